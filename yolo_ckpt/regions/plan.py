"""A checkpoint plan: the regions a model's forward recomputes, resolved from the user's keys on a built model.

Examples:
    >>> from ultralytics.nn.tasks import DetectionModel
    >>> model = DetectionModel("yolo11n.yaml", verbose=False)
    >>> [(r.stages, r.layers) for r in CheckpointPlan.from_spec(model, [2, 3, 4]).regions]  # 2 feeds only 3
    [((2, 3), (1, 2, 3, 4)), ((4,), (5, 6))]
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

from torch import nn

from .graph import (
    _analyse,
    _built,
    _joined,
    _model_name,
    _outputs_needing_grad,
    _parts_of,
    model_stages,
    stored_head_layers,
)
from .spec import CheckpointConfigError, Span, _show, _valid_hint, layers_hint, parse_layer_spec, parse_stage_spec


def _layers_hint(model: Any) -> str:
    try:
        n = len(_built(model)[0])
    except Exception:  # the hint must not fail where the model cannot be built
        n = None
    return layers_hint(n)


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
        regions = _stage_regions(requested, stages, joined)
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


def _stage_regions(requested: list[int], stages: dict[int, tuple[int, ...]], joined: set[int]) -> list[Region]:
    """One region per requested stage, a stage in ``joined`` sharing the region of the stage before it."""
    regions: list[Region] = []
    for k in requested:
        last = regions[-1] if regions else None
        if last and last.stages[-1] == k - 1 and k in joined:
            regions[-1] = Region((*last.stages, k), (*last.layers, *stages[k]))
        else:
            regions.append(Region((k,), stages[k]))
    return regions


def _layer_regions(model: Any, spans: list[Span] | None, spec: Any,
                   stages: dict[int, tuple[int, ...]]) -> list[Region]:
    """Regions of ``checkpoint_layers``: the given items, or for ``head`` one per storing layer (``head_layers``)."""
    layers, _, cfg, name = _built(model)
    if spans is None:
        first = max(stages[max(stages)]) + 1
        return [Region((), (i,)) for i in stored_head_layers(layers, cfg, first)]
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
    _check_parts([r for r in regions if r.parts], spec, model)
    return regions


def _check_parts(regions: list[Region], spec: Any, model: Any) -> None:
    """Part regions of one layer may nest (a part inside a run or inside a larger part) but not overlap; and a layer
    has at most one run of several of the parts its own code calls (the recompute of such a run replays the layer's
    forward: ``yolo_ckpt.regions.install``)."""
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
