"""The trainer's side of the run's memory decisions: at Ultralytics' hooks, read plain values off the trainer
(``run_facts``), hand them to its ``RunMemory`` (``trainer.run_memory``), and apply what it decides: the batch, the
plan in ``args`` and args.yaml, the validator's loader, the restart after an escalation.

- ``auto_batch``: AutoBatch on the checkpointed model: Ultralytics' own on CUDA, for ``memory_budget`` or a simulated
  device ``RunMemory.batch_for_budget``, with ``checkpoint_stages=auto`` the plan and the batch together;
- ``choose_auto_plan`` (``on_pretrain_routine_end``): ``auto`` for a fixed batch, once the model is on its device,
  frozen and batched; ``plan_validation_for_device`` then plans the validator's batch for every other run whose
  device says its memory;
- ``validate_within_memory``: validation retried at a smaller batch after an out-of-memory error;
- ``hold_batch`` (before Ultralytics builds its loaders) and ``escalation_point`` (``on_train_epoch_start``): in
  Ultralytics' first-epoch out-of-memory retry, a plan that keeps less before the batch halves.

Under DDP rank 0 decides ``auto`` and every rank installs what it broadcasts.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
from torch import nn
from ultralytics.engine.trainer import BaseTrainer
from ultralytics.utils import LOCAL_RANK, LOGGER, RANK

from ..memory.device import device_memory, is_oom, release
from ..memory.step import grad_bytes, planned_copy
from ..planning import compiled
from ..planning.autobatch import parse_memory
from ..planning.escalation import Snapshot
from ..planning.random_state import Generators, random_state_kept
from ..regions.install import checkpoint_mode, checkpoint_plan, network
from ..regions.loss.install import auto_loss_modes, enable_loss_checkpointing, loss_checkpointing
from ..regions.plan import CheckpointPlan
from ..regions.recompute import compile_regions_apart
from ..regions.settings import VANILLA, PlanSettings
from ..regions.spec import CheckpointConfigError, word
from ..report.summary import PREFIX
from .auto import AUTOBATCH
from .distributed import from_rank0
from .run_facts import (
    dataset_facts,
    loss_escalation,
    memory_fraction,
    objects,
    planning_imgsz,
    record_settings,
    settings_of,
    step_shape,
    validation_of,
)
from .run_memory import smallest_device
from .settings import is_auto, is_least


def auto_batch(trainer: Any) -> int:
    """AutoBatch for the checkpointed model, and what the same memory gives without checkpointing
    (``run_memory.batch_without``).

    It gathers the same dataset facts as Ultralytics' ``DetectionTrainer.auto_batch``: the most labels in one image,
    x4 for mosaic, and the number of training images. Both batches are measured on copies of the model. Without
    ``memory_budget``, a CUDA device gets Ultralytics' own AutoBatch (on the checkpointed model) and a simulated
    device is planned for its size; any other device keeps Ultralytics' default batch.
    """
    max_num_obj, dataset_size = dataset_facts(trainer)
    if is_least(trainer.args.checkpoint_stages):  # the plan first: the batch is AutoBatch's for it
        least_plan(trainer, max(max_num_obj, 1), 1)
    simulated = trainer.device.type != "cuda" and device_memory(trainer.device) is not None
    if trainer.args.memory_budget is None and trainer.device.type != "cuda" and not simulated:
        LOGGER.info(f"{AUTOBATCH}set memory_budget (e.g. memory_budget=24GB) to plan without CUDA")
        return BaseTrainer.auto_batch(trainer, max_num_obj, dataset_size)
    if is_auto(trainer.args.checkpoint_stages):
        batch = auto_plan(trainer, max(max_num_obj, 1), autobatch=True, dataset_size=dataset_size)
        return compiled_batch(trainer, batch, max(max_num_obj, 1))
    model, memory = trainer.model, trainer.run_memory
    plain = network(model)
    described = (checkpoint_plan(plain) or CheckpointPlan()).describe(checkpoint_mode(plain))
    if loss := loss_checkpointing(plain):  # measured with the plan: the copies carry it
        described += f" + checkpoint_loss={loss}"
    if trainer.args.memory_budget is not None or simulated:
        with random_state_kept(Generators.TORCH):
            target = memory.aim(trainer.device, trainer.args.memory_budget, memory_fraction(trainer))
            batch = memory.batch_for_budget(plain, step_shape(trainer, max(max_num_obj, 1)), target, described,
                                            dataset_size, validation_of(trainer))
        return compiled_batch(trainer, batch, max(max_num_obj, 1))
    try:
        trainer.model = plain  # Ultralytics profiles a deepcopy: the plan comes along
        batch = BaseTrainer.auto_batch(trainer, max_num_obj, dataset_size)
        with planned_copy(plain, VANILLA) as trainer.model:  # without: no layer plan, Ultralytics' loss
            with random_state_kept(Generators.TORCH):  # Ultralytics' own AutoBatch draws once, as in vanilla
                memory.batch_without = BaseTrainer.auto_batch(trainer, max_num_obj, dataset_size)
    finally:
        trainer.model = model
    LOGGER.info(f"{AUTOBATCH}batch {batch} with {described} ({memory.batch_without} without)")
    return batch


def compiled_batch(trainer: Any, batch: int, objects: int) -> int:
    """AutoBatch's ``batch``, chosen from eager steps, as a ``compile=True`` run trains it: halved until the run's
    compiled step (its plan, ``compile_memory_budget``, ``compile_regions``) fits the share
    (``RunMemory.confirm_compiled``); the batch itself without compile."""
    if not trainer.args.compile:
        return batch
    candidate = compiled.CompiledCandidate(settings_of(trainer), getattr(trainer.args, "compile_memory_budget", None),
                                           regions="apart" if regions_apart(trainer) else "graph")
    return trainer.run_memory.confirm_compiled(network(trainer.model), step_shape(trainer, objects), batch, candidate,
                                               validation_of(trainer), memory_fraction(trainer))


def record_planned_batch(trainer: Any) -> None:
    """``on_pretrain_routine_end``: where AutoBatch chose the batch, args.yaml records it, as last.pt's training
    arguments do, so that a run trained again from args.yaml (``cfg=``, tuning's next iterations) trains at it."""
    if trainer.run_memory.batch_planned:
        record_settings(trainer)


def choose_auto_plan(trainer: Any) -> None:
    """Resolve ``checkpoint_stages=auto`` or ``least`` for a fixed batch at ``on_pretrain_routine_end``: the model is
    on its device, frozen and batched by then (AutoBatch resolves them earlier, in ``auto_batch``)."""
    if is_auto(trainer.args.checkpoint_stages):
        auto_plan(trainer, objects(trainer))
    elif is_least(trainer.args.checkpoint_stages):
        least_plan(trainer, objects(trainer), max(trainer.batch_size // max(trainer.world_size, 1), 1))


def least_plan(trainer: Any, objects: int, batch: int) -> None:
    """Resolve ``checkpoint_stages=least`` (``RunMemory.least_plan``) for ``batch`` images (per process) with
    ``objects`` each: record the plan in ``args`` (and args.yaml), install it, and say what to pass to train it again
    without measuring. Under DDP rank 0 measures and every rank installs what it broadcasts."""
    model = network(trainer.model)
    decision = None
    if RANK in {-1, 0}:
        try:
            decision = {"keys": trainer.run_memory.least_plan(model, step_shape(trainer, objects, batch)).keys()}
        except CheckpointConfigError as e:
            decision = {"error": str(e)}
    if RANK != -1:
        decision = from_rank0(decision)
    if "error" in decision:
        raise CheckpointConfigError(decision["error"])
    record_settings(trainer, decision["keys"])
    settings = settings_of(trainer)
    settings.install(model)
    LOGGER.info(f"{PREFIX} checkpoint_stages=least: {settings.resolve(model).describe(settings.mode)}, of the plans "
                f"predicted to keep the least the one measured keeping the least at imgsz={planning_imgsz(trainer)}, "
                f"batch {batch}; to train it again "
                f"without measuring, pass {settings}")


def plan_validation_for_device(trainer: Any) -> None:
    """``on_pretrain_routine_end``, after ``choose_auto_plan``: a run whose training nothing planned to a share (a
    fixed plan or vanilla, at a fixed batch) on a device that says its memory, or with ``memory_budget``, gets the
    validator's batch planned too (``RunMemory.fit_validation``), so that validation fits where training does. One
    process only: under DDP the ranks validate together."""
    memory = trainer.run_memory
    budget = trainer.args.memory_budget
    if RANK != -1 or memory.target is not None or is_auto(trainer.args.checkpoint_stages):
        return  # AutoBatch for a budget and ``auto`` planned validation with the training step
    if budget is None and device_memory(trainer.device) is None:
        return  # nothing bounds this run's memory: Ultralytics' own validation
    model = network(trainer.model)
    shape = step_shape(trainer, objects(trainer), trainer.batch_size)
    line = memory.fit_validation(model, trainer.device, shape, validation_of(trainer), None,
                                 None if budget is None else parse_memory(budget), "validation planned for the device")
    if line:
        validate_at_planned_batch(trainer)
        LOGGER.info(line)


def auto_plan(trainer: Any, objects: int, autobatch: bool = False, dataset_size: int = 0) -> int:
    """Resolve ``checkpoint_stages=auto`` on copies of the model: choose, record in ``args`` (and args.yaml),
    install. With AutoBatch the batch is chosen too (at most the training images); returns the batch.

    Under DDP rank 0 chooses, for its share of the batch as Ultralytics splits it, and every rank installs what it
    broadcasts; "nothing fits" stops every rank with the same line, and any other error on rank 0 is broadcast before
    rank 0 raises it, so that no rank waits in the broadcast until the collective times out.
    """
    model = network(trainer.model)
    decision, failure = None, None
    if RANK != -1:
        trainer.run_memory.device = smallest_device(trainer.device)
    if RANK in {-1, 0}:
        try:
            with random_state_kept(Generators.TORCH):
                decision = decide(trainer, model, objects, autobatch, dataset_size)
        except CheckpointConfigError as e:
            decision = {"error": str(e)}
        except Exception as e:  # the other ranks wait in the broadcast: tell them, then raise it here
            if RANK == -1:
                raise
            failure, decision = e, {"failed": f"{type(e).__name__}: {e}"}
    if RANK != -1:  # the process group exists: Ultralytics set it up before _setup_train
        decision = from_rank0(decision)
    if failure is not None:
        raise failure
    if "failed" in decision:
        raise RuntimeError(f"checkpoint_stages=auto: rank 0 failed while planning ({decision['failed']})")
    if "error" in decision:
        raise CheckpointConfigError(decision["error"])
    written = trainer.args.checkpoint_loss
    record_settings(trainer, decision["settings"])
    trainer.run_memory.val_batch = decision["val_batch"]
    validate_at_planned_batch(trainer)
    settings_of(trainer).install(model)
    if "checkpoint_loss" in decision["settings"]:  # auto weighed the loss: its choice replaces the run's, also on
        # the EMA the validator computes its losses with (a fixed batch plans after Ultralytics made it)
        for m in (model, getattr(getattr(trainer, "ema", None), "ema", None)):
            if m is not None:
                enable_loss_checkpointing(m, trainer.args.checkpoint_loss)
        if written != trainer.args.checkpoint_loss:  # the log said what was written: say what trains
            LOGGER.info(f"{PREFIX} auto: checkpoint_loss={trainer.args.checkpoint_loss} chosen (checkpoint_loss="
                        f"{written} allowed it){'' if trainer.args.checkpoint_loss == 'chunked' else ': bit for bit'}")
    for line in decision["lines"]:
        LOGGER.info(line)
    budget = decision["settings"].get("compile_memory_budget")
    apart = " compile_regions=apart" if decision["settings"].get("compile_regions") == "apart" else ""
    LOGGER.info(f"{PREFIX} auto: to train this plan again without planning, pass "
                f"{PlanSettings.from_keys(decision['settings'])}"
                f"{'' if budget is None else f' compile_memory_budget={budget:g}'}{apart} (args.yaml holds them too)")
    return decision["batch"]


def decide(trainer: Any, model: nn.Module, objects: int, autobatch: bool, dataset_size: int) -> dict:
    """Rank 0's part of ``auto_plan``: the trainer's values handed to ``RunMemory.choose_plan``, and its choice as
    plain data (settings, batch, log lines, the validator's batch) for the broadcast."""
    memory = trainer.run_memory
    target = memory.aim(trainer.device, trainer.args.memory_budget, memory_fraction(trainer))
    batch = 1 if autobatch else max(trainer.batch_size // max(trainer.world_size, 1), 1)  # AutoBatch chooses its own
    choice = memory.choose_plan(model, step_shape(trainer, objects, batch), target, autobatch=autobatch,
                                images=dataset_size, buckets=grad_bytes(model) if trainer.world_size > 1 else 0,
                                loss_modes=auto_loss_modes(trainer.args.checkpoint_loss, trainer.args.task),
                                device=trainer.device, validation=validation_of(trainer),
                                compiled=bool(trainer.args.compile), apart=regions_apart(trainer))
    settings = choice.settings.keys()
    if choice.compiled:  # the budget measured, torch's default (None) included, and where its regions compiled
        settings["compile_memory_budget"] = choice.compile_budget
        settings["compile_regions"] = choice.regions
    return {"settings": settings, "batch": choice.batch, "lines": choice.lines, "val_batch": memory.val_batch}


def regions_apart(trainer: Any) -> bool:
    """Whether the run's ``compile_regions`` (given, or chosen by ``auto``) is ``apart``."""
    return bool(trainer.args.compile) and word(getattr(trainer.args, "compile_regions", None) or "graph") == "apart"


def apply_compile_budget(trainer: Any) -> None:
    """``on_pretrain_routine_end``, after ``auto``: ``compile_memory_budget`` (given, or chosen by ``auto``) into
    ``torch._functorch.config.activation_memory_budget``, which the partitioner reads when the model compiles at the
    first step, and ``compile_regions=apart`` (given, or chosen) switched on in the ``regions_compiled_apart`` the
    trainer's ``train`` holds, with the backend ``auto`` measures with (``planning.compiled.BACKEND``, Ultralytics');
    ``train`` puts torch's values back however training ends.

    Under compile, dynamo's cache is emptied first: a graph an earlier run in this process compiled for the same
    model class is otherwise reused (guards do not see the budget), partitioned under that run's budget."""
    budget = getattr(trainer.args, "compile_memory_budget", None)
    if trainer.args.compile:
        torch._dynamo.reset()
        compile_regions_apart(compiled.BACKEND if regions_apart(trainer) else None)
    if budget is not None and trainer.args.compile:
        torch._functorch.config.activation_memory_budget = float(budget)
        LOGGER.info(f"{PREFIX} compile_memory_budget={budget}: torch.compile's activation_memory_budget")


def validate_at_planned_batch(trainer: Any) -> None:
    """Give the validator the planned batch (``run_memory.val_batch``) where its loader exists already (``auto`` for
    a fixed batch chooses once Ultralytics built the loaders); later loaders get it from ``get_dataloader``."""
    loader, planned = getattr(trainer, "test_loader", None), trainer.run_memory.val_batch
    if planned is None or loader is None or loader.batch_size <= planned:
        return
    with random_state_kept(Generators.PYTHON):
        trainer.test_loader = trainer.get_dataloader(trainer.data[trainer.args.split], batch_size=planned,
                                                     rank=LOCAL_RANK, mode="val")
    if getattr(trainer, "validator", None) is not None:
        trainer.validator.dataloader = trainer.test_loader


def hold_batch(trainer: Any) -> None:
    """Before the loaders are built: at set-up, what escalation needs found while memory is free; in Ultralytics'
    first-epoch out-of-memory retry, which has just halved the batch, the batch put back when a plan that keeps less
    exists (``RunMemory.hold_batch``; ``escalation_point`` installs it when the epoch restarts)."""
    memory, model = trainer.run_memory, network(trainer.model)
    held = memory.escalation.pipeline_batch
    if held is None:
        memory.prepare_escalation(model, checkpoint_plan(model) is not None)
        return
    checkpoints = checkpoint_plan(model) is not None or memory.escalation.planned  # auto chose vanilla?
    if RANK == -1 and memory.hold_batch(trainer.batch_size, settings_of(trainer), checkpoints,
                                        loss_escalation(trainer)):
        trainer.args.batch = trainer.batch_size = held


def escalation_point(trainer: Any) -> None:
    """``on_train_epoch_start`` of the first epoch: remember where it starts; after an out-of-memory error that
    ``hold_batch`` kept the batch for, move to the next plan and restart from that point.

    Registered before the epoch memory meter starts, so the planning copies are not the epoch's peak.
    """
    state = trainer.run_memory.escalation
    if trainer.epoch != trainer.start_epoch or RANK != -1:
        return
    model = network(trainer.model)
    if state.pending:
        # not a halving: Ultralytics counted it as one of its three (``_oom_retries``, private, checked against
        # ``versions.ULTRALYTICS_CHECKED``) and, being non-zero, it restarted the epoch (that decision is behind us
        # now); give it back, so that the halvings left are vanilla's. Escalation ends: each plan keeps less than the
        # last, and the one that keeps least halves.
        trainer._oom_retries -= 1
        escalate(trainer, model)
        if state.snapshot is not None and trainer.ema.updates == state.snapshot.ema_updates:  # no optimizer step yet
            state.snapshot.restore(model)
        else:
            LOGGER.info(f"{PREFIX} optimizer steps were taken before the error: training goes on from them, as "
                        f"Ultralytics' own retry does")
    elif state.snapshot is None and checkpoint_plan(model) is not None:
        state.snapshot = Snapshot.take(model, trainer.ema.updates)


def escalate(trainer: Any, model: nn.Module) -> None:
    """Install the next plan (``RunMemory.escalate``), record it, say so, and plan validation again for it."""
    memory = trainer.run_memory
    shape = step_shape(trainer, objects(trainer), trainer.batch_size)
    done = memory.escalate(model, trainer.device, settings_of(trainer), shape, loss_escalation(trainer))
    record_settings(trainer, done.settings.keys())
    LOGGER.warning(done.line)
    if line := memory.fit_validation(model, trainer.device, shape, validation_of(trainer), done.measured):
        validate_at_planned_batch(trainer)
        LOGGER.info(line)


def validate_within_memory(trainer: Any, run: Callable[[], Any], what: str = "validation") -> Any:
    """Ultralytics' ``validate`` or ``final_eval`` (``run``), retried after an out-of-memory error instead of ending
    the run.

    Ultralytics' own retry covers the first training epoch only; validation comes after it and before
    ``save_model``, so an error there would end the run with the epoch's weights unsaved. In one process the
    validator retries at half the batch (kept for the rest of the run, the final evaluation included), down to one
    image, then without its loss (``RunMemory.after_validation_oom``); where even that does not fit, the epoch is not
    validated (its metrics the last validation's, no fitness) and its weights are saved as every epoch's are, or the
    final evaluation is left out (best.pt is saved already). Under DDP the ranks validate together, and an error
    stays the run's.
    """
    memory = trainer.run_memory
    while True:
        try:
            with _loss_left_out(trainer) if memory.val_without_loss and what == "validation" else nullcontext():
                return run()
        except Exception as e:
            if RANK != -1 or not is_oom(e):
                raise
        release(trainer.device)  # outside the handler: the error's frames, and the tensors they held, are gone
        batch = trainer.test_loader.batch_size
        if what != "validation" and batch == 1:  # the final evaluation computes no loss: nothing left to leave out
            LOGGER.warning(f"{PREFIX} the final evaluation does not fit one image: left out (best.pt is saved)")
            return None
        line = memory.after_validation_oom(batch)
        if line is None:
            LOGGER.warning(f"{PREFIX} validation does not fit one image without its loss: epoch {trainer.epoch + 1} "
                           f"is not validated (its metrics the last validation's); its weights are saved")
            return trainer.metrics, None
        LOGGER.warning(f"{PREFIX} {line.replace('validation', what, 1)}")
        validate_at_planned_batch(trainer)


@contextmanager
def _loss_left_out(trainer: Any) -> Iterator[None]:
    """The validator's model (the EMA) computes no loss: its loss items NaN, in the form the validator sums."""
    model, items = trainer.ema.ema, trainer.loss_items
    nan = ({k: torch.full_like(v, math.nan) for k, v in items.items()} if isinstance(items, dict)
           else torch.full_like(items, math.nan))
    model.loss = lambda batch, preds=None: (None, nan)
    try:
        yield
    finally:
        model.__dict__.pop("loss", None)
