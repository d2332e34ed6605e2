"""``checkpoint_stages=auto`` and AutoBatch (``batch=-1``/``0.x``) on the checkpointed model, for a trainer.

- ``auto_batch``: AutoBatch on the checkpointed model: Ultralytics' own on CUDA, ``plan_batch`` for ``memory_budget``
  or a simulated device, ``choose_plan_and_batch`` with ``checkpoint_stages=auto``;
- ``choose_auto_plan`` (``on_pretrain_routine_end``): ``auto`` for a fixed batch, once the model is on its device,
  frozen and batched.
"""

from __future__ import annotations

import math
import time
from typing import Any

from torch import nn
from ultralytics.engine.trainer import BaseTrainer
from ultralytics.utils import LOGGER, RANK, colorstr
from ultralytics.utils.torch_utils import unwrap_model

from ..memory.device import device_memory, release, unless_oom
from ..memory.step import StepShape, batch_bytes, grad_bytes, loop_bytes, planned_copy
from ..memory.tracker import cuda_peak
from ..planning.autobatch import plan_batch
from ..planning.choice import choose_plan, choose_plan_and_batch
from ..planning.random_state import Generators, random_state_kept
from ..planning.units import NothingFits, describe, loss_suffix
from ..regions.install import checkpoint_mode, checkpoint_plan
from ..regions.loss.install import auto_loss_modes, enable_loss_checkpointing, loss_checkpointing
from ..regions.plan import CheckpointPlan
from ..regions.recompute import MODES
from ..regions.settings import VANILLA, PlanSettings
from ..regions.spec import CheckpointConfigError
from .distributed import from_rank0
from .run_memory import (
    PREFIX,
    dataset_facts,
    memory_target,
    objects,
    record_settings,
    settings_of,
    smallest_device,
    step_shape,
)
from .settings import is_auto
from .validation_batch import plan_validation, validate_at_planned_batch


def auto_report(choice: Any, mode: str, how: str = "measured", capped: str = "") -> list[str]:
    """Log lines for ``auto``'s choice (a ``choice.Choice``): the trade-off table of the measured candidates and the
    choice, or a single line when vanilla fits (nothing was weighed, so there is no table)."""
    measured = f"{how} {choice.measured_bytes / 2**30:.3f} GB of {choice.target_bytes / 2**30:.3f} GB"
    c = choice.candidate
    if not c.recomputes:
        return [f"auto: vanilla fits at batch {choice.batch}{capped} ({measured}): nothing recomputed"]
    what = describe(c)
    if c.units and c.mode in MODES:  # the plan knows one mode only
        what = choice.plan.describe(mode) + loss_suffix(c)
    timed = f", measured {choice.measured_seconds:.3f} s" if choice.measured_seconds is not None else ""
    return [*(f"  {line}" for line in choice.table()),
            f"auto chose {what} at batch {choice.batch}{capped}: {1 + c.flops / choice.base_flops:.3f}x FLOPs, "
            f"step time predicted {c.seconds:.3f} s{timed}, {measured}"]


def auto_batch(trainer: Any) -> int:
    """AutoBatch for the checkpointed model, and what the same memory gives without checkpointing
    (``trainer.autobatch_without``).

    It gathers the same dataset facts as Ultralytics' ``DetectionTrainer.auto_batch``: the most labels in
    one image, x4 for mosaic, and the number of training images. Both batches are measured on copies of the model.
    Without ``memory_budget``, a CUDA device gets Ultralytics' own AutoBatch (on the checkpointed model) and a
    simulated device is planned for its size; any other device keeps Ultralytics' default batch.
    """
    max_num_obj, dataset_size = dataset_facts(trainer)
    simulated = trainer.device.type != "cuda" and device_memory(trainer.device) is not None
    if trainer.args.memory_budget is None and trainer.device.type != "cuda" and not simulated:
        LOGGER.info(f"{colorstr('AutoBatch: ')}set memory_budget (e.g. memory_budget=24GB) to plan without CUDA")
        return BaseTrainer.auto_batch(trainer, max_num_obj, dataset_size)
    if is_auto(trainer.args.checkpoint_stages):
        return auto_plan(trainer, max(max_num_obj, 1), autobatch=True, dataset_size=dataset_size)
    model = trainer.model
    plain = unwrap_model(model)
    stages = (checkpoint_plan(plain) or CheckpointPlan()).describe(checkpoint_mode(plain))
    if loss := loss_checkpointing(plain):  # measured with the plan: the copies carry it
        stages += f" + checkpoint_loss={loss}"
    if trainer.args.memory_budget is not None or simulated:
        with random_state_kept(Generators.TORCH):
            return plan_for_budget(trainer, plain, stages, max_num_obj, dataset_size)
    try:
        trainer.model = plain  # Ultralytics profiles a deepcopy: the plan comes along
        batch = BaseTrainer.auto_batch(trainer, max_num_obj, dataset_size)
        with planned_copy(plain, VANILLA) as trainer.model:  # without: no layer plan, Ultralytics' loss
            with random_state_kept(Generators.TORCH):  # Ultralytics' own AutoBatch draws once, as in vanilla
                trainer.autobatch_without = BaseTrainer.auto_batch(trainer, max_num_obj, dataset_size)
    finally:
        trainer.model = model
    LOGGER.info(f"{colorstr('AutoBatch: ')}batch {batch} with {stages} ({trainer.autobatch_without} without)")
    return batch


def plan_for_budget(trainer: Any, model: nn.Module, stages: str, max_num_obj: int, dataset_size: int) -> int:
    """AutoBatch for ``memory_budget`` (or the simulated device) on copies of the model (probe steps would move
    BatchNorm statistics).

    Steps are measured under the autocast dtype the run trains with, one copy at a time, each within the share and
    what the device has free, so planning itself stays inside the share it plans for.
    """
    budget, fraction, source = memory_target(trainer)
    shape = step_shape(trainer, max(max_num_obj, 1))  # its batch is what ``plan_batch`` chooses
    trainer.memory_target = int(fraction * budget)
    LOGGER.info(f"{colorstr('AutoBatch: ')}planning {fraction:.0%} of {source} at imgsz={shape.imgsz}"
                f"{f' under {shape.amp} autocast' if shape.amp else ''} from measured training steps...")
    try:
        with planned_copy(model, None) as copy:
            chosen = plan_batch(copy, shape, budget, fraction)
    except ValueError as e:
        raise CheckpointConfigError(f"{e} with {stages}; raise memory_budget or lower imgsz") from None
    try:
        with planned_copy(model, VANILLA) as plain:  # without: no layer plan, Ultralytics' loss
            without = str(plan_batch(plain, shape, budget, fraction).batch)
    except ValueError:
        without = "none fits"
    batch = min(chosen.batch, dataset_size or chosen.batch)
    cap = f", capped to the {dataset_size} training images" if batch < chosen.batch else ""
    how = (f"extrapolated from steps at batches {sorted(chosen.points)} that fit the device"
           if chosen.extrapolated else "measured")
    LOGGER.info(f"{colorstr('AutoBatch: ')}batch {chosen.batch} with {stages} ({without} without){cap}; "
                f"{how} {chosen.measured_bytes / 2**30:.2f} GB of {chosen.target_bytes / 2**30:.2f} GB, the "
                f"training loop's other batches ({chosen.loop_bytes / 2**20:.1f} MiB) included")
    trainer.autobatch_without = without
    held = batch_bytes(model, shape.at(batch)) + loop_bytes(model, shape.at(batch))
    trainer.val_batch, line = plan_validation(trainer, model, batch, trainer.memory_target, held,
                                              chosen.measured_bytes)
    LOGGER.info(f"{colorstr('AutoBatch: ')}{line}")
    return batch


def choose_auto_plan(trainer: Any) -> None:
    """Resolve ``checkpoint_stages=auto`` for a fixed batch at ``on_pretrain_routine_end``: the model is on its device,
    frozen and batched by then (AutoBatch resolves it earlier, in ``auto_batch``)."""
    if is_auto(trainer.args.checkpoint_stages):
        auto_plan(trainer, objects(trainer))


def auto_plan(trainer: Any, objects: int, autobatch: bool = False, dataset_size: int = 0) -> int:
    """Resolve ``checkpoint_stages=auto`` on copies of the model: choose, record in ``args`` (and args.yaml),
    install. With AutoBatch the batch is chosen too (at most the training images); returns the batch.

    Under DDP rank 0 chooses, for its share of the batch as Ultralytics splits it, and every rank installs what it
    broadcasts; "nothing fits" stops every rank with the same line, and any other error on rank 0 is broadcast before
    rank 0 raises it, so that no rank waits in the broadcast until the collective times out.
    """
    model = unwrap_model(trainer.model)
    decision, failure = None, None
    if RANK != -1:
        trainer.planning.device = smallest_device(trainer)
    if RANK in {-1, 0}:
        try:
            with random_state_kept(Generators.TORCH):
                decision = choose(trainer, model, objects, autobatch, dataset_size)
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
    for k, v in decision["settings"].items():
        setattr(trainer.args, k, v)
    trainer.val_batch = decision.get("val_batch")
    validate_at_planned_batch(trainer)
    record_settings(trainer)
    settings_of(trainer).install(model)
    if "checkpoint_loss" in decision["settings"]:  # auto weighed the loss: its choice replaces the run's, also on
        # the EMA the validator computes its losses with (a fixed batch plans after Ultralytics made it)
        for m in (model, getattr(getattr(trainer, "ema", None), "ema", None)):
            if m is not None:
                enable_loss_checkpointing(m, trainer.args.checkpoint_loss)
        if written != trainer.args.checkpoint_loss:  # the log said what was written: say what trains
            LOGGER.info(f"{PREFIX} auto: checkpoint_loss={trainer.args.checkpoint_loss} chosen (checkpoint_loss="
                        f"{written} allowed it){'' if trainer.args.checkpoint_loss == 'chunked' else ': bit for bit'}")
    for line in decision.get("lines", []):
        LOGGER.info(line)
    return decision["batch"]


def choose(trainer: Any, model: nn.Module, objects: int, autobatch: bool, dataset_size: int) -> dict:
    """Rank 0's part of ``auto_plan``: the choice as plain data (settings, batch, log lines) for the broadcast."""
    budget, fraction, source = memory_target(trainer)
    batch = None if autobatch else max(trainer.batch_size // max(trainer.world_size, 1), 1)
    shape = step_shape(trainer, objects, batch or 1)  # AutoBatch: its batch is what ``choose_plan_and_batch`` chooses
    cap = min(1024, dataset_size) if autobatch and dataset_size else 1024
    trainer.memory_target = int(fraction * budget)
    # DDP's gradient buckets: Ultralytics wraps the model in DistributedDataParallel with its default
    # gradient_as_bucket_view=False, which keeps a flat copy of every gradient beside the gradients
    # (tests/test_ddp.py: without this the two-rank epoch on a simulated device passes auto's share). AutoBatch is
    # single-process, so only a fixed batch meets them here.
    buckets = grad_bytes(model) if trainer.world_size > 1 else 0
    # The loop's other batches (step.loop_bytes): without them a plan measured right at a 0.4x share trains 1.2 MB
    # past it (tests/test_device.py). A fixed batch's plan is chosen for the share less them; AutoBatch counts them
    # at every batch it weighs (choice.choose_plan_and_batch), so here they are per image.
    loop = loop_bytes(model, shape)
    what = (f"the largest batch (at most the {cap} training images)" if autobatch and dataset_size
            else "the largest batch" if autobatch else f"batch {batch}")
    less = f" less DDP's gradient buckets ({buckets / 2**20:.1f} MiB)" if buckets else ""
    less += f" less the training loop's other batches ({loop / 2**20:.1f} MiB{' per image' if autobatch else ''})"
    LOGGER.info(f"{PREFIX} auto: choosing the plan with the least predicted step time that fits {fraction:.0%} of "
                f"{source}{less} at imgsz={shape.imgsz}, {what}...")
    # the loss plans it may choose beside the layer plan: exact (bit for bit) where the task has it, chunked only
    # where the user wrote it
    loss_modes = auto_loss_modes(trainer.args.checkpoint_loss, trainer.args.task)
    start = time.perf_counter()
    try:
        if autobatch:
            choice = choose_plan_and_batch(model, shape, budget, fraction, max_batch=cap, loss_modes=loss_modes)
        else:
            choice = choose_plan(model, shape, trainer.memory_target - buckets - loop, loss_modes=loss_modes)
    except NothingFits as e:  # say what would fit: the budget whose share covers the least-keeping plan
        # (choose_plan_and_batch's bound holds the loop's batches at its batch already)
        need = math.ceil((e.needed + buckets + (0 if autobatch else loop)) / fraction / 2**20)
        raise CheckpointConfigError(f"{e}: memory_budget={need}MB would fit it, or lower batch or imgsz") from None
    except ValueError as e:
        raise CheckpointConfigError(f"{e}; raise memory_budget or lower imgsz") from None
    trainer.planning.measured(choice.costs, choice.batch)  # escalation on out-of-memory starts from them
    s, chosen = choice.candidate.settings, shape.at(choice.batch)
    capped = autobatch and choice.batch == cap == dataset_size
    lines = _choice_lines(choice, f" (capped to the {cap} training images)" if capped else "",
                          time.perf_counter() - start)
    if trainer.device.type == "cuda":
        lines.append(f"{PREFIX} auto: not confirmed on {trainer.device}: the batch was extrapolated beyond what it "
                     f"holds" if choice.extrapolated else confirm_on_cuda(trainer, model, s, chosen))
    # the training loop's batches beside validation: the last one trained, and those the loop holds beside it
    held = buckets + batch_bytes(model, chosen) + loop_bytes(model, chosen)
    val_batch, line = plan_validation(trainer, model, choice.batch, trainer.memory_target, held,
                                      choice.measured_bytes + held - batch_bytes(model, chosen))
    lines.append(f"{PREFIX} auto: {line}")
    return {"settings": s.keys(), "batch": choice.batch, "lines": lines, "val_batch": val_batch}


def _choice_lines(choice: Any, capped: str, seconds: float) -> list[str]:
    """``auto``'s choice as log lines: its trade-off table, and what planning measured in how long."""
    how = "extrapolated from batches the device holds" if choice.extrapolated else "measured"
    lines = [f"{PREFIX} {line}" for line in auto_report(choice, choice.candidate.settings.mode, how, capped)]
    lines.append(f"{PREFIX} auto: planned in {seconds:.1f} s ({len(choice.costs.unit) + 1} timed batch-1 steps: "
                 f"vanilla, and each unit alone in each of its modes; {len(choice.tried)} candidates measured at "
                 f"batch {choice.batch})")
    return lines


def confirm_on_cuda(trainer: Any, model: nn.Module, settings: PlanSettings, shape: StepShape) -> str:
    """One measured step of ``shape`` with the chosen plan on the CUDA device: the allocator's ``max_memory_reserved``
    against the share of usable memory (tensor bytes were planned; this is what the allocator really takes)."""
    from ..memory.step import step_loss, training_batch

    dev = device_memory(trainer.device)
    target = int(trainer.memory_target * dev.margin)

    def step() -> int:  # the device bounds it: a memory error is "does not fit" (``unless_oom``), never the run's
        with planned_copy(model, settings.with_loss(None)) as m:  # the loss plan the model has
            data = training_batch(m, shape)
            with cuda_peak(trainer.device) as peak:
                step_loss(m, data, shape.amp).backward()
            return peak.reserved

    reserved = unless_oom(step, trainer.device)
    release(trainer.device)
    if reserved is None:
        return (f"{PREFIX} auto on {dev.name}: the chosen plan's step ran out of memory when confirmed (the allocator "
                f"needs more than the tensor bytes planned): escalation follows if training does too")
    verdict = "confirmed" if reserved <= target else "over the target: escalation follows an out-of-memory"
    return (f"{PREFIX} auto on {dev.name}: max_memory_reserved {reserved / 2**30:.3f} GB of {target / 2**30:.3f} GB "
            f"({verdict})")
