"""A plan as a user writes it: the four keys ``checkpoint_stages``, ``checkpoint_layers``, ``checkpoint_mode`` and
``checkpoint_loss`` as one frozen value.

A ``PlanSettings`` is what travels: the trainer reads it from its args, the planner's candidates carry it, a profile
names its plans with it, escalation moves from one to the next, and a copy of a model is planned with it. It compares
and hashes by value, says itself in the exact keys a user would pass (``str``), and installs itself on a model
(``install``); on a built model it resolves into the regions it recomputes (``CheckpointPlan``).

Examples:
    >>> s = PlanSettings.of([3, 2], "selective", "head")
    >>> str(s)
    '"checkpoint_stages=[2,3]" checkpoint_layers=head checkpoint_mode=selective'
    >>> s == PlanSettings.of((2, 3), "SELECTIVE", "head"), s.keys()["checkpoint_stages"]
    (True, [2, 3])
"""

from __future__ import annotations

import shlex
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from torch import nn

from .install import enable_checkpointing
from .loss.install import enable_loss_checkpointing
from .plan import CheckpointPlan
from .recompute import Mode
from .spec import plain, unquoted, word

KEYS = ("checkpoint_stages", "checkpoint_layers", "checkpoint_mode", "checkpoint_loss")


def _frozen(value: Any) -> Any:
    """A key's value in one hashable spelling: lists as tuples, inside too."""
    return tuple(_frozen(v) for v in value) if isinstance(value, (list, tuple)) else value


def _listed(value: Any) -> Any:
    """A frozen value as a user writes it: tuples as lists."""
    return [_listed(v) for v in value] if isinstance(value, tuple) else value


def _shown(value: Any) -> str:
    """A value as the ``k=v`` command line reads it: ``[2,3]``, ``[[13,16],'2.*']``, ``head``."""
    if isinstance(value, tuple):
        return "[" + ",".join(_shown(v) if not isinstance(v, str) else repr(v) for v in value) + "]"
    return str(value)


def _quoted(token: str) -> str:
    """``token`` as a POSIX shell passes it on: bare where it can be, else in double quotes (the layer items' own
    single quotes stay readable), else as ``shlex.quote`` writes it."""
    if shlex.quote(token) == token:
        return token
    return f'"{token}"' if not set(token) & set('"$`\\!') else shlex.quote(token)


@dataclass(frozen=True)
class PlanSettings:
    """The keys of a checkpoint plan, as a user writes them.

    Attributes:
        stages (tuple | str): ``checkpoint_stages``: stage numbers, ``"all"``, or ``()`` for none.
        layers (tuple | str | None): ``checkpoint_layers``: items (layer indices, ``(first, last)`` ranges, part
            strings such as ``"2.*:selective"``), ``"head"``, or ``None`` for none.
        mode (Mode): ``checkpoint_mode``: how regions without a mode of their own are recomputed.
        loss (str | None): ``checkpoint_loss`` (``"none"``, ``"exact"``, ``"chunked"``), or ``None`` where the loss
            plan is whatever the model has (a planning copy keeps its model's).
    """

    stages: tuple | str = ()
    layers: tuple | str | None = None
    mode: Mode = Mode.FULL
    loss: str | None = None

    @classmethod
    def of(cls, stages: Any = (), mode: Any = Mode.FULL, layers: Any = None, loss: str | None = None) -> PlanSettings:
        """The value of any spelling the keys take (``[2, 3]``, ``(3, 2)``, ``3``, ``"all"``, ``None``; ``"head"``,
        ``[[13, 16], 22]``; ``"Selective"``), validated only as far as the spelling goes: resolving it on a model
        (``resolve``) checks the rest."""
        stages, layers = _frozen(word(plain(stages))), plain(layers)
        stages = () if stages in (None, ()) else stages if isinstance(stages, (tuple, str)) else (stages,)
        if isinstance(stages, tuple) and all(isinstance(k, int) and not isinstance(k, bool) for k in stages):
            stages = tuple(sorted(stages))
        if isinstance(layers, str) and layers.strip().startswith("["):  # a list the shell passed unquoted
            layers = unquoted(layers)
        layers = "head" if word(layers) == "head" else _frozen(layers)
        return cls(stages, None if layers in (None, ()) else layers, Mode(word(mode) or Mode.FULL),
                   None if loss is None else word(loss))

    @classmethod
    def from_keys(cls, keys: Mapping[str, Any] | Any) -> PlanSettings:
        """The plan a mapping or namespace of training arguments holds (keys it lacks take their defaults)."""
        get = keys.get if isinstance(keys, Mapping) else lambda k, d=None: getattr(keys, k, d)
        return cls.of(get("checkpoint_stages"), get("checkpoint_mode") or Mode.FULL, get("checkpoint_layers"),
                      get("checkpoint_loss"))

    def keys(self) -> dict[str, Any]:
        """The training arguments of this plan, as ``yolo-ckpt train`` and ``YOLO.train`` take them (the loss only
        where the plan has one of its own)."""
        layers = [] if self.layers is None else _listed(self.layers)  # [] as the planner has always written none
        keys = {"checkpoint_stages": _listed(self.stages), "checkpoint_layers": layers,
                "checkpoint_mode": self.mode.value}
        return keys if self.loss is None else {**keys, "checkpoint_loss": self.loss}

    def __str__(self) -> str:
        """The plan as ``k=v`` arguments to pass again on a command line (quoted for the shell where a value needs
        it), the keys at their defaults left out."""
        keys = {"checkpoint_stages": self.stages, "checkpoint_layers": self.layers, "checkpoint_mode": self.mode.value,
                "checkpoint_loss": self.loss}
        default = {"checkpoint_stages": (), "checkpoint_layers": None, "checkpoint_mode": "full",
                   "checkpoint_loss": None}
        shown = [_quoted(f"{k}={_shown(v)}") for k, v in keys.items() if v != default[k]]
        return " ".join(shown) or "checkpoint_stages=[]"

    def with_loss(self, loss: str | None) -> PlanSettings:
        """The same layer plan with ``checkpoint_loss=loss``."""
        return replace(self, loss=loss)

    def resolve(self, model: Any) -> CheckpointPlan:
        """The regions this plan recomputes on ``model`` (a built model, or what ``model_stages`` accepts)."""
        return CheckpointPlan.from_spec(model, _listed(self.stages), _listed(self.layers))

    def install(self, model: nn.Module) -> None:
        """Install the plan on ``model``: its regions, and its loss plan where it has one of its own."""
        enable_checkpointing(model, self.resolve(model), self.mode)
        if self.loss is not None:
            enable_loss_checkpointing(model, self.loss)


NO_PLAN = PlanSettings()  # no layer region, and the loss plan a model has kept
VANILLA = PlanSettings(loss="none")  # nothing recomputed: no layer region, Ultralytics' own loss
