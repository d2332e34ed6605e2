"""Ultralytics trainers that recompute chosen backbone stages during backward.

Each task trainer is the Ultralytics one plus ``CheckpointMixin``: a handful of hook overrides and nothing else, so the
training loop, losses, optimizer, EMA and checkpoint files are Ultralytics' own.

Examples:
    >>> from yolo_ckpt import YOLO
    >>> YOLO("yolo11n.yaml").train(data="data.yaml", imgsz=1280, checkpoint_stages=[2, 3])  # doctest: +SKIP

    or with Ultralytics' own model class:

    >>> from ultralytics import YOLO
    >>> from yolo_ckpt import DetectionTrainer
    >>> YOLO("yolo11n.yaml").train(trainer=DetectionTrainer, data="d.yaml", checkpoint_stages="all")  # doctest: +SKIP
"""

from __future__ import annotations

import math
import subprocess
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import torch
import ultralytics
from torch import nn
from ultralytics.cfg import cfg2dict
from ultralytics.models import yolo
from ultralytics.models.rtdetr.train import RTDETRTrainer as UltralyticsRTDETRTrainer
from ultralytics.utils import LOGGER, RANK, IterableSimpleNamespace
from ultralytics.utils.patches import torch_load

from ..memory.device import SimulatedDevice
from ..planning.autobatch import parse_memory
from ..regions.graph import model_stages
from ..regions.install import checkpoint_mode, checkpoint_plan, disable_checkpointing, enable_checkpointing, network
from ..regions.loss.install import (
    check_loss_setting,
    disable_loss_checkpointing,
    enable_loss_checkpointing,
    loss_checkpointing,
)
from ..regions.recompute import regions_compiled_apart
from ..regions.spec import CheckpointConfigError, plain, word
from ..report.plots import plot_memory
from ..report.summary import PREFIX, compare_with_vanilla, say_why_map_is_zero
from . import memory_hooks, multitrain, tuning
from .distributed import DistributedMixin, from_ultralytics_launcher, launch_record, leave_process_group
from .epoch_memory import CALLBACKS, batch_ready, close_epoch_memory, validation_memory
from .memory_hooks import (
    apply_compile_budget,
    choose_auto_plan,
    escalation_point,
    plan_validation_for_device,
    record_planned_batch,
)
from .offline import provide_fonts
from .run_dir import new_run_dir, remove_created_dir, report_to_launcher, reported_by_workers
from .run_facts import record_settings, settings_of
from .run_memory import RunMemory
from .settings import CKPT_CFG_DICT, DEFAULT_CFG_DICT_CKPT, is_auto, is_least, model_name, saved_settings


def skip_frozen_stages(trainer: Any) -> None:
    """Stop checkpointing stages that store nothing for backward once Ultralytics has frozen layers (``freeze=``).

    Registered for ``on_pretrain_routine_end`` (Ultralytics freezes inside ``_setup_train``, after ``get_model``) and
    called by ``auto_batch`` first, so AutoBatch measures the plan that will train.
    """
    model = network(trainer.model)
    plan = checkpoint_plan(model)
    if plan is None:
        return
    kept, dropped = plan.without_frozen(model)
    if dropped:
        names = ", ".join(f"stage {d}" if isinstance(d, int) else d for d in dropped)  # stages as numbers, "layer i"
        LOGGER.warning(f"{PREFIX} {names} not recomputed: frozen, with no gradient flowing in, so nothing is "
                       f"stored for backward there; checkpointing {kept.describe()}")
        enable_checkpointing(model, kept, checkpoint_mode(model))


class CheckpointMixin(DistributedMixin):
    """Hooks that add ``checkpoint_stages`` to an Ultralytics task trainer (listed first among the bases).

    - ``check_resume``: the first hook ``BaseTrainer.__init__`` calls once arguments are merged, before it creates the
      run directory or reads the dataset; bad ``checkpoint_stages`` are rejected here, and a resumed run gets its
      stages back from ``last.pt``.
    - ``get_model``: the training model runs the plan's regions inside checkpoints.
    - ``get_validator``: validators rebuild their arguments with Ultralytics' key check, so they get ours removed.
    - ``save_model``: what is pickled is plain Ultralytics, and ``train_args`` hold only Ultralytics' keys.
    - ``auto_batch``, ``get_dataloader``, ``_build_train_pipeline`` and callbacks: the run's memory decisions
      (``self.run_memory``, a ``RunMemory``, called with what ``yolo_ckpt.integration.memory_hooks`` reads off the
      trainer): AutoBatch on the checkpointed model or for ``memory_budget`` on any device, ``checkpoint_stages=auto``,
      the validator's batch, and escalation to a plan that keeps less before Ultralytics' out-of-memory retry halves
      the batch.
    - ``get_dataset``: with ``YOLO_OFFLINE``, the plotting font Ultralytics' dataset check looks up is local
      (``yolo_ckpt.integration.offline``), also in DDP workers.
    - ``train``: on any exit, also a crash, the model (which ``YOLO.model`` shares) is plain again; a plan or batch
      that cannot fit removes the run directory this run created before its one-line error.
    - ``on_train_end`` with ``checkpoint_compare``: the run's plan measured against vanilla
      (``yolo_ckpt.report.summary``).
    - callbacks (``yolo_ckpt.integration.epoch_memory``), ``save_metrics``, ``plot_metrics``: each epoch's peak
      memory goes to the console, results.csv, Ultralytics' loggers and memory.png; frozen stages are dropped from
      the plan.
    - the base ``DistributedMixin`` (``yolo_ckpt.integration.distributed``): under ``torchrun`` the launcher's world
      size, device and one run directory, on any number of nodes, CUDA or CPU (gloo).
    """

    def __init__(self, cfg: Any = None, overrides: dict | None = None, _callbacks: dict | None = None):
        """Initialise like the Ultralytics trainer, with our keys' defaults added to ``cfg``."""
        super().__init__({**DEFAULT_CFG_DICT_CKPT, **cfg2dict(cfg or {})}, overrides, _callbacks)
        self.run_memory = RunMemory()  # the run's memory decisions and what they remember
        ours = [("on_train_epoch_start", escalation_point), *CALLBACKS.items(),
                ("on_pretrain_routine_end", choose_auto_plan), ("on_pretrain_routine_end", skip_frozen_stages),
                ("on_pretrain_routine_end", apply_compile_budget),
                ("on_pretrain_routine_end", plan_validation_for_device),
                ("on_pretrain_routine_end", record_planned_batch), ("on_fit_epoch_end", say_why_map_is_zero),
                ("on_train_end", compare_with_vanilla)]
        for event, fn in reversed(ours):  # ahead of every other callback, in this order: a user's reads our figures
            if fn not in self.callbacks[event]:  # a DDP worker is built with the parent's callbacks, ours included
                self.callbacks[event].insert(0, fn)

    def check_resume(self, overrides: dict) -> None:
        """Resume like Ultralytics, restore our keys from the checkpoint, then validate ``checkpoint_stages``."""
        ours = {k: overrides[k] for k in CKPT_CFG_DICT if k in overrides}
        super().check_resume({k: v for k, v in overrides.items() if k not in CKPT_CFG_DICT})
        if self.resume:  # Ultralytics rebuilt args from the checkpoint's train_args, which hold none of our keys
            saved = saved_settings(torch_load(self.args.resume, map_location="cpu"))
            for k, default in CKPT_CFG_DICT.items():
                setattr(self.args, k, ours.get(k, saved.get(k, default)))
        for k in ("checkpoint_stages", "checkpoint_layers"):  # Python's spellings (numpy, range) as the CLI's, so
            setattr(self.args, k, plain(getattr(self.args, k)))  # that args.yaml and last.pt hold plain values
        multitrain.check_once(self.args.model, vars(self.args))  # fail fast: before any directory or dataset work
        self.args.checkpoint_mode = word(self.args.checkpoint_mode)  # what the recompute and args.yaml get
        # rank 0 of torchrun chose the directory; Ultralytics' own launcher's parent created it for its workers
        self.created_dir = None if self.resume or RANK > 0 or from_ultralytics_launcher() else new_run_dir(self.args)

    def get_dataset(self) -> dict:
        """Ultralytics' dataset check, which looks up its plotting font: offline, give it a local one first (also in
        DDP workers, which never run ``yolo-ckpt``'s entry point)."""
        provide_fonts()
        return super().get_dataset()

    def get_model(self, cfg=None, weights=None, verbose: bool = True):
        """Build the Ultralytics model and install the checkpoint plan (and the loss's) on it."""
        model = super().get_model(cfg=cfg, weights=weights, verbose=verbose)
        self.install_loss_plan(model)
        if is_auto(self.args.checkpoint_stages) or is_least(self.args.checkpoint_stages):
            LOGGER.info(f"{PREFIX} {word(self.args.checkpoint_stages)}: the plan is chosen once the device, batch and "
                        f"frozen layers are known")
            return model
        settings = settings_of(self)
        plan, mode = settings.resolve(model), settings.mode
        enable_checkpointing(model, plan, mode)
        if not plan.regions:
            LOGGER.info(f"{PREFIX} no layer plan, all the network's activations stored")
        stages = model_stages(model) if plan.stages else {}
        whole = [r for r in plan.regions if not r.parts]
        for region in plan.regions:
            how = ", selective: outputs costly to recompute kept" if (region.mode or mode) == "selective" else ""
            shared = f", recomputed as one region with stages {list(region.stages)}" if len(region.stages) > 1 else ""
            for k in region.stages:
                types = ", ".join(type(model.model[i]).__name__ for i in stages[k])
                LOGGER.info(f"{PREFIX} stage {k} (P{k}/{2**k}) layers {list(stages[k])}: {types}{shared}{how}")
            if region.parts:
                i = region.layers[0]
                inside = next((r for r in whole if i in r.layers), None)
                nested = "" if inside is None else f", nested in the region of layers {list(inside.layers)}"
                run = f"parts {', '.join(region.parts)} as one region" if len(region.parts) > 1 else \
                    f"part {region.parts[0]}"
                LOGGER.info(f"{PREFIX} layer {i} ({type(model.model[i]).__name__}) {run}{nested}{how}")
            elif not region.stages:
                types = ", ".join(type(model.model[i]).__name__ for i in region.layers)
                LOGGER.info(f"{PREFIX} layers {list(region.layers)}: {types}{how}")
        return model

    def install_loss_plan(self, model: nn.Module) -> None:
        """Recompute the criterion as ``checkpoint_loss`` says (``yolo_ckpt.regions.loss.install``), and say so."""
        how = check_loss_setting(self.args.checkpoint_loss, self.args.task, model_name(model))
        if word(self.args.checkpoint_loss) == "least":  # recorded as what it chose: resume and args.yaml train it
            LOGGER.info(f"{PREFIX} checkpoint_loss=least: {how}, the loss plan that keeps the least for "
                        f"task={self.args.task}")
            record_settings(self, {"checkpoint_loss": how})
        enable_loss_checkpointing(model, how)
        if how == "exact":
            masks = "each image's mask loss recomputed in backward, " if self.args.task == "segment" else ""
            LOGGER.info(f"{PREFIX} checkpoint_loss=exact: {masks}the task-aligned assignment image by image (YOLO26 "
                        f"segmentation's mask-aware one stays batched), bit for bit")
        elif how == "chunked":
            LOGGER.warning(f"{PREFIX} checkpoint_loss=chunked: this run is NOT bitwise vanilla Ultralytics (equal up "
                           f"to float rounding): the loss in chunks (mask rows, pixel blocks, the assignment image by "
                           f"image), each recomputed in backward")

    def train(self):
        """Train like Ultralytics; however it ends, the model is plain again and no memory tracker stays active.

        ``Model.train`` hands the trainer's model to ``YOLO.model``; after a failed run that object is what a user
        saves or trains next, so the plan must not outlive training. With ``simulate_gpu`` the whole run, the model
        built before it included, lives on a ``SimulatedDevice`` of that size.

        A one-line error of ours that comes once Ultralytics has created the run directory (a plan or batch that
        cannot fit) removes the directory this run created first, so nothing is left behind and the next run keeps
        its name; a worker of Ultralytics' launcher hands the line to the launching process instead of a traceback,
        and under torchrun every rank raises it (rank 0 decided it) after leaving the process group.
        """
        with ExitStack() as stack:
            # compile_memory_budget sets torch's value for this run only (``memory_hooks.apply_compile_budget``)
            stack.enter_context(torch._functorch.config.patch(
                activation_memory_budget=torch._functorch.config.activation_memory_budget))
            if self.args.compile:  # held for every step (dynamo guards on it); compile_regions=apart, given or chosen
                stack.enter_context(regions_compiled_apart(None))  # by auto, switched on by apply_compile_budget
            if self.args.simulate_gpu is not None:
                gpu = stack.enter_context(SimulatedDevice(parse_memory(self.args.simulate_gpu),
                                                          bool(self.args.simulate_allocator)))
                if isinstance(self.model, nn.Module):
                    gpu.track([*self.model.parameters(), *self.model.buffers()])
                LOGGER.info(f"{PREFIX} simulate_gpu={self.args.simulate_gpu}: a {gpu.limit / 2**30:.3f} GB device on "
                            f"CPU, {gpu.counts}")
            try:
                result = super().train()
            except CheckpointConfigError as e:
                if from_ultralytics_launcher():  # a worker: end quietly, the launching process raises the one line
                    report_to_launcher(self, e)
                leave_process_group()  # torchrun: every rank raises the same line (rank 0 decided it)
                remove_created_dir(self)
                raise
            except subprocess.CalledProcessError:  # the launching process: a worker that reported a line failed
                if error := reported_by_workers(self):  # at exit after it (any other failure stays as it is)
                    remove_created_dir(self)
                    raise CheckpointConfigError(error) from None
                raise
            finally:
                for model in (self.model, getattr(self.ema, "ema", None)):  # first: nothing below may skip this
                    if isinstance(model, nn.Module):
                        disable_checkpointing(network(model))
                        disable_loss_checkpointing(network(model))
                close_epoch_memory(self)
        if error := reported_by_workers(self):
            remove_created_dir(self)
            raise CheckpointConfigError(error)
        return result

    @contextmanager
    def _ultralytics_args(self) -> Iterator[None]:
        """Hide our keys from ``self.args`` for code that checks arguments against Ultralytics' defaults."""
        saved = {k: getattr(self.args, k) for k in CKPT_CFG_DICT if hasattr(self.args, k)}
        for k in saved:
            delattr(self.args, k)
        try:
            yield
        finally:
            for k, v in saved.items():
                setattr(self.args, k, v)

    def validate(self):
        """Validate like Ultralytics, its peak measured (``mem/val_peak_...``); an out-of-memory error retries at a
        smaller validator batch and never ends the run (``memory_hooks.validate_within_memory``)."""
        with validation_memory(self, "validation"):
            return memory_hooks.validate_within_memory(self, super().validate)

    def final_eval(self):
        """Ultralytics' final evaluation of best.pt, its peak measured and in the metrics it hands on; retried as
        validation is."""
        with validation_memory(self, "final evaluation"):
            memory_hooks.validate_within_memory(self, super().final_eval, "final evaluation")

    def get_validator(self):
        """Build the Ultralytics validator from arguments without our keys."""
        with self._ultralytics_args():
            return super().get_validator()

    def save_model(self):
        """Save Ultralytics checkpoints that plain Ultralytics can load, validate and resume.

        The pickled EMA is plain (an EMA deep-copied from the training model carries the plan); ``train_args``, which
        ``yolo train resume`` validates against Ultralytics' keys, hold none of ours; our settings are recorded in the
        saved model's own ``args`` (where Ultralytics records the run's arguments too) for ``yolo-ckpt train resume``.
        Once saved, the EMA gets the run's loss plan back: the validator computes its losses on it, every epoch.
        """
        ema = self.ema.ema
        disable_checkpointing(network(ema))  # network: distillation's student, inside Ultralytics' wrapper
        disable_loss_checkpointing(network(ema))
        linked = getattr(ema, "args", None)  # the trainer's args object itself (detect tasks), or none (classify)
        ours = {**{k: getattr(self.args, k) for k in CKPT_CFG_DICT}, **launch_record(self)}  # + world size, resume
        base = {} if linked is None else linked if isinstance(linked, dict) else vars(linked)
        ema.args = IterableSimpleNamespace(**{**base, **ours})  # a snapshot, of the type Ultralytics saves
        try:
            with self._ultralytics_args():
                return super().save_model()
        finally:
            if linked is None:
                del ema.args
            else:
                ema.args = linked
            # the validator computes its losses on the EMA: under the run's loss plan, as training computes them
            enable_loss_checkpointing(network(ema), loss_checkpointing(network(self.model)) or "none")

    def auto_batch(self) -> int:
        """AutoBatch for the checkpointed model (``memory_hooks.auto_batch``), after dropping the frozen stages from the
        plan: Ultralytics froze layers before AutoBatch, so the plan that will train is measured. Our mixin comes first
        in the MRO, so this replaces the task trainer's ``auto_batch`` too."""
        skip_frozen_stages(self)
        self.run_memory.batch_planned = True
        return memory_hooks.auto_batch(self)

    def preprocess_batch(self, batch: dict) -> dict:
        """Ultralytics' preprocessing; a compiled CPU run's meter counts the batch (``epoch_memory.batch_ready``)."""
        batch = super().preprocess_batch(batch)
        batch_ready(self, batch)
        return batch

    def get_dataloader(self, dataset_path: str, batch_size: int = 16, rank: int = 0, mode: str = "train"):
        """Ultralytics' loader; the validator's at most the batch planning measured to fit
        (``RunMemory.validator_batch``)."""
        if mode == "val":
            batch_size = self.run_memory.validator_batch(batch_size)
        return super().get_dataloader(dataset_path, batch_size, rank, mode)

    def _build_train_pipeline(self) -> None:
        """Build loaders and optimizer settings like Ultralytics; in its first-epoch out-of-memory retry, keep the
        batch when a plan that keeps less exists (``memory_hooks.hold_batch``; ``escalation_point`` installs it when
        the epoch restarts).

        Private hook, checked against ``versions.ULTRALYTICS_CHECKED``: ``BaseTrainer._do_train`` halves ``batch`` on an
        out-of-memory error and calls this method before restarting the epoch; nothing public runs in between, and
        the loaders must be built at the batch that will train. Ultralytics' "Reducing to batch=..." warning is
        printed before this runs.
        """
        memory_hooks.hold_batch(self)
        super()._build_train_pipeline()
        self.run_memory.escalation.pipeline_batch = self.batch_size

    def save_metrics(self, metrics: dict) -> None:
        """Write results.csv with this epoch's peak memory columns, and pass them to Ultralytics' loggers.

        The integrations (TensorBoard, MLflow, W&B, Comet, ...) log ``trainer.metrics`` at ``on_fit_epoch_end``, which
        follows this call in every epoch: they get the figures measured (results.csv says NaN for the others).
        """
        ours = {**self.run_memory.epoch, **self.run_memory.val}

        def ours_last(d: dict, figures: dict) -> dict:  # an epoch without validation carries the last one's metrics
            return {**{k: v for k, v in d.items() if k not in ours}, **figures}

        self.metrics = ours_last(self.metrics, {k: v for k, v in ours.items() if math.isfinite(v)})
        super().save_metrics(ours_last(metrics, ours))  # results.csv writes values in order under the first header

    def plot_metrics(self) -> None:
        """Plot results.png like Ultralytics, and memory per epoch to memory.png beside it."""
        super().plot_metrics()
        if path := plot_memory(self.csv):
            self.on_plot(path)


class DetectionTrainer(CheckpointMixin, yolo.detect.DetectionTrainer):
    """Ultralytics ``DetectionTrainer`` with ``checkpoint_stages``."""


class SegmentationTrainer(CheckpointMixin, yolo.segment.SegmentationTrainer):
    """Ultralytics ``SegmentationTrainer`` with ``checkpoint_stages``."""


class PoseTrainer(CheckpointMixin, yolo.pose.PoseTrainer):
    """Ultralytics ``PoseTrainer`` with ``checkpoint_stages``."""


class OBBTrainer(CheckpointMixin, yolo.obb.OBBTrainer):
    """Ultralytics ``OBBTrainer`` with ``checkpoint_stages``."""


class ClassificationTrainer(CheckpointMixin, yolo.classify.ClassificationTrainer):
    """Ultralytics ``ClassificationTrainer`` with ``checkpoint_stages``."""


class RTDETRTrainer(CheckpointMixin, UltralyticsRTDETRTrainer):
    """Ultralytics ``RTDETRTrainer`` with ``checkpoint_stages`` (HGNet/ResNet backbone stages, the decoder in
    ``checkpoint_layers=head``)."""


class SemanticSegmentationTrainer(CheckpointMixin, yolo.semantic.SemanticSegmentationTrainer):
    """Ultralytics ``SemanticSegmentationTrainer`` (``yolo26*-sem.yaml``) with ``checkpoint_stages``."""


class DepthTrainer(CheckpointMixin, yolo.depth.DepthTrainer):
    """Ultralytics ``DepthTrainer`` (``yolo26*-depth.yaml``) with ``checkpoint_stages``."""


TRAINERS = {
    "detect": DetectionTrainer,
    "segment": SegmentationTrainer,
    "semantic": SemanticSegmentationTrainer,
    "depth": DepthTrainer,
    "pose": PoseTrainer,
    "obb": OBBTrainer,
    "classify": ClassificationTrainer,
}


class EveryPath:
    """``Model.train`` and ``Model.tune`` for our model classes: several datasets (``data=[...]``) train one by one
    in this process, each with the run's plan (``yolo_ckpt.integration.multitrain``); tuning trains every iteration
    with it (``yolo_ckpt.integration.tuning``); everything else as Ultralytics does it."""

    def train(self, trainer: Any = None, **kwargs: Any) -> Any:
        """Train like Ultralytics' ``Model.train``, several datasets each with our trainer."""
        if multitrain.is_several(kwargs.get("data")):
            return multitrain.train(self, super().train, trainer or self.task_map[self.task]["trainer"], kwargs)
        return super().train(trainer=trainer, **kwargs)

    def tune(self, use_ray: bool = False, iterations: int = 10, *args: Any, **kwargs: Any) -> Any:
        """Tune like Ultralytics' ``Model.tune``; with our keys, every iteration trains with the plan."""
        if tuning.our_keys(kwargs):
            return tuning.tune(self, use_ray, iterations, args, kwargs)
        return super().tune(use_ray, iterations, *args, **kwargs)


class YOLO(EveryPath, ultralytics.YOLO):
    """``ultralytics.YOLO`` whose ``train()`` uses the checkpointing trainer of the model's task.

    Examples:
        >>> YOLO("yolo11n-seg.yaml").train(data="seg.yaml", checkpoint_stages=[1, 2])  # doctest: +SKIP
    """

    def __init__(self, model: Any = "yolo26n.pt", task: str | None = None, verbose: bool = False):
        """Load like ``ultralytics.YOLO``; a checkpoint whose head is RT-DETR's becomes our ``RTDETR``, as
        Ultralytics turns it into its own (by swapping ``__class__`` in ``YOLO.__init__``)."""
        super().__init__(model, task=task, verbose=verbose)
        if type(self) is ultralytics.RTDETR:
            self.__class__ = RTDETR

    @property
    def task_map(self) -> dict:
        """Ultralytics' task map with our trainers in place of its own."""
        return {task: {**v, "trainer": TRAINERS.get(task, v["trainer"])} for task, v in super().task_map.items()}


class RTDETR(EveryPath, ultralytics.RTDETR):
    """``ultralytics.RTDETR`` whose ``train()`` uses ``RTDETRTrainer`` (checkpointing).

    Examples:
        >>> RTDETR("rtdetr-l.yaml").train(data="data.yaml", imgsz=640, checkpoint_stages="all")  # doctest: +SKIP
    """

    @property
    def task_map(self) -> dict:
        """Ultralytics' RT-DETR task map with our trainer in place of its own."""
        return {task: {**v, "trainer": RTDETRTrainer} for task, v in super().task_map.items()}
