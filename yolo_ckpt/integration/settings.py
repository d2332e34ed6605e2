"""Our keys (``cfg/default.yaml``) beside Ultralytics' own: read, checked in one line before any work, saved."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from difflib import get_close_matches
from pathlib import Path
from typing import Any

import torch
import ultralytics.nn.modules as modules
import ultralytics.nn.modules.head as heads
from ultralytics.cfg import DEFAULT_CFG_DICT, check_dict_alignment
from ultralytics.nn.tasks import guess_model_task, yaml_model_load
from ultralytics.utils import LOGGER, YAML

from ..data.resources import data_file
from ..memory.device import parse_device
from ..planning.autobatch import parse_memory
from ..regions.families import DEFAULT_MODELS, check_supported
from ..regions.install import check_plan
from ..regions.loss.install import check_loss_setting
from ..regions.plan import CheckpointPlan
from ..regions.recompute import MODES
from ..regions.spec import CheckpointConfigError, plain, word
from ..versions import torchvision_error

CKPT_CFG_DICT: dict[str, Any] = YAML.load(data_file("cfg", "default.yaml"))  # our keys and their defaults
DEFAULT_CFG_DICT_CKPT: dict[str, Any] = {**DEFAULT_CFG_DICT, **CKPT_CFG_DICT}  # what `yolo-ckpt train` accepts
COMPILE_REGIONS = ("graph", "apart")  # compile_regions: in the model's one compiled graph, or each region apart


def check_settings(model: Any, args: dict) -> None:
    """Reject bad values of our keys with one line naming what is valid.

    Args:
        model: The model argument (YAML, ``.pt`` or built model) that ``checkpoint_stages`` refers to, or ``None``.
        args: Training arguments holding ``checkpoint_stages``, ``checkpoint_layers``, ``checkpoint_mode`` and
            ``memory_budget``.

    Raises:
        CheckpointConfigError: For a model family yolo-ckpt cannot train, invalid stages of this model, an unknown
            mode or an unreadable memory budget.
    """
    args = {**args, **{k: plain(args[k]) for k in ("checkpoint_stages", "checkpoint_layers") if k in args}}
    if error := torchvision_error():  # else the first validation ends the run in torchvision's NMS
        raise CheckpointConfigError(error)
    if model is not None:
        check_supported(model)
    for key in ("memory_budget", "simulate_gpu"):
        if args.get(key) is not None:
            try:
                parse_memory(args[key])
            except ValueError as e:
                raise CheckpointConfigError(str(e).replace("memory_budget=", f"{key}=")) from None
    budget = args.get("compile_memory_budget")
    if budget is not None and (isinstance(budget, bool) or not isinstance(budget, (int, float)) or not 0 < budget <= 1):
        raise CheckpointConfigError(f"compile_memory_budget={budget} is not torch.compile's activation_memory_budget. "
                                    f"Valid: a number in (0, 1], e.g. 0.3 (with compile=True), or empty.")
    if budget is not None and not args.get("compile"):  # it would change nothing: never silently ignored
        raise CheckpointConfigError(f"compile_memory_budget={budget} is torch.compile's budget and this run does not "
                                    f"compile. Valid: with compile=True, or no compile_memory_budget.")
    regions = word(args.get("compile_regions") or "graph")
    if regions not in COMPILE_REGIONS:
        raise CheckpointConfigError(f"compile_regions={args['compile_regions']!r} is not a place to recompute under "
                                    f"compile. Valid: 'graph' or 'apart' (with compile=True).")
    if regions == "apart" and not args.get("compile"):  # it would change nothing: never silently ignored
        raise CheckpointConfigError("compile_regions=apart compiles a plan's regions apart and this run does not "
                                    "compile. Valid: with compile=True, or compile_regions=graph.")
    batch = args.get("batch")
    if regions == "apart" and is_auto(args.get("checkpoint_stages")) and isinstance(batch, (int, float)) and \
            not isinstance(batch, bool) and batch < 1:  # a fixed batch's auto measures apart; AutoBatch plans eagerly
        raise CheckpointConfigError(f"compile_regions=apart with checkpoint_stages=auto and batch={batch}: auto "
                                    f"chooses the batch from eager steps, in one graph. Valid: a fixed batch, or "
                                    f"compile_regions=graph.")
    if regions == "apart" and plain(args.get("checkpoint_stages")) in (None, [], "") and \
            not args.get("checkpoint_layers"):
        raise CheckpointConfigError("compile_regions=apart compiles a plan's regions apart and this run has no plan. "
                                    "Valid: with checkpoint_stages or checkpoint_layers, or compile_regions=graph.")
    if args.get("simulate_allocator") and args.get("simulate_gpu") is None:
        raise CheckpointConfigError("simulate_allocator=True rounds the tensors of a simulated GPU. Valid: with "
                                    "simulate_gpu=SIZE and device=cpu, or simulate_allocator=False.")
    if args.get("simulate_gpu") is not None and trains_on_cuda(args.get("device")):
        raise CheckpointConfigError(f"simulate_gpu={args['simulate_gpu']!r} rehearses a GPU on CPU. Valid: with "
                                    f"device=cpu, or no simulate_gpu on a CUDA device (its own memory counts).")
    if is_auto(args.get("checkpoint_stages")):
        if args.get("checkpoint_layers"):
            raise CheckpointConfigError(f"checkpoint_layers={args['checkpoint_layers']!r}: checkpoint_stages=auto "
                                        f"chooses the layers and the mode itself. Valid: [] or nothing with auto.")
        if args.get("memory_budget") is None and args.get("simulate_gpu") is None and \
                not trains_on_cuda(args.get("device")):
            raise CheckpointConfigError("checkpoint_stages=auto needs a memory target: memory_budget=24GB (any "
                                        "device), a CUDA device (its memory) or simulate_gpu=24GB with device=cpu.")
    if is_least(args.get("checkpoint_stages")):
        if args.get("checkpoint_layers"):
            raise CheckpointConfigError(f"checkpoint_layers={args['checkpoint_layers']!r}: checkpoint_stages=least "
                                        f"chooses the layers itself. Valid: [] or nothing with least.")
        if (word(args.get("checkpoint_mode")) or "full") != "full":
            raise CheckpointConfigError(f"checkpoint_mode={args['checkpoint_mode']!r}: checkpoint_stages=least "
                                        f"chooses each region's mode itself. Valid: full or nothing with least.")
    if (mode := word(args.get("checkpoint_mode")) or "full") not in MODES:
        raise CheckpointConfigError(f"checkpoint_mode={mode!r} is invalid. Valid: 'full' (recompute whole stages) or "
                                    f"'selective' (keep outputs costly to recompute, recompute the rest).")
    check_task(model, args.get("task"))
    check_loss_setting(args.get("checkpoint_loss"), args.get("task") or yaml_task(model), model_name(model))
    if model is not None and not (is_auto(args.get("checkpoint_stages")) or is_least(args.get("checkpoint_stages"))):
        plan = CheckpointPlan.from_spec(model, args.get("checkpoint_stages"), args.get("checkpoint_layers"))
        check_plan(plan, mode, args.get("compile"))


def model_name(model: Any) -> str:
    """The name a model argument goes by: its file name, or the class of a built model."""
    return Path(model).name if isinstance(model, (str, Path)) else type(model).__name__


def trains_on_cuda(device: Any) -> bool:
    """Whether Ultralytics' ``select_device`` puts a run with ``device=`` on CUDA (the training device decides, not
    whether the machine has CUDA): nothing given when CUDA is available; ``cuda``, ``cuda:N``, indices (``0``,
    ``0,1``, ``[0, 1]``, ``-1`` for an idle GPU) always; ``cpu``, ``mps``, ``npu``, ``xpu`` and every other backend
    never (the same spellings ``ultralytics.utils.torch_utils.parse_device`` reads, without its GPU
    queries)."""
    backend, _ = parse_device(device)
    return torch.cuda.is_available() if backend == "" else backend == "cuda"


# Ultralytics head modules and the task each trains, most specific first: Segment, Pose and OBB subclass
# Detect; YOLOESegment subclasses YOLOEDetect, not Segment.
def yaml_task(model: Any) -> str | None:
    """The task a model YAML's output module trains (Ultralytics' ``guess_model_task`` on the YAML), or ``None`` when
    ``model`` is no YAML or its output module is no task head of Ultralytics'.

    A wrapper, as ``guess_model_task`` is no drop-in: given a path it guesses from the file's name, not its
    layers; it matches task words in the module's name, so it names a task for modules that are no head
    (``ConvTranspose`` holds "pose") or that are unknown, and none for RT-DETR's head (``RTDETRDecoder``); and where it
    cannot tell it warns and assumes detect. Here only a head class of ``ultralytics.nn.modules.head`` has a task.
    """
    if not isinstance(model, (str, Path)) or Path(model).suffix not in {".yaml", ".yml"}:
        return None
    try:
        cfg = yaml_model_load(model)
        _, _, name, _ = cfg["head"][-1]  # the output module, as Ultralytics' parse_model reads a layer
    except Exception:  # a missing or malformed YAML: Ultralytics' own error comes when it is built
        return None
    head = getattr(modules, str(name), None)
    if not isinstance(head, type) or head.__module__ != heads.__name__:
        return None
    return "detect" if issubclass(head, heads.RTDETRDecoder) else guess_model_task(cfg)


def check_task(model: Any, task: str | None) -> None:
    """Reject, in one line, a task yolo-ckpt has no trainer for, or a task the model's head does not train.

    The one task check: ``check_settings`` runs it before any work, and ``yolo-ckpt train`` also on the task of the
    model it built (a checkpoint's own task), so no task falls through to a trainer that rejects our keys.

    Args:
        model: The model argument whose YAML head must train ``task``, or ``None`` to check only the task name.
        task: The task word given (or the built model's task); ``None`` checks nothing.

    Raises:
        CheckpointConfigError: Naming the valid tasks, or a model of the task and the model's own task.
    """
    if task is None:
        return
    if task not in DEFAULT_MODELS:
        raise CheckpointConfigError(f"task={task!r} is not a task yolo-ckpt trains. "
                                    f"Valid: {', '.join(DEFAULT_MODELS)}.")
    own = yaml_task(model)
    if own is not None and own != task:
        raise CheckpointConfigError(f"task={task}: {Path(model).name} is a {own} model (its output layer trains "
                                    f"{own}). Valid: a {task} model such as {DEFAULT_MODELS[task]}, or task={own}.")


def saved_settings(ckpt: dict) -> dict[str, Any]:
    """Our keys as a yolo-ckpt checkpoint records them: in its model's own ``args`` (see ``save_model``).

    Plain Ultralytics never reads those back as training arguments (``load_checkpoint`` replaces them with
    ``train_args``), so they cannot break ``yolo train resume``.
    """
    model = ckpt.get("ema") or ckpt.get("model")
    args = getattr(model, "args", None) or {}
    args = args if isinstance(args, dict) else vars(args)
    return {k: args[k] for k in CKPT_CFG_DICT if k in args}


def is_auto(stages: Any) -> bool:
    """Whether ``checkpoint_stages`` asks for the plan to be chosen for a memory target (``auto``)."""
    return word(stages) == "auto"


def is_least(stages: Any) -> bool:
    """Whether ``checkpoint_stages`` asks for the plan that keeps the least (``least``)."""
    return word(stages) == "least"


EXTRA_KEYS = {"augmentations", "save_dir"}  # what Ultralytics' check_dict_alignment allows beside its defaults


def check_keys(custom: dict, valid: dict) -> None:
    """Reject keys that neither ``yolo train`` nor yolo-ckpt has, in one line naming the closest valid key.

    Ultralytics' deprecated keys are renamed in ``custom`` (in place, with its warning) as ``yolo`` renames them,
    by its own ``check_dict_alignment``; its help, which it prints before its error, is left out.

    Raises:
        CheckpointConfigError: Naming each unknown key and the valid keys closest to it.
    """
    if not any(k not in valid and k not in EXTRA_KEYS for k in custom):
        check_dict_alignment(valid, custom)  # deprecated keys, if any, renamed in place
        return
    try:
        with _without_info(LOGGER):
            check_dict_alignment(valid, custom)
    except SyntaxError:
        unknown = [k for k in custom if k not in valid and k not in EXTRA_KEYS]
        raise CheckpointConfigError("; ".join(_unknown_key(k, valid) for k in unknown)) from None


def _unknown_key(key: str, valid: dict) -> str:
    """One unknown key, and the valid keys closest to it."""
    close = get_close_matches(key, valid, n=1)
    hint = f"Did you mean {close[0]}?" if close else "Valid: the keys of `yolo train` and yolo-ckpt's."
    return f"'{key}' is not a valid argument. {hint} (`yolo-ckpt help` lists every key)"


@contextmanager
def _without_info(logger: logging.Logger) -> Iterator[None]:
    """Drop ``logger``'s info records for the duration (Ultralytics' help text); warnings pass."""
    def no_info(record: logging.LogRecord) -> bool:
        return record.levelno != logging.INFO

    logger.addFilter(no_info)
    try:
        yield
    finally:
        logger.removeFilter(no_info)
