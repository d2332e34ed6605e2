"""What the whole network checkpointed still keeps: where its step peaks, and what the bytes at that moment are.

One training step (``model.loss`` forward + backward, 50 boxes per image) of vanilla and of ``checkpoint_stages=all
checkpoint_layers=head`` (``full``), measured side by side with exact live tensor bytes: the vanilla peak; for the
checkpointed step the bytes kept after the forward (region inputs, the head outputs the loss reads), the peak of the
loss, the backward peak and the layer running when it happened (a recompute runs layer forwards inside backward), and
the model's gradients, which no plan changes; then the same with one region per layer instead of merged stages.

Usage:
    python benchmarks/whole_network.py --model yolo11n.yaml --imgsz 640 --batch 4
"""

import argparse

from yolo_ckpt.measure import build_model, training_batch, with_plan
from yolo_ckpt.memory import LiveTensorTracker
from yolo_ckpt.stages import CheckpointPlan, model_stages


class Where(LiveTensorTracker):
    """A tracker that remembers the layer and phase of its high-water mark."""

    layer, phase, at = None, "forward", None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if self.current >= self.peak:
            self.at = (self.phase, self.layer, str(func))
        return out


def step(model, data) -> dict:
    tracker = Where()
    hooks = [m.register_forward_pre_hook(lambda m, a: setattr(tracker, "layer", f"{m.i} {type(m).__name__}"))
             for m in model.model]
    model.zero_grad(set_to_none=True)
    with tracker:
        preds = model(data["img"])
        kept = tracker.current
        tracker.phase, tracker.layer = "loss", None
        loss = model.loss(data, preds)[0].sum()
        del preds  # as in model.loss(batch): the head's outputs live on only where the loss saved them
        loss_peak = tracker.peak
        tracker.phase = "backward"
        loss.backward()
        del loss
    for h in hooks:
        h.remove()
    grads = sum(p.grad.untyped_storage().nbytes() for p in model.parameters() if p.grad is not None)
    model.zero_grad(set_to_none=True)
    return {"peak": tracker.peak, "kept after forward": kept, "peak until backward": loss_peak,
            "parameter gradients": grads, "at": tracker.at}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="yolo11n.yaml")
    p.add_argument("--imgsz", type=int, default=640)
    p.add_argument("--batch", type=int, default=4)
    a = p.parse_args()
    model = build_model(a.model)
    data = training_batch(model, a.imgsz, a.batch)
    inputs = sum(t.untyped_storage().nbytes() for t in data.values())
    plain = step(with_plan(model, []), data)
    whole = step(with_plan(model, "all", "full", "head"), data)
    mib = lambda b: f"{b / 2**20:.0f} MiB"  # noqa: E731
    print(f"{a.model} imgsz={a.imgsz} batch={a.batch}: vanilla peak {mib(plain['peak'])}, whole network "
          f"{mib(whole['peak'])} ({whole['peak'] / plain['peak']:.3f}x); the batch itself {mib(inputs)}")
    for k in ("kept after forward", "peak until backward", "parameter gradients"):
        print(f"  {k:<22} vanilla {mib(plain[k]):>9}   whole network {mib(whole[k]):>9}")
    phase, layer, op = whole["at"]
    print(f"  whole network peaks in {phase}, in layer {layer} ({op})")
    head = [r[0] for r in CheckpointPlan.from_spec(model, [], "head").layer_regions]
    backbone = max(i for layers in model_stages(model).values() for i in layers) + 1
    per_layer = [*range(backbone), *head]  # every backbone layer and every storing head layer, each its own region
    fine = step(with_plan(model, [], "full", per_layer), data)
    print(f"  one region per layer (checkpoint_layers={per_layer}): {mib(fine['peak'])} "
          f"({fine['peak'] / plain['peak']:.3f}x), peaks in {fine['at'][0]}, in layer {fine['at'][1]}")


if __name__ == "__main__":
    main()
