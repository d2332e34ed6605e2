"""What the run's memory decisions need, read off an Ultralytics trainer as plain values: the step it trains
(``StepShape``), its validator (``Validation``), its settings and dataset facts.

The trainer's hooks (``memory_hooks``) read these and hand them to ``RunMemory``, as Ultralytics' ``auto_batch`` reads
the dataset's largest label count and hands it to ``check_train_batch_size``.
"""

from __future__ import annotations

import math
from typing import Any

from ultralytics.utils import RANK, YAML
from ultralytics.utils.patches import override_configs

from ..memory.step import StepShape
from ..planning.random_state import Generators, random_state_kept
from ..regions.install import network
from ..regions.loss.install import EXACT_REGION_TASKS, loss_checkpointing
from ..regions.settings import PlanSettings
from ..report.summary import training_formats
from .validation_batch import Validation


def settings_of(trainer: Any) -> PlanSettings:
    """The layer plan the trainer's args hold (``checkpoint_stages``, ``checkpoint_layers``, ``checkpoint_mode``; the
    loss plan is the run's, installed apart)."""
    return PlanSettings.from_keys(trainer.args).with_loss(None)


def record_settings(trainer: Any, settings: dict[str, Any] | None = None) -> None:
    """Set ``settings`` (our keys) on the trainer's args; args.yaml then holds the plan that trains, as last.pt does:
    resume restores it."""
    for k, v in (settings or {}).items():
        setattr(trainer.args, k, v)
    if RANK in {-1, 0}:
        YAML.save(trainer.save_dir / "args.yaml", vars(trainer.args))


def loss_escalation(trainer: Any) -> str | None:
    """The loss plan an out-of-memory error may escalate to once the layer plan keeps the least: ``exact`` where the
    run's loss is Ultralytics' own and its task has exact regions (instance segmentation: bit for bit, so the run stays
    vanilla's), else ``None``. ``chunked`` is never chosen by itself: it is not bitwise."""
    if loss_checkpointing(network(trainer.model)) is None and trainer.args.task in EXACT_REGION_TASKS:
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
    ``DetectionTrainer.auto_batch`` gathers them (and hands to ``BaseTrainer.auto_batch``)."""
    with override_configs(trainer.args, overrides={"cache": False}) as trainer.args:
        dataset = trainer.build_dataset(trainer.data["train"], mode="train", batch=16)
    labels = [x for x in getattr(dataset, "labels", []) if isinstance(x, dict) and "cls" in x]
    return max((len(x["cls"]) for x in labels), default=0) * 4, len(dataset)


VAL_AT_TRAINING_BATCH = {"obb", "semantic", "depth"}  # validated at the training batch, the rest at twice it


def validation_of(trainer: Any) -> Validation:
    """The run's validator as planning measures it (``Validation``): the most labelled objects in one validation image
    (no mosaic there), the number of images (the most Ultralytics' loader batches, ``build_dataloader``), its
    largest image side, the training batches it takes at once, and whether it runs in fp16 (``args.quantize``)."""
    dataset = getattr(getattr(trainer, "test_loader", None), "dataset", None)
    if dataset is None:  # AutoBatch runs before Ultralytics builds the loaders
        no_cache = override_configs(trainer.args, overrides={"cache": False})
        with random_state_kept(Generators.PYTHON), no_cache as trainer.args:
            dataset = trainer.build_dataset(trainer.data.get(trainer.args.split) or trainer.data["val"], mode="val",
                                            batch=16)
    labels = [x for x in getattr(dataset, "labels", None) or [] if isinstance(x, dict) and "cls" in x]
    return Validation(imgsz=validation_imgsz(trainer), objects=max(max((len(x["cls"]) for x in labels), default=0), 1),
                      images=len(dataset), per_training_batch=1 if trainer.args.task in VAL_AT_TRAINING_BATCH else 2,
                      half=trainer.device.type != "cpu" and bool(trainer.amp))


def validation_imgsz(trainer: Any) -> int:
    """The longest side of the validator's images. Ultralytics validates rectangular batches padded by half a stride
    (``build_yolo_dataset(..., pad=0.5)`` for mode "val", ``ultralytics/data/build.py``): at most
    ``ceil(imgsz / stride + 0.5) * stride``, 192 for ``imgsz=160`` at stride 32, 672 for 640. Semantic segmentation
    validates without the pad and depth at ``imgsz`` squares (the same function); classification ``imgsz`` crops."""
    stride = int(trainer.stride)
    pad = 0.0 if trainer.args.task in {"classify", "semantic", "depth"} else 0.5
    return math.ceil(trainer.args.imgsz / stride + pad) * stride


def memory_fraction(trainer: Any) -> float:
    """The share of memory a training step may use: ``batch=0.x``, else 0.6 (Ultralytics' AutoBatch default)."""
    return trainer.batch_size if 0 < trainer.batch_size < 1 else 0.6
