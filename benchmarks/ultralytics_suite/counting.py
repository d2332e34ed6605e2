"""Count the regions yolo-ckpt recomputes in backward, per training, in this process and in the ``yolo-ckpt``
processes it starts.

``install`` wraps the one call through which yolo-ckpt checkpoints a region (``checkpoint`` as
``yolo_ckpt.regions.recompute`` calls it): each region's function counts its runs after the first (its forward), which
are the recomputes backward makes; backward passes (``Tensor.backward``); and Ultralytics' training loop
(``BaseTrainer._do_train``), which notes how many recomputes each training that ran a backward pass made. A training
of ours that recomputed nothing trained vanilla.

Run as a script, it is ``yolo-ckpt`` itself (the console script's ``yolo_ckpt.integration.cli.main``) with the counter
installed; on exit it leaves its count in ``$ULTRALYTICS_SUITE_COUNTS/<pid>.json`` for the test that started it:

    python benchmarks/ultralytics_suite/counting.py train model=yolo26n.yaml data=coco8.yaml checkpoint_stages=all
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

COUNTS_ENV = "ULTRALYTICS_SUITE_COUNTS"  # a directory: each yolo-ckpt process started by a test leaves its count here
COUNT: dict = {"recomputes": 0, "backward": 0, "trainings": []}  # all recomputes, backward passes; each training's


def install() -> None:
    """Count every recompute of a checkpointed region from now on (``COUNT["recomputes"]``), and each training's
    (``COUNT["trainings"]``)."""
    import torch
    from ultralytics.engine.trainer import BaseTrainer

    from yolo_ckpt.regions import recompute

    original = recompute.checkpoint
    if getattr(original, "counting", False):
        return

    def checkpoint(fn, *args, **kwargs):
        runs = []

        def counted(*a, **k):
            if runs:  # the forward ran it first: this is backward's recompute
                COUNT["recomputes"] += 1
            runs.append(None)
            return fn(*a, **k)

        return original(counted, *args, **kwargs)

    checkpoint.counting = True
    recompute.checkpoint = checkpoint
    backward = torch.Tensor.backward

    def counted_backward(self, *args, **kwargs):
        COUNT["backward"] += 1
        return backward(self, *args, **kwargs)

    torch.Tensor.backward = counted_backward
    loop = BaseTrainer._do_train

    def _do_train(self, *args, **kwargs):
        recomputes, passes = COUNT["recomputes"], COUNT["backward"]
        try:
            return loop(self, *args, **kwargs)
        finally:
            if COUNT["backward"] > passes:  # it trained (a resume of a finished run stops before any batch)
                COUNT["trainings"].append(COUNT["recomputes"] - recomputes)

    BaseTrainer._do_train = _do_train


def write_count() -> None:
    """Leave this process's count where the test that started it reads it (nothing when not started by one)."""
    if folder := os.environ.get(COUNTS_ENV):
        (Path(folder) / f"{os.getpid()}.json").write_text(json.dumps(COUNT))


def reset() -> None:
    COUNT.update(recomputes=0, backward=0, trainings=[])


def subprocess_counts(folder: Path) -> dict:
    """What the processes started with ``folder`` as ``$ULTRALYTICS_SUITE_COUNTS`` counted, together."""
    counts = [json.loads(f.read_text()) for f in sorted(folder.glob("*.json"))]
    return {"recomputes": sum(c["recomputes"] for c in counts),
            "trainings": [n for c in counts for n in c["trainings"]]}


def main(argv: list[str]) -> int:
    """``yolo-ckpt`` with the counter, its count written however it ends."""
    install()
    from yolo_ckpt.integration.cli import main as yolo_ckpt

    sys.argv[:] = ["yolo-ckpt", *argv]
    try:
        return yolo_ckpt(argv)
    finally:
        write_count()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
