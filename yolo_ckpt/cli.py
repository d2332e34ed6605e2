"""``yolo-ckpt``: the ``yolo`` command with checkpointing in ``train``.

``yolo-ckpt train ...`` parses ``k=v`` tokens with Ultralytics' own helpers and checks keys against Ultralytics'
defaults plus ``cfg/default.yaml``, so unknown keys get the same error as ``yolo``; it then trains with the task's
checkpointing trainer. Without ``model=`` it builds the task's yolo11n YAML (yolo26n for semantic and depth; nothing to
download), without ``data=`` it trains on the embedded synthetic high-resolution dataset of the model's task;
``data=synthetic_medical`` (which ``cfg/medical_2048.yaml`` sets) picks the grayscale medical variant instead. A task
it has no trainer for, or a task word the model's head does not train, stops with one line. Every other mode is handed
to ``yolo`` unchanged.

``yolo-ckpt profile`` measures one training step per checkpoint plan (see ``yolo_ckpt.profiler``).

Example:
    $ yolo-ckpt profile model=yolo11n.yaml imgsz=640 batch=4
    $ yolo-ckpt train data=coco.yaml model=yolo11s.yaml imgsz=1280 batch=8 checkpoint_stages=[2,3]
    $ yolo-ckpt train                       # yolo11n on the embedded dataset, offline
    $ yolo-ckpt train cfg=cfg/medical_2048.yaml   # 1-channel segmentation on the embedded grayscale variant
    $ yolo-ckpt val model=runs/detect/train/weights/best.pt data=coco.yaml   # plain `yolo val`
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path
from types import SimpleNamespace

from ultralytics.cfg import (
    MODES,
    TASKS,
    check_dict_alignment,
    entrypoint,
    merge_equals_args,
    parse_key_value_pair,
)
from ultralytics.utils import LOGGER, YAML, checks

DEFAULT_MODELS = {  # built from YAML: nothing to download (`yolo` would fetch yolo26n.pt)
    "detect": "yolo11n.yaml",
    "segment": "yolo11n-seg.yaml",
    "semantic": "yolo26n-sem.yaml",  # no yolo11 semantic or depth YAML ships with Ultralytics 8.4.190
    "depth": "yolo26n-depth.yaml",
    "pose": "yolo11n-pose.yaml",
    "obb": "yolo11n-obb.yaml",
    "classify": "yolo11n-cls.yaml",
}


def parse_train_args(args: list[str]) -> dict:
    """Turn ``train`` tokens into overrides the way ``yolo`` does, accepting our keys too.

    Args:
        args: Command-line tokens after the program name, e.g. ``["train", "imgsz=1280", "checkpoint_stages=[2,3]"]``.

    Returns:
        (dict): Overrides for ``Model.train``, ``task`` included when given.

    Raises:
        SyntaxError: For unknown keys, as ``yolo`` raises.
    """
    from .resources import data_file
    from .trainer import DEFAULT_CFG_DICT_CKPT

    full = {**DEFAULT_CFG_DICT_CKPT, **dict.fromkeys((*TASKS, *MODES))}
    overrides: dict = {}
    for a in merge_equals_args(args):
        a = a.removeprefix("--").removesuffix(",")
        if "=" in a:
            try:
                k, v = parse_key_value_pair(a)
            except (NameError, SyntaxError, ValueError, AssertionError) as e:
                check_dict_alignment(full, {a: ""}, e)
            if k == "cfg" and v is not None:  # a custom default.yaml, as in `yolo cfg=custom.yaml`
                if not Path(v).exists() and Path(v).parent.name in {"", "cfg"}:  # our recipes, also from a wheel
                    with contextlib.suppress(FileNotFoundError):
                        v = data_file("cfg", Path(v).name)
                overrides = {**{k: v for k, v in YAML.load(checks.check_yaml(v)).items() if k != "cfg"}, **overrides}
            else:
                overrides[k] = v
        elif a in TASKS:
            overrides["task"] = a
        elif a in MODES:
            overrides["mode"] = a
        elif isinstance(DEFAULT_CFG_DICT_CKPT.get(a), bool):
            overrides[a] = True  # bare boolean flags, as `yolo train plots`
        else:
            check_dict_alignment(full, {a: ""})
    check_dict_alignment(full, overrides)
    return overrides


def train(args: list[str]) -> None:
    """Run ``yolo-ckpt train ...``."""
    from .stages import CheckpointConfigError
    from .trainer import YOLO, check_settings

    overrides = parse_train_args(args)
    overrides.pop("mode", None)
    task = overrides.pop("task", None)
    if overrides.get("resume") and not overrides.get("model"):
        raise CheckpointConfigError("resume needs the checkpoint: yolo-ckpt train resume model=path/to/last.pt")
    overrides["model"] = overrides.get("model") or DEFAULT_MODELS.get(task or "detect", DEFAULT_MODELS["detect"])
    if not overrides.get("resume"):  # reject bad settings before the model is built or the dataset generated
        check_settings(overrides["model"], {**overrides, "task": task})
    model = YOLO(overrides.pop("model"), task=task)
    data = overrides.get("data")
    if not overrides.get("resume") and (not data or embedded_variant(data)):
        from .synthetic import DEFAULT_VARIANT, recipe, recipe_tasks, synthetic_dataset

        variant = data or DEFAULT_VARIANT
        if model.task not in (tasks := recipe_tasks(recipe(variant))):  # one line, as for bad stages
            raise CheckpointConfigError(f"data={variant}: the embedded dataset has no {model.task} labels. "
                                        f"Valid tasks: {', '.join(tasks)}.")
        overrides["data"] = str(synthetic_dataset(model.task, variant=variant))
        missing = "" if data else "'data' argument is missing. "
        LOGGER.info(f"{missing}Using the embedded synthetic dataset 'data={overrides['data']}'.")
    model.train(**overrides)


def embedded_variant(data: object) -> bool:
    """Whether a ``data=`` value names an embedded synthetic dataset (``synthetic_hr``, ``synthetic_medical``).

    Like Ultralytics' ``data=coco8.yaml``, the name stands for a dataset yolo-ckpt generates for the model's task; a
    local file or directory of that name wins, so the names never hide user data.

    Args:
        data: The ``data=`` value.

    Returns:
        (bool): True when ``train`` should generate the embedded variant ``data`` names.
    """
    from .synthetic import VARIANTS

    return isinstance(data, str) and data in VARIANTS and not Path(data).exists()


def main(argv: list[str] | None = None) -> int:
    """Console entry point of ``yolo-ckpt`` (and ``python -m yolo_ckpt``)."""
    from .stages import CheckpointConfigError

    args = sys.argv[1:] if argv is None else argv
    if args[:1] == ["profile"]:
        profile(args[1:])
        return 0
    if "train" not in args:
        sys.argv[:] = ["yolo", *args]  # in place: Ultralytics' entrypoint reads its ARGV alias of sys.argv
        entrypoint()
        return 0
    try:
        train(args)
    except CheckpointConfigError as e:
        print(f"yolo-ckpt: error: {e}", file=sys.stderr)
        return 2
    return 0


def profile(args: list[str]) -> list[Path]:
    """Run ``yolo-ckpt profile model=... imgsz=... batch=...``: per-stage and per-plan figures, saved and printed."""
    from ultralytics.cfg import get_save_dir
    from ultralytics.utils import colorstr
    from ultralytics.utils.torch_utils import select_device

    from .profiler import build_model, compare_plans, profile_stages, standard_plans, write_profile
    from .tradeoff import tradeoffs
    from .trainer import DEFAULT_CFG_DICT_CKPT

    overrides = {k: v for k, v in parse_train_args(args).items() if k != "mode"}
    cfg = SimpleNamespace(**{**DEFAULT_CFG_DICT_CKPT, "batch": 4, "imgsz": 640, **overrides, "mode": "profile"})
    model_name = overrides.get("model") or DEFAULT_MODELS.get(overrides.get("task") or "detect", "yolo11n.yaml")
    model = build_model(model_name).to(select_device(cfg.device, verbose=False))
    cfg.task = cfg.task or model.task
    batch = int(cfg.batch) if cfg.batch >= 1 else 4
    stages = profile_stages(model, cfg.imgsz, batch, progress=True)
    plans = compare_plans(model, cfg.imgsz, batch, standard_plans(model), progress=True)
    fraction = cfg.batch if 0 < cfg.batch < 1 else 0.6
    extra = tradeoffs(model, cfg.imgsz, batch, cfg.memory_budget, fraction)
    LOGGER.info(f"\n{colorstr('profile:')} {model_name} imgsz={cfg.imgsz} batch={batch}, one training step each")
    front = [r for r in extra["candidates"] if r["pareto"]]
    for rows in (stages, plans, front, extra["untouchable"]):
        LOGGER.info("  ".join(f"{k:>14}" for k in rows[0]))
        for r in rows:
            LOGGER.info("  ".join(f"{str(v):>14}" for v in r.values()))
    for line in extra["notes"]:
        LOGGER.info(f"{colorstr('profile:')} {line}")
    paths = write_profile(get_save_dir(cfg), stages, plans, extra)
    LOGGER.info(f"{colorstr('profile:')} results saved to {paths[0].parent}")
    return paths
