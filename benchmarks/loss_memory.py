"""How much of a training step's memory the loss itself takes (semantic segmentation, depth, any task, RT-DETR).

The semantic loss upsamples its logits to the mask's full resolution (batch x classes x imgsz x imgsz, then softmax,
cross-entropy and Dice on every pixel) and the depth loss runs a four-scale gradient-matching term on full-resolution
log-depth maps: at 1024-2048 px these are large, and no checkpoint plan touches them. Measured with exact live tensor
bytes (``LiveTensorTracker``), one training step at a time:

- the step as planning measures it (``yolo_ckpt.measure.measure_peak``: ``model.loss`` forward and backward, the
  loss included), vanilla and with the whole network checkpointed;
- the loss alone: its forward and its backward into the head's outputs (detached leaves), on top of nothing else;
- where the whole-network step peaks (``planner.step_phases``): its forward with the loss, and its backward from the
  moment it reaches the head's output, after the loss's backward. A loss plan (``checkpoint_loss``) lowers what the
  loss holds from its forward to its backward; where the step peaks after that, no loss plan can lower the step.

Usage:
    python benchmarks/loss_memory.py --models yolo26n-sem.yaml yolo26n-depth.yaml --imgsz 1024 --batch 4
"""

import argparse

import torch

from yolo_ckpt.measure import build_model, measure_peak, training_batch, with_plan
from yolo_ckpt.memory import LiveTensorTracker
from yolo_ckpt.planner import step_phases


def loss_alone(model, data) -> int:
    """Peak live tensor bytes of the criterion's forward and backward on the head's outputs (made outside)."""
    with torch.no_grad():
        preds = model(data["img"])
    leaves = torch.utils._pytree.tree_map_only(torch.Tensor, lambda t: t.detach().requires_grad_(), preds)
    with LiveTensorTracker() as tracker:  # the model's own loss on given predictions: its targets, its criterion
        loss, _ = model.loss(data, leaves)
        loss.sum().backward()
        del loss
    return tracker.peak


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=["yolo26n-sem.yaml", "yolo26n-depth.yaml"])
    p.add_argument("--imgsz", nargs="+", type=int, default=[1024])
    p.add_argument("--batch", type=int, default=4)
    a = p.parse_args()
    print("| model | imgsz | batch | step peak MiB (vanilla) | loss alone MiB | share | step peak MiB (all + head) "
          "| loss alone / that | forward + loss MiB (all + head) | backward after the loss MiB (all + head) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name in a.models:
        model = build_model(name)
        for imgsz in a.imgsz:
            data = training_batch(model, imgsz, a.batch)
            vanilla = measure_peak(model, data).peak
            checkpointed = with_plan(model, "all", "full", "head")
            whole = measure_peak(checkpointed, data).peak
            phases = step_phases(checkpointed, data, last=len(model.model) - 1)
            alone = loss_alone(model, data)
            print(f"| {name} | {imgsz} | {a.batch} | {vanilla / 2**20:.0f} | {alone / 2**20:.0f} | "
                  f"{alone / vanilla:.3f} | {whole / 2**20:.0f} | {alone / whole:.3f} | {phases.forward / 2**20:.0f} | "
                  f"{phases.window / 2**20:.0f} |", flush=True)


if __name__ == "__main__":
    main()
