"""The plans worth measuring: every combination of units and modes, cut to those no other plan beats
(Pareto) where the space is large, ranked by predicted step time; and the plans escalation walks to."""

from __future__ import annotations

import bisect
import dataclasses
import itertools
import math
from collections.abc import Iterator
from typing import NamedTuple

from torch import nn

from ..regions.graph import model_stages
from ..regions.recompute import MODES
from ..regions.settings import PlanSettings
from .costs import Costs, _layout
from .units import HEAD, NESTED, Candidate, is_joined

MAX_SPACE = 3**8  # candidate plans listed one by one at most; beyond, only those no other beats (``_front_plans``)


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
    joined = [u for u in costs.units if is_joined(u)]  # with neither of its stages, or not at all
    alone = [u for u in costs.units if not is_joined(u) and not any(u in j for j in joined)]
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
    """Whether ``units`` holds a stage twice: a joined unit (``UnitKind.JOINED``) and one of its stages."""
    return any(k in units for u in units if is_joined(u) for k in u)


class _Partial(NamedTuple):
    """Units decided so far (in ``costs.units`` order) and what ``Costs.predict`` adds up over them at batch 1."""

    units: tuple
    modes: tuple
    saved: int  # bytes no longer kept: what the forward and the units after these no longer hold
    seconds: float  # recompute time
    flops: int  # recompute FLOPs
    window: float  # the largest backward window of these units less the savings before each (-inf: no unit)


def _undominated(plans: list[_Partial]) -> list[_Partial]:
    """The plans no other beats — one with less time (or as much and fewer FLOPs), as much saving and no larger
    window — at most ``MAX_SPACE`` of them, fastest first. Taken in that order, only earlier plans can beat a plan,
    and of those only the staircase of (saving, window) matters: along it the window grows with the saving, so the
    first step saving at least as much has the least window of all that do."""
    kept: list[_Partial] = []
    saved: list[int] = []  # the staircase: savings ascending, windows ascending with them
    windows: list[float] = []
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
        plans = [_Partial((), (), 0, 0.0, 0, -math.inf)]  # no unit yet: no window (the identity of ``max``)
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


def no_recompute(costs: Costs, batch: int, fixed: int) -> Candidate:
    """The plain step as a candidate: no recompute (Ultralytics' loss where planning weighs the loss), its bytes
    predicted from batch 1 (never measured at a batch it may not fit)."""
    return candidate(costs, (), (), batch, fixed, "none" if costs.loss else None)


def least_keeping(costs: Costs, batch: int = 1, fixed: int = 0) -> Candidate:
    """The layer plan predicted to keep the least at ``batch`` (a tie: the one that recomputes more), with the loss
    the run has: where escalation's layer plans end (the loss comes after them, ``run_facts.loss_escalation``).
    Nested plans and parts count: in yolo11n at 160 px it recomputes every stage with its block layers' parts
    nested inside, where plans take a mode per region."""
    return min(candidates(costs, batch, fixed, loss=False), key=lambda c: (c.predicted_bytes, -c.flops))


def deepest(model: nn.Module) -> PlanSettings:
    """The settings of the plan that recomputes the most, known without measuring anything: every unit (each stage,
    the stem in stage 2's region, the neck, the head layer) full, and each of its block layers' parts a full region
    nested inside (``NESTED``).
    Escalation takes it as the plan that keeps the least until the units are measured (``least_keeping``). Builds
    ``checkpoint_layers=head`` with a dry run: call it where memory is free."""
    head = tuple((r[0], r[-1]) for r in PlanSettings.of(layers=HEAD).resolve(model).layer_regions)
    layout = _layout(model, model_stages(model), head)
    joined = {k for w in layout if is_joined(w.unit) for k in w.unit}  # the stem in stage 2's region
    layout = tuple(w for w in layout if w.unit not in joined)
    modes = tuple(NESTED if w.nests else "full" for w in layout)
    return Candidate(tuple(w.unit for w in layout), modes, 0, 0, head, layout=layout).settings


def nested_in_first_region(settings: PlanSettings) -> PlanSettings:
    """``settings`` with parts nested only in its first region (the stem's, recomputed last in backward): the plan
    that keeps the least under ``torch.compile``.

    Under compile a nested region's inputs are saved from the forward for the whole backward (the partitioner
    recomputes a node once, where eager recomputes a nested region twice), so nesting pays only where the enclosing
    region's recompute is the step's peak: the stem's, at the highest resolution, when the least else is kept.

    Examples:
        >>> nested_in_first_region(PlanSettings.of([], layers=["0-2", "2.*", "3-4", "4.*"])).layers
        ('0-2', '2.*', '3-4')
    """
    first, *rest = settings.layers
    a, _, b = str(first).partition("-")
    stem = range(int(a), int(b or a) + 1)
    kept = [item for item in rest if "." not in str(item) or int(str(item).split(".")[0]) in stem]
    return dataclasses.replace(settings, layers=(first, *kept))


def head_in_parts(settings: PlanSettings) -> PlanSettings:
    """``nested_in_first_region(settings)`` with its last layer (the head's: Detect on detectors) checkpointed as
    that layer's parts, each a region of its own, where ``settings`` nests them: the plan that keeps the least with
    regions compiled apart (``compile_regions=apart``).

    Apart, the head layer recomputed whole holds every branch's activations at once, its parts one branch at a time;
    where that recompute is the step's peak (many classes), the peak falls (yolo11n at 640 px, batch 4, 80 classes:
    274.9 -> 245.6 MiB, ``benchmarks/compiled_memory.py --apart least-stem least-apart``); where the stem's is (2
    classes), nothing changes.

    Examples:
        >>> head_in_parts(PlanSettings.of([], layers=["0-2", "2.*", "3-4", "4.*", "23", "23.*"])).layers
        ('0-2', '2.*', '3-4', '23.*')
    """
    stem = nested_in_first_region(settings)
    *rest, last = stem.layers
    parts = f"{last}.*"
    return dataclasses.replace(stem, layers=(*rest, parts if parts in settings.layers else last))


def escalations(costs: Costs, current: int | None, batch: int, fixed: int) -> list[Candidate]:
    """The plans predicted to keep less than ``current`` step bytes at ``batch`` (``None``: a step over what the
    device holds, so every plan), least predicted step time first: where a run that ran out of memory goes next (the
    first of them is the next point of the Pareto front)."""
    return [c for c in candidates(costs, batch, fixed, loss=False) if current is None or c.predicted_bytes < current]
