"""Hyperparameter tuning with a plan: ``YOLO(...).tune(data=..., checkpoint_stages=[2, 3])``.

Ultralytics' own ``Tuner`` runs (its search space, its resume from tune_results.ndjson, its best-hyperparameters
file); it trains every iteration in a subprocess through ``MultiTrainer`` with the ``yolo train`` command
(``ultralytics.engine.trainer._YOLO_CLI_COMMAND``, private, checked against ``versions.ULTRALYTICS_CHECKED``), which
rejects our keys. For the tuning call only, that command is ``python -m yolo_ckpt`` (``yolo-ckpt train`` takes every
``yolo train`` argument and ours), and our keys ride on the tuner's training arguments, so every iteration trains with
the plan, measures its memory, and records its peak in the tuning results (the run's metrics). A plan or batch that
is planned (``auto``, ``least``, ``batch=-1`` or a fraction) is planned once, in the first iteration, and its choice
reused by the others (``reuse``): the hyperparameters the Tuner mutates do not change what it was planned for, unless
its search space holds ``imgsz`` or ``batch``. Ray Tune (``use_ray=True``) is refused in one line: its trials train
through Ultralytics' own trainer.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any
from unittest import mock

import ultralytics.engine.trainer as engine_trainer
from ultralytics.utils import LOGGER, YAML

from ..regions.spec import CheckpointConfigError
from ..report.summary import PREFIX
from .settings import CKPT_CFG_DICT, check_settings, is_auto, is_least

PLANNED_FOR = ("imgsz", "batch")  # what a plan is planned for that the Tuner's search space may mutate
CHOICE = ("checkpoint_stages", "checkpoint_layers", "checkpoint_mode", "checkpoint_loss", "batch")

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
        if iterations > 1 and planned(vars(tuner.args)) and not set(PLANNED_FOR) & set(tuner.space):
            tuner(iterations=1)  # the first iteration plans; the Tuner resumes from its results below
            reuse(tuner)
        return tuner(iterations=iterations)


def planned(args: dict) -> bool:
    """Whether a run with ``args`` plans its plan or its batch."""
    batch = args.get("batch")
    return is_auto(args.get("checkpoint_stages")) or is_least(args.get("checkpoint_stages")) or \
        batch is not None and float(batch) < 1


def reuse(tuner: Any) -> None:
    """Set the plan and batch the tuner's first iteration chose (its run's args.yaml, as ``record_settings`` left it)
    on the tuner's training arguments, so that the following iterations train them without planning again."""
    lines = tuner.tune_file.read_text().splitlines() if tuner.tune_file.exists() else []
    first = json.loads(lines[0]) if lines else {}
    dirs = first.get("save_dirs", {})
    # several datasets are each planned for their own labels; a failed iteration chose nothing
    if len(dirs) != 1 or first.get("failed_datasets") or not (saved := Path(*dirs.values()) / "args.yaml").exists():
        return
    chosen = {k: v for k, v in YAML.load(saved).items() if k in CHOICE}
    if planned(chosen):  # the run ended before it chose
        return
    for k, v in chosen.items():
        setattr(tuner.args, k, v)
    LOGGER.info(f"{PREFIX} tune: planned in iteration 1, reused by the others: "
                f"{' '.join(f'{k}={v}' for k, v in chosen.items())}")
