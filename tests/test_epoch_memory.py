"""Per-epoch peak memory: robust to Ultralytics' event order, and visible in results.csv, the console and loggers."""

from __future__ import annotations

import csv as csvlib
import importlib.util
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch
import ultralytics
from torch.utils._python_dispatch import _get_current_dispatch_mode

import yolo_ckpt
from yolo_ckpt import YOLO, CheckpointPlan
from yolo_ckpt.integration.epoch_memory import EpochPeak, is_compiled
from yolo_ckpt.memory.step import build_model
from yolo_ckpt.memory.tracker import GB, LiveTensorTracker
from yolo_ckpt.planning.search import deepest

from support import (
    TRAIN_ARGS,
    CkptOOMOnce,
    VanillaOOMOnce,
    add_counting,
    assert_recomputed,
    assert_same_run,
    forward_counts,
    results,
)

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

@pytest.fixture(autouse=True)
def _no_leftover_modes():
    yield
    assert _get_current_dispatch_mode() is None, "a test left a dispatch mode on the stack"


# ------------------------------------------------------------------------------------------------- the meter
def test_exact_cpu_epochs():
    meter = EpochPeak("cpu")
    assert meter.source == "tensor" and meter.keys == ("mem/peak_tensor_GB",)
    assert meter.stop() == {}  # never started: nothing measured
    meter.start()
    assert _get_current_dispatch_mode() is meter.tracker
    a = torch.ones(1000)  # 4000 B
    b = a * 2  # 4000 B
    del b
    assert meter.stop() == {"mem/peak_tensor_GB": 8000 / GB}
    assert _get_current_dispatch_mode() is None
    meter.start()  # next epoch: a (allocated in epoch 1) is still alive and counts
    c = torch.ones(500)
    assert meter.stop() == {"mem/peak_tensor_GB": (4000 + 2000) / GB}
    del a, c
    meter.start()  # no op ran: no made-up 0
    assert meter.stop() == {}


@pytest.mark.parametrize("events, expected", [
    # OOM retry: the epoch restarts without on_train_epoch_end; the peak restarts from what is alive
    (["start", "alloc 1000", "free", "start", "alloc 250", "stop"], 250 * 4),
    # an exception mid-epoch: teardown closes; measuring again counts what is still alive
    (["start", "alloc 1000", "close", "start", "alloc 100", "stop"], (1000 + 100) * 4),
    # early stop / the final epoch end with a stop and nothing after it; a second stop reports nothing
    # (resume needs no case here: a resumed run starts a fresh meter, tested through training in test_trainer)
    (["start", "alloc 300", "stop", "stop"], None),
])
def test_any_order_of_events(events, expected):
    meter, held, last = EpochPeak("cpu"), [], {}
    for e in events:
        if e.startswith("alloc"):
            held.append(torch.ones(int(e.split()[1])))
        elif e == "free":
            held.clear()
        else:
            last = getattr(meter, e)() or {}
    assert _get_current_dispatch_mode() is None and not meter.running
    assert last == ({} if expected is None else {"mem/peak_tensor_GB": expected / GB})


def test_meter_refuses_to_pop_a_foreign_mode():
    meter = EpochPeak("cpu")
    meter.start()
    other = LiveTensorTracker()
    other.__enter__()
    with pytest.raises(RuntimeError):
        meter.stop()
    assert _get_current_dispatch_mode() is other
    other.__exit__(None, None, None)
    meter.tracker.__exit__(None, None, None)


def test_compiled_cpu_epochs_sample_one_step_from_allocation_records():
    """A compiled CPU run's meter profiles step ``SAMPLED_STEP`` of each epoch, from the end of the step before it: its
    figure is the bytes alive when that window opened plus the window's allocation peak; the steps around it are not
    profiled; an epoch that ends before it measures nothing; validation (``eager``) is tracked exactly."""
    from yolo_ckpt.integration.epoch_memory import SAMPLED_STEP

    assert SAMPLED_STEP == 2
    meter = EpochPeak("cpu", compiled=True)
    assert meter.source == "allocations" and meter.keys == ("mem/peak_tensor_GB",)
    meter.start()
    assert _get_current_dispatch_mode() is None  # nothing a compiled frame would be skipped under
    big = torch.ones(4 * 2**20 // 4)  # 4 MiB in step 1: not profiled
    del big
    meter.step_ended(held=1000)  # step 1 ends: the window opens, 1000 bytes alive beside it
    a = torch.ones(2**20 // 4)  # step 2: 1 MiB ...
    b = a * 2  # ... +1 MiB
    del a, b
    meter.step_ended(held=5)  # step 2 ends: the window closes (the bytes alive now are not read)
    c = torch.ones(8 * 2**20 // 4)  # step 3: not profiled
    del c
    meter.step_ended(held=5)
    peak = meter.stop()["mem/peak_tensor_GB"] * GB
    assert 1000 + 2 * 2**20 <= peak <= 1000 + 2 * 2**20 + 1024, peak  # the profiler may see a few bytes besides
    meter.start()  # an epoch of one step: nothing measured, never a made-up 0
    meter.step_ended(held=1000)
    assert meter.stop() == {}
    meter.start(eager=True)  # validation: exact tracking
    assert _get_current_dispatch_mode() is meter.tracker
    d = torch.ones(1000)
    del d
    assert meter.stop() == {"mem/peak_tensor_GB": 4000 / GB}
    meter.start()
    meter.step_ended(held=0)  # a window open when training ends (an exception): closed unread
    meter.close()
    assert not meter.running and meter.stop() == {}


def test_compiled_models_are_recognised():
    model = torch.nn.Linear(2, 2)
    assert not is_compiled(model)
    assert is_compiled(torch.compile(model))  # lazy: nothing is compiled until called


# ----------------------------------------------------------------------------------------- through training
def test_oom_retry_continues_at_half_the_batch_like_vanilla(detect_data, tmp_path):
    """Ultralytics halves the batch and restarts the first epoch on a CUDA out-of-memory error; so do we, exactly."""
    runs = {}
    whole = deepest(build_model("yolo11n.yaml")).keys()  # nothing keeps less: no escalation, it halves
    for name, trainer, extra in (("vanilla", VanillaOOMOnce, {}), ("ckpt", CkptOOMOnce, whole)):
        model = ultralytics.YOLO("yolo11n.yaml")
        add_counting(model)
        model.train(trainer=trainer, data=detect_data, project=str(tmp_path), name=name,
                    **{**TRAIN_ARGS, "epochs": 1, "imgsz": 160, "val": False, "save_period": 1, **extra})
        assert model.trainer.oom_raised and model.trainer.batch_size == TRAIN_ARGS["batch"] // 2
        runs[name] = Path(model.trainer.save_dir)
    layers = {i for r in CheckpointPlan.from_spec("yolo11n.yaml", [], whole["checkpoint_layers"]).regions
              for i in r.layers}
    assert_recomputed(forward_counts(runs["vanilla"]), forward_counts(runs["ckpt"]), layers)
    assert_same_run(runs["vanilla"], runs["ckpt"])
    assert float(results(runs["ckpt"])[0]["mem/peak_tensor_GB"]) > 0  # the restarted epoch was measured


def test_tracker_does_not_outlive_a_crash(detect_data, tmp_path):
    def crash(trainer):
        raise RuntimeError("crash during the epoch's training steps, while memory is being measured")

    model = YOLO("yolo11n.yaml")
    model.add_callback("on_train_batch_end", crash)
    with pytest.raises(RuntimeError, match="crash during"):
        model.train(data=detect_data, project=str(tmp_path), **{**TRAIN_ARGS, "epochs": 1, "imgsz": 64})


def test_memory_reaches_ultralytics_tensorboard_logger(detect_data, tmp_path):
    """Ultralytics' own TensorBoard callback logs the memory columns as it logs metrics, with results.csv's values.

    It runs in a fresh interpreter: Ultralytics switches its loggers off while pytest runs, and the TensorBoard
    setting is written to a settings file of that run only (``YOLO_CONFIG_DIR``).
    """
    code = f"""
from ultralytics import settings
settings.update({{"tensorboard": True}})
from yolo_ckpt import YOLO
YOLO("yolo11n.yaml").train(data=r"{detect_data}", project=r"{tmp_path}", name="tb", checkpoint_stages=[2, 3],
                           epochs=3, imgsz=64, batch=4, workers=0, device="cpu", plots=False, val=False)
"""
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST"}
    env.update(YOLO_CONFIG_DIR=str(tmp_path / "config"), YOLO_OFFLINE="1")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "tb")).Reload()
    rows = results(tmp_path / "tb")
    # epochs without validation carry earlier metrics: every column must still hold its own values (the logger takes
    # the learning rate straight from the trainer)
    for column in ("mem/peak_tensor_GB", "lr/pg0"):
        logged = {e.step: e.value for e in events.Scalars(column)}
        csv = {int(r["epoch"]): float(r[column]) for r in rows}
        assert set(csv) == {1, 2, 3} and set(logged) - set(csv) <= {4}, column
        assert all(logged[e] == pytest.approx(csv[e], rel=1e-5) and csv[e] > 0 for e in csv), (column, logged, csv)
    # the final evaluation's metrics (step 4) carry the last epoch's peak and the evaluation's own
    final = {e.step: e.value for e in events.Scalars("mem/peak_tensor_GB")}[4]
    assert final == pytest.approx(float(rows[-1]["mem/peak_tensor_GB"]), rel=1e-5) and final > 0
    assert {e.step for e in events.Scalars("mem/val_peak_tensor_GB")} == {3, 4}  # epochs 1-2 not validated: NaN


LOGGERS = ("mlflow", "wandb", "clearml", "comet_ml", "dvclive")  # the `loggers` extra (pyproject.toml)

LOGGER_RUN = """
import sys
from ultralytics import settings
settings.update({"mlflow": True, "wandb": True, "clearml": True, "comet": True, "dvc": True})
from clearml import Task
from yolo_ckpt import YOLO
model = YOLO("yolo11n.yaml")
# ClearML offline cannot register the final model: Ultralytics' on_train_end calls update_output_model, which raises
# AttributeError ('DummyModel' object has no attribute 'locked') and ends training in it. A user's on_train_end runs
# before Ultralytics' and closes the task, so that ClearML's callback finds none; our figure went out before, with
# every on_fit_epoch_end
model.add_callback("on_train_end", lambda trainer: Task.current_task().close())
model.train(data=sys.argv[1], project=sys.argv[2], name="r", checkpoint_stages=[2, 3], epochs=2, imgsz=64, batch=4,
            workers=0, device="cpu", plots=False)
"""


def wandb_history(run_file: Path) -> list[dict]:
    """The rows logged to a W&B run, read from its ``.wandb`` file: wandb's ``Record`` protobufs in LevelDB's log
    framing (32 KiB blocks, 7-byte record headers, after wandb's own 7-byte file header). wandb 0.31 reads the file in
    its Go core only: no Python reader is shipped."""
    from wandb.proto import wandb_internal_pb2

    data, pos, part, rows = run_file.read_bytes(), 7, b"", []
    assert data[:4] == b":W&B", run_file
    while pos + 7 <= len(data):
        left = 32768 - pos % 32768
        length, kind = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6]
        if left < 7 or (kind == 0 and length == 0):  # a block's zero padding
            pos += left
            continue
        part, pos = part + data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind in (1, 4):  # a full record, or the last fragment of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(part)
            part = b""
            if record.WhichOneof("record_type") == "history":
                rows.append({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item})
    return rows


@pytest.mark.loggers
def test_memory_reaches_every_logger_ultralytics_ships(detect_data, tmp_path, monkeypatch):
    """MLflow, Weights & Biases, ClearML, Comet and DVC (dvclive), each installed and run offline, log
    ``mem/peak_tensor_GB`` under that one name through Ultralytics' own callbacks, with results.csv's value for each
    epoch and for the final evaluation, read back from what each wrote on disk. TensorBoard: above.

    It needs the ``loggers`` extra and is deselected otherwise (``-m "not loggers"`` in pyproject.toml's addopts):
    Ultralytics turns ClearML, Comet, DVC and MLflow on by default, so that installed beside the suite they would log
    every run trained outside pytest. CI installs them in a venv of their own and runs this test there (.ci/run).
    """
    missing = [name for name in LOGGERS if importlib.util.find_spec(name) is None]
    if missing:
        pytest.fail(f"needs the loggers extra: python -m pip install -e '.[loggers]' (missing: {missing})", False)
    import matplotlib
    from mlflow.tracking import MlflowClient

    (tmp_path / "clearml.conf").write_text("sdk.development.report_use_subprocess: false\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST"}  # Ultralytics' loggers are off in tests
    env.update(
        YOLO_CONFIG_DIR=str(tmp_path / "config"), YOLO_OFFLINE="1",
        # the yolo_ckpt imported here, from a cwd of the run's own (CI's loggers venv reads the suite's packages
        # through a .pth line, which does not run the suite venv's editable-install hook)
        PYTHONPATH=os.pathsep.join([str(Path(yolo_ckpt.__file__).parents[1]), *filter(None, [env.get("PYTHONPATH")])]),
        HOME=str(tmp_path / "home"), MPLCONFIGDIR=matplotlib.get_configdir(),  # wandb, ClearML, MLflow write under ~
        WANDB_MODE="offline",
        MLFLOW_TRACKING_URI=(tmp_path / "mlruns").as_uri(), MLFLOW_ALLOW_FILE_STORE="true",  # else refused
        MLFLOW_DISABLE_TELEMETRY="true",
        # a reporting thread, not a subprocess: closing the task took 11 s waiting on the subprocess
        CLEARML_OFFLINE_MODE="1", CLEARML_CONFIG_FILE=str(tmp_path / "clearml.conf"),
        # Comet's MLflow patch would open a second experiment at mlflow.start_run, ending Ultralytics' own
        COMET_START_ONLINE="0", COMET_DISABLE_AUTO_LOGGING="1", COMET_OFFLINE_DIRECTORY=str(tmp_path / "comet"),
    )
    out = subprocess.run([sys.executable, "-c", LOGGER_RUN, detect_data, str(tmp_path)], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=600)  # cwd: dvclive writes ./dvclive
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    key = "mem/peak_tensor_GB"
    csv = [float(r[key]) for r in results(tmp_path / "r")]
    assert len(csv) == 2 and all(v > 0 for v in csv)
    final = [*csv, csv[-1]]  # each epoch's, then the final evaluation's (it carries the last epoch's peak)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    mlflow = MlflowClient((tmp_path / "mlruns").as_uri())
    (run,) = mlflow.search_runs([mlflow.get_experiment_by_name(str(tmp_path)).experiment_id])
    # (step, value) in the order logged, each logger's step as it counts them
    logged = {"mlflow": [(m.step, m.value) for m in mlflow.get_metric_history(run.info.run_id, key)]}
    (run_file,) = (tmp_path / "r" / "wandb").glob("offline-run-*/run-*.wandb")
    logged["wandb"] = [(row["epoch"], row[key]) for row in wandb_history(run_file) if key in row]
    (session,) = (tmp_path / "home" / ".clearml" / "cache" / "offline").glob("offline-*/metrics.jsonl")
    events = [e for line in session.read_text().splitlines() for e in json.loads(line) if e.get("variant") == key]
    assert {e["metric"] for e in events} == {"mem"}  # ClearML's title: the key up to its first "/"
    logged["clearml"] = [(e["iter"], e["value"]) for e in events]
    (archive,) = (tmp_path / "comet").glob("*.zip")  # one experiment
    with zipfile.ZipFile(archive) as z:
        metrics = [json.loads(m)["payload"].get("metric") for m in z.read("messages.json").splitlines()]
    logged["comet"] = [(m["epoch"], float(m["metricValue"])) for m in metrics if m and m["metricName"] == key]
    with open(tmp_path / "dvclive" / "plots" / "metrics" / "mem" / "peak_tensor_GB.tsv") as f:  # per epoch only
        logged["dvc"] = [(int(r["step"]), float(r["peak_tensor_GB"])) for r in csvlib.DictReader(f, delimiter="\t")]
    summary = json.loads((tmp_path / "dvclive" / "metrics.json").read_text())["mem"]["peak_tensor_GB"]
    assert summary == pytest.approx(final[-1], rel=1e-5)  # dvclive's summary: the final evaluation's metrics
    for name, first in (("mlflow", 0), ("wandb", 1), ("clearml", 0), ("comet", 1), ("dvc", 0)):
        expected = final if name != "dvc" else csv
        steps, values = zip(*logged[name]) if logged[name] else ((), ())
        assert list(steps) == list(range(first, first + len(expected))), (name, logged[name])  # once each, in order
        assert list(values) == pytest.approx(expected, rel=1e-5), (name, logged[name], csv)


def test_a_users_callback_reads_this_epochs_memory(detect_data, tmp_path):
    """Our callbacks run ahead of a user's of the same event: a user's ``on_train_epoch_end`` reads this epoch's peak
    in ``trainer.metrics`` (the value results.csv then holds for that epoch) at every epoch, and every
    ``on_fit_epoch_end``, the final evaluation's included, carries the epoch's and the validation's peaks.

    The run is eager with the meter a compiled CPU run gets (allocation records of one sampled step), so that the
    exact tracker can measure the same step beside it, from the end of the step before to the end of the sampled
    one, every tensor of the run counted: the two agree within 2% (the profiler also sees kernels' scratch)."""
    from yolo_ckpt.integration.epoch_memory import SAMPLED_STEP, held_state

    seen, fit, exact = [], [], []
    tracker, steps = LiveTensorTracker(), [0]

    def start(trainer):  # after ours: the meter samples, the reference tracks everything alive
        steps[0] = 0
        tracker.track(held_state(trainer))
        tracker.__enter__()

    def step_end(trainer):
        steps[0] += 1
        if steps[0] == SAMPLED_STEP - 1:
            tracker.reset_peak()
        elif steps[0] == SAMPLED_STEP:
            exact.append(tracker.peak)

    model = YOLO("yolo11n.yaml")
    model.add_callback("on_pretrain_routine_end", lambda t: setattr(t.run_memory, "meter",
                                                                    EpochPeak(t.device, compiled=True)))
    model.add_callback("on_train_epoch_start", start)
    model.add_callback("on_train_batch_end", step_end)
    model.add_callback("on_train_epoch_end", lambda t: tracker.__exit__(None, None, None))
    model.add_callback("on_train_epoch_end", lambda t: seen.append(t.metrics.get("mem/peak_tensor_GB")))
    model.add_callback("on_fit_epoch_end", lambda t: fit.append(dict(t.metrics)))
    model.train(data=detect_data, project=str(tmp_path), checkpoint_stages=[2, 3],
                **{**TRAIN_ARGS, "epochs": 2, "imgsz": 64})
    rows = results(model.trainer.save_dir)
    assert len(seen) == len(rows) == 2 and all(x is not None for x in seen), seen
    assert seen == pytest.approx([float(r["mem/peak_tensor_GB"]) for r in rows], rel=1e-4)
    assert len(fit) == 3  # two epochs, then the final evaluation
    assert all(f["mem/peak_tensor_GB"] > 0 and f["mem/val_peak_tensor_GB"] > 0 for f in fit), fit
    assert len(exact) == 2 and all(e <= s * GB <= 1.02 * e for e, s in zip(exact, seen)), (exact, seen)


@needs_cuda
def test_cuda_epochs():
    meter = EpochPeak("cuda")
    assert meter.tracker is None
    dev = torch.device("cuda", torch.cuda.current_device())
    base = torch.cuda.memory_allocated(dev)
    meter.start()
    a = torch.empty(2**20, device=dev)
    b = a + 1
    del a, b
    stats = meter.stop()
    assert set(stats) == {"mem/peak_alloc_GB", "mem/peak_reserved_GB"}
    assert stats["mem/peak_alloc_GB"] == (base + 8 * 2**20) / GB
    assert stats["mem/peak_reserved_GB"] >= stats["mem/peak_alloc_GB"]


@pytest.mark.parametrize("n", [1, 3, 40])
def test_memory_plot_ticks_whole_epochs_only(n):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    from yolo_ckpt.report.plots import epoch_ticks

    fig, ax = plt.subplots()
    epochs = np.arange(1, n + 1, dtype=float)
    ax.plot(epochs, epochs)
    epoch_ticks(ax, epochs)
    fig.canvas.draw()
    lo, hi = ax.get_xlim()
    ticks = [t for t in ax.get_xticks() if lo <= t <= hi]
    assert lo < 1 and hi > n and 1 <= len(ticks) <= max(n, 1) and all(float(t).is_integer() for t in ticks)
    plt.close(fig)
