"""Plug a ``CheckpointPlan`` into a built Ultralytics model, and take it out again.

This is the one place that touches the entry points of Ultralytics' layer loop (every place of ours that touches
Ultralytics' private code is listed in ``yolo_ckpt/versions.py``). ``BaseModel._predict_once``
(``ultralytics/nn/tasks.py``) is the layer loop every YOLO task model runs; ``RTDETRDetectionModel.predict`` is
RT-DETR's (its head also takes the training targets). ``enable_checkpointing`` shadows that method on the *instance*
— the way Ultralytics' own ``fuse()`` swaps ``forward`` on layer instances — with the same loop in which each
region's layers run inside one checkpoint. Nothing is wrapped, so state_dict keys, ``m.type``/``m.f``/``m.i`` and
``isinstance`` checks are unchanged; ``disable_checkpointing`` deletes the instance attribute and the model is plain
again, safe to pickle where yolo_ckpt is not installed. Models that run another loop of their own (YOLO-World,
YOLOE) are rejected with ``UnsupportedModelError``, never trained silently without checkpointing.

The checkpointed loop is used only while the model trains with grad enabled; eval, ``torch.no_grad`` (validation,
EMA, predict, export, fuse), profiling and embedding requests run Ultralytics' own loop.

Regions inside layers (``Region.parts``) shadow ``forward`` the same way, on the instances of the parts (or of the
Sequential or layer that runs them), see "regions inside layers" below; ``disable_checkpointing`` removes those too.

Examples:
    >>> from ultralytics.nn.tasks import DetectionModel
    >>> from yolo_ckpt.regions.plan import CheckpointPlan
    >>> model = DetectionModel("yolo11n.yaml", verbose=False)
    >>> enable_checkpointing(model, CheckpointPlan.from_spec(model, [2, 3]), mode="selective")
    >>> checkpoint_plan(model).stages, checkpoint_mode(model)
    ([2, 3], 'selective')
    >>> disable_checkpointing(model)
    >>> checkpoint_plan(model) is None
    True
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch import nn
from ultralytics.utils.torch_utils import unwrap_model

from .graph import layer_inputs, student
from .plan import CheckpointPlan, Region
from .recompute import MODES, checkpoint_region, enclosing_hooks, stored_as_around
from .spec import CheckpointConfigError

SUPPORTED_MODELS = ("Valid: the detect, segment, pose, obb and classify models of YOLOv3-v10, YOLO11, YOLO12 and "
                    "YOLO26, and RT-DETR (rtdetr-*.yaml).")
ENTRY_POINTS = ("_predict_once", "predict")  # the instance attributes a plan may shadow


class UnsupportedModelError(CheckpointConfigError):
    """A model whose training forward yolo-ckpt cannot checkpoint; the message is one line naming what is valid."""


@dataclass(frozen=True)
class _Wiring:
    """How a region connects to the layers around it.

    Attributes:
        region (Region): The region.
        outside (tuple[int, ...]): Earlier layers, outside the region, whose outputs layers after its first read.
        wanted (tuple[bool, ...]): Per region layer but the last: is its output read after the region?
        inner (frozenset[int]): Region layers whose outputs later region layers read by index (kept while it runs).
    """

    region: Region
    outside: tuple[int, ...]
    wanted: tuple[bool, ...]
    inner: frozenset[int]

    @classmethod
    def of(cls, layers: nn.Sequential, region: Region) -> _Wiring:
        first, last = region.layers[0], region.layers[-1]
        reads = {m.i: layer_inputs(m) for m in layers}
        outside = sorted({j for i in region.layers[1:] for j in reads[i] if j < first})
        later = {j for i in range(last + 1, len(layers)) for j in reads[i]}
        inner = frozenset(j for i in region.layers[1:] for j in reads[i] if first <= j < i - 1 or
                          (j == i - 1 and layers[i].f != -1))
        return cls(region, tuple(outside), tuple(i in later for i in region.layers[:-1]), inner)


def _call(m: nn.Module, x: Any) -> Any:
    """Run one layer as Ultralytics' ``BaseModel._predict_once`` does."""
    return m(x)


def _call_with_targets(head: nn.Module, batch: dict | None, m: nn.Module, x: Any) -> Any:
    """Run one layer as ``RTDETRDetectionModel.predict`` does: its decoder head also takes the training targets, from
    which it draws the random denoising queries (replayed exactly in a recompute: checkpoint restores the RNG state)."""
    return m(x, batch) if m is head else m(x)


def _run_region(layers: list[nn.Module], wiring: _Wiring, call: Callable[[nn.Module, Any], Any], x: Any,
                *outside: torch.Tensor) -> tuple[Any, ...]:
    """Run a region's layers as Ultralytics' loop would; return the outputs read after it, then the last output."""
    y = dict(zip(wiring.outside, outside))
    kept = []
    for n, m in enumerate(layers):
        if n and m.f != -1:  # Ultralytics indexes its output list, where -2 is two layers back
            at = lambda j, i=m.i: y[i + j if j < 0 else j]  # noqa: E731
            x = at(m.f) if isinstance(m.f, int) else [x if j == -1 else at(j) for j in m.f]
        x = call(m, x)
        if m.i in wiring.inner:
            y[m.i] = x
        if n < len(wiring.wanted) and wiring.wanted[n]:
            kept.append(x)
    return (*kept, x)


def _run_layers(model: nn.Module, mode: str, wiring: dict[int, _Wiring], x: Any,
                call: Callable[[nn.Module, Any], Any] = _call) -> Any:
    """Ultralytics' layer loop with each plan region run inside one checkpoint; ``call`` runs a layer."""
    y, i, layers = [], 0, model.model
    while i < len(layers):
        m = layers[i]
        if m.f != -1:  # as Ultralytics: input from earlier layers
            x = y[m.f] if isinstance(m.f, int) else [x if j == -1 else y[j] for j in m.f]
        w: _Wiring | None = wiring.get(i)
        if w is None:
            x = call(m, x)
            y.append(x if m.i in model.save else None)
            i += 1
            continue
        members = [layers[j] for j in w.region.layers]
        outs = checkpoint_region(partial(_run_region, members, w, call), x, *(y[j] for j in w.outside),
                                 modules=members, mode=w.region.mode or mode)
        n = 0  # indexing, not iter()/next(): the loop stays traceable by torch.compile (one graph, no breaks)
        for k in w.wanted:
            y.append(outs[n] if k else None)
            n += k
        x = outs[-1]
        y.append(x if w.region.layers[-1] in model.save else None)
        i = w.region.layers[-1] + 1
    return x


def _training(model: nn.Module) -> bool:
    return model.training and torch.is_grad_enabled()


# The loops take ``plan`` without reading it: bound after the model in their ``partial`` (``enable_checkpointing``), it
# is the record of the installed plan that ``checkpoint_plan`` reads back (``args[1]``), as ``checkpoint_mode`` reads
# ``mode`` (``args[2]``).
def _predict_once(model: nn.Module, plan: CheckpointPlan, mode: str, wiring: dict[int, _Wiring], x, profile=False,
                  embed=None):
    """``BaseModel._predict_once`` with each plan region recomputed in backward (same signature, same result)."""
    if profile or embed or not _training(model):
        return type(model)._predict_once(model, x, profile, embed)
    return _run_layers(model, mode, wiring, x)


def _predict_rtdetr(model: nn.Module, plan: CheckpointPlan, mode: str, wiring: dict[int, _Wiring], x, profile=False,
                    batch=None, augment=False, embed=None):
    """``RTDETRDetectionModel.predict`` (Ultralytics' loop over all layers but the head, then
    ``head([y[j] for j in head.f], batch)``) with each plan region recomputed in backward."""
    if profile or embed or not _training(model):
        return type(model).predict(model, x, profile, batch, augment, embed)
    return _run_layers(model, mode, wiring, x, call=partial(_call_with_targets, model.model[-1], batch))


def _entry_point(model: nn.Module) -> tuple[str, Callable[..., Any]]:
    """Which method of ``model`` runs its layer loop in training, and our checkpointed version of it.

    ``BaseModel.predict`` calls ``_predict_once``; RT-DETR overrides ``predict`` itself (the head takes the targets).
    YOLO-World and YOLOE override ``predict`` with text/visual prompt embeddings threaded through their layers; their
    loops are not reproduced here, so they are rejected rather than silently trained without checkpointing.
    """
    from ultralytics.nn.tasks import BaseModel, RTDETRDetectionModel

    if isinstance(model, RTDETRDetectionModel) and type(model).predict is RTDETRDetectionModel.predict:
        return "predict", _predict_rtdetr
    if type(model).predict is not BaseModel.predict:
        raise UnsupportedModelError(f"{type(model).__name__} runs its own forward loop ({type(model).__qualname__}"
                                    f".predict), which yolo-ckpt cannot checkpoint. {SUPPORTED_MODELS}")
    return "_predict_once", _predict_once


# ------------------------------------------------------------------------------------------- regions inside layers
# A part (``Region.parts``) is recomputed by shadowing ``forward`` on the part's instance, as for the layer loop:
# nothing is wrapped, so state_dict keys and ``isinstance`` stay, and ``disable_checkpointing`` removes every shadow.
# Each shadow keeps the instance's own ``forward`` it replaced (``prior``: Ultralytics' ``fuse()`` sets one) and runs
# the class's ``forward`` otherwise; outside training with grad it only calls it.


def _inner(module: nn.Module, prior: Callable[..., Any] | None) -> Callable[..., Any]:
    return prior if prior is not None else type(module).forward.__get__(module)


def _part_forward(module: nn.Module, prior: Callable[..., Any] | None, mode: str, *args: Any, **kwargs: Any) -> Any:
    """One part recomputed in backward (a nested checkpoint when its layer's region is recomputed too)."""
    forward = _inner(module, prior)
    if kwargs:
        forward = partial(forward, **kwargs)
    if not _training(module):
        return forward(*args)
    return checkpoint_region(forward, *args, modules=[module], mode=mode)


def _chain(children: list[nn.Module], x: Any) -> Any:
    for m in children:
        x = m(x)
    return x


def _chain_forward(seq: nn.Sequential, prior: Callable[..., Any] | None, runs: tuple[tuple[int, int, str], ...],
                   x: Any) -> Any:
    """``nn.Sequential.forward`` (each child on the previous output) with runs of children ``(first, last, mode)``
    each recomputed as one region."""
    if not _training(seq):
        return _inner(seq, prior)(x)
    children, i = list(seq), 0  # Sequential.forward's chain (a fused forward of the instance is never trained)
    starts = {first: (last, mode) for first, last, mode in runs}
    while i < len(children):
        if i in starts:
            last, mode = starts[i]
            run = children[i:last + 1]
            x = checkpoint_region(partial(_chain, run), x, modules=run, mode=mode)
            i = last + 1
        else:
            x = children[i](x)
            i += 1
    return x


def _own_run_forward(layer: nn.Module, prior: Callable[..., Any] | None, state: dict, *args: Any) -> Any:
    """A layer whose forward calls a run of its parts recomputed as one region: the whole forward is checkpointed, the
    parts outside the run store for backward as without checkpointing (``_outside_forward``) and, in the recompute
    (which stops after the run's last stored tensor: torch's early stop), give back what they gave in the forward."""
    forward = _inner(layer, prior)
    if not _training(layer):
        return forward(*args)
    outputs: list[Any] = []
    calls = 0  # the first call is the forward, any later one the recompute
    around = enclosing_hooks()  # how the parts outside the run store: as this layer would without the run

    def replay(*a: Any) -> Any:
        nonlocal calls
        state.update(outputs=outputs, at=0, replay=calls > 0, around=around)
        calls += 1
        try:
            return forward(*a)
        finally:
            state.update(outputs=None)

    return checkpoint_region(replay, *args, modules=[layer], mode="full")


def _outside_forward(module: nn.Module, prior: Callable[..., Any] | None, state: dict, *args: Any) -> Any:
    """A part outside its layer's run (``_own_run_forward``): stored in the forward as without the run (also by an
    enclosing region), and given back from the forward in the run's recompute."""
    forward = _inner(module, prior)
    if state.get("outputs") is None:  # the layer is not recomputing a run now (eval, no grad)
        return forward(*args)
    if state["replay"]:
        state["at"] += 1
        return state["outputs"][state["at"] - 1]
    with stored_as_around(state["around"]):
        out = forward(*args)
    state["outputs"].append(out)
    return out


SHADOWS = (_part_forward, _chain_forward, _own_run_forward, _outside_forward)


def _shadow(module: nn.Module, fn: Callable[..., Any], *args: Any) -> None:
    module.forward = partial(fn, module, module.__dict__.get("forward"), *args)


def network(model: nn.Module) -> nn.Module:
    """The Ultralytics task model a plan goes on, inside what wraps it in training: ``torch.compile`` and DDP
    (Ultralytics' ``unwrap_model``), and knowledge distillation's student (``distill_model=``: Ultralytics wraps the
    student in a ``DistillationModel`` whose ``student_model`` it trains, 8.4.190; the teacher runs without
    gradients, so a plan on it would keep nothing less)."""
    return student(unwrap_model(model))


def check_plan(plan: CheckpointPlan, mode: str, compile: Any = False) -> None:
    """Raise the one-line error for a run of a layer's own parts (``Region.siblings``) that cannot run as asked: it is
    recomputed ``full`` only (its recompute serves the other parts from the forward, which a selective cache, matched
    op by op, cannot skip) and eagerly only (``torch.compile`` breaks its graph at the saved-tensor hooks)."""
    runs = [r for r in plan.part_regions if r.siblings]
    if bad := next((r for r in runs if (r.mode or mode) != "full"), None):
        raise CheckpointConfigError(f"checkpoint_layers: {bad.name} is a run of parts of layer {bad.layers[0]}'s own "
                                    f"forward, recomputed full only. Valid: give it ':full', or selective single parts "
                                    f"and runs inside Sequential parts.")
    if runs and compile:
        raise CheckpointConfigError(f"checkpoint_layers: {runs[0].name} is a run of parts of layer "
                                    f"{runs[0].layers[0]}'s own forward, which compile={compile!r} cannot trace in one "
                                    f"graph. Valid with compile: single parts, runs inside Sequential parts, layers.")


def _install_parts(model: nn.Module, plan: CheckpointPlan, mode: str) -> None:
    """Shadow the forwards that recompute the plan's regions inside layers, innermost first, so that each shadow runs
    the one below it: a Sequential's runs, then single parts (a part whose children run as regions checkpoints that
    chain), then the runs of a layer's own parts (the parts outside such a run store as the shadows below them say)."""
    chains: dict[int, tuple[nn.Sequential, list]] = {}
    singles, own = [], []
    for r in plan.part_regions:
        layer, how = model.model[r.layers[0]], r.mode or mode
        if r.siblings:
            own.append((layer, r))
        elif len(r.parts) == 1:
            singles.append((layer.get_submodule(r.parts[0]), how))
        else:  # children of a Sequential (the layer or one of its parts)
            parent = r.parts[0].rpartition(".")[0]
            seq = layer.get_submodule(parent) if parent else layer
            index = [n.rpartition(".")[2] for n in r.parts]
            chains.setdefault(id(seq), (seq, []))[1].append((int(index[0]), int(index[-1]), how))
    for seq, runs in chains.values():
        _shadow(seq, _chain_forward, tuple(runs))
    for part, how in singles:
        _shadow(part, _part_forward, how)
    for layer, r in own:
        state: dict = {}
        for name in r.siblings:
            if name not in r.parts:
                _shadow(layer.get_submodule(name), _outside_forward, state)
        _shadow(layer, _own_run_forward, state)


def enable_checkpointing(model: nn.Module, plan: CheckpointPlan, mode: str = "full") -> None:
    """Make ``model`` recompute the plan's regions during backward; an empty plan leaves it plain.

    Args:
        model: An Ultralytics ``BaseModel`` (detect, segment, pose, obb or classify).
        plan: Regions of consecutive layers; layers after a region's first may also read earlier layers' outputs.
        mode: How each region is recomputed, one of ``yolo_ckpt.regions.recompute.MODES``.
    """
    if mode not in MODES:
        raise ValueError(f"checkpoint mode {mode!r} is not one of {MODES}")
    disable_checkpointing(model)
    if plan.regions:
        check_plan(plan, mode)
        name, loop = _entry_point(model)
        wiring = {r.layers[0]: _Wiring.of(model.model, r) for r in plan.regions if not r.parts}
        setattr(model, name, partial(loop, model, plan, mode, wiring))
        _install_parts(model, plan, mode)


def disable_checkpointing(model: nn.Module) -> None:
    """Restore Ultralytics' own forward loop and every module's own ``forward`` on ``model`` (no-op on a plain
    model)."""
    for name in ENTRY_POINTS:
        model.__dict__.pop(name, None)
    for m in model.modules():
        while isinstance(fn := m.__dict__.get("forward"), partial) and fn.func in SHADOWS:
            if fn.args[1] is None:
                del m.forward
            else:
                m.forward = fn.args[1]


def checkpoint_plan(model: nn.Module) -> CheckpointPlan | None:
    """The plan installed on ``model``, or ``None`` when it runs plainly."""
    fn = _installed(model)
    return fn.args[1] if fn else None


def checkpoint_mode(model: nn.Module) -> str | None:
    """How the installed plan's regions are recomputed (``"full"``/``"selective"``), or ``None`` when plain."""
    fn = _installed(model)
    return fn.args[2] if fn else None


def _installed(model: nn.Module) -> partial | None:
    """The checkpointed loop shadowing one of ``ENTRY_POINTS`` on ``model``, if any."""
    fns = (model.__dict__.get(name) for name in ENTRY_POINTS)
    return next((fn for fn in fns if isinstance(fn, partial)), None)
