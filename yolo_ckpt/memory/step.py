"""One training step, measured: exact memory, FLOPs and time of ``model.loss(batch)`` forward and backward.

Every figure of the project comes from here: the step the trainer runs, on a copy of the model with a plan installed
(``planned_copy``: steps move BatchNorm statistics, so the training model never runs), on a deterministic batch in the
format of the model's task (``training_batch``), with exact tensor accounting (``LiveTensorTracker``), convolution
and matmul FLOPs counted by the same tracker (recompute included) and wall-clock time.

Memory is counted the way planning compares it with a target:

    step bytes = model state (weights, EMA, two optimizer moments) + the batch on the device + the step's exact peak

A probe step can be given a limit on the bytes it may add (``probe_step``): past it the step stops with an
out-of-memory error, which means "does not fit", and its memory is released.

Examples:
    >>> model = build_model("yolo11n.yaml")
    >>> with planned_copy(model, PlanSettings.of("all")) as m:
    ...     step_bytes(m, StepShape(320, 2)) < step_bytes(model, StepShape(320, 2))
    True
"""

from __future__ import annotations

import copy
import dataclasses
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import nn

from ..regions.install import disable_checkpointing
from ..regions.loss.install import disable_loss_checkpointing, loss_checkpointing
from ..regions.settings import NO_PLAN, PlanSettings
from .device import LimitReached, MemoryLimit, unless_oom
from .tracker import LiveTensorTracker

OBJECTS_PER_IMAGE = 50  # boxes per image in the measured batch; loss memory grows with them


@dataclass(frozen=True)
class StepShape:
    """The shape of a training step as planning measures it: the batch it trains on and the precision it runs in.

    One value for what every measured step needs besides the model, so that it travels whole from the run to each
    probe; a function that sweeps batches asks for ``shape.at(b)``.

    Attributes:
        imgsz (int): Square image side.
        batch (int): Images in the batch.
        objects (int): Labelled objects per image (detect, segment, pose, obb); loss memory grows with them.
        amp (torch.dtype | None): Autocast dtype of the forward (``torch.float16``/``torch.bfloat16``), ``None`` for
            full precision.

    Examples:
        >>> StepShape(640, 4, amp=torch.bfloat16).at(8)
        StepShape(imgsz=640, batch=8, objects=50, amp=torch.bfloat16)
    """

    imgsz: int
    batch: int = 1
    objects: int = OBJECTS_PER_IMAGE
    amp: torch.dtype | None = None

    def at(self, batch: int) -> StepShape:
        """The same step at ``batch`` images."""
        return dataclasses.replace(self, batch=batch)


def build_model(cfg: str, overrides: dict | None = None) -> nn.Module:
    """Build the Ultralytics task model for a model YAML (or load a ``.pt``), ready for ``model.loss``."""
    from ultralytics.cfg import get_cfg

    from ..regions.families import ultralytics_class

    model = ultralytics_class(cfg)(cfg).model
    model.nc = getattr(model, "nc", len(model.names))  # as the trainer's set_model_attributes; RT-DETR's loss reads it
    model.args = get_cfg(overrides={"task": getattr(model, "task", None) or "detect", **(overrides or {})})
    return model.float().train()


def training_batch(model: nn.Module, shape: StepShape) -> dict:
    """A deterministic batch in the format Ultralytics' loss of the model's task expects.

    Every tensor's size is proportional to ``shape.batch`` (``batch_bytes`` relies on it).

    Args:
        model: An Ultralytics task model (its class decides the label format).
        shape: Image side, images and labelled objects per image (detect, segment, pose, obb); its ``amp`` is not
            read (the batch is float32, as the loader's after ``preprocess``).

    Semantic segmentation gets ``semantic_mask`` (int32 class ids, batch x imgsz x imgsz: the image's resolution,
    as ``SemanticFormat`` and the collate give it; the loss upsamples its logits to it) and depth gets ``depth``
    (float32 metres, batch x 1 x imgsz x imgsz, as ``DepthFormat``); every pixel is valid, the most the losses keep.
    """
    from ultralytics.nn.tasks import (
        ClassificationModel,
        DepthModel,
        OBBModel,
        PoseModel,
        SegmentationModel,
        SemanticSegmentationModel,
    )

    imgsz, batch, objects = shape.imgsz, shape.batch, shape.objects
    g = torch.Generator().manual_seed(0)
    device = next(model.parameters()).device
    nc = len(model.names) if hasattr(model, "names") else 80
    b = {"img": torch.rand(batch, model.yaml.get("channels", 3), imgsz, imgsz, generator=g)}
    if isinstance(model, ClassificationModel):
        b["cls"] = torch.randint(0, nc, (batch,), generator=g)
        return {k: v.to(device) for k, v in b.items()}
    if isinstance(model, SemanticSegmentationModel):
        b["semantic_mask"] = torch.randint(0, model.model[-1].nc, (batch, imgsz, imgsz), generator=g, dtype=torch.int32)
        return {k: v.to(device) for k, v in b.items()}
    if isinstance(model, DepthModel):
        b["depth"] = torch.rand(batch, 1, imgsz, imgsz, generator=g) * 50 + 1  # 1-51 m, all valid (> 0.001)
        return {k: v.to(device) for k, v in b.items()}
    n = batch * objects
    b["batch_idx"] = torch.arange(batch).repeat_interleave(objects).float()
    b["cls"] = torch.randint(0, nc, (n, 1), generator=g).float()
    xywh = torch.cat([torch.rand(n, 2, generator=g) * 0.8 + 0.1, torch.rand(n, 2, generator=g) * 0.08 + 0.02], 1)
    b["bboxes"] = torch.cat([xywh, torch.rand(n, 1, generator=g)], 1) if isinstance(model, OBBModel) else xywh
    if isinstance(model, PoseModel):
        b["keypoints"] = torch.rand(n, *model.model[-1].kpt_shape, generator=g)  # the head's: in every release
    if isinstance(model, SegmentationModel):
        b["masks"] = torch.randint(0, objects + 1, (batch, imgsz // 4, imgsz // 4), generator=g).float()
        # class ids per mask pixel, as Ultralytics' ``Format`` gives every segment batch; YOLO26's semantic aux loss
        # reads them
        b["sem_masks"] = torch.randint(0, nc, (batch, imgsz // 4, imgsz // 4), generator=g).float()
    return {k: v.to(device) for k, v in b.items()}


def batch_bytes(model: nn.Module, shape: StepShape) -> int:
    """Bytes of ``training_batch(model, shape)`` on the device, computed from batch 1 (every tensor of it grows with
    the batch), so that no batch is allocated to learn its size."""
    one = training_batch(model, shape.at(1))
    return shape.batch * sum(t.untyped_storage().nbytes() for t in one.values())


def loop_bytes(model: nn.Module, shape: StepShape) -> int:
    """Bytes of batches Ultralytics' training loop holds during a step beside the one the step trains on: the
    loader's uint8 images, and at every second step's start the previous batch (measured on a
    simulated device: vanilla's loop alternates by exactly one batch, and ``gc.collect()`` does not free it).

    The loader's images live in host memory: they count where the model trains on the CPU (a simulated device counts
    every live CPU tensor), not on an accelerator, which holds only the previous batch."""
    host = next(model.parameters()).device.type == "cpu"
    uint8 = shape.batch * model.yaml.get("channels", 3) * shape.imgsz**2 if host else 0
    return uint8 + batch_bytes(model, shape)


def weight_bytes(model: nn.Module) -> int:
    """Bytes of the model's parameters and buffers."""
    return sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))


def grad_bytes(model: nn.Module) -> int:
    """Bytes of the gradients of the trainable parameters (and of each optimizer moment of the same shape)."""
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)


def state_bytes(model: nn.Module) -> int:
    """Bytes of the tensors a training step finds alive: weights + EMA copy + two optimizer moments (AdamW; SGD needs
    one, so this is conservative there)."""
    return 2 * weight_bytes(model) + 2 * grad_bytes(model)


def step_loss(model: nn.Module, batch: dict, amp: torch.dtype | None = None) -> torch.Tensor:
    """The trainer's forward: ``model.loss`` under autocast of ``amp``, as Ultralytics' loop; backward is outside."""
    with torch.autocast(batch["img"].device.type, dtype=amp, enabled=amp is not None):
        loss, _ = model.loss(batch)
        return loss.sum()


class StepMemory(NamedTuple):
    """Exact memory of one training step.

    Attributes:
        peak (int): Peak live tensor bytes the step allocated (activations, gradients, loss).
        saved (int): Bytes still alive after forward, i.e. kept for backward.
        flops (int): Convolution/matmul FLOPs of the step, recompute included (counted only when asked for).
    """

    peak: int
    saved: int
    flops: int = 0


def measure_peak(model: nn.Module, batch: dict, amp: torch.dtype | None = None, limit: int | None = None,
                 flops: bool = False) -> StepMemory:
    """Exact memory of one training step, ``model.loss(batch)`` forward and backward, and nothing else running.

    The model's gradients are cleared first (as ``optimizer.zero_grad()`` does), so each measurement starts like a
    training step.

    Args:
        model: The model as it trains (checkpoint plan installed, or plain).
        batch: A batch as ``training_batch`` makes it.
        amp: Autocast dtype of the forward (``torch.float16``/``torch.bfloat16``), ``None`` for full precision.
        limit: Bytes the step may allocate at most; past it, ``device.LimitReached``.
        flops: Count the step's FLOPs too (in the same tracker: one dispatch mode).
    """
    model.zero_grad(set_to_none=True)
    tracker = LiveTensorTracker(flops) if limit is None else MemoryLimit(limit, "planning share", False, flops)
    try:
        with tracker:
            loss = step_loss(model, batch, amp)
            saved = tracker.current
            loss.backward()
            del loss
    finally:
        model.zero_grad(set_to_none=True)
    return StepMemory(tracker.peak, saved, tracker.flops)


class StepCost(NamedTuple):
    """A training step as planning counts it (``step_cost``).

    Attributes:
        bytes (int): Model state, the batch on the device and the step's exact peak.
        flops (int): Convolution/matmul FLOPs of the step (0 unless counted).
    """

    bytes: int
    flops: int


def step_bytes(model: nn.Module, shape: StepShape, limit: int | None = None) -> int:
    """Memory of a training step of ``shape`` as planning counts it: model state, the batch on the device, the exact
    step peak.

    ``limit`` (step bytes; ``None``: none) stops the step with ``device.LimitReached`` once it cannot fit (the batch
    is not even allocated when it alone passes it).
    """
    return step_cost(model, shape, limit).bytes


def step_cost(model: nn.Module, shape: StepShape, limit: int | None = None, flops: bool = False) -> StepCost:
    """``step_bytes`` and, with ``flops=True``, the step's FLOPs, counted in the same step."""
    static = state_bytes(model)
    inputs = batch_bytes(model, shape)
    if limit is not None and static + inputs > limit:
        raise LimitReached(f"the batch alone ({inputs / 2**20:.2f} MiB) passes the planning share")
    data = training_batch(model, shape)  # on the device for the whole step, as the trainer's batch
    step = measure_peak(model, data, shape.amp, None if limit is None else limit - static - inputs, flops)
    return StepCost(static + inputs + step.peak, step.flops)


def probe_step(model: nn.Module, shape: StepShape, limit: int | None = None) -> int | None:
    """A probe step that may not pass ``limit`` step bytes (``None``: no limit but the device's); ``None`` when it
    does not fit (out of memory at the limit or on the device), its memory released (``device.release``)."""
    return unless_oom(lambda: step_bytes(model, shape, limit), next(model.parameters()).device)


def step_flops(model: nn.Module, batch: dict, amp: torch.dtype | None = None) -> int:
    """Convolution/matmul FLOPs of one training step, recompute included (``LiveTensorTracker(flops=True)``)."""
    return measure_peak(model, batch, amp, flops=True).flops


def time_steps(models: list[nn.Module], batch: dict, repeats: int, amp: torch.dtype | None = None,
               clock: Callable[[], float] = time.perf_counter) -> list[float]:
    """Median step time of each model, timed in interleaved rounds so machine drift hits all of them alike.

    ``clock``: wall-clock by default; ``time.process_time`` gives a CPU step's own CPU time (all of this process's
    threads), which other processes on a shared machine do not stretch.
    """
    times: list[list[float]] = [[] for _ in models]
    cuda = batch["img"].is_cuda
    for _ in range(repeats):
        for model, ts in zip(models, times):
            model.zero_grad(set_to_none=True)
            if cuda:
                torch.cuda.synchronize()
            t0 = clock()
            step_loss(model, batch, amp).backward()
            if cuda:
                torch.cuda.synchronize()
            ts.append(clock() - t0)
            model.zero_grad(set_to_none=True)
    return [statistics.median(ts) if ts else 0.0 for ts in times]


def with_plan(model: nn.Module, plan: PlanSettings) -> nn.Module:
    """A copy of ``model`` with ``plan`` installed (its loss plan where it has one, else the one ``model`` has). The
    caller disables it when done: the installed plan refers back to its model; see ``planned_copy``."""
    m = copy.deepcopy(model)
    plan.install(m)
    return m


@contextmanager
def planned_copy(model: nn.Module, plan: PlanSettings | None = NO_PLAN) -> Iterator[nn.Module]:
    """A copy of ``model`` with ``plan`` installed (``None``: the plan ``model`` has), for the block only: afterwards
    the plan is removed, so the copy is freed at once rather than when the collector finds the cycle, and planning
    keeps one copy at a time.

    Examples:
        >>> with planned_copy(build_model("yolo11n.yaml"), PlanSettings.of([2, 3], "selective")) as m:
        ...     step = measure_peak(m, training_batch(m, StepShape(128)))
    """
    m = with_plan(model, plan) if plan is not None else copy.deepcopy(model)  # a deep copy carries the plan
    try:
        yield m
    finally:
        disable_checkpointing(m)
        disable_loss_checkpointing(m)
        del m


def put_back_criterion(model: nn.Module, criterion: nn.Module | None) -> None:
    """``model``'s loss as a copy had it: ``criterion``, or none at all where it had none (``None``), so that its next
    step builds the loss as a fresh copy's first step does (8.4.162's RT-DETR builds it only where the attribute is
    missing, and would call a ``None``)."""
    if criterion is not None:
        model.criterion = criterion
    elif hasattr(model, "criterion"):
        delattr(model, "criterion")


@contextmanager
def copy_for_plans(model: nn.Module) -> Iterator[Callable[[PlanSettings], nn.Module]]:
    """One copy of ``model`` for many plans in turn: ``install(plan)`` puts a plan on it and returns it, its loss
    built afresh at its next step, so that each step measures as the first step of a fresh ``planned_copy`` does;
    afterwards the copy is freed as ``planned_copy`` frees it.

    One copy for all plans: measuring every candidate plan (``tradeoff.measure_candidates``) would otherwise deep-copy
    the model once per plan. The copy's BatchNorm statistics move from step to step; no step's bytes, FLOPs or time
    depend on them.

    Examples:
        >>> with copy_for_plans(build_model("yolo11n.yaml")) as install:
        ...     steps = [measure_peak(m := install(PlanSettings.of(p)), training_batch(m, StepShape(128)))
        ...              for p in ([], [2, 3], "all")]
    """
    with planned_copy(model) as m:
        criterion, own_loss = getattr(m, "criterion", None), loss_checkpointing(model) or "none"

        def install(plan: PlanSettings) -> nn.Module:
            put_back_criterion(m, criterion)  # the next step builds the loss as a fresh copy's first does
            plan.with_loss(own_loss if plan.loss is None else plan.loss).install(m)
            return m

        yield install


def validation_bytes(model: nn.Module, shape: StepShape, half: bool = False, limit: int | None = None) -> int:
    """Memory of one validation batch as planning counts it, measured on a plain copy of ``model``.

    What Ultralytics' validator runs during training (``BaseValidator.__call__``): the EMA model in eval
    mode without gradients, the batch's images in half precision under fp16 autocast where it trains on CUDA with AMP
    (``half``), its forward and the loss of its predictions. Counted like a step: model state (weights, EMA, two
    optimizer moments; the gradients were set to ``None`` by the last optimizer step), a second copy of the weights
    (the final evaluation loads best.pt beside that state), the batch on the device and the exact peak of forward and
    loss. Not counted: non-maximum suppression of the predictions (a few boxes per image). Square ``shape.imgsz``
    images bound the validator's rectangular batches where it is their padded size
    (``run_facts.validation_imgsz``: Ultralytics pads them by half a stride, 192 px for ``imgsz=160``).

    ``shape.amp`` is not read: the validator's precision is ``half``. ``limit`` (bytes, as ``step_bytes``): past it,
    ``device.LimitReached``.
    """
    static = state_bytes(model) + weight_bytes(model)
    inputs = batch_bytes(model, shape)
    if limit is not None and static + inputs > limit:
        raise LimitReached(f"the validation batch alone ({inputs / 2**20:.2f} MiB) passes the planning share")
    with planned_copy(model) as m:
        m.eval()
        data = training_batch(m, shape)
        if half:
            data["img"] = data["img"].half()
        tracker = LiveTensorTracker() if limit is None else MemoryLimit(limit - static - inputs, "planning share",
                                                                       device=False)
        with torch.no_grad(), tracker:
            with torch.autocast(data["img"].device.type, dtype=torch.float16, enabled=half):
                preds = m(data["img"])
                m.loss(data, preds)
                del preds
    return static + inputs + tracker.peak


def validation_probe(model: nn.Module, shape: StepShape, half: bool = False, limit: int | None = None) -> int | None:
    """``validation_bytes`` within ``limit``; ``None`` when it does not fit (at the limit or on the device), its
    memory released (as ``probe_step``)."""
    return unless_oom(lambda: validation_bytes(model, shape, half, limit), next(model.parameters()).device)
