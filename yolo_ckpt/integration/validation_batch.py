"""Validation's batch: chosen so that validation fits what training fits, and set on the run's validator."""

from __future__ import annotations

import math
from typing import Any

from torch import nn
from ultralytics.utils import LOCAL_RANK
from ultralytics.utils.patches import override_configs

from ..memory.step import StepShape, state_bytes, validation_probe, weight_bytes
from ..planning.autobatch import probe_room
from ..planning.random_state import Generators, random_state_kept
from ..regions.spec import CheckpointConfigError

VAL_AT_TRAINING_BATCH = {"obb", "semantic", "depth"}  # validated at the training batch, the rest at twice it


def val_facts(trainer: Any) -> tuple[int, int]:
    """``(objects, images)`` of the validation set: the most labelled objects in one image (no mosaic there), which
    validation measures, and the number of images, the most Ultralytics' loader batches (``build_dataloader``)."""
    dataset = getattr(getattr(trainer, "test_loader", None), "dataset", None)
    if dataset is None:  # AutoBatch runs before Ultralytics builds the loaders
        no_cache = override_configs(trainer.args, overrides={"cache": False})
        with random_state_kept(Generators.PYTHON), no_cache as trainer.args:
            dataset = trainer.build_dataset(trainer.data.get(trainer.args.split) or trainer.data["val"], mode="val",
                                            batch=16)
    labels = [x for x in getattr(dataset, "labels", None) or [] if isinstance(x, dict) and "cls" in x]
    return max(max((len(x["cls"]) for x in labels), default=0), 1), len(dataset)


def validation_imgsz(trainer: Any) -> int:
    """The longest side of the validator's images. Ultralytics validates rectangular batches padded by half a stride
    (``build_yolo_dataset(..., pad=0.5)`` for mode "val", ``ultralytics/data/build.py``): at most
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
    EMA and (in the final evaluation) best.pt loaded beside it (``step.validation_bytes``), and with the training
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
        return validation_probe(model, StepShape(imgsz, b, n), half, limit)

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
    with random_state_kept(Generators.PYTHON):
        trainer.test_loader = trainer.get_dataloader(trainer.data[trainer.args.split], batch_size=trainer.val_batch,
                                                     rank=LOCAL_RANK, mode="val")
    if getattr(trainer, "validator", None) is not None:
        trainer.validator.dataloader = trainer.test_loader
