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

Example:
    >>> from yolo_ckpt.profiler import build_model
    >>> choice = choose_plan(build_model("yolov8n.yaml"), imgsz=128, batch=2, target=200 * 2**20)
    >>> choice.plan.describe(), choice.measured_bytes <= 200 * 2**20  # doctest: +SKIP
    ('stages [1, 2] selective', True)
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from .autobatch import BatchPlan, plan_batch, step_bytes
from .memory import LiveTensorTracker
from .model import disable_checkpointing
from .profiler import _loss, measure_peak, step_flops, training_batch, with_plan
from .recompute import MODES
from .stages import CheckpointPlan, model_stages

HEAD = "head"  # the unit of every layer after the backbone that stores activations (``checkpoint_layers=head``)
MAX_MEASURED = 12  # candidates measured at most before falling back to those predicted to keep the least
MARGIN = 0.1  # predictions are within about 10% of measured steps: measure candidates predicted up to this much over


class NothingFits(ValueError):
    """No candidate plan's measured step fits the target; ``needed`` is what the plan that kept the least measured."""

    def __init__(self, message: str, needed: int):
        super().__init__(message)
        self.needed = needed


@dataclass(frozen=True)
class Candidate:
    """One plan: units recomputed in one mode, with its recompute FLOPs and predicted bytes at the run's batch.

    Attributes:
        units (tuple): Stage numbers, and ``"head"`` last if the head is recomputed.
        mode (str): ``full`` or ``selective``.
        flops (int): Convolution/matmul FLOPs the recompute adds to a step at the run's batch.
        predicted_bytes (int): Vanilla step bytes at the run's batch minus the units' measured savings.
    """

    units: tuple
    mode: str
    flops: int
    predicted_bytes: int

    @property
    def settings(self) -> dict:
        """The training arguments of this plan."""
        stages = [u for u in self.units if u != HEAD]
        return {"checkpoint_stages": stages, "checkpoint_layers": HEAD if HEAD in self.units else [],
                "checkpoint_mode": self.mode}

    def plan(self, model: nn.Module) -> CheckpointPlan:
        """The ``CheckpointPlan`` of this candidate on ``model``."""
        s = self.settings
        return CheckpointPlan.from_spec(model, s["checkpoint_stages"], s["checkpoint_layers"])

    def installed(self, model: nn.Module) -> nn.Module:
        """A copy of ``model`` with this plan installed (the caller disables it when done)."""
        s = self.settings
        return with_plan(model, s["checkpoint_stages"], s["checkpoint_mode"], s["checkpoint_layers"] or None)


@dataclass
class Choice:
    """What ``choose_plan`` chose, and what it measured on the way.

    Attributes:
        candidate (Candidate): The chosen plan.
        plan (CheckpointPlan): Its regions on the model.
        batch (int): The batch it was measured at.
        measured_bytes (int): Its measured step (model state, batch, step peak).
        target_bytes (int): The memory it had to fit.
        base_flops (int): FLOPs of the vanilla step at ``batch``, for ratios.
        tried (list[tuple[Candidate, int]]): Every measured candidate with its measured bytes, in order.
        alternatives (list[Candidate]): The next cheapest candidates predicted to fit, for the trade-off table.
    """

    candidate: Candidate
    plan: CheckpointPlan
    batch: int
    measured_bytes: int
    target_bytes: int
    base_flops: int
    tried: list = field(default_factory=list)
    alternatives: list = field(default_factory=list)

    def table(self) -> list[str]:
        """Trade-off lines for the log: each measured candidate and the next alternatives."""
        rows = [f"{'plan':<40}{'FLOPs':>8}{'predicted GB':>14}{'measured GB':>13}"]
        seen = set()
        for c, measured in [*self.tried, *((a, None) for a in self.alternatives)]:
            if (c.units, c.mode) in seen:
                continue
            seen.add((c.units, c.mode))
            mark = " <- chosen" if c == self.candidate else ""
            shown = f"{measured / 2**30:.3f}" if measured is not None else "-"
            rows.append(f"{describe(c):<40}{1 + c.flops / self.base_flops:>7.3f}x{c.predicted_bytes / 2**30:>14.3f}"
                        f"{shown:>13}{mark}")
        return rows


def describe(c: Candidate) -> str:
    """``stages [1, 2] + head selective``, or ``none``."""
    stages = [u for u in c.units if u != HEAD]
    parts = ([f"stages {stages}"] if stages else []) + (["head"] if HEAD in c.units else [])
    return " + ".join(parts) + (f" {c.mode}" if c.mode == "selective" else "") if parts else "none"


def _phases(model: nn.Module, batch: dict, amp: torch.dtype | None, last: int | None = None) -> tuple[int, ...]:
    """Exact bytes of a step: kept after the loss, peak until then (forward and loss), peak during backward, and peak
    from the moment backward reaches layer ``last``'s output to its end (the whole backward when ``None``)."""
    model.zero_grad(set_to_none=True)
    hooks = []
    with LiveTensorTracker() as tracker:
        marks = {}

        def mark(m: nn.Module, args: Any, out: Any) -> None:  # backward reaches this output: start the window
            if isinstance(out, torch.Tensor) and out.requires_grad:
                out.register_hook(lambda g: marks.setdefault("bwd", tracker.peak) and tracker.reset_peak())

        if last is not None:
            hooks.append(model.model[last].register_forward_hook(mark))
        loss = _loss(model, batch, amp)
        kept, forward = tracker.current, tracker.peak
        tracker.reset_peak()
        loss.backward()
        del loss
        window = tracker.peak
    for h in hooks:
        h.remove()
    model.zero_grad(set_to_none=True)
    return kept, forward, max(marks.get("bwd", 0), window), window


@dataclass(frozen=True)
class Costs:
    """Measured at batch 1, plain and per unit alone (per ``(unit, mode)``): bytes kept after the loss, the forward
    and backward peaks, and FLOPs.

    Attributes:
        units (list): Stage numbers in forward order, then ``"head"``.
        plain (tuple): The vanilla step's kept bytes, forward peak, backward peak, peak from the unit's backward on
            (``_phases``) and FLOPs.
        unit (dict): ``(unit, mode) ->`` the same five figures with only that unit recomputed.
        grads (int): Bytes of the parameter gradients, which backward peaks hold at most and which no batch scales.
    """

    units: list
    plain: tuple
    unit: dict
    grads: int = 0

    def predict(self, units: tuple, mode: str, batch: int) -> tuple[int, int]:
        """Predicted (step peak bytes, extra FLOPs) of recomputing ``units`` in ``mode`` at ``batch``.

        The forward peak falls by every unit's saving; a unit's backward runs while only the units before it still
        hold their kept tensors, so its backward peak falls by their savings alone; FLOPs add up. Activations scale
        with the batch, parameter gradients do not: at small images they are much of a batch-1 backward peak.
        """
        kept, fwd, bwd, _, flops = self.plain
        less = {u: kept - self.unit[(u, mode)][0] for u in units}

        def backward(peak: int) -> int:
            return batch * max(peak - self.grads, 0) + self.grads

        peaks = [batch * (fwd - sum(less.values())), backward(bwd - sum(less.values()))]
        for u in units:  # from u's backward on, only the units before it still hold what they keep
            before = sum(less[v] for v in units if self.units.index(v) < self.units.index(u))
            peaks.append(backward(self.unit[(u, mode)][3] - before))
        extra = sum(self.unit[(u, mode)][4] - flops for u in units)
        return max(peaks), batch * extra


def unit_costs(model: nn.Module, imgsz: int, objects: int = 50, amp: torch.dtype | None = None) -> Costs:
    """Measure the plain step and each unit alone, in each mode, at batch 1 (on copies of the model)."""
    data = training_batch(model, imgsz, 1, objects)
    stages = model_stages(model)
    units = [*sorted(stages), HEAD]
    costs = {}
    for unit, mode in [(None, "full"), *itertools.product(units, MODES)]:
        m = Candidate((unit,) if unit is not None else (), mode, 0, 0).installed(model)
        last = stages[unit][-1] if isinstance(unit, int) else None  # the head: its backward starts the step's
        try:
            costs[(unit, mode)] = (*_phases(m, data, amp, last), step_flops(m, data, amp))
        finally:
            disable_checkpointing(m)
            del m
    grads = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    return Costs(units, costs.pop((None, "full")), costs, grads)


def candidates(costs: Costs, batch: int, fixed: int) -> list[Candidate]:
    """Every set of units in every mode, cheapest recompute first (then least predicted memory); ``fixed`` is what
    no plan changes (model state, the batch on the device)."""
    out = []
    for n in range(1, len(costs.units) + 1):
        for subset in itertools.combinations(costs.units, n):
            for mode in MODES:
                peak, flops = costs.predict(subset, mode, batch)
                out.append(Candidate(subset, mode, flops, fixed + peak))
    return sorted(out, key=lambda c: (c.flops, c.predicted_bytes))


def choose_plan(model: nn.Module, imgsz: int, batch: int, target: int, objects: int = 50,
                amp: torch.dtype | None = None, costs: Costs | None = None, measured: dict | None = None) -> Choice:
    """The candidate with the least recompute FLOPs whose measured step at ``batch`` fits ``target`` bytes.

    Args:
        model: The model as it will train, plain (frozen layers already frozen).
        imgsz: Training image size.
        batch: Training batch.
        target: Bytes the step (model state, batch, step peak) must fit.
        objects: Labelled objects per image in the measured batches.
        amp: Autocast dtype of the run's forward, ``None`` for full precision.
        costs: ``unit_costs`` of this model, when already measured.
        measured: Steps already measured on this model at ``imgsz`` (``None`` keys the vanilla step), filled in as
            it measures, so that choosing for several targets measures each plan once.

    Raises:
        ValueError: One line when not even the plan that keeps the least fits, saying what it needs.
    """
    costs = costs or unit_costs(model, imgsz, objects, amp)
    measured = {} if measured is None else measured
    if (None, batch) not in measured:
        plain = with_plan(model, [])  # steps move BatchNorm statistics: never run the model itself
        try:
            vanilla = step_bytes(plain, imgsz, batch, objects, amp)
            measured[None, batch] = vanilla, vanilla - measure_peak(plain, training_batch(plain, imgsz, batch,
                                                                                           objects), amp)[0]
        finally:
            del plain
    vanilla, fixed = measured[None, batch]
    base = Choice(Candidate((), "full", 0, vanilla), CheckpointPlan(), batch, vanilla, target, batch * costs.plain[4])
    if vanilla <= target:
        return base
    ranked = candidates(costs, batch, fixed)
    tried: list[tuple[Candidate, int]] = []

    def measure(c: Candidate) -> int:
        if (key := (c.units, c.mode, batch)) not in measured:
            m = c.installed(model)
            try:
                measured[key] = step_bytes(m, imgsz, batch, objects, amp)
            finally:
                disable_checkpointing(m)
                del m
        tried.append((c, measured[key]))
        return measured[key]

    fitting = [c for c in ranked if c.predicted_bytes <= target * (1 + MARGIN)]
    for c in fitting[:MAX_MEASURED]:
        if (got := measure(c)) <= target:
            later = [a for a in fitting if a.flops >= c.flops and a != c][:3]
            return Choice(c, c.plan(model), batch, got, target, base.base_flops, tried, later)
    for c in sorted(ranked, key=lambda c: (c.predicted_bytes, -c.flops))[:3]:  # predicted to keep least; a tie:
        # the plan that recomputes more
        if all(c != t for t, _ in tried) and (got := measure(c)) <= target:
            return Choice(c, c.plan(model), batch, got, target, base.base_flops, tried, [])
    least, needed = min(tried, key=lambda t: t[1])
    raise NothingFits(f"checkpoint_stages=auto: nothing fits {target / 2**30:.3f} GB at batch {batch}, imgsz "
                      f"{imgsz}; the plan that kept the least ({describe(least)}) needs {needed / 2**30:.3f} GB",
                      needed)


def choose_plan_and_batch(model: nn.Module, imgsz: int, budget: int, fraction: float, objects: int = 50,
                          amp: torch.dtype | None = None) -> Choice:
    """AutoBatch with ``auto``: the largest batch any plan allows, then the cheapest plan that fits at that batch.

    The plans predicted to keep about the least are measured at the batch the first of them allows; the one measured
    to keep the least sets the batch (``plan_batch``).

    Raises:
        ValueError: When not even batch 1 fits with the plan that keeps the least.
    """
    costs = unit_costs(model, imgsz, objects, amp)
    ranked = sorted(candidates(costs, 1, 0), key=lambda c: (c.predicted_bytes, c.flops))
    near = [c for c in ranked if c.predicted_bytes <= ranked[0].predicted_bytes * (1 + MARGIN)][:MAX_MEASURED]

    def largest(c: Candidate) -> BatchPlan:
        m = c.installed(model)
        try:
            return plan_batch(m, imgsz=imgsz, budget=budget, fraction=fraction, objects=objects, amp=amp)
        finally:
            disable_checkpointing(m)
            del m

    try:
        first = largest(near[0])
    except ValueError:
        raise ValueError(f"checkpoint_stages=auto: not even batch 1 fits {fraction:.0%} of {budget / 2**30:.3f} GB at "
                         f"imgsz {imgsz} with {describe(near[0])}") from None
    sizes = {}  # the plans predicted to keep about the least, measured at that batch: the least sets the batch
    for c in near:
        m = c.installed(model)
        try:
            sizes[c] = step_bytes(m, imgsz, first.batch, objects, amp)
        finally:
            disable_checkpointing(m)
            del m
    least = min(sizes, key=lambda c: (sizes[c], c.flops))
    best = first if least == near[0] else max(first, largest(least), key=lambda b: b.batch)
    return choose_plan(model, imgsz, best.batch, best.target_bytes, objects, amp, costs)
