"""Measure what checkpointing buys: per-stage saved bytes and recompute FLOPs, per-plan peak memory and step time.

Every figure is measured on a real training step — ``model.loss(batch)`` forward and backward, the step the trainer
runs — with exact tensor accounting (``LiveTensorTracker``), ``FlopCounterMode`` (convolutions and matmuls, recompute
included) and wall-clock time, checkpointed and vanilla side by side in one process.

Example:
    >>> from yolo_ckpt.profiler import build_model, compare_plans
    >>> model = build_model("yolo11n.yaml")
    >>> rows = compare_plans(model, imgsz=320, batch=2, plans={"none": [], "all": "all"}, repeats=1)
    >>> rows[1]["peak_ratio"] < 0.7
    True
"""

from __future__ import annotations

import copy
import csv
import json
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from .memory import LiveTensorTracker
from .model import enable_checkpointing
from .stages import CheckpointPlan, model_stages

OBJECTS_PER_IMAGE = 50  # boxes per image in the measured batch; loss memory grows with them


def build_model(cfg: str, overrides: dict | None = None) -> nn.Module:
    """Build the Ultralytics task model for a model YAML (or load a ``.pt``), ready for ``model.loss``."""
    from ultralytics import YOLO
    from ultralytics.cfg import get_cfg

    model = YOLO(cfg).model
    model.args = get_cfg(overrides={"task": getattr(model, "task", None) or "detect", **(overrides or {})})
    return model.float().train()


def training_batch(model: nn.Module, imgsz: int, batch: int, objects: int = OBJECTS_PER_IMAGE) -> dict:
    """A deterministic batch in the format Ultralytics' loss of the model's task expects.

    Args:
        model: An Ultralytics task model (its class decides the label format).
        imgsz: Square image side.
        batch: Images in the batch.
        objects: Labelled objects per image (detect, segment, pose, obb).

    Semantic segmentation gets ``semantic_mask`` (int32 class ids, batch x imgsz x imgsz: the image's resolution,
    as ``SemanticFormat`` and the collate give it; the loss upsamples its logits to it) and depth gets ``depth``
    (float32 metres, batch x 1 x imgsz x imgsz, as ``DepthFormat``); every pixel is valid, the most the losses keep.
    """
    from ultralytics.nn.tasks import (
        ClassificationModel,
        DepthModel,
        OBBModel,
        PoseModel,
        SegmentationModel,
        SemanticSegmentationModel,
    )

    g = torch.Generator().manual_seed(0)
    device = next(model.parameters()).device
    nc = len(model.names) if hasattr(model, "names") else 80
    b = {"img": torch.rand(batch, model.yaml.get("channels", 3), imgsz, imgsz, generator=g)}
    if isinstance(model, ClassificationModel):
        b["cls"] = torch.randint(0, nc, (batch,), generator=g)
        return {k: v.to(device) for k, v in b.items()}
    if isinstance(model, SemanticSegmentationModel):
        b["semantic_mask"] = torch.randint(0, model.model[-1].nc, (batch, imgsz, imgsz), generator=g, dtype=torch.int32)
        return {k: v.to(device) for k, v in b.items()}
    if isinstance(model, DepthModel):
        b["depth"] = torch.rand(batch, 1, imgsz, imgsz, generator=g) * 50 + 1  # 1-51 m, all valid (> 0.001)
        return {k: v.to(device) for k, v in b.items()}
    n = batch * objects
    b["batch_idx"] = torch.arange(batch).repeat_interleave(objects).float()
    b["cls"] = torch.randint(0, nc, (n, 1), generator=g).float()
    xywh = torch.cat([torch.rand(n, 2, generator=g) * 0.8 + 0.1, torch.rand(n, 2, generator=g) * 0.08 + 0.02], 1)
    b["bboxes"] = torch.cat([xywh, torch.rand(n, 1, generator=g)], 1) if isinstance(model, OBBModel) else xywh
    if isinstance(model, PoseModel):
        b["keypoints"] = torch.rand(n, *model.kpt_shape, generator=g)
    if isinstance(model, SegmentationModel):
        b["masks"] = torch.randint(0, objects + 1, (batch, imgsz // 4, imgsz // 4), generator=g).float()
    return {k: v.to(device) for k, v in b.items()}


@dataclass
class Step:
    """One measured training step.

    Attributes:
        peak_bytes (int): Exact peak of live tensor bytes the step allocated (activations, gradients, loss).
        flops (int): Convolution/matmul FLOPs of forward, recompute and backward.
        seconds (float): Median wall-clock time of the step.
        saved_bytes (int): Tensor bytes still alive after forward, i.e. kept for backward.
        cuda_peak_bytes (int | None): ``torch.cuda.max_memory_allocated`` over the timed steps (CUDA only).
    """

    peak_bytes: int
    flops: int
    seconds: float
    saved_bytes: int
    cuda_peak_bytes: int | None = None


def _loss(model: nn.Module, batch: dict, amp: torch.dtype | None = None) -> torch.Tensor:
    """The trainer's forward: ``model.loss`` under autocast of ``amp``, as Ultralytics' loop; backward is outside."""
    with torch.autocast(batch["img"].device.type, dtype=amp, enabled=amp is not None):
        loss, _ = model.loss(batch)
        return loss.sum()


def measure_peak(model: nn.Module, batch: dict, amp: torch.dtype | None = None) -> tuple[int, int]:
    """Exact memory of one training step, ``model.loss(batch)`` forward and backward, and nothing else running.

    The model's gradients are cleared first (as ``optimizer.zero_grad()`` does), so each measurement starts like a
    training step.

    Args:
        model: The model as it trains (checkpoint plan installed, or plain).
        batch: A batch as ``training_batch`` makes it.
        amp: Autocast dtype of the forward (``torch.float16``/``torch.bfloat16``), ``None`` for full precision.

    Returns:
        (tuple[int, int]): Peak live tensor bytes of the step, and bytes still alive after forward (kept for backward).
    """
    model.zero_grad(set_to_none=True)
    with LiveTensorTracker() as tracker:
        loss = _loss(model, batch, amp)
        saved = tracker.current
        loss.backward()
        del loss
    model.zero_grad(set_to_none=True)
    return tracker.peak, saved


def measure_step(model: nn.Module, batch: dict, repeats: int = 3, amp: torch.dtype | None = None) -> Step:
    """Measure ``model.loss(batch)`` forward + backward: exact memory, FLOPs, median time (see ``measure_peak``
    and ``step_flops``)."""
    peak, saved = measure_peak(model, batch, amp)
    flops = step_flops(model, batch, amp)
    cuda = batch["img"].is_cuda and repeats > 0
    if cuda:  # the allocator's own peak over the timed steps, for comparison with the exact tracker
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    seconds = time_steps([model], batch, repeats, amp)[0]
    cuda_peak = torch.cuda.max_memory_allocated() if cuda else None
    return Step(peak, flops, seconds, saved, cuda_peak)


def step_flops(model: nn.Module, batch: dict, amp: torch.dtype | None = None) -> int:
    """Convolution/matmul FLOPs of one training step, recompute included (``FlopCounterMode``).

    Counted in a step of its own: the counter keeps tensors alive that checkpointing frees, so memory is measured
    without it.
    """
    model.zero_grad(set_to_none=True)
    with FlopCounterMode(display=False) as counter:
        _loss(model, batch, amp).backward()
    model.zero_grad(set_to_none=True)
    return counter.get_total_flops()


def with_plan(model: nn.Module, spec: Any, mode: str = "full", layers: Any = None) -> nn.Module:
    """A copy of ``model`` with ``checkpoint_stages=spec``, ``checkpoint_mode=mode`` and ``checkpoint_layers=layers``
    installed."""
    m = copy.deepcopy(model)
    enable_checkpointing(m, CheckpointPlan.from_spec(m, spec, layers), mode)
    return m


def time_steps(models: list[nn.Module], batch: dict, repeats: int, amp: torch.dtype | None = None) -> list[float]:
    """Median step time of each model, timed in interleaved rounds so machine drift hits all of them alike."""
    times: list[list[float]] = [[] for _ in models]
    cuda = batch["img"].is_cuda
    for _ in range(repeats):
        for model, ts in zip(models, times):
            model.zero_grad(set_to_none=True)
            if cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            _loss(model, batch, amp).backward()
            if cuda:
                torch.cuda.synchronize()
            ts.append(time.perf_counter() - t0)
            model.zero_grad(set_to_none=True)
    return [statistics.median(ts) if ts else 0.0 for ts in times]


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
        def pack(t):
            saved[k][t.untyped_storage()._cdata] = t.untyped_storage().nbytes()
            return t

        contexts[k] = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
        contexts[k].__enter__()

    for k, layers in stages.items():
        hooks.append(model.model[layers[0]].register_forward_pre_hook(lambda m, i, k=k: enter(k)))
        leave = lambda m, i, o, k=k: contexts[k].__exit__(None, None, None)  # noqa: E731
        hooks.append(model.model[layers[-1]].register_forward_hook(leave))
    try:
        _loss(model, data)
    finally:
        for h in hooks:
            h.remove()
    return {k: sum(v.values()) for k, v in saved.items()}


def profile_stages(model: nn.Module, imgsz: int, batch: int, progress: bool = False) -> list[dict]:
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
    base = measure_step(model, data, repeats=0)
    for h in hooks:
        h.remove()
    saved = _saved_per_stage(model, data, stages)
    model.zero_grad(set_to_none=True)
    rows = []
    for k in TQDM(sorted(stages), desc="stages") if progress else sorted(stages):
        step = measure_step(with_plan(model, [k]), data, repeats=0)
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
    fig, ax = plt.subplots(figsize=(6, 4.5), tight_layout=True)
    for r in plans:
        ax.scatter(r["time_ratio"], r["peak_ratio"], color="tab:blue")
        ax.annotate(r["plan"], (r["time_ratio"], r["peak_ratio"]), textcoords="offset points", xytext=(4, 4))
    ax.set(xlabel="step time / vanilla", ylabel="peak live tensor bytes / vanilla", title="checkpointing trade-off")
    ax.grid(alpha=0.3)
    fig.savefig(paths[3], dpi=150)
    plt.close(fig)
    if extra:
        from .tradeoff import plot_front

        paths += [save_dir / "candidates.csv", save_dir / "untouchable.csv", save_dir / "pareto.png"]
        plot_front(extra["candidates"], paths[-1], extra.get("chosen"))
    return paths
