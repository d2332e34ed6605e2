"""Profiler figures against independent measurements: tensor sizes, FlopCounterMode on the stage alone."""

import json
import subprocess
import sys

import pytest
import torch
import yaml
from torch.utils.flop_counter import FlopCounterMode

from yolo_ckpt.measure import build_model, training_batch
from yolo_ckpt.profiler import compare_plans, profile_stages, standard_plans

from support import SMALL


@pytest.fixture(scope="module")
def model():
    return build_model("yolo11n.yaml")


def test_stage_rows_against_independent_figures(model):
    imgsz, batch = 160, 2
    rows = {r["stage"]: r for r in profile_stages(model, imgsz, batch)}
    assert sorted(rows) == [1, 2, 3, 4, 5]
    # Checkpointed, stage 1 keeps exactly its input for the recompute: the fp32 image batch.
    assert rows[1]["saved_MiB_checkpointed"] == round(batch * 3 * imgsz * imgsz * 4 / 2**20, 2)
    assert rows[2]["output_shape"] == [batch, 64, imgsz // 4, imgsz // 4]
    for k, r in rows.items():
        assert r["saved_MiB_checkpointed"] < r["saved_MiB_vanilla"]
        x = training_batch(model, imgsz, batch)["img"]
        with torch.no_grad():  # the recompute is one forward of the stage: count that forward's FLOPs alone
            for i in range(r["layers"][0]):
                x = model.model[i](x)
            with FlopCounterMode(display=False) as fc:
                for i in r["layers"]:
                    x = model.model[i](x)
        assert r["recompute_GFLOPs"] == pytest.approx(fc.get_total_flops() / 1e9, abs=1e-3), k


def test_whole_backbone_meets_the_target(model):
    """yolo11n, 640, batch 4: all backbone stages at <= 0.55x the vanilla peak for <= 1.15x the FLOPs."""
    none, every = compare_plans(model, 640, 4, {"none": [], "all": "all"}, repeats=0)
    assert every["peak_ratio"] <= 0.55 and every["flops_ratio"] <= 1.15, every


def test_standard_plans(model):
    assert list(standard_plans(model)) == ["none", "[1]", "[2]", "[3]", "[4]", "[5]", "[2,3]", "all", "all selective",
                                           "all + head", "all + head selective"]


def test_profile_command_writes_results(tmp_path):
    cfg = tmp_path / "small.yaml"
    cfg.write_text(yaml.safe_dump(SMALL, sort_keys=False))
    out = subprocess.run([sys.executable, "-m", "yolo_ckpt", "profile", f"model={cfg}", "imgsz=64", "batch=2",
                          "memory_budget=11MB", f"project={tmp_path}", "name=p"], capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    saved = json.loads((tmp_path / "p" / "profile.json").read_text())
    assert [r["plan"] for r in saved["plans"]] == list(standard_plans(build_model(str(cfg))))
    assert saved["plans"][0]["peak_ratio"] == 1.0 and saved["plans"][-1]["peak_ratio"] < 1.0
    assert all(r["recompute_GFLOPs"] > 0 for r in saved["stages"])
    for name in ("plans.csv", "stages.csv", "candidates.csv", "untouchable.csv"):
        assert len((tmp_path / "p" / name).read_text().splitlines()) == 1 + len(saved[name.split(".")[0]])
    for name in ("tradeoff.png", "pareto.png"):
        assert (tmp_path / "p" / name).read_bytes()[:4] == b"\x89PNG"
    rows, target = saved["candidates"], int(0.6 * 11 * 2**20)  # every plan measured; auto's share of the budget
    fitting = [r for r in rows if r["step_bytes"] <= target]
    assert len(rows) == 63 and rows[0]["step_bytes"] > target and fitting  # vanilla does not fit, some plans do
    chosen = saved["chosen"]
    assert chosen["auto"] and chosen["step_bytes"] <= target
    assert chosen["flops"] <= 1.01 * min(r["flops"] for r in fitting)  # the cheapest that fits
    least = min(rows, key=lambda r: r["step_bytes"])
    assert least["pareto"] and least["largest_imgsz"] >= 64 > rows[0]["largest_imgsz"]
    assert "plans: 100%" in out.stderr + out.stdout  # progress was shown


def test_plot_labels_are_a_legend_beside_the_axes():
    """Points that coincide or sit near the frame keep readable labels: none is drawn on the axes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from yolo_ckpt.plots import legend_points

    rows = [{"plan": "all + head", "x": 1.3, "y": 0.47}, {"plan": "all + head selective", "x": 1.3, "y": 0.47},
            {"plan": "none", "x": 1.0, "y": 1.0}]
    fig, ax = plt.subplots()
    legend_points(ax, rows, "x", "y", lambda r: r["plan"])
    fig.canvas.draw()
    legend = ax.get_legend()
    assert len(ax.texts) == 0 and [t.get_text() for t in legend.get_texts()] == [r["plan"] for r in rows]
    assert legend.get_window_extent().x0 >= ax.get_window_extent().x1  # beside the axes, not over the points
    lo, hi = ax.get_xlim()
    assert lo < 1.0 and hi > 1.3  # no point on the frame
    plt.close(fig)
