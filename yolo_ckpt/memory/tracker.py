"""How to measure memory: exact live tensor bytes, CUDA allocator peaks, allocation records.

Three sources of truth, for three situations:

* **CUDA**: the caching allocator's own statistics
  (:func:`torch.cuda.max_memory_allocated` / :func:`torch.cuda.max_memory_reserved`),
  read over a block by :func:`cuda_peak`.
* **CPU** (or any other device): the CPU allocator keeps no statistics, so
  :class:`LiveTensorTracker` counts the bytes of tensor storages that are
  allocated while it is active and still alive, and keeps their exact
  high-water mark.
* **CPU under torch.compile**: a dispatch mode cannot run inside compiled
  graphs (dynamo skips frames while one is active), so a compiled step is
  measured from torch.profiler's allocation records instead
  (:mod:`yolo_ckpt.memory.allocations`).

What a training run reports per epoch is built on these in
:mod:`yolo_ckpt.integration.epoch_memory`.

Why not ``torch.distributed._tools.mem_tracker.MemTracker``? It is private API
(not in the torch docs, may change without notice), imports
``torch.distributed``, adds module and optimizer hooks plus a monkey-patch of
``UntypedStorage.resize_``, rounds CUDA sizes to 512 bytes, and counts any
output storage it has not seen before, including storages that existed before
it started (e.g. a view of a parameter). :class:`LiveTensorTracker` is the same
core idea (a dispatch mode plus weak references to storages) reduced to what is
needed here.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import flop_registry

__all__ = ["LiveTensorTracker", "CudaPeak", "cuda_peak", "GB"]

GB = 2**30
"""Bytes per "GB" in reported values (binary GiB, as Ultralytics reports GPU memory)."""


def _storage(t: torch.Tensor) -> torch.UntypedStorage | None:
    """Return the untyped storage of a dense tensor, or ``None`` if it has no real memory.

    Meta tensors have no memory; sparse, nested and other storage-less tensors
    raise on ``untyped_storage()``; both are skipped.
    """
    if t.is_meta:
        return None
    try:
        return t.untyped_storage()
    except (RuntimeError, NotImplementedError, TypeError):
        return None


def _op_flops(func: Any, args: Any, kwargs: dict, out: Any) -> int:
    """Convolution/matmul FLOPs of one ATen op by torch's own formulas (``flop_registry``, the ones
    ``torch.utils.flop_counter.FlopCounterMode`` sums); 0 for every other op.

    Most formulas are registered wrapped in ``shape_wrapper``, which maps every argument to its shape with
    ``tree_map``: a fifth of a tracked step's time on a small model. Where the wrapper's ``__wrapped__`` formula
    (``functools.wraps``; torch 2.14) is there and the arguments are flat, the same shapes are handed to it directly.
    """
    count = flop_registry.get(getattr(func, "_overloadpacket", None))
    if count is None:
        return 0
    formula = getattr(count, "__wrapped__", None)
    if formula is None or not _flat(args) or not _flat(kwargs.values()) or not _flat((out,)):
        return count(*args, **kwargs, out_val=out)
    return formula(*map(_shape, args), out_shape=_shape(out), **{k: _shape(v) for k, v in kwargs.items()})


def _shape(x: Any) -> Any:
    """``flop_counter.get_shape`` over one level of tuple or list: what ``shape_wrapper``'s ``tree_map`` gives."""
    if isinstance(x, torch.Tensor):
        return x.shape
    if type(x) is tuple or type(x) is list:
        return type(x)(e.shape if isinstance(e, torch.Tensor) else e for e in x)
    return x


def _flat(xs: Iterable[Any]) -> bool:
    """Whether ``_shape`` maps every one of ``xs`` as ``tree_map`` would: no container deeper than one plain tuple
    or list (a namedtuple or a nested container is left to torch's own wrapper)."""
    for x in xs:
        kind = type(x)
        if kind is tuple or kind is list:
            if any(isinstance(e, (tuple, list, dict)) for e in x):
                return False
        elif isinstance(x, (tuple, list, dict)):
            return False
    return True


class LiveTensorTracker(TorchDispatchMode):
    """Exact peak of live tensor storage bytes allocated while active (CPU or any device).

    A storage is counted when it first appears as the output of an ATen op and
    is not the storage of one of that op's input tensors; so views, in-place
    ops and ``out=`` ops, which return an input's storage, add nothing (except
    that an ``out=``/``resize_`` op that grows an already counted storage adds
    the growth). Each storage is counted once with ``untyped_storage().nbytes()``
    and is subtracted when it is freed, i.e. when its last tensor (held from
    Python or from C++, e.g. by the autograd graph) dies. The peak is the
    exact high-water mark of that sum as seen between ops.

    Frees are detected with a weak reference to the storage's Python object.
    This is exact because torch preserves a storage's Python object for as
    long as its C++ ``StorageImpl`` lives ("PyObject preservation"), so the
    weakref callback fires exactly when the last tensor using the storage
    dies (tested in ``tests/test_memory.py``).

    The tracker never changes numerics: every op is run as ``func(*args, **kwargs)``.
    It sees ops run on the thread that entered it, including autograd backward
    on CPU (which runs on the calling thread) and the recomputation of
    ``torch.utils.checkpoint``. CUDA backward runs on the engine's device
    threads; the engine copies the caller's thread-local state into them
    (``GraphTask::thread_locals_``, an ``at::ThreadLocalState`` that includes
    the dispatch-mode stack), so those ops are seen too. Storages of all
    devices are counted together.

    Not counted: storages created before the tracker started (unless passed to
    :meth:`track`), scratch memory a kernel allocates and frees internally,
    tensors created without an op (``torch.from_numpy``, tensors received from
    DataLoader worker processes), growth of a storage via
    ``UntypedStorage.resize_`` called directly, and meta/sparse tensors.

    With ``flops=True`` it also sums every op's convolution/matmul FLOPs (``_op_flops``): planning wants both
    figures of one step, and a second dispatch mode around the same step would cost as much Python per op again.

    Attributes:
        current: Bytes of tracked storages alive now.
        peak: High-water mark of ``current`` since start or the last :meth:`reset_peak`.
        num_ops: Number of ops observed (0 means nothing was measured).
        flops: FLOPs counted so far (``flops=True`` only; 0 otherwise).

    Examples:
        >>> import torch
        >>> from yolo_ckpt.memory.tracker import LiveTensorTracker
        >>> with LiveTensorTracker() as tracker:
        ...     a = torch.zeros(1000, dtype=torch.float32)  # +4000 bytes
        ...     b = a.view(10, 100)                          # view: +0
        ...     a += 1.0                                     # in-place: +0
        ...     c = a * 2                                    # +4000 bytes
        ...     del c                                        # -4000 bytes
        >>> tracker.current, tracker.peak
        (4000, 8000)
        >>> del a, b
        >>> tracker.current, tracker.peak
        (0, 8000)

        Over many steps (an epoch), keep one tracker and re-enter it (or stay
        inside it); ``current`` carries over, and :meth:`reset_peak` starts a
        new high-water mark from it whenever you want a per-step or
        per-epoch peak.
    """

    def __init__(self, flops: bool = False) -> None:
        super().__init__()
        self.current: int = 0
        self.peak: int = 0
        self.num_ops: int = 0
        self.flops: int = 0
        self._count_flops = flops
        # StorageImpl address -> [counted nbytes, weakref to the storage PyObject].
        self._live: dict[int, list[Any]] = {}
        self._depth: int = 0

    # ------------------------------------------------------------------ public API
    def reset_peak(self) -> None:
        """Restart the high-water mark from the bytes alive now (``peak = current``)."""
        self.peak = self.current

    def track(self, tensors: Iterable[Any]) -> int:
        """Count storages that already exist (e.g. parameters) as if allocated now.

        Args:
            tensors: Any pytree (list, tuple, dict, generator such as
                ``model.parameters()``) whose tensor leaves should be counted.

        Returns:
            The number of bytes newly added to ``current``.
        """
        if not isinstance(tensors, (list, tuple, dict)):
            tensors = list(tensors)
        before = self.current
        for t in tree_leaves(tensors):
            if isinstance(t, torch.Tensor):
                st = _storage(t)
                if st is not None and st._cdata not in self._live:
                    self._add(st)
        if self.current > self.peak:
            self.peak = self.current
        return self.current - before

    # ------------------------------------------------------------ context manager
    def __enter__(self) -> LiveTensorTracker:
        # Nested ``with`` on the same tracker is a no-op: pushing it twice would
        # run every op through it twice. (The depth is per tracker, not per
        # thread: use one tracker per thread.)
        if self._depth == 0:
            super().__enter__()
        self._depth += 1
        return self

    def __exit__(self, exc_type: Any, exc_val: Any, exc_tb: Any) -> None:
        if self._depth <= 0:
            raise RuntimeError("LiveTensorTracker.__exit__ called without matching __enter__")
        self._depth -= 1
        if self._depth == 0:
            top = _get_current_dispatch_mode()
            if top is not self:
                # TorchDispatchMode.__exit__ pops whatever mode is on top; refuse
                # to pop someone else's.
                self._depth += 1
                raise RuntimeError(
                    f"LiveTensorTracker must be exited on the thread that entered it and after "
                    f"every mode entered later has exited; top of the dispatch stack is {top!r}"
                )
            super().__exit__(exc_type, exc_val, exc_tb)

    # ------------------------------------------------------------------- internals
    def _on_free(self, key: int, ref: weakref.ref) -> None:
        entry = self._live.get(key)
        if entry is not None and entry[1] is ref:
            del self._live[key]
            self.current -= entry[0]

    def _bytes(self, st: torch.UntypedStorage) -> int:
        """The bytes a storage counts for: its own (``SimulatedDevice`` may round them as an allocator does)."""
        return st.nbytes()

    def _add(self, st: torch.UntypedStorage) -> None:
        key = st._cdata
        nbytes = self._bytes(st)
        ref = weakref.ref(st, lambda r, key=key: self._on_free(key, r))
        self._live[key] = [nbytes, ref]
        self.current += nbytes

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.num_ops += 1
        if self._count_flops:
            self.flops += _op_flops(func, args, kwargs, out)

        live = self._live
        input_keys: set[int] | None = None
        for t in _tensor_leaves(out):
            st = _storage(t)
            if st is None:
                continue
            key = st._cdata
            entry = live.get(key)
            if entry is not None:
                # Already counted; an out=/resize_ op may have grown it in place.
                nbytes = self._bytes(st)
                if nbytes != entry[0]:
                    self.current += nbytes - entry[0]
                    entry[0] = nbytes
                continue
            if input_keys is None:
                input_keys = set()
                for a in _tensor_leaves(args):
                    ast = _storage(a)
                    if ast is not None:
                        input_keys.add(ast._cdata)
                if kwargs:
                    for a in _tensor_leaves(kwargs):
                        ast = _storage(a)
                        if ast is not None:
                            input_keys.add(ast._cdata)
            if key in input_keys:
                continue  # aliases an input that existed before tracking started
            self._add(st)

        if self.current > self.peak:
            self.peak = self.current
        return out


def _tensor_leaves(tree: Any) -> list[torch.Tensor]:
    """Tensor leaves of an op's outputs or arguments.

    Fast path for what ATen ops take and return (tensors, scalars, ``None``
    and plain tuples/lists/dicts of them); any other container (e.g. a
    namedtuple) goes through :func:`torch.utils._pytree.tree_leaves`.
    """
    if isinstance(tree, torch.Tensor):
        return [tree]
    res: list[torch.Tensor] = []
    _collect(tree, res)
    return res


def _collect(tree: Any, res: list[torch.Tensor]) -> None:
    kind = type(tree)
    if kind is tuple or kind is list:
        for x in tree:
            if isinstance(x, torch.Tensor):
                res.append(x)
            elif isinstance(x, (tuple, list, dict)):
                _collect(x, res)
    elif kind is dict:
        _collect(list(tree.values()), res)
    elif isinstance(tree, (tuple, list, dict)):
        res.extend(t for t in tree_leaves(tree) if isinstance(t, torch.Tensor))


# ---------------------------------------------------------------------- CUDA helpers
def _cuda_device(device: torch.device | str | int | None) -> torch.device:
    """Normalise ``device`` to an indexed CUDA device; raise for non-CUDA devices."""
    if device is None:
        return torch.device("cuda", torch.cuda.current_device())
    if isinstance(device, int):
        return torch.device("cuda", device)
    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"expected a CUDA device, got {device}")
    if device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


@dataclass
class CudaPeak:
    """The CUDA allocator's figures over a block (``cuda_peak``).

    Attributes:
        before (int): ``memory_allocated`` when the block started.
        allocated (int): ``max_memory_allocated`` over the block (set when it ends).
        reserved (int): ``max_memory_reserved`` over the block (set when it ends).
    """

    before: int = 0
    allocated: int = 0
    reserved: int = 0


@contextmanager
def cuda_peak(device: torch.device | str | int | None = None) -> Iterator[CudaPeak]:
    """The caching allocator's peaks over the block on a CUDA ``device``, every stream synchronised at both ends (the
    one place that resets the peak statistics around a measured step or epoch).

    The peaks are read from :func:`torch.cuda.memory_stats` (the numbers :func:`torch.cuda.max_memory_allocated` and
    :func:`torch.cuda.max_memory_reserved` give), but a missing statistic raises instead of reading as 0.

    Args:
        device: CUDA device (``"cuda"``, ``"cuda:1"``, ``torch.device``, index, or ``None`` for the current device).

    Raises:
        ValueError: If ``device`` is not a CUDA device (on entering the block).
        RuntimeError: If the allocator has no peak statistics for ``device`` (when the block ends).

    Examples:
        >>> with cuda_peak("cuda:0") as peak:  # doctest: +SKIP
        ...     y = torch.ones(1024, device="cuda:0") * 2
        >>> peak.allocated - peak.before >= 2 * 4096  # doctest: +SKIP
        True
    """
    device = _cuda_device(device)
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    peak = CudaPeak(torch.cuda.memory_allocated(device))
    yield peak
    torch.cuda.synchronize(device)
    stats = torch.cuda.memory_stats(device)
    try:
        peak.allocated, peak.reserved = int(stats["allocated_bytes.all.peak"]), int(stats["reserved_bytes.all.peak"])
    except KeyError as e:
        raise RuntimeError(f"CUDA allocator has no statistic {e} for {device}") from e
