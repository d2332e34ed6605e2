"""In Ultralytics' first-epoch out-of-memory retry: the plan that keeps less at the same batch, installed before the
batch halves (``yolo_ckpt.planning.escalation``)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from ..memory.device import release, unless_oom
from ..memory.step import StepShape
from ..planning.costs import Costs, unit_costs
from ..planning.escalation import Snapshot, keeps_least, next_plan
from ..planning.random_state import Generators, random_state_kept
from ..planning.search import deepest, least_keeping
from ..regions.install import checkpoint_plan, enable_checkpointing
from ..regions.loss.install import enable_loss_checkpointing
from ..regions.plan import CheckpointPlan
from ..regions.settings import PlanSettings
from ..report.summary import PREFIX


@dataclass
class Escalation:
    """What escalation remembers across Ultralytics' first-epoch retry.

    Attributes:
        costs (Costs | None): Unit costs (auto's, or the first escalation's), from which escalation plans.
        snapshot (Snapshot | None): The first epoch's start, for an exact restart after an escalation.
        pipeline_batch (int | None): The batch the loaders were last built at.
        stages (list[int]): The model's stage numbers, found at set-up (no dry run may allocate in the retry).
        least (PlanSettings | None): The plan that keeps the least: ``search.deepest`` at set-up, the
            planner's ``least_keeping`` candidate once the units are measured.
        pending (bool): The retry kept the batch: install the next plan when the epoch restarts.
        planned (bool): ``auto`` planned this run eagerly: escalation may install a plan where it chose none.
    """

    costs: Costs | None = None
    snapshot: Snapshot | None = None
    pipeline_batch: int | None = None
    stages: list = field(default_factory=list)
    least: PlanSettings | None = None
    pending: bool = False
    planned: bool = False

    def measured(self, costs: Costs, batch: int) -> None:
        """The units' costs are known: escalation plans from them, and ends at their least-keeping candidate."""
        self.costs, self.least = costs, least_keeping(costs, batch).settings


@dataclass(frozen=True)
class Escalated:
    """The plan an escalation installed.

    Attributes:
        settings (PlanSettings): The plan now installed; its ``loss`` is set where the loss plan was escalated.
        line (str): The warning that says what changed and why.
        measured (int | None): The new plan's measured step bytes, ``None`` where none was measured.
    """

    settings: PlanSettings
    line: str
    measured: int | None


def escalate(model: nn.Module, device: torch.device, old: PlanSettings, shape: StepShape, loss: str | None,
             state: Escalation) -> Escalated:
    """Install the next plan on ``model`` after an out-of-memory error at ``shape`` with ``old``: a layer plan that
    keeps less, or, once the layer plan keeps the least, the loss plan ``loss`` (``run_facts.loss_escalation``).

    ``state``: the plan that keeps the least and the stages, found at set-up, and the
    units' costs, measured here the first time.
    """
    release(device)  # the failed step's tensors, held by the traceback until now
    if keeps_least(old, state.least, state.stages) and loss is not None:
        enable_loss_checkpointing(model, loss)
        now = (checkpoint_plan(model) or CheckpointPlan()).describe(old.mode)
        return Escalated(old.with_loss(loss),
                         f"{PREFIX} out of memory at batch {shape.batch} with {now}, the plan that keeps the least: "
                         f"escalated to checkpoint_loss={loss} (each image's mask loss recomputed, bit for bit) at the "
                         f"same batch instead of halving it", None)

    def plan() -> tuple[PlanSettings, int | None]:
        if state.costs is None:  # once: a second escalation at this imgsz plans from the same unit steps
            state.measured(unit_costs(model, shape), shape.batch)
        return next_plan(model, old, shape, state.costs)

    with random_state_kept(Generators.TORCH):  # training goes on from here, as after Ultralytics' own retry
        # a device that holds less than it said may not hold planning's copies: then the plan that keeps the least
        settings, measured = unless_oom(plan, device) or (state.least or deepest(model), None)
    plan = settings.resolve(model)
    enable_checkpointing(model, plan, settings.mode)
    how = (f"its step measured {measured / 2**30:.3f} GB, within what the device has free less the training loop's "
           f"other batches" if measured is not None
           else "none was measured to fit, so the plan that keeps the least; if it runs out too, the batch halves")
    return Escalated(settings, f"{PREFIX} out of memory at batch {shape.batch} with "
                               f"{old.resolve(model).describe(old.mode)}: escalated to {plan.describe(settings.mode)} "
                               f"at the same batch instead of halving it ({how})", measured)
