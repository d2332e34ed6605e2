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

Examples:
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
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from torch.utils._python_dispatch import _disable_current_modes, _get_current_dispatch_mode_stack
from torch.utils._pytree import tree_map

from .tracker import LiveTensorTracker, _tensor_leaves

T = TypeVar("T")

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


_ALLOCATES: dict[Any, bool] = {}  # op overload -> whether it returns a tensor that is not an alias of an input
_SIZED: dict[tuple, int | None] = {}  # (op, argument signature) -> output bytes: steps repeat ops at the same shapes


def output_bytes(func: Any, args: tuple, kwargs: dict) -> int | None:
    """Bytes of the new storages the ATen op ``func`` would allocate for ``args``, computed on meta tensors before it
    runs; ``0`` for views, in-place ops and ops that return no tensor; ``None`` when meta cannot tell (an output whose
    shape depends on the data, such as ``nonzero``).

    The op runs with every dispatch mode off (``_disable_current_modes``, private in torch 2.14.1 and the one way to
    run an op from inside a mode without the modes below seeing it), on meta copies of the tensor arguments and with
    ``device="meta"`` for factories, so nothing is allocated and no generator advances. Sizes are remembered per
    shapes and arguments (a meta kernel, often written in Python, costs more than a small step's real op).
    """
    allocates = _ALLOCATES.get(func)
    if allocates is None:
        rets = func._schema.returns
        allocates = _ALLOCATES[func] = any("Tensor" in str(r.type) and r.alias_info is None for r in rets)
    if not allocates:
        return 0
    key = (func, _signature(args), _signature(kwargs))
    if key not in _SIZED:
        if len(_SIZED) > 2**17:
            _SIZED.clear()
        _SIZED[key] = _meta_bytes(func, args, kwargs)
    return _SIZED[key]


def _signature(x: Any) -> Any:
    """What an op's output size can depend on: tensors by dtype, shape and strides (a meta kernel never reads
    values), everything else by value."""
    if isinstance(x, torch.Tensor):
        return x.dtype, tuple(x.shape), x.stride()
    if isinstance(x, (list, tuple)):
        return tuple(_signature(v) for v in x)
    if isinstance(x, dict):
        return tuple((k, _signature(v)) for k, v in x.items())
    simple = (int, float, bool, str, type(None), torch.dtype, torch.device, torch.memory_format, torch.layout)
    return x if isinstance(x, simple) else repr(x)


def _meta_bytes(func: Any, args: tuple, kwargs: dict) -> int | None:
    """``func`` run on meta copies of its arguments: the bytes of its outputs, or ``None`` when it cannot run so."""

    def meta(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            return torch.empty_strided(x.size(), x.stride(), dtype=x.dtype, device="meta")
        return torch.device("meta") if isinstance(x, torch.device) else x

    kwargs = {**kwargs, "device": "meta"} if "device" in kwargs else kwargs
    try:
        with _disable_current_modes():
            out = func(*tree_map(meta, args), **tree_map(meta, kwargs))
    except Exception:  # no meta kernel, or data-dependent: the op runs and the limit checks its outputs after it
        return None
    return sum(t.untyped_storage().nbytes() for t in _tensor_leaves(out))


class MemoryLimit(LiveTensorTracker):
    """A ``LiveTensorTracker`` that refuses to count past ``limit`` bytes: the allocation that would pass it raises,
    and is never counted — ``torch.OutOfMemoryError`` with CUDA's wording (a device), or ``LimitReached`` (a probe's
    share, ``device=False``). Nested inside another tracker it limits only what is allocated while it is active.
    After the error, ``release`` frees what the failed step held.

    A probe's limit (``device=False``) refuses an op before it runs when its outputs, computed on meta tensors
    (``output_bytes``), would pass the limit: the bound a probe obeys then holds also for every tracker around it —
    the device, or an exact tracker around planning — since the allocation never happens. Only an op meta cannot
    size (data-dependent shapes: ``nonzero``, boolean indexing, small in every task's loss) is checked after it ran.
    """

    def __init__(self, limit: int, name: str = "memory limit", device: bool = True, flops: bool = False) -> None:
        super().__init__(flops)
        self.limit, self.name, self.device = int(limit), name, device

    def _refuse(self, nbytes: int) -> None:
        if self.current + nbytes > self.limit:
            what = f"Tried to allocate {_mib(nbytes)}. {self.name} of {_mib(self.limit)} has " \
                   f"{_mib(self.limit - self.current)} free ({_mib(self.current)} allocated)"
            raise torch.OutOfMemoryError(f"CUDA out of memory. {what}") if self.device else LimitReached(what)

    def _add(self, st: torch.UntypedStorage) -> None:
        self._refuse(self._bytes(st))
        super()._add(st)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if not self.device and (need := output_bytes(func, args, kwargs or {})):
            self._refuse(need)
        return super().__torch_dispatch__(func, types, args, kwargs)


MIB = 2**20


def cuda_block_bytes(nbytes: int) -> int:
    """The bytes CUDA's caching allocator holds for a tensor of ``nbytes`` (torch 2.14.1,
    ``c10/cuda/CUDACachingAllocator.cpp``): blocks are multiples of 512 bytes (``kMinBlockSize``); a request of
    10 MiB or more (``kMinLargeAlloc``) gets a segment of its own rounded up to 2 MiB (``kRoundLarge``), whose tail of
    at most 1 MiB is not split off for others (``kSmallSize``); smaller requests are split from shared 2 MiB or
    20 MiB segments, whose rest serves other tensors.

    Examples:
        >>> cuda_block_bytes(1), cuda_block_bytes(513), cuda_block_bytes(11 * 2**20 + 1) // 2**20
        (512, 1024, 12)
    """
    block = max(-(-nbytes // 512) * 512, 512)
    if block < 10 * MIB:
        return block
    segment = -(-block // (2 * MIB)) * 2 * MIB
    return segment if segment - block <= MIB else block


class SimulatedDevice(MemoryLimit):
    """A GPU of ``limit`` bytes simulated on CPU: every tensor allocated while it is active counts against the limit.

    It answers what planning asks CUDA (``mem_get_info``, ``memory_allocated``, ``memory_reserved``,
    ``max_memory_allocated``, ``reset_peak_memory_stats``); reserved equals allocated (no caching allocator).
    Enter it around everything that would run on the GPU, the model's construction included.

    With ``allocator=True`` every tensor counts for the block CUDA's caching allocator would give it
    (``cuda_block_bytes``), so that a rehearsal shows the rounding margin a GPU needs. Still not modelled: freed
    blocks the allocator keeps cached (reserved memory above allocated), fragmentation of segments, cuDNN and cuBLAS
    workspaces, the CUDA context (several hundred MiB outside PyTorch's statistics).
    """

    def __init__(self, limit: int, allocator: bool = False) -> None:
        super().__init__(limit, name="simulated device")
        self.allocator = allocator

    def _bytes(self, st: torch.UntypedStorage) -> int:
        return cuda_block_bytes(st.nbytes()) if self.allocator else st.nbytes()

    @property
    def counts(self) -> str:
        """What a tensor counts for, for log lines."""
        return "tensors in CUDA allocator blocks" if self.allocator else "exact tensor bytes"

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


class UntoldDevice(MemoryLimit):
    """A device of ``limit`` bytes that planning is not told about: it raises CUDA's out-of-memory error as
    ``SimulatedDevice`` does, but ``device_memory`` does not see it — a GPU whose free memory moved after planning
    read it (other processes, fragmentation), or one that reports nothing. Every memory decision must survive it:
    probes that run out count as "does not fit" (``unless_oom``), AutoBatch narrows the batch between the last fit
    and the failure, escalation plans within what its probes find."""

    def __init__(self, limit: int) -> None:
        super().__init__(limit, name="untold device")


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


def parse_device(device: Any) -> tuple[str, list[int]]:
    """``device=`` as Ultralytics reads it (``select_device``/``parse_device``, without their GPU queries):
    ``(backend, CUDA indices)``. The backend is ``""`` when nothing is given (CUDA where available), ``"cuda"`` for
    ``cuda``, ``cuda:N`` and index lists (``0``, ``0,1``, ``[0, 1]``, ``-1`` for an idle GPU), else the backend's
    name (``cpu``, ``mps``, ``npu``, ``xpu``, ...); the indices are those listed.

    Examples:
        >>> parse_device("cuda:0,1"), parse_device([0, 1]), parse_device("xpu:0"), parse_device(None)
        (('cuda', [0, 1]), ('cuda', [0, 1]), ('xpu', []), ('', []))
    """
    name = re.sub(r"[\s()\[\]']", "", str(device if device is not None else "")).lower()
    if name in {"", "none"}:
        return "", []
    name = name.removeprefix("cuda:")
    if name == "cuda":
        return "cuda", []
    if re.fullmatch(r"-?\d+(,-?\d+)*", name):
        return "cuda", [int(x) for x in name.split(",")]
    return re.match(r"[a-z_]*", name).group() or name, []


def device_memory(device: torch.device | str | None) -> DeviceMemory | None:
    """The memory of the training ``device``: CUDA, the active simulated device on CPU, or ``None`` (no limit).

    The training device decides: a CPU run on a machine that has CUDA has no limit unless a simulated device is active.
    """
    device = torch.device(device if device is not None else "cpu")
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        free, total = torch.cuda.mem_get_info(index)
        reserved, allocated = torch.cuda.memory_reserved(index), torch.cuda.memory_allocated(index)
        # ``set_per_process_memory_fraction`` caps what this process's allocator may reserve, whatever is free
        fraction = getattr(torch.cuda, "get_per_process_memory_fraction", lambda _: 1.0)(index)  # torch >= 2.6
        usable = min(free + reserved, int(fraction * total))
        return DeviceMemory(total, usable, max(usable - allocated, 0), ALLOCATOR_MARGIN, f"cuda:{index}")
    if (sim := simulated_device()) is not None:
        free, total = sim.mem_get_info()
        return DeviceMemory(total, total, free, 1.0, f"simulated device ({total / 2**30:.3f} GB)")
    return None


CUDA_MEMORY_ERRORS = ("CUBLAS_STATUS_ALLOC_FAILED", "CUDNN_STATUS_INTERNAL_ERROR", "unable to find an engine")
"""Besides "out of memory": what cuBLAS and cuDNN raise when they cannot allocate their workspaces, which
Ultralytics' first-epoch retry (``BaseTrainer._do_train``) treats as memory errors too."""


def is_oom(e: BaseException) -> bool:
    """Whether ``e`` means "does not fit": a memory error as Ultralytics' retry recognises one (CUDA's out of memory,
    cuBLAS/cuDNN workspace failures, a simulated device's), or a probe that reached its share."""
    if isinstance(e, LimitReached):
        return True
    text = str(e) if isinstance(e, RuntimeError) else ""
    return "out of memory" in text.lower() or any(s in text for s in CUDA_MEMORY_ERRORS)


def unless_oom(measure: Callable[[], T], device: torch.device | str | None = None) -> T | None:
    """``measure()``, or ``None`` when it did not fit (``is_oom``), what it allocated then released (``release``:
    outside the ``except`` block, where the traceback no longer holds the failed step)."""
    try:
        return measure()
    except RuntimeError as e:
        if not is_oom(e):
            raise
    release(device)
    return None


def release(device: torch.device | str | None = None) -> None:
    """Free what a failed step left: the autograd engine's queue of the failed backward (torch 2.14.1 keeps its
    pending gradients until the next backward on this thread runs: found as 11 MiB held after a failed probe of a
    small model, so one tiny backward drains it), the graph's cycles (the collector), CUDA's cached blocks."""
    torch.ones(1, requires_grad=True).sum().backward()
    gc.collect()
    if torch.device(device or "cpu").type == "cuda":
        torch.cuda.empty_cache()
