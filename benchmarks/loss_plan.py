"""What ``checkpoint_loss`` buys once the whole network is checkpointed: one step per loss plan, side by side.

One training step (``model.loss`` forward and backward) at 1024 px, batch 2, with ``--objects`` labelled objects per
image, measured with exact live tensor bytes (``measure_peak``) and timed in interleaved rounds in the same run
(``time_steps``): vanilla, and the whole network checkpointed with each ``checkpoint_loss`` the model's task allows.
Ratios are to vanilla's peak and step time; ``n/a`` where the loss has no such plan
(``yolo_ckpt.regions.loss.install.LOSS_TASKS``).

Two network plans, a row each:

- ``all + head``: ``checkpoint_stages=all checkpoint_layers=head``, the "today" column of the loss's issue;
- ``least-keeping`` (with ``--least-keeping PX``): the layer plan ``search.least_keeping`` predicts to keep the
  least, where escalation ends and ``profile`` points: each stage (the stem in stage 2's region where that keeps
  less), the neck and the head recomputed, with their block layers' parts nested inside, in regions of their own.
  Its units are measured at ``PX`` px (``unit_costs``, about 90 s for yolo11n at 1024 px), with the loss plan
  ``--planned-with`` (as a run with that ``checkpoint_loss`` plans), and the plan it gives is measured at
  ``--imgsz``;
- ``--stages S --layers L`` (with ``--extra``): a plan written out, as ``checkpoint_stages`` and ``checkpoint_layers``.

Usage:
    python benchmarks/loss_plan.py --models yolo11n-seg.yaml yolo11n.yaml --imgsz 1024 --objects 300 --repeats 2
    python benchmarks/loss_plan.py --models yolo11n.yaml --imgsz 1024 --objects 300 --least-keeping 1024
    python benchmarks/loss_plan.py --models yolo26n-sem.yaml --least-keeping 1024 --planned-with chunked
    python benchmarks/loss_plan.py --models yolo11n.yaml --extra --stages "[1,2]" \
        --layers "['2.*','3-4','5-6','7-10','13','16','17','19','20','22','23.*']"   # the stem in stage 2's region
"""

import argparse
import ast

import torch

from yolo_ckpt.memory.step import StepShape, build_model, measure_peak, time_steps, training_batch, with_plan
from yolo_ckpt.planning import costs, search, units
from yolo_ckpt.regions.loss.install import LOSS_MODES, LOSS_TASKS, enable_loss_checkpointing
from yolo_ckpt.regions.settings import PlanSettings


def network_plans(model: torch.nn.Module, least_keeping: int | None, objects: int, batch: int,
                  extra: tuple | None = None, planned_with: str = "none") -> list[tuple[str, tuple]]:
    """``(name, (stages, mode, layers))`` of each network plan the table has a row for; the least-keeping plan's units
    measured with the loss plan ``planned_with``, as a run with that ``checkpoint_loss`` measures them."""
    plans = [("all + head", PlanSettings.of("all", "full", "head"))]
    if extra is not None:
        plans.append((f"stages {extra[0]} + layers {extra[1]}", PlanSettings.of(extra[0], "full", extra[1])))
    if least_keeping:
        costs.TIMED_STEPS = 0  # the plan that keeps the least is chosen by bytes alone
        enable_loss_checkpointing(model, planned_with)  # every planning copy carries the model's loss plan
        c = search.least_keeping(costs.unit_costs(model, StepShape(least_keeping, objects=objects)), batch)
        enable_loss_checkpointing(model, "none")
        told = "" if planned_with == "none" else f" (planned with loss {planned_with})"
        plans.append((f"least-keeping{told}: {units.describe(c)}", c.settings.with_loss(None)))
    return plans


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=["yolo11n-seg.yaml", "yolo26n-sem.yaml", "yolo11n.yaml"])
    p.add_argument("--imgsz", type=int, default=1024)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--objects", type=int, default=300, help="labelled objects per image (detect, segment, pose, obb)")
    p.add_argument("--repeats", type=int, default=2, help="timed steps per plan (median)")
    p.add_argument("--least-keeping", type=int, metavar="PX", default=None,
                   help="also a row for the least-keeping layer plan, its units measured at PX px")
    p.add_argument("--planned-with", choices=LOSS_MODES, default="none",
                   help="the checkpoint_loss the least-keeping plan's units are measured with")
    p.add_argument("--extra", action="store_true", help="also a row for the plan of --stages and --layers")
    p.add_argument("--stages", default="[]", help="checkpoint_stages of the --extra plan, e.g. \"[1,2]\"")
    p.add_argument("--layers", default="[]", help="checkpoint_layers of the --extra plan, e.g. \"['2.*','3-4']\"")
    a = p.parse_args()
    extra = (ast.literal_eval(a.stages), ast.literal_eval(a.layers)) if a.extra else None
    print(f"{a.imgsz} px, batch {a.batch}, {a.objects} objects per image; peak MiB (x vanilla), step time x vanilla")
    print("| model | network plan | vanilla MiB | " + " | ".join(f"loss {how}" for how in LOSS_MODES) + " |")
    print("|---|---|---|" + "---|" * len(LOSS_MODES))
    for name in a.models:
        torch.manual_seed(0)
        model = build_model(name)
        data = training_batch(model, StepShape(a.imgsz, a.batch, a.objects))
        rows = network_plans(model, a.least_keeping, a.objects, a.batch, extra, a.planned_with)
        plans = [model]
        for _, spec in rows:
            for how in LOSS_MODES:
                if how == "none" or model.args.task in LOSS_TASKS[how]:
                    m = with_plan(model, spec)
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
        for r, (plan, _) in enumerate(rows):
            row = cells[r * len(LOSS_MODES):(r + 1) * len(LOSS_MODES)]
            print(f"| {name} | {plan} | {peaks[0] / 2**20:.0f} | " + " | ".join(row) + " |", flush=True)


if __name__ == "__main__":
    main()
