"""Several datasets in one call (``data=[a, b]``, Ultralytics' ``MultiTrainer``): each trains with the run's plan, in
this process; bad keys stop once, before any dataset; a dataset that fails ends the command with exit 1."""

import json
import subprocess
import sys
from pathlib import Path

import torch
import ultralytics
from ultralytics.models.yolo.detect import DetectionTrainer as UltralyticsDetectionTrainer

from yolo_ckpt import YOLO

from support import TRAIN_ARGS, add_counting, assert_recomputed, assert_same_run, forward_counts, results

ARGS = {**TRAIN_ARGS, "epochs": 1, "imgsz": 96, "save_period": 1}  # epoch0.pt keeps the optimizer step count


def sweep(cls, project: Path, data: list, **keys) -> list[Path]:
    """Train ``cls("yolo11n.yaml")`` on ``data`` (several datasets); the run directories, in order. The base model's
    random weights seed every dataset's run (MultiTrainer fine-tunes them), so they are drawn from one seed."""
    torch.manual_seed(0)
    model = cls("yolo11n.yaml")
    add_counting(model)
    model.train(data=data, project=str(project), **ARGS, **keys)
    return [r.save_dir for r in model.trainer.trainers]


def test_each_dataset_trains_with_the_plan_as_vanilla_multitrainer(detect_data, tmp_path):
    """``YOLO(...).train(data=[a, b], checkpoint_stages=[2, 3])`` without ``trainer=`` or a callback of the user's
    (where Ultralytics would run plain ``yolo train`` subprocesses, which reject our keys): both datasets train in
    this process with stages 2-3 recomputed (forward counts), each run bit for bit as Ultralytics' own MultiTrainer
    trains it in process, each with its memory in results.csv and in the sweep's summary."""
    data = [detect_data, detect_data]
    vanilla = sweep(ultralytics.YOLO, tmp_path, data, trainer=UltralyticsDetectionTrainer)
    (tmp_path / "multitrain").rename(tmp_path / "vanilla")  # ours sweeps into multitrain/ too: the same saved paths
    vanilla = [tmp_path / "vanilla" / v.name for v in vanilla]
    ours = sweep(YOLO, tmp_path, data, checkpoint_stages=[2, 3])
    assert len(vanilla) == len(ours) == 2
    for v, c in zip(vanilla, ours):
        assert_recomputed(forward_counts(v), forward_counts(c), {1, 2, 3, 4})  # stages 2 and 3 of yolo11n
        assert_same_run(v, c)
    summary = json.loads((ours[0].parent / "multitrain_results.json").read_text())["results"]
    assert set(summary) == {c.name for c in ours}
    for c in ours:
        assert summary[c.name]["mem/peak_tensor_GB"] == max(float(r["mem/peak_tensor_GB"]) for r in results(c)) > 0


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "yolo_ckpt", "train", *args], capture_output=True, text=True,
                          timeout=600)


def test_a_bad_value_stops_once_before_any_dataset(detect_data, tmp_path):
    """``checkpoint_stages=7`` with several datasets: one line, exit 2, no run folder (Ultralytics' MultiTrainer
    would log one ERROR line per dataset and exit 0)."""
    out = cli("model=yolo11n.yaml", f"data=['{detect_data}','{detect_data}']", "checkpoint_stages=7",
              f"project={tmp_path}", "epochs=1", "imgsz=64")
    lines = (out.stdout + out.stderr).strip().splitlines()
    assert out.returncode == 2 and len(lines) == 1 and "checkpoint_stages=7: yolo11n.yaml has no stage 7" in lines[0]
    assert list(tmp_path.iterdir()) == []


TRAINER_SWEEP = """
import sys
import ultralytics
from yolo_ckpt import DetectionTrainer
ultralytics.YOLO("yolo11n.yaml").train(trainer=DetectionTrainer, data=[sys.argv[1], sys.argv[1]], project=sys.argv[2],
                                       checkpoint_stages=7, epochs=1, imgsz=64)
print("returned")
"""


def test_a_bad_value_stops_the_sweep_of_ultralytics_own_yolo_once(detect_data, tmp_path):
    """The same through Ultralytics' own ``YOLO(...).train(trainer=<ours>, data=[a, b])``, where its MultiTrainer
    builds our trainer inside the ``except Exception`` that skips a failing dataset: one error line, exit 2, no
    dataset tried, and not one of the folders it made for the sweep left."""
    out = subprocess.run([sys.executable, "-c", TRAINER_SWEEP, detect_data, str(tmp_path / "runs")],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 2, (out.stdout + out.stderr)[-3000:]
    errors = [x for x in (out.stdout + out.stderr).splitlines() if "error" in x.lower()]
    assert len(errors) == 1 and errors[0].startswith("yolo-ckpt: error: checkpoint_stages=7: yolo11n.yaml has no "
                                                     "stage 7. Valid: "), errors
    assert "MultiTrainer 2/2" not in out.stdout + out.stderr and "returned" not in out.stdout
    assert not (tmp_path / "runs").exists() or list((tmp_path / "runs").rglob("*")) == []


def test_a_dataset_that_fails_ends_the_command_with_exit_1_once_all_ran(detect_data, tmp_path):
    """One dataset missing: Ultralytics skips it with its ERROR line, the other trains with the plan, and the command
    ends with one line naming the dataset that did not train, exit 1."""
    out = cli("model=yolo11n.yaml", f"data=['{tmp_path / 'missing.yaml'}','{detect_data}']", "checkpoint_stages=[2,3]",
              f"project={tmp_path / 'runs'}", "epochs=1", "imgsz=64", "batch=4", "workers=0", "plots=False")
    last = out.stderr.strip().splitlines()[-1]
    assert out.returncode == 1, (out.stdout + out.stderr)[-3000:]
    assert last == ("yolo-ckpt: error: 1 of 2 datasets did not train: missing (each one's error is above); the "
                    "others' runs are saved"), last
    trained = tmp_path / "runs" / "multitrain" / Path(detect_data).parent.name / "results.csv"
    assert trained.exists() and "mem/peak_tensor_GB" in trained.read_text().splitlines()[0]
