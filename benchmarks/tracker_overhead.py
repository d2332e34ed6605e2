"""Wall-time overhead of LiveTensorTracker on one YOLO11n training step on CPU.

A step is forward of ``DetectionModel("yolo11n.yaml", nc=4)`` (train mode) on a
random ``(batch, 3, imgsz, imgsz)`` input, ``sum`` of every output tensor,
``backward()``, and dropping the gradients. With ``--loss`` the step is the real
training loss instead: ``model.loss(batch)`` (v8DetectionLoss with the
task-aligned assigner, 3 boxes per image) then ``loss.sum().backward()``. Plain and tracked steps are
interleaved so drift (thermal, other load) hits both alike; the median of each
is reported side by side. A third column runs an empty ``TorchDispatchMode``
(only ``func(*args, **kwargs)``) to show how much of the overhead any Python
dispatch mode costs and how much is the tracker's own bookkeeping.

Usage:
    python benchmarks/tracker_overhead.py [--threads 2] [--repeats 7] [--imgsz 320] [--batch 2]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from yolo_ckpt.memory.tracker import GB, LiveTensorTracker


class _EmptyMode(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--imgsz", type=int, default=320)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--loss", action="store_true", help="step = model.loss(batch) instead of sum(outputs)")
    args = p.parse_args()

    from ultralytics.nn.tasks import DetectionModel

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = DetectionModel("yolo11n.yaml", nc=4, verbose=False).train()
    x = torch.randn(args.batch, 3, args.imgsz, args.imgsz)
    if args.loss:
        from ultralytics.cfg import get_cfg

        model.args = get_cfg()  # loss hyper-parameters (box, cls, dfl gains)
        n = 3  # boxes per image
        batch = {
            "img": torch.rand(args.batch, 3, args.imgsz, args.imgsz),
            "batch_idx": torch.arange(args.batch).repeat_interleave(n).float(),
            "cls": torch.randint(0, 4, (args.batch * n, 1)).float(),
            "bboxes": torch.rand(args.batch * n, 4) * 0.4 + torch.tensor([0.3, 0.3, 0.05, 0.05]),
        }

    def step() -> None:
        if args.loss:
            loss = model.loss(batch)[0].sum()
        else:
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

    def empty_mode_step() -> None:
        with _EmptyMode():
            step()

    step(), tracked_step(), empty_mode_step()  # warm-up (allocator, oneDNN primitive caches)
    plain, tracked, empty = [], [], []
    for _ in range(args.repeats):
        plain.append(timed(step))
        tracker.reset_peak()
        tracked.append(timed(tracked_step))
        empty.append(timed(empty_mode_step))

    mp, mt, me = statistics.median(plain), statistics.median(tracked), statistics.median(empty)
    print(
        f"torch {torch.__version__}, threads={torch.get_num_threads()}, yolo11n nc=4, "
        f"input {tuple(x.shape)}, step={'model.loss(batch)' if args.loss else 'sum(outputs)'}, "
        f"repeats={args.repeats}, ops/step={tracker.num_ops // (args.repeats + 1)}"
    )
    print(f"{'':10s} {'median s':>9s} {'min s':>8s} {'max s':>8s}")
    for name, ts in (("plain", plain), ("tracked", tracked), ("empty mode", empty)):
        print(f"{name:10s} {statistics.median(ts):9.4f} {min(ts):8.4f} {max(ts):8.4f}")
    print(f"overhead ratio tracked/plain (median): {mt / mp:.3f}   (empty dispatch mode/plain: {me / mp:.3f})")
    print(f"tracked peak of one step: {tracker.peak / GB:.4f} GB ({tracker.peak} B), live after: {tracker.current} B")


if __name__ == "__main__":
    main()
