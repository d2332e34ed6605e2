"""Memory decisions on a simulated GPU: the cases of the issue about planning that fits the device it plans for.

Usage:
    python benchmarks/simulated_device.py auto      # auto, yolo11n 640 batch 4, memory_budget=925MB, a 925 MiB device
    python benchmarks/simulated_device.py budget    # batch=-1 memory_budget=4GB on a 1.5 GB device vs unlimited
    python benchmarks/simulated_device.py escalate  # [2,3] at batch 4 on a device of 0.6x vanilla's epoch peak

Each prints what planning chose, whether anything ran out of memory, and the simulated device's peaks (exact live
tensor bytes): for ``auto`` the planning phase (from the start of training to its first epoch, the training model
included) and the epoch. CPU times: ``auto`` and ``budget`` a few minutes each at 640 px, ``escalate`` three runs.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import yaml

from yolo_ckpt import YOLO
from yolo_ckpt.autobatch import parse_memory, plan_batch
from yolo_ckpt.device import SimulatedDevice, simulated_device
from yolo_ckpt.measure import build_model, planned_copy
from yolo_ckpt.synthetic import synthetic_dataset

RUN = dict(epochs=1, workers=0, device="cpu", plots=False, val=False, deterministic=True, seed=0)
KEYS = ("checkpoint_stages", "checkpoint_layers", "checkpoint_mode")


def train(project: str, name: str, **kw) -> dict:
    """One run on the embedded dataset; the simulated device's peak until the first epoch and in it."""
    seen = {}

    def planning_peak(trainer):  # planning (AutoBatch, auto) ends before the first epoch
        seen.setdefault("planning", simulated_device().peak)

    model = YOLO("yolo11n.yaml")
    model.add_callback("on_train_start", planning_peak)
    model.train(data=str(synthetic_dataset("detect")), project=project, name=name, exist_ok=True, **RUN, **kw)
    t = model.trainer
    save = Path(t.save_dir)
    args = yaml.safe_load((save / "args.yaml").read_text())
    rows = (save / "results.csv").read_text().splitlines()
    epoch = dict(zip([c.strip() for c in rows[0].split(",")], rows[1].split(",")))["mem/peak_tensor_GB"]
    return {"batch": t.batch_size, "plan": {k: args[k] for k in KEYS}, "planning_GB": seen.get("planning", 0) / 2**30,
            "epoch_GB": float(epoch), "target_GB": (t.memory_target or 0) / 2**30}


def auto(project: str) -> None:
    r = train(project, "auto", imgsz=640, batch=4, checkpoint_stages="auto", memory_budget="925MB",
              simulate_gpu="925MB")
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


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("case", choices=["auto", "budget", "escalate"])
    p.add_argument("--project", default="runs/simulated_device")
    a = p.parse_args()
    {"auto": auto, "budget": budget, "escalate": escalate}[a.case](a.project)
    sys.exit(0)
