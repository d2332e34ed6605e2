"""The pictures: memory per epoch (``memory.png``), and readable labels for the profile plots.

Profile plots put every labelled point in a legend beside the axes, never text on the plot.

Plans often sit close together or on top of each other (``all + head`` and ``all + head selective`` keep the same
bytes on yolo11s), so labels written next to the points overlap and run past the axes; a legend entry per point, each
with its own marker and colour, stays legible however the points fall.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
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


def epoch_ticks(ax: Any, epochs: Any) -> None:
    """Tick whole epochs only: each epoch of a short run, whole numbers of a long one (matplotlib's default ticks a
    single epoch at 0.96-1.04)."""
    from matplotlib.ticker import MaxNLocator

    if len(epochs) <= 20:
        ax.set_xticks(epochs)
        ax.set_xlim(min(epochs) - 0.5, max(epochs) + 0.5)
    else:
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def plot_memory(csv_file: str | Path, vanilla: float | None = None) -> Path | None:
    """Plot the ``mem/*`` columns of an Ultralytics results.csv per epoch into ``memory.png`` beside it.

    Args:
        csv_file (str | Path): The run's results.csv.
        vanilla (float | None): What the same run without checkpointing would have peaked at, in GB
            (``summary.compare_with_vanilla``'s estimate), drawn as a dashed line to compare the run's peaks with.

    Returns:
        The PNG path, or ``None`` when the file has no memory column (nothing is drawn from nothing).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    csv_file = Path(csv_file)
    names = [c.strip() for c in csv_file.read_text().splitlines()[0].split(",")]
    columns = [i for i, c in enumerate(names) if c.startswith("mem/")]
    if not columns:
        return None
    data = np.atleast_2d(np.loadtxt(csv_file, delimiter=",", skiprows=1))
    if not np.isfinite(data[:, columns]).any():  # no epoch was measured: nothing to draw
        return None
    fig, ax = plt.subplots(figsize=(6, 4), tight_layout=True)
    for i in columns:
        ax.plot(data[:, 0], data[:, i], marker=".", label=names[i].removeprefix("mem/"))
    if vanilla is not None:
        ax.axhline(vanilla, color="grey", linestyle="--", label=f"vanilla, estimated ({vanilla:.3f} GB)")
    top = max(float(np.nanmax(data[:, columns])), vanilla or 0.0) * 1.15
    ax.set(xlabel="epoch", ylabel="peak memory (GB = 2^30 B)", title="peak memory per epoch", ylim=(0, top))
    epoch_ticks(ax, data[:, 0])
    ax.legend()
    ax.grid(alpha=0.3)
    path = csv_file.with_name("memory.png")
    fig.savefig(path, dpi=150)
    plt.close(fig)
    return path
