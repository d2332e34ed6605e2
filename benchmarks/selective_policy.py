"""Selective recompute: the cost rule against the by-name rule it replaced, side by side with vanilla in one run.

Rows, for ``checkpoint_stages=all checkpoint_mode=selective`` (yolo11n.yaml, 640 px, batch 4 by default):

- ``vanilla``: no checkpointing, the base of every ratio;
- ``by name``: the rule before ``recompute_cost`` (keep convolutions over 32 multiply-adds per output element, matrix
  products and attention; recompute everything else);
- ``cost``: ``yolo_ckpt.regions.recompute``'s rule (keep what costs at least ``KEEP_NS_PER_BYTE`` to recompute per
  byte);
- ``cost + BatchNorm``: the same with BatchNorm's outputs kept too (the threshold just below BatchNorm's cost);
- ``keep all``: every output that may be kept is kept (only views and in-place ops are recomputed): no plan can be
  faster, so its time is what the selective machinery itself costs (Python dispatch of every op in forward and
  recompute, the BatchNorm buffer restore).

Columns: exact step peak and bytes alive after forward (``step.measure_peak``, ``tracker.LiveTensorTracker``),
convolution/matmul FLOPs (``step.step_flops``), and the median step time of interleaved rounds
(``step.time_steps``): on CPU the step's own CPU time (``time.process_time``, which the other processes of a shared
machine do not stretch) and wall-clock.

Then, per op kind inside the regions, what each rule keeps (MiB after forward) and what its recompute costs (the op's
forward time in a plain step, summed over the ops it recomputes), next to the measured and modelled cost per byte:
where the bytes and the time of a selective plan are.

Usage:
    python benchmarks/selective_policy.py                    # yolo11n.yaml 640 batch 4, 10 rounds
    python benchmarks/selective_policy.py --imgsz 320 --repeats 3

Last, the floor: the least time any rule that recomputes whole ops needs to reach ``--target`` x vanilla's peak
(``recompute_floor``), against the time target of 1.05x.
"""

from __future__ import annotations

import argparse
import math
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from typing import Any
from unittest import mock

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import CheckpointPolicy, SelectiveCheckpointContext

from yolo_ckpt.memory.step import (
    StepShape,
    build_model,
    measure_peak,
    step_flops,
    time_steps,
    training_batch,
    with_plan,
)
from yolo_ckpt.regions import recompute
from yolo_ckpt.regions.install import disable_checkpointing
from yolo_ckpt.regions.plan import CheckpointPlan
from yolo_ckpt.regions.settings import PlanSettings

_aten = torch.ops.aten
BY_NAME_KEPT = frozenset({  # the by-name rule's kept ops (yolo-ckpt up to the cost rule)
    _aten.convolution.default, _aten.mm.default, _aten.addmm.default, _aten.bmm.default, _aten.baddbmm.default,
    _aten._scaled_dot_product_flash_attention.default, _aten._scaled_dot_product_efficient_attention.default,
    _aten._scaled_dot_product_cudnn_attention.default,
})


def by_name(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """The rule the cost rule replaced: convolutions over 32 MACs per output element, matmuls, attention kept."""
    if op is _aten.convolution.default and math.prod(args[1].shape[1:]) <= 32:
        return CheckpointPolicy.PREFER_RECOMPUTE
    return CheckpointPolicy.MUST_SAVE if op in BY_NAME_KEPT else CheckpointPolicy.PREFER_RECOMPUTE


def keep_all(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """Keep every output torch can keep (not views, not in-place ops): the fastest a selective plan can be."""
    return CheckpointPolicy.PREFER_RECOMPUTE if recompute._aliases(op) else CheckpointPolicy.MUST_SAVE


COST = recompute._selective_policy  # the library's rule, bound before any row patches it in


def cost_and_batch_norm(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """The cost rule with BatchNorm kept too: the next point of the trade-off, where the threshold passes BatchNorm."""
    if op in recompute._BATCH_NORMS:
        return CheckpointPolicy.MUST_SAVE
    return COST(ctx, op, *args, **kwargs)


RULES: dict[str, Callable | None] = {"by name": by_name, "cost": COST,
                                     "cost + BatchNorm": cost_and_batch_norm, "keep all": keep_all}


@contextmanager
def ruled(rule: Callable | None) -> Iterator[None]:
    """Selective regions decide by ``rule`` inside the block. Benchmark only: ``recompute`` has one rule, looked up
    when a region's forward starts (torch asks it in the forward; the recompute replays the forward's decisions)."""
    with mock.patch.object(recompute, "_selective_policy", rule) if rule else nullcontext():
        yield


class Ruled(nn.Module):
    """A model whose training forward runs under a selective rule, so that rules can be timed in interleaved rounds."""

    def __init__(self, model: nn.Module, rule: Callable | None) -> None:
        super().__init__()
        self.model, self.rule = model, rule

    def loss(self, batch: dict) -> Any:
        with ruled(self.rule):
            return self.model.loss(batch)


def rows(model: nn.Module, imgsz: int, batch: int, repeats: int) -> list[dict]:
    """One row per rule (vanilla first): peak, bytes after forward, FLOPs, CPU and wall step time."""
    data = training_batch(model, StepShape(imgsz, batch))
    ruled_models = {"vanilla": Ruled(model, None)}
    ruled_models.update({name: Ruled(with_plan(model, PlanSettings.of("all", "selective")), rule)
                         for name, rule in RULES.items()})
    try:
        out = [{"rule": name, "mem": measure_peak(m, data), "flops": step_flops(m, data)}
               for name, m in ruled_models.items()]
        models = list(ruled_models.values())
        time_steps(models, data, 1)  # warm-up round
        cpu = time_steps(models, data, repeats, clock=time.process_time)
        wall = time_steps(models, data, repeats)
    finally:
        for name, m in ruled_models.items():
            if name != "vanilla":
                disable_checkpointing(m.model)
    for row, c, w in zip(out, cpu, wall):
        row.update(cpu=c, wall=w)
    return out


class _OpTimer(TorchDispatchMode):
    """Each op's time and output inside the plan's regions (flagged by the caller), with each rule's decision."""

    def __init__(self) -> None:
        super().__init__()
        self.inside = False
        self.ops: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0.0, 0.0, 0.0])  # MiB, ms, modelled
        self.keepable: list[tuple[float, float]] = []  # (MiB, ms) of each op call whose output may be kept

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        t0 = time.perf_counter()
        out = func(*args, **(kwargs or {}))
        seconds = time.perf_counter() - t0
        if self.inside:
            ctx = SelectiveCheckpointContext(is_recompute=False, op_output=out)
            mib = recompute._nbytes(out) / 2**20
            for name, rule in RULES.items():
                keep = rule(ctx, func, *args, **(kwargs or {})) == CheckpointPolicy.MUST_SAVE
                rec = self.ops[(name, str(func).removeprefix("aten."))]
                rec[0] += mib * keep
                rec[1] += seconds * 1e3 * (not keep)
            total = self.ops[("all", str(func).removeprefix("aten."))]
            total[0] += mib
            total[1] += seconds * 1e3
            total[2] += recompute.recompute_cost(func, args, out) * mib
            if mib and keep_all(ctx, func) == CheckpointPolicy.MUST_SAVE:
                self.keepable.append((mib, seconds * 1e3))
        return out


def recompute_floor(calls: list[tuple[float, float]], mib: float) -> float | None:
    """The least forward time (ms) of op outputs adding up to ``mib``: the cheapest per byte first, the last in part
    (a fractional knapsack over ``calls``' ``(MiB, ms)``). A lower bound on the recompute time of any rule that stops
    keeping that many bytes: it recomputes whole ops, each at least once, and their inputs too where not kept.
    ``None`` when all of them together are less."""
    got = ms = 0.0
    for size, t in sorted(calls, key=lambda c: c[1] / c[0]):
        take = min(size, mib - got)
        got, ms = got + take, ms + t * take / size
        if got >= mib:
            return ms
    return None


def _timed_forward(model: nn.Module, layers: list[nn.Module], data: dict) -> _OpTimer:
    """One plain training forward under ``_OpTimer``, its ops flagged while one of ``layers`` runs."""
    timer = _OpTimer()
    flag = lambda inside: lambda *_: setattr(timer, "inside", inside)  # noqa: E731
    hooks = [h for m in layers for h in (m.register_forward_pre_hook(flag(True)), m.register_forward_hook(flag(False)))]
    try:
        with timer:
            model.loss(data)
    finally:
        for h in hooks:
            h.remove()
    return timer


def op_breakdown(model: nn.Module, imgsz: int, batch: int, rounds: int = 3) -> _OpTimer:
    """Time every op of a plain training forward, flagging those inside the ``all`` plan's regions (the fastest of
    ``rounds`` forwards counts)."""
    layers = [model.model[i] for r in CheckpointPlan.from_spec(model, "all").regions for i in r.layers]
    data = training_batch(model, StepShape(imgsz, batch))
    timers = [_timed_forward(model, layers, data) for _ in range(rounds)]
    model.zero_grad(set_to_none=True)
    return min(timers, key=lambda t: sum(v[1] for (name, _), v in t.ops.items() if name == "all"))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="yolo11n.yaml")
    p.add_argument("--imgsz", type=int, default=640)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--target", type=float, default=0.65, help="peak ratio the floor is computed for")
    a = p.parse_args()
    torch.manual_seed(0)
    model = build_model(a.model)
    print(f"{a.model} {a.imgsz} px, batch {a.batch}, checkpoint_stages=all checkpoint_mode=selective, "
          f"{a.repeats} interleaved rounds\n")
    print("| rule | peak MiB | peak ratio | after forward MiB | FLOP ratio | CPU time ratio | wall time ratio |")
    print("|---|---|---|---|---|---|---|")
    out = rows(model, a.imgsz, a.batch, a.repeats)
    base = out[0]
    for r in out:
        print(f"| {r['rule']} | {r['mem'].peak / 2**20:.0f} | {r['mem'].peak / base['mem'].peak:.3f} "
              f"| {r['mem'].saved / 2**20:.0f} | {r['flops'] / base['flops']:.3f} | {r['cpu'] / base['cpu']:.3f} "
              f"| {r['wall'] / base['wall']:.3f} |", flush=True)
    timer = op_breakdown(model, a.imgsz, a.batch)
    ops = timer.ops
    kinds = sorted({k for _, k in ops}, key=lambda k: -ops[("all", k)][1])
    print("\nInside the regions, per op kind: outputs and forward time of a plain step; what each rule keeps "
          "(MiB) and recomputes (ms)\n")
    print("| op | outputs MiB | forward ms | measured ns/B | modelled ns/B | "
          + " | ".join(f"{n} keeps MiB | {n} recomputes ms" for n in RULES) + " |")
    print("|---" * (5 + 2 * len(RULES)) + "|")
    for k in kinds:
        mib, ms, modelled = ops[("all", k)]
        if ms < 0.05 and not any(ops[(n, k)][0] for n in RULES):
            continue
        per = f"{ms / mib / 1.048576:.3f} | {modelled / mib:.3f}" if mib else " | "
        print(f"| {k} | {mib:.1f} | {ms:.1f} | {per} | "
              + " | ".join(f"{ops[(n, k)][0]:.1f} | {ops[(n, k)][1]:.1f}" for n in RULES) + " |")
    print("| **total** | | {:.1f} | | | ".format(sum(ops[("all", k)][1] for k in kinds))
          + " | ".join(f"{sum(ops[(n, k)][0] for k in kinds):.1f} | {sum(ops[(n, k)][1] for k in kinds):.1f}"
                       for n in RULES) + " |")
    print_floor(timer.keepable, base, next(r for r in out if r["rule"] == "keep all"), a.target)


def print_floor(calls: list[tuple[float, float]], base: dict, keep_all_row: dict, target: float) -> None:
    """What stands between a peak of ``target`` x vanilla's and little extra time: a peak falls at most by the bytes
    no longer kept, so the regions must stop keeping ``(1 - target)`` of vanilla's peak, and recomputing that many
    bytes takes at least ``recompute_floor`` of the plain step's op times (wall-clock, as the ops were timed)."""
    drop = (1 - target) * base["mem"].peak / 2**20
    floor = recompute_floor(calls, drop)
    machinery = keep_all_row["wall"] / base["wall"] - 1
    if floor is None:
        print(f"\nFloor: the regions' outputs add up to less than the {drop:.0f} MiB a peak of {target}x needs freed")
        return
    share = floor / 1e3 / base["wall"]
    print(f"\nFloor at {target}x vanilla's peak: at least {drop:.0f} MiB no longer kept (a peak falls at most by "
          f"that); the ops cheapest per byte that add up to it take {floor:.1f} ms to recompute, {share:.3f} of "
          f"vanilla's step wall time: no rule of whole ops is under {1 + share:.3f}x, before the selective "
          f"machinery's own {machinery:.3f} (keep all)")


if __name__ == "__main__":
    main()
