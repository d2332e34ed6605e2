"""A ``yolo-ckpt train`` run's memory and step time against eager vanilla's, side by side in one command.

Three runs of one recipe, one after another, each in a process of its own (its own dynamo cache and allocator):

1. plain Ultralytics, ``YOLO(model).train(...)``, eager: the step-time reference (without yolo-ckpt's exact tracker,
   which slows eager steps about 3.9x on CPU);
2. ``yolo-ckpt train ... checkpoint_stages=[]``, eager, its memory sampled as a compiled run's is (step 2 of each
   epoch from allocation records, with the model state, the optimizer's moments and the batch): the memory reference;
3. ``yolo-ckpt train`` with the keys given after ``--``; with ``--pairs N``, runs 1 and 3 alternate N times and
   the step-time ratio of each pair is printed with their median.

Step time is CPU time (``time.process_time``) from ``on_train_batch_start`` to ``on_train_batch_end``, the median of
every step but each epoch's first two (the first compiles, the second is the one sampled for memory); CPU time,
since wall time on a shared machine drifts by more than the ratios measured. Memory is results.csv's
``mem/peak_tensor_GB``, epoch by epoch.

Usage:
    python benchmarks/run_step_times.py -- compile=True compile_regions=apart \\
        "checkpoint_layers=[0-2,2.*,3-4,5-6,7-10,13,16,17,19,20,22,23]"          # issue 48's run, 640 px, batch 4
    python benchmarks/run_step_times.py --imgsz 64 --epochs 1 -- compile=True   # a quick check
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MARK = "RUN_STEP_TIMES "


def child(kind: str, recipe: dict, keys: list[str]) -> None:
    """One run in this process; prints its step CPU times (per epoch) and its results.csv path after ``MARK``."""
    from ultralytics.utils.callbacks import base

    steps: list[tuple[int, float]] = []
    start = [0.0]
    base.default_callbacks["on_train_batch_start"].append(lambda t: start.__setitem__(0, time.process_time()))
    base.default_callbacks["on_train_batch_end"].append(
        lambda t: steps.append((t.epoch, time.process_time() - start[0])))
    if kind == "ultralytics":
        from ultralytics import YOLO

        from yolo_ckpt.data.synthetic import synthetic_dataset

        YOLO(recipe["model"]).train(data=str(synthetic_dataset("detect")), **{k: v for k, v in recipe.items()
                                                                              if k != "model"})
        csv_path = ""
    else:
        from yolo_ckpt.integration import epoch_memory
        from yolo_ckpt.integration.cli import main

        if kind == "sampled":  # an eager run measured as a compiled one is: step 2 of each epoch, allocation records
            epoch_memory.is_compiled = lambda model: True
        main(["train", *(f"{k}={v}" for k, v in recipe.items()), *keys])
        csv_path = str(Path(recipe["project"]) / recipe["name"] / "results.csv")
    print(MARK + json.dumps({"steps": steps, "csv": csv_path}), flush=True)


def run(kind: str, recipe: dict, keys: list[str]) -> dict:
    out = subprocess.run([sys.executable, __file__, "--child", kind, "--recipe", json.dumps(recipe), "--", *keys],
                         capture_output=True, text=True)
    line = next((x for x in out.stdout.splitlines() if x.startswith(MARK)), None)
    if out.returncode or line is None:
        sys.exit(f"{kind} run failed:\n{(out.stdout + out.stderr)[-3000:]}")
    got = json.loads(line[len(MARK):])
    by_epoch: dict[int, list[float]] = {}
    for epoch, seconds in got["steps"]:
        by_epoch.setdefault(epoch, []).append(seconds)
    timed = [s for times in by_epoch.values() for s in times[2:]]
    memory = []
    if got["csv"]:
        with open(got["csv"]) as f:
            memory = [float(r["mem/peak_tensor_GB"]) for r in csv.DictReader(f, skipinitialspace=True)]
    return {"seconds": statistics.median(timed) if timed else float("nan"), "memory": memory}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="yolo11n.yaml")
    p.add_argument("--imgsz", type=int, default=640)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--pairs", type=int, default=1, help="plain and measured runs, alternated, this many times each")
    p.add_argument("--child", choices=["ultralytics", "sampled", "ckpt"], help=argparse.SUPPRESS)
    p.add_argument("--recipe", help=argparse.SUPPRESS)
    p.add_argument("keys", nargs="*", help="yolo-ckpt keys of the run measured, after --")
    a = p.parse_args()
    if a.pairs < 1:
        p.error(f"--pairs {a.pairs}: a number of pairs of runs, 1 or more")
    if a.child:
        child(a.child, json.loads(a.recipe), a.keys)
        return
    project = tempfile.mkdtemp(prefix="run_step_times_")
    recipe = dict(model=a.model, imgsz=a.imgsz, batch=a.batch, epochs=a.epochs, val=False, deterministic=False,
                  workers=0, plots=False, project=project, exist_ok=True)
    # plain Ultralytics with the demo recipe's keys (cfg/demo.yaml), which yolo-ckpt train applies without data=
    plain_recipe = {**recipe, "name": "ultralytics", "nbs": a.batch, "mosaic": 0.0, "warmup_epochs": 1}
    reference = run("sampled", {**recipe, "name": "vanilla", "checkpoint_compare": False}, ["checkpoint_stages=[]"])
    pairs = []
    for _ in range(a.pairs):  # plain, measured, plain, measured: a drift of the machine's speed hits both of a pair
        pairs.append((run("ultralytics", plain_recipe, []),
                      run("ckpt", {**recipe, "name": "measured", "checkpoint_compare": False}, a.keys)))
    plain, measured = pairs[0]
    ratios = [m / r for m, r in zip(measured["memory"], reference["memory"])]
    print(f"{a.model}, {a.imgsz} px, batch {a.batch}, {a.epochs} epochs; keys: {' '.join(a.keys) or '(none)'}")
    print(f"{'run':<36}{'mem/peak_tensor_GB by epoch':<32}{'x vanilla':<22}{'step CPU s':>11}{'x plain':>9}")
    print(f"{'plain Ultralytics, eager':<36}{'-':<32}{'-':<22}{plain['seconds']:>11.3f}{1:>9.2f}")
    for name, r, x in (("eager vanilla, sampled as compiled", reference, None), ("yolo-ckpt with the keys", measured,
                                                                                 ratios)):
        mem = " ".join(f"{m:.3f}" for m in r["memory"])
        shown = " ".join(f"{v:.3f}" for v in x) if x is not None else "1"
        seconds = r["seconds"] / plain["seconds"]
        print(f"{name:<36}{mem:<32}{shown:<22}{r['seconds']:>11.3f}{seconds:>9.2f}")
    if len(pairs) > 1:
        each = [m["seconds"] / p["seconds"] for p, m in pairs]
        print(f"step CPU time x plain, pair by pair: {' '.join(f'{x:.2f}' for x in each)}; "
              f"median {statistics.median(each):.2f}")


if __name__ == "__main__":
    main()
