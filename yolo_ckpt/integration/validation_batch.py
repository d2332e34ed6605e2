"""Validation's batch: chosen so that validation fits what training fits."""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from ..memory.step import StepShape, state_bytes, validation_probe, weight_bytes
from ..planning.autobatch import probe_room
from ..regions.spec import CheckpointConfigError


@dataclass(frozen=True)
class Validation:
    """The run's validator, as planning measures it.

    Attributes:
        imgsz (int): Its largest image side (``run_facts.validation_imgsz``).
        objects (int): The most labelled objects in one validation image.
        images (int): The validation images: the most Ultralytics' loader puts in one batch.
        per_training_batch (int): Ultralytics' validator batch over the training batch: 2, or 1 for the tasks it
            validates at the training batch.
        half (bool): Whether the validator runs in fp16.
    """

    imgsz: int
    objects: int
    images: int
    per_training_batch: int = 2
    half: bool = False

    def batch(self, training_batch: int) -> int:
        """Ultralytics' own validator batch for a run training at ``training_batch`` (per process)."""
        return min(self.per_training_batch * training_batch, max(self.images, 1))


@dataclass(frozen=True)
class ValidationPlan:
    """The validator's batch planning chose: ``batch`` is ``None`` where Ultralytics' own fits; ``line`` says why."""

    batch: int | None
    line: str


def plan_validation(model: nn.Module, validation: Validation, batch: int, target: int, held: int,
                    step: int) -> ValidationPlan:
    """The validator's batch for a run training at ``batch`` (per process) within ``target`` bytes.

    Ultralytics validates detection, segmentation, pose and classification at twice the training batch, at most the
    validation images (its loader batches no more): without a gradient, but with the training state resident, the
    EMA and (in the final evaluation) best.pt loaded beside it (``step.validation_bytes``), and with the training
    loop's last batches still alive (``held``). Measured like a probe step, bounded by ``target`` and by what the
    device has free. ``step`` is the training step's measured peak, to say which of the two is the run's. Where
    Ultralytics' batch does not fit: the largest batch measured to fit, found from the bound a batch-1 measurement
    gives (memory is ``a·b + c`` with ``c >= 0``, as ``autobatch`` states), which ``get_dataloader`` then gives the
    validator.

    Raises:
        CheckpointConfigError: When not even batch 1 validates within ``target``.
    """
    default = validation.batch(batch)
    limit = probe_room(model, target - held).limit

    def measure(b: int) -> int | None:
        return validation_probe(model, StepShape(validation.imgsz, b, validation.objects), validation.half, limit)

    if (got := measure(default)) is not None:
        peak = " (the run's peak)" if got + held > step else ""
        return ValidationPlan(None, f"validation at batch {default} measured {(got + held) / 2**30:.3f} GB{peak} of "
                                    f"{target / 2**30:.3f} GB")
    if (one := measure(1)) is None:
        raise CheckpointConfigError(f"validation at batch 1, imgsz {validation.imgsz} does not fit "
                                    f"{target / 2**30:.3f} GB beside the training state and batch {batch}: raise "
                                    f"memory_budget, or lower batch or imgsz")
    static = state_bytes(model) + weight_bytes(model)
    b = min(max((limit - static) // max(one - static, 1), 1), default - 1)  # the bound from batch 1 fits
    while b > 1 and (got := measure(b)) is None:  # not a·b + c after all: step down to a measured fit
        b = max(b * 3 // 4, 1)
    got = one if b == 1 else got
    return ValidationPlan(b, f"validation at Ultralytics' batch {default} does not fit {target / 2**30:.3f} GB (it "
                             f"would be the run's peak): validating at batch {b}, measured "
                             f"{(got + held) / 2**30:.3f} GB")
