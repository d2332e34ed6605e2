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
part of it selective inside), since what the parts save depends on what holds them. Where the model's plans take no
mode per region (``per_region_modes``), one of ``full``/``selective`` for all units, neck and head layer together.
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
target a step must fit is the share less the batches the training loop holds beside it (``measure.loop_bytes``).

No probe passes what it may use (``autobatch.ProbeRoom``: the share, and what the device has free): the vanilla step
and the fixed part (model state, the batch) are computed or predicted, a step is measured only under that limit, and a
step that reaches it stops there and counts as "does not fit". When the device is smaller than the share (a
``memory_budget`` bigger than the device), a candidate is confirmed by ``plan_batch``'s steps that fit the device,
extrapolated to the batch.

Examples:
    >>> from yolo_ckpt.measure import build_model
    >>> choice = choose_plan(build_model("yolov8n.yaml"), imgsz=128, batch=2, target=200 * 2**20)
    >>> choice.plan.describe(), choice.measured_bytes <= 200 * 2**20  # doctest: +SKIP
    ('stages [1, 2] selective', True)
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
from torch import nn

from .autobatch import BatchPlan, ProbeRoom, plan_batch, probe_room
from .device import MemoryLimit, unless_oom
from .loss import enable_loss_checkpointing
from .measure import (
    batch_bytes,
    grad_bytes,
    loop_bytes,
    planned_copy,
    probe_step,
    state_bytes,
    step_loss,
    time_steps,
    training_batch,
)
from .memory import LiveTensorTracker
from .model import enable_checkpointing
from .recompute import MODES
from .stages import CheckpointConfigError, CheckpointPlan, joined_stages, model_parts, model_stages

LOSS = "loss"  # the loss plan as a unit (``Costs.loss``): after the head, its backward first
HEAD = "head"  # the unit of the model's last layer (Detect, Segment, Classify, RTDETRDecoder, ...)
NECK = "neck"  # the unit of the layers between backbone and head layer that store activations (where there are any)
MAX_MEASURED = 16  # candidates measured at most before falling back to those predicted to keep the least
MARGIN = 0.1  # predictions are within about 10% of measured steps: measure candidates predicted up to this much over
MIXED = "mixed"  # ``Candidate.mode`` of a plan whose units are recomputed in different modes
MAX_SPACE = 3**8  # candidate plans listed one by one at most; beyond, only those no other beats (``_front_plans``)
TIMED_STEPS = 3  # timed steps per planning copy (median): a unit's recompute time is its step's less vanilla's
# (0: no step is timed, every time is 0 s and plans rank by their FLOPs, ``candidates``' next key)
# A unit's mode, where the model's plans take a mode per region: its own regions' (``full``, ``selective``, or none)
# and, for a unit with block layers, the mode of their parts (``Layout.nests``) as a unit of their own: each part a
# region, nested inside the unit's regions (Chen's recursive scheme) or alone ("parts": the unit's other layers keep
# their tensors). What the parts save depends on their unit's mode, so each pair is measured together.
PARTS = "parts"
UNIT_MODES = (*MODES, *(f"{o}+{PARTS}{s}" for o in MODES for s in ("", ":selective")), PARTS, f"{PARTS}:selective")
JOINED = tuple  # the type of a unit of stages in one region, ``(1, 2)``: the stem in the next stage's region
NESTED = f"full+{PARTS}"  # a unit recomputed full, each part of its block layers a full region of its own inside


def split_mode(mode: str) -> tuple[str | None, str | None]:
    """A unit mode's (regions' mode, parts' mode), ``None`` where not recomputed: ``"full+parts:selective"`` is
    ``("full", "selective")``, ``"parts"`` is ``(None, "full")``, ``"selective"`` is ``("selective", None)``."""
    outer, with_parts, parts = mode.partition(PARTS)
    if not with_parts:
        return mode, None
    return outer.removesuffix("+") or None, parts.removeprefix(":") or "full"


class NothingFits(ValueError):
    """No candidate plan's measured step fits the target; ``needed`` bounds what the plan that keeps the least needs."""

    def __init__(self, message: str, needed: int):
        super().__init__(message)
        self.needed = needed


class Layout(NamedTuple):
    """Where a unit sits in the model, for settings that name its regions one by one.

    Attributes:
        unit (Any): A stage number, ``"neck"``, ``"head"``, or the stem and the next stage in one region (``(1, 2)``,
            ``JOINED``).
        ranges (tuple): Its layer regions as ``(first, last)`` pairs.
        nests (tuple): Its block layers, whose parts (``stages.model_parts``) are blocks of their own (``_layout``):
            the unit's ``+parts`` modes recompute each part of them as a region of its own (inside the unit's
            regions, or alone).
    """

    unit: Any
    ranges: tuple
    nests: tuple = ()


@dataclass(frozen=True)
class Candidate:
    """One plan: units, each recomputed in its own mode, with its recompute FLOPs, predicted bytes and predicted step
    time at the run's batch.

    Attributes:
        units (tuple): Stage numbers, then ``"neck"`` and ``"head"`` where recomputed; ``()`` is vanilla.
        modes (tuple): Each unit's mode (one of ``UNIT_MODES``), in the order of ``units``; a single mode given as a
            string applies to every unit.
        flops (int): Convolution/matmul FLOPs the recompute adds to a step at the run's batch.
        predicted_bytes (int): Vanilla step bytes at the run's batch minus the units' measured savings.
        head (tuple): The regions of ``checkpoint_layers=head`` (neck and head layer) as ``[first, last]`` ranges,
            resolved once per model (``Costs.head``): the keyword finds them with a training-mode dry run, which
            planning copies need not repeat.
        seconds (float): Predicted step time at the run's batch (``Costs.predict_seconds``).
        layout (tuple | None): ``Layout`` of every unit of the model (``Costs.layout``): where the settings of a plan
            with per-unit modes cut its regions.
        loss (str | None): Its ``checkpoint_loss`` where planning weighs the loss (``Costs.loss``; ``"none"``:
            Ultralytics' loss), ``None`` where the loss plan is the run's, carried by every copy.
    """

    units: tuple
    modes: tuple | str
    flops: int
    predicted_bytes: int
    head: tuple | None = None
    seconds: float = 0.0
    layout: tuple | None = None
    loss: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.modes, str):  # one mode for every unit
            object.__setattr__(self, "modes", (self.modes,) * len(self.units))

    @property
    def mode(self) -> str:
        """The plan's one mode (``full`` for vanilla), or ``MIXED`` when its units differ."""
        return self.modes[0] if len(set(self.modes)) == 1 else MIXED if self.modes else "full"

    def unit_mode(self, unit: Any) -> str:
        """The mode ``unit`` is recomputed in."""
        return self.modes[self.units.index(unit)]

    @property
    def settings(self) -> dict:
        """The training arguments of this plan.

        One mode of ``MODES``: those keys as a user writes them (``checkpoint_stages``, ``checkpoint_layers=head``
        for neck and head layer, or the regions of the one of them recomputed, ``checkpoint_mode``). Otherwise every
        region in ``checkpoint_layers``: each unit's layer ranges with its mode as a suffix where it is not ``full``
        (``"0-2:selective"``), and where its parts are recomputed each part of its block layers (``"2.*"``,
        ``"2.*:selective"``), inside those ranges when they are recomputed too (``per_region_modes``: only such models
        get these plans).
        """
        loss = {} if self.loss is None else {"checkpoint_loss": self.loss}
        if self.mode in MODES:
            stages = [k for u in self.units for k in (u if isinstance(u, JOINED) else (u,)) if isinstance(k, int)]
            return {"checkpoint_stages": stages, "checkpoint_layers": self._head_layers(), "checkpoint_mode": self.mode,
                    **loss}
        return {"checkpoint_stages": [], "checkpoint_layers": self._items(), "checkpoint_mode": "full", **loss}

    @property
    def key(self) -> tuple:
        """What tells two plans apart: units, modes and loss plan."""
        return self.units, self.modes, self.loss

    @property
    def recomputes(self) -> bool:
        """Whether the plan recomputes anything: a unit, or the loss."""
        return bool(self.units) or self.loss not in (None, "none")

    def _head_layers(self) -> str | list:
        """``checkpoint_layers`` of a one-mode plan: ``head`` when it recomputes every unit after the backbone (or,
        without a layout, the head unit), else the ranges of those it recomputes."""
        after = [w for w in self.layout or () if w.unit in (NECK, HEAD)]
        if all(w.unit in self.units for w in after) if after else HEAD in self.units:
            return HEAD
        return [list(r) for w in after if w.unit in self.units for r in w.ranges]

    def _items(self) -> list[str]:
        """Every unit's regions as ``checkpoint_layers`` strings, in layer order."""
        if self.layout is None:
            raise ValueError("a plan of per-unit modes needs the units' layout (Costs.layout)")
        where = {w.unit: w for w in self.layout}
        items = []
        for u, m in zip(self.units, self.modes):
            outer, parts = split_mode(m)
            if outer:
                items += [(a, 0, f"{a}{'' if a == b else f'-{b}'}{_suffix(outer)}") for a, b in where[u].ranges]
            if parts:
                items += [(i, 1, f"{i}.*{_suffix(parts)}") for i in where[u].nests]
        return [item for *_, item in sorted(items)]

    @property
    def spec(self) -> tuple:
        """``(checkpoint_stages, checkpoint_mode, checkpoint_layers, checkpoint_loss)`` as ``planned_copy`` installs
        it: the head's resolved ranges where known; the loss ``None`` where it is the run's."""
        s = self.settings
        if self.mode not in MODES or s["checkpoint_layers"] != HEAD:
            return s["checkpoint_stages"], s["checkpoint_mode"], s["checkpoint_layers"] or None, self.loss
        head = [list(r) for r in self.head] if self.head is not None else HEAD
        return s["checkpoint_stages"], s["checkpoint_mode"], head, self.loss

    @property
    def layers(self) -> Any:
        """``checkpoint_layers`` as planning installs it (``spec``)."""
        return self.spec[2]

    def plan(self, model: nn.Module) -> CheckpointPlan:
        """The ``CheckpointPlan`` of this candidate on ``model``."""
        return CheckpointPlan.from_spec(model, self.spec[0], self.spec[2])

    @contextmanager
    def copy(self, model: nn.Module) -> Iterator[nn.Module]:
        """A copy of ``model`` with this plan installed, for the block (``measure.planned_copy``)."""
        with planned_copy(model, *self.spec) as m:
            yield m


def _suffix(mode: str) -> str:
    return "" if mode == "full" else f":{mode}"


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
        base_flops (int): FLOPs of the vanilla step at ``batch``, for ratios.
        tried (list[Tried]): Every measured candidate, in order.
        alternatives (list[Candidate]): The next cheapest candidates predicted to fit, for the trade-off table.
        costs (Costs | None): The unit costs the choice rests on (escalation reuses them).
        extrapolated (bool): The device is smaller than the target: steps were extrapolated from batches it holds.
        measured_seconds (float | None): The chosen plan's step time at ``batch``, timed once its step was measured
            to fit (``None`` when extrapolated: the device does not hold that batch).
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


def describe(c: Candidate) -> str:
    """``stages [1, 2] + head selective``, ``stages [2, 3] full; stages [1] + head selective`` (per-unit modes),
    ``stages [2] full+parts`` (parts recomputed inside), ``head parts:selective`` (the head's parts alone), or
    ``none``; a loss plan after them (``stages [1, 2] + head, loss exact``, ``loss chunked``)."""
    if not c.units and c.loss not in (None, "none"):
        return f"loss {c.loss}"
    return _describe_plan(c) + loss_suffix(c)


def loss_suffix(c: Candidate) -> str:
    """``", loss exact"`` after a plan's units where it recomputes the loss, else nothing."""
    return "" if c.loss in (None, "none") else f", loss {c.loss}"


def _describe_plan(c: Candidate) -> str:
    if c.mode != MIXED:
        return _describe_units(c.units, c.mode)
    return "; ".join(f"{_describe_units(us, m)}{' full' if m == 'full' else ''}"
                     for m in UNIT_MODES if (us := tuple(u for u in c.units if c.unit_mode(u) == m)))


def _describe_units(units: tuple, mode: str) -> str:
    stages = ["+".join(map(str, u)) if isinstance(u, JOINED) else str(u) for u in units if u not in (NECK, HEAD)]
    parts = ([f"stages [{', '.join(stages)}]"] if stages else []) + [u for u in (NECK, HEAD) if u in units]
    return " + ".join(parts) + (f" {mode}" if mode != "full" else "") if parts else "none"


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
        seconds (float): Median wall-clock time of the step on the run's device (``TIMED_STEPS``), timed only once
            the bounded step fit.
    """

    kept: int
    forward: int
    backward: int
    window: int
    flops: int
    seconds: float = 0.0


def _phases(model: nn.Module, batch: dict, amp: torch.dtype | None, last: int | None, limit: int | None) -> Phases:
    """Measure ``Phases`` of a step of ``model`` that may allocate at most ``limit`` bytes."""
    model.zero_grad(set_to_none=True)
    hooks = []
    # without a limit an exact tracker: a limit sizes every op on meta tensors before it runs
    tracker = MemoryLimit(limit, "device room", False, True) if limit is not None else LiveTensorTracker(flops=True)
    with tracker:
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
    return Phases(kept, forward, max(marks.get("bwd", 0), window), window, tracker.flops)


@dataclass(frozen=True)
class Costs:
    """Measured at batch 1, plain and per unit alone (per ``(unit, mode)``).

    Attributes:
        units (list): Stage numbers in forward order, then ``"neck"`` (where the model has one) and ``"head"``
            (units whose batch-1 step did not fit the device are left out).
        plain (Phases): The vanilla step.
        unit (dict): ``(unit, mode) -> Phases`` with only that unit recomputed.
        grads (int): Bytes of the parameter gradients, which backward peaks hold at most and which no batch scales.
        head (tuple | None): The head's regions as ``(first, last)`` ranges (``Candidate.head``).
        layout (tuple | None): Each unit's ``Layout`` (``Candidate.layout``).
        mixed (bool): The model's plans take a mode per region (``per_region_modes``): candidates may then recompute
            each unit in its own mode, its parts' modes included where the unit has block layers.
        loss (dict): ``checkpoint_loss value -> Phases`` with only the loss recomputed, for the loss plans planning
            may choose (``loss.auto_loss_modes``); empty where the loss plan is the run's (every copy carries it).
    """

    units: list
    plain: Phases
    unit: dict
    grads: int = 0
    head: tuple | None = None
    layout: tuple | None = None
    mixed: bool = False
    loss: dict = field(default_factory=dict)

    def groups(self) -> list[tuple]:
        """The units plans recompute or not together: each alone where units take modes of their own; in one mode
        for all, neck and head layer together, as ``checkpoint_layers=head`` (their plans are the user's keys)."""
        if self.mixed:
            return [(u,) for u in self.units]
        after = tuple(u for u in self.units if u in (NECK, HEAD))
        alone = [(u,) for u in self.units if u not in after and not isinstance(u, JOINED)]  # stages join by themselves
        return alone + [after] if after else alone

    def modes_of(self, unit: Any) -> tuple[str, ...]:
        """The modes ``unit`` was measured in (those with its parts only where it has block layers)."""
        return tuple(m for m in UNIT_MODES if (unit, m) in self.unit)

    def predict(self, units: tuple, modes: tuple | str, batch: int, loss: str | None = None) -> tuple[int, int]:
        """Predicted (step peak bytes, extra FLOPs) of recomputing ``units`` in ``modes`` (one per unit, or one
        for all) at ``batch``, and the loss as ``loss`` says (a key of ``Costs.loss``; else Ultralytics' loss, or the
        run's).

        The forward peak falls by every unit's saving; a unit's backward runs while only the units before it still
        hold their kept tensors, so its backward peak falls by their savings alone; FLOPs add up. Activations scale
        with the batch, parameter gradients do not: at small images they are much of a batch-1 backward peak. The
        loss is the last unit: its backward runs first, while every unit holds what it keeps, and what it kept is
        freed before any unit's backward starts.
        """
        p = self.plain
        phases = self._phases(units, modes, loss)
        units = (*units, LOSS) if LOSS in phases else units
        less = {u: p.kept - phases[u].kept for u in units}

        def backward(peak: int) -> int:
            return batch * max(peak - self.grads, 0) + self.grads

        peaks = [batch * (p.forward - sum(less.values())), backward(p.backward - sum(less.values()))]
        order = [*self.units, LOSS]
        for u in units:  # from u's backward on, only the units before it still hold what they keep
            before = sum(less[v] for v in units if order.index(v) < order.index(u))
            peaks.append(backward(phases[u].window - before))
        extra = sum(phases[u].flops - p.flops for u in units)
        return max(peaks), batch * extra

    def predict_seconds(self, units: tuple, modes: tuple | str, batch: int, loss: str | None = None) -> float:
        """Predicted step time at ``batch``: the vanilla step's at batch 1 plus each unit's recompute time (its
        batch-1 step's less vanilla's, never below zero: timing noise must not make recompute look free), the loss
        plan's likewise, scaled with the batch as activations are."""
        phases = self._phases(units, modes, loss)
        return batch * (self.plain.seconds + sum(max(ph.seconds - self.plain.seconds, 0.0) for ph in phases.values()))

    def _phases(self, units: tuple, modes: tuple | str, loss: str | None = None) -> dict:
        modes = (modes,) * len(units) if isinstance(modes, str) else modes
        phases = {u: self.unit[(u, m)] for u, m in zip(units, modes)}
        return {**phases, LOSS: self.loss[loss]} if loss in self.loss else phases


def _unit_phases(m: nn.Module, c: Candidate, imgsz: int, objects: int, amp: torch.dtype | None,
                 last: int | None) -> Phases | None:
    """``Phases`` of ``c``'s step at batch 1 on ``m`` (planning's copy; ``c`` is installed on it) within what the
    device has free, ``None`` when it does not fit; then, only when it fit, its step timed on the same copy and batch
    (the same step, so the memory it needs is what was just measured within the bound)."""
    enable_checkpointing(m, c.plan(m), c.spec[1])  # as ``Candidate.copy`` installs it
    if c.loss is not None:
        enable_loss_checkpointing(m, c.loss)
    room = probe_room(m, 2**62).device  # step bytes the device holds for a probe now
    data = training_batch(m, imgsz, 1, objects)
    limit = None if room is None else room - state_bytes(m) - batch_bytes(m, imgsz, 1, objects)
    device = next(m.parameters()).device
    phases = unless_oom(lambda: _phases(m, data, amp, last, limit), device)
    if phases is None:
        return None
    # the same step again; still bounded by the device: a CUDA allocator may need more than the exact bytes
    seconds = unless_oom(lambda: time_steps([m], data, TIMED_STEPS, amp)[0], device)
    return None if seconds is None else dataclasses.replace(phases, seconds=seconds)


def per_region_modes(model: nn.Module) -> bool:
    """Whether ``checkpoint_layers`` on this model takes a mode per region (``"0:selective"``); the grammar of
    regions inside layers brings it."""
    try:
        CheckpointPlan.from_spec(model, [], ["0:selective"])
    except (CheckpointConfigError, TypeError, ValueError):
        return False
    return True


def unit_costs(model: nn.Module, imgsz: int, objects: int = 50, amp: torch.dtype | None = None,
               loss_modes: tuple = ()) -> Costs:
    """Measure the plain step and each unit alone, in each mode (its parts' too where the model's plans take modes
    per region and the unit has block layers), at batch 1 (on copies of the model), each within what the device has
    free, and time each such step that fit. With ``loss_modes`` (``loss.auto_loss_modes``) every step runs
    Ultralytics' loss, and each of those loss plans is measured alone too (``Costs.loss``); without, every step runs
    the loss plan ``model`` has.

    Raises:
        ValueError: When not even the plain step at batch 1 fits the device.
    """
    stages = model_stages(model)
    head = tuple((r[0], r[-1]) for r in CheckpointPlan.from_spec(model, [], HEAD).layer_regions)
    mixed = per_region_modes(model)
    layout = _layout(model, stages, head, mixed)
    units = [w.unit for w in layout]
    where = {w.unit: w for w in layout}
    costs = {}
    # one copy for every probe, each plan installed in turn (a copy each took a third of planning on a simulated
    # device); its BatchNorm statistics move from probe to probe, which no step's bytes, FLOPs or time depend on,
    # and its loss is put back as the copy had it, so that every probe is the first step of a fresh copy
    probes = [(None, "full"), *((u, k) for u in units for k in UNIT_MODES
                                if k in MODES or where[u].nests and (split_mode(k)[0] or not isinstance(u, JOINED))),
              *((LOSS, k) for k in loss_modes)]
    base = "none" if loss_modes else None  # the loss the network's probes run
    with planned_copy(model, [], loss=base) as m:
        criterion = getattr(m, "criterion", None)  # the loss a first step makes, as it had it (its bytes count)
        for unit, mode in probes:
            m.criterion = criterion
            if unit == LOSS:  # the loss plan alone: the network plain
                c = Candidate((), "full", 0, 0, head, layout=layout, loss=mode)
            else:
                c = Candidate((unit,) if unit is not None else (), mode, 0, 0, head, layout=layout, loss=base)
            last = where[unit].ranges[-1][1] if unit not in (None, HEAD, LOSS) else None  # the head: backward first
            if (phases := _unit_phases(m, c, imgsz, objects, amp, last)) is not None:
                costs[(unit, mode)] = phases
            elif unit is None:
                raise ValueError(f"checkpoint_stages=auto: a training step at batch 1, imgsz {imgsz} does not fit "
                                 f"the device")
    units = [u for u in units if all((u, mode) in costs for mode in MODES)]
    plain = costs.pop((None, "full"))
    loss = {mode: costs.pop((LOSS, mode)) for mode in loss_modes if (LOSS, mode) in costs}
    return Costs(units, plain, {k: v for k, v in costs.items() if k[0] in units}, grad_bytes(model), head, layout,
                 mixed, loss)


def _layout(model: nn.Module, stages: dict, head: tuple, mixed: bool) -> tuple[Layout, ...]:
    """Each unit's ``Layout``. Its block layers (``Layout.nests``, only where plans take modes per region) are
    those whose parts are blocks of their own (a part with modules inside: C3k2's ``cv1``/``m.0``/``cv2``, Detect's
    branches), not a ``Conv``'s convolution and BatchNorm, which recomputed apart keep nothing less. Where plans take
    a mode per unit and the stem's output feeds only the next stage, the two as one unit, after the second."""
    parts = model_parts(model) if mixed else {}

    def composite(i: int) -> bool:
        return any(next(model.model[i].get_submodule(p).children(), None) is not None
                   for p in parts.get(i, {}).get("", ()))

    def nests(ranges: tuple) -> tuple[int, ...]:
        return tuple(i for a, b in ranges for i in range(a, b + 1) if composite(i))

    spans = [(k, ((layers[0], layers[-1]),)) for k, layers in sorted(stages.items())]
    if mixed and len(stages) > 1 and (second := sorted(stages)[1]) in joined_stages(model):
        first = min(stages)
        at = next(i for i, (u, _) in enumerate(spans) if u == second) + 1
        spans.insert(at, ((first, second), ((stages[first][0], stages[second][-1]),)))
    spans += [(NECK, head[:-1])] if len(head) > 1 else []  # the head layer is the last region of the keyword's
    spans += [(HEAD, head[-1:])]
    return tuple(Layout(u, ranges, nests(ranges)) for u, ranges in spans)


def _mode_choices(costs: Costs, units: tuple) -> Iterator[tuple]:
    """The modes ``units`` may take together: each its own where the model's plans take per-region modes, else one
    of ``MODES`` for all."""
    if costs.mixed:
        return itertools.product(*(costs.modes_of(u) for u in units))
    return ((m,) * len(units) for m in MODES)


def space_size(costs: Costs) -> int:
    """How many candidate plans ``costs``' units make: each unit off or in one of its modes (with per-unit modes),
    else every set of ``Costs.groups`` in each of ``MODES``."""
    n = {u: len(costs.modes_of(u)) for u in costs.units}
    joined = [u for u in costs.units if isinstance(u, JOINED)]  # with neither of its stages, or not at all
    alone = [u for u in costs.units if not isinstance(u, JOINED) and not any(u in j for j in joined)]
    plans = (math.prod(1 + n[u] for u in alone)
             * math.prod(math.prod(1 + n.get(k, 0) for k in j) + n[j] for j in joined) - 1  # a stage may not fit
             if costs.mixed else len(MODES) * (2 ** len(costs.groups()) - 1))
    return (plans + 1) * (1 + len(costs.loss)) - 1  # each with the loss plan or without, and the loss plans alone


def _every_plan(costs: Costs) -> Iterator[tuple[tuple, tuple]]:
    """``(units, modes)`` of every candidate plan."""
    groups = costs.groups()
    for n in range(1, len(groups) + 1):
        for chosen in itertools.combinations(groups, n):
            subset = tuple(u for g in chosen for u in g)
            if _clash(subset):
                continue
            for modes in _mode_choices(costs, subset):
                yield subset, modes


def _clash(units: tuple) -> bool:
    """Whether ``units`` holds a stage twice: a joined unit (``JOINED``) and one of its stages."""
    return any(k in units for u in units if isinstance(u, JOINED) for k in u)


class _Partial(NamedTuple):
    """Units decided so far (in ``costs.units`` order) and what ``Costs.predict`` adds up over them at batch 1."""

    units: tuple
    modes: tuple
    saved: int  # bytes no longer kept: what the forward and the units after these no longer hold
    seconds: float  # recompute time
    flops: int  # recompute FLOPs
    window: int  # the largest backward window of these units less the savings before each


def _undominated(plans: list[_Partial]) -> list[_Partial]:
    """The plans no other beats — one with less time (or as much and fewer FLOPs), as much saving and no larger
    window — at most ``MAX_SPACE`` of them, fastest first. Taken in that order, only earlier plans can beat a plan,
    and of those only the staircase of (saving, window) matters: along it the window grows with the saving, so the
    first step saving at least as much has the least window of all that do."""
    kept: list[_Partial] = []
    saved: list[int] = []  # the staircase: savings ascending, windows ascending with them
    windows: list[int] = []
    for q in sorted(plans, key=lambda q: (q.seconds, q.flops, -q.saved, q.window)):
        at = bisect.bisect_left(saved, q.saved)
        if at < len(saved) and windows[at] <= q.window:
            continue
        kept.append(q)
        start = at
        while start and windows[start - 1] >= q.window:  # steps q beats: no more saving, no less window
            start -= 1
        saved[start:at] = [q.saved]
        windows[start:at] = [q.window]
        if len(kept) == MAX_SPACE:
            break
    return kept


def _front_plans(costs: Costs) -> Iterator[tuple[tuple, tuple]]:
    """``(units, modes)`` of the plans that some target makes worth measuring, unit by unit (a plan's predicted
    peak falls with its saving and rises with its worst backward window; time and FLOPs add up): a prefix another
    prefix beats in all four can only lead to plans beaten the same way, so it is dropped. This keeps planning
    bounded where per-unit modes make the space exponential (``space_size``)."""
    p = costs.plain
    for only in [None] if costs.mixed else MODES:  # one mode for all: a front per mode
        plans = [_Partial((), (), 0, 0.0, 0, -(2**62))]
        for g in costs.groups():  # more than one unit only in one mode for all
            grown = list(plans)
            for q in plans:
                if _clash((*q.units, *g)):
                    continue
                for m in costs.modes_of(g[0]) if only is None else (only,):
                    r = q
                    for u in g:
                        ph = costs.unit[(u, m)]
                        r = _Partial((*r.units, u), (*r.modes, m), r.saved + p.kept - ph.kept,
                                     r.seconds + max(ph.seconds - p.seconds, 0.0), r.flops + ph.flops - p.flops,
                                     max(r.window, ph.window - r.saved))
                    grown.append(r)
            plans = _undominated(grown)
        yield from ((q.units, q.modes) for q in plans if q.units)


def candidate(costs: Costs, units: tuple, modes: tuple | str, batch: int, fixed: int,
              loss: str | None = None) -> Candidate:
    """``units`` in ``modes`` with the loss as ``loss`` says (``Candidate.loss``) as a candidate at ``batch``, its
    bytes, FLOPs and step time predicted; ``fixed`` is what no plan changes (model state, the batch on the device)."""
    peak, flops = costs.predict(units, modes, batch, loss)
    return Candidate(units, modes, flops, fixed + peak, costs.head, costs.predict_seconds(units, modes, batch, loss),
                     costs.layout, loss)


def candidates(costs: Costs, batch: int, fixed: int, max_space: int | None = None,
               loss: bool = True) -> list[Candidate]:
    """Every set of units, each in every mode it may take (``_mode_choices``) — or, when that space holds more than
    ``max_space`` plans (``MAX_SPACE``), only the plans no other beats (``_front_plans``) — least predicted step time
    first (then least recompute FLOPs, least predicted memory); ``fixed`` is what no plan changes (model state, the
    batch on the device). Where planning weighs the loss (``Costs.loss``), each plan with Ultralytics' loss and with
    each loss plan, and the loss plans alone; ``loss=False``: the layer plans only, with the loss the run has."""
    every = space_size(costs) <= (MAX_SPACE if max_space is None else max_space)
    plans = list(_every_plan(costs) if every else _front_plans(costs))
    losses = ("none", *costs.loss) if costs.loss and loss else (None,)
    out = [candidate(costs, units, modes, batch, fixed, how)
           for units, modes in [((), ()), *plans] for how in losses if units or how not in (None, "none")]
    return sorted(out, key=lambda c: (c.seconds, c.flops, c.predicted_bytes))


@dataclass(frozen=True)
class Over:
    """A plan's step that did not fit ``target`` bytes (its probe stopped at that limit, or at the device)."""

    target: int


def no_recompute(costs: Costs, batch: int, fixed: int) -> Candidate:
    """The plain step as a candidate: no recompute (Ultralytics' loss where planning weighs the loss), its bytes
    predicted from batch 1 (never measured at a batch it may not fit)."""
    return candidate(costs, (), (), batch, fixed, "none" if costs.loss else None)


def least_keeping(costs: Costs, batch: int = 1, fixed: int = 0) -> Candidate:
    """The layer plan predicted to keep the least at ``batch`` (a tie: the one that recomputes more), with the loss
    the run has: where escalation's layer plans end (the loss comes after them, ``run_planning.loss_escalation``).
    Nested plans and parts count: in yolo11n at 160 px it recomputes every stage with its block layers' parts
    nested inside, where plans take a mode per region."""
    return min(candidates(costs, batch, fixed, loss=False), key=lambda c: (c.predicted_bytes, -c.flops))


def deepest(model: nn.Module) -> dict[str, Any]:
    """The settings of the plan that recomputes the most, known without measuring anything: every unit (each stage,
    the stem in stage 2's region where plans take a mode per region, the neck, the head layer) full, and, where the
    model's plans take a mode per region, each of its block layers' parts a full region nested inside (``NESTED``).
    Escalation takes it as the plan that keeps the least until the units are measured (``least_keeping``). Builds
    ``checkpoint_layers=head`` with a dry run: call it where memory is free."""
    head = tuple((r[0], r[-1]) for r in CheckpointPlan.from_spec(model, [], HEAD).layer_regions)
    layout = _layout(model, model_stages(model), head, per_region_modes(model))
    joined = {k for w in layout if isinstance(w.unit, JOINED) for k in w.unit}  # the stem in stage 2's region
    layout = tuple(w for w in layout if w.unit not in joined)
    modes = tuple(NESTED if w.nests else "full" for w in layout)
    return Candidate(tuple(w.unit for w in layout), modes, 0, 0, head, layout=layout).settings


def measure_candidate(model: nn.Module, c: Candidate, imgsz: int, batch: int, target: int | None, costs: Costs,
                      objects: int = 50, amp: torch.dtype | None = None) -> tuple[int | None, bool]:
    """``c``'s step at ``batch`` on a copy, within the target and the device: ``(bytes or None, extrapolated)``
    (``measure_copy`` on ``c.copy(model)``). The copy itself, and the dry run that resolves its parts, may not fit a
    device that holds less than it said: that too is "does not fit"."""
    def measure() -> tuple[int | None, bool]:
        with c.copy(model) as m:
            return measure_copy(m, imgsz, batch, target, objects, amp)

    got = unless_oom(measure, next(model.parameters()).device)
    return (None, False) if got is None else got


def measure_copy(m: nn.Module, imgsz: int, batch: int, target: int | None, objects: int = 50,
                 amp: torch.dtype | None = None) -> tuple[int | None, bool]:
    """The step at ``batch`` of a planning copy ``m`` (any plan installed), within the target and the device:
    ``(bytes or None, extrapolated)``.

    ``None``: the probe stopped at its limit, so the plan does not fit. When the device holds less than ``target``,
    the step is ``plan_batch``'s, up to ``batch``, extrapolated from batches the device holds. ``target`` is step
    bytes (the caller takes the training loop's other batches off it); ``target=None``: what the device holds now,
    less the optimizer's moments and the training loop's other batches at ``batch``, is the target (escalation, with
    the training state resident).
    """
    room = probe_room(m, 2**62 if target is None else target)
    if target is None:  # the optimizer's moments appear at the first step: keep room for them (AdamW: two)
        # and for the training loop's other batches, released with the failed step (``measure.loop_bytes``)
        less = 2 * grad_bytes(m) + loop_bytes(m, imgsz, batch, objects)
        free = None if room.device is None else room.device - less
        room = ProbeRoom(free if free is not None else room.target, free)
        target = room.target
    if room.device is None or room.device >= target:
        got = probe_step(m, imgsz, batch, objects, amp, room.limit)
        return got, False
    try:
        p = plan_batch(m, imgsz, target, 1.0, max_batch=batch, objects=objects, amp=amp, loop=False)
    except ValueError:
        return None, False
    return (p.measured_bytes if p.batch >= batch else None), p.extrapolated


def choose_plan(model: nn.Module, imgsz: int, batch: int, target: int, objects: int = 50,
                amp: torch.dtype | None = None, costs: Costs | None = None, measured: dict | None = None,
                sized: BatchFit | None = None, loss_modes: tuple = ()) -> Choice:
    """The candidate with the least predicted step time whose measured step at ``batch`` fits ``target`` bytes; its
    step is then timed at ``batch`` (``Choice.measured_seconds``) on a copy, in the memory just measured.

    Args:
        model: The model as it will train, plain (frozen layers already frozen), on its device.
        imgsz: Training image size.
        batch: Training batch.
        target: Bytes the step (model state, batch, step peak) must fit.
        objects: Labelled objects per image in the measured batches.
        amp: Autocast dtype of the run's forward, ``None`` for full precision.
        costs: ``unit_costs`` of this model, when already measured.
        measured: Steps already measured on this model at ``imgsz`` (``(units, modes, batch)`` keys, vanilla's units
            ``()``; ``Over`` values did not fit the target they were measured for), filled in as it measures, so
            that choosing for several targets measures each plan once (again only for a target larger than the one
            it did not fit).
        sized: The plan whose step set ``batch`` (``choose_plan_and_batch``), known to fit ``target`` there: taken
            when it is faster than every candidate measured to fit, or when none is, so that a batch set by a plan is
            never refused.
        loss_modes: The loss plans it may choose beside the layer plan (``loss.auto_loss_modes``; ``unit_costs``).

    Raises:
        NothingFits: One line when not even the plan that keeps the least fits, with a bound on what it needs.
    """
    costs = costs or unit_costs(model, imgsz, objects, amp, loss_modes)
    measured = {} if measured is None else measured
    fixed = state_bytes(model) + batch_bytes(model, imgsz, batch, objects)
    base_flops = batch * costs.plain.flops
    tried: list[Tried] = []
    extrapolated = False

    def measure(c: Candidate) -> int | None:
        nonlocal extrapolated
        key = (*c.key, batch)
        got = measured.get(key)
        if got is None or isinstance(got, Over) and got.target < target:  # a larger target may hold it: measure
            got, extra = measure_candidate(model, c, imgsz, batch, target, costs, objects, amp)
            got = measured[key] = Over(target) if got is None else got
            extrapolated |= extra
        got = None if isinstance(got, Over) else got
        tried.append(Tried(c, got))
        return got if got is not None and got <= target else None

    def chosen(c: Candidate, got: int, later: list) -> Choice:
        seconds = None if extrapolated else time_candidate(model, c, imgsz, batch, objects, amp)
        return Choice(c, c.plan(model), batch, got, target, base_flops, tried, later, costs, extrapolated, seconds)

    plain = no_recompute(costs, batch, fixed)
    if plain.predicted_bytes <= target * (1 + MARGIN) and (got := measure(plain)) is not None:
        return chosen(plain, got, [])
    ranked = candidates(costs, batch, fixed)
    fitting = [c for c in ranked if c.predicted_bytes <= target * (1 + MARGIN)]
    best = _fastest_fitting(fitting, target, measure, len(tried))
    if sized is not None:  # the same plan at this batch (its bytes and time predicted here)
        known = next(c for c in ranked if c.key == sized.candidate.key)
        if best is None or known.seconds < best[0].seconds:
            extrapolated |= sized.extrapolated
            tried.append(Tried(known, sized.step_bytes))
            best = (known, sized.step_bytes)
    if best:
        return chosen(*best, [a for a in fitting if a.seconds >= best[0].seconds and a != best[0]][:3])
    least_first = sorted(ranked, key=lambda c: (c.predicted_bytes, -c.flops))  # ``least_keeping`` first
    for c in least_first[:3]:
        if all(c != t.candidate for t in tried) and (got := measure(c)) is not None:
            return chosen(c, got, [])
    least = min(tried, key=lambda t: (t.measured is None, t.measured or 0, t.candidate.predicted_bytes)).candidate
    needed = needed_bytes(model, least, imgsz, batch, objects, amp)
    raise NothingFits(f"checkpoint_stages=auto: nothing fits {target / 2**30:.3f} GB at batch {batch}, imgsz "
                      f"{imgsz}; the plan that keeps the least ({describe(least)}) needs at most "
                      f"{needed / 2**30:.3f} GB", needed)


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


def time_candidate(model: nn.Module, c: Candidate, imgsz: int, batch: int, objects: int = 50,
                   amp: torch.dtype | None = None) -> float | None:
    """Median time of ``c``'s step at ``batch`` on a copy (``TIMED_STEPS``); ``None`` when it ran out of memory (a
    CUDA allocator may need more than the exact bytes counted). Call it only for a plan whose step was measured to
    fit: the timed steps are that step again, so they need the memory it was measured to need."""
    with c.copy(model) as m:
        data = training_batch(m, imgsz, batch, objects)
        return unless_oom(lambda: time_steps([m], data, TIMED_STEPS, amp)[0], next(model.parameters()).device)


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
                          amp: torch.dtype | None = None, max_batch: int = 1024, loss_modes: tuple = (),
                          costs: Costs | None = None) -> Choice:
    """AutoBatch with ``auto``: the largest batch any plan allows (at most ``max_batch``: Ultralytics caps AutoBatch at
    the training images), then the fastest plan (least predicted step time) that fits at that batch.

    The plans predicted to keep about the least are measured at the batch the first of them allows; the one measured
    to keep the least sets the batch (``plan_batch``), and is the choice there unless a faster plan is measured to fit
    (predictions at that batch may miss it: it is never refused). At every batch the training loop's other batches
    (``measure.loop_bytes``) count against the share, as ``plan_batch`` counts them: the choice's ``target_bytes``
    is the share less them, at its batch, as for a fixed batch. ``loss_modes``: the loss plans it may choose
    (``choose_plan``); ``costs``: this model's ``unit_costs`` at ``imgsz`` with those loss plans, when already measured.

    Raises:
        ValueError: When not even batch 1 fits with the plan that keeps the least.
    """
    costs = costs or unit_costs(model, imgsz, objects, amp, loss_modes)
    ranked = sorted(candidates(costs, 1, 0), key=lambda c: (c.predicted_bytes, c.seconds))
    near = [c for c in ranked if c.predicted_bytes <= ranked[0].predicted_bytes * (1 + MARGIN)][:MAX_MEASURED]
    target = int(fraction * budget)

    def largest(c: Candidate) -> BatchPlan:
        with c.copy(model) as m:
            return plan_batch(m, imgsz=imgsz, budget=budget, fraction=fraction, max_batch=max_batch, objects=objects,
                              amp=amp)

    def step_target(batch: int) -> int:  # the share less the loop's other batches at ``batch``
        return target - loop_bytes(model, imgsz, batch, objects)

    try:
        first = largest(near[0])
    except ValueError:
        raise ValueError(f"checkpoint_stages=auto: not even batch 1 fits {fraction:.0%} of {budget / 2**30:.3f} GB at "
                         f"imgsz {imgsz} with {describe(near[0])}") from None
    sizes = {}  # the plans predicted to keep about the least, measured at that batch: the least sets the batch
    measured = {}  # the same steps for ``choose_plan`` (a plan that did not fit there is not measured again)
    for c in near:
        got, extra = measure_candidate(model, c, imgsz, first.batch, step_target(first.batch), costs, objects, amp)
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
    return choose_plan(model, imgsz, sized.batch, step_target(sized.batch), objects, amp, costs, measured, sized,
                       loss_modes)


def escalations(costs: Costs, current: int, batch: int, fixed: int) -> list[Candidate]:
    """The plans predicted to keep less than ``current`` step bytes at ``batch``, least predicted step time first:
    where a run that ran out of memory goes next (the first of them is the next point of the Pareto front)."""
    return [c for c in candidates(costs, batch, fixed, loss=False) if c.predicted_bytes < current]
