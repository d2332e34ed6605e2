"""How close a checkpointed compiled training step is to compiled vanilla's: gradients and BatchNorm buffers, tensor by
tensor, side by side in one run.

Each case is one training step as Ultralytics' ``compile=True`` runs it (``torch.compile(model, backend=...)``, the
criterion outside the graph), from the same weights, BatchNorm buffers and batch: compiled vanilla, then each plan
compiled. For every parameter's gradient and every BatchNorm buffer after the step it prints how many are bitwise
equal to compiled vanilla's and the largest difference relative to the tensor's largest value. docs/limitations.md's
statement on compiled exactness rests on it.

Usage:
    python benchmarks/compiled_exactness.py                          # yolo11n, 320 px, batch 2, inductor
    python benchmarks/compiled_exactness.py --backend aot_eager      # the traced graph alone (no fusion)
"""

from __future__ import annotations

import argparse

import torch
from compiled_memory import plan_settings
from torch import nn

from yolo_ckpt.memory.step import StepShape, build_model, training_batch, with_plan
from yolo_ckpt.regions.install import disable_checkpointing
from yolo_ckpt.regions.settings import PlanSettings

PLANS = ("all+head", "least-stem")


def compiled_state(base: nn.Module, settings: PlanSettings | None, batch: dict, backend: str) -> dict:
    """One compiled step of a copy of ``base`` with ``settings``: its gradients and buffers afterwards, by name."""
    model = with_plan(base, settings or PlanSettings(loss="none"))
    torch._dynamo.reset()
    try:
        forward = torch.compile(model, mode="default", backend=backend)
        model.zero_grad(set_to_none=True)
        loss, _ = model.loss(batch, forward(batch["img"]))
        loss.sum().backward()
        out = {f"grad {k}": p.grad.detach().clone() for k, p in model.named_parameters() if p.grad is not None}
        out.update({f"buffer {k}": b.detach().clone() for k, b in model.named_buffers() if b.is_floating_point()})
    finally:
        disable_checkpointing(model)
        torch._dynamo.reset()
    return out


def compare(got: dict, ref: dict) -> tuple[int, int, float, str]:
    """Tensors compared, bitwise equal, and the largest difference relative to its tensor's largest value (where)."""
    equal, worst, where = 0, 0.0, "-"
    for k, r in ref.items():
        g = got[k]
        if torch.equal(g, r):
            equal += 1
            continue
        rel = ((g - r).abs().max() / r.abs().max().clamp_min(1e-30)).item()
        if rel > worst:
            worst, where = rel, k
    return len(ref), equal, worst, where


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="yolo11n.yaml")
    p.add_argument("--imgsz", type=int, default=320)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--backend", default="inductor")
    p.add_argument("--cases", nargs="+", default=list(PLANS), choices=PLANS)
    a = p.parse_args()
    torch.manual_seed(0)
    base = build_model(a.model)
    batch = training_batch(base, StepShape(a.imgsz, a.batch, 50))
    ref = compiled_state(base, None, batch, a.backend)
    print(f"{a.model}, {a.imgsz} px, batch {a.batch}, backend {a.backend}: each plan against compiled vanilla")
    print(f"{'plan':<14}{'tensors':>9}{'bitwise':>9}{'max rel diff':>14}  where")
    for name in a.cases:
        n, equal, worst, where = compare(compiled_state(base, plan_settings(name, base), batch, a.backend), ref)
        print(f"{name:<14}{n:>9}{equal:>9}{worst:>14.2e}  {where}")


if __name__ == "__main__":
    main()
