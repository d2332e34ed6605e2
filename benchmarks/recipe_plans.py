"""Which plan ``checkpoint_stages=auto memory_budget=24GB`` gives each high-resolution recipe at its batch.

Builds each recipe's model as its trainer would (the embedded dataset's classes, plus background for semantic
segmentation, and its image channels) and runs the planner's two stages as ``yolo-ckpt train`` does for a fixed batch:

1. ``unit_costs``: the vanilla step and each unit (stage, head; full and selective) alone, measured at batch 1 (exact
   live tensor bytes and FLOPs, real training steps on this machine's CPU), and every candidate plan ranked by FLOPs
   with its memory predicted at the recipe's batch (``candidates``): the cheapest predicted to fit 60% of the budget
   (``auto`` measures the candidates predicted within 10% of it in FLOPs order and takes the first whose measured step
   fits; predictions are within about 10% of measured steps);
2. with ``--measure``, ``choose_plan`` itself: the measured step at the recipe's batch decides. This holds the whole
   step in host memory (above 10 GB at these sizes for vanilla): run it where that memory exists (a GPU: see
   ``benchmarks/gpu_check.py``), which is why it is opt-in. With ``--device 6GB`` as well, planning runs on a
   simulated device of that size, smaller than the budget, as on such a GPU: each candidate's step at the recipe's
   batch is extrapolated from the batches the device holds (``plan_batch``), and the first in FLOPs order whose
   step fits decides — ``checkpoint_stages=auto memory_budget=24GB`` on that device;
3. with ``--confirm``, the plan of stage 1 and vanilla measured at two small batches (the recipe's batch / 8 and
   twice that) and extended along the line through them to the recipe's batch — memory is linear in the batch, and
   this is how planning itself extrapolates when the device holds less than the budget (``plan_batch``).

Usage:
    python benchmarks/recipe_plans.py cfg/medical_semantic_2048.yaml cfg/aerial_semantic_1024.yaml --budget 24GB
    python benchmarks/recipe_plans.py cfg/medical_semantic_2048.yaml --confirm   # measured at batches 1 and 2
    python benchmarks/recipe_plans.py cfg/aerial_semantic_1024.yaml --measure --device 6GB   # auto on a 6 GB device
"""

import argparse
import contextlib
import time

from ultralytics.cfg import get_cfg
from ultralytics.nn.tasks import DepthModel, SemanticSegmentationModel
from ultralytics.utils import YAML

from yolo_ckpt.data.synthetic import recipe
from yolo_ckpt.memory.device import SimulatedDevice
from yolo_ckpt.memory.step import StepShape, planned_copy, state_bytes, step_bytes, training_batch
from yolo_ckpt.planning.autobatch import parse_memory
from yolo_ckpt.planning.choice import choose_plan
from yolo_ckpt.planning.costs import unit_costs
from yolo_ckpt.planning.search import candidates
from yolo_ckpt.planning.units import NothingFits, describe
from yolo_ckpt.regions.settings import PlanSettings

MODELS = {"semantic": SemanticSegmentationModel, "depth": DepthModel}


def recipe_model(cfg: dict):
    """The model a recipe trains, built as its trainer builds it from the embedded dataset's data.yaml."""
    data = recipe(cfg["data"])
    task = "semantic" if "-sem" in cfg["model"] else "depth"
    nc = len(data["names"]) + 1 if task == "semantic" else 1  # semantic: the classes, then background
    model = MODELS[task](cfg["model"], ch=int(data.get("channels", 3)), nc=nc, verbose=False)
    model.args = get_cfg(overrides={"task": task})  # the loss reads its hyperparameters here
    return model.float().train()


def ranked_plans(model, imgsz: int, batch: int):
    """Stage 1: unit costs at batch 1, the fixed part (model state, the batch) and every candidate at ``batch``,
    cheapest FLOPs first."""
    costs = unit_costs(model, StepShape(imgsz))
    data = training_batch(model, StepShape(imgsz, batch))
    fixed = state_bytes(model) + sum(t.untyped_storage().nbytes() for t in data.values())  # as step_bytes counts
    del data
    return costs, fixed, candidates(costs, batch, fixed)


def predicted(model, imgsz: int, batch: int, target: int) -> str:
    """The cheapest candidate predicted (from batch-1 steps) to fit ``target``, and the plan that keeps the least."""
    costs, fixed, ranked = ranked_plans(model, imgsz, batch)
    vanilla = fixed + costs.predict((), "full", batch)[0]
    least = min(ranked, key=lambda c: c.predicted_bytes)
    head = f"vanilla predicted {vanilla / 2**30:.2f} GB of {target / 2**30:.2f} GB"
    if vanilla <= target:
        return f"{head}: auto keeps everything (no plan needed)"
    if (c := next((c for c in ranked if c.predicted_bytes <= target), None)) is None:
        return f"{head}; nothing predicted to fit (least: {describe(least)} {least.predicted_bytes / 2**30:.2f} GB)"
    base = batch * costs.plain.flops
    return (f"{head}; cheapest plan predicted to fit: {describe(c)}, predicted {c.predicted_bytes / 2**30:.2f} GB, "
            f"{1 + c.flops / base:.3f}x FLOPs (least-keeping plan {describe(least)}: "
            f"{least.predicted_bytes / 2**30:.2f} GB, {1 + least.flops / base:.3f}x)")


def extended_step(model, imgsz: int, batch: int) -> tuple[list[tuple[int, int]], float]:
    """Step bytes measured at ``batch`` / 8 and ``batch`` / 4 (at least 1 and 2) and extended along the line through
    them to ``batch``: the measured points and the bytes at ``batch``."""
    (b1, m1), (b2, m2) = points = [(b, step_bytes(model, StepShape(imgsz, b)))
                                   for b in (max(batch // 8, 1), max(batch // 4, 2))]
    return points, m2 + (m2 - m1) / (b2 - b1) * (batch - b2)


def confirmed(model, imgsz: int, batch: int, target: int) -> str:
    """Vanilla and stage 1's plan measured at batch/8 and batch/4 (at least 1 and 2), extended to ``batch``."""
    c = next((c for c in ranked_plans(model, imgsz, batch)[2] if c.predicted_bytes <= target), None)
    if c is None:
        return "nothing predicted to fit"
    parts = []
    for name, spec in (("vanilla", PlanSettings()), (describe(c), c.settings.with_loss(None))):
        with planned_copy(model, spec) as m:
            ((b1, m1), (b2, m2)), at = extended_step(m, imgsz, batch)
        parts.append(f"{name}: measured {m1 / 2**30:.2f} GB at batch {b1}, {m2 / 2**30:.2f} GB at batch {b2} -> "
                     f"{at / 2**30:.2f} GB at batch {batch} ({'fits' if at <= target else 'does not fit'} "
                     f"{target / 2**30:.2f} GB)")
    return "; ".join(parts) + f"; predicted from batch 1: {c.predicted_bytes / 2**30:.2f} GB"


def measured(model, imgsz: int, batch: int, target: int) -> str:
    """What ``choose_plan`` chooses, every step measured at ``batch``."""
    try:
        c = choose_plan(model, StepShape(imgsz, batch), target)
    except NothingFits as e:
        return str(e)
    how = "extrapolated from batches the device holds" if c.extrapolated else "measured"
    return (f"auto chooses {describe(c.candidate)}, {how} {c.measured_bytes / 2**30:.2f} GB of "
            f"{c.target_bytes / 2**30:.2f} GB, {1 + c.candidate.flops / c.base_flops:.3f}x FLOPs; measured: "
            + "; ".join(f"{describe(t.candidate)} " + ("does not fit" if t.measured is None else
                                                       f"{t.measured / 2**30:.2f} GB") for t in c.tried))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("recipes", nargs="+")
    p.add_argument("--budget", default="24GB")
    p.add_argument("--fraction", type=float, default=0.6)
    p.add_argument("--measure", action="store_true", help="run choose_plan: measure at the recipe's batch")
    p.add_argument("--confirm", action="store_true", help="measure at two small batches, extend to the recipe's")
    p.add_argument("--device", default=None, help="with --measure: plan on a simulated device of this size")
    a = p.parse_args()
    for path in a.recipes:
        cfg = YAML.load(path)
        with SimulatedDevice(parse_memory(a.device)) if a.device else contextlib.nullcontext():
            model, t0 = recipe_model(cfg), time.time()  # built on the device, as the trainer builds it
            target = int(a.fraction * parse_memory(a.budget))
            how = measured if a.measure else confirmed if a.confirm else predicted
            line, channels = how(model, cfg["imgsz"], cfg["batch"], target), model.yaml.get("channels", 3)
            del model
        where = f" on a simulated {a.device} device" if a.device else ""
        print(f"{path}: {cfg['model']} imgsz={cfg['imgsz']} batch={cfg['batch']} channels={channels}, "
              f"{a.fraction:.0%} of {a.budget}{where}: {line} ({time.time() - t0:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
