"""Which layers to checkpoint: backbone stages of an Ultralytics model, derived from the built model.

Stage ``k`` is the run of backbone layers whose output stride is ``2**k`` — the ``Pk/2^k`` comments of Ultralytics'
model YAMLs. Strides come from a dry run of the backbone, never from an index table, so every scale of yolov8, yolo11
and yolo26 (P5 and P6) and every task head resolves the same way.

Examples:
    >>> from ultralytics.nn.tasks import DetectionModel
    >>> model = DetectionModel("yolo11n.yaml", verbose=False)
    >>> backbone_stages(model)
    {1: (0,), 2: (1, 2), 3: (3, 4), 4: (5, 6), 5: (7, 8, 9, 10)}
    >>> CheckpointPlan.from_spec(model, [2, 3, 4]).regions  # layer 2's output feeds only layer 3: one region
    (Region(stages=(2, 3), layers=(1, 2, 3, 4)), Region(stages=(4,), layers=(5, 6)))
"""

from __future__ import annotations

import itertools
import math
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from copy import deepcopy
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple, TypeVar

import torch
from torch import nn

DRY_RUN_SIZE = 256  # input side for the stride dry run; a multiple of every stride up to P8
NO_STAGES_HINT = ("Valid for this model: checkpoint_layers=[first, last] ranges of layer indices (checkpoint_stages "
                  "and checkpoint_layers=head need stages).")
T = TypeVar("T")
STRIDE_TOLERANCE = 0.25  # in log2: a layer's output side may be off a power-of-two stride by a padding pixel


class CheckpointConfigError(ValueError):
    """A ``checkpoint_stages`` value that cannot be applied to the model; the message is one line.

    Attributes:
        reason (str): What is wrong, without the hint of valid values.
    """

    def __init__(self, reason: str, hint: str = ""):
        super().__init__(f"{reason} {hint}".strip())
        self.reason = reason


@dataclass(frozen=True)
class Region:
    """A contiguous run of model layers recomputed as one unit during backward.

    Attributes:
        stages (tuple[int, ...]): Backbone stages k (output stride 2**k) the region covers, ascending.
        layers (tuple[int, ...]): Indices into ``model.model``, ascending and contiguous.
        parts (tuple[str, ...]): For a region inside a layer (``layers`` is that one layer): its run of parts in call
            order, named by their module paths inside the layer (``("m.0", "cv2")``); ``()`` for whole layers.
        mode (str | None): How this region is recomputed (``full``/``selective``); ``None``: the plan's mode.
        siblings (tuple[str, ...]): For a run of several parts the layer's own code calls: every part it calls, in
            order (the recompute replays the layer's forward, serving the parts outside the run from the forward).
    """

    stages: tuple[int, ...]
    layers: tuple[int, ...]
    parts: tuple[str, ...] = ()
    mode: str | None = None
    siblings: tuple[str, ...] = ()

    @property
    def name(self) -> str:
        """The region in ``checkpoint_layers`` spelling: ``13``, ``0-4``, ``2.cv1``, ``2.m.0-cv2``, with ``:mode``."""
        where = str(self.layers[0]) if len(self.layers) == 1 else f"{self.layers[0]}-{self.layers[-1]}"
        if self.parts:
            where += "." + (self.parts[0] if len(self.parts) == 1 else f"{self.parts[0]}-{self.parts[-1]}")
        return where + (f":{self.mode}" if self.mode else "")


@dataclass(frozen=True)
class CheckpointPlan:
    """Which regions of a model to checkpoint: a plain value, independent of how a region is recomputed.

    Attributes:
        regions (tuple[Region, ...]): Regions in forward order; empty means checkpointing is off.
    """

    regions: tuple[Region, ...] = ()

    @property
    def stages(self) -> list[int]:
        """Checkpointed stage numbers in ascending order."""
        return [k for r in self.regions for k in r.stages]

    @property
    def layer_regions(self) -> list[list[int]]:
        """Regions of whole layers from ``checkpoint_layers`` (not backbone stages), as layer index lists."""
        return [list(r.layers) for r in self.regions if not r.stages and not r.parts]

    @property
    def part_regions(self) -> list[Region]:
        """Regions inside layers (``checkpoint_layers`` parts), in forward order."""
        return [r for r in self.regions if r.parts]

    def layer_spec(self) -> list[str]:
        """``checkpoint_layers`` that gives this plan's regions that are not backbone stages (with their modes)."""
        return [r.name for r in self.regions if not r.stages]

    def describe(self, mode: str = "full") -> str:
        """One line for logs: ``stages [2, 3] + layers [13] [16] + parts 2.m.0-cv2 selective``; ``none`` when off."""
        parts = [f"stages {self.stages}"] if self.stages else []
        if layers := [r for r in self.regions if not r.stages and not r.parts]:
            parts.append("layers " + " ".join(f"[{r.name}]" for r in layers))
        if inside := self.part_regions:
            parts.append("parts " + " ".join(r.name for r in inside))
        return " + ".join(parts or ["none"]) + (" selective" if mode == "selective" and parts else "")

    @classmethod
    def from_spec(cls, model: Any, spec: Any, layers: Any = None) -> CheckpointPlan:
        """Resolve ``checkpoint_stages`` (and ``checkpoint_layers``) values against a model.

        Consecutive requested stages share one region when the tensor between them is read by nothing but the next
        layer, and that layer (the next stage's first) reads nothing else: a region boundary there would keep that
        tensor alive only for the recompute (for yolo11n at 640 the P1 and P2 outputs are ~10% of the checkpointed
        peak). Where a later layer reads it anyway (P3, P4 feed the neck), or the next stage takes other inputs,
        regions stay separate, so no recompute holds more than one stage's activations beyond that.

        Layer regions (``checkpoint_layers``, see ``layer_regions``) are added as given; they must not overlap the
        stages.

        Args:
            model: A built Ultralytics model, or anything ``model_stages`` accepts (YAML path, dict).
            spec: ``None``/``[]`` (off), ``"all"``, a stage number, or a list/tuple of stage numbers.
            layers: A ``checkpoint_layers`` value: ``None``/``[]`` (none), ``"head"``, or layer indices and
                ``[first, last]`` ranges.

        Returns:
            (CheckpointPlan): One region per requested stage (or merged run of stages) and per layer region.

        Raises:
            CheckpointConfigError: For any value that is not a set of this model's stages or layers.
        """
        try:
            requested = parse_stage_spec(spec)
        except CheckpointConfigError as e:  # name this model's stages when it has any
            try:
                stages = model_stages(model)
            except CheckpointConfigError:
                raise e from None
            raise CheckpointConfigError(f"{e.reason} {_valid_hint(stages)}") from None
        try:
            ranges = parse_layer_spec(layers)
        except CheckpointConfigError as e:  # name this model's layers
            raise CheckpointConfigError(e.reason, _layers_hint(model)) from None
        if requested == [] and ranges == []:
            return cls()
        if requested == [] and ranges:  # layer ranges need no stages (a model without them can still use these)
            return cls(tuple(_layer_regions(model, ranges, layers, {})))
        stages, read_later, chained = _analyse(model)
        joined = _joined(stages, read_later, chained)
        extra = _layer_regions(model, ranges, layers, stages) if ranges != [] else []
        if requested is None:  # "all"
            requested = sorted(stages)
        if bad := [k for k in requested if k not in stages]:
            raise CheckpointConfigError(
                f"checkpoint_stages={_show(spec)}: {_model_name(model)} has no stage {bad[0]}.", _valid_hint(stages)
            )
        regions: list[Region] = []
        for k in requested:
            last = regions[-1] if regions else None
            merge = last and last.stages[-1] == k - 1 and k in joined
            if merge:
                regions[-1] = Region((*last.stages, k), (*last.layers, *stages[k]))
            else:
                regions.append(Region((k,), stages[k]))
        taken = {i: r for r in regions for i in r.layers}
        if clash := next((i for r in extra if not r.parts for i in r.layers if i in taken), None):
            raise CheckpointConfigError(
                f"checkpoint_layers={_show(layers)}: layer {clash} is already in checkpoint_stages={_show(spec)} "
                f"(stage {taken[clash].stages[0]}).", _layers_hint(model)
            )
        return cls(tuple(sorted((*regions, *extra), key=lambda r: (r.layers[0], bool(r.parts)))))

    def without_frozen(self, model: nn.Module) -> tuple[CheckpointPlan, list[int]]:
        """This plan minus the stages that store nothing for backward: all parameters frozen, no gradient coming in.

        Such a stage (``freeze=`` covering it, behind a frozen stem) keeps no activations even without checkpointing,
        so recomputing it would only cost time. Call it after the trainer has frozen layers (``requires_grad``).

        Returns:
            (tuple[CheckpointPlan, list[int]]): The plan of the remaining stages, and the stages dropped.
        """
        if not self.regions:
            return self, []
        needs_grad = _outputs_needing_grad(model.model)
        stages = model_stages(model)
        dropped = [k for k in self.stages if not needs_grad[stages[k][-1]]]
        extra = [r for r in self.regions if not r.stages]
        kept_extra = [r for r in extra if needs_grad[r.layers[-1]]]
        dropped_layers = [i for r in extra if r not in kept_extra for i in r.layers]
        if not dropped and not dropped_layers:
            return self, []
        staged = CheckpointPlan.from_spec(model, [k for k in self.stages if k not in dropped]).regions
        plan = CheckpointPlan(tuple(sorted((*staged, *kept_extra), key=lambda r: (r.layers[0], bool(r.parts)))))
        return plan, [*dropped, *(f"layer {i}" for i in dropped_layers)]


def _outputs_needing_grad(layers: nn.Sequential) -> list[bool]:
    """Per layer: does its output require grad in training (a trainable parameter in it or in anything feeding it)?"""
    needs: list[bool] = []
    for i, m in enumerate(layers):
        sources = [m.f] if isinstance(m.f, int) else m.f
        inputs = [i + j if j < 0 else j for j in sources]  # -1: the previous layer (the image for layer 0)
        trainable = any(p.requires_grad for p in m.parameters())
        needs.append(trainable or any(needs[j] for j in inputs if j >= 0))
    return needs


def _show(spec: Any) -> str:
    return "[" + ",".join(map(repr, spec)) + "]" if isinstance(spec, list) else repr(spec)


def _valid_hint(stages: dict[int, tuple[int, ...]] | None = None) -> str:
    valid = ", ".join(str(k) for k in sorted(stages)) if stages else "the model's backbone stages"
    return (f"Valid: a list of distinct stage numbers from {{{valid}}}, a single stage, 'all', 'auto' (with "
            f"memory_budget or CUDA), or [] for off.")


def _model_name(model: Any) -> str:
    if isinstance(model, (str, Path)):
        return Path(model).name
    yaml = getattr(model, "yaml", None) or (model if isinstance(model, dict) else {})
    return Path(str(yaml.get("yaml_file") or type(model).__name__)).name


def word(value: Any) -> Any:
    """The case rule of all our keys: a word value (``all``, ``auto``, ``head``, ``full``, ``selective``, and memory
    units) is read case-insensitively, spaces around it ignored; any other value is returned as it is."""
    return value.strip().lower() if isinstance(value, str) else value


def parse_stage_spec(spec: Any) -> list[int] | None:
    """Check the form of a ``checkpoint_stages`` value without a model.

    Args:
        spec: The raw value from the CLI (already ``ast.literal_eval``-ed by Ultralytics) or Python.

    Returns:
        (list[int] | None): Sorted stage numbers, ``[]`` for off, or ``None`` for ``"all"``.

    Raises:
        CheckpointConfigError: For floats, bools, dicts, strings other than ``all``, stage < 1 and duplicates.

    Examples:
        >>> parse_stage_spec(3), parse_stage_spec((3, 2)), parse_stage_spec("all"), parse_stage_spec(None)
        ([3], [2, 3], None, [])
    """
    if spec is None:
        return []
    if word(spec) == "all":
        return None
    items = list(spec) if isinstance(spec, (list, tuple)) else [spec]
    for k in items:
        if isinstance(k, bool) or not isinstance(k, int):
            raise CheckpointConfigError(f"checkpoint_stages={_show(spec)}: {k!r} is not a stage number.", _valid_hint())
        if k < 1:
            raise CheckpointConfigError(f"checkpoint_stages={_show(spec)}: stages start at 1, got {k}.", _valid_hint())
    if len(set(items)) != len(items):
        raise CheckpointConfigError(f"checkpoint_stages={_show(spec)}: duplicate stages.", _valid_hint())
    return sorted(items)


def model_stages(model: Any) -> dict[int, tuple[int, ...]]:
    """Stages of a model given as a built model, a model YAML path/name or a YAML dict.

    A YAML (or a ``.pt`` file's embedded YAML) is built layer by layer with Ultralytics' own ``parse_model``; only its
    backbone is run, on a zero image.

    Raises:
        CheckpointConfigError: When the model has no recognisable backbone stages.
    """
    return _analyse(model)[0]


def _built(model: Any) -> tuple[nn.Sequential, list[int], dict | None, str]:
    """Layers, ``save`` list, YAML dict and name of a built model, a ``.pt`` file, a YAML path/name or dict."""
    if isinstance(model, (str, Path)) and Path(model).suffix == ".pt":
        from ultralytics.nn.tasks import load_checkpoint

        model = load_checkpoint(model)[0]
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


class Span(NamedTuple):
    """One ``checkpoint_layers`` item: layers ``first``-``last``, or parts of layer ``first``.

    Attributes:
        first (int): First layer.
        last (int): Last layer (``first`` for parts).
        parts (tuple[str, str] | str | None): ``None`` for whole layers, ``"*"`` for each part of the layer its own
            region, or the first and last part of a run (equal for one part).
        mode (str | None): The region's own mode (``:full``/``:selective``), ``None`` for the plan's.
    """

    first: int
    last: int
    parts: tuple[str, str] | str | None = None
    mode: str | None = None


_ITEM = re.compile(r"^(\d+)(?:-(\d+))?(?:\.(\*|[A-Za-z_][\w.]*?)(?:-([A-Za-z_][\w.]*))?)?(?::(\w+))?$")


def _span(item: Any, spec: Any) -> Span:
    """Parse one item: an index, a ``[first, last]`` pair or a string (``13``, ``0-4``, ``2.cv1``, ``2.m.0-cv2``,
    ``2.*``, each with an optional ``:full``/``:selective``)."""
    from .recompute import MODES

    if isinstance(item, str):
        found = _ITEM.match(item.strip())
        if not found or (found[2] and found[3]):
            raise CheckpointConfigError(f"checkpoint_layers={_show(spec)}: {item!r} is not a layer, layer range or "
                                        f"part of a layer.", _layers_hint())
        first, last, part, until, mode = found.groups()
        if mode is not None and word(mode) not in MODES:
            raise CheckpointConfigError(f"checkpoint_layers={_show(spec)}: {item!r} has mode {mode!r}; modes are "
                                        f"{' and '.join(MODES)}.", _layers_hint())
        parts = None if part is None else "*" if part == "*" else (part, until or part)
        if parts == "*" and until:
            raise CheckpointConfigError(f"checkpoint_layers={_show(spec)}: {item!r}: '*' stands alone.",
                                        _layers_hint())
        return Span(int(first), int(last or first), parts, word(mode))
    pair = list(item) if isinstance(item, (list, tuple)) else [item, item]
    if len(pair) != 2 or any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in pair):
        raise CheckpointConfigError(f"checkpoint_layers={_show(spec)}: {item!r} is not a layer index or "
                                    f"[first, last] range.", _layers_hint())
    return Span(pair[0], pair[1])


def _unquoted(text: str) -> list:
    """``[2.*, 23.cv2.0, [0, 4], 16]`` written without quotes, which Ultralytics' CLI hands over as one string (it
    cannot be read as a Python literal): string items, with ``[first, last]`` pairs and indices as numbers."""
    items = re.findall(r"\[\s*\d+\s*,\s*\d+\s*\]|[^,\[\]\s'\"]+", text.strip()[1:-1])
    return [[int(i) for i in re.findall(r"\d+", x)] if x.startswith("[") else int(x) if x.isdigit() else x
            for x in items]


def parse_layer_spec(spec: Any) -> list[Span] | None:
    """Check the form of a ``checkpoint_layers`` value without a model.

    The grammar (each item's meaning never depends on other keys): ``13`` or ``"13"`` is layer 13; ``[13, 15]`` or
    ``"13-15"`` layers 13-15 as one region; ``"2.cv1"`` the part ``cv1`` of layer 2 (a module its forward calls,
    named by its path inside the layer: what follows ``model.2.`` in state_dict keys); ``"2.m.0-cv2"`` the run of
    parts from ``m.0`` to ``cv2`` in the order the layer calls them; ``"2.*"`` each part of layer 2 its own region.
    A string item may end in ``:full`` or ``:selective``, that region's mode (otherwise ``checkpoint_mode``). A part
    inside another region (a stage, a layer, a larger part) is recomputed nested, with checkpoints of its own.

    Returns:
        (list[Span] | None): Items in layer order, ``[]`` for none, ``None`` for ``"head"``.

    Raises:
        CheckpointConfigError: For anything else, and for layer regions that overlap.

    Examples:
        >>> parse_layer_spec([22, [13, 15], "16:selective"]), parse_layer_spec("head"), parse_layer_spec(None)
        ([Span(13, 15), Span(16, 16, None, 'selective'), Span(22, 22)], None, [])
        >>> parse_layer_spec(["2.m.0-cv2", "23.*"])
        [Span(2, 2, ('m.0', 'cv2')), Span(23, 23, '*')]
    """
    if spec is None:
        return []
    if word(spec) == "head":
        return None
    if isinstance(spec, str) and spec.strip().startswith("["):  # a list the shell passed unquoted: [2.*,23.cv2.0]
        spec = _unquoted(spec)
    spans = sorted((_span(item, spec) for item in (list(spec) if isinstance(spec, (list, tuple)) else [spec])),
                   key=lambda s: (s.first, s.parts is not None))
    for s in spans:
        if s.first > s.last:
            raise CheckpointConfigError(f"checkpoint_layers={_show(spec)}: range {[s.first, s.last]} ends before it "
                                        f"starts.", _layers_hint())
    whole = [s for s in spans if s.parts is None]
    if any(b.first <= a.last for a, b in zip(whole, whole[1:])):
        raise CheckpointConfigError(f"checkpoint_layers={_show(spec)}: regions overlap.", _layers_hint())
    return spans


def _layers_hint(model: Any = None) -> str:
    n = None
    if model is not None:
        try:
            n = len(_built(model)[0])
        except Exception:  # the hint must not fail where the model cannot be built
            n = None
    valid = f"layer indices 0-{n - 1}" if n else "layer indices (the first column of the model summary)"
    return (f"Valid: 'head' (every layer after the backbone that stores activations), {valid}, "
            f"[first, last] ranges of them, parts of a layer ('2.cv1', '2.m.0-cv2', '2.*'; ':full'/':selective' "
            f"after any string item), or [] for none.")


def _layer_regions(model: Any, spans: list[Span] | None, spec: Any,
                   stages: dict[int, tuple[int, ...]]) -> list[Region]:
    """Regions of ``checkpoint_layers``: the given items, or for ``head`` one per storing layer (``head_layers``)."""
    layers, _, cfg, name = _built(model)
    if spans is None:
        first = max(stages[max(stages)]) + 1
        return [Region((), (i,)) for i in _by_architecture("head", layers, cfg,
                                                           lambda: head_layers(layers, cfg, first), first)]
    if bad := next((i for s in spans for i in (s.first, s.last) if i >= len(layers)), None):
        raise CheckpointConfigError(f"checkpoint_layers={_show(spec)}: {name} has no layer {bad}.",
                                    _layers_hint(model))
    parts = _parts_of(model) if any(s.parts for s in spans) else {}
    regions = []
    for s in spans:
        if s.parts is None:
            regions.append(Region((), tuple(range(s.first, s.last + 1)), mode=s.mode))
        else:
            for run in _runs(parts[s.first], s, spec, layers):
                own = len(run) > 1 and part_container(run[0], parts[s.first]) == "" and not isinstance(
                    layers[s.first], nn.Sequential)
                regions.append(Region((), (s.first,), run, s.mode, parts[s.first][""] if own else ()))
    _check_parts([r for r in regions if r.parts], parts, spec, model)
    return regions


def _check_parts(regions: list[Region], parts: dict[int, dict[str, tuple[str, ...]]], spec: Any, model: Any) -> None:
    """Part regions of one layer may nest (a part inside a run or inside a larger part) but not overlap; and a layer
    has at most one run of several of the parts its own code calls (the recompute of such a run replays the layer's
    forward: ``yolo_ckpt.model``)."""
    for a, b in itertools.combinations(regions, 2):
        nested = (len(a.parts) == 1) != (len(b.parts) == 1)  # one part inside a run: checkpointed within it
        if a.layers == b.layers and set(a.parts) & set(b.parts) and not nested:
            raise CheckpointConfigError(f"checkpoint_layers={_show(spec)}: {a.name} and {b.name} overlap (a part "
                                        f"may nest inside a run or a larger part, not share it with another "
                                        f"region).", _layers_hint(model))
    for i in {r.layers[0] for r in regions}:
        runs = [r for r in regions if r.layers[0] == i and r.siblings]
        if len(runs) > 1:
            raise CheckpointConfigError(f"checkpoint_layers={_show(spec)}: layer {i} has two runs of its own parts, "
                                        f"{runs[0].name} and {runs[1].name}; a layer recomputes at most one run of "
                                        f"several parts (any number of single parts and runs inside Sequential "
                                        f"parts).", _layers_hint(model))


def _runs(tree: dict[str, tuple[str, ...]], s: Span, spec: Any, layers: nn.Sequential) -> list[tuple[str, ...]]:
    """The runs of parts a part item names, checked against the layer's parts."""
    kind = type(layers[s.first]).__name__

    def hint() -> str:
        names = [n for children in tree.values() for n in children]
        return (f"Valid parts of layer {s.first} ({kind}): {', '.join(names)}; a run joins parts called one after "
                f"another by the same module ('{s.first}.{names[0]}-{tree[''][-1]}')." if names else
                f"Layer {s.first} ({kind}) calls no modules of its own in training: name the whole layer.")

    if s.parts == "*":
        if not tree.get(""):
            raise CheckpointConfigError(f"checkpoint_layers={_show(spec)}: layer {s.first} ({kind}) has no parts.",
                                        hint())
        return [(n,) for n in tree[""]]
    a, b = s.parts
    where = next((c for c, children in tree.items() if a in children), None)
    if where is None or b not in tree[where]:
        bad = a if where is None else b
        raise CheckpointConfigError(f"checkpoint_layers={_show(spec)}: {bad!r} is not a part of layer {s.first}"
                                    f"{'' if where is None else f' called by the same module as {a!r}'}.", hint())
    children = tree[where]
    if children.index(b) < children.index(a):
        raise CheckpointConfigError(f"checkpoint_layers={_show(spec)}: layer {s.first} calls {b!r} before {a!r}.",
                                    hint())
    return [children[children.index(a):children.index(b) + 1]]


def part_container(part: str, tree: dict[str, tuple[str, ...]]) -> str:
    """The module (``""``: the layer itself, or a Sequential part) that calls ``part``."""
    return next(c for c, children in tree.items() if part in children)


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
