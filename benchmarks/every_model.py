"""Every task's default model, and the other families people train, through every planning path.

Usage:
    python benchmarks/every_model.py                    # every model at 64 px (CPU: about 10 min on 1 core)
    python benchmarks/every_model.py --models yolo26n-seg.yaml --imgsz 128

For each model: ``yolo-ckpt profile`` (the task inferred from the model), ``auto`` at a fixed batch for a target
between the plan that keeps the least and vanilla, escalation from vanilla at that batch, AutoBatch with ``auto``
for a share that vanilla's batch-1 step does not fit, and the validator's memory. What each path chose is measured
again with a fresh exact tracker around the model's own loss (``LiveTensorTracker``), and each line says PASS or FAIL
on its claim. CI runs it at 64 px on yolo26n-seg, -cls and -sem (yolo26n-seg covers yolo26n), a test per model,
``profile`` without its candidates table and no step timed (``tests/test_every_model.py``); run this for the others
(rtdetr-l: 80 s of a 2-core CPU).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
import traceback
from pathlib import Path

from yolo_ckpt.integration.cli import profile
from yolo_ckpt.memory.step import (
    OBJECTS_PER_IMAGE,
    StepShape,
    build_model,
    loop_bytes,
    state_bytes,
    training_batch,
    validation_bytes,
    with_plan,
)
from yolo_ckpt.memory.tracker import LiveTensorTracker
from yolo_ckpt.planning.choice import choose_plan, choose_plan_and_batch
from yolo_ckpt.planning.costs import unit_costs
from yolo_ckpt.planning.escalation import next_plan
from yolo_ckpt.planning.search import deepest
from yolo_ckpt.regions.settings import PlanSettings
from yolo_ckpt.report.profiler import standard_plans

MODELS = [  # Ultralytics' default model of every task (8.4.190: yolo26), the yolo11 ones yolo-ckpt defaults to
    # where their heads differ, and RT-DETR
    "yolo26n.yaml", "yolo26n-seg.yaml", "yolo26n-pose.yaml", "yolo26n-obb.yaml", "yolo26n-cls.yaml",
    "yolo26n-sem.yaml", "yolo26n-depth.yaml", "yolo11n-seg.yaml", "yolo11n-pose.yaml", "rtdetr-l.yaml",
]
OBJECTS = OBJECTS_PER_IMAGE  # as profile measures: its unit costs are the ones every path below plans with


def fresh_step(model, plan: PlanSettings | None, imgsz: int, batch: int) -> int:
    """The independent reference: model state and a fresh tracker around one loss forward and backward of a copy
    with ``plan`` installed (``None``: vanilla)."""
    m = model if plan is None else with_plan(model, plan.with_loss(None))
    m.zero_grad(set_to_none=True)
    with LiveTensorTracker() as t:
        data = training_batch(m, StepShape(imgsz, batch, OBJECTS))
        m.loss(data)[0].sum().backward()
    m.zero_grad(set_to_none=True)
    return state_bytes(m) + t.peak


def check(name: str, imgsz: int, batch: int, candidates: bool = True,
          timed: bool = True) -> list[tuple[str, bool, str]]:
    """Each planning path on ``name``: (path, passed, what it found). ``candidates=False``: ``profile`` without its
    candidates table (``cli.profile``), which no line here checks and which is most of a profile's time.
    ``timed=False``: no step is timed (every planned time 0 s), as ``checkpoint_stages=least`` plans; no line here
    checks a time, and timing is most of what is left."""
    model, out = build_model(name), []
    # measured once: profile's tradeoffs and every plan below use them
    costs = unit_costs(model, StepShape(imgsz, objects=OBJECTS), timed=timed)
    with tempfile.TemporaryDirectory() as tmp:
        profile([f"model={name}", f"imgsz={imgsz}", "batch=1", f"project={tmp}", "name=p"], costs=costs,
                candidates=candidates, repeats=None if timed else 0)
        saved = json.loads((Path(tmp) / "p" / "profile.json").read_text())
    ok = [r["plan"] for r in saved["plans"]] == list(standard_plans(model)) and all(r["fits"] for r in saved["plans"])
    out.append(("profile", ok, f"{len(saved['plans'])} plans, task {saved.get('task', model.args.task)}"))

    vanilla, least = fresh_step(model, None, imgsz, batch), fresh_step(model, deepest(model), imgsz, batch)
    out.append(("least-keeping plan", least < vanilla, f"{least / 2**20:.1f} of vanilla's {vanilla / 2**20:.1f} MiB"))
    target = (least + vanilla) // 2
    choice = choose_plan(model, StepShape(imgsz, batch, OBJECTS), target, costs=costs)
    got = fresh_step(model, choice.candidate.settings, imgsz, batch)
    out.append(("auto (fixed batch)", bool(choice.plan.regions) and got <= target,
                f"{choice.plan.describe(choice.candidate.settings.mode)}: {got / 2**20:.1f} MiB of "
                f"{target / 2**20:.1f}"))
    plan, _ = next_plan(model, PlanSettings(), StepShape(imgsz, batch, OBJECTS), costs)
    got = fresh_step(model, plan, imgsz, batch)
    out.append(("escalation from vanilla", got < vanilla, f"{got / 2**20:.1f} of {vanilla / 2**20:.1f} MiB"))

    one = fresh_step(model, None, imgsz, 1) + loop_bytes(model, StepShape(imgsz, 1, OBJECTS))
    share = (one + fresh_step(model, deepest(model), imgsz, 1) + loop_bytes(model, StepShape(imgsz, 1, OBJECTS))) // 2
    batched = choose_plan_and_batch(model, StepShape(imgsz, objects=OBJECTS), int(share / 0.6) + 1, 0.6, max_batch=4,
                                    costs=costs)
    b = batched.batch
    got = fresh_step(model, batched.candidate.settings, imgsz, b) + loop_bytes(model, StepShape(imgsz, b, OBJECTS))
    out.append(("AutoBatch with auto", bool(batched.plan.regions) and got <= share,
                f"batch {b}: {got / 2**20:.1f} MiB of {share / 2**20:.1f} (vanilla's batch 1: {one / 2**20:.1f})"))
    val = validation_bytes(model, StepShape(imgsz, 2 * batch, OBJECTS))
    out.append(("validation", val > state_bytes(model), f"{val / 2**20:.1f} MiB at batch {2 * batch}"))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="*", default=MODELS)
    p.add_argument("--imgsz", type=int, default=64)
    p.add_argument("--batch", type=int, default=2)
    a = p.parse_args()
    failed = 0
    for name in a.models:
        start = time.perf_counter()
        try:
            rows = check(name, a.imgsz, a.batch)
        except Exception as e:  # one model's error is its FAIL line; the others still run
            traceback.print_exc()
            rows = [("every path", False, f"{type(e).__name__}: {e}")]
        for path, ok, what in rows:
            failed += not ok
            print(f"{'PASS' if ok else 'FAIL'} {name} {path}: {what}")
        print(f"{name}: {time.perf_counter() - start:.0f} s")
    raise SystemExit(1 if failed else 0)


if __name__ == "__main__":
    main()
