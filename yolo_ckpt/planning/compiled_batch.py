"""AutoBatch under ``compile=True``: the batch chosen from eager steps, confirmed by the run's compiled step.

AutoBatch (``autobatch.plan_batch``, ``choice.choose_plan_and_batch``) sizes the batch from eager steps, and a
``compile=True`` run trains compiled, where inductor's partitioner decides what the backward keeps: a plan's compiled
step keeps more or less than its eager one (yolo11n at 640 px, batch 4: the least-keeping plan 0.422x of eager
vanilla compiled, 0.273x eagerly; docs/compile.md). So the chosen batch's compiled step is measured as the run will
compile it (``compiled.compiled_step``: the run's plan, its ``compile_memory_budget`` and ``compile_regions``,
``compiled.BACKEND``), and while it passes the step target (the share less the training loop's other batches at that
batch, ``step.loop_bytes``, as AutoBatch counts them) the batch halves, as Ultralytics' own out-of-memory retry does.
Halving needs no model of how compiled memory grows with the batch (the partitioner may save differently at each
batch), and it stops within ``log2(batch)`` compiles: each takes minutes with inductor.

Examples:
    >>> from yolo_ckpt.memory.step import StepShape, build_model
    >>> from yolo_ckpt.regions.settings import VANILLA
    >>> model = build_model("yolo11n.yaml")  # doctest: +SKIP
    >>> confirmed = confirm_batch(model, StepShape(640, 1), 16, 2**30, CompiledCandidate(VANILLA))  # doctest: +SKIP
    >>> confirmed.batch <= 16  # doctest: +SKIP
    True
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

from torch import nn

from ..memory.device import unless_oom
from ..memory.step import StepShape, loop_bytes
from . import compiled
from .compiled import CompiledCandidate
from .units import NothingFits


@dataclass(frozen=True)
class ConfirmedBatch:
    """The batch whose compiled step fits its target, and the steps measured on the way.

    Attributes:
        chosen (int): AutoBatch's batch, from eager steps.
        measured (tuple[tuple[int, int | None, int], ...]): ``(batch, compiled step bytes, target bytes)`` in the
            order measured, halving from ``chosen`` (``None``: it ran out of the device's memory); the last one fits.
    """

    chosen: int
    measured: tuple[tuple[int, int, int], ...]

    @property
    def batch(self) -> int:
        """The batch the run trains at."""
        return self.measured[-1][0]

    @property
    def bytes(self) -> int:
        """Its compiled step: model state, the batch and the step's allocation peak (``compiled.CompiledStep``)."""
        return self.measured[-1][1]

    def line(self) -> str:
        """What was confirmed compiled, for the log."""
        batch, got, target = self.measured[-1]
        fits = f"{_size(got)} of {_size(target)}"
        if batch == self.chosen:
            return f"batch {batch} confirmed compiled: {fits}"
        over = ", ".join(f"batch {b} {_size(g) if g is not None else 'out of memory'} of {_size(t)}"
                         for b, g, t in self.measured[:-1])
        return (f"batch {self.chosen}, chosen from eager steps, is over compiled ({over}): halved to {batch}, "
                f"confirmed compiled: {fits}")


def confirm_batch(model: nn.Module, shape: StepShape, batch: int, share: int, candidate: CompiledCandidate,
                  backend: str | None = None) -> ConfirmedBatch:
    """``batch``, halved until the compiled step of ``candidate`` (the run's plan, budget and regions) fits.

    Args:
        model: The model as it will train, plain, on its device.
        shape: The step's image size, objects per image and autocast dtype (its ``batch`` is not read).
        batch: AutoBatch's batch, chosen from eager steps.
        share: Bytes a training step may use, with the training loop's other batches (``MemoryTarget.share``).
        candidate: What the run compiles.
        backend: What it compiles with (by default ``compiled.BACKEND``, Ultralytics').

    Raises:
        NothingFits: When batch 1's compiled step does not fit either; ``needed`` is that step with the loop's
            batches, the share that would hold it (0 where the device ran out: no budget would help).
    """
    measured = []
    device = next(model.parameters()).device
    while True:
        at = shape.at(batch)
        # a device that holds less than it said may stop the probe: "over", never the run's end
        step = unless_oom(partial(compiled.compiled_step, model, at, candidate, backend), device)
        target = share - loop_bytes(model, at)
        got = step.bytes if step is not None else None
        measured.append((batch, got, target))
        if got is not None and got <= target:
            return ConfirmedBatch(measured[0][0], tuple(measured))
        if batch == 1 and got is None:
            raise NothingFits(f"batch 1's compiled step ({candidate}) ran out of the device's memory", 0)
        if batch == 1:
            raise NothingFits(f"batch 1's compiled step ({candidate}) measured {_size(got)}, over "
                              f"{_size(target)} ({len(measured)} compiled steps measured, halving from batch "
                              f"{measured[0][0]})", got + loop_bytes(model, at))
        batch //= 2


def _size(n: int) -> str:
    """Bytes for the log: GB from 1 GB up, MiB below (a small model's steps would all read 0.01 GB)."""
    return f"{n / 2**30:.2f} GB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"
