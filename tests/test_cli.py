"""`yolo-ckpt` against `yolo`: same grammar and errors; bad checkpoint_stages stop before any work."""

import functools
import importlib.metadata
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from yolo_ckpt import YOLO, CheckpointConfigError
from yolo_ckpt.integration.cli import parse_train_args

YOLO_BIN = shutil.which("yolo") or pytest.fail("the `yolo` command of ultralytics is not installed")


def run(*cmd, env=None) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={**os.environ, **(env or {})})


def last_line(text: str) -> str:
    return [line for line in text.splitlines() if line.strip()][-1]


def test_parses_like_yolo():
    got = parse_train_args(["segment", "train", "imgsz=1280", "batch", "=", "8", "checkpoint_stages=[2,3]", "plots"])
    assert got == {"task": "segment", "mode": "train", "imgsz": 1280, "batch": 8, "checkpoint_stages": [2, 3],
                   "plots": True}
    assert parse_train_args(["train", "checkpoint_stages=all"])["checkpoint_stages"] == "all"
    assert parse_train_args(["train", "checkpoint_stages=3"])["checkpoint_stages"] == 3
    assert parse_train_args(["train", "checkpoint_stages=[]"])["checkpoint_stages"] == []
    assert parse_train_args(["train", "checkpoint_layers=[[10,12],22]"])["checkpoint_layers"] == [[10, 12], 22]
    assert parse_train_args(["train", "checkpoint_stages=auto", "checkpoint_layers=head"]) == {
        "mode": "train", "checkpoint_stages": "auto", "checkpoint_layers": "head"}


def test_unknown_key_is_one_line_naming_the_closest_key_as_yolo_finds_it(capsys):
    """A mistyped key stops ``train`` and ``profile`` with one line and exit 2 before any work; the key it suggests is
    the one Ultralytics' own ``yolo train`` names first for the same typo (for a key ``yolo`` knows). The first typo
    runs as a user runs it, in a process of its own; the others through the console script's ``main`` here, every
    line it prints counted, the log's too (a process each took 5 of this test's 6 processes' time)."""
    import logging

    from ultralytics.utils import LOGGER

    from yolo_ckpt.integration.cli import main

    ours = run(sys.executable, "-m", "yolo_ckpt", "train", "imgsz=64", "epochz=3")
    theirs = run(YOLO_BIN, "train", "imgsz=64", "epochz=3")
    assert ours.returncode == 2 and theirs.returncode != 0
    assert "Similar arguments are i.e. ['epochs=" in last_line(theirs.stderr)  # Ultralytics' closest: epochs
    assert (ours.stdout + ours.stderr).strip() == ("yolo-ckpt: error: 'epochz' is not a valid argument. Did you mean "
                                                   "epochs? (`yolo-ckpt help` lists every key)")

    def printed(args: list[str]) -> tuple[int, list[str]]:
        """``main``'s exit code and the lines it printed or logged (the log's stream may lie past ``capsys``)."""
        logged: list[str] = []
        handler = logging.Handler()
        handler.emit = lambda record: logged.extend(record.getMessage().splitlines())
        LOGGER.addHandler(handler)
        try:
            rc = main(args)
        finally:
            LOGGER.removeHandler(handler)
        out = capsys.readouterr()
        return rc, [line for line in (out.out + out.err).splitlines() + logged if line.strip()]

    for args, closest in ((["train", "checkpoint_stage=[2,3]"], "checkpoint_stages"),
                          (["train", "chekpoint_stages=1"], "checkpoint_stages"),
                          (["profile", "checkpoint_mod=full"], "checkpoint_mode")):
        rc, lines = printed(args)
        assert rc == 2 and len(lines) == 1 and f"Did you mean {closest}?" in lines[0], lines
    rc, lines = printed(["train", "imgsz="])
    assert rc == 2 and len(lines) == 1 and lines[0].startswith("yolo-ckpt: error: 'imgsz=' is not a valid"), lines


def test_a_deprecated_ultralytics_key_is_renamed_as_yolo_renames_it():
    """``boxes`` (Ultralytics' old name of ``show_boxes``) passes the key check with Ultralytics' warning, as in
    ``yolo``; the parsed overrides hold the new name."""
    assert parse_train_args(["train", "boxes=False"]) == {"mode": "train", "show_boxes": False}


def test_checks_says_whether_torch_and_torchvision_agree_then_runs_yolo_checks():
    """``yolo-ckpt checks``: our lines (the supported range, torch with torchvision through one real NMS call), then
    Ultralytics' own ``yolo checks``, whose package table follows."""
    rc, text = as_user(["checks"])
    assert rc == 0 and "torch + torchvision ✅ work together" in text and "(yolo-ckpt supports >=" in text
    assert text.index("torch + torchvision ✅") < text.index("Setup complete ✅")  # ours, then Ultralytics' own


def test_a_broken_torch_torchvision_pair_is_one_line_before_any_work(monkeypatch):
    """torchvision's operators missing (a torchvision built for another torch): the settings check stops with one
    line naming the pair, before any model is built (``torchvision.ops.nms`` made to fail as it does then)."""
    import torchvision

    from yolo_ckpt.integration.settings import check_settings

    def missing(*args, **kwargs):
        raise RuntimeError("operator torchvision::nms does not exist")

    monkeypatch.setattr(torchvision.ops, "nms", missing)
    with pytest.raises(CheckpointConfigError, match=r"^torch \S+ and torchvision \S+ do not work together "
                                                    r"\(operator torchvision::nms does not exist\)\. Valid: "):
        check_settings("yolo11n.yaml", {"checkpoint_stages": [2, 3]})


def as_user(args: list[str]) -> tuple[int, str]:
    """``yolo-ckpt *args`` as a user runs it, in a process of its own: its exit code and everything it printed."""
    out = run(sys.executable, "-m", "yolo_ckpt", *args)
    return out.returncode, out.stdout + out.stderr


@functools.cache
def yolo_help() -> str:
    """What Ultralytics' ``yolo help`` prints, run once for both spellings of ours."""
    return run(YOLO_BIN, "help").stdout


@pytest.mark.parametrize("args", [["help"], ["train", "--help"]])
def test_help_lists_our_keys_and_profile_then_ultralytics_help(args):
    rc, text = as_user(args)
    assert rc == 0
    ours = yaml.safe_load((Path(__file__).parents[1] / "cfg" / "default.yaml").read_text())
    for key, default in ours.items():  # each key with its default, valid values and an example
        block = text[text.index(f"    {key}  (default: "):]
        assert block.startswith(f"    {key}  (default: {'none' if default is None else default})")
        assert "valid:" in block.splitlines()[1] and f"example: yolo-ckpt train {key}=" in block
    assert "yolo-ckpt profile model=" in text and "Traceback" not in text
    theirs = yolo_help()
    assert theirs.strip().splitlines()[-1] in text and text.index("profile") < text.index("yolo TASK MODE ARGS")


@pytest.mark.parametrize("args, word", [(["train", "help"], "help"), (["train", "--help"], "help"), (["-h"], "help"),
                                        ([], "help"), (["--version"], "version"), (["-v"], "version"),
                                        (["train", "imgsz=64"], None), (["train", "name=help"], None)])
def test_every_spelling_of_help_and_version_is_the_word(args, word):
    """``main`` shows help for a bare ``help``/``-h``/``--help`` or nothing, as for ``help`` above (and `yolo`)."""
    from yolo_ckpt.integration.cli import _special

    assert (_special(args) if args else "help") == word


@pytest.fixture(scope="module")
def yolo11n():
    from ultralytics.nn.tasks import DetectionModel

    return DetectionModel("yolo11n.yaml", verbose=False)


def test_help_examples_are_valid_settings(yolo11n):
    from yolo_ckpt.integration.cli import KEY_HELP
    from yolo_ckpt.integration.settings import check_settings

    for key, (_, example) in KEY_HELP.items():
        parsed = parse_train_args(["train", example])
        assert list(parsed) == ["mode", key]
        needs = {"simulate_allocator": {"simulate_gpu": "1GB", "device": "cpu"},  # rounds a simulated GPU
                 "compile_memory_budget": {"compile": True},  # a budget of torch.compile
                 "compile_regions": {"compile": True, "checkpoint_stages": [2, 3]}}.get(key, {})  # a plan compiled
        check_settings(yolo11n, {**parsed, **needs})  # raises for an invalid value


def test_version_prints_ours_and_ultralytics():
    import ultralytics

    rc, text = as_user(["version"])
    project = importlib.metadata.version("yolo-ckpt")  # the installed distribution's, from pyproject.toml
    lines = text.splitlines()
    assert rc == 0 and lines[:2] == [f"yolo-ckpt {project}", f"ultralytics {ultralytics.__version__}"]


def test_other_modes_are_yolo():
    ours = run(sys.executable, "-m", "yolo_ckpt", "val", "model=yolo11n.yaml", "checkpoint_stages=2")
    theirs = run(YOLO_BIN, "val", "model=yolo11n.yaml", "checkpoint_stages=2")
    assert last_line(ours.stderr) == last_line(theirs.stderr)  # our key is train-only, as in `yolo`


BAD = ["0", "-1", "6", "[2,2]", "2.5", "two", "{'a':1}", "[2,'x']", "True"]


def in_process(args: list[str], capsys, monkeypatch, tmp_path) -> tuple[int, list[str]]:
    """``yolo-ckpt *args`` through the console script's own ``main`` in this process (the script itself runs in a
    process of its own for the first bad stage value, a bad budget, resume and a flat model): its exit code and the
    lines it printed to stderr. Datasets go to ``tmp_path / "datasets"``, so that generating one would show as a new
    file."""
    from yolo_ckpt.integration.cli import main

    monkeypatch.setenv("YOLO_CKPT_DATASETS", str(tmp_path / "datasets"))
    rc = main(list(args))
    return rc, [line for line in capsys.readouterr().err.splitlines() if line.strip()]


@pytest.mark.parametrize("value", BAD)
def test_bad_stages_cli_one_line_before_any_work(value, tmp_path, capsys, monkeypatch):
    earlier = tmp_path / "runs" / "train"
    earlier.mkdir(parents=True)
    (earlier / "results.csv").write_text("epoch\n1\n")
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    args = ["train", f"checkpoint_stages={value}", f"project={tmp_path / 'runs'}", "name=train", "exist_ok=True"]
    if value == BAD[0]:  # as a user runs it: the console script, in a process of its own
        out = run("yolo-ckpt", *args, env={"YOLO_CKPT_DATASETS": str(tmp_path / "datasets")})
        rc, errors = out.returncode, [line for line in out.stderr.splitlines() if line.strip()]
    else:
        rc, errors = in_process(args, capsys, monkeypatch, tmp_path)
    assert rc == 2
    assert len(errors) == 1 and errors[0].startswith("yolo-ckpt: error: checkpoint_stages=")
    assert "{1, 2, 3, 4, 5}" in errors[0]
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before  # no run dir, no dataset
    assert (earlier / "results.csv").read_text() == "epoch\n1\n"


@pytest.mark.parametrize("value", [0, [1, 1], 3.0, "P3", {"stage": 2}, 9])
def test_bad_stages_python_before_dataset_and_run_dir(value, tmp_path):
    with pytest.raises(CheckpointConfigError, match=r"\{1, 2, 3, 4, 5\}"):
        YOLO("yolov8n.yaml").train(data=str(tmp_path / "missing.yaml"), project=str(tmp_path), checkpoint_stages=value)
    assert list(tmp_path.iterdir()) == []  # a dataset error would mean the stages were checked too late


@pytest.mark.parametrize("args, valid", [
    (["checkpoint_loss=bogus"], "Valid: 'none' (Ultralytics' loss), 'exact'"),
    (["checkpoint_loss=exact", "depth"], "checkpoint_loss=exact: task=depth has no loss region"),
    (["checkpoint_loss=chunked", "model=yolov8n-cls.yaml"], "checkpoint_loss=chunked: task=classify has no"),
    (["checkpoint_loss=exact", "semantic"], "checkpoint_loss=exact: task=semantic has no"),
    (["checkpoint_loss=chunked", "model=rtdetr-l.yaml"], "checkpoint_loss=chunked: RT-DETR has no"),
])
def test_bad_loss_plan_cli_one_line_before_any_work(args, valid, tmp_path, capsys, monkeypatch):
    """A value ``checkpoint_loss`` does not know, or a task (model) whose loss it cannot recompute: one line naming
    what is valid, exit 2, no run directory and no dataset."""
    rc, errors = in_process(["train", *args, f"project={tmp_path / 'runs'}"], capsys, monkeypatch, tmp_path)
    assert rc == 2 and len(errors) == 1, errors
    assert errors[0].startswith("yolo-ckpt: error: checkpoint_loss=")
    assert valid in errors[0] and "Valid: " in errors[0]
    assert list(tmp_path.iterdir()) == []


def test_bad_loss_plan_python_before_dataset_and_run_dir(tmp_path):
    with pytest.raises(CheckpointConfigError, match="checkpoint_loss=exact: task=classify"):
        YOLO("yolov8n-cls.yaml").train(data=str(tmp_path / "missing"), project=str(tmp_path), checkpoint_loss="exact")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("args, valid", [
    (["compile_memory_budget=2", "compile=True"], "Valid: a number in (0, 1]"),
    (["compile_memory_budget=lots", "compile=True"], "Valid: a number in (0, 1]"),
    (["compile_memory_budget=0.3"], "Valid: with compile=True"),
    (["compile_regions=apart", "checkpoint_stages=all"], "Valid: with compile=True"),
    (["compile_regions=inside", "compile=True"], "Valid: 'graph' or 'apart'"),
    (["compile_regions=apart", "compile=True"], "Valid: with checkpoint_stages or checkpoint_layers"),
    (["compile_regions=apart", "compile=True", "checkpoint_stages=auto", "memory_budget=1GB", "batch=-1"],
     "Valid: a fixed batch"),
])
def test_bad_compile_budget_cli_one_line_before_any_work(args, valid, tmp_path, capsys, monkeypatch):
    """``compile_memory_budget`` outside torch's (0, 1], ``compile_regions`` not a place, either without
    ``compile=True`` (where it would change nothing), regions apart with no plan or with ``auto`` choosing the batch
    (from eager steps): one line naming what is valid, exit 2, no run directory and no dataset."""
    rc, errors = in_process(["train", *args, f"project={tmp_path / 'runs'}"], capsys, monkeypatch, tmp_path)
    assert rc == 2 and len(errors) == 1, errors
    assert errors[0].startswith(f"yolo-ckpt: error: {args[0].split('=')[0]}=") and valid in errors[0], errors
    assert list(tmp_path.iterdir()) == []


def test_bad_budget_cli_before_any_work(tmp_path):
    out = run("yolo-ckpt", "train", "memory_budget=lots", f"project={tmp_path / 'runs'}",
              env={"YOLO_CKPT_DATASETS": str(tmp_path / "datasets")})
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert out.stderr.strip() == "yolo-ckpt: error: memory_budget='lots' is invalid. Valid: a positive size such as " \
                                 "24GB, 512MB, 80GiB or 24."
    assert list(tmp_path.iterdir()) == []


def test_model_without_stages_is_rejected(tmp_path):
    cfg = tmp_path / "flat.yaml"
    cfg.write_text("nc: 1\nbackbone:\n  - [-1, 1, Conv, [16, 3, 1]]\nhead:\n  - [[0], 1, Detect, [nc]]\n")
    out = run("yolo-ckpt", "train", f"model={cfg}", "checkpoint_stages=all", f"project={tmp_path / 'runs'}")
    assert out.returncode == 2 and "no recognisable backbone stages" in out.stderr
    assert not (tmp_path / "runs").exists()


def test_high_resolution_recipe_is_valid():
    from yolo_ckpt.data.resources import data_file
    from yolo_ckpt.regions.plan import CheckpointPlan

    recipe = parse_train_args(["train", f"cfg={data_file('cfg', 'aerial_1280.yaml')}", "epochs=3"])
    assert recipe["imgsz"] == 1280 and recipe["epochs"] == 3  # the command line wins over the recipe
    assert CheckpointPlan.from_spec(recipe["model"], recipe["checkpoint_stages"]).stages == [1, 2, 3]


def test_resume_without_model_is_one_line(tmp_path):
    out = run("yolo-ckpt", "train", "resume", f"project={tmp_path}")
    assert out.returncode == 2 and out.stderr.strip() == (
        "yolo-ckpt: error: resume needs the checkpoint: yolo-ckpt train resume model=path/to/last.pt")


def test_every_task_has_a_default_model_of_its_task_and_an_embedded_set():
    """What ``test_defaults_follow_the_task`` trains for two tasks, for every task: the model the CLI picks is one of
    the task (as Ultralytics reads the YAML) and the embedded set of the task exists."""
    import ultralytics

    from yolo_ckpt.data.synthetic import TASKS
    from yolo_ckpt.regions.families import DEFAULT_MODELS

    assert set(DEFAULT_MODELS) == set(TASKS)
    for task, name in DEFAULT_MODELS.items():
        assert ultralytics.YOLO(name).task == task, (task, name)


# a task given by name (segment) and one inferred from model= (classify); the other tasks use the same lookups
@pytest.mark.parametrize("args, task", [(["segment", "train"], "segment"),
                                        (["train", "model=yolov8n-cls.yaml"], "classify")])
def test_defaults_follow_the_task(args, task, tmp_path):
    """Without model= or data=, the task's own model YAML, its embedded dataset and the demo recipe are used, and
    the run ends by comparing its plan with vanilla."""
    out = run(sys.executable, "-m", "yolo_ckpt", *args, "epochs=1", "imgsz=64", "checkpoint_stages=all",
              f"project={tmp_path}", "name=r", "plots=False", "fraction=0.25")  # 4 of the demo's 16 steps
    assert out.returncode == 0, out.stderr[-3000:]
    saved = yaml.safe_load((tmp_path / "r" / "args.yaml").read_text())
    assert saved["task"] == task and f"/{task}" in saved["data"]
    demo = yaml.safe_load((Path(__file__).parents[1] / "cfg" / "demo.yaml").read_text())
    assert {k: saved[k] for k in demo} == {**demo, "epochs": 1, "imgsz": 64}  # the command line wins
    text = re.sub(r"\x1b\[[0-9;]*m", "", out.stdout + out.stderr)
    vanilla = re.search(r"checkpoint:   vanilla +([\d.]+) +1\.000 +1\.000 +1\.00", text)
    ours = re.search(r"checkpoint:   stages \[[\d, ]+\] +([\d.]+) +([\d.]+) +([\d.]+)", text)
    assert vanilla and ours and float(ours[3]) > 1.0  # the recompute adds FLOPs
    assert abs(float(ours[1]) / float(vanilla[1]) - float(ours[2])) < 0.01
    column = [line.split(",") for line in (tmp_path / "r" / "results.csv").read_text().splitlines()]
    peak = max(float(r[column[0].index(k)]) for r in column[1:]  # the run's own peak, its validations' included
               for k in ("mem/peak_tensor_GB", "mem/val_peak_tensor_GB"))
    assert f"this run peaked at {peak:.3f} GB over its epochs and validations (mem/peak_tensor_GB" in text
    maps = [float(v) for k, v in zip(column[0], column[1]) if k.strip().startswith("metrics/mAP50(")]
    said = text.count("is trained from scratch and finds no object yet in its first epochs")
    assert said == (bool(maps) and not any(maps)), (maps, said)  # said once, where the first epoch's mAP is 0


def test_bad_mode_rejected_before_any_work(tmp_path):
    with pytest.raises(CheckpointConfigError, match="checkpoint_mode='fast' is invalid. Valid: 'full'") as e:
        YOLO("yolo11n.yaml").train(data=str(tmp_path / "missing.yaml"), project=str(tmp_path), checkpoint_mode="fast")
    assert "\n" not in str(e.value) and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("value", ["neck", "[[13,11]]", "[2]"])  # [2]: inside stage 2
def test_bad_layers_cli_one_line_before_any_work(value, tmp_path, capsys, monkeypatch):
    args = ["train", "checkpoint_stages=[2]", f"checkpoint_layers={value}", f"project={tmp_path / 'runs'}"]
    rc, errors = in_process(args, capsys, monkeypatch, tmp_path)
    assert rc == 2 and len(errors) == 1 and errors[0].startswith("yolo-ckpt: error: checkpoint_layers=")
    assert errors[0].endswith("Valid: 'head' (every layer after the backbone that stores activations), layer indices "
                              "0-23, [first, last] ranges of them, parts of a layer ('2.cv1', '2.m.0-cv2', '2.*'; "
                              "':full'/':selective' after any string item), or [] for none.")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("value, says", [
    ("[4.m.1,23.*]", "'m.1' is not a part of layer 4. Valid parts of layer 4 (C3k2): cv1, m.0, cv2"),
    ("[4.m.0-cv2:selective]", "4.m.0-cv2:selective is a run of parts of layer 4's own forward, recomputed full only"),
])
def test_bad_parts_cli_one_line_before_any_work(value, says, tmp_path, capsys, monkeypatch):
    """Parts as a user types them (an unquoted list), checked against the model before any work."""
    args = ["train", "checkpoint_stages=[2]", f"checkpoint_layers={value}", f"project={tmp_path / 'runs'}"]
    rc, errors = in_process(args, capsys, monkeypatch, tmp_path)
    assert rc == 2 and len(errors) == 1 and says in errors[0], errors
    assert list(tmp_path.iterdir()) == []


def test_profile_checks_our_keys_before_measuring(tmp_path):
    out = run(sys.executable, "-m", "yolo_ckpt", "profile", "checkpoint_stages=7", f"project={tmp_path}")
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert out.stderr.strip().splitlines() == [
        "yolo-ckpt: error: checkpoint_stages=7: yolo11n.yaml has no stage 7. Valid: a list of distinct stage numbers "
        "from {1, 2, 3, 4, 5}, a single stage, 'all', 'auto' (with memory_budget or CUDA), 'least' (the plan that "
        "keeps the least), or [] for off."]
    assert "plans" not in out.stdout + out.stderr and list(tmp_path.iterdir()) == []  # nothing measured or written


WORDS = {"checkpoint_stages": ["ALL", " All ", "AUTO"], "checkpoint_layers": ["Head"],
         "checkpoint_mode": ["SELECTIVE", "Selective", " Full "], "memory_budget": ["24gb", "24Gb", "512mib"]}


@pytest.fixture(scope="module")
def small():
    from copy import deepcopy

    from ultralytics.nn.tasks import DetectionModel

    from support import SMALL

    return DetectionModel(deepcopy(SMALL), verbose=False)


@pytest.mark.parametrize("key", WORDS)
def test_one_case_rule_for_every_word_value(key, small):
    """Word values of every key of ours are case-insensitive: each spelling means what the lower-case word means."""
    from yolo_ckpt.integration.settings import check_settings
    from yolo_ckpt.planning.autobatch import parse_memory
    from yolo_ckpt.regions.plan import CheckpointPlan

    base = {"memory_budget": "2GB"} if key == "checkpoint_stages" else {}  # auto needs a target without CUDA
    for value in WORDS[key]:
        check_settings(small, {**base, key: value})
        lower = value.strip().lower()
        if key == "checkpoint_stages" and lower == "all":
            assert CheckpointPlan.from_spec(small, value) == CheckpointPlan.from_spec(small, lower)
        if key == "checkpoint_layers":
            assert CheckpointPlan.from_spec(small, [], value) == CheckpointPlan.from_spec(small, [], lower)
        if key == "memory_budget":
            assert parse_memory(value) == parse_memory(lower)


def test_mode_reaches_training_in_lower_case(detect_data, tmp_path):
    from yolo_ckpt import DetectionTrainer

    trainer = DetectionTrainer(overrides={"data": detect_data, "model": "yolo11n.yaml", "project": str(tmp_path),
                                          "checkpoint_stages": [2], "checkpoint_mode": "Selective"})
    assert trainer.args.checkpoint_mode == "selective"


def test_the_demo_steps_the_optimizer_every_batch_whatever_the_batch():
    from ultralytics.utils import DEFAULT_CFG_DICT

    from yolo_ckpt.integration.cli import demo_settings

    assert demo_settings({})["nbs"] == demo_settings({})["batch"] == 1
    assert demo_settings({"batch": 8})["nbs"] == 8  # weight decay scales with batch / nbs: unchanged
    assert demo_settings({"batch": -1})["nbs"] == DEFAULT_CFG_DICT["nbs"]  # AutoBatch: Ultralytics' own
    assert demo_settings({"batch": 8, "nbs": 2})["nbs"] == 1  # the user's nbs wins when merged over the demo


MODELS_WE_CANNOT_PLAN_FOR = [
    (["model=yolov8s-worldv2.yaml"], "YOLO-World is not supported"),
    (["model=yoloe-11s.yaml"], "YOLOE is not supported"),
    (["task=foo"], "task='foo' is not a task yolo-ckpt trains. Valid: detect,"),
    (["model=rtdetr-l.yaml", "checkpoint_stages=1"], "rtdetr-l.yaml has no stage 1. Valid: a list of distinct stage "
                                                     "numbers from {2, 3, 4, 5}"),
]


@pytest.mark.parametrize("args, says", MODELS_WE_CANNOT_PLAN_FOR)
def test_models_and_tasks_we_cannot_plan_for_one_line_before_any_work(args, says, tmp_path, capsys, monkeypatch):
    """YOLO-World/YOLOE, an unknown task, RT-DETR's stages (the CLI builds RTDETR by name): one line, rc 2, nothing
    written — no run directory, no dataset. The first as a user runs it, in a process of its own; the others through
    the console script's ``main`` here (``in_process``: a process each cost 5 of a case's 7 s)."""
    argv = ["train", *args, f"project={tmp_path / 'runs'}"]
    if args == MODELS_WE_CANNOT_PLAN_FOR[0][0]:
        out = run(sys.executable, "-m", "yolo_ckpt", *argv, env={"YOLO_CKPT_DATASETS": str(tmp_path / "datasets")})
        assert "Traceback" not in out.stderr
        rc, errors = out.returncode, out.stderr.splitlines()
    else:
        rc, errors = in_process(argv, capsys, monkeypatch, tmp_path)
    errors = [line for line in errors if line.strip() and "WARNING" not in line]
    assert rc == 2 and len(errors) == 1, errors
    assert errors[0].startswith("yolo-ckpt: error: ") and says in errors[0] and "Valid" in errors[0]
    assert list(tmp_path.iterdir()) == []


TASKS_THE_MODEL_CANNOT_TRAIN = [
    (["train", "task=panoptic"], "task='panoptic' is not a task yolo-ckpt trains. Valid: detect, segment, "
                                 "semantic, depth, pose, obb, classify."),
    (["semantic", "train", "model=yolo11n.yaml"], "task=semantic: yolo11n.yaml is a detect model (its output layer "
     "trains detect). Valid: a semantic model such as yolo26n-sem.yaml, or task=detect."),
    (["depth", "train", "model=yolo26n-sem.yaml", "checkpoint_stages=auto", "memory_budget=1GB"],
     "task=depth: yolo26n-sem.yaml is a semantic model (its output layer trains semantic). Valid: a depth model such "
     "as yolo26n-depth.yaml, or task=semantic."),
]


@pytest.mark.parametrize("args, line", TASKS_THE_MODEL_CANNOT_TRAIN)
def test_task_the_model_cannot_train_is_one_line_before_any_work(args, line, tmp_path, capsys, monkeypatch):
    """Vanilla Ultralytics ends these in a traceback from inside the loss or the model loader. The first as a user
    runs it, in a process of its own; the others through the console script's ``main`` here (``in_process``)."""
    argv = [*args, f"project={tmp_path / 'runs'}"]
    if args == TASKS_THE_MODEL_CANNOT_TRAIN[0][0]:
        out = run(sys.executable, "-m", "yolo_ckpt", *argv, env={"YOLO_CKPT_DATASETS": str(tmp_path / "datasets")})
        assert "Traceback" not in out.stderr
        rc, errors = out.returncode, [x for x in out.stderr.splitlines() if x.strip()]
    else:
        rc, errors = in_process(argv, capsys, monkeypatch, tmp_path)
    assert rc == 2 and errors == [f"yolo-ckpt: error: {line}"]
    assert list(tmp_path.iterdir()) == []  # no run directory, no dataset


@pytest.mark.parametrize("name, task, imgsz, channels", [("medical_semantic_2048.yaml", "semantic", 2048, 1),
                                                         ("aerial_semantic_1024.yaml", "semantic", 1024, 3)])
def test_semantic_recipes_are_valid(name, task, imgsz, channels):
    """The recipes load as `yolo-ckpt train cfg=...` reads them, their settings pass the checks run before any work,
    and their embedded data has the channels they say."""
    from yolo_ckpt.data.resources import data_file
    from yolo_ckpt.data.synthetic import recipe
    from yolo_ckpt.integration.settings import check_settings, yaml_task

    cfg = parse_train_args(["train", f"cfg={data_file('cfg', name)}"])
    assert yaml_task(cfg["model"]) == task and cfg["imgsz"] == imgsz
    check_settings(cfg["model"], {**cfg, "task": task})
    assert recipe(cfg["data"]).get("channels", 3) == channels and task in recipe(cfg["data"])


def test_profile_follows_the_runs_amp_and_channels_last():
    """As Ultralytics' trainer picks them (8.4.190): AMP and channels_last on CUDA only; bf16 is bfloat16."""
    from types import SimpleNamespace

    import torch

    from yolo_ckpt.report.summary import training_formats

    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    run_cfg = lambda amp, cl: SimpleNamespace(amp=amp, channels_last=cl)  # noqa: E731
    assert training_formats(run_cfg(True, None), cpu) == (None, False)
    assert training_formats(run_cfg(True, None), cuda) == (torch.float16, True)
    assert training_formats(run_cfg("bf16", False), cuda) == (torch.bfloat16, False)
    assert training_formats(run_cfg(False, True), cuda) == (None, True)


@pytest.mark.parametrize("extra,line", [
    ({"checkpoint_layers": "head"}, "checkpoint_layers='head': checkpoint_stages=least chooses the layers itself. "
                                    "Valid: [] or nothing with least."),
    ({"checkpoint_mode": "selective"}, "checkpoint_mode='selective': checkpoint_stages=least chooses each region's "
                                       "mode itself. Valid: full or nothing with least.")])
def test_least_with_a_plan_of_its_own_is_one_line(extra, line):
    from yolo_ckpt.integration.settings import check_settings

    with pytest.raises(CheckpointConfigError, match=f"^{re.escape(line)}$"):
        check_settings("yolo11n.yaml", {"checkpoint_stages": "LEAST", **extra})
    check_settings("yolo11n.yaml", {"checkpoint_stages": " Least "})  # the case rule of every word value


def test_a_cfg_file_with_our_keys_trains_its_plan(detect_data, tmp_path):
    """``yolo-ckpt train cfg=my.yaml``, the file holding our keys beside Ultralytics' (as ``yolo train cfg=`` takes a
    custom default.yaml): the plan of the file trains (its recompute line in the log, and the run's own args.yaml),
    not vanilla; a key on the command line wins over the file's."""
    cfg = tmp_path / "my.yaml"
    cfg.write_text(yaml.safe_dump({"model": "yolo11n.yaml", "data": detect_data, "imgsz": 64, "epochs": 1, "batch": 4,
                                   "workers": 0, "plots": False, "checkpoint_stages": [2, 3],
                                   "checkpoint_mode": "selective"}))
    rc, text = as_user(["train", f"cfg={cfg}", "checkpoint_mode=full", f"project={tmp_path / 'runs'}", "name=r"])
    assert rc == 0, text[-3000:]
    assert "stage 2 (P2/4) layers [1, 2]: Conv, C3k2, recomputed as one region with stages [2, 3]" in text
    saved = yaml.safe_load((tmp_path / "runs" / "r" / "args.yaml").read_text())
    assert saved["checkpoint_stages"] == [2, 3] and saved["checkpoint_mode"] == "full"
