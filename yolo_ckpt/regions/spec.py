"""The grammar of ``checkpoint_stages`` and ``checkpoint_layers``: a value checked and parsed without a model.

Examples:
    >>> parse_stage_spec((3, 2)), parse_layer_spec("2.*")
    ([2, 3], [Span(first=2, last=2, parts='*', mode=None)])
"""

from __future__ import annotations

import ast
import operator
import re
from typing import Any, NamedTuple


class CheckpointConfigError(ValueError):
    """A ``checkpoint_stages`` value that cannot be applied to the model; the message is one line.

    Attributes:
        reason (str): What is wrong, without the hint of valid values.
    """

    def __init__(self, reason: str, hint: str = ""):
        super().__init__(f"{reason} {hint}".strip())
        self.reason = reason


def _show(spec: Any) -> str:
    return "[" + ",".join(map(repr, spec)) + "]" if isinstance(spec, list) else repr(spec)


def _valid_hint(stages: dict[int, tuple[int, ...]] | None = None) -> str:
    valid = ", ".join(str(k) for k in sorted(stages)) if stages else "the model's backbone stages"
    return (f"Valid: a list of distinct stage numbers from {{{valid}}}, a single stage, 'all', 'auto' (with "
            f"memory_budget or CUDA), 'least' (the plan that keeps the least), or [] for off.")


def word(value: Any) -> Any:
    """The case rule of all our keys: a word value (``all``, ``auto``, ``head``, ``full``, ``selective``, and memory
    units) is read case-insensitively, spaces around it ignored; any other value is returned as it is."""
    return value.strip().lower() if isinstance(value, str) else value


def plain(value: Any) -> Any:
    """A key's value as Ultralytics' command line hands it over, whatever Python spelling it came in: a string that
    holds a list, a tuple or a number read as the command line reads a whole value (``"[2, 3]"``, ``"3"``); numpy and
    torch integers as ``int`` (floats as ``float``); ranges, numpy arrays and tensors as lists, their items likewise
    (strings inside a list stay strings, as inside the command line's list). Every other value is returned as it is,
    for the grammar to accept or refuse in one line, the same line whichever way it was written.

    Examples:
        >>> plain(range(2, 4)), plain("[2, 3]"), plain(" 3 "), plain((3, 2)), plain("all"), plain(["10", 13])
        ([2, 3], [2, 3], 3, (3, 2), 'all', ['10', 13])
    """
    if isinstance(value, str):
        text = value.strip()
        if text.startswith(("[", "(")) or text.isdigit():
            try:
                return _plain_item(ast.literal_eval(text))
            except (ValueError, SyntaxError):  # "[2.*, 23.cv2.0]", unquoted: ``unquoted`` reads it
                return value
        return value
    return _plain_item(value)


def _plain_item(value: Any) -> Any:
    """``plain`` for anything but a whole value's string: numbers and sequences made Python's own."""
    if value is None or isinstance(value, (str, bool, dict)):
        return value
    if isinstance(value, float):  # numpy's float64 is one: shown as the command line shows it
        return float(value)
    if isinstance(value, int):
        return int(value)
    if isinstance(value, (list, tuple)):
        return type(value)(_plain_item(v) for v in value)
    if hasattr(value, "tolist"):  # numpy arrays and scalars, torch tensors
        return _plain_item(value.tolist())
    if hasattr(value, "__index__"):  # any other integer type
        return operator.index(value)
    if isinstance(value, range):
        return list(value)
    return value


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
    spec = plain(spec)
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
                                        f"part of a layer.", layers_hint())
        first, last, part, until, mode = found.groups()
        if mode is not None and word(mode) not in MODES:
            raise CheckpointConfigError(f"checkpoint_layers={_show(spec)}: {item!r} has mode {mode!r}; modes are "
                                        f"{' and '.join(MODES)}.", layers_hint())
        parts = None if part is None else "*" if part == "*" else (part, until or part)
        if parts == "*" and until:
            raise CheckpointConfigError(f"checkpoint_layers={_show(spec)}: {item!r}: '*' stands alone.",
                                        layers_hint())
        return Span(int(first), int(last or first), parts, word(mode))
    pair = list(item) if isinstance(item, (list, tuple)) else [item, item]
    if len(pair) != 2 or any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in pair):
        raise CheckpointConfigError(f"checkpoint_layers={_show(spec)}: {item!r} is not a layer index or "
                                    f"[first, last] range.", layers_hint())
    return Span(pair[0], pair[1])


def unquoted(text: str) -> list:
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
        >>> [(s.first, s.last, s.mode) for s in parse_layer_spec([22, [13, 15], "16:selective"])]
        [(13, 15, None), (16, 16, 'selective'), (22, 22, None)]
        >>> parse_layer_spec("head"), parse_layer_spec(None)
        (None, [])
        >>> parse_layer_spec(["2.m.0-cv2", "23.*"])
        [Span(first=2, last=2, parts=('m.0', 'cv2'), mode=None), Span(first=23, last=23, parts='*', mode=None)]
    """
    spec = plain(spec)
    if spec is None:
        return []
    if word(spec) == "head":
        return None
    if isinstance(spec, str) and spec.strip().startswith("["):  # a list the shell passed unquoted: [2.*,23.cv2.0]
        spec = unquoted(spec)
    spans = sorted((_span(item, spec) for item in (list(spec) if isinstance(spec, (list, tuple)) else [spec])),
                   key=lambda s: (s.first, s.parts is not None))
    for s in spans:
        if s.first > s.last:
            raise CheckpointConfigError(f"checkpoint_layers={_show(spec)}: range {[s.first, s.last]} ends before it "
                                        f"starts.", layers_hint())
    whole = [s for s in spans if s.parts is None]
    if any(b.first <= a.last for a, b in zip(whole, whole[1:])):
        raise CheckpointConfigError(f"checkpoint_layers={_show(spec)}: regions overlap.", layers_hint())
    return spans


def layers_hint(n: int | None = None) -> str:
    """The valid values of ``checkpoint_layers``, for a model of ``n`` layers where it is known."""
    valid = f"layer indices 0-{n - 1}" if n else "layer indices (the first column of the model summary)"
    return (f"Valid: 'head' (every layer after the backbone that stores activations), {valid}, "
            f"[first, last] ranges of them, parts of a layer ('2.cv1', '2.m.0-cv2', '2.*'; ':full'/':selective' "
            f"after any string item), or [] for none.")
