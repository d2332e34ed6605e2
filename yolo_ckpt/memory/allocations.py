"""A step's tensor memory from torch.profiler's allocation records: the figure for compiled steps on CPU.

The exact ``LiveTensorTracker`` is a dispatch mode, and dynamo skips the frames it would compile while one is active,
so a compiled step cannot be tracked. torch's profiler (``profile_memory=True``) records every allocation and free
of the CPU allocator while it runs, compiled kernels included: the running sum of those records from a window's
start is the bytes the window allocated and still holds, and its high-water mark the window's peak above what was
alive at its start.

It agrees with the tracker on eager steps (``tests/test_memory.py``, ``tests/test_compile.py``): within 2% on
yolo11n at 160 px, 1.1% at 640 px. It may lie above the tracker, never below by more than the window's own frees of
older tensors: the profiler also sees scratch memory a kernel allocates and frees inside one op, and a tensor
allocated before the window (the profiler did not see it come) is not subtracted when it is freed inside it.

Examples:
    >>> import torch
    >>> def step():
    ...     x = torch.ones(1024, 256)  # 1 MiB
    ...     y = x * 2  # +1 MiB
    ...     del x, y
    >>> profile_step(step).peak // 2**20  # and a few bytes the profiler saw besides
    2
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

__all__ = ["BACKWARD_MARK", "AllocationPeak", "AllocationWindow", "allocation_peak", "memory_events", "profile_step"]

BACKWARD_MARK = "## backward ##"
"""The ``torch.profiler.record_function`` name a step wraps its backward in, so that ``kept`` can be read."""


class AllocationPeak(NamedTuple):
    """What a window of allocation records says.

    Attributes:
        peak (int): High-water mark of the records' running sum from the window's start, bytes.
        kept (int): The running sum when the window's ``BACKWARD_MARK`` starts (what forward kept for backward), or
            at the window's end where it has none.
    """

    peak: int
    kept: int


def memory_events(prof: torch.profiler.profile) -> list[tuple[int, int]]:
    """``(time_ns, bytes)`` of every allocation record of the trace (+ allocated, - freed), in time order.

    The raw records (``kineto_results``): ``prof.events()`` attributes a record made inside an op to that op and
    lists only the rest as ``[memory]``."""
    records = prof.profiler.kineto_results.events()
    return sorted(((e.start_ns(), e.nbytes()) for e in records if e.name() == "[memory]"), key=lambda e: e[0])


def allocation_peak(prof: torch.profiler.profile, backward_mark: str = BACKWARD_MARK) -> AllocationPeak:
    """The peak and kept-at-backward bytes of a finished profile (see the module's docstring)."""
    events = prof.profiler.kineto_results.events()
    backward_at = min((e.start_ns() for e in events if e.name() == backward_mark), default=None)
    current = peak = 0
    kept = None
    for t, nbytes in memory_events(prof):
        if kept is None and backward_at is not None and t >= backward_at:
            kept = current
        current += nbytes
        peak = max(peak, current)
    return AllocationPeak(peak, current if kept is None else kept)


def profile_step(step: Callable[[], None], backward_mark: str = BACKWARD_MARK) -> AllocationPeak:
    """Peak and kept-at-backward bytes of ``step()`` from the profiler's allocation records.

    ``step`` wraps its backward in ``torch.profiler.record_function(backward_mark)`` for ``kept`` to be read.
    """
    window = AllocationWindow()
    window.start()
    try:
        step()
    finally:
        measured = window.stop()
    return measured


class AllocationWindow:
    """Allocation records over a window that opens and closes in different places (a trainer's callbacks):
    ``start()``, ``stop()`` for its ``AllocationPeak``, ``close()`` on any exit.

    Only the CPU activity is profiled, with memory and nothing else (no shapes, no stacks): the records of one
    training step, a few MB of trace.
    """

    def __init__(self) -> None:
        self._prof: torch.profiler.profile | None = None

    @property
    def running(self) -> bool:
        """Whether the window is open."""
        return self._prof is not None

    def start(self) -> None:
        """Open the window (a window open already is dropped unread)."""
        self.close()
        self._prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True)
        self._prof.start()

    def stop(self) -> AllocationPeak | None:
        """Close the window and return what it recorded; ``None`` when it was not open."""
        prof, self._prof = self._prof, None
        if prof is None:
            return None
        prof.stop()
        return allocation_peak(prof)

    def close(self) -> None:
        """Close the window unread, if open."""
        prof, self._prof = self._prof, None
        if prof is not None:
            prof.stop()
