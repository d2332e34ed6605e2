"""Hyperparameter tuning with a plan: ``YOLO(...).tune(data=..., checkpoint_stages=[2, 3])``.

Ultralytics' own ``Tuner`` runs (its search space, its resume from tune_results.ndjson, its best-hyperparameters
file); it trains every iteration in a subprocess through ``MultiTrainer`` with the ``yolo train`` command
(``ultralytics.engine.trainer._YOLO_CLI_COMMAND``, private, checked against ``versions.ULTRALYTICS_CHECKED``), which
rejects our keys. For the tuning call only, that command is ``python -m yolo_ckpt`` (``yolo-ckpt train`` takes every
``yolo train`` argument and ours), and our keys ride on the tuner's training arguments, so every iteration trains with
the plan, measures its memory, and records its peak in the tuning results (the run's metrics). ``auto`` and AutoBatch
plan again in each iteration. Ray Tune (``use_ray=True``) is refused in one line: its trials train through
Ultralytics' own trainer.
"""

from __future__ import annotations

import sys
from typing import Any
from unittest import mock

import ultralytics.engine.trainer as engine_trainer

from ..regions.spec import CheckpointConfigError
from .settings import CKPT_CFG_DICT, check_settings

COMMAND = [sys.executable, "-m", "yolo_ckpt"]  # `yolo-ckpt`, where Ultralytics runs `yolo` for each iteration


def our_keys(kwargs: dict) -> dict[str, Any]:
    """Our keys among ``tune``'s arguments."""
    return {k: v for k, v in kwargs.items() if k in CKPT_CFG_DICT}


def tune(model: Any, use_ray: bool, iterations: int, args: tuple, kwargs: dict) -> Any:
    """``Model.tune`` of Ultralytics with our keys (``kwargs``), every iteration trained by ``yolo-ckpt train``.

    Raises:
        CheckpointConfigError: For bad values of our keys (before any iteration), and for ``use_ray=True``.
    """
    from ultralytics.engine.tuner import Tuner

    ours = our_keys(kwargs)
    if use_ray:
        raise CheckpointConfigError(f"tune(use_ray=True) with {', '.join(ours)}: Ray Tune's trials train through "
                                    f"Ultralytics' own trainer, without the plan. Valid: use_ray=False (Ultralytics' "
                                    f"Tuner), every iteration trained by yolo-ckpt.")
    if args:
        raise TypeError(f"Positional arguments {args} require use_ray=True, pass Tuner options as keywords.")
    check_settings(model.model, {"task": model.task, **kwargs})  # one line before any iteration
    rest = {k: v for k, v in kwargs.items() if k not in ours}
    if "optimizer" not in (rest.get("space") or {}):  # as Model.tune
        rest.setdefault("optimizer", "AdamW")
    tuner = Tuner(args={**model.overrides, **rest, "mode": "train"}, model=model.model, _callbacks=model.callbacks)
    for k, v in ours.items():  # each iteration's training arguments are vars(tuner.args): ours ride along
        setattr(tuner.args, k, v)
    with mock.patch.object(engine_trainer, "_YOLO_CLI_COMMAND", COMMAND):
        return tuner(iterations=iterations)
