"""The memory facts of a training run, read from a ``CheckpointMixin`` trainer: the target, the batch's shape
(image size, objects per image), the device, the settings it trains with; and the random state kept across probes.

The memory decisions of a run (``auto``, AutoBatch, escalation, validation's batch) are made by
``yolo_ckpt.integration.auto``, ``validation_batch`` and ``oom_retry`` from these facts, at the points of the run where
Ultralytics decides too. Every step they measure runs on a copy of the model, bounded by what the device has free
(``device.unless_oom``): a memory error there means "does not fit", never the end of the run. Under DDP rank 0
decides and every rank installs what it broadcasts.

State lives on the trainer: ``memory_target`` and ``autobatch_without`` (read by the summary and loggers), and
``trainer.planning`` (a ``Planning``) for escalation.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from ultralytics.utils import LOGGER, RANK, YAML, colorstr
from ultralytics.utils.patches import override_configs
from ultralytics.utils.torch_utils import unwrap_model

from ..memory.device import DeviceMemory, device_memory
from ..memory.step import StepShape
from ..planning.autobatch import parse_memory
from ..planning.costs import Costs
from ..planning.escalation import Snapshot
from ..planning.search import least_keeping
from ..regions.loss.install import LOSS_TASKS, loss_checkpointing
from ..regions.settings import PlanSettings
from ..report.summary import training_formats
from .distributed import gather

PREFIX = colorstr("checkpoint:")


@dataclass
class Planning:
    """What escalation remembers across Ultralytics' first-epoch retry.

    Attributes:
        costs (Costs | None): Unit costs (auto's, or the first escalation's), from which escalation plans.
        snapshot (Snapshot | None): The first epoch's start, for an exact restart after an escalation.
        pipeline_batch (int | None): The batch the loaders were last built at.
        stages (list[int]): The model's stage numbers, found at set-up (no dry run may allocate in the retry).
        least (PlanSettings | None): The plan that keeps the least: ``search.deepest`` at set-up, the
            planner's ``least_keeping`` candidate once the units are measured.
        device (DeviceMemory | None): Under DDP, the device of the rank with the least usable memory
            (``smallest_device``), which rank 0 plans for.
        escalate (bool): The retry kept the batch: install the next plan when the epoch restarts.
    """

    costs: Costs | None = None
    snapshot: Snapshot | None = None
    pipeline_batch: int | None = None
    stages: list = field(default_factory=list)
    least: PlanSettings | None = None
    escalate: bool = False
    device: DeviceMemory | None = None

    def measured(self, costs: Costs, batch: int) -> None:
        """The units' costs are known: escalation plans from them, and ends at their least-keeping candidate."""
        self.costs, self.least = costs, least_keeping(costs, batch).settings


def settings_of(trainer: Any) -> PlanSettings:
    """The layer plan the trainer's args hold (``checkpoint_stages``, ``checkpoint_layers``, ``checkpoint_mode``; the
    loss plan is the run's, installed apart)."""
    return PlanSettings.from_keys(trainer.args).with_loss(None)


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


def step_shape(trainer: Any, per_image: int, batch: int = 1) -> StepShape:
    """The step the run's memory decisions measure: ``batch`` images (per process) at the largest side it trains at
    (``planning_imgsz``), ``per_image`` labelled objects in each, under the autocast dtype it trains with."""
    return StepShape(planning_imgsz(trainer), batch, per_image,
                     training_formats(trainer.args, trainer.device, trainer.amp)[0])


def dataset_facts(trainer: Any) -> tuple[int, int]:
    """The most labels in one image x4 (mosaic) and the number of training images, as Ultralytics'
    ``DetectionTrainer.auto_batch`` gathers them."""
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
    known = [d for d in gather(device_memory(trainer.device)) if d is not None]
    return min(known, key=lambda d: d.usable) if known else None
