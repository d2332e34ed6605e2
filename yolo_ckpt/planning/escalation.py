"""Out of memory in the first epoch: recompute more at the same batch before Ultralytics halves it.

Ultralytics' first-epoch retry (``BaseTrainer._do_train``) halves the batch on any out-of-memory error and
restarts the epoch. A run that checkpoints can usually keep its batch by recomputing more instead: ``next_plan``
finds the cheapest plan predicted to keep less than the one that failed and measures it at the same batch on a copy,
within what the device has free once the failed step is released, less what the restarted epoch needs beside the
step (the optimizer's moments, the training loop's other batches: ``step.loop_bytes``); only when no plan keeps
less is the batch halved.

A restart after an escalation is the run a user would have started with the new plan: ``Snapshot`` keeps what the
failed step changed before any optimizer step (BatchNorm buffers, the random generators' states) and puts it back.

Examples:
    >>> snap = Snapshot.take(model, ema_updates=0)  # doctest: +SKIP
    >>> settings, measured = next_plan(model, PlanSettings.of([2, 3]), StepShape(640, 4))  # doctest: +SKIP
    >>> snap.restore(model)  # doctest: +SKIP
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..memory.step import StepShape, batch_bytes, planned_copy, state_bytes
from ..regions.settings import PlanSettings
from .choice import MAX_MEASURED, least_candidates, measure_candidate, measure_copy
from .costs import Costs, unit_costs
from .random_state import RandomState
from .search import escalations, least_keeping
from .units import HEAD, NECK, Candidate


@dataclass
class Snapshot:
    """What a training step changes before the optimizer steps: module buffers and the random generators.

    Attributes:
        buffers (list[torch.Tensor]): Clones of every buffer of the model (BatchNorm statistics), in order.
        rng (RandomState): Every random generator's state.
        ema_updates (int): EMA updates at the snapshot: equal later means no optimizer step happened since.
    """

    buffers: list
    rng: RandomState
    ema_updates: int

    @classmethod
    def take(cls, model: nn.Module, ema_updates: int) -> Snapshot:
        return cls([b.detach().clone() for b in model.buffers()], RandomState.take(), ema_updates)

    def restore(self, model: nn.Module) -> None:
        """Put the buffers (in place: the EMA and optimizer keep their tensors) and generators back."""
        with torch.no_grad():
            for b, s in zip(model.buffers(), self.buffers):
                b.copy_(s)
        self.rng.restore()


def _normal(settings: PlanSettings, stages: list[int]) -> tuple:
    """A layer plan in one spelling: ``all`` as every stage of ``stages``, layer items as strings, no loss."""
    spec = tuple(stages) if settings.stages == "all" else settings.stages
    layers = settings.layers if isinstance(settings.layers, str) else tuple(map(str, settings.layers or ()))
    return spec, layers, settings.mode


def keeps_least(settings: PlanSettings, least: PlanSettings | None, stages: list[int]) -> bool:
    """Whether ``settings`` are the plan that keeps the least, ``least``: nothing keeps less, so an out-of-memory
    error can only be met by a smaller batch. ``least`` is the planner's least-keeping candidate once the units are
    measured (``search.least_keeping``), before that ``search.deepest``; ``None`` (not known) keeps nothing least.
    Decided from the values alone: it is asked while the failed step still holds its memory, where no dry run may
    allocate."""
    return least is not None and _normal(settings, stages) == _normal(least, stages)


def _units(model: nn.Module, settings: PlanSettings, costs: Costs) -> tuple | None:
    """The planner's units of ``settings`` (stages, then neck and head for ``checkpoint_layers=head``), or ``None``
    for plans outside that space."""
    if settings.layers not in (None, HEAD):
        return None
    stages = PlanSettings.of(settings.stages).resolve(model).stages
    return (*stages, *(u for u in costs.units if u in (NECK, HEAD) and settings.layers))


def next_plan(model: nn.Module, settings: PlanSettings, shape: StepShape,
              costs: Costs | None = None) -> tuple[PlanSettings, int | None]:
    """Where a run that ran out of memory at ``shape.batch`` with ``settings`` goes: the cheapest plan predicted to
    keep less whose step of ``shape`` fits what the device has free now less the training loop's other batches
    (measured on copies; ``choice.measure_candidate``).

    The plans predicted to keep the least (``choice.least_candidates``) are measured first, until one fits: where
    none does, no other is measured, and the planner's least-keeping candidate is the answer (``search.least_keeping``,
    unmeasured: the next out-of-memory error then halves the batch). Otherwise the fastest of at most
    ``MAX_MEASURED`` measured to fit, or that one of the least-keeping.

    Args:
        model: The training model (plan installed or not); copies are measured, it never runs.
        settings: The failed plan (its layer keys: its loss plan is the run's).
        shape: The step that ran out of memory: image size, batch (per process), objects per image, the run's
            autocast dtype.
        costs: ``unit_costs`` of the model at ``shape.imgsz`` (auto measured them already), or ``None`` to measure
            them.

    Returns:
        (tuple): The next plan's settings and its measured step bytes (``None`` when not measured).
    """
    batch = shape.batch
    costs = costs or unit_costs(model, shape)
    fixed = state_bytes(model) + batch_bytes(model, shape)
    units, measured = _units(model, settings, costs), False
    if units is not None and all(u in costs.units for u in units) and units:
        current = fixed + costs.predict(units, settings.mode, batch)[0]
    elif units == ():
        current = fixed + costs.predict((), "full", batch)[0]
    else:  # a plan outside the units (layer lists, parts): its own step at the batch, measured as candidates are
        # (not its batch-1 step scaled to the batch: that scales the parameter gradients too, and at 160 px puts a
        # plan of parts above stage 1 alone, which keeps more)
        with planned_copy(model, settings) as m:
            got, _ = measure_copy(m, shape, None)
        current = got  # None: over what the device holds, so any plan measured to fit keeps less
        measured = True
    later = escalations(costs, current, batch, fixed)
    steps = {}

    def fits(c: Candidate) -> int | None:  # each plan measured once; its bytes where it fits
        if c.key not in steps:
            got, _ = measure_candidate(model, c, shape, None)
            # against a measured step, measured: a plan predicted to keep less may not (the failed plan itself, when
            # auto wrote it as a per-unit plan, would be chosen again)
            steps[c.key] = got if got is not None and (not measured or current is None or got < current) else None
        return steps[c.key]

    # those predicted to keep the least first, until one fits: where none does, no plan that keeps more is measured
    least = least_candidates(sorted(later, key=lambda c: (c.predicted_bytes, -c.flops)))
    fallback = next(((c, got) for c in least if (got := fits(c)) is not None), None)
    if fallback is None:
        return least_keeping(costs, batch, fixed).settings, None
    for c in later[:MAX_MEASURED]:
        if (got := fits(c)) is not None:
            return c.settings, got
    return fallback[0].settings, fallback[1]

