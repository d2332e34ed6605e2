"""Steps measured within the device a profile runs on: a CUDA GPU, a ``SimulatedDevice`` (``simulate_gpu=``), or none.

``yolo-ckpt profile`` measures every plan, including plans whose step does not fit the GPU. Each measured step runs as
a planning probe (``step.probe_step`` with the limit ``autobatch.probe_room`` gives for what the device has free
now, the rule planning follows): a step that does not fit stops at that limit, its memory is released and its row
says it does not fit, instead of ending the profile in an out-of-memory traceback. Without a device limit (CPU) the
same code measures the same figures, unbounded.

FLOPs are counted in that same bounded step, by its own tracker (``LiveTensorTracker(flops=True)``), as everywhere in
the project.
``torch.utils.flop_counter.FlopCounterMode`` cannot be used there: its module tracker keeps tensors alive that
checkpointing frees (under it a whole-network plan's step peaks above the same step without it:
``tests/test_profiler.py``), so it would run out of memory exactly where only the checkpointed step fits.

Examples:
    >>> from yolo_ckpt.memory.step import StepShape, build_model, planned_copy
    >>> from yolo_ckpt.regions.settings import PlanSettings
    >>> with planned_copy(build_model("yolo11n.yaml"), PlanSettings.of("all")) as m:
    ...     fit = fitting_step(m, StepShape(128, 2))  # None when it does not fit the device
    >>> fit.peak_bytes < fit.step_bytes
    True
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from typing import TypeVar

import torch
from torch import nn

from ..memory.device import MemoryLimit, device_memory, unless_oom
from ..memory.step import (
    StepShape,
    batch_bytes,
    planned_copy,
    state_bytes,
    step_cost,
    time_steps,
    training_batch,
    with_plan,
)
from ..memory.tracker import cuda_peak
from ..planning.autobatch import probe_room
from ..regions.install import disable_checkpointing
from ..regions.settings import PlanSettings
from .progress import Track, tracked

T = TypeVar("T")


@dataclass(frozen=True)
class Fit:
    """A training step that fit the device.

    Attributes:
        step_bytes (int): Model state, the batch and the exact step peak, as planning counts a step.
        peak_bytes (int): The step's exact peak of live tensor bytes (activations, gradients, loss).
        flops (int): Convolution/matmul FLOPs of forward, recompute and backward.
        cuda_peak_bytes (int | None): On CUDA, ``max_memory_allocated`` of the model's device over the step, less what
            lived there before it and the batch.
    """

    step_bytes: int
    peak_bytes: int
    flops: int
    cuda_peak_bytes: int | None = None


def device_room(model: nn.Module) -> int | None:
    """Step bytes the device of ``model`` (a copy, on its device) holds for a probe now; ``None``: no limit."""
    return probe_room(model).device  # no share: a profile is bounded by the device alone


def fitting_step(model: nn.Module, shape: StepShape) -> Fit | None:
    """One training step of ``shape`` of ``model`` within what its device has free now; ``None`` when it does not fit
    (the step stopped at the limit and its memory was released)."""
    device, limit = next(model.parameters()).device, device_room(model)
    with cuda_peak(device) if device.type == "cuda" else nullcontext() as peak:  # a probe step (``probe_step``)
        got = unless_oom(lambda: step_cost(model, shape, limit=limit, flops=True), device)
    if got is None:
        return None
    inputs = batch_bytes(model, shape)
    cuda = peak.allocated - peak.before - inputs if peak is not None else None
    return Fit(got.bytes, got.bytes - state_bytes(model) - inputs, got.flops, cuda)


def plan_step(model: nn.Module, plan: PlanSettings, shape: StepShape) -> Fit | None:
    """``fitting_step`` of a copy of ``model`` with ``plan`` installed. The copy is gone when it returns: a ``with
    planned_copy(...) as m`` in a loop keeps the last copy bound to ``m`` until the next one exists, two copies on the
    device where one was counted."""
    with planned_copy(model, plan) as m:
        return fitting_step(m, shape)


def _time_alone(model: nn.Module, plan: PlanSettings, data: dict, amp: torch.dtype | None) -> float:
    """One timed step of a copy of ``model`` with ``plan`` installed, the copy gone when it returns (``plan_step``)."""
    with planned_copy(model, plan) as m:
        return time_steps([m], data, 1, amp)[0]


def within_device(model: nn.Module, measure: Callable[[], T]) -> T | None:
    """``measure()`` — a measurement that is not a training step (``fitting_step`` bounds those) — within what the
    device of ``model`` has free now; ``None`` when it does not fit, its memory released as after a probe."""
    device = next(model.parameters()).device
    dev = device_memory(device)
    if dev is None:
        return measure()

    def bounded() -> T:
        with MemoryLimit(dev.tensor_bytes(dev.free), "device room", device=False):
            return measure()

    return unless_oom(bounded, device)


def time_plans(model: nn.Module, plans: list[PlanSettings], shape: StepShape, repeats: int,
               track: Track | None = None) -> list[float]:
    """Median step time of each plan's step of ``shape`` over ``time_rounds``."""
    return [statistics.median(ts) if ts else 0.0 for ts in time_rounds(model, plans, shape, repeats, track)]


def time_rounds(model: nn.Module, plans: list[PlanSettings], shape: StepShape, repeats: int,
                track: Track | None = None) -> list[list[float]]:
    """Each plan's step time of ``shape`` in each of ``repeats`` interleaved rounds (one list per plan, one time
    per round), so that machine drift hits all plans alike and a round's times compare with each other.

    A first, untimed round warms every plan up. Without a device limit every plan's copy lives for all rounds. On a
    device each step gets a copy of its own, made for it and freed after it, so that it runs in the memory its
    measured step had (the model, one copy, the batch): a plan that fit when measured fits when timed.
    """
    if not repeats:
        return [[] for _ in plans]
    data, amp = training_batch(model, shape), shape.amp
    times: list[list[float]] = [[] for _ in plans]
    rounds = tracked(track, range(1 + repeats), f"timing {len(plans)} plans")
    if device_memory(data["img"].device) is None:
        models = [with_plan(model, plan) for plan in plans]
        try:
            for _ in rounds:
                for m, ts in zip(models, times):
                    ts.append(time_steps([m], data, 1, amp)[0])
        finally:
            for m in models:
                disable_checkpointing(m)
    else:
        for _ in rounds:
            for plan, ts in zip(plans, times):
                ts.append(_time_alone(model, plan, data, amp))
    return [ts[1:] for ts in times]


def ratio(value: float | None, base: float | None, digits: int = 3) -> float | None:
    """``value / base`` rounded, or ``None`` when either was not measured (did not fit) or ``base`` is zero."""
    return round(value / base, digits) if value is not None and base else None


def mib(nbytes: int | None, digits: int = 1) -> float | None:
    """Bytes in MiB, rounded; ``None`` stays ``None`` (not measured: did not fit)."""
    return None if nbytes is None else round(nbytes / 2**20, digits)
