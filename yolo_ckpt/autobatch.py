"""AutoBatch on the checkpointed model: on CUDA with Ultralytics' algorithm, anywhere with an explicit memory budget.

``batch=-1`` (60%) or ``batch=0.x`` asks for the largest batch using that fraction of memory. On CUDA without
``memory_budget``, Ultralytics' own ``check_train_batch_size`` profiles a copy of the model — the checkpointed one, so
the recompute is what it measures. With ``memory_budget`` (say ``24GB``, the GPU you plan for), ``plan_batch`` works
on any device from exact tensor accounting of real training steps:

    memory(b) = model state + batch(b) + step peak(b)

Model state is the weights, their EMA copy and two optimizer moments (AdamW; SGD needs one): the tensors a training
step finds alive; the batch is the images and labels on the device. The step peak is exact (``LiveTensorTracker``):
activations, gradients, loss, with the forward under the run's autocast dtype (fp16/bf16 on CUDA), as Ultralytics'
loop runs it.

A step's memory is ``a·b + c`` with ``c >= 0`` (what does not grow with the batch, such as the weights' gradients), so
the memory per image can only fall as the batch grows: a step measured at ``b`` bounds every larger batch by
``b' / b`` times itself. ``plan_batch`` measures batch 1, jumps to the largest batch that bound allows, measures it,
and repeats until the batch stops growing (two to four steps). Every measured step fits by that bound, so planning
stays inside the share it plans for; only memory is measured (no FLOP counting, which keeps checkpointed activations
alive); and the caller plans on one copy of the model at a time, which ``state_bytes`` covers.

Example:
    >>> from yolo_ckpt.profiler import build_model
    >>> plan_batch(build_model("yolo11n.yaml"), imgsz=320, budget=parse_memory("1GB"), fraction=0.6).batch
    9
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
from torch import nn

from .profiler import measure_peak, training_batch

_UNITS = {"": 2**30, "b": 1, "kb": 2**10, "kib": 2**10, "mb": 2**20, "mib": 2**20, "gb": 2**30, "gib": 2**30,
          "tb": 2**40, "tib": 2**40}


def parse_memory(value: str | float | int) -> int:
    """Bytes of a memory size: ``"24GB"``, ``"512 MiB"``, or a number of GB (GB = 2**30 bytes, as Ultralytics).

    Raises:
        ValueError: One line naming the accepted forms.
    """
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(value))
    if isinstance(value, bool) or not m or m.group(2).lower() not in _UNITS or float(m.group(1)) <= 0:
        raise ValueError(
            f"memory_budget={value!r} is invalid. Valid: a positive size such as 24GB, 512MB, 80GiB or 24."
        )
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def state_bytes(model: nn.Module) -> int:
    """Bytes of the tensors a training step finds alive: weights + EMA copy + two optimizer moments."""
    params = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    weights = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
    return 2 * weights + 2 * params


def step_bytes(model: nn.Module, imgsz: int, batch: int, objects: int = 50, amp: torch.dtype | None = None) -> int:
    """Memory of a training step as planning counts it: model state, the batch on the device, the exact step peak."""
    data = training_batch(model, imgsz, batch, objects)  # on the device for the whole step, as the trainer's batch
    inputs = sum(t.untyped_storage().nbytes() for t in data.values())
    return state_bytes(model) + inputs + measure_peak(model, data, amp)[0]


@dataclass
class BatchPlan:
    """A batch chosen for a memory target.

    Attributes:
        batch (int): The chosen batch size.
        measured_bytes (int): Model state, batch and the measured step peak at ``batch``.
        target_bytes (int): ``fraction * budget``.
    """

    batch: int
    measured_bytes: int
    target_bytes: int


def plan_batch(model: nn.Module, imgsz: int, budget: int, fraction: float = 0.6, max_batch: int = 1024,
               objects: int = 50, amp: torch.dtype | None = None) -> BatchPlan:
    """The largest batch whose measured training step fits ``fraction * budget`` bytes.

    Args:
        model: The model as it will train (with its checkpoint plan installed, or plain).
        imgsz: Training image size.
        budget: Device memory to plan for, in bytes.
        fraction: Share of ``budget`` to use (Ultralytics: 0.6 for ``batch=-1``).
        max_batch: Upper clamp, as Ultralytics' 1024.
        objects: Labelled objects per image in the measured batches.
        amp: Autocast dtype the run trains with (``torch.float16``/``torch.bfloat16``), ``None`` for full precision.

    Raises:
        ValueError: When not even batch 1 fits.
    """
    static, target = state_bytes(model), int(fraction * budget)

    def measured(b: int) -> int:
        return step_bytes(model, imgsz, b, objects, amp)

    def bound(b: int) -> int:  # the largest batch that fits if the step per image is at most that measured at b
        return min(int((target - static) * b // (points[b] - static)), max_batch)

    points = {1: measured(1)}
    if points[1] > target:
        raise ValueError(f"memory_budget: batch 1 at imgsz={imgsz} needs {points[1] / 2**30:.3f} GB, "
                         f"over {target / 2**30:.3f} GB")
    b = 1
    while (nxt := bound(b)) > b:  # each step is measured only where the bound says it fits
        points[nxt] = measured(nxt)
        if points[nxt] > target:  # the step is not a·b + c with c >= 0 here: keep the largest measured fit
            break
        b = nxt
    return BatchPlan(b, points[b], target)
