"""The memory of the device a run plans for: a CUDA GPU, or a simulated one on CPU with a hard limit.

Every memory decision (``auto``, AutoBatch with or without ``memory_budget``, escalation on out-of-memory) reads the
device through ``device_memory`` and runs its probe steps under a ``MemoryLimit``, so the same planning code runs on a
real GPU and on ``SimulatedDevice``:

- **CUDA**: usable memory = ``mem_get_info`` free + what this process's caching allocator has reserved, as
  Ultralytics' AutoBatch counts it; tensor bytes are turned into allocator bytes with ``ALLOCATOR_MARGIN``.
- **Simulated** (``simulate_gpu=925MB`` on CPU, or ``with SimulatedDevice(limit):`` in code): an exact live-tensor
  tracker that raises ``torch.OutOfMemoryError`` with a CUDA-style message when live bytes would pass the limit, and
  reports free, allocated and peak memory the way the CUDA helpers do. Ultralytics' first-epoch OOM retry recognises
  its error as it recognises CUDA's (any ``RuntimeError`` whose message says "out of memory").
- **CPU** without a simulated device: no limit (``device_memory`` returns ``None``).

Example:
    >>> import torch
    >>> with SimulatedDevice(2**20) as gpu:  # a 1 MiB "GPU"
    ...     a = torch.zeros(2**17)  # 512 KiB
    ...     gpu.mem_get_info()
    ...     try:
    ...         b = torch.zeros(2**18)  # another 1 MiB does not fit
    ...     except torch.OutOfMemoryError as e:
    ...         print(str(e).split(".")[0])
    (524288, 1048576)
    CUDA out of memory
"""

from __future__ import annotations

import gc
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

from .memory import LiveTensorTracker

ALLOCATOR_MARGIN = 1.10
"""Allocator bytes per exact tensor byte assumed on CUDA: the caching allocator rounds blocks (512 B, 2 MiB segments),
caches freed blocks and cuDNN takes workspaces, none of which the exact tensor count sees. Planning divides the CUDA
memory it may use by this before comparing it with measured tensor bytes. Unconfirmed on a GPU (none has been lent to
this project); ``benchmarks/gpu_check.py`` prints the measured ratio of ``max_memory_reserved`` to exact tensor
bytes. On a simulated device it is 1: the limit counts exact tensor bytes."""


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"


class LimitReached(RuntimeError):
    """A planning probe reached its share. Not worded as out of memory on purpose: Ultralytics recovers from those
    inside a step (``TaskAlignedAssigner`` retries one image at a time), which would change the step measured."""


class MemoryLimit(LiveTensorTracker):
    """A ``LiveTensorTracker`` that refuses to count past ``limit`` bytes: the allocation that would pass it raises,
    and is never counted — ``torch.OutOfMemoryError`` with CUDA's wording (a device), or ``LimitReached`` (a probe's
    share, ``device=False``). Nested inside another tracker it limits only what is allocated while it is active.
    After the error, ``release`` frees what the failed step held.
    """

    def __init__(self, limit: int, name: str = "memory limit", device: bool = True) -> None:
        super().__init__()
        self.limit, self.name, self.device = int(limit), name, device

    def _add(self, st: torch.UntypedStorage) -> None:
        nbytes = st.nbytes()
        if self.current + nbytes > self.limit:
            what = f"Tried to allocate {_mib(nbytes)}. {self.name} of {_mib(self.limit)} has " \
                   f"{_mib(self.limit - self.current)} free ({_mib(self.current)} allocated)"
            raise torch.OutOfMemoryError(f"CUDA out of memory. {what}") if self.device else LimitReached(what)
        super()._add(st)


class SimulatedDevice(MemoryLimit):
    """A GPU of ``limit`` bytes simulated on CPU: every tensor allocated while it is active counts against the limit.

    It answers what planning asks CUDA (``mem_get_info``, ``memory_allocated``, ``memory_reserved``,
    ``max_memory_allocated``, ``reset_peak_memory_stats``); reserved equals allocated (no caching allocator).
    Enter it around everything that would run on the GPU, the model's construction included.
    """

    def __init__(self, limit: int) -> None:
        super().__init__(limit, name="simulated device")

    def mem_get_info(self) -> tuple[int, int]:
        """``(free, total)`` bytes, as ``torch.cuda.mem_get_info``."""
        return self.limit - self.current, self.limit

    def memory_allocated(self) -> int:
        return self.current

    memory_reserved = memory_allocated

    def max_memory_allocated(self) -> int:
        return self.peak

    def reset_peak_memory_stats(self) -> None:
        self.reset_peak()


def simulated_device() -> SimulatedDevice | None:
    """The ``SimulatedDevice`` active on this thread, or ``None``."""
    return next((m for m in reversed(_get_current_dispatch_mode_stack()) if isinstance(m, SimulatedDevice)), None)


@dataclass(frozen=True)
class DeviceMemory:
    """What a device offers a run, in bytes.

    Attributes:
        total (int): The device's memory.
        usable (int): What this run may use in all: free plus what it holds already (reserved by this process on
            CUDA, allocated on a simulated device) — the figure Ultralytics' AutoBatch plans a fraction of.
        free (int): What is not allocated now: the most a probe step may add.
        margin (float): Device bytes per exact tensor byte (``ALLOCATOR_MARGIN`` on CUDA, 1 simulated).
        name (str): For log lines.
    """

    total: int
    usable: int
    free: int
    margin: float
    name: str

    def tensor_bytes(self, device_bytes: int) -> int:
        """The exact tensor bytes that fit in ``device_bytes`` of this device."""
        return int(device_bytes / self.margin)


def device_memory(device: torch.device | str | None) -> DeviceMemory | None:
    """The memory of the training ``device``: CUDA, the active simulated device on CPU, or ``None`` (no limit).

    The training device decides: a CPU run on a machine that has CUDA has no limit unless a simulated device is active.
    """
    device = torch.device(device if device is not None else "cpu")
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        free, total = torch.cuda.mem_get_info(index)
        reserved, allocated = torch.cuda.memory_reserved(index), torch.cuda.memory_allocated(index)
        return DeviceMemory(total, free + reserved, free + reserved - allocated, ALLOCATOR_MARGIN, f"cuda:{index}")
    if (sim := simulated_device()) is not None:
        free, total = sim.mem_get_info()
        return DeviceMemory(total, total, free, 1.0, f"simulated device ({total / 2**30:.3f} GB)")
    return None


def is_oom(e: BaseException) -> bool:
    """Whether ``e`` means "does not fit": an out-of-memory error as Ultralytics' retry recognises one (CUDA's, or a
    simulated device's), or a probe that reached its share."""
    return isinstance(e, LimitReached) or isinstance(e, RuntimeError) and "out of memory" in str(e).lower()


def release(device: torch.device | str | None = None) -> None:
    """Free what a failed step left: the autograd engine's queue of the failed backward (torch 2.14.1 keeps its
    pending gradients until the next backward on this thread runs: found as 11 MiB held after a failed probe of a
    small model, so one tiny backward drains it), the graph's cycles (the collector), CUDA's cached blocks."""
    torch.ones(1, requires_grad=True).sum().backward()
    gc.collect()
    if torch.device(device or "cpu").type == "cuda":
        torch.cuda.empty_cache()
