"""Which Ultralytics model class a model argument needs, and the model families yolo-ckpt cannot train.

``yolo train`` picks the model class from the model's name (``ultralytics.cfg.entrypoint``): ``rtdetr`` in
the file stem gives ``ultralytics.RTDETR``, anything else ``ultralytics.YOLO`` (which itself turns ``*-world*.yaml``
into ``YOLOWorld``, ``yoloe*.yaml`` into ``YOLOE``, and checkpoints into the class of the model they hold).
``yolo-ckpt train`` follows the same rule, so every name means the same model as in ``yolo``.

YOLO-World and YOLOE are rejected with one line before any work (``check_supported``). Their forward threads prompt
embeddings through the layers in a loop of its own (``WorldModel.predict``, ``YOLOEModel.predict``), which yolo-ckpt
does not checkpoint (``yolo_ckpt.regions.install``), and their training loads a text encoder that is a download
(the ``clip`` package from GitHub, which ``ultralytics.nn.text_model`` imports or pip-installs, and CLIP ViT-B/32 or
MobileCLIP weights). Checked in ``versions.ULTRALYTICS_CHECKED``, trainer by trainer:

- ``WorldTrainer``/``WorldTrainerFromScratch``: ``on_pretrain_routine_end`` sets the EMA's classes with
  ``get_text_pe`` (CLIP) before the first epoch, whether or not a ``text_embeddings_*.pt`` cache exists;
- ``YOLOETrainer`` (what ``yolo train`` picks), ``YOLOETrainerFromScratch`` and ``YOLOEVPTrainer`` (visual prompts):
  the cache covers the training batches, but ``YOLOEDetectValidator.get_model`` encodes the class names with
  MobileCLIP at every validated epoch (always the last);
- ``YOLOEPETrainer``/``YOLOEPESegTrainer`` (linear probing, Python ``trainer=`` only) validate with the plain
  detection/segmentation validator and are offline only when the given YOLOE weights already have their class
  embeddings fused into the head (otherwise ``get_vocab`` calls MobileCLIP). Probing linearly (every other layer
  frozen with ``freeze=``) trains only the head's class convolutions, and nothing before them stores activations for
  backward: nothing to recompute. Without ``freeze=`` it is full fine-tuning, which would need
  ``YOLOEModel.predict``'s loop checkpointed: not implemented.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import ultralytics

from .install import SUPPORTED_MODELS, UnsupportedModelError

DEFAULT_MODELS = {  # each task's model when none is given; built from YAML: nothing to download (`yolo` would fetch
    # yolo26n.pt)
    "detect": "yolo11n.yaml",
    "segment": "yolo11n-seg.yaml",
    "semantic": "yolo26n-sem.yaml",  # no yolo11 semantic or depth YAML ships with Ultralytics
    "depth": "yolo26n-depth.yaml",
    "pose": "yolo11n-pose.yaml",
    "obb": "yolo11n-obb.yaml",
    "classify": "yolo11n-cls.yaml",
}

TEXT_ENCODERS = {  # the model class Ultralytics builds -> what its training loads
    "WorldModel": ("YOLO-World", "the CLIP ViT-B/32 text encoder (the `clip` package from GitHub and its weights), "
                                 "loaded to set the class embeddings before the first epoch"),
    "YOLOEModel": ("YOLOE", "the MobileCLIP text encoder (the `clip` package from GitHub and mobileclip_blt.ts), "
                            "loaded by its validator (every validated epoch, always the last) or, for linear "
                            "probing, to fuse the class names into the head"),
}


def ultralytics_class(model: Any) -> type[ultralytics.YOLO] | type[ultralytics.RTDETR]:
    """The Ultralytics model class ``yolo train`` would build ``model`` with (its name decides, as in ``yolo``)."""
    if isinstance(model, (str, Path)) and "rtdetr" in Path(model).stem.lower():
        return ultralytics.RTDETR
    return ultralytics.YOLO


def task_model_name(model: Any) -> str | None:
    """The class name of the task model Ultralytics builds for a model argument, where the name alone tells
    (``ultralytics.YOLO.__init__``: ``-world`` in a YAML stem means ``WorldModel``, ``yoloe`` ``YOLOEModel``);
    a built model or a checkpoint's model by its class (YOLOE segmentation models subclass ``YOLOEModel``)."""
    from torch import nn
    from ultralytics.nn.tasks import WorldModel, YOLOEModel

    if isinstance(model, ultralytics.engine.model.Model):
        model = model.model
    if isinstance(model, (str, Path)) and Path(model).suffix == ".pt" and Path(model).exists():
        from ultralytics.nn.tasks import load_checkpoint

        model = load_checkpoint(model)[0]
    if isinstance(model, nn.Module):
        return next((c.__name__ for c in (WorldModel, YOLOEModel) if isinstance(model, c)), type(model).__name__)
    path = Path(str(model))
    if path.suffix.lower() in {".yaml", ".yml"}:
        return "WorldModel" if "-world" in path.stem else "YOLOEModel" if "yoloe" in path.stem else None
    return None


def check_supported(model: Any) -> None:
    """Stop with one line, before any work, for a model family yolo-ckpt cannot train.

    Raises:
        UnsupportedModelError: For YOLO-World and YOLOE models (YAML names, checkpoints or built models).
    """
    if (family := TEXT_ENCODERS.get(task_model_name(model) or "")) is not None:
        name = Path(str(model)).name if isinstance(model, (str, Path)) else type(model).__name__
        raise UnsupportedModelError(f"{name}: {family[0]} is not supported: its forward threads prompt embeddings "
                                    f"through its layers in a loop of its own, which yolo-ckpt does not checkpoint, "
                                    f"and Ultralytics trains it with {family[1]}, downloaded unless installed (a local "
                                    f"text-embedding cache does not replace it). {SUPPORTED_MODELS}")
