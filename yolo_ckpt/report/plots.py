"""Readable labels for the profile plots: every labelled point in a legend beside the axes, never text on the plot.

Plans often sit close together or on top of each other (``all + head`` and ``all + head selective`` keep the same
bytes on yolo11s), so labels written next to the points overlap and run past the axes; a legend entry per point, each
with its own marker and colour, stays legible however the points fall.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

MARKERS = "osD^v<>pPX*h"


def legend_points(ax: Any, rows: list[dict], x: str, y: str, label: Callable[[dict], str]) -> None:
    """Scatter ``rows[i][x], rows[i][y]``, each point with its own marker and colour and ``label(row)`` in a legend
    outside the axes (save with ``bbox_inches="tight"`` to keep it in the figure)."""
    import matplotlib.pyplot as plt

    for n, r in enumerate(rows):
        ax.scatter(r[x], r[y], marker=MARKERS[n % len(MARKERS)], color=plt.cm.tab20(n % 20), s=42, zorder=3,
                   label=label(r))
    ax.margins(0.08)  # no point on the frame
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1), borderaxespad=0)


def axes(rows: list[dict], ratios: tuple[str, str, str], absolute: tuple[str, str, str]) -> tuple[str, str, str]:
    """``(x key, y key, unit suffix)`` of a profile plot: ``ratios`` when the first row (vanilla) was measured, else
    ``absolute`` (vanilla did not fit the device, so there is nothing to divide by)."""
    return ratios if rows and rows[0].get(ratios[1]) is not None else absolute
