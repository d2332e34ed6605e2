"""Every candidate plan of one mode measured: the memory-versus-FLOPs front (with measured and predicted step time),
the largest imgsz per plan, and what checkpointing cannot touch.

``yolo-ckpt profile`` uses these to answer what users ask before a run: which plans are worth it (the Pareto front of
peak memory against recompute FLOPs, each point with its measured step time and the one ``auto`` predicts, with the
plan ``checkpoint_stages=auto`` would choose for ``memory_budget``),
how large the images can be at a given batch ("how large can my scans be at batch 8 on a 24 GB GPU?"), and how much
memory no plan can save: the model state and the loss with its assigner, which grows with objects per image.

On a GPU or a simulated one (``simulate_gpu=``) every step runs within what the device has free
(``yolo_ckpt.report.fitting``): a plan whose step does not fit has ``fits`` false and no figures, the front is of
the plans that fit, and auto's choice is ``choose_plan``'s on that device.

Examples:
    >>> from yolo_ckpt.memory.step import StepShape, build_model
    >>> rows = measure_candidates(build_model("yolov8n.yaml"), StepShape(128, 2))
    >>> sum(r["pareto"] for r in rows) >= 2  # vanilla and the plan that keeps the least, at least
    True
"""

from __future__ import annotations

import dataclasses
import math
from contextlib import nullcontext

import torch
from torch import nn

from ..memory.device import device_memory
from ..memory.step import (
    StepShape,
    batch_bytes,
    copy_for_plans,
    grad_bytes,
    loop_bytes,
    planned_copy,
    state_bytes,
    training_batch,
    weight_bytes,
)
from ..memory.tracker import LiveTensorTracker
from ..planning.autobatch import parse_memory
from ..planning.choice import choose_plan
from ..planning.costs import Costs, unit_costs
from ..planning.search import candidates, no_recompute
from ..planning.units import HEAD, Candidate, describe
from ..regions.settings import PlanSettings
from .fitting import Fit, device_room, fitting_step, mib, plan_step, ratio, time_plans, within_device
from .plots import axes, legend_points
from .progress import Track, tracked


def _row(c: Candidate, fit: Fit | None) -> dict:
    """A candidate's row; its ratios are filled in once vanilla's row is known (``_ratios``)."""
    return {"plan": describe(c), **c.settings.keys(), "fits": fit is not None,
            "step_bytes": fit.step_bytes if fit else None, "flops": fit.flops if fit else None,
            "step_MiB": mib(fit.step_bytes) if fit else None, "peak_ratio": None, "flops_ratio": None,
            "predicted_MiB": mib(c.predicted_bytes), "predicted_s": round(c.seconds, 4)}


def _ratios(rows: list[dict]) -> None:
    """Ratios to vanilla (``rows[0]``) of step bytes and FLOPs, both measured (none when vanilla did not fit), and of
    predicted step time."""
    for r in rows:
        r["peak_ratio"] = ratio(r["step_bytes"], rows[0]["step_bytes"], 4)
        r["flops_ratio"] = ratio(r["flops"], rows[0]["flops"], 4)
        r["predicted_time_ratio"] = ratio(r["predicted_s"], rows[0]["predicted_s"], 4)


def _plan(row: dict) -> PlanSettings:
    """``row``'s plan (its layer keys; the loss plan the model has)."""
    return PlanSettings.from_keys({**row, "checkpoint_loss": None})


def pareto(rows: list[dict]) -> list[dict]:
    """Mark ``row["pareto"]``: a measured plan (one that fit the device) that no other keeps at most as many bytes for
    at most as many FLOPs, one of them fewer (of plans equal in both, the first listed — the cheaper by prediction —
    stands for them)."""
    for i, r in enumerate(rows):
        key = (r["step_bytes"], r["flops"])
        r["pareto"] = r["fits"] and not any(o["fits"] and o["step_bytes"] <= key[0] and o["flops"] <= key[1]
                                            and ((o["step_bytes"], o["flops"]) != key or j < i)
                                            for j, o in enumerate(rows) if j != i)
    return rows


def measure_candidates(model: nn.Module, shape: StepShape, repeats: int = 1, costs: Costs | None = None,
                       measured: dict | None = None, also: tuple = (), track: Track | None = None) -> list[dict]:
    """Every candidate plan of ``checkpoint_stages=auto`` in one mode for all its units, and the plans ``also``
    (``Candidate``s: auto's choice with a mode per unit), measured in a step of ``shape`` on one copy of the
    model, each plan installed in turn (``step.copy_for_plans``; on a device a copy per plan), each step within
    what the device has free (``fitting.fitting_step``). Plans with a mode per unit are not all measured: there are
    ``3**n - 1`` of them for ``n`` units.

    ``costs`` are the model's ``unit_costs`` when already measured. ``measured`` is filled as ``choose_plan`` fills
    it, so that choosing afterwards measures nothing again — only without a device limit: on a device these steps are
    bounded by the device alone, ``choose_plan``'s also by the share (and extrapolated past a device smaller than it),
    so on a device ``choose_plan`` measures its own.

    Returns:
        (list[dict]): One row per plan, vanilla first: settings, ``fits`` (its step fit the device), step bytes (model
        state, batch and exact step peak, as planning counts them) and FLOPs, their ratios to vanilla's (only where
        both were measured), the predicted bytes, the Pareto flag (measured plans only), and for Pareto plans (and
        vanilla) the measured step time ``step_s`` (median of ``repeats``) and its ratio to vanilla's; every row has
        the planner's predicted step time ``predicted_s`` (from the batch-1 steps timed in ``unit_costs``) and its
        ratio to vanilla's prediction. ``track``: a ``progress.Progress`` the steps are counted on.
    """
    batch = shape.batch
    costs = costs or unit_costs(model, shape, track=track)
    share = measured is not None and device_memory(next(model.parameters()).device) is None
    fixed = state_bytes(model) + batch_bytes(model, shape)
    rows: list[dict] = []
    unbounded = device_memory(next(model.parameters()).device) is None
    # without a device limit one copy, each plan installed in turn; on a device a copy per plan, freed with whatever
    # a step that ran out left on it (one shared copy would pass a simulated device's limit: tests/test_tradeoff.py)
    with copy_for_plans(model) if unbounded else nullcontext() as install:
        plans = [no_recompute(costs, batch, fixed), *candidates(dataclasses.replace(costs, mixed=False), batch, fixed),
                 *also]
        for c in tracked(track, plans, f"memory of {len(plans)} candidate plans"):
            fit = fitting_step(install(c.installs), shape) if unbounded else plan_step(model, c.installs, shape)
            if share:
                measured[(*c.key, batch)] = fit.step_bytes
            rows.append(_row(c, fit))
    _ratios(rows)
    pareto(rows)
    front = [r for r in rows if r["pareto"]]
    timed = [*([rows[0]] if rows[0]["fits"] and not rows[0]["pareto"] else []), *front]
    for r, s in zip(timed, time_plans(model, [_plan(r) for r in timed], shape, max(repeats, 1), track)):
        r["step_s"] = round(s, 4)
    for r in front:
        if (t := ratio(r["step_s"], rows[0].get("step_s"))) is not None:
            r["time_ratio"] = t
    return rows


def largest_imgsz(model: nn.Module, row: dict, shape: StepShape, target: int, stride: int = 32) -> int | None:
    """The largest multiple of ``stride`` whose step with ``row``'s plan at ``shape.batch`` is predicted to fit
    ``target``.

    Measured at the two largest of ``shape.imgsz``, half of it, a quarter, ... (multiples of ``stride``) whose
    steps fit the device, each within what it has free (``fitting.fitting_step``): the bytes beyond the model state
    grow as ``a + b * pixels`` (activations, the batch and the loss's anchors all scale with pixels), solved for the
    target. A prediction, not a measurement at that size: on a GPU, confirm with a run. A size whose step did not fit
    a device that holds the target bounds the prediction from above.

    Returns:
        (int | None): The size (0: not even the smallest fits ``target``), or ``None`` when fewer than two sizes fit
        the device, so there is nothing to predict from.
    """
    sizes = [shape.imgsz]
    while (half := max(sizes[-1] // 2 // stride * stride, stride)) < sizes[-1]:
        sizes.append(half)
    with planned_copy(model, _plan(row)) as m:
        static, room, points, over = state_bytes(m), device_room(m), [], None
        for s in sizes:
            if (fit := fitting_step(m, dataclasses.replace(shape, imgsz=s))) is not None:
                points.append((s, fit.step_bytes - static))
            else:
                over = s
            if len(points) == 2:
                break
    if len(points) < 2:
        return None
    (x2, y2), (x1, y1) = points
    b = (y2 - y1) / (x2**2 - x1**2)
    a = y2 - b * x2**2
    if target <= static + a or b <= 0:
        return 0
    size = int(math.sqrt((target - static - a) / b)) // stride * stride
    if over is not None and room is not None and target <= room:  # what the device did not hold, the target cannot
        size = min(size, (over - 1) // stride * stride)
    return size


def tradeoffs(model: nn.Module, shape: StepShape, memory_budget: str | int | None = None, fraction: float = 0.6,
              costs: Costs | None = None, track: Track | None = None) -> dict:
    """What ``yolo-ckpt profile`` reports beyond its fixed plans: every candidate plan with its Pareto flag; with
    ``memory_budget``, auto's choice for ``fraction`` of it (``choose_plan``, on the device the profile runs on) and
    the largest imgsz each Pareto plan (and vanilla) fits at this batch; the memory no plan changes.

    ``shape``: the step every plan is measured in. ``costs``: the model's ``unit_costs`` at ``shape.imgsz`` when
    already measured on this device.

    Returns:
        (dict): ``candidates`` (rows of ``measure_candidates``), ``untouchable``, ``notes`` (lines for the log) and
        ``chosen`` (auto's row, or ``None``).
    """
    dev = device_memory(next(model.parameters()).device)
    try:
        costs = costs or unit_costs(model, shape, track=track)
    except ValueError as e:  # not even vanilla's batch-1 step fits the device: there is nothing to plan from
        return {"candidates": [], "untouchable": untouchable(model, shape), "notes": [str(e)], "chosen": None}
    imgsz, batch = shape.imgsz, shape.batch
    choice, failed = None, None
    if memory_budget is not None:  # first: a choice with a mode per unit is measured among the rows
        target = int(fraction * parse_memory(memory_budget))
        try:  # as training chooses: the share less the other batches Ultralytics' loop holds (step.loop_bytes)
            choice = choose_plan(model, shape, target - loop_bytes(model, shape), costs=costs)
        except ValueError as e:
            failed = str(e)
    listed = {(c.units, c.modes) for c in candidates(dataclasses.replace(costs, mixed=False), batch, 0)}
    # a choice of per-unit modes, or of the neck without the head layer, is not among the one-mode rows: one more row
    also = (choice.candidate,) if choice is not None and (choice.candidate.units, choice.candidate.modes) not in \
        listed | {((), ())} else ()
    rows = measure_candidates(model, shape, costs=costs, also=also, track=track)
    notes, chosen = [f"{sum(r['pareto'] for r in rows)} of {len(rows)} plans on the Pareto front"], None
    if dev is not None:
        notes.append(f"{sum(r['fits'] for r in rows)} of {len(rows)} plans fit the {dev.name} at imgsz={imgsz} "
                     f"batch={batch}; the others are reported with fits=False and no figures")
    if not rows[0]["fits"]:
        notes.append(f"vanilla does not fit the {dev.name} (predicted {rows[0]['predicted_MiB']} MiB): no figure is "
                     f"given as a ratio to it")
    if memory_budget is not None:
        if choice is not None:
            chosen = next(r for r in rows if r["plan"] == describe(choice.candidate))  # one name per plan
            chosen["auto"] = True
            where = f" on the {dev.name}" + (" (extrapolated from batches it holds)" if choice.extrapolated else "") \
                if dev is not None else ""
            notes.append(f"checkpoint_stages=auto chooses {chosen['plan']} for {fraction:.0%} of "
                         f"memory_budget={memory_budget} at imgsz={imgsz} batch={batch}{where}")
        else:
            notes.append(failed)
        for r in rows:
            if r["pareto"] or r is rows[0]:  # vanilla too, for comparison
                r["largest_imgsz"] = largest_imgsz(model, r, shape, target)
                notes.append(f"{r['plan']}: imgsz up to {r['largest_imgsz']} at batch {batch} (predicted)"
                             if r["largest_imgsz"] is not None else
                             f"{r['plan']}: no prediction of its largest imgsz (fewer than two image sizes at "
                             f"batch {batch} fit the device)")
    return {"candidates": rows, "untouchable": untouchable(model, shape), "notes": notes, "chosen": chosen}


def _loss_peak(model: nn.Module, shape: StepShape) -> int:
    """Exact peak of ``model.loss`` on given predictions, at ``shape.objects`` per image."""
    data = training_batch(model, shape)
    with torch.autocast(data["img"].device.type, dtype=shape.amp, enabled=shape.amp is not None):
        preds = model(data["img"])
        with LiveTensorTracker() as tracker:
            model.loss(data, preds)[0].sum()
    return tracker.peak


def untouchable(model: nn.Module, shape: StepShape, objects: tuple[int, ...] = (10, 50, 200)) -> list[dict]:
    """Memory no checkpoint plan changes: model state (weights, gradients, EMA, two AdamW moments) and the loss with
    its assigner, measured (exact peak of ``model.loss`` on given predictions) at several ``objects`` per image (not
    ``shape.objects``), each
    forward and loss within what the device has free (``fitting.within_device``: ``MiB`` is ``None`` where they do
    not fit). The predictions come from the whole network checkpointed, which keeps the least until the loss: the
    loss runs the same ops on the same predictions as after a plain forward, so its figure is the same."""
    weights, grads = weight_bytes(model), grad_bytes(model)
    rows = [{"what": "weights", "MiB": weights}, {"what": "gradients", "MiB": grads},
            {"what": "EMA copy", "MiB": weights}, {"what": "optimizer (AdamW, 2 moments)", "MiB": 2 * grads}]
    with planned_copy(model, PlanSettings.of("all", layers=HEAD)) as least:
        for n in objects:
            peak = within_device(least, lambda n=n: _loss_peak(least, dataclasses.replace(shape, objects=n)))
            rows.append({"what": f"loss + assigner, {n} objects per image", "MiB": peak})
    for r in rows:
        r["MiB"] = mib(r["MiB"])
    return rows


def _times(row: dict) -> str:
    """`` (1.12x time, predicted 1.10x)``: a front point's measured and predicted step time, as ratios to vanilla."""
    shown = [f"{row['time_ratio']:.2f}x time"] if row.get("time_ratio") is not None else []
    if row.get("predicted_time_ratio") is not None:
        shown.append(f"predicted {row['predicted_time_ratio']:.2f}x")
    return f" ({', '.join(shown)})" if shown else ""


def plot_front(rows: list[dict], path, chosen: dict | None = None) -> None:
    """Memory against FLOPs for every measured plan (ratios to vanilla; absolute when vanilla did not fit the
    device), the Pareto front joined and labelled, ``chosen`` ringed where it was measured."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x, y, unit = axes(rows, ("flops_ratio", "peak_ratio", " / vanilla"), ("flops", "step_MiB", ""))
    rows = [r for r in rows if r["fits"]]
    fig, ax = plt.subplots(figsize=(7, 5))
    ax.scatter([r[x] for r in rows], [r[y] for r in rows], s=12, color="tab:gray", label="candidate plans")
    front = sorted((r for r in rows if r["pareto"]), key=lambda r: r[x])
    ax.plot([r[x] for r in front], [r[y] for r in front], "-", color="tab:blue", label="Pareto front")
    if chosen and chosen["fits"]:
        ax.scatter([chosen[x]], [chosen[y]], s=160, facecolors="none", edgecolors="tab:red", linewidths=2,
                   label=f"auto: {chosen['plan']}")
    legend_points(ax, front, x, y, lambda r: r["plan"] + _times(r))
    ax.set(xlabel=f"FLOPs{unit}", ylabel=f"step memory{unit or ' (MiB)'}",
           title="checkpoint plans: memory vs recompute" + ("" if unit else " (vanilla does not fit the device)"))
    ax.grid(alpha=0.3)
    fig.savefig(path, dpi=150, bbox_inches="tight")
    plt.close(fig)
