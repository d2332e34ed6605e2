"""Exact peak memory of ``memory_budget`` planning itself, next to the share it plans for.

Runs docs/planning.md's budget example — yolo11n, all stages, ``batch=-1 memory_budget=2GB``, 640 px, the embedded
dataset — and tracks every live tensor byte (the training model's own weights included) while Ultralytics' trainer
runs AutoBatch; then prints the batch and the exact peak of the epoch at that batch (results.csv).

Usage:
    python benchmarks/planning_peak.py
    python benchmarks/planning_peak.py --imgsz 320 --budget 400MB --stages "[2,3]"
"""

import argparse
import ast
import tempfile
from pathlib import Path

from ultralytics.utils.torch_utils import unwrap_model

from yolo_ckpt import YOLO, DetectionTrainer
from yolo_ckpt.data.synthetic import synthetic_dataset
from yolo_ckpt.memory.tracker import LiveTensorTracker
from yolo_ckpt.planning.autobatch import parse_memory


class TrackedPlanning(DetectionTrainer):
    """Our trainer with an exact tracker around AutoBatch."""

    def auto_batch(self):
        model = unwrap_model(self.model)
        with LiveTensorTracker() as tracker:
            tracker.track([*model.parameters(), *model.buffers()])
            batch = super().auto_batch()
        self.planning_peak = tracker.peak
        return batch


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="yolo11n.yaml")
    p.add_argument("--imgsz", type=int, default=640)
    p.add_argument("--budget", default="2GB")
    p.add_argument("--fraction", type=float, default=-1, help="batch: -1 (60%%) or a fraction")
    p.add_argument("--stages", default="all")
    a = p.parse_args()
    stages = a.stages if a.stages == "all" else ast.literal_eval(a.stages)
    model = YOLO(a.model)
    model.train(trainer=TrackedPlanning, data=str(synthetic_dataset("detect")), checkpoint_stages=stages,
                memory_budget=a.budget, batch=a.fraction, imgsz=a.imgsz, epochs=1, workers=0, device="cpu",
                plots=False, val=False, project=tempfile.mkdtemp(prefix="planning_peak_"))
    share = (0.6 if a.fraction == -1 else a.fraction) * parse_memory(a.budget)
    peak = model.trainer.planning_peak
    rows = (Path(model.trainer.save_dir) / "results.csv").read_text().splitlines()
    epoch = dict(zip([c.strip() for c in rows[0].split(",")], rows[1].split(",")))["mem/peak_tensor_GB"]
    print(f"\nplanning peak {peak / 2**30:.3f} GB of a {share / 2**30:.3f} GB share ({peak / share:.2f}x), "
          f"batch {model.trainer.batch_size} ({model.trainer.run_memory.batch_without} without checkpointing); the "
          f"epoch at that batch peaked at {float(epoch):.3f} GB")


if __name__ == "__main__":
    main()
