"""Checkpointed training against vanilla Ultralytics training: bit for bit, same files, same resume."""

import pickletools
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch
import ultralytics
from torch.utils._python_dispatch import _get_current_dispatch_mode
from ultralytics.utils.patches import torch_load

from conftest import TRAIN_ARGS, results
from yolo_ckpt import TRAINERS, YOLO, checkpoint_plan


def train_pair(model: str, stages, data: str, project: Path, **kw):
    """Train vanilla Ultralytics and yolo_ckpt with the same arguments; return both YOLO objects."""
    args = {**TRAIN_ARGS, "data": data, "project": str(project), "save_period": 1, **kw}
    vanilla = ultralytics.YOLO(model)
    vanilla.train(name="vanilla", **args)
    ckpt = ultralytics.YOLO(model)
    ckpt.train(trainer=TRAINERS[ckpt.task], name="ckpt", checkpoint_stages=stages, **args)
    return vanilla, ckpt


def assert_same_tensors(a, b, where: str):
    """Every tensor reachable in two checkpoint objects (modules by state_dict, dicts by key) is bitwise equal."""
    if isinstance(a, torch.nn.Module):
        a, b = a.state_dict(), b.state_dict()
        assert list(a) == list(b), where
    if isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            assert_same_tensors(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same_tensors(x, y, f"{where}[{i}]")
    elif isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a, b), where


def assert_same_training(vanilla, ckpt):
    v_dir, c_dir = Path(vanilla.trainer.save_dir), Path(ckpt.trainer.save_dir)
    ours = [{k: row[k] for k in base} for row, base in zip(results(c_dir), results(v_dir))]  # + our memory columns
    assert ours == results(v_dir)  # every loss and metric of every epoch
    # the live training model: weights and BatchNorm running_mean / running_var / num_batches_tracked
    assert_same_tensors(vanilla.trainer.model, ckpt.trainer.model, "model")
    files = sorted(p.name for p in (v_dir / "weights").glob("*.pt"))
    assert files == sorted(p.name for p in (c_dir / "weights").glob("*.pt")) and len(files) >= 3
    for name in files:  # epochN.pt keep EMA, optimizer and updates; last/best are Ultralytics-stripped
        v, c = (torch_load(d / "weights" / name, map_location="cpu") for d in (v_dir, c_dir))
        for key in ("model", "ema", "optimizer", "updates", "epoch", "best_fitness"):
            assert_same_tensors(v[key], c[key], f"{name}:{key}")


def test_yolo11n_all_stages_bitwise_equal_to_vanilla(detect_data, tmp_path):
    vanilla, ckpt = train_pair("yolo11n.yaml", "all", detect_data, tmp_path)
    assert checkpoint_plan(ckpt.trainer.model).stages == [1, 2, 3, 4, 5]  # the plan really ran
    assert_same_training(vanilla, ckpt)


def test_yolov8n_stages_2_3_bitwise_equal_to_vanilla(detect_data, tmp_path):
    vanilla, ckpt = train_pair("yolov8n.yaml", [2, 3], detect_data, tmp_path)
    assert checkpoint_plan(ckpt.trainer.model).stages == [2, 3]
    assert_same_training(vanilla, ckpt)


@pytest.mark.parametrize("task, model", [("segment", "yolo11n-seg.yaml"), ("pose", "yolo26n-pose.yaml"),
                                         ("obb", "yolo11n-obb.yaml"), ("classify", "yolov8n-cls.yaml")])
def test_task_trainers_train_like_vanilla(task, model, tmp_path):
    from yolo_ckpt.synthetic import synthetic_dataset

    data = str(synthetic_dataset(task))
    imgsz = 64 if task == "classify" else 256
    vanilla, ckpt = train_pair(model, "all", data, tmp_path, epochs=1, imgsz=imgsz)
    assert isinstance(ckpt.trainer, TRAINERS[task])
    assert checkpoint_plan(ckpt.trainer.model).regions
    assert_same_training(vanilla, ckpt)


@pytest.fixture(scope="module")
def finished_run(detect_data, tmp_path_factory):
    model = YOLO("yolo11n.yaml")
    model.train(data=detect_data, project=str(tmp_path_factory.mktemp("runs")), name="run", checkpoint_stages=[2, 3],
                **{**TRAIN_ARGS, "epochs": 2, "plots": True})
    return Path(model.trainer.save_dir)


def test_memory_per_epoch_in_results_and_plot(finished_run):
    rows = results(finished_run)
    assert len(rows) == 2 and all(float(r["mem/peak_tensor_GB"]) > 0 for r in rows)
    weights = sum(t.numel() * t.element_size() for t in ultralytics.YOLO("yolo11n.yaml").model.state_dict().values())
    assert all(float(r["mem/peak_tensor_GB"]) * 2**30 > weights for r in rows)  # weights are counted, and more
    png = finished_run / "memory.png"
    assert png.read_bytes()[:4] == b"\x89PNG" and (finished_run / "results.png").exists()


def test_memory_column_shows_the_saving(detect_data, tmp_path):
    """The same run measured with the exact tracker: all stages checkpointed peaks well below no checkpointing."""
    peaks = {}
    for stages in ([], "all"):
        model = YOLO("yolo11n.yaml")
        model.train(data=detect_data, project=str(tmp_path), name=str(stages), checkpoint_stages=stages,
                    **{**TRAIN_ARGS, "epochs": 1, "imgsz": 640, "val": False})
        peaks[str(stages)] = float(results(Path(model.trainer.save_dir))[0]["mem/peak_tensor_GB"])
    assert 0 < peaks["all"] <= 0.6 * peaks["[]"], peaks


def test_saved_files_are_plain_ultralytics(finished_run, detect_data, tmp_path):
    for name in ("last.pt", "best.pt"):
        with zipfile.ZipFile(finished_run / "weights" / name) as z:
            pkl = next(n for n in z.namelist() if n.endswith("data.pkl"))
            classes = {arg for op, arg, _ in pickletools.genops(z.read(pkl)) if op.name == "GLOBAL"}
        assert classes and not any(c.startswith("yolo_ckpt") for c in classes), name
    vanilla = ultralytics.YOLO("yolo11n.yaml").model.state_dict()
    saved = torch_load(finished_run / "weights" / "last.pt")["model"].state_dict()
    assert list(saved) == list(vanilla)
    # Load, validate, predict, export and fine-tune in a fresh interpreter where yolo_ckpt cannot be imported, with safe loading on.
    image = next((Path(detect_data).parent / "images" / "val").iterdir())
    code = f"""
import sys
sys.modules["yolo_ckpt"] = None  # any pickled reference to our package would fail to import
from ultralytics import YOLO
m = YOLO(r"{finished_run / 'weights' / 'best.pt'}")
metrics = m.val(data=r"{detect_data}", imgsz=320, batch=4, device="cpu", plots=False, project=r"{tmp_path}")
boxes = m.predict(r"{image}", imgsz=320, device="cpu")[0].boxes
exported = YOLO(r"{finished_run / 'weights' / 'best.pt'}").export(format="torchscript", imgsz=64)
tuned = YOLO(r"{finished_run / 'weights' / 'last.pt'}")
tuned.train(data=r"{detect_data}", epochs=1, imgsz=64, batch=4, workers=0, device="cpu", plots=False, val=False,
            project=r"{tmp_path}", name="finetune")
print("OK", metrics.box.map50 >= 0, len(boxes) >= 0, exported.endswith(".torchscript"))
"""
    env = {**__import__("os").environ, "ULTRALYTICS_SAFE_LOAD": "1", "YOLO_OFFLINE": "1"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0 and "OK True True True" in out.stdout, out.stderr[-2000:]


def test_settings_are_recorded(finished_run):
    import yaml

    assert yaml.safe_load((finished_run / "args.yaml").read_text())["checkpoint_stages"] == [2, 3]
    assert torch_load(finished_run / "weights" / "last.pt")["model"].args["checkpoint_stages"] == [2, 3]


def test_resume_continues_with_the_same_stages(detect_data, tmp_path):
    class Interrupt(Exception):
        pass

    def stop_after_first_epoch(trainer):
        raise Interrupt  # after save_model: last.pt is an unfinished, resumable checkpoint

    model = YOLO("yolo11n.yaml")
    model.add_callback("on_fit_epoch_end", stop_after_first_epoch)
    with pytest.raises(Interrupt):
        model.train(data=detect_data, project=str(tmp_path), name="run", checkpoint_stages=[2, 3], **TRAIN_ARGS)
    last = tmp_path / "run" / "weights" / "last.pt"
    assert torch_load(last)["train_args"]["checkpoint_stages"] == [2, 3]
    out = subprocess.run([sys.executable, "-m", "yolo_ckpt", "train", "resume", f"model={last}"],
                         capture_output=True, text=True, timeout=600)
    log = out.stdout + out.stderr
    assert out.returncode == 0, log[-3000:]
    assert "Resuming training" in log and "stage 2 (P2/4) layers [1, 2]" in log and "stage 3 (P3/8)" in log
    assert "epoch 2 peak" in log and "GB live tensor bytes (exact, CPU)" in log  # the per-epoch memory line
    assert len(results(tmp_path / "run")) == TRAIN_ARGS["epochs"]


def test_tracker_does_not_outlive_a_crash(detect_data, tmp_path):
    def crash(trainer):
        raise RuntimeError("crash during the epoch's training steps, while memory is being measured")

    model = YOLO("yolo11n.yaml")
    model.add_callback("on_train_batch_end", crash)
    with pytest.raises(RuntimeError, match="crash during"):
        model.train(data=detect_data, project=str(tmp_path), **{**TRAIN_ARGS, "epochs": 1, "imgsz": 64})
    assert _get_current_dispatch_mode() is None
