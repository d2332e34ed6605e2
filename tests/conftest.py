"""Shared test set-up: offline Ultralytics, the embedded dataset. Helpers live in ``support.py``."""

import os

os.environ.setdefault("YOLO_OFFLINE", "1")  # before Ultralytics is imported: no network probes

import pytest


@pytest.fixture(scope="session")
def detect_data() -> str:
    from yolo_ckpt.synthetic import synthetic_dataset

    return str(synthetic_dataset("detect"))
