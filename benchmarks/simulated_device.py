"""Memory decisions on a simulated GPU: the cases of the issue about planning that fits the device it plans for.

Usage:
    python benchmarks/simulated_device.py auto      # auto, yolo11n 640 batch 4, memory_budget=925MB, a 925 MiB device
    python benchmarks/simulated_device.py budget    # batch=-1 memory_budget=4GB on a 1.5 GB device vs unlimited
    python benchmarks/simulated_device.py escalate  # [2,3] at batch 4 on a device of 0.6x vanilla's epoch peak
    python benchmarks/simulated_device.py third     # auto, yolo11n 640 batch 4, a share of 0.33x vanilla's step
    python benchmarks/simulated_device.py third --imgsz 160 --share 0.5   # the same at another size and share

Each prints what planning chose, whether anything ran out of memory, and the simulated device's peaks (exact live
tensor bytes): for ``auto`` and ``third`` the planning phase (from the start of training to its first epoch, the
training model included) and the epoch, and auto's trade-off table (predicted and measured step time and memory,
FLOPs). CPU times: ``auto``, ``third`` and ``budget`` a few minutes each at 640 px, ``escalate`` three runs.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

import yaml
from ultralytics.utils import LOGGER

from yolo_ckpt import YOLO
from yolo_ckpt.autobatch import parse_memory, plan_batch
from yolo_ckpt.device import SimulatedDevice, simulated_device
from yolo_ckpt.measure import build_model, planned_copy, step_bytes
from yolo_ckpt.stages import CheckpointConfigError
from yolo_ckpt.synthetic import synthetic_dataset

RUN = dict(epochs=1, workers=0, device="cpu", plots=False, val=False, deterministic=True, seed=0)
KEYS = ("checkpoint_stages", "checkpoint_layers", "checkpoint_mode")


class _AutoLines(logging.Handler):
    """Keeps auto's log lines: its trade-off table and its choice."""

    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if " auto" in (msg := record.getMessage()) or "<- chosen" in msg or "predicted s" in msg:
            self.lines.append(msg)


def train(project: str, name: str, **kw) -> dict:
    """One run on the embedded dataset; the simulated device's peak until the first epoch and in it, auto's lines."""
    seen = {}

    def planning_peak(trainer):  # planning (AutoBatch, auto) ends before the first epoch
        seen.setdefault("planning", simulated_device().peak)

    model = YOLO("yolo11n.yaml")
    model.add_callback("on_train_start", planning_peak)
    log = _AutoLines()
    LOGGER.addHandler(log)
    try:
        model.train(data=str(synthetic_dataset("detect")), project=project, name=name, exist_ok=True, **RUN, **kw)
    finally:
        LOGGER.removeHandler(log)
    t = model.trainer
    save = Path(t.save_dir)
    args = yaml.safe_load((save / "args.yaml").read_text())
    rows = (save / "results.csv").read_text().splitlines()
    epoch = dict(zip([c.strip() for c in rows[0].split(",")], rows[1].split(",")))["mem/peak_tensor_GB"]
    return {"batch": t.batch_size, "plan": {k: args[k] for k in KEYS}, "planning_GB": seen.get("planning", 0) / 2**30,
            "epoch_GB": float(epoch), "target_GB": (t.memory_target or 0) / 2**30, "auto": log.lines}


def auto(project: str) -> None:
    r = train(project, "auto", imgsz=640, batch=4, checkpoint_stages="auto", memory_budget="925MB",
              simulate_gpu="925MB")
    print("\n".join(r["auto"]))
    print(f"auto on a 925 MiB device: batch {r['batch']}, plan {r['plan']}, share {r['target_GB']:.3f} GB, planning "
          f"peak {r['planning_GB']:.3f} GB, epoch peak {r['epoch_GB']:.3f} GB (device {925 / 1024:.3f} GB)")


def budget(project: str) -> None:
    model = build_model("yolo11n.yaml")
    with planned_copy(model, "all") as m:
        unlimited = plan_batch(m, 640, parse_memory("4GB"), 0.6)
        with SimulatedDevice(parse_memory("1.5GB")) as gpu:
            gpu.track([*m.parameters(), *m.buffers()])
            small = plan_batch(m, 640, parse_memory("4GB"), 0.6)
    print(f"memory_budget=4GB, all stages, 640 px: unlimited device batch {unlimited.batch} (measured "
          f"{sorted(unlimited.points)}); 1.5 GB device batch {small.batch} (extrapolated={small.extrapolated} from "
          f"{sorted(small.points)}, device peak {gpu.peak / 2**30:.3f} GB); ratio {small.batch / unlimited.batch:.3f}")


def escalate(project: str) -> None:
    plain = train(project, "plain", imgsz=320, batch=4, checkpoint_stages=[], simulate_gpu="64GB")
    device = int(0.6 * plain["epoch_GB"] * 2**30)
    r = train(project, "escalated", imgsz=320, batch=4, checkpoint_stages=[2, 3], simulate_gpu=f"{device}B")
    print(f"[2,3] batch 4 on {device / 2**30:.3f} GB (0.6x vanilla's epoch peak {plain['epoch_GB']:.3f} GB): trained "
          f"at batch {r['batch']} with {r['plan']}, epoch peak {r['epoch_GB']:.3f} GB")


def third(project: str, imgsz: int = 640, share: float = 0.33) -> None:
    """auto asked for a third (``share``) of vanilla's step (model state, batch and exact peak, as planning counts
    it, with the dataset's objects per image as the trainer counts them): memory_budget so that its 60% share is
    0.33x that, on a simulated device of memory_budget, so that planning too runs within the device."""
    data = synthetic_dataset("detect")
    labels = data.parent / "labels" / "train"
    objects = 4 * max(len(f.read_text().splitlines()) for f in labels.glob("*.txt"))  # mosaic, as the trainer counts
    vanilla = step_bytes(build_model("yolo11n.yaml"), imgsz, 4, objects)
    budget = int(share * vanilla / 0.6)
    print(f"vanilla step {vanilla / 2**30:.3f} GB (yolo11n {imgsz} batch 4, {objects} objects per image); "
          f"memory_budget={budget}B: share {0.6 * budget / 2**30:.3f} GB = {0.6 * budget / vanilla:.3f}x")
    try:
        r = train(project, "third", imgsz=imgsz, batch=4, checkpoint_stages="auto", memory_budget=f"{budget}B",
                  simulate_gpu=f"{budget}B")
    except CheckpointConfigError as e:  # nothing in auto's space fits the share: its one line says what would
        print(f"auto at {share}x: {e}")
        return
    print("\n".join(r["auto"]))
    print(f"auto at {share}x: batch {r['batch']}, plan {r['plan']}, share {r['target_GB']:.3f} GB, planning peak "
          f"{r['planning_GB']:.3f} GB ({r['planning_GB'] * 2**30 / vanilla:.3f}x), epoch peak {r['epoch_GB']:.3f} GB "
          f"({r['epoch_GB'] * 2**30 / vanilla:.3f}x)")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("case", choices=["auto", "budget", "escalate", "third"])
    p.add_argument("--project", default="runs/simulated_device")
    p.add_argument("--imgsz", type=int, default=640, help="third: image size")
    p.add_argument("--share", type=float, default=0.33, help="third: the share of vanilla's step")
    a = p.parse_args()
    if a.case == "third":
        third(a.project, a.imgsz, a.share)
    else:
        {"auto": auto, "budget": budget, "escalate": escalate}[a.case](a.project)
    sys.exit(0)
