"""Checkpointed training against vanilla Ultralytics training: bit for bit, same files, same resume."""

import copy
import functools
import os
import pickletools
import re
import subprocess
import sys
import zipfile
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import ultralytics
from ultralytics.utils.patches import torch_load

from yolo_ckpt import YOLO, CheckpointPlan, checkpoint_plan
from yolo_ckpt.integration.settings import CKPT_CFG_DICT, saved_settings
from yolo_ckpt.memory.step import StepShape

from support import (
    TRAIN_ARGS,
    assert_recomputed,
    assert_same_run,
    assert_same_training,
    forward_counts,
    results,
    run_differences,
    train_pair,
    train_run,
    write_depth_set,
    write_polygon_set,
)

BLOCKED = """
import sys
sys.modules["yolo_ckpt"] = None  # any pickled reference to our package, or any use of it, fails
"""
SAFE = {**os.environ, "ULTRALYTICS_SAFE_LOAD": "1", "YOLO_OFFLINE": "1"}
HALF = {"epochs": 1, "fraction": 0.5}  # one epoch on 8 of the 16 training images: two optimizer steps at batch 4


@pytest.fixture(scope="module")
def yolo11n_vanilla(detect_data, tmp_path_factory) -> Path:
    """Vanilla yolo11n, one epoch at ``TRAIN_ARGS`` (forwards counted): the reference of the yolo11n plans below,
    trained once; each plan's run goes into its project (a pair's runs differ only in name). Half the set
    (``HALF``): two optimizer steps prove what four did."""
    return train_run("yolo11n.yaml", detect_data, tmp_path_factory.mktemp("yolo11n"), "vanilla", **HALF)


def test_yolo11n_whole_network_bitwise_equal_to_vanilla(detect_data, yolo11n_vanilla):
    """All stages and the head: every layer that stores activations is recomputed (Upsample/Concat store none)."""
    assert len(CheckpointPlan.from_spec("yolo11n.yaml", "all", "head").layer_regions) == 7
    ours = {"checkpoint_stages": "all", "checkpoint_mode": "full", "checkpoint_layers": "head"}  # as train_pair
    ckpt = train_run("yolo11n.yaml", detect_data, yolo11n_vanilla.parent, "whole", ours, **HALF)
    assert_same_training("yolo11n.yaml", "all", yolo11n_vanilla, ckpt, layers="head")


def test_yolov8n_stages_2_3_and_head_ranges_selective_bitwise_equal_to_vanilla(detect_data, tmp_path):
    """Ranges whose layers read tensors from before the region (Concat of layer 6, of layer 12) and from inside it."""
    layers = [[10, 12], [16, 18], 22]
    pair = train_pair("yolov8n.yaml", [2, 3], detect_data, tmp_path, mode="selective", layers=layers, **HALF)
    assert_same_training("yolov8n.yaml", [2, 3], *pair, layers=layers)


def test_yolo11n_all_selective_bitwise_equal_to_vanilla(detect_data, yolo11n_vanilla):
    """The whole backbone selective: what the cost rule keeps beyond convolutions (SPPF's pooling windows, C2PSA's
    long-inner-dimension matmul) and what it recomputes (BatchNorm, SiLU, the cheap convolutions, QK^T)."""
    ours = {"checkpoint_stages": "all", "checkpoint_mode": "selective", "checkpoint_layers": None}
    ckpt = train_run("yolo11n.yaml", detect_data, yolo11n_vanilla.parent, "selective", ours, **HALF)
    assert_same_training("yolo11n.yaml", "all", yolo11n_vanilla, ckpt)


@pytest.mark.parametrize("task, model", [("segment", "yolo11n-seg.yaml"), ("pose", "yolo26n-pose.yaml"),
                                         ("obb", "yolo11n-obb.yaml"), ("classify", "yolov8n-cls.yaml"),
                                         ("semantic", "yolo26n-sem.yaml")])
def test_task_trainers_train_like_vanilla(task, model, tmp_path, small_data):
    """On the embedded dataset of each task (semantic: its PNG masks with label_mapping). Depth: the same model,
    plan, size and loader on the maps written below (``test_semantic_and_depth_train_like_vanilla_on_foreign_data``)."""
    data = small_data(task)
    imgsz = {"classify": 64, "semantic": 128, "depth": 128}.get(task, 256)
    pair = train_pair(model, "all", data, tmp_path, epochs=1, imgsz=imgsz, fraction=0.5)  # 2 optimizer steps
    assert_same_training(model, "all", *pair)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_trainer_bitwise_equal_to_vanilla(detect_data, tmp_path):
    """On CUDA, with Ultralytics' deterministic=True (deterministic algorithms and cuDNN) and its default fp16 AMP
    (autocast, GradScaler, channels_last): all stages recomputed, the same run bit for bit. A failure lists every
    tensor that differs and by how much, beside what differs between two vanilla runs (CUDA's own run-to-run noise)."""
    kw = dict(epochs=1, imgsz=256, device=0)
    vanilla, ckpt = train_pair("yolo11n.yaml", "all", detect_data, tmp_path, **kw)
    if diffs := run_differences(vanilla, ckpt):
        again = run_differences(vanilla, train_run("yolo11n.yaml", detect_data, tmp_path, "vanilla_again", **kw))
        pytest.fail("checkpointed vs vanilla:\n" + "\n".join(diffs) + "\nvanilla vs vanilla again:\n" +
                    ("\n".join(again) or "bitwise equal"), pytrace=False)
    assert_same_training("yolo11n.yaml", "all", vanilla, ckpt)


EXTERNAL = {"yolo26n-sem.yaml": write_polygon_set, "yolo26n-depth.yaml": write_depth_set}


@pytest.fixture(scope="module")
def foreign_vanilla(tmp_path_factory):
    """``foreign_vanilla(model)``: the set written for ``model`` (``EXTERNAL``) and vanilla's run on it at 128 px
    (forwards counted), once per model: the reference of each of its plans below, whose runs go into its project (a
    pair's runs differ only in name)."""
    @functools.cache
    def run(model: str) -> tuple[str, Path]:
        project = tmp_path_factory.mktemp(Path(model).stem)
        data = EXTERNAL[model](project / "data", size=128, images={"train": 6, "val": 2})
        return data, train_run(model, data, project, "vanilla", imgsz=128)

    return run


@pytest.mark.parametrize("model, stages, mode, layers", [
    ("yolo26n-sem.yaml", "all", "full", None),
    ("yolo26n-sem.yaml", [2, 3], "selective", None),
    ("yolo26n-depth.yaml", "all", "full", None),
    ("yolo26n-depth.yaml", [], "full", "head"),  # the depth head (layers 13-23) alone
])
def test_semantic_and_depth_train_like_vanilla_on_foreign_data(model, stages, mode, layers, foreign_vanilla):
    """Semantic segmentation on YOLO polygons and depth on uint16 PNG maps, both written here with numpy/cv2 (not by
    yolo_ckpt), train bit for bit as vanilla Ultralytics; the weights load in plain Ultralytics with safe loading."""
    data, vanilla = foreign_vanilla(model)
    ours = {"checkpoint_stages": stages, "checkpoint_mode": mode, "checkpoint_layers": layers}  # as train_pair
    ckpt = train_run(model, data, vanilla.parent, re.sub(r"\W", "", f"ckpt{stages}{mode}{layers}"), ours, imgsz=128)
    pair = vanilla, ckpt
    assert_same_training(model, stages, *pair, layers=layers)
    task = ultralytics.YOLO(model).task
    image = next((Path(data).parent / "images" / "val").iterdir())
    code = BLOCKED + f"""
from ultralytics import YOLO
m = YOLO(r"{pair[1] / 'weights' / 'best.pt'}")
r = m.predict(r"{image}", imgsz=128, device="cpu")[0]
print("OK", m.task, r.orig_shape)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=SAFE, timeout=300)
    assert out.returncode == 0 and f"OK {task} (128, 128)" in out.stdout, out.stderr[-2000:]


@pytest.fixture(scope="module")
def finished_run(detect_data, tmp_path_factory):
    model = YOLO("yolo11n.yaml")
    model.train(data=detect_data, project=str(tmp_path_factory.mktemp("runs")), name="run", checkpoint_stages=[2, 3],
                **{**TRAIN_ARGS, "epochs": 2, "plots": True, "fraction": 0.5})  # two steps an epoch
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
                    **{**TRAIN_ARGS, "epochs": 1, "imgsz": 480, "val": False, "fraction": 0.25})  # a step's peak:
        # one batch of 4 of the 16 images shows it as four do
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
    # Load, validate, predict, export and fine-tune in a fresh interpreter where yolo_ckpt cannot be imported,
    # with safe loading on.
    image = next((Path(detect_data).parent / "images" / "val").iterdir())
    code = BLOCKED + f"""
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
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=SAFE, timeout=300)
    assert out.returncode == 0 and "OK True True True" in out.stdout, out.stderr[-2000:]


def test_settings_are_recorded(finished_run):
    import yaml

    assert yaml.safe_load((finished_run / "args.yaml").read_text())["checkpoint_stages"] == [2, 3]
    assert torch_load(finished_run / "weights" / "last.pt")["model"].args["checkpoint_stages"] == [2, 3]


class Interrupt(Exception):
    """Raised after an epoch's checkpoint is written: last.pt is then an unfinished, resumable checkpoint."""


def interrupted_run(data: str, project: Path, **kw) -> tuple[YOLO, Path]:
    """A yolo-ckpt run (stages [2,3]) that fails after its first epoch; return the model object and its last.pt."""
    def stop(trainer):
        raise Interrupt

    model = YOLO("yolo11n.yaml")
    model.add_callback("on_fit_epoch_end", stop)
    with pytest.raises(Interrupt):
        model.train(data=data, project=str(project), name="run", checkpoint_stages=[2, 3],
                    **{**TRAIN_ARGS, "imgsz": 160, **kw})
    return model, project / "run" / "weights" / "last.pt"


def test_resume_continues_with_the_same_stages(detect_data, tmp_path):
    parts = ["4.*", "23.cv2.0:selective"]  # regions inside layers too, one nested in stage 3
    _, last = interrupted_run(detect_data, tmp_path, checkpoint_layers=parts, checkpoint_loss="chunked")
    ckpt = torch_load(last)
    assert not set(CKPT_CFG_DICT) & set(ckpt["train_args"])  # what plain Ultralytics validates on resume
    assert saved_settings(ckpt)["checkpoint_stages"] == [2, 3] and saved_settings(ckpt)["checkpoint_layers"] == parts
    assert saved_settings(ckpt)["checkpoint_loss"] == "chunked"
    out = subprocess.run([sys.executable, "-m", "yolo_ckpt", "train", "resume", f"model={last}"],
                         capture_output=True, text=True, timeout=600)
    log = out.stdout + out.stderr
    assert out.returncode == 0, log[-3000:]
    assert "Resuming training" in log and "stage 2 (P2/4) layers [1, 2]" in log and "stage 3 (P3/8)" in log
    for part in ("cv1", "m.0", "cv2"):  # each its own region, inside the one region of stages 2 and 3
        assert f"layer 4 (C3k2) part {part}, nested in the region of layers [1, 2, 3, 4]" in log
    assert "layer 23 (Detect) part cv2.0, selective" in log
    assert "checkpoint_loss=chunked: this run is NOT bitwise vanilla Ultralytics" in log  # the loss plan came back
    assert "epoch 2 peak" in log and "GB live tensor bytes (exact, CPU)" in log  # the per-epoch memory line
    assert len(results(tmp_path / "run")) == TRAIN_ARGS["epochs"]


def test_plain_yolo_resumes_an_interrupted_run(detect_data, tmp_path):
    """`yolo train resume` of an unfinished yolo-ckpt run finishes it as plain training, without yolo_ckpt."""
    _, last = interrupted_run(detect_data, tmp_path)
    code = BLOCKED + f"from ultralytics.cfg import entrypoint\nentrypoint('yolo train resume model={last}')\n"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=SAFE, timeout=600)
    log = out.stdout + out.stderr
    assert out.returncode == 0, log[-3000:]
    assert "Resuming training" in log and "checkpoint:" not in log
    rows = results(tmp_path / "run")
    assert [r["epoch"] for r in rows] == ["1", "2"]
    assert rows[0]["mem/peak_tensor_GB"] and not rows[1]["mem/peak_tensor_GB"]  # epoch 2 trained plainly


def test_failed_training_leaves_nothing_of_ours(detect_data, tmp_path):
    """After a crash, YOLO.model is plain: saving it, or what the run saved, needs no yolo_ckpt to load."""
    model, last = interrupted_run(detect_data, tmp_path)
    assert checkpoint_plan(model.model) is None
    tuned = YOLO(str(last))  # a .pt fine-tune that fails in its first step

    def crash(trainer):
        raise RuntimeError("crash in the first training step")

    tuned.add_callback("on_train_batch_end", crash)
    with pytest.raises(RuntimeError, match="crash in the first"):
        tuned.train(data=detect_data, project=str(tmp_path), name="tune", checkpoint_stages="all",
                    checkpoint_layers=["2.*", "23.*"], **{**TRAIN_ARGS, "epochs": 1, "imgsz": 64})  # parts too
    assert checkpoint_plan(tuned.model) is None
    assert not any("forward" in vars(m) for m in tuned.model.modules())  # no part keeps a forward of ours
    model.save(tmp_path / "yaml_after_crash.pt")
    tuned.save(tmp_path / "pt_after_crash.pt")
    files = [tmp_path / "yaml_after_crash.pt", tmp_path / "pt_after_crash.pt", last]
    code = BLOCKED + f"from ultralytics import YOLO\nfor f in {[str(f) for f in files]!r}:\n    YOLO(f)\nprint('OK')\n"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=SAFE, timeout=300)
    assert out.returncode == 0 and "OK" in out.stdout, out.stderr[-2000:]


def test_frozen_stages_are_not_recomputed(detect_data, tmp_path):
    """freeze=3 freezes layers 0-2 behind the image: stages 1 and 2 store nothing, so only stages 3-5 recompute."""
    vanilla, ckpt = train_pair("yolo11n.yaml", "all", detect_data, tmp_path, **HALF, imgsz=160, freeze=3)
    assert_recomputed(forward_counts(vanilla), forward_counts(ckpt), set(range(3, 11)))
    assert_same_run(vanilla, ckpt)


@pytest.mark.parametrize("device, cuda", [
    ("cpu", False), ("mps", False), ("mps:0", False), ("xpu:0", False), ("npu:0", False), ("npu", False),
    ("tpu", False), ("0", True), ("0,1", True), ("[0, 1]", True), ("cuda", True), ("cuda:1", True), ("-1", True),
    (0, True), ([0, 1], True),
])
def test_the_training_device_decides_cuda(device, cuda, monkeypatch):
    """The device strings Ultralytics' ``select_device`` takes (8.4.190: cpu, mps, npu, xpu, tpu pass to their own
    backends; indices, ``cuda``/``cuda:N`` and ``-1`` to CUDA); no device: CUDA when the machine has it."""
    from yolo_ckpt.integration.settings import trains_on_cuda

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert trains_on_cuda(device) is cuda
    assert trains_on_cuda(None) and trains_on_cuda("")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert not trains_on_cuda(None) and trains_on_cuda(device) is cuda


def test_a_rank_0_planning_failure_reaches_every_rank(monkeypatch):
    """Under DDP rank 0 plans and broadcasts its decision; an error of any kind there (not only a settings error) is
    broadcast before rank 0 raises it, so the other ranks stop with a line naming it instead of waiting in the
    broadcast until the collective times out (torch.distributed mocked: rank 0's broadcast is what rank 1 gets)."""
    import torch.distributed as dist

    from yolo_ckpt.integration import memory_hooks as rp
    from yolo_ckpt.integration.run_memory import RunMemory

    sent = []

    def broadcast(box, src):
        if rp.RANK == 0:
            sent.append(box[0])
        else:
            box[0] = sent[-1]

    def decide(*args):
        raise KeyError("sem_masks")

    monkeypatch.setattr(dist, "broadcast_object_list", broadcast)
    monkeypatch.setattr(dist, "get_rank", lambda: rp.RANK)
    monkeypatch.setattr(rp, "decide", decide)
    monkeypatch.setattr(rp, "smallest_device", lambda device: None)  # a collective: every rank reads its device
    fake = SimpleNamespace(model=torch.nn.Linear(1, 1), device=torch.device("cpu"), run_memory=RunMemory())
    monkeypatch.setattr(rp, "RANK", 0)
    with pytest.raises(KeyError, match="sem_masks"):
        rp.auto_plan(fake, 1)
    assert sent == [{"failed": "KeyError: 'sem_masks'"}]
    monkeypatch.setattr(rp, "RANK", 1)
    with pytest.raises(RuntimeError, match=r"rank 0 failed while planning \(KeyError: 'sem_masks'\)"):
        rp.auto_plan(fake, 1)


def test_the_cuda_confirmation_step_treats_out_of_memory_as_does_not_fit(monkeypatch):
    """``auto``'s confirming step on CUDA runs where the allocator may need more than the tensor bytes planned: its
    out-of-memory error is a log line, never the run's end (torch.cuda mocked; the step raises CUDA's error)."""
    from ultralytics.nn.tasks import DetectionModel

    from yolo_ckpt.integration import auto as rp
    from yolo_ckpt.memory.device import DeviceMemory
    from yolo_ckpt.regions.settings import PlanSettings

    from support import MINI

    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(rp, "device_memory", lambda device: DeviceMemory(2**30, 2**30, 2**30, 1.1, "cuda:0"))
    for name in ("synchronize", "reset_peak_memory_stats", "empty_cache"):
        monkeypatch.setattr(torch.cuda, name, lambda *args: None)
    monkeypatch.setattr(rp, "step_loss", out_of_memory)
    model = DetectionModel(copy.deepcopy(MINI), verbose=False).train()
    line = rp.confirm_on_cuda(torch.device("cuda", 0), 2**20, model, PlanSettings.of([1]), StepShape(64, 2, 10))
    assert "ran out of memory when confirmed" in line


def test_ddp_plans_for_the_rank_whose_gpu_has_the_least_memory(monkeypatch):
    """Under DDP each rank reads its own GPU and rank 0 plans for the smallest: another rank's GPU may have less free
    than rank 0's (torch.distributed and the CUDA reading mocked: rank 0 holds 70 GB usable, rank 1 30 GB)."""
    import torch.distributed as dist

    from yolo_ckpt.integration import run_memory as rp
    from yolo_ckpt.memory.device import DeviceMemory

    mine = DeviceMemory(80 * 2**30, 70 * 2**30, 70 * 2**30, 1.1, "cuda:0")
    other = DeviceMemory(80 * 2**30, 30 * 2**30, 30 * 2**30, 1.1, "cuda:1")

    def gather(out, obj):
        out[0], out[1] = obj, other

    monkeypatch.setattr(rp, "device_memory", lambda device: mine)
    monkeypatch.setattr(dist, "get_world_size", lambda: 2)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "all_gather_object", gather)
    cuda, memory = torch.device("cuda", 0), rp.RunMemory()
    assert memory.aim(cuda, None, 0.6).budget == int(70 * 2**30 / 1.1)  # one process: its own GPU
    memory.device = rp.smallest_device(cuda)
    target = memory.aim(cuda, None, 0.6)
    assert target.budget == int(30 * 2**30 / 1.1) and target.fraction == 0.6 and target.source == "cuda:1 usable memory"
    assert memory.target == target.share == int(0.6 * target.budget)


def test_distillation_recomputes_the_students_plan_and_trains_like_vanilla_distillation(detect_data, tmp_path):
    """Knowledge distillation (``distill_model=``: Ultralytics wraps the student in its ``DistillationModel`` once the
    student is built): the plan is the student's, recomputed in every step (forward counts), memory measured, and the
    run is vanilla distillation's bit for bit; last.pt loads in plain Ultralytics with safe loading where yolo_ckpt
    cannot be imported, its student plain."""
    teacher = tmp_path / "teacher.pt"
    ultralytics.YOLO("yolo11n.yaml").save(teacher)
    pair = train_pair("yolo11n.yaml", [2, 3], detect_data, tmp_path, **HALF, imgsz=128, distill_model=str(teacher))
    assert_same_training("yolo11n.yaml", [2, 3], *pair)
    code = BLOCKED + f"""
from ultralytics.utils.patches import torch_load
ckpt = torch_load(r"{pair[1] / 'weights' / 'last.pt'}")
model = ckpt.get("ema") or ckpt["model"]  # stripped: the EMA's weights saved as the model
student = getattr(model, "student_model", model)
shadows = sorted(k for k, v in vars(student).items() if callable(v) and not hasattr(v, "forward"))
print("OK", type(model).__name__, shadows)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=SAFE, timeout=300)
    assert out.returncode == 0 and "OK" in out.stdout, out.stderr[-2000:]
    assert out.stdout.strip().endswith("[]"), out.stdout  # no method shadowed on the pickled student's instance
