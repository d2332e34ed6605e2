"""Report what checkpointing buys: per-stage saved bytes and recompute FLOPs, per-plan peak memory and step time.

Every figure is measured on a real training step — ``model.loss(batch)`` forward and backward, the step the trainer
runs — with exact tensor accounting (``LiveTensorTracker``), FLOPs counted as ``FlopCounterMode`` counts them
(convolutions and matmuls, recompute included) and wall-clock time, checkpointed and vanilla side by side in one
process. On a GPU or a simulated one (``simulate_gpu=``) every step runs within what the device has free
(``yolo_ckpt.report.fitting``): a plan whose step does not fit is reported so (``fits`` false, no figures), and
when vanilla does not fit, nothing is given as a ratio to it.

Examples:
    >>> from yolo_ckpt.memory.step import StepShape, build_model
    >>> model = build_model("yolo11n.yaml")
    >>> plans = {"none": PlanSettings(), "all": PlanSettings.of("all")}
    >>> rows = compare_plans(model, StepShape(320, 2), plans=plans, repeats=1)
    >>> rows[1]["peak_ratio"] < 0.7
    True
"""

from __future__ import annotations

import csv
import json
import statistics
from contextlib import nullcontext
from pathlib import Path

import torch
from torch import nn

from ..memory.step import StepShape, measure_peak, planned_copy, step_loss, training_batch
from ..planning import costs
from ..regions.graph import model_stages
from ..regions.recompute import Mode
from ..regions.settings import PlanSettings
from .fitting import fitting_step, mib, plan_step, ratio, time_rounds
from .plots import axes, legend_points
from .progress import Track, tracked


def compare_plans(model: nn.Module, shape: StepShape, plans: dict[str, PlanSettings], repeats: int | None = None,
                  track: Track | None = None) -> list[dict]:
    """Measure each plan's training step of ``shape``, one copy at a time; ratios are to the first plan (vanilla).

    Each plan's loss plan is its own where it has one, else the one ``model`` has.

    Memory and FLOPs are exact per plan, each step within what the device has free (``fitting.fitting_step``); step
    times are medians of ``repeats`` interleaved rounds (``fitting.time_rounds``; ``None``: as many as planning times,
    ``costs.TIMED_STEPS``), and ``time_spread`` is half the range of a plan's time over vanilla's in the same round:
    a ``time_ratio`` closer to 1 than that is timing noise. ``shape.amp`` is the forward's autocast dtype (``None``:
    full precision). ``track``: a ``progress.Progress`` the steps are counted on.

    Returns:
        (list[dict]): One row per plan: name, stages, ``fits``, peak/FLOP/time figures and ratios to the first plan.
        A plan whose step does not fit the device has ``fits`` false and no figures; when the first plan does not
        fit, no row has ratios.
    """
    repeats = costs.TIMED_STEPS if repeats is None else repeats
    items = tracked(track, plans.items(), f"memory of {len(plans)} plans")
    fits = {name: plan_step(model, plan, shape) for name, plan in items}
    measured = [name for name, fit in fits.items() if fit is not None]
    rounds = dict(zip(measured, time_rounds(model, [plans[n] for n in measured], shape, repeats, track)))
    seconds = {name: statistics.median(ts) for name, ts in rounds.items() if ts}
    first = next(iter(fits))
    base, base_s = fits[first], seconds.get(first)
    rows = []
    for name, fit in fits.items():
        peak, flops, cuda = (fit.peak_bytes, fit.flops, fit.cuda_peak_bytes) if fit else (None, None, None)
        rows.append({
            "plan": name,
            "stages": PlanSettings.of(plans[name].stages).resolve(model).stages,
            "layers": PlanSettings.of(layers=plans[name].layers).resolve(model).layer_spec(),
            "mode": plans[name].mode.value,
            "keys": str(plans[name]),  # what to pass to yolo-ckpt train for this plan
            "fits": fit is not None,
            "peak_MiB": mib(peak),
            "GFLOPs": None if flops is None else round(flops / 1e9, 2),
            "step_s": None if name not in seconds else round(seconds[name], 4),
            "peak_ratio": ratio(peak, base and base.peak_bytes),
            "flops_ratio": ratio(flops, base and base.flops),
            "time_ratio": ratio(seconds.get(name), base_s),
            "time_spread": None if name == first else _spread(rounds.get(name), rounds.get(first)),
            **({"cuda_peak_MiB": mib(cuda), "cuda_peak_ratio": ratio(cuda, base and base.cuda_peak_bytes)}
               if cuda else {}),
        })
    return rows


def time_x(row: dict) -> str:
    """A plan's step time over vanilla's as a person should read it: ``1.20 ±0.03``, or ``~1 ±0.05`` where the
    measured noise covers the difference from vanilla's (or the plan measured faster: recomputing adds work, so a
    ratio below 1 is the machine's noise, not the plan's gain)."""
    t, spread = row.get("time_ratio"), row.get("time_spread")
    if t is None:
        return "-"
    if spread is None:
        return f"{t:.2f}"
    return f"{'~1' if within_noise(row) else format(t, '.2f')} ±{spread:.2f}"


def within_noise(row: dict) -> bool:
    """Whether a plan's step time is vanilla's as far as its rounds can tell (``time_x``)."""
    t, spread = row.get("time_ratio"), row.get("time_spread") or 0.0
    return t is not None and (t < 1 or abs(t - 1) <= spread)


def _spread(times: list[float] | None, base: list[float] | None) -> float | None:
    """Half the range of ``times`` over ``base``, round by round (the same round's steps met the same machine)."""
    if not times or not base or len(times) < 2:
        return None
    ratios = [t / b for t, b in zip(times, base) if b]
    return round((max(ratios) - min(ratios)) / 2, 3) if len(ratios) >= 2 else None


def _saved_per_stage(model: nn.Module, data: dict, stages: dict[int, tuple[int, ...]],
                     amp: torch.dtype | None = None) -> dict[int, int]:
    """Bytes each stage saves for backward in a plain step under autocast of ``amp`` (as the run's forward), from
    ``saved_tensors_hooks``, one count per storage."""
    saved: dict[int, dict[int, torch.UntypedStorage]] = {k: {} for k in stages}
    hooks, contexts = [], {}

    def enter(k):
        def pack(t):  # autograd keeps nothing (no backward follows: see graph.head_layers on what keeping t would
            # leak); the storage is held here until the count, so that a freed one's address is never counted again
            st = t.untyped_storage()
            saved[k][st._cdata] = st

        contexts[k] = torch.autograd.graph.saved_tensors_hooks(pack, lambda _: None)
        contexts[k].__enter__()

    for k, layers in stages.items():
        hooks.append(model.model[layers[0]].register_forward_pre_hook(lambda m, i, k=k: enter(k)))
        leave = lambda m, i, o, k=k: contexts[k].__exit__(None, None, None)  # noqa: E731
        hooks.append(model.model[layers[-1]].register_forward_hook(leave))
    try:
        step_loss(model, data, amp)
    finally:
        for h in hooks:
            h.remove()
    return {k: sum(st.nbytes() for st in v.values()) for k, v in saved.items()}


def _stage_step(model: nn.Module, shape: StepShape, stage: int | None = None,
                end: int | None = None) -> tuple[int, int, list | None] | None:
    """``(FLOPs, bytes kept after forward, output shape of layer end)`` of a step of ``model`` (of a copy with only
    ``stage`` checkpointed, gone when it returns: see ``fitting.plan_step``), or ``None`` when it does not fit the
    device: a bounded step (``fitting_step``) first, then the step again on a batch of the same size — in the memory
    the first had, so it fits — for what it keeps after forward."""
    with planned_copy(model, PlanSettings.of([stage])) if stage is not None else nullcontext(model) as m:
        fit = fitting_step(m, shape)
        if fit is None:
            return None
        shapes: list[list[int]] = []
        hook = None if end is None else m.model[end].register_forward_hook(lambda _, i, o: shapes.append(list(o.shape)))
        try:
            kept = measure_peak(m, training_batch(m, shape), shape.amp).saved
        finally:
            if hook is not None:
                hook.remove()
        return fit.flops, kept, shapes[0] if shapes else None


def profile_stages(model: nn.Module, shape: StepShape, track: Track | None = None) -> list[dict]:
    """Per backbone stage, in a training step of ``shape``: layers, output shape, bytes kept for backward with and
    without checkpointing, FLOPs.

    Without checkpointing, a stage keeps what its ops save for backward (``saved_tensors_hooks``). Checkpointed, it
    keeps that minus what checkpointing frees, the drop in exact live tensor bytes after forward when this stage alone
    is checkpointed. Recompute FLOPs are the extra FLOPs of that step.

    Every step runs within what the device has free (``fitting.fitting_step``). The figures compare two steps,
    vanilla's and the stage's: where either does not fit the device, ``fits`` is false and they are ``None``.
    ``track``: a ``progress.Progress`` the steps are counted on.
    """
    stages = model_stages(model)
    base = _stage_step(model, shape)
    # A forward that keeps what vanilla's keeps, and no backward: it fits wherever vanilla's whole step fit.
    saved = _saved_per_stage(model, training_batch(model, shape), stages, shape.amp) if base else {}
    model.zero_grad(set_to_none=True)
    rows = []
    for k in tracked(track, sorted(stages), f"each of {len(stages)} stages"):
        step = _stage_step(model, shape, k, stages[k][-1])
        both = base is not None and step is not None
        rows.append({
            "stage": k,
            "layers": list(stages[k]),
            "modules": [type(model.model[i]).__name__ for i in stages[k]],
            "output_shape": step[2] if step else None,
            "fits": both,
            "saved_MiB_vanilla": mib(saved.get(k), 2),
            "saved_MiB_checkpointed": mib(saved[k] - (base[1] - step[1]), 2) if both else None,
            "recompute_GFLOPs": round((step[0] - base[0]) / 1e9, 3) if both else None,
        })
    return rows


def standard_plans(model: nn.Module) -> dict[str, PlanSettings]:
    """The plans the profiler compares: none, each single stage, [2,3] and all, all recomputed selectively, and the
    whole network (all stages and ``checkpoint_layers=head``), full and selective."""
    stages = sorted(model_stages(model))
    plans = {"none": PlanSettings(), **{f"[{k}]": PlanSettings.of([k]) for k in stages}}
    if {2, 3} <= set(stages):
        plans["[2,3]"] = PlanSettings.of([2, 3])
    plans["all"] = PlanSettings.of("all")
    plans["all selective"] = PlanSettings.of("all", Mode.SELECTIVE)
    plans["all + head"] = PlanSettings.of("all", Mode.FULL, "head")
    plans["all + head selective"] = PlanSettings.of("all", Mode.SELECTIVE, "head")
    return plans


def write_profile(save_dir: Path, stages: list[dict], plans: list[dict], extra: dict | None = None) -> list[Path]:
    """Write profile.json, plans.csv, stages.csv and a PNG of memory versus time; with ``extra``
    (``yolo_ckpt.report.tradeoff.tradeoffs``) also candidates.csv, untouchable.csv and pareto.png; return the paths."""
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
    x, y, unit = axes(plans, ("time_ratio", "peak_ratio", " / vanilla"), ("step_s", "peak_MiB", ""))
    shown = [r for r in plans if r[x] is not None and r[y] is not None]
    legend_points(ax, shown, x, y, lambda r: r["plan"])
    if x == "time_ratio" and (noisy := [r for r in shown if r.get("time_spread")]):  # the timing noise, as measured
        ax.errorbar([r[x] for r in noisy], [r[y] for r in noisy], xerr=[r["time_spread"] for r in noisy], fmt="none",
                    ecolor="grey", elinewidth=0.8, capsize=2, zorder=2)
        ax.axvline(1.0, color="grey", linestyle=":", linewidth=0.8)
    spread = ", ± half the rounds' spread" if x == "time_ratio" else ""
    ax.set(xlabel=f"step time{unit or ' (s)'}{spread}", ylabel=f"peak live tensor bytes{unit or ' (MiB)'}",
           title="checkpointing trade-off" + ("" if unit else " (vanilla does not fit the device)"))
    ax.grid(alpha=0.3)
    fig.savefig(paths[3], dpi=150, bbox_inches="tight")
    plt.close(fig)
    if extra:
        from .tradeoff import plot_front

        paths += [save_dir / "candidates.csv", save_dir / "untouchable.csv", save_dir / "pareto.png"]
        plot_front(extra["candidates"], paths[-1], extra.get("chosen"))
    return paths
