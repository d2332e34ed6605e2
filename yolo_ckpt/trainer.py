"""Ultralytics trainers that recompute chosen backbone stages during backward.

Each task trainer is the Ultralytics one plus ``CheckpointMixin``: a handful of hook overrides and nothing else, so the
training loop, losses, optimizer, EMA and checkpoint files are Ultralytics' own.

Example:
    >>> from yolo_ckpt import YOLO
    >>> YOLO("yolo11n.yaml").train(data="data.yaml", imgsz=1280, checkpoint_stages=[2, 3])  # doctest: +SKIP

    or with Ultralytics' own model class:

    >>> from ultralytics import YOLO
    >>> from yolo_ckpt import DetectionTrainer
    >>> YOLO("yolo11n.yaml").train(trainer=DetectionTrainer, data="d.yaml", checkpoint_stages="all")  # doctest: +SKIP
"""

from __future__ import annotations

import math
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any, NoReturn

import torch
import ultralytics
from torch import nn
from ultralytics.cfg import DEFAULT_CFG_DICT, cfg2dict, get_save_dir
from ultralytics.engine.trainer import BaseTrainer
from ultralytics.models import yolo
from ultralytics.models.rtdetr.train import RTDETRTrainer as UltralyticsRTDETRTrainer
from ultralytics.utils import LOGGER, RANK, YAML, IterableSimpleNamespace, colorstr
from ultralytics.utils.patches import override_configs, torch_load
from ultralytics.utils.torch_utils import unwrap_model

from .autobatch import parse_memory, plan_batch
from .device import SimulatedDevice, device_memory, release, unless_oom
from .distributed import DistributedMixin, from_ultralytics_launcher, launch_record, leave_process_group
from .epoch_memory import CALLBACKS, EpochPeak, close_epoch_memory, plot_memory
from .escalation import Snapshot, keeps_least, next_plan
from .families import check_supported
from .measure import grad_bytes, loop_bytes, planned_copy
from .model import check_plan, checkpoint_mode, checkpoint_plan, disable_checkpointing, enable_checkpointing
from .offline import provide_fonts
from .planner import describe, unit_costs
from .recompute import MODES
from .resources import data_file
from .stages import CheckpointConfigError, CheckpointPlan, model_stages, word
from .summary import autocast_dtype, compare_with_vanilla

CKPT_CFG_DICT: dict[str, Any] = YAML.load(data_file("cfg", "default.yaml"))  # our keys and their defaults
DEFAULT_CFG_DICT_CKPT: dict[str, Any] = {**DEFAULT_CFG_DICT, **CKPT_CFG_DICT}  # what `yolo-ckpt train` accepts
PREFIX = colorstr("checkpoint:")


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
    if model is not None:
        check_supported(model)
    for key in ("memory_budget", "simulate_gpu"):
        if args.get(key) is not None:
            try:
                parse_memory(args[key])
            except ValueError as e:
                raise CheckpointConfigError(str(e).replace("memory_budget=", f"{key}=")) from None
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
    if (mode := word(args.get("checkpoint_mode")) or "full") not in MODES:
        raise CheckpointConfigError(f"checkpoint_mode={mode!r} is invalid. Valid: 'full' (recompute whole stages) or "
                                    f"'selective' (keep outputs costly to recompute, recompute the rest).")
    check_task(model, args.get("task"))
    if model is not None and not is_auto(args.get("checkpoint_stages")):
        plan = CheckpointPlan.from_spec(model, args.get("checkpoint_stages"), args.get("checkpoint_layers"))
        check_plan(plan, mode, args.get("compile"))


def trains_on_cuda(device: Any) -> bool:
    """Whether Ultralytics' ``select_device`` puts a run with ``device=`` on CUDA (the training device decides, not
    whether the machine has CUDA): nothing given when CUDA is available; ``cuda``, ``cuda:N``, indices (``0``,
    ``0,1``, ``[0, 1]``, ``-1`` for an idle GPU) always; ``cpu``, ``mps``, ``npu``, ``xpu`` and every other backend
    never (the same spellings ``ultralytics.utils.torch_utils.parse_device`` reads, 8.4.190, without its GPU
    queries)."""
    name = re.sub(r"[\s()\[\]']", "", str(device if device is not None else "")).lower().replace("cuda:", "")
    if name in {"", "none"}:
        return torch.cuda.is_available()
    return name == "cuda" or re.fullmatch(r"-?\d+(,-?\d+)*", name) is not None


# Ultralytics head modules and the task each trains (8.4.190), most specific first: Segment, Pose and OBB subclass
# Detect; YOLOESegment subclasses YOLOEDetect, not Segment.
HEAD_TASKS = (("SemanticSegment", "semantic"), ("Segment", "segment"), ("YOLOESegment", "segment"), ("Pose", "pose"),
              ("OBB", "obb"), ("Depth", "depth"), ("Classify", "classify"), ("Detect", "detect"),
              ("RTDETRDecoder", "detect"))


def yaml_task(model: Any) -> str | None:
    """The task a model YAML's output module trains, or ``None`` when ``model`` is no YAML or its head is unknown."""
    import ultralytics.nn.modules as modules
    from ultralytics.nn.tasks import yaml_model_load

    if not isinstance(model, (str, Path)) or Path(model).suffix not in {".yaml", ".yml"}:
        return None
    try:
        head = getattr(modules, str(yaml_model_load(model)["head"][-1][2]), None)
    except Exception:  # a missing or malformed YAML: Ultralytics' own error comes when it is built
        return None
    classes = [(getattr(modules, name), task) for name, task in HEAD_TASKS]
    return next((task for cls, task in classes if isinstance(head, type) and issubclass(head, cls)), None)


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
    if task not in TRAINERS:
        raise CheckpointConfigError(f"task={task!r} is not a task yolo-ckpt trains. Valid: {', '.join(TRAINERS)}.")
    own = yaml_task(model)
    if own is not None and own != task:
        from .cli import DEFAULT_MODELS

        raise CheckpointConfigError(f"task={task}: {Path(model).name} is a {own} model (its output layer trains "
                                    f"{own}). Valid: a {task} model such as {DEFAULT_MODELS[task]}, or task={own}.")


def is_auto(stages: Any) -> bool:
    """Whether ``checkpoint_stages`` asks for the plan to be chosen (``auto``)."""
    return word(stages) == "auto"


def saved_settings(ckpt: dict) -> dict[str, Any]:
    """Our keys as a yolo-ckpt checkpoint records them: in its model's own ``args`` (see ``save_model``).

    Plain Ultralytics never reads those back as training arguments (``load_checkpoint`` replaces them with
    ``train_args``), so they cannot break ``yolo train resume``.
    """
    model = ckpt.get("ema") or ckpt.get("model")
    args = getattr(model, "args", None) or {}
    args = args if isinstance(args, dict) else vars(args)
    return {k: args[k] for k in CKPT_CFG_DICT if k in args}


def choose_auto_plan(trainer: Any) -> None:
    """Resolve ``checkpoint_stages=auto`` for a fixed batch at ``on_pretrain_routine_end``: the model is on its device,
    frozen and batched by then (AutoBatch resolves it earlier, in ``auto_batch``)."""
    if is_auto(trainer.args.checkpoint_stages):
        trainer._auto_plan(trainer._objects())


def escalation_point(trainer: Any) -> None:
    """``on_train_epoch_start`` of the first epoch: remember where it starts; after an out-of-memory error that
    ``_build_train_pipeline`` kept the batch for, move to the next plan and restart from that point.

    Registered before the epoch memory meter starts, so the planning copies are not the epoch's peak.
    """
    if trainer.epoch != trainer.start_epoch or RANK != -1:
        return
    model = unwrap_model(trainer.model)
    if trainer._escalate:
        trainer._escalate = False
        # not a halving: Ultralytics counted it as one of its three (``_oom_retries``, private, 8.4.190) and, being
        # non-zero, it restarted the epoch (that decision is behind us now); give it back, so that the halvings left
        # are vanilla's. Escalation ends: each plan keeps less than the last, and the one that keeps least halves.
        trainer._oom_retries -= 1
        trainer._escalate_plan()
        snap = trainer._snapshot
        if snap is not None and trainer.ema.updates == snap.ema_updates:  # no optimizer step yet: a fresh start
            snap.restore(model)
        else:
            LOGGER.info(f"{PREFIX} optimizer steps were taken before the error: training goes on from them, as "
                        f"Ultralytics' own retry does")
    elif trainer._snapshot is None and checkpoint_plan(model) is not None:
        trainer._snapshot = Snapshot.take(model, trainer.ema.updates)


@contextmanager
def random_state_kept(device: torch.device) -> Iterator[None]:
    """Leave torch's generators (CPU, and the training CUDA device) as the block found them.

    Planning runs training steps on copies, and RT-DETR's decoder draws random denoising queries in every training
    forward: without this, the queries training draws afterwards would differ from vanilla Ultralytics'.
    """
    cuda = device.type == "cuda"
    with torch.random.fork_rng(devices=[device.index or 0] if cuda else [], device_type="cuda"):
        yield


def skip_frozen_stages(trainer: Any) -> None:
    """Stop checkpointing stages that store nothing for backward once Ultralytics has frozen layers (``freeze=``).

    Registered for ``on_pretrain_routine_end`` (Ultralytics freezes inside ``_setup_train``, after ``get_model``) and
    called by ``auto_batch`` first, so AutoBatch measures the plan that will train.
    """
    model = unwrap_model(trainer.model)
    plan = checkpoint_plan(model)
    if plan is None:
        return
    kept, dropped = plan.without_frozen(model)
    if dropped:
        names = ", ".join(f"stage {d}" if isinstance(d, int) else d for d in dropped)  # stages as numbers, "layer i"
        LOGGER.warning(f"{PREFIX} {names} not recomputed: frozen, with no gradient flowing in, so nothing is "
                       f"stored for backward there; checkpointing {kept.describe()}")
        enable_checkpointing(model, kept, checkpoint_mode(model))


WORKER_ERROR = "yolo_ckpt_error_rank{}.txt"  # each DDP worker's one-line error, for the launching process


def new_run_dir(args: Any) -> Path | None:
    """The run directory Ultralytics will create for ``args`` (``get_save_dir``, as ``BaseTrainer.__init__`` calls it
    next), or ``None`` when it exists already (``exist_ok=True``): only a directory this run creates is ever removed."""
    path = get_save_dir(args)
    return None if path.exists() else path


def remove_created_dir(trainer: Any) -> None:
    """Remove the run directory, if this run created it (never a pre-existing one, never on resume)."""
    created = getattr(trainer, "created_dir", None)
    if created is not None and Path(trainer.save_dir).resolve() == created:
        shutil.rmtree(created, ignore_errors=True)


def report_to_launcher(trainer: Any, error: CheckpointConfigError) -> NoReturn:
    """In a DDP worker: leave this rank's line where the launching process looks, and end the worker at once.

    ``os._exit``: a worker leaving Python normally after the error intermittently aborts in gloo's threads
    (``terminate called without an active exception``, SIGABRT: 2 of 8 runs under load with the process group
    destroyed first, torch 2.14.1), and the launcher then prints its own traceback. Every rank has raised the same
    line (rank 0 decided it), so no collective is left waiting; there is nothing of the worker's to clean up.
    """
    (Path(trainer.save_dir) / WORKER_ERROR.format(RANK)).write_text(str(error))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def reported_by_workers(trainer: Any) -> str | None:
    """In the launching process of DDP: the line the workers reported (their files are removed), or ``None``.

    Every rank stops with the line rank 0 decided (``_auto_plan`` broadcasts it), so all ranks report one line; where
    they do not, the line says what each rank reported, and which reported nothing."""
    files = {r: Path(trainer.save_dir) / WORKER_ERROR.format(r) for r in range(max(trainer.world_size, 1))}
    lines = {r: f.read_text() for r, f in files.items() if f.is_file()}
    for f in files.values():
        f.unlink(missing_ok=True)
    if not trainer.ddp or not lines:
        return None
    if len(set(lines.values())) == 1 and len(lines) == len(files):
        return next(iter(lines.values()))
    silent = [r for r in files if r not in lines]
    return "; ".join([*(f"rank {r}: {line}" for r, line in lines.items()),
                      *([f"ranks {silent} reported nothing"] if silent else [])])


def auto_report(choice: Any, mode: str, how: str = "measured", capped: str = "") -> list[str]:
    """Log lines for ``auto``'s choice (a ``planner.Choice``): the trade-off table of the measured candidates and the
    choice, or a single line when vanilla fits (nothing was weighed, so there is no table)."""
    measured = f"{how} {choice.measured_bytes / 2**30:.3f} GB of {choice.target_bytes / 2**30:.3f} GB"
    if not choice.plan.regions:
        return [f"auto: vanilla fits at batch {choice.batch}{capped} ({measured}): nothing recomputed"]
    c = choice.candidate
    what = describe(c) if c.mode not in MODES else choice.plan.describe(mode)  # the plan knows one mode only
    timed = f", measured {choice.measured_seconds:.3f} s" if choice.measured_seconds is not None else ""
    return [*(f"  {line}" for line in choice.table()),
            f"auto chose {what} at batch {choice.batch}{capped}: {1 + c.flops / choice.base_flops:.3f}x FLOPs, "
            f"step time predicted {c.seconds:.3f} s{timed}, {measured}"]


class CheckpointMixin(DistributedMixin):
    """Hooks that add ``checkpoint_stages`` to an Ultralytics task trainer (listed first among the bases).

    - ``check_resume``: the first hook ``BaseTrainer.__init__`` calls once arguments are merged, before it creates the
      run directory or reads the dataset; bad ``checkpoint_stages`` are rejected here, and a resumed run gets its
      stages back from ``last.pt``.
    - ``get_model``: the training model runs the plan's regions inside checkpoints.
    - ``get_validator``: validators rebuild their arguments with Ultralytics' key check, so they get ours removed.
    - ``save_model``: what is pickled is plain Ultralytics, and ``train_args`` hold only Ultralytics' keys.
    - ``auto_batch``: AutoBatch measures the checkpointed model, or plans for ``memory_budget`` on any device;
      with ``checkpoint_stages=auto`` it chooses plan and batch together (``yolo_ckpt.planner``), and for a fixed batch
      ``choose_auto_plan`` chooses the plan at ``on_pretrain_routine_end``.
    - ``get_dataset``: with ``YOLO_OFFLINE``, the plotting font Ultralytics' dataset check looks up is local
      (``yolo_ckpt.offline``), also in DDP workers.
    - ``train``: on any exit, also a crash, the model (which ``YOLO.model`` shares) is plain again; a plan or batch
      that cannot fit removes the run directory this run created before its one-line error.
    - ``on_train_end`` with ``checkpoint_compare``: the run's plan measured against vanilla (``yolo_ckpt.summary``).
    - callbacks (``yolo_ckpt.epoch_memory``), ``save_metrics``, ``plot_metrics``: each epoch's peak memory goes to
      the console, results.csv, Ultralytics' loggers and memory.png; frozen stages are dropped from the plan.
    - the base ``DistributedMixin`` (``yolo_ckpt.distributed``): under ``torchrun`` the launcher's world size, device
      and one run directory, on any number of nodes, CUDA or CPU (gloo).
    """

    def __init__(self, cfg: Any = None, overrides: dict | None = None, _callbacks: dict | None = None):
        """Initialise like the Ultralytics trainer, with our keys' defaults added to ``cfg``."""
        super().__init__({**DEFAULT_CFG_DICT_CKPT, **cfg2dict(cfg or {})}, overrides, _callbacks)
        self.epoch_memory: dict[str, float] = {}
        self.memory_meter: EpochPeak | None = None
        self.autobatch_without: int | str | None = None  # what AutoBatch chose for the same memory, unplanned
        self.memory_target: int | None = None  # exact tensor bytes auto or AutoBatch planned to fit
        self._plan_costs = None  # unit costs (auto's, or the first escalation's), for escalation
        self._snapshot: dict | None = None  # the first epoch's start, for an exact restart after an escalation
        self._pipeline_batch: int | None = None
        self._stages: list[int] = []
        self._escalate = False
        ours = [("on_train_epoch_start", escalation_point), *CALLBACKS.items(),
                ("on_pretrain_routine_end", choose_auto_plan),
                ("on_pretrain_routine_end", skip_frozen_stages), ("on_train_end", compare_with_vanilla)]
        for event, fn in ours:
            if fn not in self.callbacks[event]:  # a DDP worker is built with the parent's callbacks, ours included
                self.add_callback(event, fn)

    def check_resume(self, overrides: dict) -> None:
        """Resume like Ultralytics, restore our keys from the checkpoint, then validate ``checkpoint_stages``."""
        ours = {k: overrides[k] for k in CKPT_CFG_DICT if k in overrides}
        super().check_resume({k: v for k, v in overrides.items() if k not in CKPT_CFG_DICT})
        if self.resume:  # Ultralytics rebuilt args from the checkpoint's train_args, which hold none of our keys
            saved = saved_settings(torch_load(self.args.resume, map_location="cpu"))
            for k, default in CKPT_CFG_DICT.items():
                setattr(self.args, k, ours.get(k, saved.get(k, default)))
        check_settings(self.args.model, vars(self.args))  # fail fast: before any directory or dataset work
        self.args.checkpoint_mode = word(self.args.checkpoint_mode)  # what the recompute and args.yaml get
        # rank 0 of torchrun chose the directory; Ultralytics' own launcher's parent created it for its workers
        self.created_dir = None if self.resume or RANK > 0 or from_ultralytics_launcher() else new_run_dir(self.args)

    def get_dataset(self) -> dict:
        """Ultralytics' dataset check, which looks up its plotting font: offline, give it a local one first (also in
        DDP workers, which never run ``yolo-ckpt``'s entry point)."""
        provide_fonts()
        return super().get_dataset()

    def get_model(self, cfg=None, weights=None, verbose: bool = True):
        """Build the Ultralytics model and install the checkpoint plan on it."""
        model = super().get_model(cfg=cfg, weights=weights, verbose=verbose)
        if is_auto(self.args.checkpoint_stages):
            LOGGER.info(f"{PREFIX} auto: the plan is chosen once the device, batch and frozen layers are known")
            return model
        plan = CheckpointPlan.from_spec(model, self.args.checkpoint_stages, self.args.checkpoint_layers)
        mode = self.args.checkpoint_mode or "full"
        enable_checkpointing(model, plan, mode)
        if not plan.regions:
            LOGGER.info(f"{PREFIX} off, all activations stored")
        stages = model_stages(model) if plan.stages else {}
        whole = [r for r in plan.regions if not r.parts]
        for region in plan.regions:
            how = ", selective: outputs costly to recompute kept" if (region.mode or mode) == "selective" else ""
            shared = f", recomputed as one region with stages {list(region.stages)}" if len(region.stages) > 1 else ""
            for k in region.stages:
                types = ", ".join(type(model.model[i]).__name__ for i in stages[k])
                LOGGER.info(f"{PREFIX} stage {k} (P{k}/{2**k}) layers {list(stages[k])}: {types}{shared}{how}")
            if region.parts:
                i = region.layers[0]
                inside = next((r for r in whole if i in r.layers), None)
                nested = "" if inside is None else f", nested in the region of layers {list(inside.layers)}"
                run = f"parts {', '.join(region.parts)} as one region" if len(region.parts) > 1 else \
                    f"part {region.parts[0]}"
                LOGGER.info(f"{PREFIX} layer {i} ({type(model.model[i]).__name__}) {run}{nested}{how}")
            elif not region.stages:
                types = ", ".join(type(model.model[i]).__name__ for i in region.layers)
                LOGGER.info(f"{PREFIX} layers {list(region.layers)}: {types}{how}")
        return model

    def train(self):
        """Train like Ultralytics; however it ends, the model is plain again and no memory tracker stays active.

        ``Model.train`` hands the trainer's model to ``YOLO.model``; after a failed run that object is what a user
        saves or trains next, so the plan must not outlive training. With ``simulate_gpu`` the whole run, the model
        built before it included, lives on a ``SimulatedDevice`` of that size.

        A one-line error of ours that comes once Ultralytics has created the run directory (a plan or batch that
        cannot fit) removes the directory this run created first, so nothing is left behind and the next run keeps
        its name; a worker of Ultralytics' launcher hands the line to the launching process instead of a traceback,
        and under torchrun every rank raises it (rank 0 decided it) after leaving the process group.
        """
        with ExitStack() as stack:
            if self.args.simulate_gpu is not None:
                gpu = stack.enter_context(SimulatedDevice(parse_memory(self.args.simulate_gpu)))
                if isinstance(self.model, nn.Module):
                    gpu.track([*self.model.parameters(), *self.model.buffers()])
                LOGGER.info(f"{PREFIX} simulate_gpu={self.args.simulate_gpu}: a {gpu.limit / 2**30:.3f} GB device on "
                            f"CPU, exact tensor bytes")
            try:
                result = super().train()
            except CheckpointConfigError as e:
                if from_ultralytics_launcher():  # a worker: end quietly, the launching process raises the one line
                    report_to_launcher(self, e)
                leave_process_group()  # torchrun: every rank raises the same line (rank 0 decided it)
                remove_created_dir(self)
                raise
            except subprocess.CalledProcessError:  # the launching process: a worker that reported a line failed
                if error := reported_by_workers(self):  # at exit after it (any other failure stays as it is)
                    remove_created_dir(self)
                    raise CheckpointConfigError(error) from None
                raise
            finally:
                for model in (self.model, getattr(self.ema, "ema", None)):  # first: nothing below may skip this
                    if isinstance(model, nn.Module):
                        disable_checkpointing(unwrap_model(model))
                close_epoch_memory(self)
        if error := reported_by_workers(self):
            remove_created_dir(self)
            raise CheckpointConfigError(error)
        return result

    @contextmanager
    def _ultralytics_args(self) -> Iterator[None]:
        """Hide our keys from ``self.args`` for code that checks arguments against Ultralytics' defaults."""
        saved = {k: getattr(self.args, k) for k in CKPT_CFG_DICT if hasattr(self.args, k)}
        for k in saved:
            delattr(self.args, k)
        try:
            yield
        finally:
            for k, v in saved.items():
                setattr(self.args, k, v)

    def get_validator(self):
        """Build the Ultralytics validator from arguments without our keys."""
        with self._ultralytics_args():
            return super().get_validator()

    def save_model(self):
        """Save Ultralytics checkpoints that plain Ultralytics can load, validate and resume.

        The pickled EMA is plain (an EMA deep-copied from the training model carries the plan); ``train_args``, which
        ``yolo train resume`` validates against Ultralytics' keys, hold none of ours; our settings are recorded in the
        saved model's own ``args`` (where Ultralytics records the run's arguments too) for ``yolo-ckpt train resume``.
        """
        ema = self.ema.ema
        disable_checkpointing(ema)
        linked = getattr(ema, "args", None)  # the trainer's args object itself (detect tasks), or none (classify)
        ours = {**{k: getattr(self.args, k) for k in CKPT_CFG_DICT}, **launch_record(self)}  # + world size, resume
        base = {} if linked is None else linked if isinstance(linked, dict) else vars(linked)
        ema.args = IterableSimpleNamespace(**{**base, **ours})  # a snapshot, of the type Ultralytics saves
        try:
            with self._ultralytics_args():
                return super().save_model()
        finally:
            if linked is None:
                del ema.args
            else:
                ema.args = linked

    def _dataset_facts(self) -> tuple[int, int]:
        """The most labels in one image x4 (mosaic) and the number of training images, as Ultralytics'
        ``DetectionTrainer.auto_batch`` gathers them (8.4.190)."""
        with override_configs(self.args, overrides={"cache": False}) as self.args:
            dataset = self.build_dataset(self.data["train"], mode="train", batch=16)
        labels = [x for x in getattr(dataset, "labels", []) if isinstance(x, dict) and "cls" in x]
        return max((len(x["cls"]) for x in labels), default=0) * 4, len(dataset)

    def _memory_target(self) -> tuple[int, float, str]:
        """``(budget bytes, share, what it is)`` of this run's memory decisions, in exact tensor bytes.

        ``memory_budget`` when given (on CUDA its allocator bytes are turned into tensor bytes with the device's
        ``ALLOCATOR_MARGIN``); otherwise the training device's usable memory — CUDA free plus what this process has
        reserved, as Ultralytics' AutoBatch counts it, or the simulated device. The share is 0.6, or ``batch=0.x``.
        """
        fraction = self.batch_size if 0 < self.batch_size < 1 else 0.6
        dev = device_memory(self.device)
        if self.args.memory_budget is not None:
            budget = parse_memory(self.args.memory_budget)
            if dev is not None and budget > dev.total:
                LOGGER.warning(f"{PREFIX} memory_budget={self.args.memory_budget} is more than {dev.name} holds "
                               f"({dev.total / 2**30:.2f} GB): planning for the budget from steps that fit the device")
            source = f"memory_budget={self.args.memory_budget}"
        else:
            budget, source = dev.usable, f"{dev.name} usable memory"
        return (dev.tensor_bytes(budget) if dev is not None else budget), fraction, source

    def auto_batch(self) -> int:
        """Choose the batch for the checkpointed model and log what the same memory gives without checkpointing.

        Our mixin comes first in the MRO, so this replaces the task trainer's ``auto_batch`` too; it gathers the same
        dataset facts as Ultralytics' ``DetectionTrainer.auto_batch`` (8.4.190): the most labels in one image, x4 for
        mosaic, and the number of training images. Both batches are measured on copies of the model. Without
        ``memory_budget``, a CUDA device gets Ultralytics' own AutoBatch (on the checkpointed model) and a simulated
        device is planned for its size; any other device keeps Ultralytics' default batch.
        """
        skip_frozen_stages(self)  # Ultralytics froze layers before AutoBatch: measure the plan that will train
        max_num_obj, dataset_size = self._dataset_facts()
        simulated = self.device.type != "cuda" and device_memory(self.device) is not None
        if self.args.memory_budget is None and self.device.type != "cuda" and not simulated:
            LOGGER.info(f"{colorstr('AutoBatch: ')}set memory_budget (e.g. memory_budget=24GB) to plan without CUDA")
            return BaseTrainer.auto_batch(self, max_num_obj, dataset_size)
        if is_auto(self.args.checkpoint_stages):
            return self._auto_plan(max(max_num_obj, 1), autobatch=True, dataset_size=dataset_size)
        model = self.model
        plain = unwrap_model(model)
        stages = (checkpoint_plan(plain) or CheckpointPlan()).describe(checkpoint_mode(plain))
        if self.args.memory_budget is not None or simulated:
            with random_state_kept(self.device):
                return self._plan_for_budget(plain, stages, max_num_obj, dataset_size)
        try:
            self.model = plain  # Ultralytics profiles a deepcopy: the plan comes along
            batch = BaseTrainer.auto_batch(self, max_num_obj, dataset_size)
            with planned_copy(plain) as self.model:
                with random_state_kept(self.device):  # Ultralytics' own AutoBatch draws once, as in vanilla
                    self.autobatch_without = BaseTrainer.auto_batch(self, max_num_obj, dataset_size)
        finally:
            self.model = model
        LOGGER.info(f"{colorstr('AutoBatch: ')}batch {batch} with {stages} ({self.autobatch_without} without)")
        return batch

    def _plan_for_budget(self, model: nn.Module, stages: Any, max_num_obj: int, dataset_size: int) -> int:
        """AutoBatch for ``memory_budget`` (or the simulated device) on copies of the model (probe steps would move
        BatchNorm statistics).

        Steps are measured under the autocast dtype this run trains with, one copy at a time, each within the share
        and what the device has free, so planning itself stays inside the share it plans for.
        """
        budget, fraction, source = self._memory_target()
        imgsz = self._planning_imgsz()
        amp = autocast_dtype(self)
        kw = dict(imgsz=imgsz, budget=budget, fraction=fraction, objects=max(max_num_obj, 1), amp=amp)
        self.memory_target = int(fraction * budget)
        LOGGER.info(f"{colorstr('AutoBatch: ')}planning {fraction:.0%} of {source} at imgsz={imgsz}"
                    f"{f' under {amp} autocast' if amp else ''} from measured training steps...")
        try:
            with planned_copy(model, None) as copy:
                chosen = plan_batch(copy, **kw)
        except ValueError as e:
            raise CheckpointConfigError(f"{e} with {stages}; raise memory_budget or lower imgsz") from None
        try:
            with planned_copy(model) as plain:
                without = str(plan_batch(plain, **kw).batch)
        except ValueError:
            without = "none fits"
        batch = min(chosen.batch, dataset_size or chosen.batch)
        cap = f", capped to the {dataset_size} training images" if batch < chosen.batch else ""
        how = (f"extrapolated from steps at batches {sorted(chosen.points)} that fit the device"
               if chosen.extrapolated else "measured")
        LOGGER.info(f"{colorstr('AutoBatch: ')}batch {chosen.batch} with {stages} ({without} without){cap}; "
                    f"{how} {chosen.measured_bytes / 2**30:.2f} GB of {chosen.target_bytes / 2**30:.2f} GB, the "
                    f"training loop's other batches ({chosen.loop_bytes / 2**20:.1f} MiB) included")
        self.autobatch_without = without
        return batch

    def _auto_plan(self, objects: int, autobatch: bool = False, dataset_size: int = 0) -> int:
        """Resolve ``checkpoint_stages=auto`` on copies of the model: choose, record in ``args`` (and args.yaml),
        install. With AutoBatch the batch is chosen too (at most the training images); returns the batch.

        Under DDP rank 0 chooses, for its share of the batch as Ultralytics splits it, and every rank installs what
        it broadcasts; "nothing fits" stops every rank with the same line.
        """
        model = unwrap_model(self.model)
        decision, failure = None, None
        if RANK in {-1, 0}:
            try:
                with random_state_kept(self.device):
                    decision = self._choose(model, objects, autobatch, dataset_size)
            except CheckpointConfigError as e:
                decision = {"error": str(e)}
            except Exception as e:  # the other ranks wait in the broadcast: tell them, then raise it here
                if RANK == -1:
                    raise
                failure, decision = e, {"failed": f"{type(e).__name__}: {e}"}
        if RANK != -1:  # the process group exists: Ultralytics set it up before _setup_train
            import torch.distributed as dist

            box = [decision]
            dist.broadcast_object_list(box, 0)
            decision = box[0]
        if failure is not None:
            raise failure
        if "failed" in decision:
            raise RuntimeError(f"checkpoint_stages=auto: rank 0 failed while planning ({decision['failed']})")
        if "error" in decision:
            raise CheckpointConfigError(decision["error"])
        for k, v in decision["settings"].items():
            setattr(self.args, k, v)
        self._record_settings()
        enable_checkpointing(model, CheckpointPlan.from_spec(model, self.args.checkpoint_stages,
                                                             self.args.checkpoint_layers), self.args.checkpoint_mode)
        for line in decision.get("lines", []):
            LOGGER.info(line)
        return decision["batch"]

    def _choose(self, model: nn.Module, objects: int, autobatch: bool, dataset_size: int) -> dict:
        """Rank 0's part of ``_auto_plan``: the choice as plain data (settings, batch, log lines) for the broadcast."""
        from .planner import NothingFits, choose_plan, choose_plan_and_batch

        budget, fraction, source = self._memory_target()
        imgsz = self._planning_imgsz()
        amp = autocast_dtype(self)
        batch = None if autobatch else max(self.batch_size // max(self.world_size, 1), 1)
        cap = min(1024, dataset_size) if autobatch and dataset_size else 1024
        self.memory_target = int(fraction * budget)
        # DDP's gradient buckets: Ultralytics wraps the model in DistributedDataParallel with its default
        # gradient_as_bucket_view=False (8.4.190), which keeps a flat copy of every gradient beside the gradients
        # (tests/test_ddp.py: without this the two-rank epoch on a simulated device passes auto's share). AutoBatch
        # is single-process, so only a fixed batch meets them here.
        buckets = grad_bytes(model) if self.world_size > 1 else 0
        # The loop's other batches (measure.loop_bytes): without them a plan measured right at a 0.4x share trained
        # 1.2 MB past it (tests/test_device.py). A fixed batch's plan is chosen for the share less them; AutoBatch
        # counts them at every batch it weighs (planner.choose_plan_and_batch), so here they are per image.
        loop = loop_bytes(model, imgsz, batch or 1, objects)
        what = (f"the largest batch (at most the {cap} training images)" if autobatch and dataset_size
                else "the largest batch" if autobatch else f"batch {batch}")
        less = f" less DDP's gradient buckets ({buckets / 2**20:.1f} MiB)" if buckets else ""
        less += f" less the training loop's other batches ({loop / 2**20:.1f} MiB{' per image' if autobatch else ''})"
        LOGGER.info(f"{PREFIX} auto: choosing the plan with the least predicted step time that fits {fraction:.0%} of "
                    f"{source}{less} at imgsz={imgsz}, {what}...")
        start = time.perf_counter()
        try:
            if autobatch:
                choice = choose_plan_and_batch(model, imgsz, budget, fraction, objects, amp, max_batch=cap)
            else:
                choice = choose_plan(model, imgsz, batch, self.memory_target - buckets - loop, objects, amp)
        except NothingFits as e:  # say what would fit: the budget whose share covers the least-keeping plan
            # (choose_plan_and_batch's bound holds the loop's batches at its batch already)
            need = math.ceil((e.needed + buckets + (0 if autobatch else loop)) / fraction / 2**20)
            raise CheckpointConfigError(f"{e}: memory_budget={need}MB would fit it, or lower batch or imgsz") from None
        except ValueError as e:
            raise CheckpointConfigError(f"{e}; raise memory_budget or lower imgsz") from None
        self._plan_costs = choice.costs  # escalation on out-of-memory starts from them
        s = choice.candidate.settings
        how = "extrapolated from batches the device holds" if choice.extrapolated else "measured"
        capped = f" (capped to the {cap} training images)" if autobatch and choice.batch == cap == dataset_size else ""
        lines = [f"{PREFIX} {line}" for line in auto_report(choice, s["checkpoint_mode"], how, capped)]
        lines.append(f"{PREFIX} auto: planned in {time.perf_counter() - start:.1f} s ({len(choice.costs.unit) + 1} "
                     f"timed batch-1 steps: vanilla, and each unit alone in each of its modes; "
                     f"{len(choice.tried)} candidates measured at batch {choice.batch})")
        if self.device.type == "cuda":
            lines.append(f"{PREFIX} auto: not confirmed on {self.device}: the batch was extrapolated beyond what it "
                         f"holds" if choice.extrapolated else self._confirm_on_cuda(model, s, choice.batch, imgsz,
                                                                                   objects, amp))
        return {"settings": s, "batch": choice.batch, "lines": lines}

    def _confirm_on_cuda(self, model: nn.Module, settings: dict, batch: int, imgsz: int, objects: int,
                         amp: torch.dtype | None) -> str:
        """One measured step of the chosen plan on the CUDA device: the allocator's ``max_memory_reserved`` against
        the share of usable memory (tensor bytes were planned; this is what the allocator really takes)."""
        from .measure import step_loss, training_batch

        dev = device_memory(self.device)
        target = int(self.memory_target * dev.margin)

        def step() -> int:  # the device bounds it: a memory error is "does not fit" (``unless_oom``), never the run's
            with planned_copy(model, settings["checkpoint_stages"], settings["checkpoint_mode"],
                              settings["checkpoint_layers"] or None) as m:
                data = training_batch(m, imgsz, batch, objects)
                torch.cuda.synchronize(self.device)
                torch.cuda.reset_peak_memory_stats(self.device)
                step_loss(m, data, amp).backward()
                torch.cuda.synchronize(self.device)
                return torch.cuda.max_memory_reserved(self.device)

        reserved = unless_oom(step, self.device)
        release(self.device)
        if reserved is None:
            return (f"{PREFIX} auto on {dev.name}: the chosen plan's step ran out of memory when confirmed (the "
                    f"allocator needs more than the tensor bytes planned): escalation follows if training does too")
        verdict = "confirmed" if reserved <= target else "over the target: escalation follows an out-of-memory"
        return (f"{PREFIX} auto on {dev.name}: max_memory_reserved {reserved / 2**30:.3f} GB of "
                f"{target / 2**30:.3f} GB ({verdict})")

    def _record_settings(self) -> None:
        """args.yaml holds the plan that trains, as last.pt does: resume restores it."""
        if RANK in {-1, 0}:
            YAML.save(self.save_dir / "args.yaml", vars(self.args))

    def _planning_imgsz(self) -> int:
        """The largest image side this run trains at (``multi_scale`` included), a multiple of the stride."""
        return math.ceil(self.args.imgsz * (1 + self.args.multi_scale) / self.stride) * self.stride

    def _objects(self) -> int:
        """Labelled objects per image planning measures: the most in one training image x4 (mosaic), as Ultralytics'
        AutoBatch counts them."""
        labels = getattr(getattr(self.train_loader, "dataset", None), "labels", None) or []
        counts = [len(x["cls"]) for x in labels if isinstance(x, dict) and "cls" in x]
        return max(max(counts, default=0) * 4, 1)

    def _build_train_pipeline(self) -> None:
        """Build loaders and optimizer settings like Ultralytics; in its first-epoch out-of-memory retry, keep the
        batch when a plan that keeps less exists (``escalation_point`` installs it when the epoch restarts).

        Private hook, checked against ultralytics 8.4.190: ``BaseTrainer._do_train`` halves ``batch`` on an
        out-of-memory error and calls this method before restarting the epoch; nothing public runs in between, and
        the loaders must be built at the batch that will train. Ultralytics' "Reducing to batch=..." warning is
        printed before this runs.
        """
        held, model = self._pipeline_batch, unwrap_model(self.model)
        settings = {k: getattr(self.args, k) for k in ("checkpoint_stages", "checkpoint_layers", "checkpoint_mode")}
        checkpoints = checkpoint_plan(model) is not None or self._plan_costs is not None  # auto may choose vanilla
        if held is not None and self.batch_size < held and RANK == -1 and checkpoints \
                and not keeps_least(settings, self._stages):
            self.args.batch = self.batch_size = held
            self._escalate = True
        if held is None:  # set-up, memory free: a stage dry run may allocate now, not in the retry
            self._stages = sorted(model_stages(model))
        super()._build_train_pipeline()
        self._pipeline_batch = self.batch_size

    def _escalate_plan(self) -> None:
        """Install the next plan after an out-of-memory error at this batch, record it, and say so in one line."""
        model = unwrap_model(self.model)
        keys = ("checkpoint_stages", "checkpoint_layers", "checkpoint_mode")
        old = {k: getattr(self.args, k) for k in keys}
        release(self.device)  # the failed step's tensors, held by the traceback until now
        imgsz = self._planning_imgsz()
        amp = autocast_dtype(self)
        with random_state_kept(self.device):  # training goes on from here, as after Ultralytics' own retry
            if self._plan_costs is None:  # once: a second escalation at this imgsz plans from the same unit steps
                self._plan_costs = unit_costs(model, imgsz, self._objects(), amp)
            settings, measured = next_plan(model, old, imgsz, self.batch_size, self._objects(), amp,
                                           self._plan_costs)
        for k, v in settings.items():
            setattr(self.args, k, v)
        plan = CheckpointPlan.from_spec(model, settings["checkpoint_stages"], settings["checkpoint_layers"] or None)
        enable_checkpointing(model, plan, settings["checkpoint_mode"])
        self._record_settings()
        before = CheckpointPlan.from_spec(model, old["checkpoint_stages"], old["checkpoint_layers"] or None)
        how = (f"its step measured {measured / 2**30:.3f} GB, within what the device has free less the training "
               f"loop's other batches" if measured is not None
               else "none was measured to fit, so the plan that keeps the least; if it runs out too, the batch halves")
        LOGGER.warning(f"{PREFIX} out of memory at batch {self.batch_size} with "
                       f"{before.describe(old['checkpoint_mode'] or 'full')}: escalated to "
                       f"{plan.describe(settings['checkpoint_mode'])} at the same batch instead of halving it ({how})")

    def save_metrics(self, metrics: dict) -> None:
        """Write results.csv with this epoch's peak memory columns, and pass them to Ultralytics' loggers.

        The integrations (TensorBoard, MLflow, W&B, Comet, ...) log ``trainer.metrics`` at ``on_fit_epoch_end``, which
        follows this call in every epoch.
        """
        def ours_last(d: dict) -> dict:  # an epoch without validation carries the last epoch's metrics, ours included
            return {**{k: v for k, v in d.items() if k not in self.epoch_memory}, **self.epoch_memory}

        self.metrics = ours_last(self.metrics)
        super().save_metrics(ours_last(metrics))  # results.csv writes values in order under the first epoch's header

    def plot_metrics(self) -> None:
        """Plot results.png like Ultralytics, and memory per epoch to memory.png beside it."""
        super().plot_metrics()
        if path := plot_memory(self.csv):
            self.on_plot(path)


class DetectionTrainer(CheckpointMixin, yolo.detect.DetectionTrainer):
    """Ultralytics ``DetectionTrainer`` with ``checkpoint_stages``."""


class SegmentationTrainer(CheckpointMixin, yolo.segment.SegmentationTrainer):
    """Ultralytics ``SegmentationTrainer`` with ``checkpoint_stages``."""


class PoseTrainer(CheckpointMixin, yolo.pose.PoseTrainer):
    """Ultralytics ``PoseTrainer`` with ``checkpoint_stages``."""


class OBBTrainer(CheckpointMixin, yolo.obb.OBBTrainer):
    """Ultralytics ``OBBTrainer`` with ``checkpoint_stages``."""


class ClassificationTrainer(CheckpointMixin, yolo.classify.ClassificationTrainer):
    """Ultralytics ``ClassificationTrainer`` with ``checkpoint_stages``."""


class RTDETRTrainer(CheckpointMixin, UltralyticsRTDETRTrainer):
    """Ultralytics ``RTDETRTrainer`` with ``checkpoint_stages`` (HGNet/ResNet backbone stages, the decoder in
    ``checkpoint_layers=head``)."""


class SemanticSegmentationTrainer(CheckpointMixin, yolo.semantic.SemanticSegmentationTrainer):
    """Ultralytics ``SemanticSegmentationTrainer`` (``yolo26*-sem.yaml``) with ``checkpoint_stages``."""


class DepthTrainer(CheckpointMixin, yolo.depth.DepthTrainer):
    """Ultralytics ``DepthTrainer`` (``yolo26*-depth.yaml``) with ``checkpoint_stages``."""


TRAINERS = {
    "detect": DetectionTrainer,
    "segment": SegmentationTrainer,
    "semantic": SemanticSegmentationTrainer,
    "depth": DepthTrainer,
    "pose": PoseTrainer,
    "obb": OBBTrainer,
    "classify": ClassificationTrainer,
}


class YOLO(ultralytics.YOLO):
    """``ultralytics.YOLO`` whose ``train()`` uses the checkpointing trainer of the model's task.

    Example:
        >>> YOLO("yolo11n-seg.yaml").train(data="seg.yaml", checkpoint_stages=[1, 2])  # doctest: +SKIP
    """

    def __init__(self, model: Any = "yolo26n.pt", task: str | None = None, verbose: bool = False):
        """Load like ``ultralytics.YOLO``; a checkpoint whose head is RT-DETR's becomes our ``RTDETR``, as
        Ultralytics turns it into its own (by swapping ``__class__`` in ``YOLO.__init__``, 8.4.190)."""
        super().__init__(model, task=task, verbose=verbose)
        if type(self) is ultralytics.RTDETR:
            self.__class__ = RTDETR

    @property
    def task_map(self) -> dict:
        """Ultralytics' task map with our trainers in place of its own."""
        return {task: {**v, "trainer": TRAINERS.get(task, v["trainer"])} for task, v in super().task_map.items()}



class RTDETR(ultralytics.RTDETR):
    """``ultralytics.RTDETR`` whose ``train()`` uses ``RTDETRTrainer`` (checkpointing).

    Example:
        >>> RTDETR("rtdetr-l.yaml").train(data="data.yaml", imgsz=640, checkpoint_stages="all")  # doctest: +SKIP
    """

    @property
    def task_map(self) -> dict:
        """Ultralytics' RT-DETR task map with our trainer in place of its own."""
        return {task: {**v, "trainer": RTDETRTrainer} for task, v in super().task_map.items()}
