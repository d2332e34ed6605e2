"""AutoBatch on the checkpointed model: on CUDA with Ultralytics' algorithm, anywhere with an explicit memory budget.

``batch=-1`` (60%) or ``batch=0.x`` asks for the largest batch using that fraction of memory. On CUDA without
``memory_budget``, Ultralytics' own ``check_train_batch_size`` profiles a copy of the model — the checkpointed one, so
the recompute is what it measures. With ``memory_budget`` (say ``24GB``, the GPU you plan for), ``plan_batch`` works
on any device from exact tensor accounting of real training steps (``yolo_ckpt.memory.step``):

    memory(b) = model state + batch(b) + step peak(b) + loop(b)

``loop(b)`` is what Ultralytics' training loop holds beside the batch a step trains on (``step.loop_bytes``: the
loader's uint8 images, and every second step the previous batch): computed, not measured (a probe step does not
allocate it), exactly ``l·b``.

**The bound every probe obeys.** A step's memory is ``a·b + c`` with ``c >= 0`` (what does not grow with the batch,
such as the weights' gradients), so the memory per image can only fall as the batch grows: a step measured at ``b``
bounds every larger batch by ``b' / b`` times itself (beyond the model state). With the loop's batches the run holds
``static + b' · ((step(b) - static) / b + l)`` at most, still of that form, so the share bounds ``b'`` by
``(share - static) · b / (step(b) - static + l·b)``; the device bounds the probe step alone (``ProbeRoom.bounded``).
``plan_batch`` measures batch 1, jumps to the largest batch that bound admits within what a probe may use
(``ProbeRoom``: the share of the budget less the loop's batches, and what the device has free), measures it, and
repeats until the batch stops growing (two to four steps). Each probe also runs under that limit
(``step.probe_step``), so that a step that is not ``a·b + c`` after all stops at the limit ("does not fit")
instead of passing it.

**A device that runs out sooner than it said** (its free memory moved, or it told nothing: a probe's out-of-memory
error where the bound expected room) is treated as Ultralytics' AutoBatch treats a batch that failed: the batch is
narrowed between the last that fit and the one that failed, by bisection (each probe bounded as before), instead of
falling back to the last measured batch; from the largest fit the batch is then extrapolated to the share, as for a
budget bigger than the device.

**A budget bigger than the device.** When ``memory_budget`` exceeds what the device can hold, the probes stop at the
device and the batch is extrapolated from the largest measured step by the same bound, up to the share, and
``BatchPlan.extrapolated`` says so. The bound never overestimates; it underestimates by the part of a step that does
not grow with the batch (``c``) times ``b' / b - 1``, small beside the activations of a batch.

Examples:
    >>> from yolo_ckpt.memory.step import StepShape, build_model
    >>> plan_batch(build_model("yolo11n.yaml"), StepShape(320), budget=parse_memory("1GB"), fraction=0.6).batch
    9
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from torch import nn

from ..memory.device import LimitReached, device_memory, is_oom, release
from ..memory.step import StepShape, loop_bytes, probe_step, state_bytes, step_bytes

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


@dataclass(frozen=True)
class MemoryTarget:
    """What a run's memory decisions plan for.

    Attributes:
        budget (int): Exact tensor bytes: ``memory_budget``, or the device's usable memory.
        fraction (float): The share of it a training step may use (0.6, or ``batch=0.x``).
        source (str): What the budget is, for the log (``memory_budget=24GB``, ``cuda:0 usable memory``).
    """

    budget: int
    fraction: float
    source: str

    @property
    def share(self) -> int:
        """The bytes a training step may use."""
        return int(self.fraction * self.budget)


def probe_room(model: nn.Module, target: int | None = None) -> ProbeRoom:
    """What a probe step on ``model`` (a planning copy, already on its device) may reach now: ``target`` step bytes
    (``None``: no share, the device alone bounds it), and what the device has free (``device.device_memory``) plus
    the model state that step bytes count but a probe does not allocate (the copy's weights are resident already, EMA
    and moments do not exist yet)."""
    dev = device_memory(next(model.parameters()).device)
    room = None if dev is None else dev.tensor_bytes(dev.free) + state_bytes(model)
    return ProbeRoom(target, room)


def _least(*bounds: int | None) -> int | None:
    """The smallest of the known ``bounds``; ``None`` (no limit) when none is known."""
    known = [b for b in bounds if b is not None]
    return min(known) if known else None


@dataclass(frozen=True)
class ProbeRoom:
    """The most a probe step may reach, in step bytes (``step.step_bytes``).

    A probe stops at the first allocation that would pass the limit, which is never counted: the step's own count
    stays within it. (A tracker outside the probe sees that one allocation until it is released, and only for a
    probe that does not fit.)

    Attributes:
        target (int | None): The share it must fit (``None``: no share).
        device (int | None): What the device can hold for it now (``None``: no limit).
        loop (int): Bytes per image the training loop holds beside a step (``step.loop_bytes`` at batch 1), which
            count against the share but which a probe does not allocate (0: none counted).
    """

    target: int | None
    device: int | None
    loop: int = 0

    @property
    def limit(self) -> int | None:
        """The smaller of share and device (``None``: neither bounds a probe)."""
        return _least(self.target, self.device)

    def step_limit(self, batch: int) -> int | None:
        """The most a probe step at ``batch`` may reach: the share less the loop's batches, and the device."""
        return _least(None if self.target is None else self.target - self.loop * batch, self.device)

    def bounded(self, batch: int, measured: int, static: int, cap: int) -> int:
        """The largest batch ``b'`` up to ``cap`` whose bound from a step of ``measured`` bytes at ``batch`` fits:
        ``static + (measured - static) · b' / batch + loop · b'`` within the share, and the step's own bound within
        the device."""
        if self.target is None:  # no share: the device and ``cap`` alone bound it
            share = cap
        else:
            share = (self.target - static) * batch // (measured - static + self.loop * batch)
        device = share if self.device is None else (self.device - static) * batch // (measured - static)
        return min(max(int(min(share, device)), 0), cap)


@dataclass
class BatchPlan:
    """A batch chosen for a memory target.

    Attributes:
        batch (int): The chosen batch size.
        measured_bytes (int): What the run holds at ``batch``: model state, batch and the measured step peak
            (extrapolated: predicted), plus ``loop_bytes``.
        target_bytes (int): ``fraction * budget``.
        extrapolated (bool): The device could not hold the target: ``batch`` is extrapolated from measured steps.
        points (dict[int, int]): Every measured batch and its step bytes (the loop's batches not included).
        loop_bytes (int): The training loop's other batches at ``batch`` (``step.loop_bytes``; 0 when not
            counted), computed, not measured.
    """

    batch: int
    measured_bytes: int
    target_bytes: int
    extrapolated: bool = False
    points: dict = field(default_factory=dict)
    loop_bytes: int = 0


def plan_batch(model: nn.Module, shape: StepShape, budget: int, fraction: float = 0.6, max_batch: int = 1024,
               loop: bool = True) -> BatchPlan:
    """The largest batch whose measured training step, with the training loop's other batches, fits
    ``fraction * budget`` bytes.

    Args:
        model: The model as it will train (a copy, with its checkpoint plan installed, or plain), on its device.
        shape: The step's image size, objects per image and autocast dtype; its ``batch`` is not read (the batch is
            what this chooses, measured from 1 up).
        budget: Device memory to plan for, in bytes.
        fraction: Share of ``budget`` to use (Ultralytics: 0.6 for ``batch=-1``).
        max_batch: Upper clamp, as Ultralytics' 1024.
        loop: Count the loop's other batches (``step.loop_bytes``); ``False`` where the caller's target has
            them taken off already (``choice.measure_candidate``).

    Raises:
        ValueError: When not even batch 1 fits (the share, or the device).
    """
    static, target = state_bytes(model), int(fraction * budget)
    per_image = loop_bytes(model, shape.at(1)) if loop else 0
    room = ProbeRoom(target, probe_room(model, target).device, per_image)
    first = probe_step(model, shape.at(1), room.step_limit(1))
    if first is None or first + per_image > target:
        where = "the device" if room.device is not None and room.device < target else f"{target / 2**30:.3f} GB"
        need = f"{(first + per_image) / 2**30:.3f} GB" if first else f"more than {room.limit / 2**30:.3f} GB"
        with_loop = " with the training loop's other batches" if per_image else ""
        raise ValueError(f"memory_budget: batch 1 at imgsz={shape.imgsz} needs {need}{with_loop}, over {where}")
    points, b, over, failed, device_out = {1: first}, 1, False, None, False
    while (nxt := room.bounded(b, points[b], static, max_batch)) > b:  # measured only where the bound admits it
        got, out = _attempt(model, shape.at(nxt), room.step_limit(nxt))
        if got is None or got + per_image * nxt > target:  # not a·b + c after all, or a device that said more
            over, failed, device_out = got is not None, nxt, out
            break
        points[nxt], b = got, nxt
    while failed is not None and not over and failed - b > 1:  # ran out where room was expected: narrow it down
        mid = (b + failed) // 2
        got, out = _attempt(model, shape.at(mid), room.step_limit(mid))
        if got is not None and got + per_image * mid <= target:
            points[mid], b = got, mid
        else:
            failed, device_out = mid, device_out or out
    further = ProbeRoom(target, None, per_image).bounded(b, points[b], static, max_batch)  # what the share admits
    told = room.device is not None and room.device < target  # the device said it holds less than the share
    if over or not (told or device_out) or further <= b:
        return BatchPlan(b, points[b] + per_image * b, target, False, points, per_image * b)
    # The device stopped the probes (as it said, or sooner: a device whose free memory moved, or that told nothing):
    # the bound from the largest measured step carries on to the share. Not the line through the last two steps: a
    # step's peak is the largest of several a·b + c sums, convex in the batch, so that line passes under larger
    # batches (yolo11n, 160 px: 9 from steps at 4 and 6, where 8 is the largest fit).
    step = static + (points[b] - static) * further // b
    return BatchPlan(further, step + per_image * further, target, True, points, per_image * further)


def _attempt(model: nn.Module, shape: StepShape, limit: int | None) -> tuple[int | None, bool]:
    """A probe step within ``limit`` (``step.probe_step``): ``(bytes or None, whether the device ran out)``. A
    device that runs out is one that holds less than it said; a probe that reached ``limit`` was over the share."""
    try:
        return step_bytes(model, shape, limit), False
    except RuntimeError as e:
        if not is_oom(e):
            raise
        device_out = not isinstance(e, LimitReached)
    release(next(model.parameters()).device)  # outside the ``except`` block, whose traceback holds the failed step
    return None, device_out
