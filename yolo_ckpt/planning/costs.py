"""What each unit costs, measured once per mode on a copy of the model: the bytes it stops keeping, its
backward window, the FLOPs and time its recompute adds (``Costs``), and the prediction of a plan's peak from them."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..memory.device import MemoryLimit, unless_oom
from ..memory.step import (
    StepShape,
    batch_bytes,
    grad_bytes,
    planned_copy,
    put_back_criterion,
    state_bytes,
    step_loss,
    time_steps,
    training_batch,
)
from ..memory.tracker import LiveTensorTracker
from ..regions.graph import joined_stages, model_parts, model_stages
from ..regions.recompute import MODES
from ..regions.settings import PlanSettings
from .autobatch import probe_room
from .units import HEAD, LOSS, NECK, UNIT_MODES, Candidate, Layout, is_joined

TIMED_STEPS = 3  # timed steps per planning copy (median): a unit's recompute time is its step's less vanilla's
# (0: no step is timed, every time is 0 s and plans rank by their FLOPs, ``candidates``' next key)


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
        mixed (bool): Plans take a mode per region (``unit_costs`` measures every model so): candidates may then
            recompute each unit in its own mode, its parts' modes included where the unit has block layers; false,
            one of ``full``/``selective`` for all units (the trade-off table's plans, as the user's keys write them).
        loss (dict): ``checkpoint_loss value -> Phases`` with only the loss recomputed, for the loss plans planning
            may choose (``install.auto_loss_modes``); empty where the loss plan is the run's (every copy carries it).
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
        alone = [(u,) for u in self.units if u not in after and not is_joined(u)]  # stages join by themselves
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


def _unit_phases(m: nn.Module, c: Candidate, shape: StepShape, last: int | None, timed: bool = True) -> Phases | None:
    """``Phases`` of ``c``'s step of ``shape`` at batch 1 on ``m`` (planning's copy; ``c`` is installed on it) within
    what the device has free, ``None`` when it does not fit; then, only when it fit and ``timed``, its step timed on
    the same copy and batch (the same step, so the memory it needs is what was just measured within the bound)."""
    c.installs.install(m)  # as ``Candidate.copy`` installs it
    room = probe_room(m).device  # step bytes the device holds for a probe now
    one = shape.at(1)
    data = training_batch(m, one)
    limit = None if room is None else room - state_bytes(m) - batch_bytes(m, one)
    device = next(m.parameters()).device
    phases = unless_oom(lambda: _phases(m, data, shape.amp, last, limit), device)
    if phases is None:
        return None
    # the same step again; still bounded by the device: a CUDA allocator may need more than the exact bytes
    seconds = unless_oom(lambda: time_steps([m], data, TIMED_STEPS if timed else 0, shape.amp)[0], device)
    return None if seconds is None else dataclasses.replace(phases, seconds=seconds)


def unit_costs(model: nn.Module, shape: StepShape, loss_modes: tuple = (), timed: bool = True,
               track: Callable[[Iterable, str], Iterable] | None = None) -> Costs:
    """Measure the plain step and each unit alone, in each mode (its parts' too where the model's plans take modes
    per region and the unit has block layers), at batch 1 (on copies of the model), each within what the device has
    free, and time each such step that fit. With ``loss_modes`` (``install.auto_loss_modes``) every step runs
    Ultralytics' loss, and each of those loss plans is measured alone too (``Costs.loss``); without, every step runs
    the loss plan ``model`` has. ``timed=False``: memory only, every time 0 s (for ``checkpoint_stages=least``).
    ``shape``: the steps' image size, objects per image and autocast dtype; its ``batch`` is not read (units are
    measured at batch 1). ``track``: a ``report.progress.Progress`` each probe is counted on.

    Raises:
        ValueError: When not even the plain step at batch 1 fits the device.
    """
    stages = model_stages(model)
    head = tuple((r[0], r[-1]) for r in PlanSettings.of(layers=HEAD).resolve(model).layer_regions)
    layout = _layout(model, stages, head)
    units = [w.unit for w in layout]
    where = {w.unit: w for w in layout}
    costs = {}
    # one copy for every probe, each plan installed in turn (a copy each took a third of planning on a simulated
    # device); its BatchNorm statistics move from probe to probe, which no step's bytes, FLOPs or time depend on,
    # and its loss is put back as the copy had it, so that every probe is the first step of a fresh copy
    probes = [(None, "full"), *((u, k) for u in units for k in UNIT_MODES
                                if k in MODES or where[u].nests and (k.regions or not is_joined(u))),
              *((LOSS, k) for k in loss_modes)]
    base = "none" if loss_modes else None  # the loss the network's probes run
    with planned_copy(model, PlanSettings(loss=base)) as m:
        criterion = getattr(m, "criterion", None)  # the loss a first step makes, as it had it (its bytes count)
        for unit, mode in probes if track is None else track(probes, f"{len(probes)} units of the model"):
            put_back_criterion(m, criterion)
            if unit == LOSS:  # the loss plan alone: the network plain
                c = Candidate((), "full", 0, 0, head, layout=layout, loss=mode)
            else:
                c = Candidate((unit,) if unit is not None else (), mode, 0, 0, head, layout=layout, loss=base)
            last = where[unit].ranges[-1][1] if unit not in (None, HEAD, LOSS) else None  # the head: backward first
            if (phases := _unit_phases(m, c, shape, last, timed)) is not None:
                costs[(unit, mode)] = phases
            elif unit is None:
                raise ValueError(f"checkpoint_stages=auto: a training step at batch 1, imgsz {shape.imgsz} does not "
                                 f"fit the device")
    units = [u for u in units if all((u, mode) in costs for mode in MODES)]
    plain = costs.pop((None, "full"))
    loss = {mode: costs.pop((LOSS, mode)) for mode in loss_modes if (LOSS, mode) in costs}
    return Costs(units, plain, {k: v for k, v in costs.items() if k[0] in units}, grad_bytes(model), head, layout,
                 mixed=True, loss=loss)


def _layout(model: nn.Module, stages: dict, head: tuple) -> tuple[Layout, ...]:
    """Each unit's ``Layout``. Its block layers (``Layout.nests``) are those whose parts are blocks of their own (a
    part with modules inside: C3k2's ``cv1``/``m.0``/``cv2``, Detect's branches), not a ``Conv``'s convolution and
    BatchNorm, which recomputed apart keep nothing less. Where the stem's output feeds only the next stage, the two
    are one unit too, after the second (plans of one mode for all take neither: ``Costs.groups``)."""
    parts = model_parts(model)

    def composite(i: int) -> bool:
        return any(next(model.model[i].get_submodule(p).children(), None) is not None
                   for p in parts.get(i, {}).get("", ()))

    def nests(ranges: tuple) -> tuple[int, ...]:
        return tuple(i for a, b in ranges for i in range(a, b + 1) if composite(i))

    spans = [(k, ((layers[0], layers[-1]),)) for k, layers in sorted(stages.items())]
    if len(stages) > 1 and (second := sorted(stages)[1]) in joined_stages(model):
        first = min(stages)
        at = next(i for i, (u, _) in enumerate(spans) if u == second) + 1
        spans.insert(at, ((first, second), ((stages[first][0], stages[second][-1]),)))
    spans += [(NECK, head[:-1])] if len(head) > 1 else []  # the head layer is the last region of the keyword's
    spans += [(HEAD, head[-1:])]
    return tuple(Layout(u, ranges, nests(ranges)) for u, ranges in spans)


def time_candidate(model: nn.Module, c: Candidate, shape: StepShape) -> float | None:
    """Median time of ``c``'s step of ``shape`` on a copy (``TIMED_STEPS``); ``None`` when it ran out of memory (a
    CUDA allocator may need more than the exact bytes counted). Call it only for a plan whose step was measured to
    fit: the timed steps are that step again, so they need the memory it was measured to need."""
    with c.copy(model) as m:
        data = training_batch(m, shape)
        return unless_oom(lambda: time_steps([m], data, TIMED_STEPS, shape.amp)[0], next(model.parameters()).device)
