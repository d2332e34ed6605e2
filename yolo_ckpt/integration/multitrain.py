"""Several datasets in one call (``data=[a.yaml, b.yaml]``): Ultralytics' ``MultiTrainer``, each dataset trained in
this process by our trainer, with the run's plan.

Given no trainer class and no callback of the user's, Ultralytics' ``Model.train`` hands each dataset to a plain
``yolo train`` subprocess (``MultiTrainer(None, ...)``), which rejects our keys; every dataset then fails with one
ERROR line and the call returns. So our ``YOLO.train`` always passes the task's trainer: each dataset trains in
process, plans (``auto``, AutoBatch) for its own labels, and measures its memory. Our keys are checked once, before
any dataset starts; a dataset that fails for another reason is skipped as Ultralytics skips it (its metrics ``None``),
and ``yolo-ckpt train`` then ends with one line naming those datasets and exits 1.
"""

from __future__ import annotations

import csv
import math
from collections.abc import Callable
from typing import Any

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
