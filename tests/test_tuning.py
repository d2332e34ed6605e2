"""Hyperparameter tuning with a plan: Ultralytics' own Tuner, every iteration trained by ``yolo-ckpt train``."""

import json

import pytest
from ultralytics.utils.patches import torch_load

from yolo_ckpt import YOLO, CheckpointConfigError
from yolo_ckpt.integration.settings import saved_settings

ARGS = dict(epochs=1, imgsz=64, batch=4, workers=0, device="cpu", plots=False)


def test_every_iteration_trains_with_the_plan_and_records_its_memory(detect_data, tmp_path, capfd):
    """``YOLO(...).tune(data=..., iterations=2, checkpoint_stages=[2, 3])``: both iterations train (Ultralytics'
    ``yolo train`` subprocess rejected the key; its Tuner failed in ``get_cfg`` before), each recomputing stages 2-3
    (the plan's log lines, two per iteration, from the iterations' own processes), each iteration's results carry
    its peak memory (a figure only our trainer writes), and the best hyperparameters and weights are written as
    Ultralytics writes them, the weights recording the plan."""
    YOLO("yolo11n.yaml").tune(data=detect_data, iterations=2, project=str(tmp_path), checkpoint_stages=[2, 3], **ARGS)
    out = capfd.readouterr()
    text = out.out + out.err
    assert text.count("recomputed as one region with stages [2, 3]") == 2 * 2, text[-3000:]
    records = [json.loads(line) for line in (tmp_path / "tune" / "tune_results.ndjson").read_text().splitlines()]
    assert [r["iteration"] for r in records] == [1, 2]
    for r in records:
        (metrics,) = r["datasets"].values()
        assert metrics["mem/peak_tensor_GB"] > 0 and metrics["mem/val_peak_tensor_GB"] > 0, r
    assert (tmp_path / "tune" / "best_hyperparameters.yaml").exists()
    best = torch_load(tmp_path / "tune" / "weights" / "best.pt")
    assert saved_settings(best)["checkpoint_stages"] == [2, 3]


def test_auto_is_planned_in_the_first_iteration_and_reused(detect_data, tmp_path, capfd, caplog):
    """``checkpoint_stages=auto`` with ``memory_budget``: the first iteration plans (auto's own log line, once, from
    the iterations' processes), the others train the plan it chose (recorded in the tuner's arguments: its log line),
    every iteration with regions recomputed, and the best weights record a plan, not ``auto``."""
    from support import auto_budget

    budget = auto_budget("yolo11n.yaml", detect_data, 160, ARGS["batch"], 0.5)  # at 64 px the model state is most
    YOLO("yolo11n.yaml").tune(data=detect_data, iterations=2, project=str(tmp_path), checkpoint_stages="auto",
                              memory_budget=budget, **{**ARGS, "imgsz": 160})
    out = capfd.readouterr()
    text = out.out + out.err
    assert text.count("auto: choosing the plan") == 1, text[-3000:]
    said = [r.getMessage() for r in caplog.records if "tune: planned in iteration 1, reused by the others:" in
            r.getMessage()]  # this process's line
    assert len(said) == 1 and "checkpoint_stages=" in said[0], said
    records = [json.loads(line) for line in (tmp_path / "tune" / "tune_results.ndjson").read_text().splitlines()]
    assert [r["iteration"] for r in records] == [1, 2]
    assert all(next(iter(r["datasets"].values()))["mem/peak_tensor_GB"] > 0 for r in records)
    chosen = saved_settings(torch_load(tmp_path / "tune" / "weights" / "best.pt"))["checkpoint_stages"]
    assert chosen != "auto" and f"checkpoint_stages={chosen}".replace(" ", "") in said[0].replace(" ", "")


@pytest.mark.parametrize("kw,line", [
    ({"use_ray": True}, "tune(use_ray=True) with checkpoint_stages: Ray Tune's trials train through Ultralytics' own "
                        "trainer, without the plan. Valid: use_ray=False"),
    ({"checkpoint_stages": 7}, "checkpoint_stages=7: yolo11n.yaml has no stage 7")])
def test_a_plan_tuning_cannot_keep_stops_before_any_iteration(kw, line, detect_data, tmp_path):
    with pytest.raises(CheckpointConfigError, match=line.replace("(", r"\(").replace(")", r"\)")):
        YOLO("yolo11n.yaml").tune(data=detect_data, iterations=1, project=str(tmp_path),
                                  **{"checkpoint_stages": [2, 3], **kw}, **ARGS)
    assert list(tmp_path.iterdir()) == []
