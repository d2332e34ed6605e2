"""Which plan ``checkpoint_stages=auto memory_budget=24GB`` gives each high-resolution recipe at its batch.

Builds each recipe's model as its trainer would (the embedded dataset's classes, plus background for semantic
segmentation, and its image channels), then runs the planner exactly as ``yolo-ckpt train`` does for a fixed batch:
``yolo_ckpt.planner.choose_plan`` with 60% of the budget, every decision resting on a measured training step (exact
live tensor bytes, on this machine's CPU). Prints the choice, its measured GB and FLOPs, and the vanilla step for
comparison. At 2048 px each CPU step takes minutes: run one recipe at a time if needed.

Usage:
    python benchmarks/recipe_plans.py cfg/medical_semantic_2048.yaml cfg/aerial_semantic_1024.yaml --budget 24GB
"""

import argparse
import time

from ultralytics.cfg import get_cfg
from ultralytics.nn.tasks import DepthModel, SemanticSegmentationModel
from ultralytics.utils import YAML

from yolo_ckpt.autobatch import parse_memory
from yolo_ckpt.planner import NothingFits, choose_plan, describe
from yolo_ckpt.synthetic import recipe

MODELS = {"semantic": SemanticSegmentationModel, "depth": DepthModel}


def recipe_model(cfg: dict):
    """The model a recipe trains, built as its trainer builds it from the embedded dataset's data.yaml."""
    data = recipe(cfg["data"])
    task = "semantic" if "-sem" in cfg["model"] else "depth"
    nc = len(data["names"]) + 1 if task == "semantic" else 1  # semantic: the classes, then background
    model = MODELS[task](cfg["model"], ch=int(data.get("channels", 3)), nc=nc, verbose=False)
    model.args = get_cfg(overrides={"task": task})  # the loss reads its hyperparameters here
    return model.float().train()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("recipes", nargs="+")
    p.add_argument("--budget", default="24GB")
    p.add_argument("--fraction", type=float, default=0.6)
    a = p.parse_args()
    for path in a.recipes:
        cfg = YAML.load(path)
        model, t0 = recipe_model(cfg), time.time()
        target = int(a.fraction * parse_memory(a.budget))
        try:
            c = choose_plan(model, cfg["imgsz"], cfg["batch"], target)
        except NothingFits as e:
            print(f"{path}: {e}")
            continue
        vanilla = next((b for t, b in c.tried if not t.units), None)
        print(f"{path}: {cfg['model']} imgsz={cfg['imgsz']} batch={cfg['batch']} channels="
              f"{model.yaml.get('channels', 3)}: auto chooses {describe(c.candidate)}, measured "
              f"{c.measured_bytes / 2**30:.2f} GB of {c.target_bytes / 2**30:.2f} GB ({a.fraction:.0%} of {a.budget}), "
              f"{1 + c.candidate.flops / c.base_flops:.3f}x FLOPs; measured: "
              + "; ".join(f"{describe(t)} {b / 2**30:.2f} GB" for t, b in c.tried)
              + (f"; vanilla {vanilla / 2**30:.2f} GB" if vanilla else "") + f" ({time.time() - t0:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
