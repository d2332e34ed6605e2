"""``yolo-ckpt``: the ``yolo`` command with checkpointing in ``train``.

``yolo-ckpt train ...`` parses ``k=v`` tokens with Ultralytics' own helpers and checks keys against Ultralytics'
defaults plus ``cfg/default.yaml``, so unknown keys get the same error as ``yolo``; it then trains with the task's
checkpointing trainer. Without ``model=`` it builds the task's yolo11n YAML (yolo26n for semantic and depth; nothing to
download), without
``data=`` it trains on the embedded synthetic high-resolution dataset of the model's task with the demo recipe
``cfg/demo.yaml`` (unless ``cfg=`` is given); ``data=synthetic_medical`` (which ``cfg/medical_2048.yaml`` sets) picks
the grayscale medical variant instead. ``help`` prints our keys and modes before Ultralytics' help, ``version`` our
version beside Ultralytics' and torch's. Every other mode is handed to ``yolo`` unchanged.
A task it has no trainer for, or a task word the model's head does not train, stops with one line.

``yolo-ckpt profile`` measures one training step per checkpoint plan (see ``yolo_ckpt.report.profiler``).

Examples:
    $ yolo-ckpt profile model=yolo11n.yaml imgsz=640 batch=4
    $ yolo-ckpt train data=coco.yaml model=yolo11s.yaml imgsz=1280 batch=8 checkpoint_stages=[2,3]
    $ yolo-ckpt train                       # yolo11n on the embedded dataset, offline
    $ yolo-ckpt train cfg=cfg/medical_2048.yaml   # 1-channel segmentation on the embedded grayscale variant
    $ yolo-ckpt val model=runs/detect/train/weights/best.pt data=coco.yaml   # plain `yolo val`
"""

from __future__ import annotations

import contextlib
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
import ultralytics
from ultralytics.cfg import (
    MODES,
    TASKS,
    entrypoint,
    get_save_dir,
    merge_equals_args,
    parse_key_value_pair,
)
from ultralytics.utils import DEFAULT_CFG_DICT, LOGGER, RANK, YAML, checks, colorstr
from ultralytics.utils.checks import check_version
from ultralytics.utils.torch_utils import select_device

from ..data.resources import data_file
from ..data.synthetic import DEFAULT_VARIANT, VARIANTS, recipe, recipe_tasks, synthetic_dataset
from ..memory import step
from ..memory.device import SimulatedDevice
from ..memory.step import StepShape
from ..planning.autobatch import parse_memory
from ..planning.choice import measured_least
from ..planning.costs import Costs, unit_costs
from ..regions.families import DEFAULT_MODELS, ultralytics_class
from ..regions.loss.install import LOSS_HELP, check_loss_setting
from ..regions.settings import PlanSettings
from ..regions.spec import CheckpointConfigError
from ..report.profiler import compare_plans, profile_stages, standard_plans, time_x, within_noise, write_profile
from ..report.progress import Progress
from ..report.summary import training_formats
from ..report.tradeoff import tradeoffs
from ..versions import ULTRALYTICS_CHECKED, ULTRALYTICS_RANGE, __version__, torchvision_error
from .multitrain import is_several
from .offline import provide_fonts
from .settings import (
    CKPT_CFG_DICT,
    DEFAULT_CFG_DICT_CKPT,
    check_keys,
    check_settings,
    check_task,
    is_auto,
    is_least,
)
from .trainer import RTDETR, YOLO

DEMO = "demo.yaml"  # the main job's settings, used when neither data= nor cfg= is given
# keys of a run's args.yaml that belong to that run: trained again from it (cfg=args.yaml), a run gets its own
# directory instead of writing into the old one's (Ultralytics' get_save_dir takes a save_dir as given)
PAST_RUN = ("cfg", "save_dir")


KEY_HELP = {  # key: (valid values, example); defaults come from cfg/default.yaml
    "checkpoint_stages": ("backbone stage numbers (stage k: output stride 2^k; yolo11n has 1-5) as a list, one stage, "
                          "'all', 'auto' (the plan with the least predicted step time that fits; needs memory_budget "
                          "or CUDA), 'least' (the plan that keeps the least for this model, measured), or [] for off",
                          "checkpoint_stages=[2,3]"),
    "checkpoint_layers": ("'head' (every layer after the backbone that stores activations), layer indices and "
                          "[first, last] ranges (one region each), parts of a layer ('2.cv1', a run '2.m.0-cv2', each "
                          "part '23.*'; nested inside other regions), any string item with ':full' or ':selective', "
                          "or [] for none", "checkpoint_layers=head"),
    "checkpoint_mode": ("'full' (keep only each region's input) or 'selective' (also keep the outputs that are "
                        "costly to recompute per byte: convolutions, pooling; almost no recompute FLOPs, less "
                        "saving)", "checkpoint_mode=selective"),
    "compile_memory_budget": ("with compile=True, a number in (0, 1]: torch.compile's activation_memory_budget while "
                              "the model compiles (checkpoint_stages=auto under compile=True chooses it)",
                              "compile_memory_budget=0.3"),
    "compile_regions": ("with compile=True and a plan, 'graph' (the plan's regions recompute inside the model's one "
                        "compiled graph) or 'apart' (each full region compiled on its own and recomputed region by "
                        "region, as eagerly: less memory, graph breaks cost time; with checkpoint_stages=auto, auto "
                        "may choose either)", "compile_regions=apart"),
    "checkpoint_loss": (LOSS_HELP, "checkpoint_loss=chunked"),
    "checkpoint_compare": ("True or False; a bare checkpoint_compare means True", "checkpoint_compare=True"),
    "memory_budget": ("a device memory size (24GB, 512MB, 80GiB, or 24 meaning GB) that AutoBatch (batch=-1 or "
                      "batch=0.x) and checkpoint_stages=auto plan for, on any device", "memory_budget=24GB"),
    "simulate_gpu": ("with device=cpu, a GPU memory size (925MB, 24GB) to rehearse on CPU: every tensor of the run "
                     "counts against it, and passing it raises CUDA's out-of-memory error", "simulate_gpu=925MB"),
    "simulate_allocator": ("True or False: with simulate_gpu, every tensor counts for the block CUDA's caching "
                           "allocator would give it (512-byte blocks, large segments rounded to 2 MiB)",
                           "simulate_allocator=True"),
}
HELP_WORDS = {"help", "h"}  # as Ultralytics' entrypoint: help, h, -h, --help, ...
VERSION_WORDS = {"version", "v"}


def _special(args: list[str]) -> str | None:
    """``help`` or ``version`` when a bare token asks for it (the first one wins, as in ``yolo``), else ``None``."""
    for a in args:
        word = a.lstrip("-").lower()
        if "=" not in a and word in HELP_WORDS | VERSION_WORDS:
            return "help" if word in HELP_WORDS else "version"
    return None


def help_text() -> str:
    """yolo-ckpt's own help: its modes, and each of its keys with default, valid values and an example."""
    lines = [
        "yolo-ckpt: the `yolo` command with activation checkpointing in `train`, and a `profile` mode.",
        "",
        "    yolo-ckpt train [yolo train ARGS] [yolo-ckpt KEYS]   train, recomputing the chosen regions in backward",
        "    yolo-ckpt train checkpoint_stages=all                the demo: yolo11n on the embedded dataset, offline",
        "    yolo-ckpt profile model=yolo11n.yaml imgsz=640 batch=4 [memory_budget=24GB]",
        "                                                         measure one training step per checkpoint plan",
        "    yolo-ckpt version                                    yolo-ckpt, Ultralytics and torch versions",
        "    yolo-ckpt checks                                     versions, whether torch and torchvision agree,",
        "                                                         then Ultralytics' `yolo checks`",
        "    yolo-ckpt val|predict|export|... ARGS                `yolo` unchanged",
        "",
        "yolo-ckpt keys (train and profile; defaults from cfg/default.yaml; word values such as all, auto, head,",
        "full, selective and GB are case-insensitive):",
    ]
    for key, default in CKPT_CFG_DICT.items():
        valid, example = KEY_HELP[key]
        lines += [f"    {key}  (default: {'none' if default is None else default})",
                  textwrap.fill(valid, 118, initial_indent=" " * 8 + "valid:   ", subsequent_indent=" " * 17),
                  f"        example: yolo-ckpt train {example}"]
    return "\n".join([*lines, "", "Ultralytics' own help follows; every `yolo` argument works with yolo-ckpt too."])


def versions() -> str:
    """``yolo-ckpt ...``, ``ultralytics ...`` and ``torch ...``: the installed versions, one per line."""
    return f"yolo-ckpt {__version__}\nultralytics {ultralytics.__version__}\ntorch {torch.__version__}"


def environment_checks() -> str:
    """``yolo-ckpt checks``' own lines: the Ultralytics range yolo-ckpt supports and whether this one is in it, and
    whether torch and torchvision work together."""
    inside = check_version(ultralytics.__version__, ULTRALYTICS_RANGE)
    mark = "✅" if inside else "❌"
    lines = [f"ultralytics {ultralytics.__version__} {mark} (yolo-ckpt supports {ULTRALYTICS_RANGE}, read against "
             f"{ULTRALYTICS_CHECKED})"]
    error = torchvision_error()
    lines.append(f"torch + torchvision {'❌ ' + error if error else '✅ work together (torchvision.ops.nms runs)'}")
    return "\n".join(lines)


def parse_train_args(args: list[str]) -> dict:
    """Turn ``train`` tokens into overrides the way ``yolo`` does, accepting our keys too.

    Args:
        args: Command-line tokens after the program name, e.g. ``["train", "imgsz=1280", "checkpoint_stages=[2,3]"]``.

    Returns:
        (dict): Overrides for ``Model.train``, ``task`` included when given.

    Raises:
        CheckpointConfigError: For an unknown key or an unreadable token, one line naming the closest valid key.
    """
    full = {**DEFAULT_CFG_DICT_CKPT, **dict.fromkeys((*TASKS, *MODES))}
    overrides: dict = {}
    for a in merge_equals_args(args):
        a = a.removeprefix("--").removesuffix(",")
        if "=" in a:
            try:
                k, v = parse_key_value_pair(a)
            except (NameError, SyntaxError, ValueError, AssertionError) as e:
                raise CheckpointConfigError(f"'{a}' is not a valid argument: {str(e) or type(e).__name__}. Valid: "
                                            f"key=value, e.g. imgsz=1280 checkpoint_stages=[2,3]") from None
            if k == "cfg" and v is not None:  # a custom default.yaml, as in `yolo cfg=custom.yaml`
                if not Path(v).exists() and Path(v).parent.name in {"", "cfg"}:  # our recipes, also from a wheel
                    with contextlib.suppress(FileNotFoundError):
                        v = data_file("cfg", Path(v).name)
                overrides = {**{k: v for k, v in YAML.load(checks.check_yaml(v)).items() if k not in PAST_RUN},
                             **overrides}
            else:
                overrides[k] = v
        elif a in TASKS:
            overrides["task"] = a
        elif a in MODES:
            overrides["mode"] = a
        elif isinstance(DEFAULT_CFG_DICT_CKPT.get(a), bool):
            overrides[a] = True  # bare boolean flags, as `yolo train plots`
        else:
            check_keys({a: ""}, full)
    check_keys(overrides, full)
    return overrides


def given(args: list[str], key: str) -> bool:
    """Whether the command line sets ``key`` (``key=value``, also ``--key=value`` or with spaces around ``=``)."""
    return any(a.removeprefix("--").split("=")[0] == key for a in merge_equals_args(args))


def demo_settings(overrides: dict) -> dict:
    """``cfg/demo.yaml``, with its optimizer step every batch kept when the command line changes the batch.

    ``nbs`` (Ultralytics' nominal batch) is the demo's batch; a ``batch=`` of the user's gets ``nbs`` equal to it, as
    weight decay scales with batch/nbs; AutoBatch (``batch`` < 1) gets Ultralytics' own ``nbs``.
    """
    demo = YAML.load(data_file("cfg", DEMO))
    batch = overrides.get("batch")
    if isinstance(batch, (int, float)) and "nbs" not in overrides:
        demo["nbs"] = int(batch) if batch >= 1 else DEFAULT_CFG_DICT["nbs"]
    return demo


def train(args: list[str]) -> None:
    """Run ``yolo-ckpt train ...``; without ``data=`` or ``cfg=``, the demo recipe ``cfg/demo.yaml`` fills in what the
    command line leaves out."""
    overrides = parse_train_args(args)
    overrides.pop("mode", None)
    if not overrides.get("data") and not overrides.get("resume") and not given(args, "cfg"):  # the demo
        overrides = {**demo_settings(overrides), **overrides}
    task = overrides.pop("task", None)
    check_task(None, task)  # before the default model is looked up for it
    if overrides.get("resume") and not overrides.get("model"):
        raise CheckpointConfigError("resume needs the checkpoint: yolo-ckpt train resume model=path/to/last.pt")
    overrides["model"] = overrides.get("model") or DEFAULT_MODELS.get(task or "detect", DEFAULT_MODELS["detect"])
    if not overrides.get("resume"):  # reject bad settings before the model is built or the dataset generated
        check_settings(overrides["model"], {**overrides, "task": task})
    cls = model_class(overrides["model"])
    model = cls(overrides.pop("model"), **({} if cls is RTDETR else {"task": task}))  # RT-DETR: detect only, as `yolo`
    check_task(None, model.task)  # a checkpoint's own task (its file decides, whatever task= says)
    data = overrides.get("data")
    if not overrides.get("resume") and (not data or embedded_variant(data)):
        variant = data or DEFAULT_VARIANT
        if model.task not in (tasks := recipe_tasks(recipe(variant))):  # one line, as for bad stages
            raise CheckpointConfigError(f"data={variant}: the embedded dataset has no {model.task} labels. "
                                        f"Valid tasks: {', '.join(tasks)}.")
        overrides["data"] = str(synthetic_dataset(model.task, variant=variant))
        missing = "" if data else "'data' argument is missing. "
        LOGGER.info(f"{missing}Using the embedded synthetic dataset 'data={overrides['data']}'.")
    metrics = model.train(**overrides)
    if is_several(data) and (failed := [name for name, m in (metrics or {}).items() if m is None]):
        raise DatasetsFailed(f"{len(failed)} of {len(data)} datasets did not train: {', '.join(failed)} (each one's "
                             f"error is above); the others' runs are saved")


class DatasetsFailed(RuntimeError):
    """Some of several datasets did not train (each one's error was logged as it failed): the command exits 1."""


def model_class(model: object) -> type:
    """Our drop-in model class for a ``model=`` value, chosen by name as ``yolo`` chooses Ultralytics' own."""
    return RTDETR if ultralytics_class(model) is ultralytics.RTDETR else YOLO


def embedded_variant(data: object) -> bool:
    """Whether a ``data=`` value names an embedded synthetic dataset (``synthetic_hr``, ``synthetic_medical``,
    ``synthetic_dense``).

    Like Ultralytics' ``data=coco8.yaml``, the name stands for a dataset yolo-ckpt generates for the model's task; a
    local file or directory of that name wins, so the names never hide user data.

    Args:
        data: The ``data=`` value.

    Returns:
        (bool): True when ``train`` should generate the embedded variant ``data`` names.
    """
    return isinstance(data, str) and data in VARIANTS and not Path(data).exists()


def main(argv: list[str] | None = None) -> int:
    """Console entry point of ``yolo-ckpt`` (and ``python -m yolo_ckpt``)."""
    args = sys.argv[1:] if argv is None else argv
    provide_fonts()  # YOLO_OFFLINE: every mode, `yolo val` too, finds its plotting font without a network call
    special = _special(args) if args else "help"
    if special == "version":
        LOGGER.info(versions())
        return 0
    if special == "help":
        LOGGER.info(help_text())
    if args[:1] == ["checks"]:  # ours first, then Ultralytics' own `yolo checks`
        LOGGER.info(f"{versions()}\n{environment_checks()}\n")
    if special or "train" not in args and args[:1] != ["profile"]:
        sys.argv[:] = ["yolo", *args]  # in place: Ultralytics' entrypoint reads its ARGV alias of sys.argv
        entrypoint()
        return 0
    try:
        if args[:1] == ["profile"]:
            profile(args[1:])
        else:
            train(args)
    except CheckpointConfigError as e:
        if RANK in {-1, 0}:  # under torchrun every rank stops with the same line; rank 0 shows it
            print(f"yolo-ckpt: error: {e}", file=sys.stderr)
        return 2
    except DatasetsFailed as e:
        print(f"yolo-ckpt: error: {e}", file=sys.stderr)
        return 1
    return 0


def profile(args: list[str], costs: Costs | None = None, candidates: bool = True,
            repeats: int | None = None) -> list[Path]:
    """Run ``yolo-ckpt profile model=... imgsz=... batch=...``: per-stage and per-plan figures, saved and printed.

    With ``simulate_gpu=SIZE`` (CPU only, as in ``train``) the whole profile, the model built included, runs on a
    ``SimulatedDevice`` of that size; there and on CUDA a plan whose step does not fit the device is reported with
    ``fits`` false and no figures.

    ``costs`` (from Python only): the model's ``costs.unit_costs`` at this ``imgsz`` on this device, with
    ``step.OBJECTS_PER_IMAGE`` objects, when the caller has already measured them (``benchmarks/every_model.py``
    plans with the same costs afterwards); otherwise the profile measures them. ``candidates=False`` (from Python
    only): the stages and plans tables alone, without ``tradeoff.tradeoffs`` (every candidate plan measured, most of a
    profile's time), for a caller that checks only those (``tests/test_every_model.py``). ``repeats`` (from Python
    only): timed rounds of the plans (``None``: as planning times; 0: none, no time figures).
    """
    overrides = {k: v for k, v in parse_train_args(args).items() if k != "mode"}
    # no task= given: the model's own (``_profile_model``), as ``train`` infers it, not Ultralytics' default detect
    cfg = SimpleNamespace(**{**DEFAULT_CFG_DICT_CKPT, "batch": 4, "imgsz": 640, "task": None, **overrides,
                             "mode": "profile"})
    model_name = overrides.get("model") or DEFAULT_MODELS.get(overrides.get("task") or "detect", "yolo11n.yaml")
    check_settings(model_name, vars(cfg))  # as train does: one line before anything is measured
    model, amp = _profile_model(model_name, cfg)
    with contextlib.ExitStack() as stack:
        if cfg.simulate_gpu is not None:  # as in train: the model, built before, lives on the device too
            gpu = stack.enter_context(SimulatedDevice(parse_memory(cfg.simulate_gpu), bool(cfg.simulate_allocator)))
            gpu.track([*model.parameters(), *model.buffers()])
            LOGGER.info(f"{colorstr('profile:')} simulate_gpu={cfg.simulate_gpu}: a {gpu.limit / 2**30:.3f} GB device "
                        f"on CPU, {gpu.counts}")
        stages, plans, extra, batch = _profile_tables(model, cfg, amp, costs, candidates, repeats)
        if cfg.simulate_gpu is not None:
            extra.setdefault("notes", []).append(f"the simulated device peaked at "
                                                 f"{gpu.max_memory_allocated() / 2**20:.1f} MiB of "
                                                 f"{gpu.limit / 2**20:.1f} MiB")
    LOGGER.info(f"\n{colorstr('profile:')} {model_name} imgsz={cfg.imgsz} batch={batch}, one training step each")
    for line in plans_table(plans, budget=cfg.memory_budget is not None or cfg.simulate_gpu is not None):
        LOGGER.info(f"  {line}")
    for line in extra.get("notes", []):
        LOGGER.info(f"{colorstr('profile:')} {line}")
    paths = write_profile(get_save_dir(cfg), stages, plans, extra)
    LOGGER.info(f"{colorstr('profile:')} every figure (stages, candidates, what no plan touches) saved to "
                f"{paths[0].parent}")
    if line := recommendation(plans, f"yolo-ckpt train model={model_name} imgsz={cfg.imgsz} batch={batch}"):
        LOGGER.info(f"{colorstr('profile:')} {line}")
    return paths


def plans_table(rows: list[dict], budget: bool) -> list[str]:
    """``profile``'s console table, one line per plan: peak MiB, and memory, FLOPs and step time as multiples of
    vanilla's (the time with its noise: ``time_x``); ``fits`` only where a budget or device bounds the steps. The raw
    columns are in the saved files."""
    def cell(v: Any, spec: str) -> str:
        return "-" if v is None else format(v, spec)

    head = f"{'plan':<34}{'peak MiB':>10}{'x vanilla':>11}{'FLOPs x':>9}{'time x':>13}" + ("   fits" if budget else "")
    lines = [head]
    for r in rows:  # a figure not measured (the step did not fit the device) shows as "-"
        name = r["plan"] if len(r["plan"]) <= 33 else r["plan"][:32] + "…"
        lines.append(f"{name:<34}{cell(r['peak_MiB'], '.1f'):>10}{cell(r['peak_ratio'], '.3f'):>11}"
                     f"{cell(r['flops_ratio'], '.3f'):>9}{time_x(r):>13}"
                     + (f"{'yes' if r['fits'] else 'no':>7}" if budget else ""))
    if any(r.get("time_spread") is not None for r in rows[1:]):
        lines.append("time x: the median of interleaved rounds, ± half their spread over vanilla's same round; "
                     "~1: within that noise")
    return lines


def recommendation(rows: list[dict], command: str) -> str | None:
    """The plan of ``rows`` that keeps the least, as the command that trains it, or ``None`` when no plan keeps less
    than vanilla."""
    measured = [r for r in rows[1:] if r["fits"] and r["peak_ratio"] is not None and r["peak_ratio"] < 1]
    if not measured:
        return None
    best = min(measured, key=lambda r: (r["peak_ratio"], r["flops_ratio"]))
    time = ("" if best["time_ratio"] is None else ", its time within the timing noise" if within_noise(best)
            else f", {best['time_ratio']:.2f}x its time")
    return f"the least memory of these plans, {best['plan']} ({best['peak_ratio']:.2f}x vanilla's step{time}), " \
           f"trains with:\n  {command} {best['keys']}"


def _profile_model(model_name: str, cfg: SimpleNamespace) -> tuple[Any, Any]:
    """The model to profile on the run's device, in the run's memory format, and the run's autocast dtype."""
    device = select_device(cfg.device, verbose=False)
    amp, channels_last = training_formats(cfg, device)
    model = step.build_model(model_name).to(device)  # looked up at the call: a caller may substitute its own
    cfg.task = cfg.task or model.task
    return (model.to(memory_format=torch.channels_last) if channels_last else model), amp


def _profile_tables(model: Any, cfg: SimpleNamespace, amp: Any, costs: Costs | None = None,
                    candidates: bool = True, repeats: int | None = None) -> tuple[list[dict], list[dict], dict, int]:
    """``profile``'s measured tables: ``(stages, plans, tradeoffs, batch)`` (``candidates=False``: no tradeoffs,
    ``{}``)."""
    batch = int(cfg.batch) if cfg.batch >= 1 else 4
    plans = standard_plans(model)
    loss = check_loss_setting(cfg.checkpoint_loss, cfg.task, str(cfg.model or ""))  # least: the task's own
    shape = StepShape(cfg.imgsz, batch, amp=amp)
    if is_least(cfg.checkpoint_stages):  # the plan that keeps the least, as a run with these keys measures it
        plans["least"] = measured_least(model, unit_costs(model, shape, timed=False), shape).settings.with_loss(loss)
    elif not is_auto(cfg.checkpoint_stages) and (cfg.checkpoint_stages or cfg.checkpoint_layers):  # the user's too
        plans["yours"] = PlanSettings.from_keys(cfg).with_loss(loss)
    if loss != "none":  # the loss plan alone and with the whole network (every other row: Ultralytics' loss)
        plans[f"loss {loss}"] = PlanSettings(loss=loss)
        plans[f"all + head, loss {loss}"] = PlanSettings.of("all", layers="head", loss=loss)
    with Progress(colorstr("profile:")) as track:  # one bar over the whole profile, saying what it measures now
        stages = profile_stages(model, shape, track)
        plans = compare_plans(model, shape, plans, repeats, track)
        if not candidates:
            return stages, plans, {}, batch
        fraction = cfg.batch if 0 < cfg.batch < 1 else 0.6
        return stages, plans, tradeoffs(model, shape, cfg.memory_budget, fraction, costs=costs, track=track), batch
