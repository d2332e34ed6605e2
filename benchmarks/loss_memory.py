"""How much of a training step's memory the loss itself takes (semantic segmentation, depth, any task, RT-DETR).

The semantic loss upsamples its logits to the mask's full resolution (batch x classes x imgsz x imgsz, then softmax,
cross-entropy and Dice on every pixel) and the depth loss runs a four-scale gradient-matching term on full-resolution
log-depth maps: at 1024-2048 px these are large, and no checkpoint plan touches them. Measured with exact live tensor
bytes (``LiveTensorTracker``), one training step at a time:

- the step as planning measures it (``yolo_ckpt.memory.step.measure_peak``: ``model.loss`` forward and backward, the
  loss included), vanilla and with the whole network checkpointed;
- the loss alone: its forward and its backward into the head's outputs (detached leaves), on top of nothing else;
  also with ``checkpoint_loss=chunked`` where the task has it;
- the whole-network step's network alone: its forward, then its backward from the head's outputs with the loss's
  gradients, the loss computed between them on detached outputs and left out of the peak. That is the least any loss
  plan (``checkpoint_loss``) can bring the step to: where it equals the step, no loss plan lowers it.

Usage:
    python benchmarks/loss_memory.py --models yolo26n-sem.yaml yolo26n-depth.yaml --imgsz 1024 --batch 4
"""

import argparse

import torch

from yolo_ckpt.memory.step import StepShape, build_model, measure_peak, training_batch, with_plan
from yolo_ckpt.memory.tracker import LiveTensorTracker
from yolo_ckpt.regions.loss.install import LOSS_TASKS, enable_loss_checkpointing
from yolo_ckpt.regions.settings import PlanSettings


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


def network_alone(model, data) -> int:
    """Peak live tensor bytes of a training step's network: the forward, then the backward from the head's outputs
    with the gradients the loss gives them (the loss run in between on detached outputs, its own bytes not counted)."""
    model.zero_grad(set_to_none=True)
    with LiveTensorTracker() as tracker:
        preds = model(data["img"])
        forward = tracker.peak
        leaves = torch.utils._pytree.tree_map_only(torch.Tensor, lambda t: t.detach().requires_grad_(t.requires_grad),
                                                   preds)
        loss, _ = model.loss(data, leaves)
        loss.sum().backward()
        del loss
        # backward of sum(output * its gradient) hands each output exactly its gradient; its graph keeps only the
        # gradients, as the loss's graph keeps what its backward reads, so outputs free as the real step frees them
        surrogate = sum((p * q.grad).sum() for p, q in zip(torch.utils._pytree.tree_leaves(preds),
                                                           torch.utils._pytree.tree_leaves(leaves))
                        if isinstance(p, torch.Tensor) and q.grad is not None)
        del leaves, preds
        tracker.reset_peak()  # from here: the network's backward
        surrogate.backward()
        del surrogate
        backward = tracker.peak
    model.zero_grad(set_to_none=True)
    return max(forward, backward)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=["yolo26n-sem.yaml", "yolo26n-depth.yaml"])
    p.add_argument("--imgsz", nargs="+", type=int, default=[1024])
    p.add_argument("--batch", type=int, default=4)
    a = p.parse_args()
    print("| model | imgsz | batch | step peak MiB (vanilla) | loss alone MiB | share | step peak MiB (all + head) "
          "| loss alone / that | network alone MiB (all + head) | loss alone, chunked MiB |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name in a.models:
        model = build_model(name)
        for imgsz in a.imgsz:
            data = training_batch(model, StepShape(imgsz, a.batch))
            vanilla = measure_peak(model, data).peak
            checkpointed = with_plan(model, PlanSettings.of("all", "full", "head"))
            whole = measure_peak(checkpointed, data).peak
            network = network_alone(checkpointed, data)
            alone = loss_alone(model, data)
            chunked = "n/a"
            if model.args.task in LOSS_TASKS["chunked"] and "rtdetr" not in name:
                enable_loss_checkpointing(model, "chunked")
                chunked = f"{loss_alone(model, data) / 2**20:.0f}"
                enable_loss_checkpointing(model, "none")
            print(f"| {name} | {imgsz} | {a.batch} | {vanilla / 2**20:.0f} | {alone / 2**20:.0f} | "
                  f"{alone / vanilla:.3f} | {whole / 2**20:.0f} | {alone / whole:.3f} | {network / 2**20:.0f} | "
                  f"{chunked} |", flush=True)


if __name__ == "__main__":
    main()
