"""Every candidate plan measured: the memory-versus-FLOPs front, the largest imgsz per plan, and what checkpointing
cannot touch.

``yolo-ckpt profile`` uses these to answer what users ask before a run: which plans are worth it (the Pareto front of
peak memory against recompute FLOPs, with the plan ``checkpoint_stages=auto`` would choose for ``memory_budget``),
how large the images can be at a given batch ("how large can my scans be at batch 8 on a 24 GB GPU?"), and how much
memory no plan can save: the model state and the loss with its assigner, which grows with objects per image.

Example:
    >>> from yolo_ckpt.measure import build_model
    >>> rows = measure_candidates(build_model("yolov8n.yaml"), imgsz=128, batch=2)
    >>> sum(r["pareto"] for r in rows) >= 2  # vanilla and the plan that keeps the least, at least
    True
"""

from __future__ import annotations

import math

import torch
from torch import nn

from .autobatch import parse_memory
from .measure import (
    batch_bytes,
    grad_bytes,
    planned_copy,
    state_bytes,
    step_bytes,
    step_flops,
    time_steps,
    training_batch,
    weight_bytes,
    with_plan,
)
from .model import disable_checkpointing
from .planner import Candidate, Costs, candidates, choose_plan, describe, unit_costs, vanilla
from .plots import legend_points


def _row(c: Candidate | None, nbytes: int, flops: int, base: tuple[int, int]) -> dict:
    settings = c.settings if c else {"checkpoint_stages": [], "checkpoint_layers": [], "checkpoint_mode": "full"}
    return {"plan": describe(c) if c else "none", **settings, "step_bytes": nbytes, "flops": flops,
            "step_MiB": round(nbytes / 2**20, 1),
            "peak_ratio": round(nbytes / base[0], 4), "flops_ratio": round(flops / base[1], 4),
            "predicted_MiB": round((c.predicted_bytes if c else nbytes) / 2**20, 1)}


def _copy(model: nn.Module, row: dict):
    """A copy of ``model`` with ``row``'s plan installed, for a ``with`` block."""
    return planned_copy(model, row["checkpoint_stages"], row["checkpoint_mode"], row["checkpoint_layers"] or None)


def pareto(rows: list[dict]) -> list[dict]:
    """Mark ``row["pareto"]``: no other plan keeps at most as many bytes for at most as many FLOPs, one of them fewer
    (of plans equal in both, the first listed — the cheaper by prediction — stands for them)."""
    for i, r in enumerate(rows):
        key = (r["step_bytes"], r["flops"])
        r["pareto"] = not any(o["step_bytes"] <= key[0] and o["flops"] <= key[1]
                              and ((o["step_bytes"], o["flops"]) != key or j < i) for j, o in enumerate(rows) if j != i)
    return rows


def measure_candidates(model: nn.Module, imgsz: int, batch: int, amp: torch.dtype | None = None,
                       repeats: int = 1, costs: Costs | None = None, measured: dict | None = None) -> list[dict]:
    """Every candidate plan of ``checkpoint_stages=auto`` measured at ``batch`` and ``imgsz`` on copies of the model.

    ``costs`` are the model's ``unit_costs`` when already measured; ``measured`` is filled as ``choose_plan`` fills
    it, so that choosing afterwards measures nothing again.

    Returns:
        (list[dict]): One row per plan, vanilla first: settings, step bytes (model state, batch and exact step peak,
        as planning counts them), ratios to vanilla of the step bytes and of FLOPs (both measured), the predicted
        bytes, the Pareto flag, and for Pareto plans the measured step time ratio (median of ``repeats``).
    """
    costs = costs or unit_costs(model, imgsz, amp=amp)
    measured = {} if measured is None else measured
    data = training_batch(model, imgsz, batch)
    fixed = state_bytes(model) + batch_bytes(model, imgsz, batch)
    rows: list[dict] = []
    base = (0, 0)
    for c in [vanilla(costs, batch, fixed), *candidates(costs, batch, fixed)]:
        with c.copy(model) as m:
            measured[c.units, c.mode, batch] = step_bytes(m, imgsz, batch, amp=amp)
            nbytes, flops = measured[c.units, c.mode, batch], step_flops(m, data, amp)
        if not rows:
            base = (nbytes, flops)
        rows.append(_row(c if c.units else None, nbytes, flops, base))
    pareto(rows)
    front = [r for r in rows if r["pareto"]]
    models = [with_plan(model, r["checkpoint_stages"], r["checkpoint_mode"], r["checkpoint_layers"] or None)
              for r in [rows[0], *front]]
    seconds = time_steps(models, data, max(repeats, 1), amp)
    for m in models:
        disable_checkpointing(m)
    for r, s in zip(front, seconds[1:]):
        r["time_ratio"] = round(s / seconds[0], 3)
    return rows


def largest_imgsz(model: nn.Module, row: dict, batch: int, target: int, imgsz: int, stride: int = 32,
                  amp: torch.dtype | None = None) -> int:
    """The largest multiple of ``stride`` whose step with ``row``'s plan at ``batch`` is predicted to fit ``target``.

    Measured at ``imgsz`` and ``imgsz // 2``: the bytes beyond the model state grow as ``a + b * pixels`` (activations,
    the batch and the loss's anchors all scale with pixels), solved for the target. A prediction, not a measurement
    at that size: on a GPU, confirm with a run.
    """
    with _copy(model, row) as m:
        static = state_bytes(m)
        small = max(imgsz // 2 // stride * stride, stride)
        y1, y2 = (step_bytes(m, s, batch, amp=amp) - static for s in (small, imgsz))
    b = (y2 - y1) / (imgsz**2 - small**2)
    a = y2 - b * imgsz**2
    if target <= static + a or b <= 0:
        return 0
    return int(math.sqrt((target - static - a) / b)) // stride * stride


def tradeoffs(model: nn.Module, imgsz: int, batch: int, memory_budget: str | int | None = None,
              fraction: float = 0.6, amp: torch.dtype | None = None) -> dict:
    """What ``yolo-ckpt profile`` reports beyond its fixed plans: every candidate plan with its Pareto flag; with
    ``memory_budget``, auto's choice for ``fraction`` of it and the largest imgsz each Pareto plan (and vanilla) fits
    at this batch; the memory no plan changes.

    Returns:
        (dict): ``candidates`` (rows of ``measure_candidates``), ``untouchable``, ``notes`` (lines for the log) and
        ``chosen`` (auto's row, or ``None``).
    """
    costs, measured = unit_costs(model, imgsz, amp=amp), {}
    rows = measure_candidates(model, imgsz, batch, amp=amp, costs=costs, measured=measured)
    notes, chosen = [f"{sum(r['pareto'] for r in rows)} of {len(rows)} plans on the Pareto front"], None
    if memory_budget is not None:
        target = int(fraction * parse_memory(memory_budget))
        try:
            c = choose_plan(model, imgsz, batch, target, amp=amp, costs=costs, measured=measured).candidate
            chosen = next(r for r in rows if r["plan"] == describe(c) and r["checkpoint_mode"] == c.mode)
            chosen["auto"] = True
            notes.append(f"checkpoint_stages=auto chooses {chosen['plan']} for {fraction:.0%} of "
                         f"memory_budget={memory_budget} at imgsz={imgsz} batch={batch}")
        except ValueError as e:
            notes.append(str(e))
        for r in rows:
            if r["pareto"] or r is rows[0]:  # vanilla too, for comparison
                r["largest_imgsz"] = largest_imgsz(model, r, batch, target, imgsz, amp=amp)
                notes.append(f"{r['plan']}: imgsz up to {r['largest_imgsz']} at batch {batch} (predicted)")
    return {"candidates": rows, "untouchable": untouchable(model, imgsz, batch, amp=amp), "notes": notes,
            "chosen": chosen}


def untouchable(model: nn.Module, imgsz: int, batch: int, objects: tuple[int, ...] = (10, 50, 200),
                amp: torch.dtype | None = None) -> list[dict]:
    """Memory no checkpoint plan changes: model state (weights, gradients, EMA, two AdamW moments) and the loss with
    its assigner, measured (exact peak of ``model.loss`` on given predictions) at several objects per image."""
    from .memory import LiveTensorTracker

    weights, grads = weight_bytes(model), grad_bytes(model)
    rows = [{"what": "weights", "MiB": weights / 2**20}, {"what": "gradients", "MiB": grads / 2**20},
            {"what": "EMA copy", "MiB": weights / 2**20},
            {"what": "optimizer (AdamW, 2 moments)", "MiB": 2 * grads / 2**20}]
    with planned_copy(model) as plain:
        for n in objects:
            data = training_batch(plain, imgsz, batch, n)
            with torch.autocast(data["img"].device.type, dtype=amp, enabled=amp is not None):
                preds = plain(data["img"])
                with LiveTensorTracker() as tracker:
                    plain.loss(data, preds)[0].sum()
            rows.append({"what": f"loss + assigner, {n} objects per image", "MiB": tracker.peak / 2**20})
            del preds
    for r in rows:
        r["MiB"] = round(r["MiB"], 1)
    return rows


def plot_front(rows: list[dict], path, chosen: dict | None = None) -> None:
    """Peak memory against FLOPs for every plan, the Pareto front joined and labelled, ``chosen`` ringed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 5))
    ax.scatter([r["flops_ratio"] for r in rows], [r["peak_ratio"] for r in rows], s=12, color="tab:gray",
               label="candidate plans")
    front = sorted((r for r in rows if r["pareto"]), key=lambda r: r["flops_ratio"])
    ax.plot([r["flops_ratio"] for r in front], [r["peak_ratio"] for r in front], "-", color="tab:blue",
            label="Pareto front")
    if chosen:
        ax.scatter([chosen["flops_ratio"]], [chosen["peak_ratio"]], s=160, facecolors="none", edgecolors="tab:red",
                   linewidths=2, label=f"auto: {chosen['plan']}")
    legend_points(ax, front, "flops_ratio", "peak_ratio",
                  lambda r: r["plan"] + (f" ({r['time_ratio']:.2f}x time)" if "time_ratio" in r else ""))
    ax.set(xlabel="FLOPs / vanilla", ylabel="step memory / vanilla", title="checkpoint plans: memory vs recompute")
    ax.grid(alpha=0.3)
    fig.savefig(path, dpi=150, bbox_inches="tight")
    plt.close(fig)
