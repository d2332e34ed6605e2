"""Profiler figures against independent measurements: tensor sizes, FlopCounterMode on the stage alone."""

import copy
import json
import shlex
import subprocess
import sys

import pytest
import torch
import yaml
from torch.utils.flop_counter import FlopCounterMode

from yolo_ckpt.memory.step import StepShape, build_model, training_batch, with_plan
from yolo_ckpt.regions.settings import PlanSettings
from yolo_ckpt.report.profiler import compare_plans, profile_stages, standard_plans, time_x, within_noise

from support import MINI, loop_batches


@pytest.fixture(scope="module")
def model():
    return build_model("yolo11n.yaml")


def test_stage_rows_against_independent_figures(model):
    imgsz, batch = 160, 2
    rows = {r["stage"]: r for r in profile_stages(model, StepShape(imgsz, batch))}
    assert sorted(rows) == [1, 2, 3, 4, 5]
    # Checkpointed, stage 1 keeps exactly its input for the recompute: the fp32 image batch.
    assert rows[1]["saved_MiB_checkpointed"] == round(batch * 3 * imgsz * imgsz * 4 / 2**20, 2)
    assert rows[2]["output_shape"] == [batch, 64, imgsz // 4, imgsz // 4]
    for k, r in rows.items():
        assert r["saved_MiB_checkpointed"] < r["saved_MiB_vanilla"]
        x = training_batch(model, StepShape(imgsz, batch))["img"]
        with torch.no_grad():  # the recompute is one forward of the stage: count that forward's FLOPs alone
            for i in range(r["layers"][0]):
                x = model.model[i](x)
            with FlopCounterMode(display=False) as fc:
                for i in r["layers"]:
                    x = model.model[i](x)
        assert r["recompute_GFLOPs"] == pytest.approx(fc.get_total_flops() / 1e9, abs=1e-3), k


def test_whole_backbone_meets_the_target(model):
    """yolo11n, 640, batch 4: all backbone stages at <= 0.55x the vanilla peak for <= 1.15x the FLOPs."""
    plans = {"none": PlanSettings(), "all": PlanSettings.of("all")}
    none, every = compare_plans(model, StepShape(640, 4), plans, repeats=0)
    assert every["peak_ratio"] <= 0.55 and every["flops_ratio"] <= 1.15, every


def test_standard_plans(model):
    assert list(standard_plans(model)) == ["none", "[1]", "[2]", "[3]", "[4]", "[5]", "[2,3]", "all", "all selective",
                                           "all + head", "all + head selective"]


def test_profile_command_writes_results(tmp_path):
    """The command in its own process (steps timed, as users' runs time them), on MINI (14 candidate plans; SMALL's
    62, each timed, made this 22 s), with a budget whose share lies between the least-keeping plan's step and
    vanilla's, both measured by a fresh tracker."""
    from yolo_ckpt.planning.search import deepest

    from support import measured_step

    cfg = tmp_path / "mini.yaml"
    cfg.write_text(yaml.safe_dump(MINI, sort_keys=False))
    model = build_model(str(cfg))
    vanilla, least = (measured_step(m, 64, 2) for m in (model, with_plan(model, deepest(model).with_loss(None))))
    budget = int(((vanilla + least) // 2 + loop_batches(model, 64, 2)) / 0.6)
    out = subprocess.run([sys.executable, "-m", "yolo_ckpt", "profile", f"model={cfg}", "imgsz=64", "batch=2",
                          f"memory_budget={budget}B", f"project={tmp_path}", "name=p"], capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    saved = json.loads((tmp_path / "p" / "profile.json").read_text())
    assert [r["plan"] for r in saved["plans"]] == list(standard_plans(build_model(str(cfg))))
    assert saved["plans"][0]["peak_ratio"] == 1.0 and saved["plans"][-1]["peak_ratio"] < 1.0
    assert all(r["recompute_GFLOPs"] > 0 for r in saved["stages"])
    for name in ("plans.csv", "stages.csv", "candidates.csv", "untouchable.csv"):
        assert len((tmp_path / "p" / name).read_text().splitlines()) == 1 + len(saved[name.split(".")[0]])
    for name in ("tradeoff.png", "pareto.png"):
        assert (tmp_path / "p" / name).read_bytes()[:4] == b"\x89PNG"
    # every plan measured; auto's share of the budget, less the batches Ultralytics' loop holds beside the step's
    rows, target = saved["candidates"], int(0.6 * budget) - loop_batches(model, 64, 2)
    fitting = [r for r in rows if r["step_bytes"] <= target]
    chosen = saved["chosen"]
    assert rows[15:] in ([], [chosen])  # vanilla and the one-mode plans, then auto's choice where its units differ
    assert rows[0]["step_bytes"] > target and fitting  # vanilla does not fit, some plans do
    assert chosen["auto"] and chosen["step_bytes"] <= target
    assert chosen["predicted_s"] == min(r["predicted_s"] for r in fitting)  # the fastest predicted that fits
    front = [r for r in rows if r["pareto"]]
    assert front and all(r["step_s"] > 0 and r["predicted_s"] > 0 for r in front)  # time measured and predicted
    assert all(r["predicted_time_ratio"] >= 1 for r in rows)  # against vanilla's prediction: recompute adds time
    least = min(rows, key=lambda r: (r["step_bytes"], r["flops"]))  # of plans keeping as little, the cheapest
    assert least["pareto"] and least["largest_imgsz"] >= 64 > rows[0]["largest_imgsz"]
    assert "plans: 100%" in out.stderr + out.stdout  # progress was shown


def test_plot_labels_are_a_legend_beside_the_axes():
    """Points that coincide or sit near the frame keep readable labels: none is drawn on the axes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from yolo_ckpt.report.plots import legend_points

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


# ------------------------------------------------------------------------------------- on a small device
@pytest.fixture(scope="module")
def mini():
    from copy import deepcopy

    from ultralytics.cfg import get_cfg
    from ultralytics.nn.tasks import DetectionModel

    model = DetectionModel(deepcopy(MINI), verbose=False).train()
    model.args = get_cfg()
    return model


def need_on_device(model, imgsz: int, batch: int, peak: int) -> int:
    """What a plan's step of ``peak`` bytes needs on a device: the model's and its planning copy's weights, the
    batch, the step (counted from shapes: float32 images, per object a batch index, a class and an xywh box)."""
    from yolo_ckpt.memory.step import OBJECTS_PER_IMAGE

    weights = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    return 2 * weights + 4 * batch * (3 * imgsz * imgsz + OBJECTS_PER_IMAGE * 6) + peak


def test_flop_count_is_torchs_and_keeps_nothing(mini):
    """The tracker's FLOPs (``flops=True``) against ``FlopCounterMode``, and its memory against the tracker without
    them; and why torch's counter is not used: under ``FlopCounterMode`` the whole network's checkpointed step peaks
    above the step itself."""
    from yolo_ckpt.memory.step import measure_peak, planned_copy, step_loss
    from yolo_ckpt.memory.tracker import LiveTensorTracker

    for spec in (PlanSettings(), PlanSettings.of("all", "full", "head")):
        with planned_copy(mini, spec) as m:
            data = training_batch(m, StepShape(128, 2))
            with LiveTensorTracker() as seen, FlopCounterMode(display=False) as torch_count:
                step_loss(m, data).backward()
            m.zero_grad(set_to_none=True)
            plain = measure_peak(m, data)
            counted = measure_peak(m, data, flops=True)
            bounded = measure_peak(m, data, limit=2**40, flops=True)  # a probe's tracker (``MemoryLimit``) counts too
        assert counted.flops == bounded.flops == torch_count.get_total_flops() > 0, spec
        assert plain.flops == 0 and counted._replace(flops=0) == plain == bounded._replace(flops=0), spec
    assert seen.peak > plain.peak  # the last spec: FlopCounterMode kept what checkpointing frees


def test_plans_and_stages_on_a_device_smaller_than_vanilla(mini):
    """Vanilla and the plans over the device are reported as not fitting, the others as measured without a device;
    no ratio to a vanilla that was not measured; no step ever tries to pass the device."""
    from yolo_ckpt.memory.device import SimulatedDevice
    from yolo_ckpt.memory.tracker import LiveTensorTracker

    imgsz, batch, plans = 128, 2, standard_plans(mini)
    ref = compare_plans(mini, StepShape(imgsz, batch), plans, repeats=0)
    need = [need_on_device(mini, imgsz, batch, int(r["peak_MiB"] * 2**20)) for r in ref]  # +-0.05 MiB: rounded
    inside = sorted({n for n in need if n < need[0]} | {need[0]})
    lo, hi = max(zip(inside, inside[1:]), key=lambda p: p[1] - p[0])
    assert hi - lo > 2**20 // 5  # wider than the rounding on either side
    limit = (lo + hi) // 2
    state = [*mini.parameters(), *mini.buffers()]
    with LiveTensorTracker() as outside, SimulatedDevice(limit) as gpu:
        outside.track(state)
        gpu.track(state)
        rows = compare_plans(mini, StepShape(imgsz, batch), plans, repeats=1)
        stages = profile_stages(mini, StepShape(imgsz, batch))
    assert gpu.max_memory_allocated() <= limit and outside.peak <= limit  # every allocation tried fit the device
    assert [r["plan"] for r in rows] == list(plans) and not rows[0]["fits"] and rows[-1]["fits"]
    for r, expected, n in zip(rows, ref, need):
        assert r["fits"] == (n <= limit), (r["plan"], n, limit)
        same = ("peak_MiB", "GFLOPs")
        assert [r[k] for k in same] == ([expected[k] for k in same] if r["fits"] else [None, None]), r["plan"]
        assert (r["step_s"] is not None) == r["fits"]
        assert r["peak_ratio"] is r["flops_ratio"] is r["time_ratio"] is None
    plain = profile_stages(mini, StepShape(imgsz, batch))
    for r, expected in zip(stages, plain):  # every stage row compares its step with vanilla's, which did not fit
        assert (r["stage"], r["layers"], r["modules"]) == (expected["stage"], expected["layers"], expected["modules"])
        assert not r["fits"] and r["saved_MiB_checkpointed"] is r["recompute_GFLOPs"] is r["saved_MiB_vanilla"] is None
        assert r["output_shape"] in (None, expected["output_shape"])


def test_profile_measures_the_loss_plan(tmp_path, monkeypatch):
    """``checkpoint_loss=exact``: the loss plan alone and with the whole network are rows of their own, each the step
    an independent copy with that plan measures; every other row keeps Ultralytics' loss."""
    from yolo_ckpt.memory.step import measure_peak, training_batch, with_plan

    cfg = tmp_path / "mini-seg.yaml"
    cfg.write_text(yaml.safe_dump({**MINI, "head": [*MINI["head"][:-1], [[2, 3], 1, "Segment", ["nc", 8, 16]]]},
                                  sort_keys=False))
    from yolo_ckpt.integration.cli import profile
    from yolo_ckpt.memory import step as measure

    model = build_model(str(cfg))  # profiled in this process, so that the figures below are of the same weights
    monkeypatch.setattr(measure, "build_model", lambda name: copy.deepcopy(model))
    profile([f"model={cfg}", "imgsz=64", "batch=2", "checkpoint_loss=exact", "checkpoint_stages=[1]",
             f"project={tmp_path}", "name=p"])
    rows = {r["plan"]: r for r in json.loads((tmp_path / "p" / "profile.json").read_text())["plans"]}
    assert list(rows) == [*standard_plans(model), "yours", "loss exact", "all + head, loss exact"]
    data = training_batch(model, StepShape(64, 2))
    for name, spec in {"none": ([], "full", None, "none"), "loss exact": ([], "full", None, "exact"),
                       "yours": ([1], "full", None, "exact")}.items():
        plan = PlanSettings.of(*spec)
        assert rows[name]["peak_MiB"] == round(measure_peak(with_plan(model, plan), data).peak / 2**20, 1), name
    assert rows["loss exact"]["peak_MiB"] < rows["none"]["peak_MiB"]


def test_profile_command_on_a_simulated_device(tmp_path, mini):
    """``yolo-ckpt profile simulate_gpu=...`` end to end on a device between the whole network's step and vanilla's:
    rows that do not fit say so, the files are written, nothing passes the device. In process, as the suite plans (no
    step timed: no claim here is on a time); the command's own process: ``test_profile_command_writes_results``."""
    import logging

    from ultralytics.utils import LOGGER

    from yolo_ckpt.integration.cli import profile
    from yolo_ckpt.memory.step import measure_peak, planned_copy

    cfg = tmp_path / "mini.yaml"
    cfg.write_text(yaml.safe_dump(MINI, sort_keys=False))
    imgsz, batch = 64, 8  # a device that holds the stage analysis' dry run of each copy (256 px, batch 1)
    need = {}
    for spec in (PlanSettings(), PlanSettings.of("all", "selective", "head")):
        with planned_copy(mini, spec) as m:
            peak = measure_peak(m, training_batch(m, StepShape(imgsz, batch))).peak
            need[str(spec)] = need_on_device(mini, imgsz, batch, peak)
    limit = sum(need.values()) // 2
    logged, handler = [], logging.Handler()
    handler.emit = lambda r: logged.append(r.getMessage())
    LOGGER.addHandler(handler)
    try:
        profile([f"model={cfg}", f"imgsz={imgsz}", f"batch={batch}", f"memory_budget={int(limit / 0.6)}B",
                 f"simulate_gpu={limit}B", f"project={tmp_path}", "name=p"])
    finally:
        LOGGER.removeHandler(handler)
    saved = json.loads((tmp_path / "p" / "profile.json").read_text())
    plans = {r["plan"]: r for r in saved["plans"]}
    assert not plans["none"]["fits"] and plans["none"]["peak_MiB"] is None and plans["all + head selective"]["fits"]
    assert all(r["peak_ratio"] is None for r in saved["plans"] + saved["candidates"])
    assert not saved["candidates"][0]["fits"] and any(r["fits"] for r in saved["candidates"])
    for name in ("plans", "stages", "candidates", "untouchable"):
        lines = (tmp_path / "p" / f"{name}.csv").read_text().splitlines()
        assert len(lines) == 1 + len(saved[name]) and ("fits" in lines[0].split(",")) == (name != "untouchable")
    for name in ("tradeoff.png", "pareto.png"):
        assert (tmp_path / "p" / name).read_bytes()[:4] == b"\x89PNG"
    peak = next(line for line in saved["notes"] if line.startswith("the simulated device peaked at"))
    assert float(peak.split()[5]) <= round(limit / 2**20, 1)  # both rounded as the note rounds
    said = next(n for n in saved["notes"] if n.startswith("vanilla does not fit the simulated device"))
    assert any(said in line for line in logged), logged  # a note of profile.json, and said


def test_profile_simulate_gpu_on_cuda_is_one_line(tmp_path, capsys):
    """Through the command's own ``main``, in this process (an exception would end the test with its traceback); the
    command in a process of its own printing its one line for a key profile refuses:
    ``tests/test_cli.py::test_profile_checks_our_keys_before_measuring``."""
    from yolo_ckpt.integration.cli import main

    rc = main(["profile", "simulate_gpu=1GB", "device=0", f"project={tmp_path}"])
    assert rc == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "yolo-ckpt: error: simulate_gpu='1GB' rehearses a GPU on CPU. Valid: with device=cpu, or no simulate_gpu on a "
        "CUDA device (its own memory counts)."]
    assert list(tmp_path.iterdir()) == []


def test_saved_bytes_of_a_stage_follow_the_runs_autocast(mini):
    """Under autocast (bf16 here, torch's CPU autocast) a stage's convolutions save half-precision outputs: the
    vanilla column counts what the run's forward saves (it counted the full-precision forward's, whatever ``amp``)."""
    fp32 = {r["stage"]: r["saved_MiB_vanilla"] for r in profile_stages(mini, StepShape(256, 2))}
    bf16 = {r["stage"]: r["saved_MiB_vanilla"] for r in profile_stages(mini, StepShape(256, 2, amp=torch.bfloat16))}
    assert fp32.keys() == bf16.keys() and all(0 < bf16[k] < fp32[k] for k in fp32), (fp32, bf16)


def test_the_console_table_fits_and_ends_with_the_command_of_the_least_plan(mini):
    """``profile``'s console: one compact table within 120 columns (``fits`` only where something bounds the steps),
    then the plan that keeps the least as the command that trains it, its keys read back by ``yolo-ckpt train``'s
    own parser into the very plan measured."""
    from yolo_ckpt.integration.cli import parse_train_args, plans_table, recommendation

    plans = {"none": PlanSettings(), "[2]": PlanSettings.of([2]), "all + head": PlanSettings.of("all", layers="head")}
    rows = compare_plans(mini, StepShape(64, 2), plans, repeats=1)
    for budget in (False, True):
        lines = plans_table(rows, budget)
        assert len(lines) == 1 + len(plans) and max(map(len, lines)) <= 120 and ("fits" in lines[0]) is budget
    line = recommendation(rows, "yolo-ckpt train model=mini.yaml")
    best = min(rows[1:], key=lambda r: r["peak_ratio"])
    assert line.startswith(f"the least memory of these plans, {best['plan']} (") and best["peak_ratio"] < 1
    sentence, command = line.splitlines()  # the command on a line of its own, to copy
    assert len(f"profile: {sentence}") <= 120 and command.startswith("  yolo-ckpt train model=mini.yaml ")
    keys = parse_train_args(["train", *shlex.split(line.split("yolo-ckpt train ", 1)[1])])
    assert PlanSettings.from_keys(keys) == plans[best["plan"]]
    assert recommendation(rows[:1], "yolo-ckpt train") is None  # vanilla alone: nothing to recommend


def test_a_step_time_within_its_noise_is_never_shown_faster_than_vanilla(mini):
    """Timed in rounds, each plan's time carries the spread of its ratio to vanilla's same round; a plan is never
    shown faster than vanilla (recomputing adds work: below 1 is the machine's noise), vanilla timed again among the
    plans included, whose difference from vanilla is nothing but noise."""
    from yolo_ckpt.integration.cli import plans_table

    plans = {"none": PlanSettings(), "none again": PlanSettings(), "all + head": PlanSettings.of("all", layers="head")}
    rows = compare_plans(mini, StepShape(64, 2), plans, repeats=3)
    for r in rows[1:]:
        cell = time_x(r)
        shown, spread = cell.split(" ±")
        assert r["time_spread"] is not None and float(spread) == round(r["time_spread"], 2)
        assert shown == "~1" or float(shown) >= 1 and abs(r["time_ratio"] - 1) > r["time_spread"], (cell, r)
        assert (shown == "~1") is within_noise(r) and (r["time_ratio"] >= 1 or shown == "~1")
    lines = plans_table(rows, budget=False)
    assert lines[-1].startswith("time x: the median of interleaved rounds") and max(map(len, lines)) <= 120
