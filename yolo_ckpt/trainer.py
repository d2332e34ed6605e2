"""Ultralytics trainers that recompute chosen backbone stages during backward.

Each task trainer is the Ultralytics one plus ``CheckpointMixin``: a handful of hook overrides and nothing else, so the
training loop, losses, optimizer, EMA and checkpoint files are Ultralytics' own.

Example:
    >>> from yolo_ckpt import YOLO
    >>> YOLO("yolo11n.yaml").train(data="data.yaml", imgsz=1280, checkpoint_stages=[2, 3])  # doctest: +SKIP

    or with Ultralytics' own model class:

    >>> from ultralytics import YOLO
    >>> from yolo_ckpt import DetectionTrainer
    >>> YOLO("yolo11n.yaml").train(trainer=DetectionTrainer, data="d.yaml", checkpoint_stages="all")  # doctest: +SKIP
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from copy import deepcopy
from pathlib import Path
from typing import Any

import torch
import ultralytics
from torch import nn
from ultralytics.cfg import DEFAULT_CFG_DICT, cfg2dict
from ultralytics.engine.trainer import BaseTrainer
from ultralytics.models import yolo
from ultralytics.utils import LOGGER, RANK, YAML, IterableSimpleNamespace, colorstr
from ultralytics.utils.patches import override_configs, torch_load
from ultralytics.utils.torch_utils import unwrap_model

from .autobatch import parse_memory, plan_batch
from .epoch_memory import CALLBACKS, EpochPeak, close_epoch_memory, plot_memory
from .model import checkpoint_mode, checkpoint_plan, disable_checkpointing, enable_checkpointing
from .profiler import with_plan
from .recompute import MODES
from .resources import data_file
from .stages import CheckpointConfigError, CheckpointPlan, model_stages

CKPT_CFG_DICT: dict[str, Any] = YAML.load(data_file("cfg", "default.yaml"))  # our keys and their defaults
DEFAULT_CFG_DICT_CKPT: dict[str, Any] = {**DEFAULT_CFG_DICT, **CKPT_CFG_DICT}  # what `yolo-ckpt train` accepts
PREFIX = colorstr("checkpoint:")


def check_settings(model: Any, args: dict) -> None:
    """Reject bad values of our keys with one line naming what is valid.

    Args:
        model: The model argument (YAML, ``.pt`` or built model) that ``checkpoint_stages`` refers to, or ``None``.
        args: Training arguments holding ``checkpoint_stages``, ``checkpoint_layers``, ``checkpoint_mode`` and
            ``memory_budget``.

    Raises:
        CheckpointConfigError: For invalid stages of this model, an unknown mode or an unreadable memory budget.
    """
    if args.get("memory_budget") is not None:
        try:
            parse_memory(args["memory_budget"])
        except ValueError as e:
            raise CheckpointConfigError(str(e)) from None
    if is_auto(args.get("checkpoint_stages")):
        if args.get("checkpoint_layers"):
            raise CheckpointConfigError(f"checkpoint_layers={args['checkpoint_layers']!r}: checkpoint_stages=auto "
                                        f"chooses the layers and the mode itself. Valid: [] or nothing with auto.")
        if args.get("memory_budget") is None and not torch.cuda.is_available():
            raise CheckpointConfigError("checkpoint_stages=auto needs a memory target: memory_budget=24GB (any device) "
                                        "or a CUDA device (its memory).")
    if (mode := args.get("checkpoint_mode") or "full") not in MODES:
        raise CheckpointConfigError(f"checkpoint_mode={mode!r} is invalid. Valid: 'full' (recompute whole stages) or "
                                    f"'selective' (keep convolution outputs, recompute the rest).")
    check_task(model, args.get("task"))
    if model is not None and not is_auto(args.get("checkpoint_stages")):
        CheckpointPlan.from_spec(model, args.get("checkpoint_stages"), args.get("checkpoint_layers"))


# Ultralytics head modules and the task each trains (8.4.190), most specific first: Segment, Pose and OBB subclass
# Detect; YOLOESegment subclasses YOLOEDetect, not Segment.
HEAD_TASKS = (("SemanticSegment", "semantic"), ("Segment", "segment"), ("YOLOESegment", "segment"), ("Pose", "pose"),
              ("OBB", "obb"), ("Depth", "depth"), ("Classify", "classify"), ("Detect", "detect"),
              ("RTDETRDecoder", "detect"))


def yaml_task(model: Any) -> str | None:
    """The task a model YAML's output module trains, or ``None`` when ``model`` is no YAML or its head is unknown."""
    import ultralytics.nn.modules as modules
    from ultralytics.nn.tasks import yaml_model_load

    if not isinstance(model, (str, Path)) or Path(model).suffix not in {".yaml", ".yml"}:
        return None
    try:
        head = getattr(modules, str(yaml_model_load(model)["head"][-1][2]), None)
    except Exception:  # a missing or malformed YAML: Ultralytics' own error comes when it is built
        return None
    classes = [(getattr(modules, name), task) for name, task in HEAD_TASKS]
    return next((task for cls, task in classes if isinstance(head, type) and issubclass(head, cls)), None)


def check_task(model: Any, task: str | None) -> None:
    """Reject, in one line, a task yolo-ckpt has no trainer for, or a task the model's head does not train.

    Raises:
        CheckpointConfigError: Naming the valid tasks, or a model of the task and the model's own task.
    """
    if task is None:
        return
    if task not in TRAINERS:
        raise CheckpointConfigError(f"task={task!r} is not a task yolo-ckpt trains. Valid: {', '.join(TRAINERS)}.")
    own = yaml_task(model)
    if own is not None and own != task:
        from .cli import DEFAULT_MODELS

        raise CheckpointConfigError(f"task={task}: {Path(model).name} is a {own} model (its output layer trains "
                                    f"{own}). Valid: a {task} model such as {DEFAULT_MODELS[task]}, or task={own}.")


def is_auto(stages: Any) -> bool:
    """Whether ``checkpoint_stages`` asks for the plan to be chosen (``auto``)."""
    return isinstance(stages, str) and stages.strip().lower() == "auto"


def saved_settings(ckpt: dict) -> dict[str, Any]:
    """Our keys as a yolo-ckpt checkpoint records them: in its model's own ``args`` (see ``save_model``).

    Plain Ultralytics never reads those back as training arguments (``load_checkpoint`` replaces them with
    ``train_args``), so they cannot break ``yolo train resume``.
    """
    model = ckpt.get("ema") or ckpt.get("model")
    args = getattr(model, "args", None) or {}
    args = args if isinstance(args, dict) else vars(args)
    return {k: args[k] for k in CKPT_CFG_DICT if k in args}


def choose_auto_plan(trainer: Any) -> None:
    """Resolve ``checkpoint_stages=auto`` for a fixed batch at ``on_pretrain_routine_end``: the model is on its device,
    frozen and batched by then (AutoBatch resolves it earlier, in ``auto_batch``)."""
    if is_auto(trainer.args.checkpoint_stages):
        labels = getattr(getattr(trainer.train_loader, "dataset", None), "labels", None) or []
        counts = [len(x["cls"]) for x in labels if isinstance(x, dict) and "cls" in x]
        trainer._auto_plan(max(max(counts, default=0) * 4, 1))  # x4: mosaic, as Ultralytics' AutoBatch counts


def skip_frozen_stages(trainer: Any) -> None:
    """Stop checkpointing stages that store nothing for backward once Ultralytics has frozen layers (``freeze=``).

    Registered for ``on_pretrain_routine_end`` (Ultralytics freezes inside ``_setup_train``, after ``get_model``) and
    called by ``auto_batch`` first, so AutoBatch measures the plan that will train.
    """
    model = unwrap_model(trainer.model)
    plan = checkpoint_plan(model)
    if plan is None:
        return
    kept, dropped = plan.without_frozen(model)
    if dropped:
        LOGGER.warning(f"{PREFIX} {', '.join(map(str, dropped))} not recomputed: all their parameters are frozen and "
                       f"no gradient flows into them, so they store nothing for backward; checkpointing "
                       f"{kept.describe()}")
        enable_checkpointing(model, kept, checkpoint_mode(model))


class CheckpointMixin:
    """Hooks that add ``checkpoint_stages`` to an Ultralytics task trainer (listed first among the bases).

    - ``check_resume``: the first hook ``BaseTrainer.__init__`` calls once arguments are merged, before it creates the
      run directory or reads the dataset; bad ``checkpoint_stages`` are rejected here, and a resumed run gets its
      stages back from ``last.pt``.
    - ``get_model``: the training model runs the plan's regions inside checkpoints.
    - ``get_validator``: validators rebuild their arguments with Ultralytics' key check, so they get ours removed.
    - ``save_model``: what is pickled is plain Ultralytics, and ``train_args`` hold only Ultralytics' keys.
    - ``auto_batch``: AutoBatch measures the checkpointed model, or plans for ``memory_budget`` on any device;
      with ``checkpoint_stages=auto`` it chooses plan and batch together (``yolo_ckpt.planner``), and for a fixed batch
      ``choose_auto_plan`` chooses the plan at ``on_pretrain_routine_end``.
    - ``train``: on any exit, also a crash, the model (which ``YOLO.model`` shares) is plain again.
    - callbacks (``yolo_ckpt.epoch_memory``), ``save_metrics``, ``plot_metrics``: each epoch's peak memory goes to
      the console, results.csv, Ultralytics' loggers and memory.png; frozen stages are dropped from the plan.
    """

    def __init__(self, cfg: Any = None, overrides: dict | None = None, _callbacks: dict | None = None):
        """Initialise like the Ultralytics trainer, with our keys' defaults added to ``cfg``."""
        super().__init__({**DEFAULT_CFG_DICT_CKPT, **cfg2dict(cfg or {})}, overrides, _callbacks)
        self.epoch_memory: dict[str, float] = {}
        self.memory_meter: EpochPeak | None = None
        self.autobatch_without: int | str | None = None  # what AutoBatch chose for the same memory, unplanned
        ours = [*CALLBACKS.items(), ("on_pretrain_routine_end", choose_auto_plan),
                ("on_pretrain_routine_end", skip_frozen_stages)]
        for event, fn in ours:
            if fn not in self.callbacks[event]:  # a DDP worker is built with the parent's callbacks, ours included
                self.add_callback(event, fn)

    def check_resume(self, overrides: dict) -> None:
        """Resume like Ultralytics, restore our keys from the checkpoint, then validate ``checkpoint_stages``."""
        ours = {k: overrides[k] for k in CKPT_CFG_DICT if k in overrides}
        super().check_resume({k: v for k, v in overrides.items() if k not in CKPT_CFG_DICT})
        if self.resume:  # Ultralytics rebuilt args from the checkpoint's train_args, which hold none of our keys
            saved = saved_settings(torch_load(self.args.resume, map_location="cpu"))
            for k, default in CKPT_CFG_DICT.items():
                setattr(self.args, k, ours.get(k, saved.get(k, default)))
        check_settings(self.args.model, vars(self.args))  # fail fast: before any directory or dataset work

    def get_model(self, cfg=None, weights=None, verbose: bool = True):
        """Build the Ultralytics model and install the checkpoint plan on it."""
        model = super().get_model(cfg=cfg, weights=weights, verbose=verbose)
        if is_auto(self.args.checkpoint_stages):
            LOGGER.info(f"{PREFIX} auto: the plan is chosen once the device, batch and frozen layers are known")
            return model
        plan = CheckpointPlan.from_spec(model, self.args.checkpoint_stages, self.args.checkpoint_layers)
        mode = self.args.checkpoint_mode or "full"
        enable_checkpointing(model, plan, mode)
        if not plan.regions:
            LOGGER.info(f"{PREFIX} off, all activations stored")
        stages = model_stages(model)
        how = ", selective: convolution outputs kept" if mode == "selective" else ""
        for region in plan.regions:
            shared = f", recomputed as one region with stages {list(region.stages)}" if len(region.stages) > 1 else ""
            for k in region.stages:
                types = ", ".join(type(model.model[i]).__name__ for i in stages[k])
                LOGGER.info(f"{PREFIX} stage {k} (P{k}/{2**k}) layers {list(stages[k])}: {types}{shared}{how}")
            if not region.stages:
                types = ", ".join(type(model.model[i]).__name__ for i in region.layers)
                LOGGER.info(f"{PREFIX} layers {list(region.layers)}: {types}{how}")
        return model

    def train(self):
        """Train like Ultralytics; however it ends, the model is plain again and no memory tracker stays active.

        ``Model.train`` hands the trainer's model to ``YOLO.model``; after a failed run that object is what a user
        saves or trains next, so the plan must not outlive training.
        """
        try:
            return super().train()
        finally:
            for model in (self.model, getattr(self.ema, "ema", None)):  # first: nothing below may skip this
                if isinstance(model, nn.Module):
                    disable_checkpointing(unwrap_model(model))
            close_epoch_memory(self)

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

    def get_validator(self):
        """Build the Ultralytics validator from arguments without our keys."""
        with self._ultralytics_args():
            return super().get_validator()

    def save_model(self):
        """Save Ultralytics checkpoints that plain Ultralytics can load, validate and resume.

        The pickled EMA is plain (an EMA deep-copied from the training model carries the plan); ``train_args``, which
        ``yolo train resume`` validates against Ultralytics' keys, hold none of ours; our settings are recorded in the
        saved model's own ``args`` (where Ultralytics records the run's arguments too) for ``yolo-ckpt train resume``.
        """
        ema = self.ema.ema
        disable_checkpointing(ema)
        linked = getattr(ema, "args", None)  # the trainer's args object itself (detect tasks), or none (classify)
        ours = {k: getattr(self.args, k) for k in CKPT_CFG_DICT}
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

    def auto_batch(self) -> int:
        """Choose the batch for the checkpointed model and log what the same memory gives without checkpointing.

        Our mixin comes first in the MRO, so this replaces the task trainer's ``auto_batch`` too; it gathers the same
        dataset facts as Ultralytics' ``DetectionTrainer.auto_batch`` (8.4.190): the most labels in one image, x4 for
        mosaic, and the number of training images. Both batches are measured on eager copies of the model.
        """
        skip_frozen_stages(self)  # Ultralytics froze layers before AutoBatch: measure the plan that will train
        with override_configs(self.args, overrides={"cache": False}) as self.args:
            dataset = self.build_dataset(self.data["train"], mode="train", batch=16)
        labels = [x for x in getattr(dataset, "labels", []) if isinstance(x, dict) and "cls" in x]
        max_num_obj, dataset_size = max((len(x["cls"]) for x in labels), default=0) * 4, len(dataset)
        del dataset
        if self.args.memory_budget is None and self.device.type != "cuda":  # Ultralytics' default batch off CUDA
            LOGGER.info(f"{colorstr('AutoBatch: ')}set memory_budget (e.g. memory_budget=24GB) to plan without CUDA")
            return BaseTrainer.auto_batch(self, max_num_obj, dataset_size)
        if is_auto(self.args.checkpoint_stages):
            return self._auto_plan(max(max_num_obj, 1), autobatch=True)
        model = self.model
        plain = unwrap_model(model)
        stages = (checkpoint_plan(plain) or CheckpointPlan()).describe(checkpoint_mode(plain))
        if self.args.memory_budget is not None:
            return self._plan_for_budget(unwrap_model(model), stages, max_num_obj, dataset_size)
        try:
            self.model = unwrap_model(model)  # Ultralytics profiles a deepcopy: the plan comes along
            batch = BaseTrainer.auto_batch(self, max_num_obj, dataset_size)
            self.model = with_plan(unwrap_model(model), [])
            self.autobatch_without = BaseTrainer.auto_batch(self, max_num_obj, dataset_size)
        finally:
            self.model = model
        LOGGER.info(f"{colorstr('AutoBatch: ')}batch {batch} with {stages} ({self.autobatch_without} without)")
        return batch

    def _plan_for_budget(self, model: nn.Module, stages: Any, max_num_obj: int, dataset_size: int) -> int:
        """``memory_budget`` AutoBatch on copies of the model (probe steps would move BatchNorm statistics).

        Steps are measured under the autocast dtype this run trains with, and one copy exists at a time, so planning
        itself stays inside the share it plans for.
        """
        fraction = self.batch_size if 0 < self.batch_size < 1 else 0.6
        imgsz = math.ceil(self.args.imgsz * (1 + self.args.multi_scale) / self.stride) * self.stride
        amp = torch.bfloat16 if self.args.amp == "bf16" else torch.float16 if self.amp else None  # as the train loop
        kw = dict(imgsz=imgsz, budget=parse_memory(self.args.memory_budget), fraction=fraction,
                  objects=max(max_num_obj, 1), amp=amp)
        LOGGER.info(f"{colorstr('AutoBatch: ')}planning {fraction:.0%} of memory_budget={self.args.memory_budget} "
                    f"at imgsz={imgsz}{f' under {amp} autocast' if amp else ''} from measured training steps...")
        copy = deepcopy(model)
        try:
            chosen = plan_batch(copy, **kw)
        except ValueError as e:
            raise CheckpointConfigError(f"{e} with {stages}; raise memory_budget or lower imgsz") from None
        finally:
            disable_checkpointing(copy)  # the installed plan refers back to its model: free the copy now, not at gc
            del copy
        try:
            without = str(plan_batch(with_plan(model, []), **kw).batch)
        except ValueError:
            without = "none fits"
        batch = min(chosen.batch, dataset_size or chosen.batch)
        cap = f", capped to the {dataset_size} training images" if batch < chosen.batch else ""
        LOGGER.info(f"{colorstr('AutoBatch: ')}batch {chosen.batch} with {stages} ({without} without){cap}; "
                    f"measured {chosen.measured_bytes / 2**30:.2f} GB of {chosen.target_bytes / 2**30:.2f} GB")
        self.autobatch_without = without
        return batch

    def _auto_plan(self, objects: int, autobatch: bool = False) -> int:
        """Resolve ``checkpoint_stages=auto`` on copies of the model: choose, record in ``args`` (and args.yaml),
        install. With AutoBatch the batch is chosen too; returns the batch."""
        from .planner import NothingFits, choose_plan, choose_plan_and_batch

        model = unwrap_model(self.model)
        if self.args.memory_budget is not None:
            budget, source = parse_memory(self.args.memory_budget), f"memory_budget={self.args.memory_budget}"
        else:
            free, _ = torch.cuda.mem_get_info(self.device)  # what others use is not ours; what we hold is counted
            budget, source = free + torch.cuda.memory_allocated(self.device), f"{self.device} free memory"
        fraction = self.batch_size if 0 < self.batch_size < 1 else 0.6
        imgsz = math.ceil(self.args.imgsz * (1 + self.args.multi_scale) / self.stride) * self.stride
        amp = torch.bfloat16 if self.args.amp == "bf16" else torch.float16 if self.amp else None
        batch = None if autobatch else max(self.batch_size // max(self.world_size, 1), 1)
        LOGGER.info(f"{PREFIX} auto: choosing the plan with the least recompute that fits {fraction:.0%} of {source} "
                    f"at imgsz={imgsz}, {'the largest batch' if autobatch else f'batch {batch}'}...")
        try:
            if autobatch:
                choice = choose_plan_and_batch(model, imgsz, budget, fraction, objects, amp)
            else:
                choice = choose_plan(model, imgsz, batch, int(fraction * budget), objects, amp)
        except NothingFits as e:  # say what would fit: the budget whose share covers the least-keeping plan
            raise CheckpointConfigError(f"{e}: memory_budget={math.ceil(e.needed / fraction / 2**20)}MB would fit "
                                        f"it, or lower batch or imgsz") from None
        except ValueError as e:
            raise CheckpointConfigError(f"{e}; raise memory_budget or lower imgsz") from None
        for k, v in choice.candidate.settings.items():
            setattr(self.args, k, v)
        if RANK in {-1, 0}:  # args.yaml holds the chosen plan, as last.pt does: resume restores it
            YAML.save(self.save_dir / "args.yaml", vars(self.args))
        enable_checkpointing(model, choice.plan, self.args.checkpoint_mode)
        for line in choice.table():
            LOGGER.info(f"{PREFIX}   {line}")
        LOGGER.info(f"{PREFIX} auto chose {choice.plan.describe(self.args.checkpoint_mode)} at batch {choice.batch}: "
                    f"{1 + choice.candidate.flops / choice.base_flops:.3f}x FLOPs, measured "
                    f"{choice.measured_bytes / 2**30:.3f} GB of {choice.target_bytes / 2**30:.3f} GB")
        return choice.batch

    def save_metrics(self, metrics: dict) -> None:
        """Write results.csv with this epoch's peak memory columns, and pass them to Ultralytics' loggers.

        The integrations (TensorBoard, MLflow, W&B, Comet, ...) log ``trainer.metrics`` at ``on_fit_epoch_end``, which
        follows this call in every epoch.
        """
        def ours_last(d: dict) -> dict:  # an epoch without validation carries the last epoch's metrics, ours included
            return {**{k: v for k, v in d.items() if k not in self.epoch_memory}, **self.epoch_memory}

        self.metrics = ours_last(self.metrics)
        super().save_metrics(ours_last(metrics))  # results.csv writes values in order under the first epoch's header

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


class YOLO(ultralytics.YOLO):
    """``ultralytics.YOLO`` whose ``train()`` uses the checkpointing trainer of the model's task.

    Example:
        >>> YOLO("yolo11n-seg.yaml").train(data="seg.yaml", checkpoint_stages=[1, 2])  # doctest: +SKIP
    """

    @property
    def task_map(self) -> dict:
        """Ultralytics' task map with our trainers in place of its own."""
        return {task: {**v, "trainer": TRAINERS.get(task, v["trainer"])} for task, v in super().task_map.items()}

