"""The run's memory decisions as one object the trainer owns: ``RunMemory`` (``trainer.run_memory``).

What it decides: the memory target (``aim``), AutoBatch's batch for a budget (``batch_for_budget``; under compile
confirmed by compiled steps, ``confirm_compiled``), ``auto``'s plan
(``choose_plan``), the validator's batch (``plan_validation``, ``validator_batch``) and, in Ultralytics' first-epoch
out-of-memory retry, a plan that keeps less at the same batch (``hold_batch``, ``escalate``). What it remembers: the
target, what AutoBatch gave without checkpointing, the validator's batch, each epoch's peak, and escalation's state
(``Escalation``).

Its methods take plain values (a model, a ``StepShape``, a ``MemoryTarget``, a ``Validation``, a ``PlanSettings``),
which the trainer's hooks (``memory_hooks``) read off the trainer, as Ultralytics' ``auto_batch`` hands plain values
to ``check_train_batch_size``; the work is done by plain functions (``auto``, ``validation_batch``, ``oom_retry``).
Every step they measure runs on a copy of the model, bounded by what the device has free (``device.unless_oom``): a
memory error there means "does not fit", never the end of the run.

Examples:
    >>> from yolo_ckpt.integration.run_memory import RunMemory
    >>> memory = RunMemory()
    >>> target = memory.aim(torch.device("cpu"), memory_budget="1GB", fraction=0.6)  # doctest: +SKIP
    >>> memory.target == target.share  # doctest: +SKIP
    True
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from ultralytics.utils import LOGGER

from ..memory.device import DeviceMemory, device_memory
from ..memory.step import StepShape, batch_bytes, loop_bytes
from ..planning.autobatch import MemoryTarget, parse_memory
from ..planning.choice import measured_least
from ..planning.compiled import CompiledCandidate
from ..planning.compiled_batch import confirm_batch
from ..planning.costs import unit_costs
from ..planning.escalation import keeps_least
from ..planning.random_state import Generators, random_state_kept
from ..planning.search import deepest
from ..planning.units import NothingFits
from ..regions.graph import model_stages
from ..regions.settings import PlanSettings
from ..regions.spec import CheckpointConfigError
from ..report.summary import PREFIX
from . import auto, oom_retry
from .distributed import gather
from .oom_retry import Escalation
from .validation_batch import Validation, plan_validation


@dataclass
class RunMemory:
    """The run's memory decisions and what they remember.

    Attributes:
        target (int | None): Exact tensor bytes ``auto`` or AutoBatch planned a training step to fit.
        batch_without (int | str | None): What AutoBatch chose for the same memory without checkpointing.
        val_batch (int | None): The validator's batch where Ultralytics' own would not fit.
        device (DeviceMemory | None): Under DDP, the device of the rank with the least usable memory
            (``smallest_device``), which rank 0 plans for; ``None``: the training device.
        epoch (dict[str, float]): The last epoch's peaks, the maximum over ranks, for results.csv and the loggers.
        epoch_own (dict[str, float]): The last epoch's peaks of this process.
        val (dict[str, float]): The last validation's peaks (``mem/val_peak_...``); NaN for an epoch not validated.
        meter (Any): The epoch's ``EpochPeak``, once the first epoch started; it measures validation too.
        escalation (Escalation): What escalation remembers across Ultralytics' retry.
        val_without_loss (bool): Validation ran out of memory at batch 1: it computes no loss from then on.
        batch_planned (bool): AutoBatch chose the batch (``batch=-1`` or a fraction): args.yaml records it.
    """

    target: int | None = None
    batch_without: int | str | None = None
    val_batch: int | None = None
    device: DeviceMemory | None = None
    epoch: dict[str, float] = field(default_factory=dict)
    epoch_own: dict[str, float] = field(default_factory=dict)
    val: dict[str, float] = field(default_factory=dict)
    meter: Any = None
    escalation: Escalation = field(default_factory=Escalation)
    val_without_loss: bool = False
    batch_planned: bool = False

    def aim(self, device: torch.device, memory_budget: str | float | None, fraction: float) -> MemoryTarget:
        """The run's memory target, in exact tensor bytes, and its share (``target``) from now on.

        ``memory_budget`` when given (on CUDA its allocator bytes are turned into tensor bytes with the device's
        ``ALLOCATOR_MARGIN``); otherwise the usable memory of ``device`` (or of the smallest rank's, ``device`` set):
        CUDA free plus what this process has reserved, as Ultralytics' AutoBatch counts it, or the simulated device.
        ``fraction``: 0.6, or ``batch=0.x``.
        """
        dev = self.device or device_memory(device)
        if memory_budget is not None:
            budget = parse_memory(memory_budget)
            if dev is not None and budget > dev.total:
                LOGGER.warning(f"{PREFIX} memory_budget={memory_budget} is more than {dev.name} holds "
                               f"({dev.total / 2**30:.2f} GB): planning for the budget from steps that fit the device")
            source = f"memory_budget={memory_budget}"
        else:
            budget, source = dev.usable, f"{dev.name} usable memory"
        target = MemoryTarget(dev.tensor_bytes(budget) if dev is not None else budget, fraction, source)
        self.target = target.share
        return target

    def least_plan(self, model: nn.Module, shape: StepShape) -> PlanSettings:
        """``checkpoint_stages=least``: of the plans predicted to keep the least at ``shape`` (each unit's bytes
        measured, untimed), the one a real step measures keeping the least (``choice.measured_least``), which is also
        where escalation ends.

        Raises:
            CheckpointConfigError: When not even the plain step at batch 1 fits the device.
        """
        try:
            with random_state_kept(Generators.TORCH):
                costs = unit_costs(model, shape, timed=False)
        except ValueError as e:
            raise CheckpointConfigError(str(e).replace("checkpoint_stages=auto", "checkpoint_stages=least")) from None
        self.escalation.measured(costs, shape.batch)
        with random_state_kept(Generators.TORCH):
            self.escalation.least = measured_least(model, costs, shape).settings
        return self.escalation.least

    def batch_for_budget(self, model: nn.Module, shape: StepShape, target: MemoryTarget, described: str,
                         images: int, validation: Validation) -> int:
        """AutoBatch for ``target`` on copies of ``model`` (``auto.batch_for_budget``), and the validator's batch
        for the batch chosen. Returns the batch."""
        chosen = auto.batch_for_budget(model, shape, target, described, images)
        self.batch_without = chosen.without
        line = self.plan_validation(model, validation, chosen.batch, target.share, chosen.held, chosen.step)
        LOGGER.info(f"{auto.AUTOBATCH}{line}")
        return chosen.batch

    def confirm_compiled(self, model: nn.Module, shape: StepShape, batch: int, candidate: CompiledCandidate,
                         validation: Validation, fraction: float) -> int:
        """AutoBatch's ``batch`` (from eager steps) in a ``compile=True`` run, halved until the compiled step of
        ``candidate`` (the run's plan, budget and regions) fits the share less the loop's batches
        (``compiled_batch.confirm_batch``); where it halved, the validator's batch is planned again for it (validation
        runs the EMA eagerly; Ultralytics validates at twice the training batch). Returns the batch.

        Raises:
            CheckpointConfigError: When not even batch 1's compiled step fits, with the ``memory_budget`` that would.
        """
        try:
            with random_state_kept(Generators.TORCH):
                confirmed = confirm_batch(model, shape, batch, self.target, candidate)
        except NothingFits as e:
            need = f"memory_budget={math.ceil(e.needed / fraction / 2**20)}MB would fit it, or " if e.needed else ""
            raise CheckpointConfigError(f"AutoBatch under compile=True: {e}: {need}lower imgsz") from None
        LOGGER.info(f"{auto.AUTOBATCH}{confirmed.line()}")
        if confirmed.batch != batch:
            at = shape.at(confirmed.batch)
            held = batch_bytes(model, at) + loop_bytes(model, at)
            line = self.plan_validation(model, validation, confirmed.batch, self.target, held,
                                        confirmed.bytes + loop_bytes(model, at))
            LOGGER.info(f"{auto.AUTOBATCH}{line}")
        return confirmed.batch

    def choose_plan(self, model: nn.Module, shape: StepShape, target: MemoryTarget, *, autobatch: bool, images: int,
                    buckets: int, loss_modes: Sequence[str], device: torch.device,
                    validation: Validation, compiled: bool = False, apart: bool = False) -> auto.AutoChoice:
        """``auto``'s plan (``auto.choose``), the validator's batch for it (its line among the choice's lines), and
        escalation's costs from the units it measured (where vanilla fit, none: escalation measures them itself if
        training runs out of memory)."""
        choice = auto.choose(model, shape, target, autobatch=autobatch, images=images, buckets=buckets,
                             loss_modes=loss_modes, device=device, compiled=compiled, apart=apart)
        if choice.costs is not None:
            self.escalation.measured(choice.costs, choice.batch)
        elif not choice.compiled:  # vanilla fit, no unit measured: escalation measures them if it is needed
            self.escalation.planned = True
            with random_state_kept(Generators.TORCH):  # its fallback where the retry cannot measure (memory free now)
                self.escalation.least = deepest(model)
        line = self.plan_validation(model, validation, choice.batch, target.share, choice.held, choice.step)
        choice.lines.append(f"{PREFIX} auto: {line}")
        return choice

    def plan_validation(self, model: nn.Module, validation: Validation, batch: int, target: int, held: int,
                        step: int) -> str:
        """The validator's batch for training at ``batch`` within ``target`` (``validation_batch.plan_validation``),
        kept in ``val_batch``; returns the line that says it."""
        planned = plan_validation(model, validation, batch, target, held, step)
        self.val_batch = planned.batch
        return planned.line

    def after_validation_oom(self, batch: int) -> str | None:
        """Validation ran out of memory at ``batch``: the next try, as a log line, or ``None`` when none is left.

        Half the batch (kept for the rest of the run: memory does not grow back), down to one image; then, at one
        image, the loss left out of validation (its figures NaN, never a made-up 0)."""
        if batch > 1:
            self.val_batch = batch // 2
            return f"validation ran out of memory at batch {batch}: validating at batch {self.val_batch}"
        if not self.val_without_loss:
            self.val_without_loss = True
            return ("validation ran out of memory at batch 1: validating without its loss from now on (the val loss "
                    "columns NaN), metrics as before")
        return None

    def validator_batch(self, batch: int) -> int:
        """The batch the validator's loader gets in place of Ultralytics' ``batch``: at most the one planned."""
        return batch if self.val_batch is None else min(batch, self.val_batch)

    def prepare_escalation(self, model: nn.Module, planned: bool) -> None:
        """At set-up, while memory is free (no dry run may allocate in the retry): the model's stages and, for a run
        with a layer plan (``planned``), the plan that keeps the least."""
        e = self.escalation
        e.stages = sorted(model_stages(model))
        if e.least is None and planned:
            with random_state_kept(Generators.TORCH):
                e.least = deepest(model)

    def hold_batch(self, batch: int, settings: PlanSettings, checkpoints: bool, loss: str | None) -> bool:
        """In Ultralytics' first-epoch out-of-memory retry, which has just halved the batch to ``batch``: whether to
        keep the batch the loaders were built at, because a plan that keeps less exists (a layer plan, or the loss
        plan ``loss``); ``escalate`` installs it when the epoch restarts. Decided from the values alone: the failed
        step still holds its memory, where no dry run may allocate. ``checkpoints``: the run has a plan (``auto``
        may have chosen vanilla)."""
        e = self.escalation
        e.pending = (e.pipeline_batch is not None and batch < e.pipeline_batch and checkpoints and
                     (not keeps_least(settings, e.least, e.stages) or loss is not None))
        return e.pending

    def escalate(self, model: nn.Module, device: torch.device, old: PlanSettings, shape: StepShape,
                 loss: str | None) -> oom_retry.Escalated:
        """Install the next plan after an out-of-memory error at ``shape`` with ``old`` (``oom_retry.escalate``)."""
        self.escalation.pending = False
        return oom_retry.escalate(model, device, old, shape, loss, self.escalation)

    def fit_validation(self, model: nn.Module, device: torch.device, shape: StepShape, validation: Validation,
                       step: int | None, budget: int | None = None, when: str = "after escalation") -> str | None:
        """The validator's batch for a run whose training at ``shape`` nothing planned to a share: a fixed plan on a
        device that says its memory (CUDA, ``simulate_gpu``) or with ``memory_budget`` (``budget``, bytes),
        and every run after an escalation, where Ultralytics validates at twice the batch escalation kept (the halving
        it replaced would have halved that too) and where, on a device that held less than it said, validation can
        run out where training fits (``benchmarks/gpu_check.py``'s escalation at 192 px).

        Planned as ``auto`` plans it, within the device's usable memory (and the budget, and the run's target, if
        any); ``step``: the training step's measured peak, if any. Returns the line to log (``when`` opens it), or
        ``None`` where nothing bounds validation."""
        dev = device_memory(device)
        tensor_bytes = dev.tensor_bytes if dev is not None else (lambda b: b)
        bounds = [b for b in (dev.usable if dev is not None else None, budget) if b is not None]
        bounds = [tensor_bytes(b) for b in bounds] + ([] if self.target is None else [self.target])
        if not bounds:
            return None
        target = min(bounds)
        held = batch_bytes(model, shape) + loop_bytes(model, shape)
        with random_state_kept(Generators.TORCH):
            try:
                # an unmeasured step claims no peak: what validation measures plus ``held`` stays within ``target``
                planned = plan_validation(model, validation, shape.batch, target, held,
                                          target if step is None else step)
            except CheckpointConfigError as e:  # training fits: validation at Ultralytics' batch is the user's
                LOGGER.warning(f"{PREFIX} {when}: {e}")
                return None
        if planned.batch is not None:
            self.val_batch = planned.batch
        return f"{PREFIX} {when}: {planned.line}"


def smallest_device(device: torch.device) -> DeviceMemory | None:
    """Under DDP, the device with the least usable memory of every rank's (each reads its own ``device``: another
    rank's GPU may have less free than rank 0's), which rank 0 then plans the shared plan for; every rank must call
    it. The probes still run on rank 0's device, within what it has free."""
    known = [d for d in gather(device_memory(device)) if d is not None]
    return min(known, key=lambda d: d.usable) if known else None
