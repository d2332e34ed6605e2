"""In Ultralytics' first-epoch out-of-memory retry: a plan that keeps less at the same batch before the batch
halves (``yolo_ckpt.planning.escalation``), and validation planned again for it."""

from __future__ import annotations

from typing import Any

from torch import nn
from ultralytics.utils import LOGGER, RANK
from ultralytics.utils.torch_utils import unwrap_model

from ..memory.device import device_memory, release, unless_oom
from ..memory.step import batch_bytes, loop_bytes
from ..planning.costs import unit_costs
from ..planning.escalation import Snapshot, keeps_least, next_plan
from ..planning.random_state import Generators, random_state_kept
from ..planning.search import deepest
from ..regions.graph import model_stages
from ..regions.install import checkpoint_plan, enable_checkpointing
from ..regions.loss.install import enable_loss_checkpointing
from ..regions.plan import CheckpointPlan
from ..regions.settings import PlanSettings
from ..regions.spec import CheckpointConfigError
from .run_memory import (
    PREFIX,
    loss_escalation,
    objects,
    record_settings,
    settings_of,
    step_shape,
)
from .validation_batch import plan_validation, validate_at_planned_batch


def hold_batch(trainer: Any) -> None:
    """Before the loaders are built: in Ultralytics' first-epoch out-of-memory retry, which has just halved the
    batch, put the batch back when a plan that keeps less exists (``escalation_point`` installs it when the epoch
    restarts). Decided from the values alone: the failed step still holds its memory, where no dry run may allocate.
    """
    state, model = trainer.planning, unwrap_model(trainer.model)
    held = state.pipeline_batch
    checkpoints = checkpoint_plan(model) is not None or state.costs is not None  # auto may have chosen vanilla
    if held is not None and trainer.batch_size < held and RANK == -1 and checkpoints and (
            not keeps_least(settings_of(trainer), state.least, state.stages) or loss_escalation(trainer)):
        trainer.args.batch = trainer.batch_size = held
        state.escalate = True
    if held is None:  # set-up, memory free: a dry run may allocate now, not in the retry
        state.stages = sorted(model_stages(model))
        if state.least is None and checkpoint_plan(model) is not None:  # a plan that may escalate
            with random_state_kept(Generators.TORCH):
                state.least = deepest(model)


def escalation_point(trainer: Any) -> None:
    """``on_train_epoch_start`` of the first epoch: remember where it starts; after an out-of-memory error that
    ``hold_batch`` kept the batch for, move to the next plan and restart from that point.

    Registered before the epoch memory meter starts, so the planning copies are not the epoch's peak.
    """
    state = trainer.planning
    if trainer.epoch != trainer.start_epoch or RANK != -1:
        return
    model = unwrap_model(trainer.model)
    if state.escalate:
        state.escalate = False
        # not a halving: Ultralytics counted it as one of its three (``_oom_retries``, private) and, being
        # non-zero, it restarted the epoch (that decision is behind us now); give it back, so that the halvings left
        # are vanilla's. Escalation ends: each plan keeps less than the last, and the one that keeps least halves.
        trainer._oom_retries -= 1
        escalate_plan(trainer)
        if state.snapshot is not None and trainer.ema.updates == state.snapshot.ema_updates:  # no optimizer step yet
            state.snapshot.restore(model)
        else:
            LOGGER.info(f"{PREFIX} optimizer steps were taken before the error: training goes on from them, as "
                        f"Ultralytics' own retry does")
    elif state.snapshot is None and checkpoint_plan(model) is not None:
        state.snapshot = Snapshot.take(model, trainer.ema.updates)


def escalate_plan(trainer: Any) -> None:
    """Install the next plan after an out-of-memory error at this batch, record it, and say so in one line: a layer
    plan that keeps less, or, once the layer plan keeps the least, the loss recomputed (``loss_escalation``)."""
    state, model = trainer.planning, unwrap_model(trainer.model)
    old = settings_of(trainer)
    release(trainer.device)  # the failed step's tensors, held by the traceback until now
    if keeps_least(old, state.least, state.stages) and (loss := loss_escalation(trainer)):
        enable_loss_checkpointing(model, loss)
        trainer.args.checkpoint_loss = loss
        record_settings(trainer)
        now = (checkpoint_plan(model) or CheckpointPlan()).describe(old.mode)
        LOGGER.warning(f"{PREFIX} out of memory at batch {trainer.batch_size} with {now}, the plan that keeps the "
                       f"least: escalated to checkpoint_loss={loss} (each image's mask loss recomputed, bit for bit) "
                       f"at the same batch instead of halving it")
        replan_validation(trainer, model, None)
        return
    shape = step_shape(trainer, objects(trainer), trainer.batch_size)
    def plan() -> tuple[PlanSettings, int | None]:
        if state.costs is None:  # once: a second escalation at this imgsz plans from the same unit steps
            state.measured(unit_costs(model, shape), trainer.batch_size)
        return next_plan(model, old, shape, state.costs)

    with random_state_kept(Generators.TORCH):  # training goes on from here, as after Ultralytics' own retry
        # a device that holds less than it said may not hold planning's copies: then the plan that keeps the least
        settings, measured = unless_oom(plan, trainer.device) or (state.least or deepest(model), None)
    for k, v in settings.keys().items():
        setattr(trainer.args, k, v)
    plan = settings.resolve(model)
    enable_checkpointing(model, plan, settings.mode)
    record_settings(trainer)
    before = old.resolve(model)
    how = (f"its step measured {measured / 2**30:.3f} GB, within what the device has free less the training loop's "
           f"other batches" if measured is not None
           else "none was measured to fit, so the plan that keeps the least; if it runs out too, the batch halves")
    LOGGER.warning(f"{PREFIX} out of memory at batch {trainer.batch_size} with "
                   f"{before.describe(old.mode)}: escalated to "
                   f"{plan.describe(settings.mode)} at the same batch instead of halving it ({how})")
    replan_validation(trainer, model, measured)


def replan_validation(trainer: Any, model: nn.Module, step: int | None) -> None:
    """After an escalation, the validator's batch for the device that ran out: Ultralytics validates at twice the
    batch that escalation kept (the halving it replaced would have halved that too), and on a device nothing planned
    for (no ``memory_target``), or one that held less than it said, that validation can run out where training fits
    (``benchmarks/gpu_check.py``'s escalation at 192 px). Planned as ``auto`` plans it, within the
    device's usable memory (and the run's target, if any); ``step``: the escalated plan's measured step, if any."""
    dev = device_memory(trainer.device)
    if dev is None:  # nothing bounds validation
        return
    target = dev.tensor_bytes(dev.usable)
    target = target if trainer.memory_target is None else min(target, trainer.memory_target)
    batch = trainer.batch_size
    shape = step_shape(trainer, objects(trainer), batch)
    held = batch_bytes(model, shape) + loop_bytes(model, shape)
    with random_state_kept(Generators.TORCH):
        try:
            # an unmeasured step claims no peak: what validation measures plus ``held`` stays within ``target``
            val_batch, line = plan_validation(trainer, model, batch, target, held, target if step is None else step)
        except CheckpointConfigError as e:  # training fits: validation at Ultralytics' batch is the user's to lower
            LOGGER.warning(f"{PREFIX} after escalation: {e}")
            return
    if val_batch is not None:
        trainer.val_batch = val_batch
        validate_at_planned_batch(trainer)
    LOGGER.info(f"{PREFIX} after escalation: {line}")
