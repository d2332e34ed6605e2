"""Ultralytics trainers that recompute chosen backbone stages during backward.

Each task trainer is the Ultralytics one plus ``CheckpointMixin``: a handful of hook overrides and nothing else, so the
training loop, losses, optimizer, EMA and checkpoint files are Ultralytics' own.

Example:
    >>> from yolo_ckpt import YOLO
    >>> YOLO("yolo11n.yaml").train(data="data.yaml", imgsz=1280, checkpoint_stages=[2, 3])  # doctest: +SKIP

    or with Ultralytics' own model class:

    >>> from ultralytics import YOLO
    >>> from yolo_ckpt import DetectionTrainer
    >>> YOLO("yolo11n.yaml").train(trainer=DetectionTrainer, data="data.yaml", checkpoint_stages="all")  # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import ultralytics
from ultralytics.cfg import DEFAULT_CFG_DICT, cfg2dict
from ultralytics.models import yolo
from ultralytics.utils import LOGGER, YAML, colorstr
from ultralytics.utils.patches import torch_load

from .model import disable_checkpointing, enable_checkpointing
from .resources import data_file
from .stages import CheckpointPlan

CKPT_CFG_DICT: dict[str, Any] = YAML.load(data_file("cfg", "default.yaml"))  # our keys and their defaults
DEFAULT_CFG_DICT_CKPT: dict[str, Any] = {**DEFAULT_CFG_DICT, **CKPT_CFG_DICT}  # what `yolo-ckpt train` accepts
PREFIX = colorstr("checkpoint:")


class CheckpointMixin:
    """Hooks that add ``checkpoint_stages`` to an Ultralytics task trainer (listed first among the bases).

    - ``check_resume``: the first hook ``BaseTrainer.__init__`` calls once arguments are merged, before it creates the
      run directory or reads the dataset; bad ``checkpoint_stages`` are rejected here, and a resumed run gets its
      stages back from ``last.pt``.
    - ``get_model``: the training model runs the plan's regions inside checkpoints.
    - ``get_validator``: validators rebuild their arguments with Ultralytics' key check, so they get ours removed.
    - ``save_model``: the EMA that is pickled is always a plain Ultralytics model.
    """

    def __init__(self, cfg: Any = None, overrides: dict | None = None, _callbacks: dict | None = None):
        """Initialise like the Ultralytics trainer, with our keys' defaults added to ``cfg``."""
        super().__init__({**DEFAULT_CFG_DICT_CKPT, **cfg2dict(cfg or {})}, overrides, _callbacks)

    def check_resume(self, overrides: dict) -> None:
        """Resume like Ultralytics, restore our keys from the checkpoint, then validate ``checkpoint_stages``."""
        ours = {k: overrides[k] for k in CKPT_CFG_DICT if k in overrides}
        super().check_resume({k: v for k, v in overrides.items() if k not in CKPT_CFG_DICT})
        if self.resume:  # Ultralytics' get_cfg(ckpt args) dropped our keys; an unfinished last.pt still has them
            saved = torch_load(self.args.resume, map_location="cpu").get("train_args", {})
            for k, default in CKPT_CFG_DICT.items():
                setattr(self.args, k, ours.get(k, saved.get(k, default)))
        if self.args.model is not None:  # fail fast: one line, before any directory or dataset work
            CheckpointPlan.from_spec(self.args.model, self.args.checkpoint_stages)

    def get_model(self, cfg=None, weights=None, verbose: bool = True):
        """Build the Ultralytics model and install the checkpoint plan on it."""
        model = super().get_model(cfg=cfg, weights=weights, verbose=verbose)
        plan = CheckpointPlan.from_spec(model, self.args.checkpoint_stages)
        enable_checkpointing(model, plan)
        if not plan.regions:
            LOGGER.info(f"{PREFIX} off, all activations stored")
        for region in plan.regions:
            types = ", ".join(type(model.model[i]).__name__ for i in region.layers)
            LOGGER.info(f"{PREFIX} stage {region.stage} (P{region.stage}/{2**region.stage}) layers {list(region.layers)}: {types}")
        return model

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
        """Save Ultralytics checkpoints of a plain EMA (an EMA deep-copied from the training model has the plan)."""
        disable_checkpointing(self.ema.ema)
        return super().save_model()


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


TRAINERS = {
    "detect": DetectionTrainer,
    "segment": SegmentationTrainer,
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
