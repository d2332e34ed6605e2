"""The memory table of docs/figures.md: checkpointed vs vanilla training steps, measured side by side in one run.

For each model, image size and AMP setting, one real training step (``model.loss`` forward + backward, 50 boxes per
image; the forward under autocast when AMP is on, as Ultralytics' loop) per plan — fixed plans, selective, the whole
network (all stages + ``checkpoint_layers=head``) and what ``checkpoint_stages=auto`` chooses at budgets of 50-90% of
the vanilla step's peak (``--shares``) — exact peak of live tensor bytes
(``LiveTensorTracker``), convolution/matmul FLOPs (``FlopCounterMode``, recompute included) and the median step time
on this machine's device, each as a ratio to vanilla. With CUDA, the allocator's ``max_memory_allocated`` is added
next to the exact estimate.

Usage:
    python benchmarks/memory_table.py                       # yolo11n, yolo11s at 640 and 1280, batch 4
    python benchmarks/memory_table.py --models yolo11n.yaml --imgsz 640 --batch 4 --device cpu
    python benchmarks/memory_table.py --device cuda --amp off fp16   # default on CUDA: AMP off and on
    python benchmarks/memory_table.py --models rtdetr-l.yaml --imgsz 640 --repeats 1   # RT-DETR (built by name)
    python benchmarks/memory_table.py --models rtdetr-l.yaml --shares    # fixed plans only, no auto rows
    python benchmarks/memory_table.py --models rtdetr-l.yaml --auto-only # vanilla and the auto rows only
"""

import argparse

import torch
from whole_network import THIRD

from yolo_ckpt.memory.step import StepShape, build_model, measure_peak, step_bytes, training_batch
from yolo_ckpt.planning.choice import choose_plan
from yolo_ckpt.planning.costs import unit_costs
from yolo_ckpt.planning.units import describe
from yolo_ckpt.regions.settings import PlanSettings
from yolo_ckpt.report.profiler import compare_plans

PLANS = {"none": PlanSettings(), "[2,3]": PlanSettings.of([2, 3]), "all": PlanSettings.of("all"),
         "[2,3] selective": PlanSettings.of([2, 3], "selective"), "all selective": PlanSettings.of("all", "selective"),
         "all + head": PlanSettings.of("all", "full", "head"),
         "all + head selective": PlanSettings.of("all", "selective", "head"),
         "parts nested (whole_network.THIRD)": THIRD}
SHARES = [0.5, 0.6, 0.7, 0.8, 0.9]  # auto rows: budgets as shares of the vanilla step's peak
AMP = {"off": None, "fp16": torch.float16, "bf16": torch.bfloat16}


def auto_plans(model, imgsz: int, batch: int, amp, shares: list[float]) -> dict:
    """``checkpoint_stages=auto`` at each share of the vanilla step's peak (on top of model state and the batch,
    which no plan changes): the plans it chooses, named ``auto 50%: stages [...]``."""
    costs = unit_costs(model, StepShape(imgsz, amp=amp))
    data = training_batch(model, StepShape(imgsz, batch))
    peak = measure_peak(model, data, amp).peak
    fixed = step_bytes(model, StepShape(imgsz, batch, amp=amp)) - peak
    measured = {(None, batch): (fixed + peak, fixed)}  # each plan is measured once for all shares
    plans = {}
    for share in sorted(shares, reverse=True):  # largest first: a plan that did not fit a share fits no smaller one
        try:
            c = choose_plan(model, StepShape(imgsz, batch, amp=amp), fixed + int(share * peak), costs=costs,
                            measured=measured).candidate
        except ValueError:
            plans[share] = (f"auto {share:.0%}: nothing fits", None)
            continue
        plans[share] = (f"auto {share:.0%}: {describe(c)}", c.settings.with_loss(None))
    return dict(plans[share] for share in shares)


def _key(model, settings: PlanSettings) -> tuple:
    """What a plan recomputes: its regions and mode, whichever way its settings name them."""
    plan = settings.resolve(model)
    return tuple(plan.regions), settings.mode if plan.regions else "full"


def table(models: list[str], sizes: list[int], batch: int, amps: list[str], device: str, repeats: int = 3,
          shares: list[float] = SHARES, fixed_plans: bool | tuple[str, ...] = True):
    """Yield the markdown lines of the table (header first), measuring as it goes. ``fixed_plans``: every plan of
    ``PLANS`` (True), vanilla alone (False), or vanilla and the ``PLANS`` named."""
    cuda = device.startswith("cuda")
    head = "| model | imgsz | batch | AMP | stages | peak MiB | peak ratio | FLOP ratio | step time ratio |"
    yield head + (" CUDA peak MiB | CUDA peak ratio |" if cuda else "")
    yield "|---" * (head.count("|") - 1 + 2 * cuda) + "|"
    for name in models:
        model = build_model(name).to(device)
        for imgsz in sizes:
            for amp in amps:
                auto = auto_plans(model, imgsz, batch, AMP[amp], shares) if shares else {}  # --shares: none
                names = PLANS if fixed_plans is True else ("none", *(fixed_plans or ()))  # vanilla: the base
                fixed = {k: PLANS[k] for k in names}
                plans = {**fixed, **{k: v for k, v in auto.items() if v is not None}}
                for k in (k for k, v in auto.items() if v is None):
                    yield f"| {name} | {imgsz} | {batch} | {amp} | {k} | | | | |"
                same = {k: _key(model, v) for k, v in plans.items()}  # an auto choice equal to a fixed plan: once
                unique = {}
                for k in plans:
                    unique.setdefault(same[k], k)
                rows = {r["plan"]: r for r in compare_plans(model, StepShape(imgsz, batch, amp=AMP[amp]),
                                                            {k: plans[k] for k in unique.values()}, repeats=repeats)}
                for r in ({**rows[unique[same[k]]], "plan": k} for k in plans):
                    row = (f"| {name} | {imgsz} | {batch} | {amp} | {r['plan']} | {r['peak_MiB']:.0f} "
                           f"| {r['peak_ratio']:.3f} | {r['flops_ratio']:.3f} | {r['time_ratio']:.3f} ({device}) |")
                    if cuda:
                        row += f" {r['cuda_peak_MiB']:.0f} | {r['cuda_peak_ratio']:.3f} |"
                    yield row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=["yolo11n.yaml", "yolo11s.yaml"])
    p.add_argument("--imgsz", nargs="+", type=int, default=[640, 1280])
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--amp", nargs="+", choices=list(AMP), default=None, help="default: off, plus fp16 on CUDA")
    p.add_argument("--shares", nargs="*", type=float, default=SHARES, help="auto rows: shares of the vanilla peak")
    p.add_argument("--auto-only", action="store_true", help="vanilla and the auto rows, no other fixed plans")
    a = p.parse_args()
    amps = a.amp or (["off", "fp16"] if a.device.startswith("cuda") else ["off"])
    for line in table(a.models, a.imgsz, a.batch, amps, a.device, a.repeats, a.shares, not a.auto_only):
        print(line, flush=True)


if __name__ == "__main__":
    main()
