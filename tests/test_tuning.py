"""Hyperparameter tuning with a plan: Ultralytics' own Tuner, every iteration trained by ``yolo-ckpt train``."""

import json
import re

import pytest
from ultralytics.utils.patches import torch_load

from yolo_ckpt import YOLO, CheckpointConfigError
from yolo_ckpt.integration.settings import saved_settings

ARGS = dict(epochs=1, imgsz=64, batch=4, workers=0, device="cpu", plots=False)


def test_every_iteration_trains_with_the_plan_auto_planned_once(detect_data, tmp_path, capfd, caplog):
    """``YOLO(...).tune(data=..., iterations=2, checkpoint_stages="auto", memory_budget=...)``: both iterations train
    (Ultralytics' ``yolo train`` subprocess rejected our keys; its Tuner failed in ``get_cfg`` before); the first
    plans (auto's own log line, once, from the iterations' processes), the second trains the plan it chose (recorded
    in the tuner's arguments: this process's line; its plan's log lines from its own process); each iteration's
    results carry its peak memory (a figure only our trainer writes); the best hyperparameters and weights are
    written as Ultralytics writes them, the weights recording the chosen plan, not ``auto``."""
    from ultralytics.utils import YAML

    from support import SMALL, auto_budget

    # SMALL (five planning units), not yolo11n: what is tested is tuning's plan, not a model; at 96 px its
    # activations are most of a step (yolo11n needed 160 px, where its two iterations and auto's 57 probes took 46 s)
    model = tmp_path / "small.yaml"
    YAML.save(model, SMALL)
    budget = auto_budget(str(model), detect_data, 96, ARGS["batch"], 0.5)
    YOLO(str(model)).tune(data=detect_data, iterations=2, project=str(tmp_path), checkpoint_stages="auto",
                          memory_budget=budget, **{**ARGS, "imgsz": 96})
    out = capfd.readouterr()
    text = re.sub(r"\x1b\[[0-9;]*m", "", out.out + out.err)
    assert text.count("auto: choosing the plan") == 1, text[-3000:]
    starts = [i for i in range(len(text)) if text.startswith("Starting training for", i)]  # one per iteration
    assert len(starts) == 2, text[-3000:]
    second = text[starts[0]:starts[1]]  # the first iteration's epoch, then the second's set-up
    assert "checkpoint: layers [" in second or "checkpoint: stage " in second, second[-3000:]  # installed, unplanned
    said = [r.getMessage() for r in caplog.records if "tune: planned in iteration 1, reused by the others:" in
            r.getMessage()]  # this process's line
    assert len(said) == 1 and "checkpoint_stages=" in said[0], said
    records = [json.loads(line) for line in (tmp_path / "tune" / "tune_results.ndjson").read_text().splitlines()]
    assert [r["iteration"] for r in records] == [1, 2]
    for r in records:
        (metrics,) = r["datasets"].values()
        assert metrics["mem/peak_tensor_GB"] > 0 and metrics["mem/val_peak_tensor_GB"] > 0, r
    assert (tmp_path / "tune" / "best_hyperparameters.yaml").exists()
    best = saved_settings(torch_load(tmp_path / "tune" / "weights" / "best.pt"))
    assert best["checkpoint_stages"] != "auto" and (best["checkpoint_stages"] or best["checkpoint_layers"])
    assert f"checkpoint_stages={best['checkpoint_stages']}".replace(" ", "") in said[0].replace(" ", "")


@pytest.mark.parametrize("kw,line", [
    ({"use_ray": True}, "tune(use_ray=True) with checkpoint_stages: Ray Tune's trials train through Ultralytics' own "
                        "trainer, without the plan. Valid: use_ray=False"),
    ({"checkpoint_stages": 7}, "checkpoint_stages=7: yolo11n.yaml has no stage 7")])
def test_a_plan_tuning_cannot_keep_stops_before_any_iteration(kw, line, detect_data, tmp_path):
    with pytest.raises(CheckpointConfigError, match=line.replace("(", r"\(").replace(")", r"\)")):
        YOLO("yolo11n.yaml").tune(data=detect_data, iterations=1, project=str(tmp_path),
                                  **{"checkpoint_stages": [2, 3], **kw}, **ARGS)
    assert list(tmp_path.iterdir()) == []
