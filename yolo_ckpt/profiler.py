"""Report what checkpointing buys: per-stage saved bytes and recompute FLOPs, per-plan peak memory and step time.

Every figure is measured on a real training step — ``model.loss(batch)`` forward and backward, the step the trainer
runs — with exact tensor accounting (``LiveTensorTracker``), ``FlopCounterMode`` (convolutions and matmuls, recompute
included) and wall-clock time, checkpointed and vanilla side by side in one process.

Example:
    >>> from yolo_ckpt.measure import build_model
    >>> model = build_model("yolo11n.yaml")
    >>> rows = compare_plans(model, imgsz=320, batch=2, plans={"none": [], "all": "all"}, repeats=1)
    >>> rows[1]["peak_ratio"] < 0.7
    True
"""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .measure import measure_step, planned_copy, step_loss, time_steps, training_batch, with_plan
from .model import disable_checkpointing
from .plots import legend_points
from .stages import CheckpointPlan, model_stages


def compare_plans(model: nn.Module, imgsz: int, batch: int, plans: dict[str, Any], repeats: int = 3,
                  progress: bool = False, amp: torch.dtype | None = None) -> list[dict]:
    """Measure each plan's training step side by side; ratios are to the first plan (vanilla).

    A plan is a ``checkpoint_stages`` value, or a ``(checkpoint_stages, checkpoint_mode[, checkpoint_layers])``
    tuple.

    Memory and FLOPs are exact per plan; step times are medians of ``repeats`` interleaved rounds (``time_steps``);
    ``amp`` is the forward's autocast dtype (``None``: full precision).

    Returns:
        (list[dict]): One row per plan: name, stages, peak/FLOP/time figures and ratios to the first plan.
    """
    from ultralytics.utils import TQDM

    data = training_batch(model, imgsz, batch)
    plans = {name: spec if isinstance(spec, tuple) else (spec, "full") for name, spec in plans.items()}
    models = {name: with_plan(model, *spec) for name, spec in plans.items()}
    items = TQDM(models.items(), desc="plans", total=len(models)) if progress else models.items()
    steps = {name: measure_step(m, data, repeats=1, amp=amp) for name, m in items}  # a timed step warms up too
    seconds = time_steps(list(models.values()), data, repeats, amp)
    for m in models.values():
        disable_checkpointing(m)
    del models
    rows = []
    base, base_s = steps[next(iter(steps))], seconds[0]
    for (name, step), s in zip(steps.items(), seconds):
        rows.append({
            "plan": name,
            "stages": CheckpointPlan.from_spec(model, plans[name][0]).stages,
            "layers": CheckpointPlan.from_spec(model, [], *plans[name][2:]).layer_regions,
            "mode": plans[name][1],
            "peak_MiB": round(step.peak_bytes / 2**20, 1),
            "GFLOPs": round(step.flops / 1e9, 2),
            "step_s": round(s, 4),
            "peak_ratio": round(step.peak_bytes / base.peak_bytes, 3),
            "flops_ratio": round(step.flops / base.flops, 3),
            "time_ratio": round(s / base_s, 3) if base_s else None,
            **({"cuda_peak_MiB": round(step.cuda_peak_bytes / 2**20, 1),
                "cuda_peak_ratio": round(step.cuda_peak_bytes / base.cuda_peak_bytes, 3)}
               if step.cuda_peak_bytes else {}),
        })
    return rows


def _saved_per_stage(model: nn.Module, data: dict, stages: dict[int, tuple[int, ...]]) -> dict[int, int]:
    """Bytes each stage saves for backward in a plain step, from ``saved_tensors_hooks`` (one count per storage)."""
    saved: dict[int, dict[int, int]] = {k: {} for k in stages}
    hooks, contexts = [], {}

    def enter(k):
        def pack(t):  # keeps nothing: no backward follows (see stages.head_layers on what keeping t would leak)
            saved[k][t.untyped_storage()._cdata] = t.untyped_storage().nbytes()

        contexts[k] = torch.autograd.graph.saved_tensors_hooks(pack, lambda _: None)
        contexts[k].__enter__()

    for k, layers in stages.items():
        hooks.append(model.model[layers[0]].register_forward_pre_hook(lambda m, i, k=k: enter(k)))
        leave = lambda m, i, o, k=k: contexts[k].__exit__(None, None, None)  # noqa: E731
        hooks.append(model.model[layers[-1]].register_forward_hook(leave))
    try:
        step_loss(model, data)
    finally:
        for h in hooks:
            h.remove()
    return {k: sum(v.values()) for k, v in saved.items()}


def profile_stages(model: nn.Module, imgsz: int, batch: int, progress: bool = False,
                   amp: torch.dtype | None = None) -> list[dict]:
    """Per backbone stage: layers, output shape, bytes kept for backward with and without checkpointing, FLOPs.

    Without checkpointing, a stage keeps what its ops save for backward (``saved_tensors_hooks``). Checkpointed, it
    keeps that minus what checkpointing frees, the drop in exact live tensor bytes after forward when this stage alone
    is checkpointed. Recompute FLOPs are the extra FLOPs of that step.
    """
    from ultralytics.utils import TQDM

    data = training_batch(model, imgsz, batch)
    stages = model_stages(model)
    shapes = {}
    ends = [model.model[layers[-1]] for layers in stages.values()]
    hooks = [m.register_forward_hook(lambda m, i, o: shapes.__setitem__(m.i, tuple(o.shape))) for m in ends]
    base = measure_step(model, data, repeats=0, amp=amp)
    for h in hooks:
        h.remove()
    saved = _saved_per_stage(model, data, stages)
    model.zero_grad(set_to_none=True)
    rows = []
    for k in TQDM(sorted(stages), desc="stages") if progress else sorted(stages):
        with planned_copy(model, [k]) as m:
            step = measure_step(m, data, repeats=0, amp=amp)
        freed = base.saved_bytes - step.saved_bytes
        rows.append({
            "stage": k,
            "layers": list(stages[k]),
            "modules": [type(model.model[i]).__name__ for i in stages[k]],
            "output_shape": list(shapes[stages[k][-1]]),
            "saved_MiB_vanilla": round(saved[k] / 2**20, 2),
            "saved_MiB_checkpointed": round((saved[k] - freed) / 2**20, 2),
            "recompute_GFLOPs": round((step.flops - base.flops) / 1e9, 3),
        })
    return rows


def standard_plans(model: nn.Module) -> dict[str, Any]:
    """The plans the profiler compares: none, each single stage, [2,3] and all, all recomputed selectively, and the
    whole network (all stages and ``checkpoint_layers=head``), full and selective."""
    stages = sorted(model_stages(model))
    plans = {"none": [], **{f"[{k}]": [k] for k in stages}}
    if {2, 3} <= set(stages):
        plans["[2,3]"] = [2, 3]
    plans["all"] = "all"
    plans["all selective"] = ("all", "selective")
    plans["all + head"] = ("all", "full", "head")
    plans["all + head selective"] = ("all", "selective", "head")
    return plans


def write_profile(save_dir: Path, stages: list[dict], plans: list[dict], extra: dict | None = None) -> list[Path]:
    """Write profile.json, plans.csv, stages.csv and a PNG of memory versus time; with ``extra``
    (``yolo_ckpt.tradeoff.tradeoffs``) also candidates.csv, untouchable.csv and pareto.png; return the paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    save_dir.mkdir(parents=True, exist_ok=True)
    paths = [save_dir / "profile.json", save_dir / "plans.csv", save_dir / "stages.csv", save_dir / "tradeoff.png"]
    extra = extra or {}
    tables = {"plans.csv": plans, "stages.csv": stages}
    if extra:
        tables.update({"candidates.csv": extra["candidates"], "untouchable.csv": extra["untouchable"]})
    paths[0].write_text(json.dumps({"stages": stages, "plans": plans, **extra}, indent=2, default=str))
    for name, rows in tables.items():
        with open(save_dir / name, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list({k: None for r in rows for k in r}))  # every row's keys
            writer.writeheader()
            writer.writerows(rows)
    fig, ax = plt.subplots(figsize=(6, 4.5))
    legend_points(ax, plans, "time_ratio", "peak_ratio", lambda r: r["plan"])
    ax.set(xlabel="step time / vanilla", ylabel="peak live tensor bytes / vanilla", title="checkpointing trade-off")
    ax.grid(alpha=0.3)
    fig.savefig(paths[3], dpi=150, bbox_inches="tight")
    plt.close(fig)
    if extra:
        from .tradeoff import plot_front

        paths += [save_dir / "candidates.csv", save_dir / "untouchable.csv", save_dir / "pareto.png"]
        plot_front(extra["candidates"], paths[-1], extra.get("chosen"))
    return paths
