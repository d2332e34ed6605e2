"""Time to generate every task of every embedded dataset variant once, into a fresh cache root (what a recipe or
generator change costs: the cache directory is keyed by the recipe's hash).

Usage:
    python benchmarks/generation_time.py
"""

import tempfile
import time

from yolo_ckpt.data.synthetic import VARIANTS, recipe, recipe_tasks, synthetic_dataset


def main() -> None:
    root, start = tempfile.mkdtemp(), time.time()
    for variant in VARIANTS:
        for task in recipe_tasks(recipe(variant)):
            t = time.time()
            synthetic_dataset(task, root, variant=variant)
            print(f"{variant} {task} {time.time() - t:.1f}s", flush=True)
    print(f"total {time.time() - start:.1f}s")


if __name__ == "__main__":
    main()
