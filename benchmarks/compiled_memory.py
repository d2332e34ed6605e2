"""What a checkpoint plan keeps under ``torch.compile``: one training step per case, eager and compiled, side by side.

Each case is one training step as Ultralytics runs it: eager, ``model.loss(batch)`` forward and backward; compiled
as ``compile=True`` compiles it (``attempt_compile``: ``torch.compile(model, mode="default", backend="inductor")``,
the model's forward compiled, the criterion called outside the graph on its predictions). Cases:

- vanilla, eager and compiled;
- ``all + head`` (``checkpoint_stages=all checkpoint_layers=head``), eager and compiled;
- the least-keeping plan (``search.deepest``: every stage, the stem in stage 2's region, the neck, the head, each
  block layer's parts nested inside; what ``search.least_keeping`` picks on yolo11n), eager and compiled;
- ``least-stem``, the least-keeping plan with parts nested only in the stem's region (``nested_in_first_region``):
  what keeps the least under compile, eager and compiled; ``least-apart``, ``least-stem`` with the head layer in
  parts (``head_in_parts``), the plan ``auto`` weighs with ``compile_regions=apart`` (``--apart least-apart``);
- compiled vanilla under compile's own ``torch._functorch.config.activation_memory_budget`` (``--budgets``, 0.5, 0.3
  and 0.1), and the plans with a budget too (``--plan-budgets``, 0.3): the issue's table in the issue's order;
- the cases of ``--channels-first`` compiled with inductor's layout optimization off
  (``torch._inductor.config.layout_optimization``, set only while the case compiles): on CPU inductor otherwise runs
  every convolution channels-last, so each step copies every conv weight (and the convolutions' inputs and gradients)
  to that layout, and the forward saves the weight copies for backward;
- the plans of ``--apart`` compiled channels first with their regions compiled apart from the model's graph
  (``regions.recompute.regions_compiled_apart``): each region under eager checkpointing, its inside a compiled graph
  of its own, so the backward recomputes region by region as eagerly; and (``--apart-budgets``) the same under
  compile's budget too (``compile_regions=apart compile_memory_budget=``), read by the model's graph and each
  region's.

Every case runs one untimed step first (compiles, warms caches, builds the criterion), then one step under
``torch.profiler.profile(profile_memory=True)``: its peak is the high-water mark of the allocation records' running
sum from the step's start (the step's own tensors, as the tracker counts them), and "kept" is that sum when backward
starts. On eager cases the step runs once more under the exact ``LiveTensorTracker`` (a dispatch mode: compiled
frames would be skipped under it) and its peak stands beside the profiler's: their agreement validates the profiler's
figure, the only one there is for compiled steps on CPU. Times: the median of ``--repeats`` steps of each case, taken
right after its profile (cases cannot be interleaved: ``torch._dynamo.reset`` between compiled cases, which share the
model class's code and would otherwise share a graph).

Usage:
    python benchmarks/compiled_memory.py                                     # yolo11n, 320 px, batch 2
    python benchmarks/compiled_memory.py --imgsz 640 --batch 4 --repeats 3   # the issue's case (about 15 min CPU)
    python benchmarks/compiled_memory.py --cases vanilla least --budgets 0.3 --plan-budgets 0.3
    python benchmarks/compiled_memory.py --imgsz 640 --batch 4 --cases vanilla least-stem --budgets --plan-budgets \
        --channels-first least-stem --apart least-stem least   # what meets issue 48's 0.33x (docs/compile.md)
    python benchmarks/compiled_memory.py --imgsz 640 --batch 4 --cases vanilla least-stem --budgets --plan-budgets \
        --apart least-stem least-apart --apart-budgets 0.5 0.3    # regions apart, with and without a budget
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass

import torch
from torch import nn

from yolo_ckpt.memory.allocations import BACKWARD_MARK, profile_step
from yolo_ckpt.memory.step import StepShape, build_model, training_batch, with_plan
from yolo_ckpt.memory.tracker import LiveTensorTracker
from yolo_ckpt.planning.search import deepest, head_in_parts, nested_in_first_region
from yolo_ckpt.regions.install import disable_checkpointing
from yolo_ckpt.regions.recompute import regions_compiled_apart
from yolo_ckpt.regions.settings import PlanSettings

MiB = 2**20
PLANS = ("vanilla", "all+head", "least", "least-stem", "least-apart")


@dataclass
class Row:
    """One measured case."""

    name: str
    compiled: bool
    peak: int  # profiler allocation records, bytes above the step's start
    kept: int  # ... when backward starts
    tracked: int | None  # LiveTensorTracker's exact peak (eager only)
    seconds: float


def training_step(model: nn.Module, forward: Callable[[torch.Tensor], object], batch: dict) -> Callable[[], None]:
    """One training step as Ultralytics runs it: compiled, ``model.loss(batch, forward(img))`` (the criterion
    outside the graph); eager, ``model.loss(batch)``."""

    def step() -> None:
        model.zero_grad(set_to_none=True)
        preds = forward(batch["img"]) if forward is not model else None
        loss, _ = model.loss(batch, preds) if preds is not None else model.loss(batch)
        loss = loss.sum()
        with torch.profiler.record_function(BACKWARD_MARK):
            loss.backward()
        del loss, preds
        model.zero_grad(set_to_none=True)

    return step


def tracked_peak(model: nn.Module, batch: dict) -> int:
    """The exact live-tensor peak of one eager step (``LiveTensorTracker``)."""
    model.zero_grad(set_to_none=True)
    with LiveTensorTracker() as tracker:
        loss, _ = model.loss(batch)
        loss.sum().backward()
        del loss
    model.zero_grad(set_to_none=True)
    return tracker.peak


def plan_settings(name: str, model: nn.Module) -> PlanSettings | None:
    if name == "vanilla":
        return None
    if name == "all+head":
        return PlanSettings.of("all", layers="head")
    least = deepest(model)
    return {"least": least, "least-stem": nested_in_first_region(least), "least-apart": head_in_parts(least)}[name]


def measure(base: nn.Module, shape: StepShape, plan: str, compiled: bool, budget: float | None,
            repeats: int, backend: str = "inductor", channels_first: bool = False, apart: bool = False) -> Row:
    """One case: a fresh copy of ``base`` with the plan, compiled (with ``backend``; ``channels_first``: inductor's
    layout optimization off; ``apart``: its regions compiled apart) or not, warmed, profiled, tracked, timed."""
    settings = plan_settings(plan, base)
    model = with_plan(base, settings or PlanSettings(loss="none"))
    batch = training_batch(model, shape)
    torch._dynamo.reset()
    config = ExitStack()  # read when the graphs compile (the warm step), both
    if budget is not None:
        config.enter_context(torch._functorch.config.patch(activation_memory_budget=budget))
    if channels_first:
        config.enter_context(torch._inductor.config.patch(layout_optimization=False))
    if apart:  # every step: dynamo guards on it
        config.enter_context(regions_compiled_apart(backend))
    forward = torch.compile(model, mode="default", backend=backend) if compiled else model
    name = f"{'compiled' if compiled else 'eager'} {plan}" + (f", budget {budget:g}" if budget is not None else "")
    name += (", regions apart" if apart else "") + (", channels first" if channels_first else "")
    try:
        with config:
            step = training_step(model, forward, batch)
            step()  # compiles, builds the criterion, warms caches
            peak, kept = profile_step(step)
            tracked = None if compiled else tracked_peak(model, batch)
            times = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                step()
                times.append(time.perf_counter() - t0)
    finally:
        disable_checkpointing(model)
        torch._dynamo.reset()
    return Row(name, compiled, peak, kept, tracked, statistics.median(times) if times else float("nan"))


def table(rows: list[Row]) -> str:
    """The markdown table: peaks with ratios to eager and compiled vanilla, the tracker's peak beside eager ones."""
    eager = next((r for r in rows if r.name == "eager vanilla"), None)
    comp = next((r for r in rows if r.name == "compiled vanilla"), None)

    def ratio(a: float, b: Row | None, attr: str) -> str:
        base = getattr(b, attr) if b else None
        return f"{a / base:.3f}" if base else "n/a"

    lines = ["| case | peak MiB (profiler) | tracker MiB | × eager vanilla | × compiled vanilla | step time × eager "
             "vanilla | kept when backward starts MiB |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        tracked = f"{r.tracked / MiB:.2f}" if r.tracked is not None else "–"
        lines.append(f"| {r.name} | {r.peak / MiB:.2f} | {tracked} | {ratio(r.peak, eager, 'peak')} | "
                     f"{ratio(r.peak, comp, 'peak')} | {ratio(r.seconds, eager, 'seconds')} | {r.kept / MiB:.1f} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="yolo11n.yaml")
    p.add_argument("--imgsz", type=int, default=320)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--objects", type=int, default=50, help="labelled objects per image")
    p.add_argument("--repeats", type=int, default=1, help="timed steps per case (median)")
    p.add_argument("--backend", default="inductor", help="torch.compile backend (aot_eager: a quick check)")
    p.add_argument("--cases", nargs="+", default=list(PLANS[:4]), choices=PLANS)
    p.add_argument("--eager", action=argparse.BooleanOptionalAction, default=True, help="measure eager cases too")
    p.add_argument("--budgets", nargs="*", type=float, default=[0.5, 0.3, 0.1],
                   help="activation_memory_budget values for compiled vanilla")
    p.add_argument("--plan-budgets", nargs="*", type=float, default=[0.3],
                   help="activation_memory_budget values for the compiled plans too")
    p.add_argument("--channels-first", nargs="*", default=[], choices=PLANS,
                   help="plans compiled once more with inductor's layout optimization off")
    p.add_argument("--apart", nargs="*", default=[], choices=PLANS[1:],
                   help="plans compiled once more channels first, each region compiled apart from the model's graph")
    p.add_argument("--apart-budgets", nargs="*", type=float, default=[],
                   help="activation_memory_budget values for the plans of --apart too")
    args = p.parse_args()
    torch.manual_seed(0)
    base = build_model(args.model)
    shape = StepShape(args.imgsz, args.batch, args.objects)
    plans = [plan for plan in args.cases if plan != "vanilla"]  # the order: vanilla and its budgets first
    cases = [(plan, False, None, False, False) for plan in args.cases if args.eager]
    cases += [("vanilla", True, b, False, False) for b in [None, *args.budgets] if "vanilla" in args.cases]
    cases += [(plan, True, None, False, False) for plan in plans]
    cases += [(plan, True, b, False, False) for b in args.plan_budgets for plan in plans]
    cases += [(plan, True, None, True, False) for plan in args.channels_first]
    cases += [(plan, True, b, True, True) for b in [None, *args.apart_budgets] for plan in args.apart]
    rows = []
    for plan, compiled, budget, channels_first, apart in cases:
        rows.append(measure(base, shape, plan, compiled, budget, args.repeats, args.backend, channels_first, apart))
        print(f"measured {rows[-1].name}: {rows[-1].peak / MiB:.1f} MiB", flush=True)
    print(f"\n{args.model}, {args.imgsz} px, batch {args.batch}, fp32, {torch.get_num_threads()} thread(s), "
          f"torch {torch.__version__}, compiled with {args.backend}:\n")
    print(table(rows))


if __name__ == "__main__":
    main()
