"""Wall-time overhead of LiveTensorTracker on one YOLO11n training step on CPU.

A step is forward of ``DetectionModel("yolo11n.yaml", nc=4)`` (train mode) on a
random ``(batch, 3, imgsz, imgsz)`` input, ``sum`` of every output tensor,
``backward()``, and dropping the gradients. Plain and tracked steps are
interleaved so drift (thermal, other load) hits both alike; the median of each
is reported side by side.

Usage:
    python benchmarks/tracker_overhead.py [--threads 2] [--repeats 7] [--imgsz 320] [--batch 2]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch.utils._pytree import tree_leaves

from yolo_ckpt.memory import GB, LiveTensorTracker


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--imgsz", type=int, default=320)
    p.add_argument("--batch", type=int, default=2)
    args = p.parse_args()

    from ultralytics.nn.tasks import DetectionModel

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = DetectionModel("yolo11n.yaml", nc=4, verbose=False).train()
    x = torch.randn(args.batch, 3, args.imgsz, args.imgsz)

    def step() -> None:
        out = model(x)
        loss = sum(t.float().sum() for t in tree_leaves(out) if isinstance(t, torch.Tensor))
        loss.backward()
        model.zero_grad(set_to_none=True)

    tracker = LiveTensorTracker()

    def tracked_step() -> None:
        with tracker:
            step()

    def timed(fn) -> float:
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    step(), tracked_step()  # warm-up (allocator, oneDNN primitive caches)
    plain, tracked = [], []
    for _ in range(args.repeats):
        plain.append(timed(step))
        tracker.reset_peak()
        tracked.append(timed(tracked_step))

    mp, mt = statistics.median(plain), statistics.median(tracked)
    print(
        f"torch {torch.__version__}, threads={torch.get_num_threads()}, yolo11n nc=4, "
        f"input {tuple(x.shape)}, repeats={args.repeats}, ops/step={tracker.num_ops // (args.repeats + 1)}"
    )
    print(f"{'':8s} {'median s':>9s} {'min s':>8s} {'max s':>8s}")
    print(f"{'plain':8s} {mp:9.4f} {min(plain):8.4f} {max(plain):8.4f}")
    print(f"{'tracked':8s} {mt:9.4f} {min(tracked):8.4f} {max(tracked):8.4f}")
    print(f"overhead ratio tracked/plain (median): {mt / mp:.3f}")
    print(f"tracked peak of one step: {tracker.peak / GB:.4f} GB ({tracker.peak} B), live after: {tracker.current} B")


if __name__ == "__main__":
    main()
