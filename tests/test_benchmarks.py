"""The benchmark scripts run end to end (their figures are for the docs; here only that they work)."""

import runpy
import subprocess
import sys
from pathlib import Path

import pytest
from ultralytics.utils import YAML

from yolo_ckpt.memory.step import StepShape, with_plan
from yolo_ckpt.regions.graph import model_stages
from yolo_ckpt.regions.settings import PlanSettings

from support import SMALL, measured_step

ROOT = Path(__file__).resolve().parents[1]


def run_script(name: str, *args: str, monkeypatch, capsys) -> str:
    """``python benchmarks/NAME ARGS``'s run in this process: the script's file executed as ``__main__`` with those
    arguments and its directory first on ``sys.path``, as the interpreter runs it; return what it printed. A script's
    own process imported torch and Ultralytics again, 4-5 s of CPU each; an error ends the test with its traceback."""
    script = ROOT / "benchmarks" / name
    monkeypatch.setattr(sys, "argv", [str(script), *args])
    monkeypatch.syspath_prepend(str(script.parent))
    capsys.readouterr()  # what the test printed before is not the script's
    try:
        runpy.run_path(str(script), run_name="__main__")
    except SystemExit as e:  # a script that ends with its exit status: only success passes
        assert e.code in (None, 0), capsys.readouterr()
    return capsys.readouterr().out


@pytest.mark.heavy(1)
def test_gpu_check_quick_writes_every_section(tmp_path):
    """The one-shot GPU check, in its quick form on this machine: every section runs, lands in the report with its
    verdict, and none fails (the CUDA-only ones are skipped). On SMALL (five planning units), not yolo11n: what is
    checked is the script, and yolo11n's 57 probes each time its units are measured made the run 84 s of CPU, SMALL
    44 s."""
    model = tmp_path / "small.yaml"
    YAML.save(model, SMALL)
    cmd = [sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), str(tmp_path), "--quick",
           "--compile-backend", "aot_eager", "--model", str(model)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    report = (tmp_path / "gpu_check.md").read_text()
    assert "FAILED" not in report, report
    verdicts = {"CUDA tests": "SKIPPED", "Exactness on CUDA": "SKIPPED", "Planning on the device": "PASS",
                "Escalation under a reduced memory fraction": "PASS", "Memory table": "PASS",
                "AutoBatch with and without checkpointing": "PASS", "Compiled checkpointed step": "PASS",
                "Whole run on a tight device": "PASS"}
    for title, verdict in verdicts.items():
        assert f"## {title}: {verdict}" in report, title
        assert f"{title}: {verdict}" in out.stdout, title
    assert "| test_memory::test_cuda_peak_rejects_cpu_device | passed |" in report  # the pytest table is read
    assert "| auto | 4 | (" in report and "| batch=-1 all | 4 | ('all', 'full', None) |" in report
    assert "device limited to " in report and "(UntoldDevice)" in report and "the run's peak " in report
    assert f"| {model} | 128 | 4 | off | all |" in report and f"| {model} | 128 | 4 | off | auto 70%: " in report
    assert "compiled [2,3] (aot_eager) | 1 | 0 |" in report and "small, imgsz 192, batch 4: vanilla's" in report


def test_recipe_step_extended_from_small_batches_is_the_measured_step():
    """What docs/recipes.md's figures rest on: the step of the recipe's model and plan, measured at batch/8 and batch/4
    and extended along their line to the recipe's batch, is the step measured at that batch by a fresh tracker (here
    at 512 px, where batch 8 fits this machine in seconds).

    Not at any size: at 128 px a batch-1 step peaks where the parameter gradients dominate, the peak's place moves
    with the batch, and the line from batches 1 and 2 falls 20% short of batch 8 (from 2 and 4: 1.3%)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import recipe_plans

    cfg = YAML.load(ROOT / "cfg" / "medical_semantic_2048.yaml")
    model = with_plan(recipe_plans.recipe_model(cfg), PlanSettings.from_keys(cfg).with_loss(None))
    points, extended = recipe_plans.extended_step(model, 512, cfg["batch"])
    assert [b for b, _ in points] == [1, 2] and cfg["batch"] == 8
    measured = measured_step(model, 512, 8)
    assert abs(extended - measured) <= 0.03 * measured, (extended, measured)


def test_whole_network_prints_each_plan_and_what_is_alive_at_its_peak(monkeypatch, capsys):
    out = run_script("whole_network.py", "--imgsz", "128", "--batch", "1", monkeypatch=monkeypatch, capsys=capsys)
    for plan in ("whole network (all + head)", "one region per layer", "parts nested (THIRD)"):
        assert f"\n{plan}: checkpoint_stages=" in out
    assert out.count("alive at the peak, by what made it: ") == 3 and "target <= 0.3x peak" in out


def test_selective_policy_benchmark_prints_every_rule_and_op_kind(tmp_path, monkeypatch, capsys):
    """The selective benchmark at 64 px: a row per rule, vanilla's ratios 1; keeping everything recomputes no
    convolution (FLOP ratio 1), the other rules keep less than vanilla; the op table names the ops the rules decide
    on. On SMALL, not yolo11n: what is checked is the script, not a model (SMALL's steps: half yolo11n's CPU time)."""
    model = tmp_path / "small.yaml"
    YAML.save(model, SMALL)
    out = run_script("selective_policy.py", "--model", str(model), "--imgsz", "64", "--repeats", "1",
                     monkeypatch=monkeypatch, capsys=capsys)
    rows = {line.split(" | ")[0].removeprefix("| "): line.split(" | ")[1:] for line in out.splitlines()
            if line.startswith("| ")}
    assert rows["vanilla"][1:2] == ["1.000"] and rows["vanilla"][3] == "1.000"
    assert rows["keep all"][3] == "1.000"
    assert float(rows["cost"][1]) < 1 and float(rows["by name"][1]) < 1 and float(rows["cost + BatchNorm"][1]) < 1
    for op in ("convolution.default", "native_batch_norm.default", "max_pool2d_with_indices.default", "silu.default"):
        assert op in rows, op
    assert "\nFloor at 0.65x vanilla's peak: at least " in out


def test_the_recompute_floor_is_below_every_set_of_whole_ops():
    """The floor (a fractional knapsack) against every subset of a few op calls: no subset that frees the bytes
    recomputes in less time, and the best subset is reached when the bytes fit whole calls."""
    import itertools
    import random

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from selective_policy import recompute_floor

    rng = random.Random(0)
    calls = [(rng.uniform(1, 10), rng.uniform(0.1, 5)) for _ in range(8)]
    for need in (0.5, 7.0, 20.0, 35.0):
        floor = recompute_floor(calls, need)
        subsets = [sum(t for _, t in s) for n in range(1, 9) for s in itertools.combinations(calls, n)
                   if sum(m for m, _ in s) >= need]
        assert floor is not None and floor <= min(subsets) + 1e-9, need
    assert recompute_floor(calls, sum(m for m, _ in calls) + 1) is None
    exact = sorted(calls, key=lambda c: c[1] / c[0])[:3]  # the three cheapest per byte, whole
    assert abs(recompute_floor(calls, sum(m for m, _ in exact)) - sum(t for _, t in exact)) < 1e-9


def test_tradeoff_picture_draws_every_standard_plan(tmp_path, monkeypatch, capsys):
    """README's picture's script at 64 px: a PNG, and a row per standard plan with vanilla's ratios 1. On SMALL (four
    stages and a head), not yolo11n: what is checked is the script, not a model (SMALL's ten plans: a third of
    yolo11n's eleven in CPU time)."""
    model, out = tmp_path / "small.yaml", tmp_path / "tradeoff.png"
    YAML.save(model, SMALL)
    printed = run_script("tradeoff_picture.py", "--model", str(model), "--imgsz", "64", "--repeats", "1", "--out",
                         str(out), monkeypatch=monkeypatch, capsys=capsys)
    assert out.read_bytes().startswith(b"\x89PNG")
    rows = [line.split(" | ") for line in printed.splitlines() if line.startswith("| ") and "---" not in line]
    assert [r[0][2:] for r in rows[1:]] == ["none", "[1]", "[2]", "[3]", "[4]", "[2,3]", "all", "all selective",
                                            "all + head", "all + head selective"]
    assert rows[1][2:] == ["1.0", "1.0 |"]


def test_stage_diagram_places_each_stage_at_its_stride(tmp_path):
    """docs/plans.md's diagram: a PNG, every backbone layer at the stride of its stage (from the dry run's own hooks,
    not from the stage analysis), the layers ``checkpoint_layers=head`` cuts marked in the neck and head only."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import stage_diagram

    out = tmp_path / "stages.png"
    rows = [[c.strip() for c in r.strip().strip("|").split("|")] for r in stage_diagram.draw("yolo11n.yaml", out)]
    assert out.read_bytes().startswith(b"\x89PNG")
    stages = model_stages("yolo11n.yaml")
    assert {int(i): int(k) for i, _, _, k in rows if k not in ("", "head")} == {
        i: k for k, ids in stages.items() for i in ids}
    assert all(float(s) == 2 ** int(k) for _, _, s, k in rows if k not in ("", "head"))
    assert [int(i) for i, *_, k in rows if k == "head"] == [13, 16, 17, 19, 20, 22, 23]  # C3k2, Conv, Detect


def test_epoch_memory_plot_draws_a_line_per_plan(tmp_path):
    """The per-epoch picture of docs/figures.md, from results.csv rows as the benchmark reads them."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import epoch_memory

    runs = {spec: [{"epoch": str(e), "mem/peak_tensor_GB": str(peak / e)} for e in (1, 2, 3)]
            for spec, peak in (("[]", 0.9), ("all", 0.5))}
    epoch_memory.plot(runs, "mem/peak_tensor_GB", "yolo11n", tmp_path / "epochs.png")
    assert (tmp_path / "epochs.png").read_bytes().startswith(b"\x89PNG")


def test_loss_memory_measures_the_loss_of_every_family(tmp_path, monkeypatch):
    """The loss alone (its forward and backward into detached head outputs, through the model's own ``loss``) is
    measured for a YOLO task model and for RT-DETR, and is less than the step that holds it (measured here by a
    fresh tracker around the whole training step)."""
    from yolo_ckpt.memory.step import build_model, training_batch

    from support import RTDETR_TINY

    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    from loss_memory import loss_alone

    YAML.save(tmp_path / "rtdetr-tiny.yaml", RTDETR_TINY)
    for name in ("yolo26n-sem.yaml", str(tmp_path / "rtdetr-tiny.yaml")):
        model = build_model(name)
        data = training_batch(model, StepShape(64, 2))
        alone = loss_alone(model, data)
        assert 0 < alone < measured_step(model, 64, 2), name


def test_the_network_alone_is_the_least_a_loss_plan_can_reach(monkeypatch):
    """The whole-network step's network alone (its backward fed the loss's gradients) is below the step where the
    loss sets the peak (yolo26n-sem's 19 full-resolution classes) and equal to it, up to a few scalars, where the
    network does (yolo11n's recompute), both measured by a fresh tracker around the step; ``chunked``'s step lies
    between the two, up to a few scalars."""
    from yolo_ckpt.memory.step import build_model, measure_peak, training_batch, with_plan
    from yolo_ckpt.regions.loss.install import enable_loss_checkpointing

    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    from loss_memory import network_alone

    for name, below in (("yolo26n-sem.yaml", True), ("yolo11n.yaml", False)):
        model = with_plan(build_model(name), PlanSettings.of("all", "full", "head"))
        data = training_batch(model, StepShape(192, 2))
        step, network = measure_peak(model, data).peak, network_alone(model, data)
        # equal up to 64 B: the loss's scalars, alive in the real step's backward, and the surrogate's in ours
        assert (network < step - 2**20) if below else abs(network - step) <= 64, name
        if below:
            enable_loss_checkpointing(model, "chunked")
            chunked = measure_peak(model, data).peak
            assert network - 64 <= chunked < step  # 64 B: the surrogate's scalars, which the real step lacks
