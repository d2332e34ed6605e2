"""One progress bar over a whole command (``yolo-ckpt profile``), fed by the loops the command runs.

A measuring function takes ``track`` (``None``: no bar) and passes the items of each of its loops through it,
naming what it measures; the bar's total grows by each loop's length as the loop starts, so that it covers phases
whose length is known only once the previous ones ran (the candidate plans, after the unit costs):

    >>> with Progress("profile:") as track:
    ...     for plan in track(["vanilla", "[2,3]", "all"], "timing plans"):
    ...         pass
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import TypeVar

T = TypeVar("T")

Track = Callable[[Iterable[T], str], Iterable[T]]  # a measuring function's ``track``: a ``Progress``, or ``None``


def tracked(track: Track | None, items: Iterable[T], what: str) -> Iterable[T]:
    """``items`` through ``track`` where there is one, else as they are."""
    return items if track is None else track(items, what)


class Progress:
    """A bar (Ultralytics' ``TQDM``) whose description says what is measured now and whose count covers every loop
    passed through it so far; ``close`` (or the ``with`` block's end) leaves it on the console."""

    def __init__(self, desc: str) -> None:
        self.desc = desc
        self.bar = None

    def __call__(self, items: Iterable[T], what: str) -> Iterator[T]:
        from ultralytics.utils import TQDM

        items = list(items)
        if self.bar is None:
            self.bar = TQDM(total=len(items), desc=self.desc, unit="step")
        else:
            self.bar.total += len(items)
        self.bar.set_description(f"{self.desc} {what}")
        for item in items:
            yield item
            self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.set_description(f"{self.desc} measured")
            self.bar.close()

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
