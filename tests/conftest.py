"""Shared test set-up: offline Ultralytics, the embedded dataset. Helpers live in ``support.py``."""

import os

os.environ.setdefault("YOLO_OFFLINE", "1")  # before Ultralytics is imported: no network probes

import pytest


@pytest.fixture(scope="session")
def detect_data() -> str:
    from yolo_ckpt.synthetic import synthetic_dataset

    return str(synthetic_dataset("detect"))


@pytest.fixture(scope="module")
def one_launch_at_a_time(tmp_path_factory):
    """Hold, for a module of multi-process launches (Ultralytics' DDP, torchrun), one lock that every xdist worker
    shares: two launches at once race for ports and rendezvous and overload two cores. README's ``--dist worksteal``
    does not honour the modules' ``xdist_group`` marks (only ``--dist loadgroup`` does), so the marks alone did not
    keep them apart."""
    import fcntl

    with open(tmp_path_factory.getbasetemp().parent / "yolo-ckpt-launch.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        yield
