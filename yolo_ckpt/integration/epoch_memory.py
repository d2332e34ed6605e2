"""Peak memory per training epoch, where users look: results.csv, the console, Ultralytics' loggers, memory.png.

``EpochPeak`` measures one epoch at a time with the right source for the run (:mod:`yolo_ckpt.memory.tracker`):

==========================  ========================================  ===============================================
run                         source                                    results.csv columns (GB = 2**30 bytes)
==========================  ========================================  ===============================================
CUDA                        caching allocator peaks                   ``mem/peak_alloc_GB``, ``mem/peak_reserved_GB``
CPU (any non-CUDA device)   exact live tensor bytes (dispatch mode)   ``mem/peak_tensor_GB``
CPU with ``compile=True``   one sampled step's allocation records     ``mem/peak_tensor_GB``
==========================  ========================================  ===============================================

Under ``compile=True`` on CPU the exact tracker cannot run (a dispatch mode: dynamo skips compiled frames under it),
so the epoch's figure is one step's, measured from torch.profiler's allocation records
(:mod:`yolo_ckpt.memory.allocations`): the second step of each epoch (``SAMPLED_STEP``; the first compiles in the
first epoch), profiled from the end of the step before it, so that its batch's loading counts, plus the tensors alive
when it starts (weights, buffers, gradients, the EMA, the optimizer state, and the batch of the step before, which
Ultralytics' loop holds into the next step at every second step), as the tracker counts them. One step in
an epoch is profiled: a step's profile costs a fraction of a step, and an epoch's steps have the same shape. An epoch
of a single step measures nothing (NaN, said on the console). Validation runs the EMA, which is never compiled
(Ultralytics' ``ModelEMA`` copies the unwrapped model), so it keeps the exact tracker.

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

from ..memory.allocations import AllocationWindow
from ..memory.device import simulated_device
from ..memory.tracker import GB, CudaPeak, LiveTensorTracker, cuda_peak
from .distributed import gather

SOURCES: dict[str, tuple[tuple[str, ...], str]] = {  # source -> (results.csv columns, what the console line says)
    "cuda": (("mem/peak_alloc_GB", "mem/peak_reserved_GB"), "allocated/reserved (CUDA allocator)"),
    "tensor": (("mem/peak_tensor_GB",), "live tensor bytes (exact, CPU)"),
    "allocations": (("mem/peak_tensor_GB",), "tensor bytes of step {step} from allocation records (CPU, compiled)"),
}
PREFIX = colorstr("memory:")
SAMPLED_STEP = 2
"""The step of each epoch a compiled CPU run profiles (1-based): the first after one has run, warm."""


class EpochPeak:
    """Peak memory of one epoch: ``start()`` when it begins, ``stop()`` when it ends, ``close()`` on any exit.

    Attributes:
        source (str): ``"cuda"``, ``"tensor"`` (exact CPU tracking) or ``"allocations"`` (CPU under torch.compile:
            one sampled step's allocation records, ``step_ended``).
        tracker (LiveTensorTracker | None): The exact tracker for ``"tensor"``, and for the eager blocks of
            ``"allocations"`` (``start(eager=True)``); entered at ``start`` and exited at ``stop`` on the same thread.
            Tensors alive before the first ``start`` count only if passed to its ``track``; tensors allocated in an
            earlier epoch and still alive keep counting.
    """

    def __init__(self, device: torch.device | str | int | None = None, compiled: bool = False) -> None:
        """Create the meter.

        Args:
            device: Training device; an int or ``None`` with CUDA available means a CUDA device.
            compiled: The model runs under ``torch.compile``; on CPU this selects allocation records of a sampled
                step, because exact tracking runs every op through a dispatch mode that compiled graphs cannot contain.
        """
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
        self.source = "cuda" if self.device.type == "cuda" else "allocations" if compiled else "tensor"
        # on a simulated device every tensor of the run is counted already: its own peak is the epoch's
        self.simulated = simulated_device() if self.source == "tensor" else None
        self.tracker = LiveTensorTracker() if self.source != "cuda" and self.simulated is None else None
        self._running = False
        self._ops_at_start = 0
        # the epoch's ``cuda_peak`` block, entered at ``start`` and ended at ``stop``: the epoch spans two callbacks
        self._cuda: AbstractContextManager[CudaPeak] | None = None
        self._cuda_peak: CudaPeak | None = None
        # "allocations": the sampled step's window, the bytes alive when it opened, steps ended, the figure
        self._window = AllocationWindow()
        self._held = 0
        self._steps = 0
        self._sampled: int | None = None
        self._tracking = False  # the tracker is entered (an eager block)
        self._eager = False  # what is measured runs eagerly (``start(eager=True)``)
        self.batch_bytes = 0  # the last training batch's, counted beside the sampled step (``batch_ready``)

    @property
    def keys(self) -> tuple[str, ...]:
        """Names of the values ``stop`` returns for this source (results.csv columns)."""
        return SOURCES[self.source][0]

    @property
    def description(self) -> str:
        """What the figures are, for the console line."""
        if self.simulated:
            return "live tensor bytes on the simulated device (exact, CPU)"
        if self.source == "allocations" and self._eager:
            return "live tensor bytes (exact, CPU: it runs eagerly)"
        return SOURCES[self.source][1].format(step=SAMPLED_STEP)

    @property
    def running(self) -> bool:
        """Whether an epoch is being measured."""
        return self._running

    def start(self, eager: bool = False) -> None:
        """Begin measuring an epoch; if one is being measured already (restarted without an end), restart its peak.

        Args:
            eager: What runs until ``stop`` runs eagerly (validation): a compiled CPU run tracks it exactly rather
                than sampling a step.
        """
        self._eager = eager
        if self.source == "cuda":
            self._cuda = cuda_peak(self.device)  # a block restarted without its end is dropped unread
            self._cuda_peak = self._cuda.__enter__()
        elif self.source == "allocations" and not eager:
            self._window.close()
            self._steps, self._sampled = 0, None
            if self._tracking:
                self.tracker.__exit__(None, None, None)
                self._tracking = False
        elif self.simulated is not None:
            self.simulated.reset_peak()
            self._ops_at_start = self.simulated.num_ops
        else:
            self.tracker.reset_peak()
            self._ops_at_start = self.tracker.num_ops
            if not self._tracking:
                self.tracker.__enter__()
                self._tracking = True
        self._running = True

    def step_ended(self, held: int) -> None:
        """A compiled CPU run's training step ended (``on_train_batch_end``): open the sampled step's window after
        the step before it, and close it after the sampled step. ``held``: bytes of the tensors alive now that a step
        finds (``held_bytes``); read only where the window opens."""
        if self.source != "allocations" or not self._running or self._tracking:
            return
        self._steps += 1
        if self._window.running:
            self._sampled = self._held + self._window.stop().peak
        elif self._steps == SAMPLED_STEP - 1:
            self._held = held
            self._window.start()

    def stop(self) -> dict[str, float]:
        """End the epoch and return its peaks in GB; ``{}`` when not measuring or nothing was measured."""
        if not self._running:
            return {}
        tracked = self._tracking
        if tracked:
            self.tracker.__exit__(None, None, None)  # raises (and stays entered) if another mode is on top
            self._tracking = False
        self._running = False
        if self.source == "cuda":
            self._cuda.__exit__(None, None, None)
            values = (self._cuda_peak.allocated, self._cuda_peak.reserved)
            self._cuda = None
        elif self.source == "allocations" and not tracked:
            self._window.close()  # an epoch that ended before its sampled step did: nothing measured
            values = (self._sampled,) if self._sampled is not None else ()
        else:
            counter = self.simulated or self.tracker
            values = (counter.peak,) if counter.num_ops > self._ops_at_start else ()
        return {k: v / GB for k, v in zip(self.keys, values)}

    def close(self) -> None:
        """Stop measuring without reporting (training ended, or failed, mid-epoch): no device call that could fail."""
        if self._tracking:
            self.tracker.__exit__(None, None, None)
            self._tracking = False
        self._window.close()
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
        if meter.source == "allocations":
            LOGGER.info(f"{PREFIX} compile=True on CPU: exact tensor tracking would run every op through a dispatch "
                        f"mode that compiled graphs cannot hold, so mem/peak_tensor_GB is step {SAMPLED_STEP} of each "
                        f"epoch measured from torch.profiler's allocation records, and the tensors alive beside it")
    if meter.tracker is not None:
        meter.tracker.track(held_state(trainer))
    trainer.run_memory.val = {val_key(k): math.nan for k in meter.keys}  # until this epoch validates
    meter.start()


def held_state(trainer: Any) -> list:
    """The tensors a training step finds alive: weights, buffers, gradients, the EMA, the optimizer state."""
    model = trainer.model
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    return [list(model.parameters()), list(model.buffers()), grads, trainer.ema.ema.state_dict(),
            trainer.optimizer.state_dict()["state"]]


def batch_ready(trainer: Any, batch: dict) -> None:
    """After ``preprocess_batch``: a compiled CPU run's meter remembers the batch's bytes, which Ultralytics' loop
    still holds at the start of every second step (``step.loop_bytes``), beyond what a trainer attribute holds."""
    meter = trainer.run_memory.meter
    if meter is not None and meter.source == "allocations":
        meter.batch_bytes = LiveTensorTracker().track([v for v in batch.values() if isinstance(v, torch.Tensor)])


def sample_step_memory(trainer: Any) -> None:
    """``on_train_batch_end``: where a compiled CPU run samples a step (``EpochPeak.step_ended``), the bytes alive
    beside it, counted once per storage as the tracker counts them: the state, and the batch of the step that ended
    (the loop holds it into the next step at every second step: counted always, so never below the epoch's peak by
    it)."""
    meter = trainer.run_memory.meter
    if meter is not None and meter.source == "allocations":
        meter.step_ended(LiveTensorTracker().track(held_state(trainer)) + meter.batch_bytes)


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
    elif meter is not None and meter.source == "allocations":
        LOGGER.info(f"{PREFIX} epoch {trainer.epoch + 1} not measured: it ended before step {SAMPLED_STEP}, the one a "
                    f"compiled CPU run profiles")


def val_key(key: str) -> str:
    """The results.csv column of validation's peak beside the epoch's: ``mem/val_peak_tensor_GB``."""
    return key.replace("mem/", "mem/val_", 1)


@contextmanager
def validation_memory(trainer: Any, what: str) -> Iterator[None]:
    """Measure a validation's peak (``what``: "validation", "final evaluation") with the epoch's meter, into
    ``run_memory.val`` and the console. In this process only: under DDP each rank validates its share."""
    meter = trainer.run_memory.meter
    if meter is not None:
        if meter.source == "allocations":  # the optimizer's state was made in a compiled step: track it
            meter.tracker.track(held_state(trainer))
        meter.start(eager=True)
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


CALLBACKS = {"on_train_epoch_start": start_epoch_memory, "on_train_batch_end": sample_step_memory,
             "on_train_epoch_end": stop_epoch_memory, "on_fit_epoch_end": memory_in_metrics}
