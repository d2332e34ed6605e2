"""docs/plans.md's stage diagram: every layer of a model at its output stride, coloured by the checkpoint stage it
belongs to (``yolo_ckpt.regions.graph.model_stages``), the layers ``checkpoint_layers=head`` cuts into regions
marked, and each layer's inputs drawn as lines (the neck's skips read the backbone's stages).

Usage:
    python benchmarks/stage_diagram.py                                  # yolo11n: docs/img/stages.png
    python benchmarks/stage_diagram.py --model yolo26n-seg.yaml --out /tmp/stages.png
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import torch

from yolo_ckpt.memory.step import build_model
from yolo_ckpt.regions.graph import head_layers, layer_inputs, model_stages

ROOT = Path(__file__).resolve().parents[1]
SIZE = 256  # the dry run's image: strides are sizes divided into it


def layer_strides(model: torch.nn.Module) -> list[float | None]:
    """Each layer's output stride from one eval forward on a zero image (``None``: no single feature map, the head's
    outputs)."""
    strides: list[float | None] = []
    hooks = [m.register_forward_hook(lambda m, a, out: strides.append(
        SIZE / out.shape[-1] if isinstance(out, torch.Tensor) and out.dim() == 4 else None)) for m in model.model]
    try:
        with torch.no_grad():
            model.eval()(torch.zeros(1, model.yaml.get("channels", 3), SIZE, SIZE))
    finally:
        for h in hooks:
            h.remove()
    return strides


def draw(model_name: str, out: Path) -> list[str]:
    """Draw ``model_name``'s diagram to ``out`` and return its rows: ``layer, type, stride, stage``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    model = build_model(model_name)
    layers = model.model
    stages = model_stages(model)
    stage_of = {i: k for k, ids in stages.items() for i in ids}
    regions = set(head_layers(layers, model.yaml, first=max(stages[max(stages)]) + 1))
    strides = layer_strides(model)
    top = max(math.log2(s) for s in strides if s) + 1  # the head's row, above the coarsest stride
    y = [math.log2(s) if s else top for s in strides]
    fig, ax = plt.subplots(figsize=(max(8.0, 0.42 * len(layers)), 4.2))
    for m in layers:
        for j in (j for j in layer_inputs(m) if j >= 0):  # -1 of layer 0: the image
            ax.plot([j, m.i], [y[j], y[m.i]], color="0.75", lw=0.8, zorder=1)
    rows = []
    for m in layers:
        k = stage_of.get(m.i)
        colour = plt.cm.tab10(k - 1) if k else "0.85"
        edge = "black" if m.i in regions else "0.5"
        ax.scatter(m.i, y[m.i], s=260, marker="s", color=colour, edgecolors=edge, linewidths=2 if m.i in regions else 1,
                   zorder=3)
        ax.annotate(type(m).__name__, (m.i, y[m.i]), xytext=(0, -15), textcoords="offset points", ha="center",
                    va="top", fontsize=6, rotation=90)
        ax.annotate(str(m.i), (m.i, y[m.i]), ha="center", va="center", fontsize=6, zorder=4)
        label = k or ("head" if m.i in regions else "")
        rows.append(f"| {m.i} | {type(m).__name__} | {strides[m.i] or 'head'} | {label} |")
    for k in stages:
        ax.scatter([], [], s=80, marker="s", color=plt.cm.tab10(k - 1), label=f"stage {k} (P{k}/{2 ** k})")
    ax.scatter([], [], s=80, marker="s", color="0.85", edgecolors="black", linewidths=2,
               label="checkpoint_layers=head region")
    ticks = sorted({v for v in y if v != top})
    ax.set_yticks([*ticks, top], [*(f"/{2 ** round(t)}" for t in ticks), "outputs"])
    ax.set_ylim(top + 1.0, min(ticks) - 0.6)  # fine strides at the top, the labels below each box inside
    ax.set_xticks([])
    ax.set_xlabel("layer (index in the model YAML; lines: each layer's inputs)")
    ax.set_ylabel("output stride")
    ax.set_title(f"{model_name}: checkpoint stages by output stride")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1), borderaxespad=0)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=150, bbox_inches="tight")
    plt.close(fig)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="yolo11n.yaml")
    p.add_argument("--out", type=Path, default=ROOT / "docs" / "img" / "stages.png")
    a = p.parse_args()
    rows = draw(a.model, a.out)
    print("| layer | type | stride | stage |\n|---|---|---|---|", *rows, f"picture: {a.out}", sep="\n")


if __name__ == "__main__":
    main()
