"""Shared test set-up: offline Ultralytics, the embedded dataset. Helpers live in ``support.py``."""

import os
from collections.abc import Iterator

os.environ.setdefault("YOLO_OFFLINE", "1")  # before Ultralytics is imported: no network probes
# before torch loads its OpenMP (GNU libgomp reads it then): a thread waiting at a parallel region's end sleeps instead
# of spinning. With two threads on two cores that the other xdist worker also uses, spinning made a 2-thread step of
# test_loss 19x slower (28.8 against 1.5 s); a wait policy changes no result
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest

from support import timing  # importing it sets the suite's costs.TIMED_STEPS


@pytest.fixture
def timed_planning() -> Iterator[None]:
    """The test's planning times one step per probe (``timing``): for tests of what the times decide."""
    with timing():
        yield


TEST_IMAGE_SIDE = 512  # px: above every size the suite trains the embedded sets at (64-480)


@pytest.fixture(scope="session")
def small_data(tmp_path_factory):
    """``small_data(task)``: the embedded set of a task whose labels are text (detect, segment, pose, obb), its 1024 px
    tiles downscaled to ``TEST_IMAGE_SIDE`` in a copy of the worker's own, the labels (normalised) as they are; any
    other task's set as it is (semantic and depth read pixel-sized masks and maps).

    Ultralytics resizes every tile to the run's ``imgsz`` as it loads it, so the runs see images of the same size;
    decoding a 1024 px PNG took 21 ms (2026's CPU), a sixth of a small training run, and 4 ms at 512 px. The sets
    themselves are tested at full size in ``test_synthetic.py``."""
    import shutil

    import cv2

    from yolo_ckpt.data.synthetic import synthetic_dataset

    made: dict[str, str] = {}

    def small(task: str) -> str:
        if task not in ("detect", "segment", "pose", "obb"):
            return str(synthetic_dataset(task))
        if task not in made:
            src, root = synthetic_dataset(task).parent, tmp_path_factory.mktemp(task)
            for split in ("train", "val"):
                (root / "images" / split).mkdir(parents=True)
                for f in sorted((src / "images" / split).glob("*.png")):
                    image = cv2.imread(str(f))
                    scale = TEST_IMAGE_SIDE / max(image.shape[:2])
                    size = (round(image.shape[1] * scale), round(image.shape[0] * scale))
                    cv2.imwrite(str(root / "images" / split / f.name), cv2.resize(image, size,
                                                                                 interpolation=cv2.INTER_AREA))
                shutil.copytree(src / "labels" / split, root / "labels" / split)
            text = (src / "data.yaml").read_text().replace(f"path: {src}\n", f"path: {root}\n")
            assert f"path: {root}\n" in text, text
            (root / "data.yaml").write_text(text)
            made[task] = str(root / "data.yaml")
        return made[task]

    return small


@pytest.fixture(scope="session")
def detect_data(small_data) -> str:
    """The embedded detection set (``synthetic_hr``), at ``TEST_IMAGE_SIDE`` (``small_data``)."""
    return small_data("detect")


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



def pytest_collection_modifyitems(items):
    """The ``heavy`` tests first, by rank (``heavy(1)`` before ``heavy(2)``), the rest as collected: xdist's workers
    then end on short tests, not one of them on a three-minute test while the other has nothing left (two workers on
    two cores: each minute one waits is half a minute of CI)."""
    def rank(item) -> float:  # a parameter's own mark may rank it before its function's
        return min((mark.args[0] for mark in item.iter_markers("heavy")), default=float("inf"))

    items.sort(key=rank)  # stable: within a rank, and for every unmarked test, the order of collection


def pytest_collection_finish(session):
    """Move what the imports made (torch, Ultralytics, every test module) out of the collector's sight: no test frees
    it, and each full collection (``device.release`` runs one after every failed probe) scanned it all again,
    0.08 s a time on 2026's CPU."""
    import gc

    import ultralytics.models  # noqa: F401  the trainers and validators the tests build, imported once here

    import yolo_ckpt.integration.trainer  # noqa: F401

    gc.collect()
    gc.freeze()
