"""pytest plugin: Ultralytics' own training tests, offline, with Ultralytics' trainers or with yolo-ckpt's.

Loaded by ``benchmarks/ultralytics_tests.py`` (``pytest -p plugin``) into a pytest run of Ultralytics' ``tests/``
with ``YOLO_CONFIG_DIR`` pointing at the stand-ins of ``offline.py``. What it changes, and nothing else:

- which tests run: ``TRAINING_TESTS``; the two whose only reason to skip offline is a download we provide locally
  (``LOCAL_DATA``) run, and a test that exports to a format whose package is not installed is skipped (``NEEDS``);
- where runs are saved: under the settings' ``runs_dir``, in the test process and in the ``yolo`` processes it
  starts, not in the ``tests/tmp/runs`` Ultralytics picks under pytest (``site-packages`` for an installed package);
- with ``$ULTRALYTICS_SUITE_MODE=ours``, before the test modules are imported: each Ultralytics task trainer the
  tests name or a task map resolves (``ultralytics.models.yolo.<task>.<Trainer>``, RT-DETR's) is yolo-ckpt's with
  ``checkpoint_stages=all`` added to its overrides, ``ultralytics.YOLO`` is ``yolo_ckpt.YOLO`` (whose ``data=[...]``
  trains in process with our trainer, where Ultralytics' starts a ``yolo`` per dataset), and ``test_cli.py``'s
  ``yolo ...`` commands are ``yolo-ckpt ...`` (``counting.py``), with ``checkpoint_stages=all`` on ``train``;
- in both modes, one JSON line per test in ``$ULTRALYTICS_SUITE_RECORD``: outcome, the reason of a failure or skip,
  the regions recomputed by each training (``counting``, in this process and in the ``yolo-ckpt`` ones the test
  starts) and the ``checkpoint_stages`` of every run the test saved (its args.yaml).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import counting
import pytest

MODE_ENV = "ULTRALYTICS_SUITE_MODE"  # "ultralytics" (default) or "ours"
RECORD_ENV = "ULTRALYTICS_SUITE_RECORD"  # where the JSON lines go
OURS = os.environ.get(MODE_ENV, "ultralytics") == "ours"
STAGES = "all"  # what every training of ours gets

TRAINING_TESTS = {  # file -> the tests of it that train (None: all of them, as the issue ran test_engine.py)
    "test_engine.py": None,
    "test_cli.py": ("test_train", "test_distill", "test_rtdetr"),
    "test_python.py": ("test_train_multi", "test_train_scratch", "test_train_pretrained", "test_workflow",
                       "test_yolov10", "test_grayscale", "test_semantic_polygon_data"),
}
LOCAL_DATA = ("test_train_multi", "test_train_scratch")  # skipped offline by Ultralytics for data that is local here
OFFLINE_SKIP = "environment is offline"  # their skip's reason
NEEDS = {"test_grayscale": "onnx"}  # exports after training to a format that needs this package
NO_EXPORT = {"test_grayscale": ("classify", "depth")}  # its cases that return before training (and exporting)

_reports: dict[str, list] = {}


def with_stages(cls: type) -> type:
    """``cls`` (a yolo-ckpt trainer) that adds ``checkpoint_stages=all`` to its overrides unless they set it."""

    def __init__(self, cfg=None, overrides=None, _callbacks=None):
        cls.__init__(self, cfg, {"checkpoint_stages": STAGES, **(overrides or {})}, _callbacks)

    wrapped = type(cls.__name__, (cls,), {"__init__": __init__, "__module__": __name__, "__qualname__": cls.__name__,
                                          "__doc__": f"yolo_ckpt.{cls.__name__} with checkpoint_stages={STAGES}."})
    globals()[cls.__name__] = wrapped  # picklable by reference, as Ultralytics' own classes are
    return wrapped


def use_ours() -> None:
    """Every trainer the tests reach is yolo-ckpt's (``with_stages``), and ``ultralytics.YOLO`` is ours."""
    import ultralytics
    import ultralytics.models.rtdetr.model as rtdetr_model
    from ultralytics.models import yolo

    import yolo_ckpt
    from yolo_ckpt.integration import trainer as ours

    for task, cls in list(ours.TRAINERS.items()):
        ours.TRAINERS[task] = wrapped = with_stages(cls)  # what yolo_ckpt.YOLO's task map and several datasets use
        module = getattr(yolo, task)  # ultralytics.models.yolo.detect, ...: what the tests and its task map name
        assert hasattr(module, cls.__name__), (task, cls.__name__)
        setattr(module, cls.__name__, wrapped)
    ours.RTDETRTrainer = rtdetr_model.RTDETRTrainer = with_stages(ours.RTDETRTrainer)
    ultralytics.YOLO = yolo_ckpt.YOLO


def pytest_configure(config) -> None:
    """Before any test module is imported: the trainers of the mode, the recompute counter, and runs saved under the
    settings' ``runs_dir`` (under pytest, Ultralytics saves them in ``tests/tmp/runs`` beside its package: here the
    installed package's ``site-packages``)."""
    import ultralytics.cfg

    if OURS:
        use_ours()
    counting.install()
    ultralytics.cfg.TESTS_RUNNING = False  # what get_save_dir reads


@pytest.hookimpl(hookwrapper=True)
def pytest_pyfunc_call(pyfuncitem):
    """While the test function runs, no ``PYTEST_CURRENT_TEST``: the ``yolo`` processes it starts, which take it for
    a pytest run, save their runs under ``runs_dir`` too (the settings turn off what else it turns off: loggers,
    events)."""
    current = os.environ.pop("PYTEST_CURRENT_TEST", None)
    try:
        yield
    finally:
        if current is not None:
            os.environ["PYTEST_CURRENT_TEST"] = current


def _selected(item) -> bool:
    names = TRAINING_TESTS.get(item.path.name, ())
    return names is None or item.originalname in names


def pytest_collection_modifyitems(config, items) -> None:
    """Only the training tests; the offline skip lifted where the data is local; a missing export package skips."""
    keep = [item for item in items if _selected(item)]
    config.hook.pytest_deselected(items=[item for item in items if not _selected(item)])
    items[:] = keep
    for item in items:
        if item.originalname in LOCAL_DATA:
            item.own_markers = [m for m in item.own_markers
                                if not (m.name == "skipif" and m.kwargs.get("reason") == OFFLINE_SKIP)]
        need = NEEDS.get(item.originalname)
        task = getattr(item, "callspec", None) and item.callspec.params.get("task")
        if need and importlib.util.find_spec(need) is None and task not in NO_EXPORT.get(item.originalname, ()):
            item.add_marker(pytest.mark.skip(reason=f"exports with {need}, which is not installed"))


def run_ours(cmd: str) -> None:
    """``test_cli.run`` for yolo-ckpt: ``yolo ...`` becomes ``yolo-ckpt ...`` (counted), ``train`` with our stages."""
    args = cmd.split()
    if args[0] == "yolo":
        args = [sys.executable, str(Path(counting.__file__)), *args[1:]]
        if "train" in args:
            args.append(f"checkpoint_stages={STAGES}")
    subprocess.run(args, check=True)


@pytest.fixture(autouse=True)
def _ours_on_the_command_line(request, monkeypatch):
    """In ``test_cli.py`` with our trainers, its commands run ``yolo-ckpt`` (``run_ours``)."""
    if OURS and request.module.__name__.rsplit(".", 1)[-1] == "test_cli":
        monkeypatch.setattr(request.module, "run", run_ours)
    yield


def pytest_runtest_logreport(report) -> None:
    _reports.setdefault(report.nodeid, []).append(report)


def _outcome(reports: list) -> tuple[str, str]:
    """The test's outcome (passed, failed, skipped) and a line saying why it failed or skipped."""
    for r in reports:
        if r.failed:
            crash = getattr(r.longrepr, "reprcrash", None)
            text = crash.message if crash else str(r.longrepr)
            return "failed", " ".join(text.split())[:400]
    for r in reports:
        if r.skipped:
            reason = r.longrepr[2] if isinstance(r.longrepr, tuple) else str(r.longrepr)
            return "skipped", reason.removeprefix("Skipped: ")
    return "passed", ""


def _saved(folders: list[Path]) -> dict[Path, int]:
    """Every args.yaml under ``folders`` (one per saved training run), with its modification time."""
    return {f: f.stat().st_mtime_ns for folder in folders if folder.exists() for f in folder.rglob("args.yaml")}


def _runs(before: dict[Path, int], after: dict[Path, int]) -> list[dict]:
    """The runs saved between the two looks (new or rewritten, as a resume rewrites it): path, ``checkpoint_stages``."""
    import yaml

    return [{"args": str(f), "checkpoint_stages": (yaml.safe_load(f.read_text()) or {}).get("checkpoint_stages")}
            for f, mtime in sorted(after.items()) if before.get(f) != mtime]


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Around each test: count its recomputes (here and in its subprocesses), then write its line."""
    from ultralytics.utils import SETTINGS

    basetemp = item.config._tmp_path_factory.getbasetemp()
    folder = Path(tempfile.mkdtemp(prefix="counts-", dir=basetemp))
    os.environ[counting.COUNTS_ENV] = str(folder)
    counting.reset()
    places = [Path(SETTINGS["runs_dir"]), basetemp]
    saved, start = _saved(places), time.time()
    yield
    outcome, why = _outcome(_reports.pop(item.nodeid, []))
    others = counting.subprocess_counts(folder)
    record = {"test": item.nodeid, "outcome": outcome, "why": why, "seconds": round(time.time() - start, 1),
              "recomputes": counting.COUNT["recomputes"] + others["recomputes"],
              "trainings": counting.COUNT["trainings"] + others["trainings"],
              "runs": _runs(saved, _saved(places))}
    if path := os.environ.get(RECORD_ENV):
        with open(path, "a") as f:
            f.write(json.dumps(record) + "\n")
