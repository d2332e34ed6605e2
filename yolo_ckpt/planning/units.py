"""The planner's vocabulary: the units a plan is made of, their modes, a candidate plan and how it reads."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from enum import Enum
from typing import Any, NamedTuple

from torch import nn

from ..memory.step import planned_copy
from ..regions.plan import CheckpointPlan
from ..regions.recompute import MODES, Mode
from ..regions.settings import PlanSettings

LOSS = "loss"  # the loss plan as a unit (``Costs.loss``): after the head, its backward first
HEAD = "head"  # the unit of the model's last layer (Detect, Segment, Classify, RTDETRDecoder, ...)
NECK = "neck"  # the unit of the layers between backbone and head layer that store activations (where there are any)
MIXED = "mixed"  # ``Candidate.mode`` of a plan whose units are recomputed in different modes
PARTS = "parts"


class UnitKind(Enum):
    """What a unit is: one backbone stage (its number), stages in one region (``(1, 2)``: the stem in the next
    stage's region, as ``checkpoint_stages=[1,2]`` makes it), the neck, the head layer, or the loss."""

    STAGE = "stage"
    JOINED = "joined"
    NECK = NECK
    HEAD = HEAD
    LOSS = LOSS

    @classmethod
    def of(cls, unit: Any) -> UnitKind:
        """The kind of ``unit`` as planning writes units: a stage number, a tuple of them, or the unit's name."""
        return cls.JOINED if isinstance(unit, tuple) else cls.STAGE if isinstance(unit, int) else cls(unit)


def is_joined(unit: Any) -> bool:
    """Whether ``unit`` is stages in one region (``UnitKind.JOINED``)."""
    return UnitKind.of(unit) is UnitKind.JOINED


def unit_stages(unit: Any) -> tuple[int, ...]:
    """The backbone stages ``unit`` recomputes: a stage's own, a joined unit's, none for the neck, head and loss."""
    kind = UnitKind.of(unit)
    return (unit,) if kind is UnitKind.STAGE else unit if kind is UnitKind.JOINED else ()


class UnitMode(str):
    """A unit's mode, where the model's plans take a mode per region, as the log and the costs' keys write it.

    Its own regions' mode (``full``, ``selective``, or none) and, for a unit with block layers, the mode of their
    parts (``Layout.nests``), each part a region nested inside the unit's regions (Chen's recursive scheme) or alone
    (``parts``: the unit's other layers keep their tensors). What the parts save depends on their unit's mode, so each
    pair is measured together: ``"full+parts:selective"`` is regions ``full``, parts ``selective``; ``"parts"`` is no
    region, parts ``full``; ``"selective"`` is regions ``selective``, no parts.
    """

    @property
    def regions(self) -> Mode | None:
        """The mode of the unit's own regions, ``None`` where they are not recomputed."""
        outer, with_parts, _ = self.partition(PARTS)
        outer = outer.removesuffix("+") if with_parts else outer
        return Mode(outer) if outer else None

    @property
    def parts(self) -> Mode | None:
        """The mode of each part of its block layers, ``None`` where they are not regions of their own."""
        _, with_parts, parts = self.partition(PARTS)
        return Mode(parts.removeprefix(":") or Mode.FULL) if with_parts else None


UNIT_MODES = tuple(UnitMode(m) for m in (*MODES, *(f"{o}+{PARTS}{s}" for o in MODES for s in ("", ":selective")),
                                         PARTS, f"{PARTS}:selective"))
NESTED = UnitMode(f"full+{PARTS}")  # a unit recomputed full, each part of its block layers a full region inside


class NothingFits(ValueError):
    """No candidate plan's measured step fits the target; ``needed`` bounds what the plan that keeps the least needs."""

    def __init__(self, message: str, needed: int):
        super().__init__(message)
        self.needed = needed


class Layout(NamedTuple):
    """Where a unit sits in the model, for settings that name its regions one by one.

    Attributes:
        unit (Any): A stage number, ``"neck"``, ``"head"``, or the stem and the next stage in one region (``(1, 2)``;
            ``UnitKind.of`` tells them apart).
        ranges (tuple): Its layer regions as ``(first, last)`` pairs.
        nests (tuple): Its block layers, whose parts (``graph.model_parts``) are blocks of their own (``_layout``):
            the unit's ``+parts`` modes recompute each part of them as a region of its own (inside the unit's
            regions, or alone).
    """

    unit: Any
    ranges: tuple
    nests: tuple = ()


@dataclass(frozen=True)
class Candidate:
    """One plan: units, each recomputed in its own mode, with its recompute FLOPs, predicted bytes and predicted step
    time at the run's batch.

    Attributes:
        units (tuple): Stage numbers, then ``"neck"`` and ``"head"`` where recomputed; ``()`` is vanilla.
        modes (tuple): Each unit's mode (one of ``UNIT_MODES``), in the order of ``units``; a single mode given as a
            string applies to every unit.
        flops (int): Convolution/matmul FLOPs the recompute adds to a step at the run's batch.
        predicted_bytes (int): Vanilla step bytes at the run's batch minus the units' measured savings.
        head (tuple): The regions of ``checkpoint_layers=head`` (neck and head layer) as ``[first, last]`` ranges,
            resolved once per model (``Costs.head``): the keyword finds them with a training-mode dry run, which
            planning copies need not repeat.
        seconds (float): Predicted step time at the run's batch (``Costs.predict_seconds``).
        layout (tuple | None): ``Layout`` of every unit of the model (``Costs.layout``): where the settings of a plan
            with per-unit modes cut its regions.
        loss (str | None): Its ``checkpoint_loss`` where planning weighs the loss (``Costs.loss``; ``"none"``:
            Ultralytics' loss), ``None`` where the loss plan is the run's, carried by every copy.
    """

    units: tuple
    modes: tuple | str
    flops: int
    predicted_bytes: int
    head: tuple | None = None
    seconds: float = 0.0
    layout: tuple | None = None
    loss: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.modes, str):  # one mode for every unit
            object.__setattr__(self, "modes", (self.modes,) * len(self.units))

    @property
    def mode(self) -> str:
        """The plan's one mode (``full`` for vanilla), or ``MIXED`` when its units differ."""
        return self.modes[0] if len(set(self.modes)) == 1 else MIXED if self.modes else "full"

    def unit_mode(self, unit: Any) -> str:
        """The mode ``unit`` is recomputed in."""
        return self.modes[self.units.index(unit)]

    @property
    def settings(self) -> PlanSettings:
        """This plan as a user writes it.

        One mode of ``MODES``: those keys as a user writes them (``checkpoint_stages``, ``checkpoint_layers=head``
        for neck and head layer, or the regions of the one of them recomputed, ``checkpoint_mode``). Otherwise every
        region in ``checkpoint_layers``: each unit's layer ranges with its mode as a suffix where it is not ``full``
        (``"0-2:selective"``), and where its parts are recomputed each part of its block layers (``"2.*"``,
        ``"2.*:selective"``), inside those ranges when they are recomputed too.
        """
        if self.mode in MODES:
            stages = [k for u in self.units for k in unit_stages(u)]
            return PlanSettings.of(stages, self.mode, self._head_layers() or None, self.loss)
        return PlanSettings.of((), Mode.FULL, self._items() or None, self.loss)

    @property
    def key(self) -> tuple:
        """What tells two plans apart: units, modes and loss plan."""
        return self.units, self.modes, self.loss

    @property
    def recomputes(self) -> bool:
        """Whether the plan recomputes anything: a unit, or the loss."""
        return bool(self.units) or self.loss not in (None, "none")

    def _head_layers(self) -> str | list:
        """``checkpoint_layers`` of a one-mode plan: ``head`` when it recomputes every unit after the backbone (or,
        without a layout, the head unit), else the ranges of those it recomputes."""
        after = [w for w in self.layout or () if w.unit in (NECK, HEAD)]
        if all(w.unit in self.units for w in after) if after else HEAD in self.units:
            return HEAD
        return [list(r) for w in after if w.unit in self.units for r in w.ranges]

    def _items(self) -> list[str]:
        """Every unit's regions as ``checkpoint_layers`` strings, in layer order."""
        if self.layout is None:
            raise ValueError("a plan of per-unit modes needs the units' layout (Costs.layout)")
        where = {w.unit: w for w in self.layout}
        items = []
        for u, m in zip(self.units, self.modes):
            outer, parts = UnitMode(m).regions, UnitMode(m).parts
            if outer:
                items += [(a, 0, f"{a}{'' if a == b else f'-{b}'}{_suffix(outer)}") for a, b in where[u].ranges]
            if parts:
                items += [(i, 1, f"{i}.*{_suffix(parts)}") for i in where[u].nests]
        return [item for *_, item in sorted(items)]

    @property
    def installs(self) -> PlanSettings:
        """``settings`` as planning installs them: ``checkpoint_layers=head`` as the head's resolved ranges where
        known (``Costs.head``), so that planning copies need not repeat the keyword's dry run."""
        s = self.settings
        if self.mode not in MODES or s.layers != HEAD or self.head is None:
            return s
        return replace(s, layers=tuple(self.head))

    def plan(self, model: nn.Module) -> CheckpointPlan:
        """The ``CheckpointPlan`` of this candidate on ``model``."""
        return self.installs.resolve(model)

    @contextmanager
    def copy(self, model: nn.Module) -> Iterator[nn.Module]:
        """A copy of ``model`` with this plan installed, for the block (``step.planned_copy``)."""
        with planned_copy(model, self.installs) as m:
            yield m


def _suffix(mode: str) -> str:
    return "" if mode == "full" else f":{mode}"


def describe(c: Candidate) -> str:
    """``stages [1, 2] + head selective``, ``stages [2, 3] full; stages [1] + head selective`` (per-unit modes),
    ``stages [2] full+parts`` (parts recomputed inside), ``head parts:selective`` (the head's parts alone), or
    ``none``; a loss plan after them (``stages [1, 2] + head, loss exact``, ``loss chunked``)."""
    if not c.units and c.loss not in (None, "none"):
        return f"loss {c.loss}"
    return _describe_plan(c) + loss_suffix(c)


def loss_suffix(c: Candidate) -> str:
    """``", loss exact"`` after a plan's units where it recomputes the loss, else nothing."""
    return "" if c.loss in (None, "none") else f", loss {c.loss}"


def _describe_plan(c: Candidate) -> str:
    if c.mode != MIXED:
        return _describe_units(c.units, c.mode)
    return "; ".join(f"{_describe_units(us, m)}{' full' if m == 'full' else ''}"
                     for m in UNIT_MODES if (us := tuple(u for u in c.units if c.unit_mode(u) == m)))


def _describe_units(units: tuple, mode: str) -> str:
    stages = ["+".join(map(str, unit_stages(u))) for u in units if UnitKind.of(u) in (UnitKind.STAGE, UnitKind.JOINED)]
    parts = ([f"stages [{', '.join(stages)}]"] if stages else []) + [u for u in (NECK, HEAD) if u in units]
    return " + ".join(parts) + (f" {mode}" if mode != "full" else "") if parts else "none"
