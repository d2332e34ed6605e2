"""``checkpoint_stages=auto`` and AutoBatch for a budget, from plain values: the model, the step's shape
(``StepShape``), the memory target (``MemoryTarget``).

- ``batch_for_budget``: AutoBatch on the checkpointed model for ``memory_budget`` or a simulated device
  (``plan_batch``), and what the same memory gives without checkpointing;
- ``choose``: ``auto``'s plan, and with AutoBatch its batch (``choose_plan``, ``choose_plan_and_batch``), with the log
  lines that say why; on CUDA one step confirms it (``confirm_on_cuda``).

``RunMemory`` calls them with what the trainer's hooks read off the trainer (``memory_hooks``).
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from ultralytics.utils import LOGGER, colorstr

from ..memory.device import device_memory, release, unless_oom
from ..memory.step import StepShape, batch_bytes, loop_bytes, planned_copy, step_loss, training_batch
from ..memory.tracker import cuda_peak
from ..planning.autobatch import MemoryTarget, plan_batch
from ..planning.choice import choose_plan, choose_plan_and_batch
from ..planning.compiled import choose_compiled, compiled_candidates
from ..planning.costs import Costs
from ..planning.units import NothingFits
from ..regions.settings import VANILLA, PlanSettings
from ..regions.spec import CheckpointConfigError
from ..report.summary import PREFIX

AUTOBATCH = colorstr("AutoBatch: ")
MAX_BATCH = 1024  # AutoBatch's most, as Ultralytics' check_train_batch_size


@dataclass(frozen=True)
class BudgetBatch:
    """AutoBatch's batch for a budget.

    Attributes:
        batch (int): The batch chosen (at most the training images).
        without (str): The batch the same memory gives without checkpointing, or ``none fits``.
        held (int): Bytes of the training loop's batches at ``batch``, alive beside validation.
        step (int): The chosen step's measured bytes.
    """

    batch: int
    without: str
    held: int
    step: int


@dataclass(frozen=True)
class AutoChoice:
    """``auto``'s choice.

    Attributes:
        settings (PlanSettings): The plan chosen, its loss plan included where ``auto`` weighed the loss.
        batch (int): The batch (per process) it trains at.
        lines (list[str]): The log lines that say what was weighed and why.
        costs (Costs | None): The units' measured costs, from which escalation plans (``None`` under compile: the
            candidates were measured whole).
        held (int): Bytes alive beside validation: the training loop's batches and DDP's gradient buckets.
        step (int): The chosen step's measured bytes, ``held`` included.
        compile_budget (float | None): ``compile_memory_budget`` chosen under compile; ``None``: torch's default.
        compiled (bool): Chosen by compiled measurements: the run trains with ``compile_budget``, ``None`` included
            (a ``compile_memory_budget`` given with ``auto`` would train what was not measured), and ``regions``.
        regions (str): ``compile_regions`` chosen under compile: ``graph`` or ``apart``.
    """

    settings: PlanSettings
    batch: int
    lines: list[str]
    costs: Costs | None
    held: int
    step: int
    compile_budget: float | None = None
    compiled: bool = False
    regions: str = "graph"


def auto_report(choice: Any, how: str = "measured", capped: str = "") -> list[str]:
    """Log lines for ``auto``'s choice (a ``choice.Choice``): the trade-off table of the measured candidates and the
    choice, or a single line when vanilla fits (nothing was weighed, so there is no table)."""
    measured = f"{how} {choice.measured_bytes / 2**30:.3f} GB of {choice.target_bytes / 2**30:.3f} GB"
    c = choice.candidate
    if not c.recomputes:
        return [f"auto: vanilla fits at batch {choice.batch}{capped} ({measured}): nothing recomputed"]
    what = str(c.settings)  # in the keys' own words
    timed = f", measured {choice.measured_seconds:.3f} s" if choice.measured_seconds is not None else ""
    return [*(f"  {line}" for line in choice.table()),
            f"auto chose {what} at batch {choice.batch}{capped}: {1 + c.flops / choice.base_flops:.3f}x FLOPs, "
            f"step time predicted {c.seconds:.3f} s{timed}, {measured}"]


def batch_for_budget(model: nn.Module, shape: StepShape, target: MemoryTarget, described: str,
                     images: int) -> BudgetBatch:
    """AutoBatch for ``memory_budget`` (or the simulated device) on copies of the model (probe steps would move
    BatchNorm statistics), and the batch the same memory gives without checkpointing.

    Steps are measured under the autocast dtype the run trains with (``shape.amp``), one copy at a time, each within
    the share and what the device has free, so planning itself stays inside the share it plans for. ``described``
    names the plan in the log and the error; ``images``: the training images (0: unknown), the most it chooses.
    """
    LOGGER.info(f"{AUTOBATCH}planning {target.fraction:.0%} of {target.source} at imgsz={shape.imgsz}"
                f"{f' under {shape.amp} autocast' if shape.amp else ''} from measured training steps...")
    try:
        with planned_copy(model, None) as copy:
            chosen = plan_batch(copy, shape, target.budget, target.fraction)
    except ValueError as e:
        raise CheckpointConfigError(f"{e} with {described}; raise memory_budget or lower imgsz") from None
    try:
        with planned_copy(model, VANILLA) as plain:  # without: no layer plan, Ultralytics' loss
            without = str(plan_batch(plain, shape, target.budget, target.fraction).batch)
    except ValueError:
        without = "none fits"
    batch = min(chosen.batch, images or chosen.batch)
    cap = f", capped to the {images} training images" if batch < chosen.batch else ""
    how = (f"extrapolated from steps at batches {sorted(chosen.points)} that fit the device"
           if chosen.extrapolated else "measured")
    LOGGER.info(f"{AUTOBATCH}batch {chosen.batch} with {described} ({without} without){cap}; "
                f"{how} {chosen.measured_bytes / 2**30:.2f} GB of {chosen.target_bytes / 2**30:.2f} GB, the "
                f"training loop's other batches ({chosen.loop_bytes / 2**20:.1f} MiB) included")
    held = batch_bytes(model, shape.at(batch)) + loop_bytes(model, shape.at(batch))
    return BudgetBatch(batch, without, held, chosen.measured_bytes)


def choose(model: nn.Module, shape: StepShape, target: MemoryTarget, *, autobatch: bool, images: int, buckets: int,
           loss_modes: Sequence[str], device: torch.device, compiled: bool = False, apart: bool = False) -> AutoChoice:
    """``auto``'s plan for ``shape`` (its batch per process; with ``autobatch`` the batch is chosen too, at most
    ``images`` when known) within ``target``'s share.

    ``buckets``: DDP's gradient buckets (Ultralytics wraps the model in DistributedDataParallel with its default
    ``gradient_as_bucket_view=False``, which keeps a flat copy of every gradient beside the gradients;
    tests/test_ddp.py: without them the two-rank epoch on a simulated device passes auto's share), 0 in one process.
    ``loss_modes``: the loss plans it may choose beside the layer plan. ``compiled``: the run trains under
    ``compile=True``: for a fixed batch the candidates are measured compiled (``choose_compiled``), with ``apart``
    (``compile_regions=apart`` given) the least-keeping plan compiled apart among them.
    """
    cap = min(MAX_BATCH, images) if autobatch and images else MAX_BATCH
    # The loop's other batches (step.loop_bytes): without them a plan measured right at a 0.4x share trains 1.2 MB
    # past it (tests/test_device.py). A fixed batch's plan is chosen for the share less them; AutoBatch counts them
    # at every batch it weighs (choice.choose_plan_and_batch), so here they are per image.
    loop = loop_bytes(model, shape)
    what = (f"the largest batch (at most the {cap} training images)" if autobatch and images
            else "the largest batch" if autobatch else f"batch {shape.batch}")
    less = f" less DDP's gradient buckets ({buckets / 2**20:.1f} MiB)" if buckets else ""
    less += f" less the training loop's other batches ({loop / 2**20:.1f} MiB{' per image' if autobatch else ''})"
    if compiled and not autobatch:
        return choose_under_compile(model, shape, target, target.share - buckets - loop, buckets, less, apart)
    LOGGER.info(f"{PREFIX} auto: choosing the plan with the least predicted step time that fits {target.fraction:.0%}"
                f" of {target.source}{less} at imgsz={shape.imgsz}, {what}...")
    start = time.perf_counter()
    try:
        if autobatch:
            choice = choose_plan_and_batch(model, shape, target.budget, target.fraction, max_batch=cap,
                                           loss_modes=loss_modes)
        else:
            choice = choose_plan(model, shape, target.share - buckets - loop, loss_modes=loss_modes)
    except NothingFits as e:  # say what would fit: the budget whose share covers the least-keeping plan
        # (choose_plan_and_batch's bound holds the loop's batches at its batch already)
        need = math.ceil((e.needed + buckets + (0 if autobatch else loop)) / target.fraction / 2**20)
        raise CheckpointConfigError(f"{e}: memory_budget={need}MB would fit it, or lower batch or imgsz") from None
    except ValueError as e:
        raise CheckpointConfigError(f"{e}; raise memory_budget or lower imgsz") from None
    s, chosen = choice.candidate.settings, shape.at(choice.batch)
    capped = autobatch and choice.batch == cap == images
    lines = _choice_lines(choice, f" (capped to the {cap} training images)" if capped else "",
                          time.perf_counter() - start)
    if device.type == "cuda":
        lines.append(f"{PREFIX} auto: not confirmed on {device}: the batch was extrapolated beyond what it holds"
                     if choice.extrapolated else confirm_on_cuda(device, target.share, model, s, chosen))
    # the training loop's batches beside validation: the last one trained, and those the loop holds beside it
    held = buckets + batch_bytes(model, chosen) + loop_bytes(model, chosen)
    return AutoChoice(s, choice.batch, lines, choice.costs, held,
                      choice.measured_bytes + held - batch_bytes(model, chosen))


def choose_under_compile(model: nn.Module, shape: StepShape, target: MemoryTarget, share: int, buckets: int,
                         less: str, apart: bool = False) -> AutoChoice:
    """``auto`` for a fixed batch under ``compile=True``: of compiled vanilla, our plans and compile's own
    ``activation_memory_budget`` (alone and with the plans), each measured compiled (``planning.compiled``), the
    fastest whose step fits ``share``; those expected to keep the least are measured first, and where none of them
    fits it stops with one line, the others unmeasured. ``apart``: the least-keeping plan with its regions compiled
    apart is one of those, measured inside ``regions_compiled_apart`` as the run trains it."""
    candidates = compiled_candidates(model, apart=apart)
    first = [c for c in candidates if c.least]
    order = (f"measuring compiled first the {len(first)} expected to keep the least ({'; '.join(map(str, first))}), "
             f"the other {len(candidates) - len(first)} only if one of them fits" if first
             else "measuring each compiled")
    LOGGER.info(f"{PREFIX} auto under compile=True: {len(candidates)} candidates (plans, compile_memory_budget, both) "
                f"for the fastest step that fits {target.fraction:.0%} of {target.source}{less} at "
                f"imgsz={shape.imgsz}, batch {shape.batch}; {order}...")
    start = time.perf_counter()
    try:
        choice = choose_compiled(model, shape, share, candidates)
    except NothingFits as e:
        need = math.ceil((e.needed + (target.share - share)) / target.fraction / 2**20)
        need = f"memory_budget={need}MB would fit it, or " if e.needed else ""  # 0: the device ran out, not the share
        hint = "" if apart else ", or compile_regions=apart (auto then also weighs its plan with regions apart)"
        raise CheckpointConfigError(f"{e}: {need}lower batch or imgsz{hint}") \
            from None
    c, step = choice.chosen.candidate, choice.chosen
    which = ("a plan and a budget" if c.settings != VANILLA and c.budget is not None else "a plan"
             if c.settings != VANILLA else "a budget" if c.budget is not None else "neither")
    which += ", its regions compiled apart" if c.regions == "apart" else ""
    lines = [f"{PREFIX}   {line}" for line in choice.table()]
    lines.append(f"{PREFIX} auto under compile=True chose {c} ({which}): measured compiled {step.bytes / 2**30:.3f} GB "
                 f"of {share / 2**30:.3f} GB, {step.seconds:.3f} s a step; planned in "
                 f"{time.perf_counter() - start:.1f} s ({len(choice.measured)} of {len(candidates)} candidates "
                 f"measured compiled)")
    held = buckets + batch_bytes(model, shape) + loop_bytes(model, shape)
    return AutoChoice(c.settings, shape.batch, lines, None, held, step.bytes + held - batch_bytes(model, shape),
                      c.budget, compiled=True, regions=c.regions)


def _choice_lines(choice: Any, capped: str, seconds: float) -> list[str]:
    """``auto``'s choice as log lines: its trade-off table, and what planning measured in how long."""
    how = "extrapolated from batches the device holds" if choice.extrapolated else "measured"
    lines = [f"{PREFIX} {line}" for line in auto_report(choice, how, capped)]
    if choice.costs is None:  # vanilla measured first, and it fit
        lines.append(f"{PREFIX} auto: planned in {seconds:.1f} s (vanilla's step measured at batch {choice.batch}; "
                     f"no plan needed, so no unit measured)")
        return lines
    lines.append(f"{PREFIX} auto: planned in {seconds:.1f} s ({len(choice.costs.unit) + 1} timed batch-1 steps: "
                 f"vanilla, and each unit alone in each of its modes; {len(choice.tried)} candidates measured at "
                 f"batch {choice.batch})")
    return lines


def confirm_on_cuda(device: torch.device, share: int, model: nn.Module, settings: PlanSettings,
                    shape: StepShape) -> str:
    """One measured step of ``shape`` with the chosen plan on the CUDA ``device``: the allocator's
    ``max_memory_reserved`` against the ``share`` of usable memory (tensor bytes were planned; this is what the
    allocator really takes)."""
    dev = device_memory(device)
    target = int(share * dev.margin)

    def step() -> int:  # the device bounds it: a memory error is "does not fit" (``unless_oom``), never the run's
        with planned_copy(model, settings.with_loss(None)) as m:  # the loss plan the model has
            data = training_batch(m, shape)
            with cuda_peak(device) as peak:
                step_loss(m, data, shape.amp).backward()
            return peak.reserved

    reserved = unless_oom(step, device)
    release(device)
    if reserved is None:
        return (f"{PREFIX} auto on {dev.name}: the chosen plan's step ran out of memory when confirmed (the allocator "
                f"needs more than the tensor bytes planned): escalation follows if training does too")
    verdict = "confirmed" if reserved <= target else "over the target: escalation follows an out-of-memory"
    return (f"{PREFIX} auto on {dev.name}: max_memory_reserved {reserved / 2**30:.3f} GB of {target / 2**30:.3f} GB "
            f"({verdict})")
