"""Several datasets in one call (``data=[a.yaml, b.yaml]``): Ultralytics' ``MultiTrainer``, each dataset trained in
this process by our trainer, with the run's plan.

Given no trainer class and no callback of the user's, Ultralytics' ``Model.train`` hands each dataset to a plain
``yolo train`` subprocess (``MultiTrainer(None, ...)``), which rejects our keys; every dataset then fails with one
ERROR line and the call returns. So our ``YOLO.train`` always passes the task's trainer: each dataset trains in
process, plans (``auto``, AutoBatch) for its own labels, and measures its memory. Our keys are checked once, before
any dataset starts; a dataset that fails for another reason is skipped as Ultralytics skips it (its metrics ``None``),
and ``yolo-ckpt train`` then ends with one line naming those datasets and exits 1.

Through Ultralytics' own ``YOLO(...).train(trainer=<ours>, data=[a, b])`` our keys can only be checked as the
MultiTrainer builds our trainer for the first dataset, inside its ``except Exception`` that skips each dataset with
an ERROR line and returns (exit 0). There ``check_once`` ends the process with the one line and exit 2 instead.
"""

from __future__ import annotations

import csv
import math
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ultralytics.engine import trainer as ultralytics_trainer

from ..regions.spec import CheckpointConfigError
from .settings import check_settings


def is_several(data: Any) -> bool:
    """Whether ``data=`` names several datasets (a list or tuple), as Ultralytics' ``Model.train`` tells them."""
    return isinstance(data, (list, tuple))


def train(model: Any, run: Callable[..., Any], trainer: type, kwargs: dict) -> dict:
    """Train ``model`` on each of ``kwargs["data"]`` with ``run`` (Ultralytics' ``Model.train``) and ``trainer``.

    Returns:
        (dict): Ultralytics' per-dataset metrics (``None`` for a dataset that failed), each with its run's peak memory
            (``mem/...``, the largest of its epochs and validations), as the sweep's summary
            (multitrain_results.json) holds them too.
    """
    check_settings(model.model, {"task": model.task, **kwargs})  # one line before any dataset starts
    metrics = run(trainer=trainer, **kwargs)
    sweep = model.trainer
    for record in getattr(sweep, "trainers", []):
        name = record.save_dir.name
        if sweep.metrics.get(name) is not None:
            sweep.metrics[name] = {**sweep.metrics[name], **run_peaks(record.save_dir / "results.csv")}
    if getattr(sweep, "trainers", None):
        sweep.save_results()  # again: with each run's peak memory
    return metrics


def run_peaks(results_csv: Any) -> dict[str, float]:
    """A run's peak memory: each ``mem/`` column's largest value over its epochs (NaN where none was measured)."""
    try:
        with open(results_csv) as f:
            rows = [{k.strip(): v.strip() for k, v in r.items()} for r in csv.DictReader(f)]
    except FileNotFoundError:
        return {}
    columns = {k for r in rows for k in r if k.startswith("mem/")}
    return {k: max((float(r[k]) for r in rows if math.isfinite(float(r[k]))), default=math.nan) for k in columns}


def check_once(model: Any, args: dict) -> None:
    """``check_settings`` as a trainer is built: inside Ultralytics' MultiTrainer, a bad value ends the sweep once
    (``stop_sweep``) rather than once per dataset."""
    try:
        check_settings(model, args)
    except CheckpointConfigError as e:
        stop_sweep(e)
        raise


def stop_sweep(error: CheckpointConfigError) -> None:
    """When Ultralytics' ``MultiTrainer`` is building this trainer: print ``error``'s one line, remove the (empty)
    folders it has just made for the sweep and its first dataset, and exit 2, before any dataset trains. Otherwise
    return, and the caller raises ``error`` as usual.

    A ``SystemExit``, since the MultiTrainer turns any ``Exception`` into one skipped dataset (checked on 8.4.190)."""
    sweep = _building_sweep()
    if sweep is None:
        return
    for folder in (sweep.f_locals.get("save_dir"), getattr(sweep.f_locals["self"], "save_dir", None)):
        try:  # only folders this sweep made and nothing was written to: rmdir refuses any other
            Path(folder).rmdir()
        except (OSError, TypeError):
            pass
    print(f"yolo-ckpt: error: {error}", file=sys.stderr)
    raise SystemExit(2)


def _building_sweep() -> Any:
    """The frame of ``MultiTrainer.train`` that is building a trainer, or ``None``."""
    cls = getattr(ultralytics_trainer, "MultiTrainer", None)
    frame = sys._getframe(1)
    while frame is not None and cls is not None:
        if frame.f_code.co_name == "train" and isinstance(frame.f_locals.get("self"), cls):
            return frame
        frame = frame.f_back
    return None
