"""README's picture: peak memory against step time for the standard plans of one model, each measured side by side with
vanilla in one run (``yolo_ckpt.report.profiler.compare_plans``: a real training step, exact live tensor bytes,
median step time), drawn as ``yolo-ckpt profile`` draws its tradeoff.png. With ``--front``, instead,
docs/planning.md's picture: every candidate plan of ``checkpoint_stages=auto`` measured, its Pareto front of memory
against FLOPs and, with ``--budget``, auto's choice for that memory_budget ringed
(``yolo_ckpt.report.tradeoff.tradeoffs``, profile's pareto.png).

Usage:
    python benchmarks/tradeoff_picture.py                     # yolo11n, 640 px, batch 4: docs/img/tradeoff.png
    python benchmarks/tradeoff_picture.py --imgsz 320 --front docs/img/pareto.png --budget 300MB   # the front
    python benchmarks/tradeoff_picture.py --imgsz 64 --repeats 1 --out /tmp/tradeoff.png
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
from pathlib import Path

from yolo_ckpt.memory.step import StepShape, build_model
from yolo_ckpt.report.profiler import compare_plans, standard_plans, write_profile
from yolo_ckpt.report.tradeoff import plot_front, tradeoffs

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="yolo11n.yaml")
    p.add_argument("--imgsz", type=int, default=640)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", type=Path, default=ROOT / "docs" / "img" / "tradeoff.png")
    p.add_argument("--front", type=Path, help="instead: every candidate plan and its Pareto front, into this PNG")
    p.add_argument("--budget", help="with --front: ring auto's choice for this memory_budget (e.g. 1GB)")
    a = p.parse_args()
    model = build_model(a.model)
    if a.front:
        front(model, a)
        return
    rows = compare_plans(model, StepShape(a.imgsz, a.batch), standard_plans(model), repeats=a.repeats)
    with tempfile.TemporaryDirectory() as tmp:
        png = write_profile(Path(tmp), [], rows)[3]
        a.out.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(png, a.out)
    print(f"{a.model}, imgsz {a.imgsz}, batch {a.batch}, CPU step time median of {a.repeats}:")
    print("| plan | peak MiB | peak ratio | step time ratio |\n|---|---|---|---|")
    for r in rows:
        print(f"| {r['plan']} | {r['peak_MiB']} | {r['peak_ratio']} | {r['time_ratio']} |")
    print(f"picture: {a.out}")


def front(model, a: argparse.Namespace) -> None:
    """Every candidate of ``auto`` measured (one step each), the Pareto front drawn and printed."""
    extra = tradeoffs(model, StepShape(a.imgsz, a.batch), a.budget)
    a.front.parent.mkdir(parents=True, exist_ok=True)
    plot_front(extra["candidates"], a.front, extra["chosen"])
    print(f"{a.model}, imgsz {a.imgsz}, batch {a.batch}: {len(extra['candidates'])} candidate plans measured")
    print(*extra["notes"], "| Pareto plan | peak ratio | FLOP ratio |\n|---|---|---|", sep="\n")
    for r in extra["candidates"]:
        if r["pareto"]:
            print(f"| {r['plan']} | {r['peak_ratio']} | {r['flops_ratio']} |")
    print(f"picture: {a.front}")


if __name__ == "__main__":
    main()
