"""Shared test set-up: offline Ultralytics, small deterministic CPU training runs."""

import os

os.environ.setdefault("YOLO_OFFLINE", "1")  # before Ultralytics is imported: no network probes

import csv
from pathlib import Path

import pytest

# Small, bitwise-reproducible CPU training (BRIEF §3) at a size where every loss term is non-zero: the same arguments for vanilla and checkpointed runs.
TRAIN_ARGS = dict(epochs=2, imgsz=320, batch=4, workers=0, device="cpu", seed=0, deterministic=True, plots=False)


def results(run_dir: Path) -> list[dict]:
    """results.csv rows without the wall-clock column."""
    with open(run_dir / "results.csv") as f:
        return [{k.strip(): v.strip() for k, v in row.items() if k.strip() != "time"} for row in csv.DictReader(f)]


@pytest.fixture(scope="session")
def detect_data() -> str:
    from yolo_ckpt.synthetic import synthetic_dataset

    return str(synthetic_dataset("detect"))
