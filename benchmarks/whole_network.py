"""What the whole network checkpointed still keeps: where its step peaks, and what the bytes at that moment are.

One training step (``model.loss`` forward + backward, 50 boxes per image) per plan, measured side by side with exact
live tensor bytes and FLOPs: vanilla; ``checkpoint_stages=all checkpoint_layers=head`` (whole layers, ``full``); one
region per layer; and ``THIRD``, the plan with regions inside layers nested in the stage regions. For each: the peak
as a ratio to vanilla, the FLOPs ratio, the phase and layer of the peak, and what is alive at that moment by where
it was made — kept from the forward (region inputs, boundaries), made by the loss, made in backward by a recompute
(its working set) or by the gradient computation (activation gradients in flight and the weights' gradients).

Usage:
    python benchmarks/whole_network.py --model yolo11n.yaml --imgsz 640 --batch 4
"""

import argparse

from yolo_ckpt.memory.step import StepShape, build_model, step_flops, training_batch, with_plan
from yolo_ckpt.memory.tracker import LiveTensorTracker
from yolo_ckpt.regions.graph import model_stages
from yolo_ckpt.regions.settings import PlanSettings

THIRD = PlanSettings.of([1, 2, 3, 4], "full", ["2.*", "4.*", "7-10:selective", "16", "19", "23", "23.*"])
"""A third of vanilla's peak for yolo11n-style models (P5 detect: layers 2/4 are the stride-4/8 C3k2, 7-10 the P5
stage, 16/19 the neck's C3k2 at P3/P4, 23 Detect): stages 1-4 full with each part of layers 2 and 4 nested (their
recompute never holds a whole C3k2), the small P5 stage selective, the neck's P3/P4 C3k2 and Detect as regions with
Detect's branches each their own (a recompute holds one branch at one scale, not three scales at once)."""
TARGET = 0.30  # the target: at most this share of vanilla's peak ...
FLOPS_TARGET = 1.33  # ... at most this many times vanilla's FLOPs


class Where(LiveTensorTracker):
    """A tracker that remembers the layer and phase of its high-water mark, and what was alive then by the phase
    that made it: ``recompute`` from a layer's start inside backward to the next gradient op, ``gradients`` else."""

    layer, phase, at = None, "forward", None
    running = 0  # 1 from a layer's start (a recompute, in backward) to the next gradient op

    def __init__(self):
        super().__init__()
        self.made: dict[int, str] = {}
        self.alive: dict[str, int] = {}

    def where(self) -> str:
        if self.phase == "backward":
            return "recompute" if self.running else "gradients"
        return self.phase

    def _add(self, st):
        super()._add(st)
        self.made[st._cdata] = self.where()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if "backward" in str(func):  # a gradient op: any recompute before it is over (its last layer may not end)
            self.running = 0
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if self.current >= self.peak:
            self.at = (self.phase, self.layer, str(func))
            alive: dict[str, int] = {}
            for key, (nbytes, _) in self._live.items():
                alive[self.made.get(key, "before")] = alive.get(self.made.get(key, "before"), 0) + nbytes
            self.alive = alive
        return out


def step(model, data) -> dict:
    tracker = Where()

    def enter(m, a):
        tracker.layer, tracker.running = f"{m.i} {type(m).__name__}", 1

    hooks = [m.register_forward_pre_hook(enter) for m in model.model]
    model.zero_grad(set_to_none=True)
    with tracker:
        preds = model(data["img"])
        kept = tracker.current
        tracker.phase, tracker.layer, tracker.running = "loss", None, 0
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
            "parameter gradients": grads, "at": tracker.at, "alive": tracker.alive, "flops": step_flops(model, data)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="yolo11n.yaml")
    p.add_argument("--imgsz", type=int, default=640)
    p.add_argument("--batch", type=int, default=4)
    a = p.parse_args()
    model = build_model(a.model)
    data = training_batch(model, StepShape(a.imgsz, a.batch))
    inputs = sum(t.untyped_storage().nbytes() for t in data.values())
    mib = lambda b: f"{b / 2**20:.0f} MiB"  # noqa: E731
    plain = step(with_plan(model, PlanSettings.of([])), data)
    print(f"{a.model} imgsz={a.imgsz} batch={a.batch}: vanilla peak {mib(plain['peak'])}, the batch itself "
          f"{mib(inputs)}, parameter gradients {mib(plain['parameter gradients'])}")
    head = [r[0] for r in PlanSettings.of(layers="head").resolve(model).layer_regions]
    backbone = max(i for layers in model_stages(model).values() for i in layers) + 1
    per_layer = [*range(backbone), *head]  # every backbone layer and every storing head layer, each its own region
    plans = {"whole network (all + head)": PlanSettings.of("all", "full", "head"),
             "one region per layer": PlanSettings.of([], "full", per_layer), "parts nested (THIRD)": THIRD}
    for name, settings in plans.items():
        r = step(with_plan(model, settings), data)
        ratio, flops = r["peak"] / plain["peak"], r["flops"] / plain["flops"]
        phase, layer, op = r["at"]
        keys = settings.keys()
        print(f"\n{name}: checkpoint_stages={keys['checkpoint_stages']} checkpoint_mode={keys['checkpoint_mode']} "
              f"checkpoint_layers={keys['checkpoint_layers']}")
        print(f"  peak {mib(r['peak'])} ({ratio:.3f}x vanilla) at {flops:.3f}x the FLOPs; kept after forward "
              f"{mib(r['kept after forward'])} (vanilla {mib(plain['kept after forward'])}); peaks in {phase}, "
              f"layer {layer} ({op})")
        print("  alive at the peak, by what made it: " + ", ".join(
            f"{k} {mib(v)}" for k, v in sorted(r["alive"].items(), key=lambda kv: -kv[1])))
        if name.endswith("(THIRD)"):
            met = ratio <= TARGET and flops <= FLOPS_TARGET
            print(f"  target <= {TARGET}x peak at <= {FLOPS_TARGET}x FLOPs: {'met' if met else 'NOT met'}"
                  + ("" if met else f"; the peak is {mib(r['peak'] - TARGET * plain['peak'])} over it"))


if __name__ == "__main__":
    main()
