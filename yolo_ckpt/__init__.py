"""yolo-ckpt: activation checkpointing for Ultralytics YOLO training — the same training, with less memory.

Examples:
    >>> from yolo_ckpt import YOLO
    >>> YOLO("yolo11n.yaml").train(data="data.yaml", imgsz=1280, checkpoint_stages=[2, 3])  # doctest: +SKIP
"""

from .versions import ULTRALYTICS_RANGE, __version__  # first: an Ultralytics outside the range stops here, in one line

# isort: split
from .integration.trainer import (
    RTDETR,
    TRAINERS,
    YOLO,
    ClassificationTrainer,
    DepthTrainer,
    DetectionTrainer,
    OBBTrainer,
    PoseTrainer,
    RTDETRTrainer,
    SegmentationTrainer,
    SemanticSegmentationTrainer,
)
from .regions.graph import backbone_stages, model_stages
from .regions.install import checkpoint_mode, checkpoint_plan, disable_checkpointing, enable_checkpointing
from .regions.plan import CheckpointPlan, Region
from .regions.spec import CheckpointConfigError

__all__ = (
    "YOLO",
    "RTDETR",
    "RTDETRTrainer",
    "TRAINERS",
    "DetectionTrainer",
    "SegmentationTrainer",
    "SemanticSegmentationTrainer",
    "DepthTrainer",
    "PoseTrainer",
    "OBBTrainer",
    "ClassificationTrainer",
    "CheckpointPlan",
    "CheckpointConfigError",
    "Region",
    "backbone_stages",
    "model_stages",
    "enable_checkpointing",
    "disable_checkpointing",
    "checkpoint_plan",
    "checkpoint_mode",
    "ULTRALYTICS_RANGE",
    "__version__",
)
