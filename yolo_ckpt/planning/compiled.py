"""``auto`` under ``compile=True``: candidates measured compiled, torch.compile's own memory budget one more axis.

Under compile the eager measurements mislead: inductor's partitioner decides what the compiled backward keeps, so a
plan keeps 0.71-0.78x of compiled vanilla where it keeps 0.29-0.50x eagerly, and compile's own knob
(``torch._functorch.config.activation_memory_budget``, read when a graph compiles; peak not monotonic in it) can beat
every plan. So each candidate is a pair (a plan or none, a budget or none), measured as Ultralytics' ``compile=True``
trains: the model's forward compiled (``torch.compile``, inductor), the criterion outside the graph; one step to
compile, then one step profiled (its peak from allocation records, ``memory.allocations``, the only figure for a
compiled step on CPU), then one step timed; ``torch._dynamo.reset`` around each, since candidates share the model's
class and would otherwise share a graph. ``choose_compiled`` measures first the candidates expected to keep the least
(``CompiledCandidate.least``) and stops when none of them fits; otherwise it measures the rest and takes the fastest
that fits the share.

Examples:
    >>> from yolo_ckpt.memory.step import StepShape, build_model
    >>> model = build_model("yolo11n.yaml")  # doctest: +SKIP
    >>> choice = choose_compiled(model, StepShape(320, 2), 2**30, compiled_candidates(model))  # doctest: +SKIP
    >>> choice.chosen.candidate.budget  # doctest: +SKIP
    0.3
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial

import torch
from torch import nn

from ..memory.allocations import BACKWARD_MARK, profile_step
from ..memory.device import unless_oom
from ..memory.step import StepShape, batch_bytes, planned_copy, state_bytes, training_batch
from ..regions.recompute import regions_compiled_apart
from ..regions.settings import VANILLA, PlanSettings
from .search import deepest, head_in_parts, nested_in_first_region
from .units import NothingFits

BACKEND = "inductor"
"""The backend candidates compile with: Ultralytics' ``attempt_compile``'s (``aot_eager_decomp_partition`` partitions
as inductor does, budget included, without generating code: seconds to compile where inductor took 3 minutes a
candidate for yolo11n on a 2-core CPU, docs/compile.md)."""
BUDGETS = (0.5, 0.3)
"""``activation_memory_budget`` values weighed (1.0, torch's default, is "no budget"): yolo11n at 640 px kept 393 and
339 MiB under them against compiled vanilla's 663 (issue 48's table); 0.1 kept more than 0.3."""


@dataclass(frozen=True)
class CompiledCandidate:
    """One pair ``auto`` weighs under compile.

    Attributes:
        settings (PlanSettings): The layer plan (``VANILLA``: none).
        budget (float | None): ``activation_memory_budget`` while the graph compiles; ``None``: torch's default.
        regions (str): Where the plan's regions compile: ``graph`` (in the model's one graph) or ``apart`` (each on
            its own, ``regions.recompute.regions_compiled_apart``: the key ``compile_regions``).
        least (bool): Expected to keep the least (docs/compile.md's table): measured first, and where none of those
            fits, no other is (not part of the pair's identity).
    """

    settings: PlanSettings
    budget: float | None = None
    least: bool = field(default=False, compare=False)
    regions: str = "graph"

    def __str__(self) -> str:
        plan = "compiled vanilla" if self.settings == VANILLA else f"compiled {self.settings}"
        return plan + (f" + compile_memory_budget={self.budget:g}" if self.budget is not None else "") + \
            (" + compile_regions=apart" if self.regions == "apart" else "")


@dataclass(frozen=True)
class CompiledStep:
    """A candidate's compiled training step, measured.

    Attributes:
        candidate (CompiledCandidate): What was measured.
        bytes (int): Model state, the batch, and the step's allocation peak (as ``step.step_cost`` counts a step).
        seconds (float): One warm step's wall-clock time.
    """

    candidate: CompiledCandidate
    bytes: int
    seconds: float


@dataclass(frozen=True)
class CompiledChoice:
    """``choose_compiled``'s choice.

    Attributes:
        chosen (CompiledStep): The fastest step within the target.
        measured (list[CompiledStep]): Every candidate's step, in the order measured (those expected to keep the
            least first).
        target (int): The bytes a step had to fit.
    """

    chosen: CompiledStep
    measured: list[CompiledStep]
    target: int

    def table(self) -> list[str]:
        """The measured candidates as lines: bytes, time as a multiple of compiled vanilla's, fits or not; compiled
        vanilla's row first, wherever it was measured (the first measured is the reference where vanilla was not),
        then the others in the order measured."""
        ref = next((s for s in self.measured if s.candidate == CompiledCandidate(VANILLA)), self.measured[0])
        base = ref.seconds or 1.0
        return [f"{'*' if s is self.chosen else ' '} {str(s.candidate):<70} {s.bytes / 2**20:9.1f} MiB "
                f"{s.seconds / base:6.2f}x time  {'fits' if s.bytes <= self.target else 'over'}"
                for s in (ref, *(s for s in self.measured if s is not ref))]


def compiled_candidates(model: nn.Module, budgets: Sequence[float] = BUDGETS,
                        plans: Sequence[PlanSettings] | None = None, apart: bool = False) -> list[CompiledCandidate]:
    """Compiled vanilla first (the reference), then vanilla under each budget, each plan, and each plan under each
    budget. ``plans``: by default ``all`` + ``head``, the plan that keeps the least eagerly (``search.deepest``)
    and the same with parts nested only in the stem's region, which keeps the least compiled
    (``search.nested_in_first_region``: 0.360x of eager vanilla against 0.422x, yolo11n at 640 px, batch 4).

    Marked ``least`` (measured first): that plan alone and under each budget, and vanilla under the smallest budget,
    which keeps within 1.4% of it (0.3: 0.365x; yolo11n at 640 px, docs/compile.md). A heuristic from that table:
    on the 5-layer test model (tests/support.py ``MINI``) at 64 px, batch 2, ``all`` + ``head`` keeps 1.5% less than it
    (4.41 against 4.48 MiB, the model's state most of both; ``aot_eager_decomp_partition``).

    ``apart``: also that plan with its regions compiled apart and the head layer in parts (``search.head_in_parts``),
    alone and under each budget, last and marked ``least``: it keeps the least of all (yolo11n at 640 px, batch 4,
    80 classes: 0.265x of eager vanilla's step peak, against 0.296x for ``least-stem`` apart and 0.336x in one graph,
    channels first; ``least`` apart keeps the same, slower: its nested parts recompute twice), and is slower than one
    graph; a budget also partitions each region's own graph, which keeps less again (budget 0.5: 0.237x). In a
    ``yolo-ckpt train`` run of that yolo11n with 2 classes, where the stem's region is the peak, it samples 0.306 GB
    (0.33x of eager vanilla's) at 1.32x plain Ultralytics' step CPU time (docs/compile.md, ``run_step_times.py``)."""
    deep = deepest(model)
    stem = nested_in_first_region(deep)
    if plans is None:
        plans = [PlanSettings.of("all", layers="head"), deep, stem]
    least = {(stem, b) for b in (None, *budgets)} | ({(VANILLA, min(budgets))} if budgets else set())
    pairs = [(VANILLA, None), *((VANILLA, b) for b in budgets), *((p, None) for p in plans),
             *((p, b) for p in plans for b in budgets)]
    return [*(CompiledCandidate(s, b, (s, b) in least) for s, b in pairs),
            *(CompiledCandidate(head_in_parts(deep), b, True, "apart")
              for b in ((None, *budgets) if apart else ()))]


def _compiled_step(model: nn.Module, forward: Callable, data: dict, amp: torch.dtype | None) -> Callable[[], None]:
    """Ultralytics' compiled training step: ``model.loss(batch, forward(img))``, the criterion outside the graph."""

    def step() -> None:
        model.zero_grad(set_to_none=True)
        with torch.autocast(data["img"].device.type, dtype=amp, enabled=amp is not None):
            loss, _ = model.loss(data, forward(data["img"]))
            loss = loss.sum()
        with torch.profiler.record_function(BACKWARD_MARK):
            loss.backward()
        del loss
        model.zero_grad(set_to_none=True)

    return step


def compiled_step(model: nn.Module, shape: StepShape, candidate: CompiledCandidate,
                  backend: str | None = None) -> CompiledStep:
    """One candidate's compiled step on a copy of ``model``: compiled (``backend``, by default ``BACKEND``), warmed,
    profiled, timed; an ``apart`` candidate inside ``regions_compiled_apart`` with the same backend, as the run holds
    it for every step."""
    budget = 1.0 if candidate.budget is None else candidate.budget
    backend = backend or BACKEND
    with planned_copy(model, candidate.settings) as m:
        data = training_batch(m, shape)
        torch._dynamo.reset()
        try:
            with torch._functorch.config.patch(activation_memory_budget=budget), \
                    regions_compiled_apart(backend if candidate.regions == "apart" else None):
                step = _compiled_step(m, torch.compile(m, backend=backend), data, shape.amp)
                step()  # compiles, builds the criterion
                peak = profile_step(step).peak
                start = time.perf_counter()
                step()
                seconds = time.perf_counter() - start
        finally:
            torch._dynamo.reset()
        return CompiledStep(candidate, state_bytes(m) + batch_bytes(m, shape) + peak, seconds)


def choose_compiled(model: nn.Module, shape: StepShape, target: int, candidates: Sequence[CompiledCandidate],
                    backend: str | None = None) -> CompiledChoice:
    """Of ``candidates``, each measured compiled (``compiled_step``), the fastest whose step fits ``target`` bytes.

    Those marked ``least`` are measured first: where none of them fits, the others are not measured (each compiles
    for minutes with inductor: docs/compile.md) and it stops at once.

    Raises:
        NothingFits: When none of those expected to keep the least fits, or no candidate does.
    """
    first = [c for c in candidates if c.least]
    measured = _steps(model, shape, first, backend)
    if first and not measured:
        raise NothingFits(f"checkpoint_stages=auto under compile=True: each of the {len(first)} candidates expected "
                          f"to keep the least ran out of the device's memory", 0)
    if first and all(s.bytes > target for s in measured):
        least = min(measured, key=lambda s: s.bytes)
        raise NothingFits(f"checkpoint_stages=auto under compile=True: none of the {len(first)} candidates expected "
                          f"to keep the least fits {target / 2**20:.1f} MiB (the least, {least.candidate}, measured "
                          f"{least.bytes / 2**20:.1f} MiB; the other {len(candidates) - len(first)} not measured)",
                          least.bytes)
    measured += _steps(model, shape, [c for c in candidates if not c.least], backend)
    return fastest_fitting(measured, target)


def _steps(model: nn.Module, shape: StepShape, candidates: Sequence[CompiledCandidate],
           backend: str | None) -> list[CompiledStep]:
    """``compiled_step`` of each candidate; one whose step ran out of the device's memory (a device that holds less
    than it said) is left out, as one that does not fit, never the run's end."""
    device = next(model.parameters()).device
    steps = (unless_oom(partial(compiled_step, model, shape, c, backend), device) for c in candidates)
    return [s for s in steps if s is not None]


def fastest_fitting(measured: list[CompiledStep], target: int) -> CompiledChoice:
    """Of ``measured``, the fastest step within ``target`` bytes.

    Raises:
        NothingFits: When none fits.
    """
    fitting = [s for s in measured if s.bytes <= target]
    if not measured:
        raise NothingFits("checkpoint_stages=auto under compile=True: each candidate ran out of the device's memory", 0)
    if not fitting:
        least = min(measured, key=lambda s: s.bytes)
        raise NothingFits(f"checkpoint_stages=auto under compile=True: no candidate fits {target / 2**20:.1f} MiB "
                          f"(the least, {least.candidate}, measured {least.bytes / 2**20:.1f} MiB)", least.bytes)
    return CompiledChoice(min(fitting, key=lambda s: s.seconds), measured, target)
