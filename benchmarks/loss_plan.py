"""What ``checkpoint_loss`` buys once the whole network is checkpointed: one step per loss plan, side by side.

One training step (``model.loss`` forward and backward) at 1024 px, batch 2, with ``--objects`` labelled objects per
image, measured with exact live tensor bytes (``measure_peak``) and timed in interleaved rounds in the same run
(``time_steps``): vanilla, and the whole network checkpointed (``checkpoint_stages=all checkpoint_layers=head``) with
each ``checkpoint_loss`` the model's task allows. Ratios are to vanilla's peak and step time; ``n/a`` where the loss
has no such plan (``yolo_ckpt.loss.LOSS_TASKS``). The whole network's step (``none``) is the "today" column.

Usage:
    python benchmarks/loss_plan.py --models yolo11n-seg.yaml yolo11n.yaml --imgsz 1024 --objects 300 --repeats 2
"""

import argparse

import torch

from yolo_ckpt.loss import LOSS_MODES, LOSS_TASKS, enable_loss_checkpointing
from yolo_ckpt.measure import build_model, measure_peak, time_steps, training_batch, with_plan


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=["yolo11n-seg.yaml", "yolo26n-sem.yaml", "yolo11n.yaml"])
    p.add_argument("--imgsz", type=int, default=1024)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--objects", type=int, default=300, help="labelled objects per image (detect, segment, pose, obb)")
    p.add_argument("--repeats", type=int, default=2, help="timed steps per plan (median)")
    a = p.parse_args()
    print(f"{a.imgsz} px, batch {a.batch}, {a.objects} objects per image; peak MiB (x vanilla), step time x vanilla")
    print("| model | vanilla MiB | " + " | ".join(f"all + head, loss {how}" for how in LOSS_MODES) + " |")
    print("|---|---|" + "---|" * len(LOSS_MODES))
    for name in a.models:
        torch.manual_seed(0)
        model = build_model(name)
        data = training_batch(model, a.imgsz, a.batch, a.objects)
        plans = [model]
        for how in LOSS_MODES:
            if how == "none" or model.args.task in LOSS_TASKS[how]:
                m = with_plan(model, "all", "full", "head")
                enable_loss_checkpointing(m, how)
                plans.append(m)
            else:
                plans.append(None)
        peaks = [measure_peak(m, data).peak if m is not None else None for m in plans]
        ran = [m for m in plans if m is not None]
        times = iter(time_steps(ran, data, a.repeats))
        times = [next(times) if m is not None else None for m in plans]
        cells = [f"{pk / 2**20:.0f} ({pk / peaks[0]:.3f}x), {t / times[0]:.2f}x time" if pk is not None else "n/a"
                 for pk, t in zip(peaks[1:], times[1:])]
        print(f"| {name} | {peaks[0] / 2**20:.0f} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
