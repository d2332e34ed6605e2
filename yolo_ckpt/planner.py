"""``checkpoint_stages=auto``: the plan with the least recompute whose measured training step fits a memory target.

A candidate plan is a set of *units* — each backbone stage, and the head (``checkpoint_layers=head``) — recomputed
``full`` or ``selective``. Each unit is measured once, alone, in a training step at batch 1 on a copy of the model:
the bytes it stops keeping for backward, the peak of the step's backward from the moment it reaches the unit, and the
FLOPs its recompute adds. A plan's FLOPs are the sum of its units'; its peak is predicted as the largest of the
vanilla forward and backward peaks less every unit's saving, and of each unit's backward window less the savings of
the units before it (only those still hold their tensors then) — within about 10% of the measured step. Candidates
are tried cheapest first: each predicted to fit is measured (a real step at the run's batch and imgsz, on a copy) and
the first that fits is the choice, so the choice always rests on a measurement and the training model never runs.

With AutoBatch (``batch=-1`` or a fraction) the plan measured to keep the least (among those predicted to) sets the
largest batch (``plan_batch``), and the cheapest plan that fits at that batch is chosen.

Memory is counted as ``plan_batch`` counts it: model state, the batch on the device and the exact step peak.

No probe passes what it may use (``autobatch.ProbeRoom``: the share, and what the device has free): the vanilla step
and the fixed part (model state, the batch) are computed or predicted, a step is measured only under that limit, and a
step that reaches it stops there and counts as "does not fit". When the device is smaller than the share (a
``memory_budget`` bigger than the device), a candidate is confirmed by ``plan_batch``'s steps that fit the device,
extrapolated to the batch.

Example:
    >>> from yolo_ckpt.measure import build_model
    >>> choice = choose_plan(build_model("yolov8n.yaml"), imgsz=128, batch=2, target=200 * 2**20)
    >>> choice.plan.describe(), choice.measured_bytes <= 200 * 2**20  # doctest: +SKIP
    ('stages [1, 2] selective', True)
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from .autobatch import BatchPlan, ProbeRoom, plan_batch, probe_room
from .device import MemoryLimit, unless_oom
from .measure import (
    FlopCount,
    batch_bytes,
    grad_bytes,
    planned_copy,
    probe_step,
    state_bytes,
    step_loss,
    training_batch,
)
from .recompute import MODES
from .stages import CheckpointPlan, model_stages

HEAD = "head"  # the unit of every layer after the backbone that stores activations (``checkpoint_layers=head``)
MAX_MEASURED = 16  # candidates measured at most before falling back to those predicted to keep the least
MARGIN = 0.1  # predictions are within about 10% of measured steps: measure candidates predicted up to this much over


class NothingFits(ValueError):
    """No candidate plan's measured step fits the target; ``needed`` bounds what the plan that keeps the least needs."""

    def __init__(self, message: str, needed: int):
        super().__init__(message)
        self.needed = needed


@dataclass(frozen=True)
class Candidate:
    """One plan: units recomputed in one mode, with its recompute FLOPs and predicted bytes at the run's batch.

    Attributes:
        units (tuple): Stage numbers, and ``"head"`` last if the head is recomputed; ``()`` is vanilla.
        mode (str): ``full`` or ``selective``.
        flops (int): Convolution/matmul FLOPs the recompute adds to a step at the run's batch.
        predicted_bytes (int): Vanilla step bytes at the run's batch minus the units' measured savings.
        head (tuple): The head's layer regions as ``[first, last]`` ranges, resolved once per model (``Costs.head``):
            ``checkpoint_layers=head`` finds them with a training-mode dry run, which planning copies need not repeat.
    """

    units: tuple
    mode: str
    flops: int
    predicted_bytes: int
    head: tuple | None = None

    @property
    def settings(self) -> dict:
        """The training arguments of this plan."""
        stages = [u for u in self.units if u != HEAD]
        return {"checkpoint_stages": stages, "checkpoint_layers": HEAD if HEAD in self.units else [],
                "checkpoint_mode": self.mode}

    @property
    def layers(self) -> Any:
        """``checkpoint_layers`` as planning installs it: the head's resolved ranges where known."""
        if HEAD not in self.units:
            return None
        return [list(r) for r in self.head] if self.head is not None else HEAD

    def plan(self, model: nn.Module) -> CheckpointPlan:
        """The ``CheckpointPlan`` of this candidate on ``model``."""
        return CheckpointPlan.from_spec(model, self.settings["checkpoint_stages"], self.layers)

    @contextmanager
    def copy(self, model: nn.Module) -> Iterator[nn.Module]:
        """A copy of ``model`` with this plan installed, for the block (``measure.planned_copy``)."""
        with planned_copy(model, self.settings["checkpoint_stages"], self.mode, self.layers) as m:
            yield m


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
        base_flops (int): FLOPs of the vanilla step at ``batch``, for ratios.
        tried (list[Tried]): Every measured candidate, in order.
        alternatives (list[Candidate]): The next cheapest candidates predicted to fit, for the trade-off table.
        costs (Costs | None): The unit costs the choice rests on (escalation reuses them).
        extrapolated (bool): The device is smaller than the target: steps were extrapolated from batches it holds.
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

    def table(self) -> list[str]:
        """Trade-off lines for the log: each measured candidate and the next alternatives; none when vanilla fit
        (nothing was traded)."""
        if not self.candidate.units:
            return []
        rows = [f"{'plan':<40}{'FLOPs':>8}{'predicted GB':>14}{'measured GB':>13}"]
        seen = set()
        for t in [*self.tried, *(Tried(a, None) for a in self.alternatives)]:
            c = t.candidate
            if (c.units, c.mode) in seen:
                continue
            seen.add((c.units, c.mode))
            mark = " <- chosen" if c == self.candidate else ""
            measured = self.measured_bytes if mark else t.measured
            tried = any(x.candidate == c for x in self.tried)
            shown = f"{measured / 2**30:.3f}" if measured is not None else "over" if tried else "-"
            rows.append(f"{describe(c):<40}{1 + c.flops / self.base_flops:>7.3f}x{c.predicted_bytes / 2**30:>14.3f}"
                        f"{shown:>13}{mark}")
        return rows


def describe(c: Candidate) -> str:
    """``stages [1, 2] + head selective``, or ``none``."""
    stages = [u for u in c.units if u != HEAD]
    parts = ([f"stages {stages}"] if stages else []) + (["head"] if HEAD in c.units else [])
    return " + ".join(parts) + (f" {c.mode}" if c.mode == "selective" else "") if parts else "none"


@dataclass(frozen=True)
class Phases:
    """Exact bytes of one training step at batch 1 (``_phases``), and its FLOPs.

    Attributes:
        kept (int): Alive after the loss: kept for backward.
        forward (int): Peak until then (forward and loss).
        backward (int): Peak during backward.
        window (int): Peak from the moment backward reaches the unit's last layer to its end (the whole backward for
            the head and for vanilla).
        flops (int): Convolution/matmul FLOPs of the step, recompute included.
    """

    kept: int
    forward: int
    backward: int
    window: int
    flops: int


def _phases(model: nn.Module, batch: dict, amp: torch.dtype | None, last: int | None, limit: int | None) -> Phases:
    """Measure ``Phases`` of a step of ``model`` that may allocate at most ``limit`` bytes."""
    model.zero_grad(set_to_none=True)
    hooks = []
    tracker = MemoryLimit(limit if limit is not None else 2**62, "device room", device=False)
    with FlopCount() as counter, tracker:
        marks = {}

        def mark(m: nn.Module, args: Any, out: Any) -> None:  # backward reaches this output: start the window
            if isinstance(out, torch.Tensor) and out.requires_grad:
                out.register_hook(lambda g: marks.setdefault("bwd", tracker.peak) and tracker.reset_peak())

        if last is not None:
            hooks.append(model.model[last].register_forward_hook(mark))
        try:
            loss = step_loss(model, batch, amp)
            kept, forward = tracker.current, tracker.peak
            tracker.reset_peak()
            loss.backward()
            del loss
        finally:
            for h in hooks:
                h.remove()
            model.zero_grad(set_to_none=True)
        window = tracker.peak
    return Phases(kept, forward, max(marks.get("bwd", 0), window), window, counter.flops)


@dataclass(frozen=True)
class Costs:
    """Measured at batch 1, plain and per unit alone (per ``(unit, mode)``).

    Attributes:
        units (list): Stage numbers in forward order, then ``"head"`` (units whose batch-1 step did not fit the device
            are left out).
        plain (Phases): The vanilla step.
        unit (dict): ``(unit, mode) -> Phases`` with only that unit recomputed.
        grads (int): Bytes of the parameter gradients, which backward peaks hold at most and which no batch scales.
        head (tuple | None): The head's regions as ``(first, last)`` ranges (``Candidate.head``).
    """

    units: list
    plain: Phases
    unit: dict
    grads: int = 0
    head: tuple | None = None

    def predict(self, units: tuple, mode: str, batch: int) -> tuple[int, int]:
        """Predicted (step peak bytes, extra FLOPs) of recomputing ``units`` in ``mode`` at ``batch``.

        The forward peak falls by every unit's saving; a unit's backward runs while only the units before it still
        hold their kept tensors, so its backward peak falls by their savings alone; FLOPs add up. Activations scale
        with the batch, parameter gradients do not: at small images they are much of a batch-1 backward peak.
        """
        p = self.plain
        less = {u: p.kept - self.unit[(u, mode)].kept for u in units}

        def backward(peak: int) -> int:
            return batch * max(peak - self.grads, 0) + self.grads

        peaks = [batch * (p.forward - sum(less.values())), backward(p.backward - sum(less.values()))]
        for u in units:  # from u's backward on, only the units before it still hold what they keep
            before = sum(less[v] for v in units if self.units.index(v) < self.units.index(u))
            peaks.append(backward(self.unit[(u, mode)].window - before))
        extra = sum(self.unit[(u, mode)].flops - p.flops for u in units)
        return max(peaks), batch * extra


def _unit_phases(model: nn.Module, c: Candidate, imgsz: int, objects: int, amp: torch.dtype | None,
                 last: int | None) -> Phases | None:
    """``Phases`` of ``c``'s step at batch 1 on a copy within what the device has free, ``None`` when it does not
    fit. A function of its own so that the copy is gone when it returns, before the next one is made (a ``with``
    in a loop keeps the last copy bound to its name until then)."""
    with c.copy(model) as m:
        room = probe_room(m, 2**62).device  # step bytes the device holds for a probe now
        data = training_batch(m, imgsz, 1, objects)
        limit = None if room is None else room - state_bytes(m) - batch_bytes(m, imgsz, 1, objects)
        return unless_oom(lambda: _phases(m, data, amp, last, limit), next(model.parameters()).device)


def unit_costs(model: nn.Module, imgsz: int, objects: int = 50, amp: torch.dtype | None = None) -> Costs:
    """Measure the plain step and each unit alone, in each mode, at batch 1 (on copies of the model), each within what
    the device has free.

    Raises:
        ValueError: When not even the plain step at batch 1 fits the device.
    """
    stages = model_stages(model)
    units = [*sorted(stages), HEAD]
    head = tuple((r[0], r[-1]) for r in CheckpointPlan.from_spec(model, [], HEAD).layer_regions)
    costs = {}
    for unit, mode in [(None, "full"), *itertools.product(units, MODES)]:
        c = Candidate((unit,) if unit is not None else (), mode, 0, 0, head)
        last = stages[unit][-1] if isinstance(unit, int) else None  # the head: its backward starts the step's
        if (phases := _unit_phases(model, c, imgsz, objects, amp, last)) is not None:
            costs[(unit, mode)] = phases
        elif unit is None:
            raise ValueError(f"checkpoint_stages=auto: a training step at batch 1, imgsz {imgsz} does not fit "
                             f"the device")
    units = [u for u in units if all((u, mode) in costs for mode in MODES)]
    plain = costs.pop((None, "full"))
    return Costs(units, plain, {k: v for k, v in costs.items() if k[0] in units}, grad_bytes(model), head)


def candidates(costs: Costs, batch: int, fixed: int) -> list[Candidate]:
    """Every set of units in every mode, cheapest recompute first (then least predicted memory); ``fixed`` is what
    no plan changes (model state, the batch on the device)."""
    out = []
    for n in range(1, len(costs.units) + 1):
        for subset in itertools.combinations(costs.units, n):
            for mode in MODES:
                peak, flops = costs.predict(subset, mode, batch)
                out.append(Candidate(subset, mode, flops, fixed + peak, costs.head))
    return sorted(out, key=lambda c: (c.flops, c.predicted_bytes))


@dataclass(frozen=True)
class Over:
    """A plan's step that did not fit ``target`` bytes (its probe stopped at that limit, or at the device)."""

    target: int


def vanilla(costs: Costs, batch: int, fixed: int) -> Candidate:
    """The plain step as a candidate: no recompute, its bytes predicted from batch 1 (never measured at a batch it may
    not fit)."""
    return Candidate((), "full", 0, fixed + costs.predict((), "full", batch)[0], costs.head)


def measure_candidate(model: nn.Module, c: Candidate, imgsz: int, batch: int, target: int | None, costs: Costs,
                      objects: int = 50, amp: torch.dtype | None = None) -> tuple[int | None, bool]:
    """``c``'s step at ``batch`` on a copy, within the target and the device: ``(bytes or None, extrapolated)``.

    ``None``: the probe stopped at its limit, so the plan does not fit. When the device holds less than ``target``,
    the step is ``plan_batch``'s, up to ``batch``, extrapolated from batches the device holds. ``target=None``: what
    the device holds now is the target (escalation, with the training state resident).
    """
    with c.copy(model) as m:
        room = probe_room(m, 2**62 if target is None else target)
        if target is None:  # the optimizer's moments appear at the first step: keep room for them (AdamW: two)
            free = None if room.device is None else room.device - 2 * grad_bytes(m)
            room = ProbeRoom(free if free is not None else room.target, free)
            target = room.target
        if room.device is None or room.device >= target:
            got = probe_step(m, imgsz, batch, objects, amp, room.limit)
            return got, False
        try:
            p = plan_batch(m, imgsz, target, 1.0, max_batch=batch, objects=objects, amp=amp)
        except ValueError:
            return None, False
        return (p.measured_bytes if p.batch >= batch else None), p.extrapolated


def choose_plan(model: nn.Module, imgsz: int, batch: int, target: int, objects: int = 50,
                amp: torch.dtype | None = None, costs: Costs | None = None, measured: dict | None = None) -> Choice:
    """The candidate with the least recompute FLOPs whose measured step at ``batch`` fits ``target`` bytes.

    Args:
        model: The model as it will train, plain (frozen layers already frozen), on its device.
        imgsz: Training image size.
        batch: Training batch.
        target: Bytes the step (model state, batch, step peak) must fit.
        objects: Labelled objects per image in the measured batches.
        amp: Autocast dtype of the run's forward, ``None`` for full precision.
        costs: ``unit_costs`` of this model, when already measured.
        measured: Steps already measured on this model at ``imgsz`` (``(units, mode, batch)`` keys, vanilla's units
            ``()``; ``Over`` values did not fit the target they were measured for), filled in as it measures, so
            that choosing for several targets measures each plan once (again only for a target larger than the one
            it did not fit).

    Raises:
        NothingFits: One line when not even the plan that keeps the least fits, with a bound on what it needs.
    """
    costs = costs or unit_costs(model, imgsz, objects, amp)
    measured = {} if measured is None else measured
    fixed = state_bytes(model) + batch_bytes(model, imgsz, batch, objects)
    base_flops = batch * costs.plain.flops
    tried: list[Tried] = []
    extrapolated = False

    def measure(c: Candidate) -> int | None:
        nonlocal extrapolated
        key = (c.units, c.mode, batch)
        got = measured.get(key)
        if got is None or isinstance(got, Over) and got.target < target:  # a larger target may hold it: measure
            got, extra = measure_candidate(model, c, imgsz, batch, target, costs, objects, amp)
            got = measured[key] = Over(target) if got is None else got
            extrapolated |= extra
        got = None if isinstance(got, Over) else got
        tried.append(Tried(c, got))
        return got if got is not None and got <= target else None

    def chosen(c: Candidate, got: int, later: list) -> Choice:
        return Choice(c, c.plan(model), batch, got, target, base_flops, tried, later, costs, extrapolated)

    plain = vanilla(costs, batch, fixed)
    if plain.predicted_bytes <= target * (1 + MARGIN) and (got := measure(plain)) is not None:
        return chosen(plain, got, [])
    ranked = candidates(costs, batch, fixed)
    fitting = [c for c in ranked if c.predicted_bytes <= target * (1 + MARGIN)]
    for c in fitting[:MAX_MEASURED]:
        if (got := measure(c)) is not None:
            return chosen(c, got, [a for a in fitting if a.flops >= c.flops and a != c][:3])
    least_first = sorted(ranked, key=lambda c: (c.predicted_bytes, -c.flops))  # a tie: the plan that recomputes more
    for c in least_first[:3]:
        if all(c != t.candidate for t in tried) and (got := measure(c)) is not None:
            return chosen(c, got, [])
    least = min(tried, key=lambda t: (t.measured is None, t.measured or 0, t.candidate.predicted_bytes)).candidate
    needed = needed_bytes(model, least, imgsz, batch, objects, amp)
    raise NothingFits(f"checkpoint_stages=auto: nothing fits {target / 2**30:.3f} GB at batch {batch}, imgsz "
                      f"{imgsz}; the plan that keeps the least ({describe(least)}) needs at most "
                      f"{needed / 2**30:.3f} GB", needed)


def needed_bytes(model: nn.Module, c: Candidate, imgsz: int, batch: int, objects: int = 50,
                 amp: torch.dtype | None = None) -> int:
    """An upper bound on ``c``'s step at ``batch``, from its step at batch 1 (memory is ``a·b + c`` with ``c >= 0``),
    so that a budget said to fit it does."""
    with c.copy(model) as m:
        one = probe_step(m, imgsz, 1, objects, amp, probe_room(m, 2**62).limit)
        static = state_bytes(m)
    if one is None:
        raise NothingFits(f"checkpoint_stages=auto: not even batch 1 of {describe(c)} fits the device at imgsz "
                          f"{imgsz}", 0)
    return static + batch * (one - static)


def choose_plan_and_batch(model: nn.Module, imgsz: int, budget: int, fraction: float, objects: int = 50,
                          amp: torch.dtype | None = None, max_batch: int = 1024) -> Choice:
    """AutoBatch with ``auto``: the largest batch any plan allows (at most ``max_batch``: Ultralytics caps AutoBatch at
    the training images), then the cheapest plan that fits at that batch.

    The plans predicted to keep about the least are measured at the batch the first of them allows; the one measured
    to keep the least sets the batch (``plan_batch``).

    Raises:
        ValueError: When not even batch 1 fits with the plan that keeps the least.
    """
    costs = unit_costs(model, imgsz, objects, amp)
    ranked = sorted(candidates(costs, 1, 0), key=lambda c: (c.predicted_bytes, c.flops))
    near = [c for c in ranked if c.predicted_bytes <= ranked[0].predicted_bytes * (1 + MARGIN)][:MAX_MEASURED]
    target = int(fraction * budget)

    def largest(c: Candidate) -> BatchPlan:
        with c.copy(model) as m:
            return plan_batch(m, imgsz=imgsz, budget=budget, fraction=fraction, max_batch=max_batch, objects=objects,
                              amp=amp)

    try:
        first = largest(near[0])
    except ValueError:
        raise ValueError(f"checkpoint_stages=auto: not even batch 1 fits {fraction:.0%} of {budget / 2**30:.3f} GB at "
                         f"imgsz {imgsz} with {describe(near[0])}") from None
    sizes = {}  # the plans predicted to keep about the least, measured at that batch: the least sets the batch
    for c in near:
        got, _ = measure_candidate(model, c, imgsz, first.batch, target, costs, objects, amp)
        if got is not None:
            sizes[c] = got
    least = min(sizes, key=lambda c: (sizes[c], c.flops)) if sizes else near[0]
    best = first if least == near[0] or first.batch >= max_batch else max(first, largest(least),
                                                                           key=lambda b: b.batch)
    return choose_plan(model, imgsz, best.batch, best.target_bytes, objects, amp, costs)


def escalations(costs: Costs, current: int, batch: int, fixed: int) -> list[Candidate]:
    """The plans predicted to keep less than ``current`` step bytes at ``batch``, cheapest recompute first: where a
    run that ran out of memory goes next (the first of them is the next point of the Pareto front)."""
    return [c for c in candidates(costs, batch, fixed) if c.predicted_bytes < current]
