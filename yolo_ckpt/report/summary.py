"""What checkpointing bought in a finished run: its peak memory next to vanilla's, and what the recompute cost.

With ``checkpoint_compare=True`` (the demo recipe ``cfg/demo.yaml`` sets it), ``compare_with_vanilla`` runs at
``on_train_end``: one training step of the final model with the run's plan and one without, measured side by side on
copies at the run's batch and imgsz (``profiler.compare_plans``: the exact peak of live tensor bytes, FLOPs counted,
median step time of 3 interleaved rounds), logged beside the run's own per-epoch peak from results.csv. Every figure
is measured in this run; the trained model is never stepped.

Examples:
    $ yolo-ckpt train data=my.yaml checkpoint_stages=all checkpoint_compare
"""

from __future__ import annotations

import csv
import math
from copy import deepcopy
from pathlib import Path
from typing import Any

import torch
from ultralytics.utils import LOGGER, WINDOWS, colorstr

from ..memory.step import StepShape
from ..regions.install import checkpoint_mode, checkpoint_plan, disable_checkpointing, network
from ..regions.loss.install import disable_loss_checkpointing, loss_checkpointing
from ..regions.plan import CheckpointPlan
from ..regions.recompute import Mode
from ..regions.settings import PlanSettings
from .plots import plot_memory
from .profiler import compare_plans, time_x, within_noise

PREFIX = colorstr("checkpoint:")
COMPARE_ROUNDS = 3  # timed rounds of the two steps (median): a figure reported to the user, whatever planning times


def training_formats(args: Any, device: Any, amp: bool | None = None) -> tuple[torch.dtype | None, bool]:
    """``(autocast dtype or None, channels_last)`` a run trains with, as Ultralytics' trainer picks them
    (``_setup_train`` and the train loop's ``autocast``): ``amp=bf16`` as bfloat16, float16 where AMP is on, ``None``
    for fp32; channels_last on CUDA only, ``channels_last=None`` meaning on (but on Windows).

    Args:
        args: The run's settings (``amp``, ``channels_last``).
        device: The training device (a ``torch.device``).
        amp: The trainer's AMP state (``trainer.amp``) once it has run Ultralytics' AMP check; ``None`` before there
            is a trainer (``yolo-ckpt profile``), when AMP is taken as ``args.amp`` asks on CUDA and off elsewhere,
            where Ultralytics' AMP check turns it off.

    Returns:
        The autocast dtype of the forward (``None``: full precision) and whether the model is channels_last.
    """
    cuda = getattr(device, "type", str(device)) == "cuda"
    if amp is None and not cuda:
        return None, False
    amp = bool(args.amp) if amp is None else amp
    dtype = torch.bfloat16 if args.amp == "bf16" else torch.float16 if amp else None
    return dtype, cuda and (args.channels_last is True or (args.channels_last is None and not WINDOWS))


def run_peak(csv_file: Any) -> tuple[str, float] | None:
    """The run's peak in results.csv: the first ``mem/*`` column (the epochs') and its validation twin
    (``mem/val_peak_*``), their largest value, and the epochs' column name; ``None`` when nothing was measured."""
    try:
        with open(csv_file, newline="") as f:
            rows = [{k.strip(): v for k, v in r.items()} for r in csv.DictReader(f)]
    except FileNotFoundError:
        return None
    key = next((k for k in (rows[0] if rows else {}) if k.startswith("mem/")), None)
    if key is None:
        return None
    columns = (key, key.replace("mem/", "mem/val_", 1))
    values = [float(r[k]) for r in rows for k in columns if r.get(k)]
    values = [v for v in values if math.isfinite(v)]
    return (key, max(values)) if values else None


def compare_with_vanilla(trainer: Any) -> list[dict] | None:
    """``on_train_end`` with ``checkpoint_compare``: measure this run's plan against vanilla and log the summary.

    Returns:
        (list[dict] | None): The two rows of ``compare_plans`` (vanilla first), or ``None`` when not asked for, when
        nothing was recomputed, or when vanilla's step does not fit the device.
    """
    if not getattr(trainer.args, "checkpoint_compare", False):
        return None
    model = network(trainer.model)
    plan, mode, loss = checkpoint_plan(model) or CheckpointPlan(), checkpoint_mode(model), loss_checkpointing(model)
    if not plan.regions and loss is None:
        LOGGER.info(f"{PREFIX} compare: nothing was recomputed in this run")
        return None
    # per process, as each trains: Ultralytics' ``batch_size`` is the global batch, split across DDP's ranks
    batch = max(int(trainer.batch_size) // max(getattr(trainer, "world_size", 1), 1), 1)
    imgsz = int(trainer.args.imgsz)
    name = " + ".join([*([plan.describe(mode)] if plan.regions else []), *([f"loss {loss}"] if loss else [])])
    layers = plan.layer_spec() or None
    copy = deepcopy(model).train()  # the plans are measured on copies of a plain, train-mode copy
    disable_checkpointing(copy)
    disable_loss_checkpointing(copy)
    LOGGER.info(f"{PREFIX} compare: one training step of the final model with and without checkpointing, "
                f"imgsz={imgsz} batch={batch}, side by side...")
    try:  # each step within what the device has free: a step that does not fit is a row with fits=False
        ours = PlanSettings.of(plan.stages, mode or Mode.FULL, layers, loss or "none")
        shape = StepShape(imgsz, batch, amp=training_formats(trainer.args, trainer.device, trainer.amp)[0])
        rows = compare_plans(copy, shape, {"vanilla": PlanSettings(), name: ours}, COMPARE_ROUNDS)
    finally:
        del copy
    if over := [r["plan"] for r in rows if not r["fits"]]:
        LOGGER.info(f"{PREFIX} compare: the step of {' and '.join(over)} does not fit what this device has free at "
                    f"imgsz={imgsz} batch={batch}; {name} trained in it")
        return None
    peak = run_peak(trainer.csv)
    for line in summary_lines(rows, peak):
        LOGGER.info(f"{PREFIX} {line}")
    if peak is not None and trainer.args.plots and (path := plot_memory(trainer.csv, vanilla_peak(rows, peak[1]))):
        trainer.on_plot(path)  # memory.png again, vanilla's estimate beside the run's peaks
    return rows


def say_why_map_is_zero(trainer: Any) -> None:
    """``on_fit_epoch_end``: where a model trained from scratch validates at mAP 0 in its first epoch, say once why, so
    that a newcomer does not read the first epochs' zeros as a fault of checkpointing."""
    model = str(trainer.args.model)
    if trainer.epoch != trainer.start_epoch or not model.endswith((".yaml", ".yml")):
        return
    maps = [v for k, v in trainer.metrics.items() if k.startswith("metrics/mAP50(")]
    if maps and all(v == 0 for v in maps):
        LOGGER.info(f"{PREFIX} mAP 0: {Path(model).name} is trained from scratch and finds no object yet in its "
                    f"first epochs; fine-tune from .pt weights (model={Path(model).stem}.pt) for mAP from the start")


def vanilla_peak(rows: list[dict], gb: float) -> float:
    """What vanilla would have peaked at in a run that peaked at ``gb``: the run's peak plus the difference of the
    two steps measured side by side (``rows``: vanilla's, this plan's)."""
    vanilla, ours = rows
    return gb + (vanilla["peak_MiB"] - ours["peak_MiB"]) / 1024


def summary_lines(rows: list[dict], peak: tuple[str, float] | None) -> list[str]:
    """One small table (vanilla, this run's plan: step peak, and memory, FLOPs and step time as multiples of
    vanilla's) and one sentence: the run's peak next to what vanilla would have needed, and what that cost."""
    vanilla, ours = rows
    lines = [f"  {'plan':<36}{'step peak MiB':>15}{'x vanilla':>11}{'FLOPs x':>9}{'time x':>13}"]
    for r in rows:
        name = r["plan"] if len(r["plan"]) <= 35 else r["plan"][:34] + "…"
        lines.append(f"  {name:<36}{r['peak_MiB']:>15.1f}{r['peak_ratio']:>11.3f}{r['flops_ratio']:>9.3f}"
                     f"{time_x(r):>13}")
    cost = ("for a step time within its timing noise" if within_noise(ours) else
            f"for {ours['time_ratio'] - 1:+.0%} step time")
    if peak is None:
        return [*lines, f"checkpointing kept {1 - ours['peak_ratio']:.0%} less step memory {cost}"]
    key, gb = peak  # the run's whole peak (weights, EMA, optimizer, activations, validation)
    without = vanilla_peak(rows, gb)
    return [*lines, f"this run peaked at {gb:.3f} GB over its epochs and validations ({key} and its val twin in "
                    f"results.csv); vanilla would need about {without:.3f} GB: {1 - gb / without:.0%} less {cost}"]
