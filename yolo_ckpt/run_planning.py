"""The memory decisions of a training run, for a ``CheckpointMixin`` trainer: ``auto``, AutoBatch and escalation.

``yolo_ckpt.planner`` chooses plans for a model, a batch and a target; this module asks it on behalf of an Ultralytics
trainer, at the points of the run where Ultralytics decides too, and installs what it chose:

- ``auto_batch``: AutoBatch (``batch=-1``/``0.x``) on the checkpointed model: Ultralytics' own on CUDA, ``plan_batch``
  for ``memory_budget`` or a simulated device, ``choose_plan_and_batch`` with ``checkpoint_stages=auto``;
- ``choose_auto_plan`` (``on_pretrain_routine_end``): ``auto`` for a fixed batch, once the model is on its device,
  frozen and batched;
- ``hold_batch`` and ``escalation_point``: in Ultralytics' first-epoch out-of-memory retry, a plan that keeps less
  at the same batch before the batch halves (``yolo_ckpt.escalation``).

Every step it measures runs on a copy of the model, bounded by what the device has free (``device.unless_oom``): a
memory error there means "does not fit", never the end of the run. Under DDP rank 0 decides and every rank installs
what it broadcasts.

State lives on the trainer: ``memory_target`` and ``autobatch_without`` (read by the summary and loggers), and
``trainer.planning`` (a ``Planning``) for escalation.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn
from ultralytics.engine.trainer import BaseTrainer
from ultralytics.utils import LOCAL_RANK, LOGGER, RANK, YAML, colorstr
from ultralytics.utils.patches import override_configs
from ultralytics.utils.torch_utils import unwrap_model

from .autobatch import parse_memory, plan_batch, probe_room
from .device import DeviceMemory, cuda_peak, device_memory, release, unless_oom
from .escalation import Snapshot, keeps_least, next_plan
from .loss import LOSS_TASKS, auto_loss_modes, enable_loss_checkpointing, loss_checkpointing
from .measure import batch_bytes, grad_bytes, loop_bytes, planned_copy, state_bytes, validation_probe, weight_bytes
from .model import checkpoint_mode, checkpoint_plan, enable_checkpointing
from .planner import Costs, deepest, describe, least_keeping, loss_suffix, unit_costs
from .recompute import MODES
from .stages import CheckpointConfigError, CheckpointPlan, model_stages, word
from .summary import autocast_dtype

PREFIX = colorstr("checkpoint:")
KEYS = ("checkpoint_stages", "checkpoint_layers", "checkpoint_mode")  # the plan, as args hold it
VAL_AT_TRAINING_BATCH = {"obb", "semantic", "depth"}  # validated at the training batch, the rest at twice it
# (``BaseTrainer._build_train_pipeline``, 8.4.190)


def is_auto(stages: Any) -> bool:
    """Whether ``checkpoint_stages`` asks for the plan to be chosen (``auto``)."""
    return word(stages) == "auto"


@dataclass
class Planning:
    """What escalation remembers across Ultralytics' first-epoch retry.

    Attributes:
        costs (Costs | None): Unit costs (auto's, or the first escalation's), from which escalation plans.
        snapshot (Snapshot | None): The first epoch's start, for an exact restart after an escalation.
        pipeline_batch (int | None): The batch the loaders were last built at.
        stages (list[int]): The model's stage numbers, found at set-up (no dry run may allocate in the retry).
        least (dict | None): The settings of the plan that keeps the least: ``planner.deepest`` at set-up, the
            planner's ``least_keeping`` candidate once the units are measured.
        device (DeviceMemory | None): Under DDP, the device of the rank with the least usable memory
            (``smallest_device``), which rank 0 plans for.
        escalate (bool): The retry kept the batch: install the next plan when the epoch restarts.
    """

    costs: Costs | None = None
    snapshot: Snapshot | None = None
    pipeline_batch: int | None = None
    stages: list = field(default_factory=list)
    least: dict | None = None
    escalate: bool = False
    device: DeviceMemory | None = None

    def measured(self, costs: Costs, batch: int) -> None:
        """The units' costs are known: escalation plans from them, and ends at their least-keeping candidate."""
        self.costs, self.least = costs, least_keeping(costs, batch).settings


@contextmanager
def random_state_kept(device: torch.device) -> Iterator[None]:
    """Leave torch's generators (CPU, and the training CUDA device) as the block found them.

    Planning runs training steps on copies, and RT-DETR's decoder draws random denoising queries in every training
    forward: without this, the queries training draws afterwards would differ from vanilla Ultralytics'.
    """
    cuda = device.type == "cuda"
    with torch.random.fork_rng(devices=[device.index or 0] if cuda else [], device_type="cuda"):
        yield


@contextmanager
def python_random_kept() -> Iterator[None]:
    """Leave Python's and NumPy's generators as the block found them: building a dataset draws from them, and
    training's augmentations draw next, where vanilla Ultralytics builds none."""
    states = random.getstate(), np.random.get_state()
    try:
        yield
    finally:
        random.setstate(states[0])
        np.random.set_state(states[1])


def settings_of(trainer: Any) -> dict[str, Any]:
    """The plan the trainer's args hold (``checkpoint_stages``, ``checkpoint_layers``, ``checkpoint_mode``)."""
    return {k: getattr(trainer.args, k) for k in KEYS}


def record_settings(trainer: Any) -> None:
    """args.yaml holds the plan that trains, as last.pt does: resume restores it."""
    if RANK in {-1, 0}:
        YAML.save(trainer.save_dir / "args.yaml", vars(trainer.args))


def loss_escalation(trainer: Any) -> str | None:
    """The loss plan an out-of-memory error may escalate to once the layer plan keeps the least: ``exact`` where the
    run's loss is Ultralytics' own and its task has exact regions (instance segmentation: bit for bit, so the run stays
    vanilla's), else ``None``. ``chunked`` is never chosen by itself: it is not bitwise."""
    if loss_checkpointing(unwrap_model(trainer.model)) is None and trainer.args.task in LOSS_TASKS["exact"]:
        return "exact"
    return None


def planning_imgsz(trainer: Any) -> int:
    """The largest image side the run trains at (``multi_scale`` included), a multiple of the stride."""
    return math.ceil(trainer.args.imgsz * (1 + trainer.args.multi_scale) / trainer.stride) * trainer.stride


def objects(trainer: Any) -> int:
    """Labelled objects per image planning measures: the most in one training image x4 (mosaic), as Ultralytics'
    AutoBatch counts them."""
    labels = getattr(getattr(trainer.train_loader, "dataset", None), "labels", None) or []
    counts = [len(x["cls"]) for x in labels if isinstance(x, dict) and "cls" in x]
    return max(max(counts, default=0) * 4, 1)


def dataset_facts(trainer: Any) -> tuple[int, int]:
    """The most labels in one image x4 (mosaic) and the number of training images, as Ultralytics'
    ``DetectionTrainer.auto_batch`` gathers them (8.4.190)."""
    with override_configs(trainer.args, overrides={"cache": False}) as trainer.args:
        dataset = trainer.build_dataset(trainer.data["train"], mode="train", batch=16)
    labels = [x for x in getattr(dataset, "labels", []) if isinstance(x, dict) and "cls" in x]
    return max((len(x["cls"]) for x in labels), default=0) * 4, len(dataset)


def memory_target(trainer: Any) -> tuple[int, float, str]:
    """``(budget bytes, share, what it is)`` of the run's memory decisions, in exact tensor bytes.

    ``memory_budget`` when given (on CUDA its allocator bytes are turned into tensor bytes with the device's
    ``ALLOCATOR_MARGIN``); otherwise the training device's usable memory — CUDA free plus what this process has
    reserved, as Ultralytics' AutoBatch counts it, or the simulated device. The share is 0.6, or ``batch=0.x``.
    """
    fraction = trainer.batch_size if 0 < trainer.batch_size < 1 else 0.6
    dev = trainer.planning.device or device_memory(trainer.device)
    if trainer.args.memory_budget is not None:
        budget = parse_memory(trainer.args.memory_budget)
        if dev is not None and budget > dev.total:
            LOGGER.warning(f"{PREFIX} memory_budget={trainer.args.memory_budget} is more than {dev.name} holds "
                           f"({dev.total / 2**30:.2f} GB): planning for the budget from steps that fit the device")
        source = f"memory_budget={trainer.args.memory_budget}"
    else:
        budget, source = dev.usable, f"{dev.name} usable memory"
    return (dev.tensor_bytes(budget) if dev is not None else budget), fraction, source


def smallest_device(trainer: Any) -> DeviceMemory | None:
    """Under DDP, the device with the least usable memory of every rank's (each reads its own: another rank's GPU may
    have less free than rank 0's), which rank 0 then plans the shared plan for; every rank must call it. The probes
    still run on rank 0's device, within what it has free."""
    import torch.distributed as dist

    devices = [None] * dist.get_world_size()
    dist.all_gather_object(devices, device_memory(trainer.device))
    known = [d for d in devices if d is not None]
    return min(known, key=lambda d: d.usable) if known else None


def auto_report(choice: Any, mode: str, how: str = "measured", capped: str = "") -> list[str]:
    """Log lines for ``auto``'s choice (a ``planner.Choice``): the trade-off table of the measured candidates and the
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

    It gathers the same dataset facts as Ultralytics' ``DetectionTrainer.auto_batch`` (8.4.190): the most labels in
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
        with random_state_kept(trainer.device):
            return plan_for_budget(trainer, plain, stages, max_num_obj, dataset_size)
    try:
        trainer.model = plain  # Ultralytics profiles a deepcopy: the plan comes along
        batch = BaseTrainer.auto_batch(trainer, max_num_obj, dataset_size)
        with planned_copy(plain, loss="none") as trainer.model:  # without: no layer plan, Ultralytics' loss
            with random_state_kept(trainer.device):  # Ultralytics' own AutoBatch draws once, as in vanilla
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
    imgsz = planning_imgsz(trainer)
    amp = autocast_dtype(trainer)
    kw = dict(imgsz=imgsz, budget=budget, fraction=fraction, objects=max(max_num_obj, 1), amp=amp)
    trainer.memory_target = int(fraction * budget)
    LOGGER.info(f"{colorstr('AutoBatch: ')}planning {fraction:.0%} of {source} at imgsz={imgsz}"
                f"{f' under {amp} autocast' if amp else ''} from measured training steps...")
    try:
        with planned_copy(model, None) as copy:
            chosen = plan_batch(copy, **kw)
    except ValueError as e:
        raise CheckpointConfigError(f"{e} with {stages}; raise memory_budget or lower imgsz") from None
    try:
        with planned_copy(model, loss="none") as plain:  # without: no layer plan, Ultralytics' loss
            without = str(plan_batch(plain, **kw).batch)
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
    held = batch_bytes(model, imgsz, batch, kw["objects"]) + loop_bytes(model, imgsz, batch, kw["objects"])
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
            with random_state_kept(trainer.device):
                decision = choose(trainer, model, objects, autobatch, dataset_size)
        except CheckpointConfigError as e:
            decision = {"error": str(e)}
        except Exception as e:  # the other ranks wait in the broadcast: tell them, then raise it here
            if RANK == -1:
                raise
            failure, decision = e, {"failed": f"{type(e).__name__}: {e}"}
    if RANK != -1:  # the process group exists: Ultralytics set it up before _setup_train
        import torch.distributed as dist

        box = [decision]
        dist.broadcast_object_list(box, 0)
        decision = box[0]
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
    enable_checkpointing(model, CheckpointPlan.from_spec(model, trainer.args.checkpoint_stages,
                                                         trainer.args.checkpoint_layers), trainer.args.checkpoint_mode)
    if "checkpoint_loss" in decision["settings"]:  # auto weighed the loss: its choice replaces the run's, also on
        # the EMA the validator computes its losses with (a fixed batch plans after Ultralytics made it, 8.4.190)
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
    from .planner import NothingFits, choose_plan, choose_plan_and_batch

    budget, fraction, source = memory_target(trainer)
    imgsz = planning_imgsz(trainer)
    amp = autocast_dtype(trainer)
    batch = None if autobatch else max(trainer.batch_size // max(trainer.world_size, 1), 1)
    cap = min(1024, dataset_size) if autobatch and dataset_size else 1024
    trainer.memory_target = int(fraction * budget)
    # DDP's gradient buckets: Ultralytics wraps the model in DistributedDataParallel with its default
    # gradient_as_bucket_view=False (8.4.190), which keeps a flat copy of every gradient beside the gradients
    # (tests/test_ddp.py: without this the two-rank epoch on a simulated device passes auto's share). AutoBatch is
    # single-process, so only a fixed batch meets them here.
    buckets = grad_bytes(model) if trainer.world_size > 1 else 0
    # The loop's other batches (measure.loop_bytes): without them a plan measured right at a 0.4x share trained 1.2 MB
    # past it (tests/test_device.py). A fixed batch's plan is chosen for the share less them; AutoBatch counts them
    # at every batch it weighs (planner.choose_plan_and_batch), so here they are per image.
    loop = loop_bytes(model, imgsz, batch or 1, objects)
    what = (f"the largest batch (at most the {cap} training images)" if autobatch and dataset_size
            else "the largest batch" if autobatch else f"batch {batch}")
    less = f" less DDP's gradient buckets ({buckets / 2**20:.1f} MiB)" if buckets else ""
    less += f" less the training loop's other batches ({loop / 2**20:.1f} MiB{' per image' if autobatch else ''})"
    LOGGER.info(f"{PREFIX} auto: choosing the plan with the least predicted step time that fits {fraction:.0%} of "
                f"{source}{less} at imgsz={imgsz}, {what}...")
    # the loss plans it may choose beside the layer plan: exact (bit for bit) where the task has it, chunked only
    # where the user wrote it
    loss_modes = auto_loss_modes(trainer.args.checkpoint_loss, trainer.args.task)
    start = time.perf_counter()
    try:
        if autobatch:
            choice = choose_plan_and_batch(model, imgsz, budget, fraction, objects, amp, max_batch=cap,
                                           loss_modes=loss_modes)
        else:
            choice = choose_plan(model, imgsz, batch, trainer.memory_target - buckets - loop, objects, amp,
                                 loss_modes=loss_modes)
    except NothingFits as e:  # say what would fit: the budget whose share covers the least-keeping plan
        # (choose_plan_and_batch's bound holds the loop's batches at its batch already)
        need = math.ceil((e.needed + buckets + (0 if autobatch else loop)) / fraction / 2**20)
        raise CheckpointConfigError(f"{e}: memory_budget={need}MB would fit it, or lower batch or imgsz") from None
    except ValueError as e:
        raise CheckpointConfigError(f"{e}; raise memory_budget or lower imgsz") from None
    trainer.planning.measured(choice.costs, choice.batch)  # escalation on out-of-memory starts from them
    s = choice.candidate.settings
    how = "extrapolated from batches the device holds" if choice.extrapolated else "measured"
    capped = f" (capped to the {cap} training images)" if autobatch and choice.batch == cap == dataset_size else ""
    lines = [f"{PREFIX} {line}" for line in auto_report(choice, s["checkpoint_mode"], how, capped)]
    lines.append(f"{PREFIX} auto: planned in {time.perf_counter() - start:.1f} s ({len(choice.costs.unit) + 1} timed "
                 f"batch-1 steps: vanilla, and each unit alone in each of its modes; {len(choice.tried)} candidates "
                 f"measured at batch {choice.batch})")
    if trainer.device.type == "cuda":
        lines.append(f"{PREFIX} auto: not confirmed on {trainer.device}: the batch was extrapolated beyond what it "
                     f"holds" if choice.extrapolated else confirm_on_cuda(trainer, model, s, choice.batch, imgsz,
                                                                          objects, amp))
    # the training loop's batches beside validation: the last one trained, and those the loop holds beside it
    held = buckets + batch_bytes(model, imgsz, choice.batch, objects) + loop_bytes(model, imgsz, choice.batch, objects)
    val_batch, line = plan_validation(trainer, model, choice.batch, trainer.memory_target, held,
                                      choice.measured_bytes + held - batch_bytes(model, imgsz, choice.batch, objects))
    lines.append(f"{PREFIX} auto: {line}")
    return {"settings": s, "batch": choice.batch, "lines": lines, "val_batch": val_batch}


def val_facts(trainer: Any) -> tuple[int, int]:
    """``(objects, images)`` of the validation set: the most labelled objects in one image (no mosaic there), which
    validation measures, and the number of images, the most Ultralytics' loader batches (``build_dataloader``,
    8.4.190)."""
    dataset = getattr(getattr(trainer, "test_loader", None), "dataset", None)
    if dataset is None:  # AutoBatch runs before Ultralytics builds the loaders
        with python_random_kept(), override_configs(trainer.args, overrides={"cache": False}) as trainer.args:
            dataset = trainer.build_dataset(trainer.data.get(trainer.args.split) or trainer.data["val"], mode="val",
                                            batch=16)
    labels = [x for x in getattr(dataset, "labels", None) or [] if isinstance(x, dict) and "cls" in x]
    return max(max((len(x["cls"]) for x in labels), default=0), 1), len(dataset)


def validation_imgsz(trainer: Any) -> int:
    """The longest side of the validator's images. Ultralytics validates rectangular batches padded by half a stride
    (``build_yolo_dataset(..., pad=0.5)`` for mode "val", ``ultralytics/data/build.py``, 8.4.190): at most
    ``ceil(imgsz / stride + 0.5) * stride``, 192 for ``imgsz=160`` at stride 32, 672 for 640. Semantic segmentation
    validates without the pad and depth at ``imgsz`` squares (the same function); classification ``imgsz`` crops."""
    stride = int(trainer.stride)
    pad = 0.0 if trainer.args.task in {"classify", "semantic", "depth"} else 0.5
    return math.ceil(trainer.args.imgsz / stride + pad) * stride


def plan_validation(trainer: Any, model: nn.Module, batch: int, target: int, held: int,
                    step: int) -> tuple[int | None, str]:
    """The validator's batch for a run training at ``batch`` (per process) within ``target`` bytes, and a log line.

    Ultralytics validates detection, segmentation, pose and classification at twice the training batch, at most the
    validation images (its loader batches no more): without a gradient, but with the training state resident, the
    EMA and (in the final evaluation) best.pt loaded beside it (``measure.validation_bytes``), and with the training
    loop's last batches still alive (``held``). Measured like a probe step, bounded by ``target`` and by what the
    device has free. ``None``: Ultralytics' own batch fits; else the largest batch measured to fit, found from the
    bound a batch-1 measurement gives (memory is ``a·b + c`` with ``c >= 0``, as ``autobatch`` states), which
    ``get_dataloader`` then gives the validator.

    Raises:
        CheckpointConfigError: When not even batch 1 validates within ``target``.
    """
    imgsz = validation_imgsz(trainer)
    half = trainer.device.type != "cpu" and bool(trainer.amp)  # the validator's fp16 rule (``args.quantize``)
    n, images = val_facts(trainer)
    default = min(batch if trainer.args.task in VAL_AT_TRAINING_BATCH else 2 * batch, max(images, 1))
    limit = probe_room(model, target - held).limit

    def measure(b: int) -> int | None:
        return validation_probe(model, imgsz, b, n, half, limit)

    if (got := measure(default)) is not None:
        peak = " (the run's peak)" if got + held > step else ""
        return None, (f"validation at batch {default} measured {(got + held) / 2**30:.3f} GB{peak} of "
                      f"{target / 2**30:.3f} GB")
    if (one := measure(1)) is None:
        raise CheckpointConfigError(f"validation at batch 1, imgsz {imgsz} does not fit {target / 2**30:.3f} GB beside "
                                    f"the training state and batch {batch}: raise memory_budget, or lower batch or "
                                    f"imgsz")
    static = state_bytes(model) + weight_bytes(model)
    b = min(max((limit - static) // max(one - static, 1), 1), default - 1)  # the bound from batch 1 fits
    while b > 1 and (got := measure(b)) is None:  # not a·b + c after all: step down to a measured fit
        b = max(b * 3 // 4, 1)
    got = one if b == 1 else got
    return b, (f"validation at Ultralytics' batch {default} does not fit {target / 2**30:.3f} GB (it would be the "
               f"run's peak): validating at batch {b}, measured {(got + held) / 2**30:.3f} GB")


def validate_at_planned_batch(trainer: Any) -> None:
    """Give the validator the planned batch (``trainer.val_batch``) where its loader exists already (``auto`` for a
    fixed batch chooses once Ultralytics built the loaders); later loaders get it from ``get_dataloader``."""
    loader = getattr(trainer, "test_loader", None)
    if trainer.val_batch is None or loader is None or loader.batch_size <= trainer.val_batch:
        return
    with python_random_kept():
        trainer.test_loader = trainer.get_dataloader(trainer.data[trainer.args.split], batch_size=trainer.val_batch,
                                                     rank=LOCAL_RANK, mode="val")
    if getattr(trainer, "validator", None) is not None:
        trainer.validator.dataloader = trainer.test_loader


def confirm_on_cuda(trainer: Any, model: nn.Module, settings: dict, batch: int, imgsz: int, objects: int,
                    amp: torch.dtype | None) -> str:
    """One measured step of the chosen plan on the CUDA device: the allocator's ``max_memory_reserved`` against the
    share of usable memory (tensor bytes were planned; this is what the allocator really takes)."""
    from .measure import step_loss, training_batch

    dev = device_memory(trainer.device)
    target = int(trainer.memory_target * dev.margin)

    def step() -> int:  # the device bounds it: a memory error is "does not fit" (``unless_oom``), never the run's
        with planned_copy(model, settings["checkpoint_stages"], settings["checkpoint_mode"],
                          settings["checkpoint_layers"] or None) as m:
            data = training_batch(m, imgsz, batch, objects)
            with cuda_peak(trainer.device) as peak:
                step_loss(m, data, amp).backward()
            return peak.reserved

    reserved = unless_oom(step, trainer.device)
    release(trainer.device)
    if reserved is None:
        return (f"{PREFIX} auto on {dev.name}: the chosen plan's step ran out of memory when confirmed (the allocator "
                f"needs more than the tensor bytes planned): escalation follows if training does too")
    verdict = "confirmed" if reserved <= target else "over the target: escalation follows an out-of-memory"
    return (f"{PREFIX} auto on {dev.name}: max_memory_reserved {reserved / 2**30:.3f} GB of {target / 2**30:.3f} GB "
            f"({verdict})")


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
            with random_state_kept(trainer.device):
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
        # not a halving: Ultralytics counted it as one of its three (``_oom_retries``, private, 8.4.190) and, being
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
        now = (checkpoint_plan(model) or CheckpointPlan()).describe(old["checkpoint_mode"] or "full")
        LOGGER.warning(f"{PREFIX} out of memory at batch {trainer.batch_size} with {now}, the plan that keeps the "
                       f"least: escalated to checkpoint_loss={loss} (each image's mask loss recomputed, bit for bit) "
                       f"at the same batch instead of halving it")
        replan_validation(trainer, model, None)
        return
    imgsz = planning_imgsz(trainer)
    amp = autocast_dtype(trainer)
    def plan() -> tuple[dict, int | None]:
        if state.costs is None:  # once: a second escalation at this imgsz plans from the same unit steps
            state.measured(unit_costs(model, imgsz, objects(trainer), amp), trainer.batch_size)
        return next_plan(model, old, imgsz, trainer.batch_size, objects(trainer), amp, state.costs)

    with random_state_kept(trainer.device):  # training goes on from here, as after Ultralytics' own retry
        # a device that holds less than it said may not hold planning's copies: then the plan that keeps the least
        settings, measured = unless_oom(plan, trainer.device) or (state.least or deepest(model), None)
    for k, v in settings.items():
        setattr(trainer.args, k, v)
    plan = CheckpointPlan.from_spec(model, settings["checkpoint_stages"], settings["checkpoint_layers"] or None)
    enable_checkpointing(model, plan, settings["checkpoint_mode"])
    record_settings(trainer)
    before = CheckpointPlan.from_spec(model, old["checkpoint_stages"], old["checkpoint_layers"] or None)
    how = (f"its step measured {measured / 2**30:.3f} GB, within what the device has free less the training loop's "
           f"other batches" if measured is not None
           else "none was measured to fit, so the plan that keeps the least; if it runs out too, the batch halves")
    LOGGER.warning(f"{PREFIX} out of memory at batch {trainer.batch_size} with "
                   f"{before.describe(old['checkpoint_mode'] or 'full')}: escalated to "
                   f"{plan.describe(settings['checkpoint_mode'])} at the same batch instead of halving it ({how})")
    replan_validation(trainer, model, measured)


def replan_validation(trainer: Any, model: nn.Module, step: int | None) -> None:
    """After an escalation, the validator's batch for the device that ran out: Ultralytics validates at twice the
    batch that escalation kept (the halving it replaced would have halved that too), and on a device nothing planned
    for (no ``memory_target``), or one that held less than it said, that validation ran out where training fit
    (``benchmarks/gpu_check.py``'s escalation at 192 px, 2026-12-04). Planned as ``auto`` plans it, within the
    device's usable memory (and the run's target, if any); ``step``: the escalated plan's measured step, if any."""
    dev = device_memory(trainer.device)
    if dev is None:  # nothing bounds validation
        return
    target = dev.tensor_bytes(dev.usable)
    target = target if trainer.memory_target is None else min(target, trainer.memory_target)
    imgsz, n, batch = planning_imgsz(trainer), objects(trainer), trainer.batch_size
    held = batch_bytes(model, imgsz, batch, n) + loop_bytes(model, imgsz, batch, n)
    with random_state_kept(trainer.device):
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
