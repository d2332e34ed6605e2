"""Peak memory per training epoch, where users look: results.csv, the console, Ultralytics' loggers, memory.png.

``EpochPeak`` measures one epoch at a time with the right source for the run (:mod:`yolo_ckpt.memory.tracker`):

==========================  ========================================  ===============================================
run                         source                                    results.csv columns (GB = 2**30 bytes)
==========================  ========================================  ===============================================
CUDA                        caching allocator peaks                   ``mem/peak_alloc_GB``, ``mem/peak_reserved_GB``
CPU (any non-CUDA device)   exact live tensor bytes (dispatch mode)   ``mem/peak_tensor_GB``
CPU with ``compile=True``   process peak RSS (``VmHWM``)              ``mem/peak_rss_GB``
==========================  ========================================  ===============================================

Validation is measured with the same meter, in columns of its own beside the epoch's (``mem/val_peak_tensor_GB``, ...;
NaN in an epoch that does not validate); the final evaluation's peak goes to the console and to the metrics of its
``on_fit_epoch_end``.

Ultralytics' events do not always come in pairs: its first-epoch out-of-memory retry restarts an epoch without
``on_train_epoch_end``, an exception skips the end, early stopping and resume start mid-way. So ``start`` restarts a
measurement that is already running, ``stop`` on a meter that is not running reports nothing, and ``close`` (on any
exit) leaves no dispatch mode behind. The trainer glue below is three callbacks, registered once per trainer ahead
of every other (a user's callback of the same event reads this epoch's figures), ``validation_memory`` around the
trainer's validations, and ``close_epoch_memory``, which the trainer calls however training ends.

Examples:
    >>> import torch
    >>> meter = EpochPeak("cpu")
    >>> meter.start()
    >>> x = torch.ones(1024, 256)  # 1 MiB
    >>> meter.start()  # an epoch restarted without ending (OOM retry): the peak restarts, nothing breaks
    >>> y = x * 2  # +1 MiB
    >>> del y
    >>> meter.stop()["mem/peak_tensor_GB"] * 2**30
    2097152.0
    >>> meter.stop()  # not running: nothing measured, never a made-up 0
    {}
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import torch
from ultralytics.utils import LOGGER, colorstr

from ..memory.device import simulated_device
from ..memory.tracker import GB, CudaPeak, LiveTensorTracker, cuda_peak, reset_rss_peak, rss_peak
from .distributed import gather

SOURCES: dict[str, tuple[tuple[str, ...], str]] = {  # source -> (results.csv columns, what the console line says)
    "cuda": (("mem/peak_alloc_GB", "mem/peak_reserved_GB"), "allocated/reserved (CUDA allocator)"),
    "tensor": (("mem/peak_tensor_GB",), "live tensor bytes (exact, CPU)"),
    "rss": (("mem/peak_rss_GB",), "process peak RSS (CPU, compiled)"),
}
PREFIX = colorstr("memory:")


class EpochPeak:
    """Peak memory of one epoch: ``start()`` when it begins, ``stop()`` when it ends, ``close()`` on any exit.

    Attributes:
        source (str): ``"cuda"``, ``"tensor"`` (exact CPU tracking) or ``"rss"`` (CPU under torch.compile).
        tracker (LiveTensorTracker | None): The exact tracker for ``"tensor"``; entered at ``start`` and exited at
            ``stop`` on the same thread. Tensors alive before the first ``start`` count only if passed to its
            ``track``; tensors allocated in an earlier epoch and still alive keep counting.
    """

    def __init__(self, device: torch.device | str | int | None = None, compiled: bool = False) -> None:
        """Create the meter.

        Args:
            device: Training device; an int or ``None`` with CUDA available means a CUDA device.
            compiled: The model runs under ``torch.compile``; on CPU this selects process RSS, because exact
                tracking runs every op through a dispatch mode that compiled graphs cannot contain.
        """
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
        self.source = "cuda" if self.device.type == "cuda" else "rss" if compiled else "tensor"
        # on a simulated device every tensor of the run is counted already: its own peak is the epoch's
        self.simulated = simulated_device() if self.source == "tensor" else None
        self.tracker = LiveTensorTracker() if self.source == "tensor" and self.simulated is None else None
        self._running = False
        self._ops_at_start = 0
        # the epoch's ``cuda_peak`` block, entered at ``start`` and ended at ``stop``: the epoch spans two callbacks
        self._cuda: AbstractContextManager[CudaPeak] | None = None
        self._cuda_peak: CudaPeak | None = None
        self._rss_ok = False

    @property
    def keys(self) -> tuple[str, ...]:
        """Names of the values ``stop`` returns for this source (results.csv columns)."""
        return SOURCES[self.source][0]

    @property
    def description(self) -> str:
        """What the figures are, for the console line."""
        return "live tensor bytes on the simulated device (exact, CPU)" if self.simulated else SOURCES[self.source][1]

    @property
    def running(self) -> bool:
        """Whether an epoch is being measured."""
        return self._running

    def start(self) -> None:
        """Begin measuring an epoch; if one is being measured already (restarted without an end), restart its peak."""
        if self.source == "cuda":
            self._cuda = cuda_peak(self.device)  # a block restarted without its end is dropped unread
            self._cuda_peak = self._cuda.__enter__()
        elif self.source == "rss":
            self._rss_ok = reset_rss_peak()
        elif self.simulated is not None:
            self.simulated.reset_peak()
            self._ops_at_start = self.simulated.num_ops
        else:
            self.tracker.reset_peak()
            self._ops_at_start = self.tracker.num_ops
            if not self._running:
                self.tracker.__enter__()
        self._running = True

    def stop(self) -> dict[str, float]:
        """End the epoch and return its peaks in GB; ``{}`` when not measuring or nothing was measured."""
        if not self._running:
            return {}
        if self.tracker is not None:
            self.tracker.__exit__(None, None, None)  # raises (and stays entered) if another mode is on top
        self._running = False
        if self.source == "cuda":
            self._cuda.__exit__(None, None, None)
            values = (self._cuda_peak.allocated, self._cuda_peak.reserved)
            self._cuda = None
        elif self.source == "rss":
            peak = rss_peak() if self._rss_ok else None
            values = (peak,) if peak else ()
        else:
            counter = self.simulated or self.tracker
            values = (counter.peak,) if counter.num_ops > self._ops_at_start else ()
        return {k: v / GB for k, v in zip(self.keys, values)}

    def close(self) -> None:
        """Stop measuring without reporting (training ended, or failed, mid-epoch): no device call that could fail."""
        if self._running and self.tracker is not None:
            self.tracker.__exit__(None, None, None)
        self._cuda = None  # the block is dropped unread: ending it would synchronise the device
        self._running = False


def is_compiled(model: Any) -> bool:
    """Whether ``model`` (possibly inside DataParallel/DDP) is a ``torch.compile`` module."""
    while isinstance(model, (torch.nn.DataParallel, torch.nn.parallel.DistributedDataParallel)):
        model = model.module
    return hasattr(model, "_orig_mod")


# Trainer glue: Ultralytics callbacks. Module-level functions, so a DDP worker that receives a trainer's callbacks
# (pickled by reference) gets these very objects and a trainer can register each once.
def start_epoch_memory(trainer: Any) -> None:
    """``on_train_epoch_start``: (re)start the epoch's peak; on CPU count the live weights, EMA and optimizer state."""
    meter = trainer.run_memory.meter
    if meter is None:
        meter = trainer.run_memory.meter = EpochPeak(trainer.device, compiled=is_compiled(trainer.model))
        if meter.source == "rss":
            LOGGER.info(f"{PREFIX} compile=True on CPU: exact tensor tracking would run every op through a dispatch "
                        f"mode that compiled graphs cannot hold, so mem/peak_rss_GB is the process peak RSS instead")
    if meter.tracker is not None:
        held = [trainer.model.parameters(), trainer.model.buffers(), trainer.ema.ema.state_dict(),
                trainer.optimizer.state_dict()["state"]]
        meter.tracker.track([list(h) if not isinstance(h, dict) else h for h in held])
    trainer.run_memory.val = {val_key(k): math.nan for k in meter.keys}  # until this epoch validates
    meter.start()


def stop_epoch_memory(trainer: Any) -> None:
    """``on_train_epoch_end``: keep the epoch's peaks for results.csv and the loggers, and print them.

    Under DDP (every rank runs this event) each rank measures its own process and device; results.csv and the loggers
    get the maximum over ranks, the rank that runs out first, and the console line names it.
    """
    meter = trainer.run_memory.meter
    measured = meter.stop() if meter is not None else {}
    keys = meter.keys if meter is not None else ()
    own = {k: measured.get(k, math.nan) for k in keys}  # fixed columns; NaN = not measured
    ranks = gather(own)
    trainer.run_memory.epoch_own = own
    trainer.run_memory.epoch, top = most_of(ranks, keys)
    trainer.metrics = {**(trainer.metrics or {}), **trainer.run_memory.epoch}  # for the callbacks after ours
    if any(math.isfinite(v) for v in trainer.run_memory.epoch.values()):
        values = "/".join(f"{v:.3f}" for v in trainer.run_memory.epoch.values())
        where = f", rank {top} of {len(ranks)} (the most; ranks {rank_values(ranks, keys)})" if len(ranks) > 1 else ""
        LOGGER.info(f"{PREFIX} epoch {trainer.epoch + 1} peak {values} GB {meter.description}{where}")


def val_key(key: str) -> str:
    """The results.csv column of validation's peak beside the epoch's: ``mem/val_peak_tensor_GB``."""
    return key.replace("mem/", "mem/val_", 1)


@contextmanager
def validation_memory(trainer: Any, what: str) -> Iterator[None]:
    """Measure a validation's peak (``what``: "validation", "final evaluation") with the epoch's meter, into
    ``run_memory.val`` and the console. In this process only: under DDP each rank validates its share."""
    meter = trainer.run_memory.meter
    if meter is not None:
        meter.start()
    try:
        yield
    finally:
        stop_validation_memory(trainer, what)


def stop_validation_memory(trainer: Any, what: str) -> None:
    """End a validation's measurement, if one runs: its peaks into ``run_memory.val``, and one console line."""
    meter = trainer.run_memory.meter
    if meter is None or not meter.running:
        return
    measured = meter.stop()
    trainer.run_memory.val = {val_key(k): measured.get(k, math.nan) for k in meter.keys}
    if measured:
        values = "/".join(f"{v:.3f}" for v in measured.values())
        LOGGER.info(f"{PREFIX} {what} peak {values} GB {meter.description}")


def memory_in_metrics(trainer: Any) -> None:
    """``on_fit_epoch_end``, before any other callback: the epoch's and the validation's peaks in ``trainer.metrics``,
    also after the final evaluation (whose measurement ends here, where its metrics are handed on)."""
    stop_validation_memory(trainer, "final evaluation")
    ours = {**trainer.run_memory.epoch, **trainer.run_memory.val}
    trainer.metrics = {**{k: v for k, v in (trainer.metrics or {}).items() if k not in ours},
                       **{k: v for k, v in ours.items() if math.isfinite(v)}}  # loggers: what was measured


def most_of(ranks: list[dict[str, float]], keys: tuple[str, ...]) -> tuple[dict[str, float], int]:
    """Each column's maximum over ranks (NaN where no rank measured it), and the rank holding the first column's."""
    def value(r: int, k: str) -> float:
        v = ranks[r].get(k, math.nan)
        return v if math.isfinite(v) else -math.inf

    best = {k: max(range(len(ranks)), key=lambda r: value(r, k)) for k in keys}
    peaks = {k: ranks[r].get(k, math.nan) if math.isfinite(value(r, k)) else math.nan for k, r in best.items()}
    return peaks, (best[keys[0]] if keys else 0)


def rank_values(ranks: list[dict[str, float]], keys: tuple[str, ...]) -> str:
    """``0.103, 1.234``: the first column of every rank, in rank order."""
    return ", ".join(f"{r.get(keys[0], math.nan):.3f}" for r in ranks) if keys else ""


def close_epoch_memory(trainer: Any) -> None:
    """On any end of training, also after an exception: never leave the CPU tracker active."""
    if trainer.run_memory.meter is not None:
        trainer.run_memory.meter.close()


CALLBACKS = {"on_train_epoch_start": start_epoch_memory, "on_train_epoch_end": stop_epoch_memory,
             "on_fit_epoch_end": memory_in_metrics}
