"""``checkpoint_stages=auto``: the plan with the least predicted step time whose measured training step fits a memory
target.

A candidate plan is a set of *units* — each backbone stage, the neck and the head layer (together
``checkpoint_layers=head``), and inside each the parts of its block layers (C3k2's ``cv1``, ``m.0``, ``cv2``; SPPF's;
Detect's branches per scale) — each
recomputed in its own mode: none, ``full`` or ``selective``. A unit's parts recomputed inside its recomputed regions
are recomputed again during the unit's recompute, which then holds one part's activations instead of the layer's
(Chen's recursive scheme); recomputed alone, they keep the unit's other layers' tensors and each part's input. Where
plans take a mode per unit, the stem (the first stage) and the stage after it are a unit of their own too, ``(1, 2)``,
one region as ``checkpoint_stages=[1,2]`` makes it (``stages.joined_stages``), which no plan takes with either
stage: it keeps no stem output, and its recompute holds both stages' tensors. A unit
and its parts are measured together, as one mode of ``UNIT_MODES`` (``"full+parts:selective"``: the stage full, each
part of it selective inside), since what the parts save depends on what holds them. The trade-off table's plans
(``Costs.mixed`` false) take one of ``full``/``selective`` for all units, neck and head layer together.
Each unit is measured once per
mode, alone, in a training step at batch 1 on a copy of the model: the bytes it stops keeping for backward, the peak
of the step's backward from the moment it reaches the unit, the FLOPs its recompute adds, and — once that bounded step
fit — its time on the run's device (a few timed steps of the same copy and batch), whose excess over the vanilla
step's is the unit's recompute time. FLOPs do not see what recompute costs on hardware (BatchNorm and SiLU recompute
is memory-bound: ``all selective`` is 1.006x the FLOPs but 1.17x the CPU step time of yolo11n at 640), times do. A
plan's FLOPs and recompute time are the sums of its units'; its peak is predicted as the largest of the vanilla
forward and backward peaks less every unit's saving, and of each unit's backward window less the savings of the units
before it (only those still hold their tensors then) — within about 10% of the measured step. Candidates are tried
least predicted step time first: those predicted to fit until one is measured to (a real step at the run's batch and
imgsz, on a copy), then those predicted just over but faster, so the choice always rests on a measurement and the
training model never runs; the choice's step is then timed at the run's batch.

The loss is a unit too where the run allows it (``loss.auto_loss_modes``): ``checkpoint_loss=exact`` (each image's
mask loss a region, bit for bit) for instance segmentation, and ``chunked`` where the user wrote it. Its step alone is
measured as the units' are, and a plan is its units with the loss plan or without it; a plan that keeps the loss
plan recomputes the criterion after every unit (its backward runs first, while every unit still holds what it keeps).

With AutoBatch (``batch=-1`` or a fraction) the plan measured to keep the least (among those predicted to) sets the
largest batch (``plan_batch``), and the fastest plan that fits at that batch is chosen.

Memory is counted as ``plan_batch`` counts a step: model state, the batch on the device and the exact step peak; the
target a step must fit is the share less the batches the training loop holds beside it (``step.loop_bytes``).

No probe passes what it may use (``autobatch.ProbeRoom``: the share, and what the device has free): the vanilla step
and the fixed part (model state, the batch) are computed or predicted, a step is measured only under that limit, and a
step that reaches it stops there and counts as "does not fit". When the device is smaller than the share (a
``memory_budget`` bigger than the device), a candidate is confirmed by ``plan_batch``'s steps that fit the device,
extrapolated to the batch.

Examples:
    >>> from yolo_ckpt.memory.step import StepShape, build_model
    >>> choice = choose_plan(build_model("yolov8n.yaml"), StepShape(128, 2), target=200 * 2**20)
    >>> choice.plan.describe(), choice.measured_bytes <= 200 * 2**20  # doctest: +SKIP
    ('stages [1, 2] selective', True)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from torch import nn

from ..memory.device import unless_oom
from ..memory.step import StepShape, batch_bytes, grad_bytes, loop_bytes, probe_step, state_bytes
from ..regions.plan import CheckpointPlan
from .autobatch import BatchPlan, ProbeRoom, plan_batch, probe_room
from .costs import Costs, time_candidate, unit_costs
from .search import candidates, no_recompute
from .units import Candidate, NothingFits, describe, is_joined

MAX_MEASURED = 16  # candidates measured at most before falling back to those predicted to keep the least
MARGIN = 0.1  # predictions are within about 10% of measured steps: measure candidates predicted up to this much over


@dataclass(frozen=True)
class BatchFit:
    """A plan and the batch ``plan_batch`` sized with it: the largest at which its step (with the training loop's other
    batches) fits the share."""

    candidate: Candidate
    sizing: BatchPlan

    @property
    def batch(self) -> int:
        return self.sizing.batch

    @property
    def step_bytes(self) -> int:
        """Its step at that batch (model state, batch, step peak), without the loop's batches, as planning counts
        steps."""
        return self.sizing.measured_bytes - self.sizing.loop_bytes

    @property
    def extrapolated(self) -> bool:
        return self.sizing.extrapolated


@dataclass(frozen=True)
class Tried:
    """A measured candidate: its step bytes, or ``None`` when the probe stopped at its limit (does not fit)."""

    candidate: Candidate
    measured: int | None


@dataclass
class Choice:
    """What ``choose_plan`` chose, and what it measured on the way.

    Attributes:
        candidate (Candidate): The chosen plan.
        plan (CheckpointPlan): Its regions on the model.
        batch (int): The batch it was measured at.
        measured_bytes (int): Its measured step (model state, batch, step peak); extrapolated when ``extrapolated``.
        target_bytes (int): The memory it had to fit.
        base_flops (int): FLOPs of the vanilla step at ``batch``, for ratios (0 where no unit was measured).
        tried (list[Tried]): Every measured candidate, in order.
        alternatives (list[Candidate]): The next cheapest candidates predicted to fit, for the trade-off table.
        costs (Costs | None): The unit costs the choice rests on (escalation reuses them); ``None`` where vanilla
            was measured first and fit, so that no unit was measured.
        extrapolated (bool): The device is smaller than the target: steps were extrapolated from batches it holds.
        measured_seconds (float | None): The chosen plan's step time at ``batch``, timed once its step was measured
            to fit (``None`` when extrapolated: the device does not hold that batch; and for vanilla, where nothing
            was traded for memory).
    """

    candidate: Candidate
    plan: CheckpointPlan
    batch: int
    measured_bytes: int
    target_bytes: int
    base_flops: int
    tried: list = field(default_factory=list)
    alternatives: list = field(default_factory=list)
    costs: Costs | None = None
    extrapolated: bool = False
    measured_seconds: float | None = None

    def table(self) -> list[str]:
        """Trade-off lines for the log: each measured candidate and the next alternatives, step time (predicted,
        and measured for the choice) next to memory (predicted, measured) and FLOPs; none when vanilla fit (nothing
        was traded)."""
        if not self.candidate.recomputes:
            return []
        listed = [*self.tried, *(Tried(a, None) for a in self.alternatives)]
        w = max(48, *(len(describe(t.candidate)) + 2 for t in listed))  # per-unit modes make long names
        rows = [f"{'plan':<{w}}{'FLOPs':>8}{'predicted s':>13}{'measured s':>12}{'predicted GB':>14}"
                f"{'measured GB':>13}"]
        seen = set()
        for t in listed:
            c = t.candidate
            if c.key in seen:
                continue
            seen.add(c.key)
            mark = " <- chosen" if c == self.candidate else ""
            measured = self.measured_bytes if mark else t.measured
            tried = any(x.candidate == c for x in self.tried)
            shown = f"{measured / 2**30:.3f}" if measured is not None else "over" if tried else "-"
            timed = f"{self.measured_seconds:.3f}" if mark and self.measured_seconds is not None else "-"
            rows.append(f"{describe(c):<{w}}{1 + c.flops / self.base_flops:>7.3f}x{c.seconds:>13.3f}{timed:>12}"
                        f"{c.predicted_bytes / 2**30:>14.3f}{shown:>13}{mark}")
        return rows


@dataclass(frozen=True)
class Over:
    """A plan's step that did not fit ``target`` bytes (its probe stopped at that limit, or at the device)."""

    target: int


def measure_candidate(model: nn.Module, c: Candidate, shape: StepShape, target: int | None) -> tuple[int | None, bool]:
    """``c``'s step of ``shape`` on a copy, within the target and the device: ``(bytes or None, extrapolated)``
    (``measure_copy`` on ``c.copy(model)``). The copy itself, and the dry run that resolves its parts, may not fit a
    device that holds less than it said: that too is "does not fit"."""
    def measure() -> tuple[int | None, bool]:
        with c.copy(model) as m:
            return measure_copy(m, shape, target)

    got = unless_oom(measure, next(model.parameters()).device)
    return (None, False) if got is None else got


def measure_copy(m: nn.Module, shape: StepShape, target: int | None) -> tuple[int | None, bool]:
    """The step of ``shape`` of a planning copy ``m`` (any plan installed), within the target and the device:
    ``(bytes or None, extrapolated)``.

    ``None``: the probe stopped at its limit, so the plan does not fit. When the device holds less than ``target``,
    the step is ``plan_batch``'s, up to ``shape.batch``, extrapolated from batches the device holds. ``target`` is
    step bytes (the caller takes the training loop's other batches off it); ``target=None``: what the device holds
    now, less the optimizer's moments and the training loop's other batches at ``shape.batch``, is the target
    (escalation, with the training state resident).
    """
    room = probe_room(m, target)
    if target is None:  # the optimizer's moments appear at the first step: keep room for them (AdamW: two)
        # and for the training loop's other batches, released with the failed step (``step.loop_bytes``)
        less = 2 * grad_bytes(m) + loop_bytes(m, shape)
        free = None if room.device is None else room.device - less
        room = ProbeRoom(free, free)  # no device limit: no target either
    if room.device is None or room.target is None or room.device >= room.target:
        got = probe_step(m, shape, room.limit)
        return got, False
    try:
        p = plan_batch(m, shape, room.target, 1.0, max_batch=shape.batch, loop=False)
    except ValueError:
        return None, False
    return (p.measured_bytes if p.batch >= shape.batch else None), p.extrapolated


def choose_plan(model: nn.Module, shape: StepShape, target: int, costs: Costs | None = None,
                measured: dict | None = None, sized: BatchFit | None = None, loss_modes: tuple = ()) -> Choice:
    """The candidate with the least predicted step time whose measured step of ``shape`` fits ``target`` bytes; its
    step is then timed at ``shape.batch`` (``Choice.measured_seconds``) on a copy, in the memory just measured.

    Args:
        model: The model as it will train, plain (frozen layers already frozen), on its device.
        shape: The training step: image size, batch, objects per image and the run's autocast dtype.
        target: Bytes the step (model state, batch, step peak) must fit.
        costs: ``unit_costs`` of this model, when already measured. Without them the vanilla step is measured first,
            and the units (a batch-1 step per unit and mode) only where it does not fit: vanilla is the fastest plan,
            so where it fits nothing else need be known.
        measured: Steps already measured on this model at ``shape.imgsz`` (``(units, modes, batch)`` keys, vanilla's
            units ``()``; ``Over`` values did not fit the target they were measured for), filled in as it measures,
            so that choosing for several targets measures each plan once (again only for a target larger than the
            one it did not fit).
        sized: The plan whose step set ``shape.batch`` (``choose_plan_and_batch``), known to fit ``target`` there: taken
            when it is faster than every candidate measured to fit, or when none is, so that a batch set by a plan is
            never refused.
        loss_modes: The loss plans it may choose beside the layer plan (``install.auto_loss_modes``; ``unit_costs``).

    Raises:
        NothingFits: One line when not even the plan that keeps the least fits, with a bound on what it needs.
    """
    batch = shape.batch
    fixed = state_bytes(model) + batch_bytes(model, shape)
    probe = _Probe(model, shape, target, costs, {} if measured is None else measured)
    if costs is None:  # vanilla first: where its step fits, no unit need be measured (57 steps on yolo11n)
        plain = Candidate((), (), 0, 0, loss="none" if loss_modes else None)
        if (got := probe.fits(plain)) is not None:
            return probe.choice(plain, got, [])
        costs = probe.costs = unit_costs(model, shape, loss_modes)
        probe.tried[-1] = Tried(no_recompute(costs, batch, fixed), None)  # over, with its predicted bytes now
    else:
        plain = no_recompute(costs, batch, fixed)
        if plain.predicted_bytes <= target * (1 + MARGIN) and (got := probe.fits(plain)) is not None:
            return probe.choice(plain, got, [])
    ranked = candidates(costs, batch, fixed)
    fitting = [c for c in ranked if c.predicted_bytes <= target * (1 + MARGIN)]
    best = _fastest_fitting(fitting, target, probe.fits, len(probe.tried))
    if sized is not None:  # the same plan at this batch (its bytes and time predicted here)
        known = next(c for c in ranked if c.key == sized.candidate.key)
        if best is None or known.seconds < best[0].seconds:
            probe.extrapolated |= sized.extrapolated
            probe.tried.append(Tried(known, sized.step_bytes))
            best = (known, sized.step_bytes)
    if best:
        return probe.choice(*best, [a for a in fitting if a.seconds >= best[0].seconds and a != best[0]][:3])
    least_first = sorted(ranked, key=lambda c: (c.predicted_bytes, -c.flops))  # ``least_keeping`` first
    for c in least_first[:3]:
        if all(c != t.candidate for t in probe.tried) and (got := probe.fits(c)) is not None:
            return probe.choice(c, got, [])
    least = min(probe.tried, key=lambda t: (t.measured is None, t.measured or 0, t.candidate.predicted_bytes))
    needed = needed_bytes(model, least.candidate, shape)
    raise NothingFits(f"checkpoint_stages=auto: nothing fits {target / 2**30:.3f} GB at batch {batch}, imgsz "
                      f"{shape.imgsz}; the plan that keeps the least ({describe(least.candidate)}) needs at most "
                      f"{needed / 2**30:.3f} GB", needed)


@dataclass
class _Probe:
    """The candidates one ``choose_plan`` call measures, at one batch for one target: what it tried, and whether a
    step had to be extrapolated (then the choice is not timed)."""

    model: nn.Module
    shape: StepShape
    target: int
    costs: Costs | None
    measured: dict
    tried: list[Tried] = field(default_factory=list)
    extrapolated: bool = False

    def fits(self, c: Candidate) -> int | None:
        """``c``'s measured step bytes where they fit the target, else ``None``; each plan measured once per batch
        (again only for a target larger than one it did not fit)."""
        key = (*c.key, self.shape.batch)
        got = self.measured.get(key)
        if got is None or isinstance(got, Over) and got.target < self.target:  # a larger target may hold it
            got, extra = measure_candidate(self.model, c, self.shape, self.target)
            got = self.measured[key] = Over(self.target) if got is None else got
            self.extrapolated |= extra
        got = None if isinstance(got, Over) else got
        self.tried.append(Tried(c, got))
        return got if got is not None and got <= self.target else None

    def choice(self, c: Candidate, got: int, later: list[Candidate]) -> Choice:
        """``c`` chosen, its step timed at the batch on a copy unless a step was extrapolated or it recomputes
        nothing (nothing was traded for memory: no time is reported)."""
        timed = c.recomputes and not self.extrapolated
        seconds = time_candidate(self.model, c, self.shape) if timed else None
        batch = self.shape.batch
        flops = 0 if self.costs is None else batch * self.costs.plain.flops
        return Choice(c, c.plan(self.model), batch, got, self.target, flops, self.tried, later, self.costs,
                      self.extrapolated, seconds)


def _fastest_fitting(fitting: list[Candidate], target: int, measure: Callable[[Candidate], int | None],
                     done: int) -> tuple[Candidate, int] | None:
    """The fastest of ``fitting`` (fastest first, predicted within ``MARGIN`` of ``target``) measured to fit, with
    its bytes, measuring at most ``MAX_MEASURED`` (``done`` already): first those predicted to fit, fastest first,
    until one does; then those predicted just over, but faster than it (a prediction may be that far off)."""
    best = None
    for c in (c for c in fitting if c.predicted_bytes <= target):
        if done >= MAX_MEASURED:
            break
        done += 1
        if (got := measure(c)) is not None:
            best = (c, got)
            break
    for c in (c for c in fitting if c.predicted_bytes > target):
        if done >= MAX_MEASURED or best is not None and c.seconds >= best[0].seconds:
            break
        done += 1
        if (got := measure(c)) is not None:
            return c, got
    return best


LEAST_MEASURED = 4  # candidates predicted to keep the least that ``measured_least`` measures


def least_candidates(ranked: list[Candidate]) -> list[Candidate]:
    """The ``LEAST_MEASURED`` plans ``measured_least`` measures, of ``ranked`` (least predicted bytes first): the first
    half with the stem in stage 2's region (a ``(1, 2)`` unit) and the first half with it apart, the first of the rest
    where one kind has too few. The prediction adds up units measured alone at batch 1, and the stem's region grows
    with the batch unlike the plans around it: the first ten on yolo26n-sem at 1024 px all join it."""
    half = LEAST_MEASURED // 2
    kinds = [[c for c in ranked if _stem_joined(c) is joined][:half] for joined in (True, False)]
    chosen = [*kinds[0], *kinds[1]]
    rest = [c for c in ranked if c not in chosen][:LEAST_MEASURED - len(chosen)]
    return sorted([*chosen, *rest], key=ranked.index)


def _stem_joined(c: Candidate) -> bool:
    return any(is_joined(u) for u in c.units)


def measured_least(model: nn.Module, costs: Costs, shape: StepShape) -> Candidate:
    """The plan that keeps the least among the layer plans ``least_candidates`` takes of those predicted to keep the
    least at ``shape``, each measured in a real step at ``shape.batch`` (the run's) on a copy, within the device: the
    prediction adds up each unit's measured bytes and can rank close plans the wrong way round, and memory is not linear
    in the batch (on yolo26n-sem at 1024 px, 4 classes, ``chunked``, the stem in stage 2's region keeps less than stage
    1 apart at batch 1, 203.1 against 212.3 MiB, and more at batch 2, 375.1 against 311.1 MiB). A tie, or nothing
    measured (none fits the device at that batch): the prediction's order."""
    ranked = sorted(candidates(costs, shape.batch, 0, loss=False), key=lambda c: (c.predicted_bytes, -c.flops))
    measured = []
    for rank, c in enumerate(least_candidates(ranked)):
        got, _ = measure_candidate(model, c, shape, None)
        if got is not None:
            measured.append((got, rank, c))
    return min(measured, key=lambda m: m[:2])[2] if measured else ranked[0]


def needed_bytes(model: nn.Module, c: Candidate, shape: StepShape) -> int:
    """An upper bound on ``c``'s step of ``shape``, from its step at batch 1 (memory is ``a·b + c`` with ``c >= 0``),
    so that a budget said to fit it does."""
    with c.copy(model) as m:
        one = probe_step(m, shape.at(1), probe_room(m).limit)
        static = state_bytes(m)
    if one is None:
        raise NothingFits(f"checkpoint_stages=auto: not even batch 1 of {describe(c)} fits the device at imgsz "
                          f"{shape.imgsz}", 0)
    return static + shape.batch * (one - static)


def choose_plan_and_batch(model: nn.Module, shape: StepShape, budget: int, fraction: float, max_batch: int = 1024,
                          loss_modes: tuple = (), costs: Costs | None = None) -> Choice:
    """AutoBatch with ``auto``: the largest batch any plan allows (at most ``max_batch``: Ultralytics caps AutoBatch at
    the training images), then the fastest plan (least predicted step time) that fits at that batch. ``shape``: the
    step's image size, objects per image and autocast dtype; its ``batch`` is not read (the batch is what this
    chooses).

    The plans predicted to keep about the least are measured at the batch the first of them allows; the one measured
    to keep the least sets the batch (``plan_batch``), and is the choice there unless a faster plan is measured to fit
    (predictions at that batch may miss it: it is never refused). At every batch the training loop's other batches
    (``step.loop_bytes``) count against the share, as ``plan_batch`` counts them: the choice's ``target_bytes``
    is the share less them, at its batch, as for a fixed batch. ``loss_modes``: the loss plans it may choose
    (``choose_plan``); ``costs``: this model's ``unit_costs`` at ``shape.imgsz`` with those loss plans, when already
    measured.

    Raises:
        ValueError: When not even batch 1 fits with the plan that keeps the least.
    """
    costs = costs or unit_costs(model, shape, loss_modes)
    ranked = sorted(candidates(costs, 1, 0), key=lambda c: (c.predicted_bytes, c.seconds))
    near = [c for c in ranked if c.predicted_bytes <= ranked[0].predicted_bytes * (1 + MARGIN)][:MAX_MEASURED]
    target = int(fraction * budget)

    def largest(c: Candidate) -> BatchPlan:
        with c.copy(model) as m:
            return plan_batch(m, shape, budget=budget, fraction=fraction, max_batch=max_batch)

    def step_target(batch: int) -> int:  # the share less the loop's other batches at ``batch``
        return target - loop_bytes(model, shape.at(batch))

    try:
        first = largest(near[0])
    except ValueError:
        raise ValueError(f"checkpoint_stages=auto: not even batch 1 fits {fraction:.0%} of {budget / 2**30:.3f} GB at "
                         f"imgsz {shape.imgsz} with {describe(near[0])}") from None
    sizes = {}  # the plans predicted to keep about the least, measured at that batch: the least sets the batch
    measured = {}  # the same steps for ``choose_plan`` (a plan that did not fit there is not measured again)
    for c in near:
        got, extra = measure_candidate(model, c, shape.at(first.batch), step_target(first.batch))
        if not extra:  # an extrapolated step is measured again there, so that the choice says it is one
            measured[(*c.key, first.batch)] = Over(step_target(first.batch)) if got is None else got
        if got is not None:
            sizes[c] = got
    least = min(sizes, key=lambda c: (sizes[c], c.seconds)) if sizes else near[0]
    sized = BatchFit(near[0], first)
    if least != near[0] and first.batch < max_batch and (second := largest(least)).batch > first.batch:
        sized = BatchFit(least, second)
    # ``sized`` fits there (its step is one ``plan_batch`` measured, or extrapolated, within the share less the
    # loop's batches), so ``choose_plan`` never refuses that batch
    return choose_plan(model, shape.at(sized.batch), step_target(sized.batch), costs, measured, sized, loss_modes)
