"""The model's layer graph, read from the built model: backbone stages, the layers the head stores, block layers' parts.

Stage ``k`` is the run of backbone layers whose output stride is ``2**k`` — the ``Pk/2^k`` comments of Ultralytics'
model YAMLs. Strides come from a dry run of the backbone, never from an index table, so every scale of yolov8, yolo11
and yolo26 (P5 and P6) and every task head resolves the same way.

Examples:
    >>> from ultralytics.nn.tasks import DetectionModel
    >>> model = DetectionModel("yolo11n.yaml", verbose=False)
    >>> model_stages(model)
    {1: (0,), 2: (1, 2), 3: (3, 4), 4: (5, 6), 5: (7, 8, 9, 10)}
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from copy import deepcopy
from pathlib import Path
from typing import Any, TypeVar

import torch
from torch import nn

from .spec import CheckpointConfigError

DRY_RUN_SIZE = 256  # input side for the stride dry run; a multiple of every stride up to P8
NO_STAGES_HINT = ("Valid for this model: checkpoint_layers=[first, last] ranges of layer indices (checkpoint_stages "
                  "and checkpoint_layers=head need stages).")
T = TypeVar("T")
STRIDE_TOLERANCE = 0.25  # in log2: a layer's output side may be off a power-of-two stride by a padding pixel


def _outputs_needing_grad(layers: nn.Sequential) -> list[bool]:
    """Per layer: does its output require grad in training (a trainable parameter in it or in anything feeding it)?"""
    needs: list[bool] = []
    for i, m in enumerate(layers):
        sources = [m.f] if isinstance(m.f, int) else m.f
        inputs = [i + j if j < 0 else j for j in sources]  # -1: the previous layer (the image for layer 0)
        trainable = any(p.requires_grad for p in m.parameters())
        needs.append(trainable or any(needs[j] for j in inputs if j >= 0))
    return needs


def _model_name(model: Any) -> str:
    if isinstance(model, (str, Path)):
        return Path(model).name
    yaml = getattr(model, "yaml", None) or (model if isinstance(model, dict) else {})
    return Path(str(yaml.get("yaml_file") or type(model).__name__)).name


def model_stages(model: Any) -> dict[int, tuple[int, ...]]:
    """Stages of a model given as a built model, a model YAML path/name or a YAML dict.

    A YAML (or a ``.pt`` file's embedded YAML) is built layer by layer with Ultralytics' own ``parse_model``; only its
    backbone is run, on a zero image.

    Raises:
        CheckpointConfigError: When the model has no recognisable backbone stages.
    """
    return _analyse(model)[0]


def student(model: Any) -> Any:
    """The model that trains inside knowledge distillation's wrapper (``distill_model=``: Ultralytics wraps the student
    in a ``DistillationModel`` whose ``student_model`` it trains, 8.4.190), else ``model`` itself."""
    inner = getattr(model, "student_model", None)
    return inner if isinstance(inner, nn.Module) else model


def _built(model: Any) -> tuple[nn.Sequential, list[int], dict | None, str]:
    """Layers, ``save`` list, YAML dict and name of a built model, a ``.pt`` file, a YAML path/name or dict."""
    if isinstance(model, (str, Path)) and Path(model).suffix == ".pt":
        from ultralytics.nn.tasks import load_checkpoint

        model = load_checkpoint(model)[0]
    model = student(model)  # distillation's last.pt holds Ultralytics' DistillationModel
    if isinstance(model, (str, Path, dict)):
        from ultralytics.nn.tasks import parse_model, yaml_model_load

        cfg = yaml_model_load(model) if not isinstance(model, dict) else model
        layers, save = parse_model(deepcopy(cfg), ch=cfg.get("channels", 3), verbose=False)
        return layers, save, cfg, _model_name(cfg)
    return model.model, model.save, getattr(model, "yaml", None), _model_name(model)


def _analyse(model: Any) -> tuple[dict[int, tuple[int, ...]], set[int], set[int]]:
    """Stages; the layers whose outputs later layers read by index (Ultralytics' ``model.save``); and the layers
    that read only the previous layer, so a region may run through them without a second input."""
    layers, save, cfg, name = _built(model)
    chained = {m.i for m in layers if m.f == -1}
    return _by_architecture("stages", layers, cfg, lambda: backbone_stages(layers, cfg, name=name)), set(save), chained


def _joined(stages: dict[int, tuple[int, ...]], read_later: set[int], chained: set[int]) -> set[int]:
    return {k for k in stages if k - 1 in stages and stages[k - 1][-1] not in read_later and stages[k][0] in chained}


def joined_stages(model: Any) -> set[int]:
    """The stages whose region ``CheckpointPlan.from_spec`` joins to the previous stage's when both are requested:
    the tensor between them is read by nothing but this stage's first layer, which reads nothing else.

    Examples:
        >>> joined_stages("yolo11n.yaml")  # stages 2 and 3 join the one before; P3's and P4's outputs feed the neck
        {2, 3}
    """
    return _joined(*_analyse(model))


def layer_inputs(m: nn.Module) -> list[int]:
    """Indices of the layers ``m`` reads (``-1`` resolved; the image, for layer 0, is index -1)."""
    return [m.i + j if j < 0 else j for j in ([m.f] if isinstance(m.f, int) else m.f)]


_FOUND: dict[tuple, Any] = {}  # the dry runs' findings by architecture (``_by_architecture``), oldest first
FOUND_KEPT = 64  # architectures remembered at most: a planner sees one or two; a test session a few dozen


def _by_architecture(what: str, layers: nn.Sequential, cfg: dict | None, find: Callable[[], T], *args: Any) -> T:
    """``find()``, a dry run's finding about ``layers`` (stages, parts, the head's regions), run once per architecture.

    A planner resolves hundreds of plans on copies of one model (a copy per plan, or one copy with plan after plan
    installed), and each resolution repeated the dry runs: for rtdetr-l a forward at ``DRY_RUN_SIZE`` of 0.2-0.5 s
    each, a fifth of a profile. What they find depends on the architecture only, never on weights, statistics, dtype
    or device: the modules with their hyperparameters (``repr``), how the layers connect (``i``, ``f``) and the YAML
    (its ``backbone`` length). That is the key; a copy of a model, or a model built again from its YAML, finds the
    same. Each call gets its own copy of the finding, so that no caller changes what the next one reads.
    """
    key = (what, repr(layers), tuple((m.i, repr(m.f)) for m in layers), repr(cfg), *args)
    if key not in _FOUND:
        while len(_FOUND) >= FOUND_KEPT:  # the oldest forgotten
            del _FOUND[next(iter(_FOUND))]
        _FOUND[key] = find()
    return deepcopy(_FOUND[key])


def _parts_of(model: Any) -> dict[int, dict[str, tuple[str, ...]]]:
    """``model_parts(model)``, its dry run once per architecture."""
    layers, _, cfg, _ = _built(model)
    return _by_architecture("parts", layers, cfg, lambda: model_parts(model))


def model_parts(model: Any) -> dict[int, dict[str, tuple[str, ...]]]:
    """Per layer, the parts its training forward calls: for the layer (key ``""``) and for each ``nn.Sequential``
    part (key: its name), the modules it calls, in the order of their first call, named by their paths inside the
    layer.

    Found with forward hooks in one training-mode forward of the plain layers on a zero image, without grad
    (buffers and modes restored): ``C3k2`` gives ``{"": ("cv1", "m.0", "cv2")}``, ``SPPF`` ``("cv1", "m", "cv2")``
    (``m`` is called three times), ``Detect`` ``cv2.0, cv2.1, cv2.2, cv3.0, ...`` (per scale and branch) and the
    layers of each branch (``cv2.0: cv2.0.0, cv2.0.1, cv2.0.2``). A Sequential runs its modules one after another
    (torch's own ``forward``), so its parts are its children; other parts are not looked into.

    Examples:
        >>> model_parts("yolo11n.yaml")[2]
        {'': ('cv1', 'm.0', 'cv2')}
    """
    from .recompute import restored_buffers

    layers, _, cfg, _ = _built(model)
    x = _zero_image(layers, cfg)
    parts: dict[int, dict[str, dict[str, None]]] = {m.i: {} for m in layers}
    names = {m.i: {id(sub): n for n, sub in m.named_modules()} for m in layers}
    uses: dict[int, int] = {}  # a module shared by several layers (Conv's default SiLU) cannot be a part of one
    for _, sub in layers.named_modules(remove_duplicate=False):
        uses[id(sub)] = uses.get(id(sub), 0) + 1
    layer_of = {id(m): m.i for m in layers}
    stack: list[tuple[int, str]] = []  # the calls running now: (layer, part name; "" for the layer)

    def enter(sub: nn.Module, args: Any) -> None:
        if id(sub) in layer_of:
            stack.append((layer_of[id(sub)], ""))
            return
        i, caller = stack[-1]
        name = names[i].get(id(sub))
        chained = caller != "" and any(caller in c for c in parts[i].values()) and isinstance(
            layers[i].get_submodule(caller), nn.Sequential)  # a Sequential part: its children are parts too
        if name and uses[id(sub)] == 1 and (caller == "" or chained):
            parts[i].setdefault(caller, {})[name] = None
        stack.append((i, name or "?"))

    def leave(*_: Any) -> None:
        stack.pop()

    hooks = [h for sub in {id(s): s for s in layers.modules()}.values() if sub is not layers
             for h in (sub.register_forward_pre_hook(enter), sub.register_forward_hook(leave))]
    outputs: list[Any] = []
    try:
        with _modes_kept(layers, train=True), restored_buffers(layers), torch.no_grad():
            for m in layers:
                x = m(_layer_input(m, x, outputs))
                outputs.append(x)
    finally:
        for h in hooks:
            h.remove()
    return {i: {c: tuple(children) for c, children in tree.items()} for i, tree in parts.items()}


@contextmanager
def _modes_kept(layers: nn.Sequential, train: bool) -> Iterator[None]:
    """The layers in train (or eval) mode for a dry run, every module's own mode back afterwards."""
    modes = [m.training for m in layers.modules()]
    layers.train(train)
    try:
        yield
    finally:
        for mod, mode in zip(layers.modules(), modes):
            mod.training = mode


def _layer_input(m: nn.Module, x: Any, outputs: list[Any]) -> Any:
    """What Ultralytics' layer loop feeds ``m``: the previous output, or earlier layers' outputs by index."""
    if m.f == -1:
        return x
    return outputs[m.f] if isinstance(m.f, int) else [x if j == -1 else outputs[j] for j in m.f]


def _zero_image(layers: nn.Sequential, cfg: dict | None) -> torch.Tensor:
    """The dry runs' input: one zero image of ``DRY_RUN_SIZE``, on the model's device and dtype."""
    param = next(layers.parameters(), None)
    device, dtype = (param.device, param.dtype) if param is not None else ("cpu", torch.float32)
    return torch.zeros(1, (cfg or {}).get("channels", 3), DRY_RUN_SIZE, DRY_RUN_SIZE, device=device, dtype=dtype)


def stored_head_layers(layers: nn.Sequential, cfg: dict | None, first: int) -> list[int]:
    """``head_layers`` of a built model, each architecture's dry run once (``_by_architecture``)."""
    return _by_architecture("head", layers, cfg, lambda: head_layers(layers, cfg, first), first)



def head_layers(layers: nn.Sequential, cfg: dict | None, first: int) -> list[int]:
    """The layers from ``first`` on worth a region of their own: those that store tensors for backward, reading only
    tensors that stay stored anyway.

    A layer that stores nothing (``Upsample``, ``Concat``) gains nothing from a recompute, and a region holds its
    inputs until backward, so a region is only cut where each input is a tensor the plain model's backward keeps too
    (a convolution's input): no tensor is kept alive only for a recompute. Decided from one training-mode forward of
    the plain layers on a zero image, every parameter trainable, with ``saved_tensors_hooks`` recording what each layer
    stores (buffers, modes and ``requires_grad`` restored; frozen layers are ``CheckpointPlan.without_frozen``'s job).
    """
    from torch.multiprocessing.reductions import StorageWeakRef  # torch's own weak storage reference (2.14)

    from .recompute import restored_buffers

    x = _zero_image(layers, cfg)
    # storages any op keeps for backward, by address, each with a weak reference: a storage freed during the dry run
    # gives its address to a later tensor, which must not then read as kept (an allocator's reuse, seen as a plan that
    # kept the least on one run and not on the next); holding the storages instead would make the dry run hold a
    # training step's activations, past what a small device has (tests/test_profiler.py)
    stored: dict[int, StorageWeakRef] = {}
    packs = [0]  # ops' saved tensors so far (an address may be seen again)
    packed: list[bool] = []  # per layer: does it keep anything?
    outputs: list[Any] = []
    grads = [p.requires_grad for p in layers.parameters()]  # as in training, whatever was loaded or frozen
    layers.requires_grad_(True)
    try:
        with _modes_kept(layers, train=True), restored_buffers(layers), torch.enable_grad():
            for m in layers:
                x = _layer_input(m, x, outputs)
                before = packs[0]

                def pack(t: torch.Tensor) -> None:
                    packs[0] += 1
                    stored[t.untyped_storage().data_ptr()] = StorageWeakRef(t.untyped_storage())
                    # nothing is kept: no backward follows, and a tensor returned here would be held by its own
                    # grad_fn (an output saved by its op, SiLU's), a cycle through C++ the collector cannot free

                with torch.autograd.graph.saved_tensors_hooks(pack, lambda _: None):
                    x = m(x)
                packed.append(packs[0] > before)
                outputs.append(x)
    finally:
        for p, g in zip(layers.parameters(), grads):
            p.requires_grad_(g)

    def kept(j: int) -> bool:
        out = outputs[j]
        ref = stored.get(out.untyped_storage().data_ptr()) if isinstance(out, torch.Tensor) else None
        return ref is not None and not ref.expired()  # the outputs are alive: an expired storage was another

    return [m.i for m in list(layers)[first:] if packed[m.i] and all(kept(j) for j in layer_inputs(m))]


def backbone_stages(layers: nn.Sequential, cfg: dict | None, name: str = "model") -> dict[int, tuple[int, ...]]:
    """Map stage k to the backbone layer indices with output stride 2**k, from a dry run.

    Layers that keep the input's full resolution before the first downsampling (yolov3's and yolov3-tiny's stride-1
    stem convolution) belong to the first stage: stages are cut where the stride changes.

    Args:
        layers: ``model.model`` of an Ultralytics model: layers with ``.f`` (input index) and ``.i`` (own index).
        cfg: The model's YAML dict; its ``backbone`` list says how many leading layers form the backbone.
        name: Model name for error messages.

    Returns:
        (dict[int, tuple[int, ...]]): Stage number to ascending, contiguous layer indices.

    Raises:
        CheckpointConfigError: When there is no backbone, a backbone layer does not return a feature map, strides
            are not powers of two growing with depth, or a stage takes input from outside itself.
    """
    n = len((cfg or {}).get("backbone") or [])
    if not n:
        raise CheckpointConfigError(f"{name} has no backbone section, so it has no checkpoint stages.")
    x = _zero_image(layers, cfg)
    stages: dict[int, list[int]] = {}
    leading: list[int] = []  # stride-1 layers at the start: they join the first stage, the first to change stride
    outputs = []
    with _modes_kept(layers, train=False), torch.no_grad():  # eval + no_grad: BatchNorm statistics untouched
        for m in list(layers)[:n]:
            x = _layer_input(m, x, outputs)
            x = m(x)
            outputs.append(x)
            stride = DRY_RUN_SIZE / x.shape[-1] if isinstance(x, torch.Tensor) and x.dim() == 4 else 0
            if stride == 1 and not stages:  # full-resolution layers before the first downsampling (yolov3)
                leading.append(m.i)
                continue
            # nearest power of two: a padding layer shifts the size by a pixel (yolov3-tiny's ZeroPad2d, 8 -> 9)
            k = round(math.log2(stride)) if stride >= 1 else -1
            if k < 1 or abs(math.log2(stride) - k) > STRIDE_TOLERANCE or (stages and k < max(stages)):
                raise CheckpointConfigError(
                    f"{name} has no recognisable backbone stages: layer {m.i} ({type(m).__name__}) "
                    f"gives output stride {stride or 'n/a'}, not a growing power of two. {NO_STAGES_HINT}"
                )
            if int(k) in stages and m.f != -1:
                raise CheckpointConfigError(
                    f"{name} has no recognisable backbone stages: layer {m.i} takes input from layer {m.f}. "
                    f"{NO_STAGES_HINT}"
                )
            stages.setdefault(int(k), [] if stages else leading).append(m.i)
    if not stages:
        raise CheckpointConfigError(f"{name} has no recognisable backbone stages: no backbone layer changes the "
                                    f"stride. {NO_STAGES_HINT}")
    return {k: tuple(v) for k, v in stages.items()}
