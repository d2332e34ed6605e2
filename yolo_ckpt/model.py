"""Plug a ``CheckpointPlan`` into a built Ultralytics model, and take it out again.

This is the one place that touches Ultralytics internals. ``BaseModel._predict_once`` (ultralytics 8.4.190,
``ultralytics/nn/tasks.py``) is the layer loop every YOLO task model runs. ``enable_checkpointing`` shadows it on the
*instance* — the way Ultralytics' own ``fuse()`` swaps ``forward`` on layer instances — with the same loop in which
each region's layers run inside one checkpoint. Nothing is wrapped, so state_dict keys, ``m.type``/``m.f``/``m.i``
and ``isinstance`` checks are unchanged; ``disable_checkpointing`` deletes the instance attribute and the model is
plain again, safe to pickle where yolo_ckpt is not installed.

The checkpointed loop is used only while the model trains with grad enabled; eval, ``torch.no_grad`` (validation,
EMA, predict, export, fuse), profiling and embedding requests run Ultralytics' own loop.

Example:
    >>> from ultralytics.nn.tasks import DetectionModel
    >>> from yolo_ckpt.stages import CheckpointPlan
    >>> model = DetectionModel("yolo11n.yaml", verbose=False)
    >>> enable_checkpointing(model, CheckpointPlan.from_spec(model, [2, 3]), mode="selective")
    >>> checkpoint_plan(model).stages, checkpoint_mode(model)
    ([2, 3], 'selective')
    >>> disable_checkpointing(model)
    >>> checkpoint_plan(model) is None
    True
"""

from __future__ import annotations

from functools import partial

import torch
from torch import nn

from .recompute import MODES, checkpoint_region
from .stages import CheckpointPlan, Region


def _run_layers(layers: list[nn.Module], keep: tuple[bool, ...], x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Run consecutive layers; return the outputs of those but the last flagged in ``keep``, then the last output."""
    kept = []
    for m, k in zip(layers, (*keep, False)):
        x = m(x)
        if k:
            kept.append(x)
    return (*kept, x)


def _predict_once(model: nn.Module, plan: CheckpointPlan, mode: str, x, profile=False, embed=None):
    """``BaseModel._predict_once`` with each plan region recomputed in backward (same signature, same result)."""
    if profile or embed or not (model.training and torch.is_grad_enabled()):
        return type(model)._predict_once(model, x, profile, embed)
    starts = {r.layers[0]: r for r in plan.regions}
    y, i, layers = [], 0, model.model
    while i < len(layers):
        m = layers[i]
        if m.f != -1:  # as Ultralytics: input from earlier layers
            x = y[m.f] if isinstance(m.f, int) else [x if j == -1 else y[j] for j in m.f]
        region: Region | None = starts.get(i)
        if region is None:
            x = m(x)
            y.append(x if m.i in model.save else None)
            i += 1
            continue
        members = [layers[j] for j in region.layers]
        keep = tuple(j in model.save for j in region.layers[:-1])
        outs = checkpoint_region(partial(_run_layers, members, keep), x, modules=members, mode=mode)
        n = 0  # indexing, not iter()/next(): the loop stays traceable by torch.compile (one graph, no breaks)
        for k in keep:
            y.append(outs[n] if k else None)
            n += k
        x = outs[-1]
        y.append(x if region.layers[-1] in model.save else None)
        i = region.layers[-1] + 1
    return x


def enable_checkpointing(model: nn.Module, plan: CheckpointPlan, mode: str = "full") -> None:
    """Make ``model`` recompute the plan's regions during backward; an empty plan leaves it plain.

    Args:
        model: An Ultralytics ``BaseModel`` (detect, segment, pose, obb or classify).
        plan: Regions of consecutive layers, each reading only the previous layer after its first.
        mode: How each region is recomputed, one of ``yolo_ckpt.recompute.MODES``.
    """
    if mode not in MODES:
        raise ValueError(f"checkpoint mode {mode!r} is not one of {MODES}")
    disable_checkpointing(model)
    if plan.regions:
        model._predict_once = partial(_predict_once, model, plan, mode)


def disable_checkpointing(model: nn.Module) -> None:
    """Restore Ultralytics' own forward loop on ``model`` (no-op on a plain model)."""
    model.__dict__.pop("_predict_once", None)


def checkpoint_plan(model: nn.Module) -> CheckpointPlan | None:
    """The plan installed on ``model``, or ``None`` when it runs plainly."""
    fn = model.__dict__.get("_predict_once")
    return fn.args[1] if isinstance(fn, partial) else None


def checkpoint_mode(model: nn.Module) -> str | None:
    """How the installed plan's regions are recomputed (``"full"``/``"selective"``), or ``None`` when plain."""
    fn = model.__dict__.get("_predict_once")
    return fn.args[2] if isinstance(fn, partial) else None
