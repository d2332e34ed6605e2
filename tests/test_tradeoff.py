"""The profiler's trade-off figures against independent measurement: every plan's step, the front, imgsz, state.

The reference for a plan's step bytes is written here without yolo_ckpt's checkpointing: Ultralytics' layer loop by
hand with plain ``torch.utils.checkpoint`` around the plan's regions (selective: torch's selective-checkpoint contexts
with the documented rule: convolutions over ``CHEAP_CONV_MACS`` multiply-adds and pooling windows kept), its exact
peak from a fresh ``LiveTensorTracker``, and the model state and input batch counted from shapes.
"""

import math
from copy import deepcopy
from functools import partial

import pytest
import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts
from ultralytics.cfg import get_cfg
from ultralytics.nn.tasks import DetectionModel

from yolo_ckpt.memory.device import SimulatedDevice
from yolo_ckpt.memory.step import OBJECTS_PER_IMAGE, StepShape, training_batch
from yolo_ckpt.memory.tracker import LiveTensorTracker
from yolo_ckpt.planning.choice import choose_plan
from yolo_ckpt.planning.costs import unit_costs
from yolo_ckpt.planning.units import describe
from yolo_ckpt.regions.plan import CheckpointPlan
from yolo_ckpt.regions.recompute import CHEAP_CONV_MACS
from yolo_ckpt.report.tradeoff import largest_imgsz, measure_candidates, pareto, tradeoffs, untouchable

from support import MINI, SMALL, loop_batches

IMGSZ, BATCH = 128, 2


def detector(cfg: dict) -> DetectionModel:
    model = DetectionModel(deepcopy(cfg), verbose=False).train()
    model.args = get_cfg()
    return model


@pytest.fixture(scope="module")
def small():
    return detector(SMALL)


@pytest.fixture(scope="module")
def rows(small):
    return measure_candidates(small, StepShape(IMGSZ, BATCH))


# ------------------------------------------------------------------------------------ the independent reference
def state_by_hand(model) -> int:
    """Weights and buffers twice (the model and its EMA copy), two AdamW moments per trainable parameter."""
    weights = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    return 2 * weights + 2 * sum(4 * p.numel() for p in model.parameters() if p.requires_grad)


def batch_by_hand(imgsz: int, batch: int) -> int:
    """float32 images, and per object a batch index, a class and an xywh box (the detection batch's tensors)."""
    return 4 * (batch * 3 * imgsz * imgsz + batch * OBJECTS_PER_IMAGE * (1 + 1 + 4))


def _reads(m) -> list[int]:
    """Absolute indices of the earlier outputs a layer reads by index (``-1``, the previous output, is ``x``)."""
    return [m.i + j if j < 0 else j for j in ([m.f] if isinstance(m.f, int) else m.f) if j != -1]


def _keep_expensive_convs(ctx, op, *args, **kwargs):
    """These models' regions hold convolutions, BatchNorm, SiLU, concat, upsample and SPPF's max pools, nothing else
    the rule keeps (no matmul, no reduction)."""
    if op is torch.ops.aten.convolution.default and math.prod(args[1].shape[1:]) > CHEAP_CONV_MACS:
        return CheckpointPolicy.MUST_SAVE
    if op is torch.ops.aten.max_pool2d_with_indices.default:
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def _run(layers, save: set[int], region: tuple[int, ...], outside: list[int], x, *inputs):
    """Ultralytics' ``_predict_once`` over ``region``: returns its output and the outputs of its layers in ``save``."""
    y = dict(zip(outside, inputs))
    for i in region:
        m = layers[i]
        if m.f != -1:
            at = lambda j, i=i: y[i + j if j < 0 else j]  # noqa: E731
            x = at(m.f) if isinstance(m.f, int) else [x if j == -1 else at(j) for j in m.f]
        x = m(x)
        if i in save:
            y[i] = x
    return x, [y[i] for i in region if i in save]


def checkpointed_forward(model, x, regions: list[tuple[int, ...]], selective: bool):
    """The model's forward with plain non-reentrant ``torch.utils.checkpoint`` around each region."""
    layers, save, y, i = model.model, set(model.save), {}, 0
    starts = {r[0]: r for r in regions}
    context = {"context_fn": partial(create_selective_checkpoint_contexts, _keep_expensive_convs)} if selective else {}
    while i < len(layers):
        region = starts.get(i, (i,))
        outside = sorted({j for k in region for j in _reads(layers[k]) if j < region[0]})
        fn = partial(_run, layers, save, region, outside)
        inputs = [y[j] for j in outside]
        x, outs = checkpoint(fn, x, *inputs, use_reentrant=False, **context) if i in starts else fn(x, *inputs)
        y.update(zip([k for k in region if k in save], outs))
        i = region[-1] + 1
    return x


def reference(small, row, imgsz=IMGSZ) -> tuple[int, int]:
    """A plan's step bytes by the reference, and the most they may differ from planning's: yolo_ckpt restores
    BatchNorm buffers around a recompute (plain checkpoint updates them twice), so while one region recomputes, a
    clone of that region's buffers is alive too."""
    model = deepcopy(small)
    plan = CheckpointPlan.from_spec(model, row["checkpoint_stages"], row["checkpoint_layers"] or None)
    regions = [r.layers for r in plan.regions]
    data = training_batch(model, StepShape(imgsz, BATCH))
    model.zero_grad(set_to_none=True)
    with LiveTensorTracker() as tracker:
        preds = checkpointed_forward(model, data["img"], regions, row["checkpoint_mode"] == "selective")
        loss = model.loss(data, preds)[0].sum()
        del preds  # dead once the loss is computed, as inside ``model.loss(batch)`` in a training step
        loss.backward()
        del loss
    clones = max((sum(b.numel() * b.element_size() for i in r for b in model.model[i].buffers()) for r in regions),
                 default=0)
    return state_by_hand(model) + batch_by_hand(imgsz, BATCH) + tracker.peak, clones


def assert_matches_reference(small, row, nbytes: int, imgsz=IMGSZ) -> None:
    ref, clones = reference(small, row, imgsz)
    assert 0 <= nbytes - ref <= clones, (row["plan"], row["checkpoint_mode"], nbytes, ref, clones)


# ----------------------------------------------------------------------------------------------------- tests
def test_every_candidate_is_measured(small, rows):
    assert len(rows) == 1 + 62 and rows[0]["plan"] == "none" and rows[0]["peak_ratio"] == rows[0]["flops_ratio"] == 1
    assert len({(r["plan"], r["checkpoint_mode"]) for r in rows}) == len(rows)
    selective = next(r for r in rows if r["checkpoint_mode"] == "selective" and r["checkpoint_layers"])
    for r in (rows[0], selective, rows[-1], min(rows, key=lambda r: r["step_bytes"])):
        assert_matches_reference(small, r, r["step_bytes"])


def test_pareto_front(rows):
    front = [r for r in rows if r["pareto"]]
    assert min(rows, key=lambda r: (r["flops"], r["step_bytes"]))["pareto"]  # the cheapest, and the smallest
    assert min(rows, key=lambda r: (r["step_bytes"], r["flops"]))["pareto"]
    for r in rows:  # every plan off the front is matched or beaten on both axes by one on it, and none on it is
        beaten = [f for f in front if f is not r and f["step_bytes"] <= r["step_bytes"] and f["flops"] <= r["flops"]]
        assert bool(beaten) != r["pareto"], r["plan"]
    assert all(r["time_ratio"] > 0 for r in front) and not any("time_ratio" in r for r in rows if not r["pareto"])


def test_largest_imgsz_fits(small, rows):
    row = min(rows, key=lambda r: r["step_bytes"])
    target = reference(small, row, 224)[0]
    s = largest_imgsz(small, row, StepShape(IMGSZ, BATCH), target)
    assert 192 <= s <= 256 and reference(small, row, s)[0] <= target * 1.02  # a prediction from two measured sizes
    assert largest_imgsz(small, row, StepShape(IMGSZ, BATCH), 2 * target) > s


def test_untouchable_memory(small):
    rows = {r["what"]: r["MiB"] for r in untouchable(small, StepShape(IMGSZ, BATCH), objects=(10, 200))}
    state = rows["weights"] + rows["EMA copy"] + rows["optimizer (AdamW, 2 moments)"]
    assert state == pytest.approx(state_by_hand(small) / 2**20, abs=0.2)  # what planning counts as model state
    assert rows["loss + assigner, 200 objects per image"] > rows["loss + assigner, 10 objects per image"] > 0


# ------------------------------------------------------------------------------------- on a small device
def device_between(small, rows) -> tuple[int, list[int]]:
    """A device limit below what vanilla's step and another plan's need on it and above what half the way from the
    plan that keeps the least to vanilla needs (planning's own batch-1 steps must fit), in the middle of the widest gap
    between the plans' needs there, so that no plan sits at the limit; and each row's need.

    On the device a step needs the model's and one planning copy's weights beside the batch and the step's peak: its
    step bytes measured without a device (``rows``) less the model state, which step bytes count but a probe does not
    allocate."""
    weights = sum(t.numel() * t.element_size() for t in small.state_dict().values())
    need = [r["step_bytes"] - state_by_hand(small) + 2 * weights for r in rows]
    least, most = min(need), need[0]
    inside = sorted({n for n in need if (least + most) / 2 <= n < most})
    lo, hi = max(zip(inside, inside[1:]), key=lambda p: p[1] - p[0])
    return (lo + hi) // 2, need


def on_device(limit: int, model, fn):
    """``fn()`` on a ``SimulatedDevice`` of ``limit`` bytes holding ``model``, with an exact tracker outside it:
    ``(result, the device's peak, the outside tracker's peak)``; the outside tracker sees every allocation tried, also
    one the device refuses."""
    state = [*model.parameters(), *model.buffers()]
    with LiveTensorTracker() as outside, SimulatedDevice(limit) as gpu:
        outside.track(state)
        gpu.track(state)
        result = fn()
    return result, gpu.max_memory_allocated(), outside.peak


def test_tradeoffs_on_a_device_smaller_than_vanilla():
    """vanilla and every plan over the device are reported as not fitting; the others equal the rows measured without
    a device; auto's choice is choose_plan's on that device; no step ever tries to pass the device."""
    small = detector(MINI)
    rows = measure_candidates(small, StepShape(IMGSZ, BATCH))
    limit, need = device_between(small, rows)
    budget = int(limit / 0.6)  # auto's share of it: as large as the device
    shape = StepShape(IMGSZ, BATCH)
    costs, _, _ = on_device(limit, small, lambda: unit_costs(small, shape))  # one set of timings for both choices
    extra, peak, tried = on_device(limit, small, lambda: tradeoffs(small, shape, f"{budget}B", costs=costs))
    assert peak <= limit and tried <= limit
    got = extra["candidates"]
    order = {r["plan"]: i for i, r in enumerate(rows)}  # candidates come fastest first, by step times timed anew
    per_unit = [r for r in got if r["plan"] not in order]  # auto's choice when its units differ in mode
    assert per_unit in ([], [extra["chosen"]])
    listed = [r["plan"] for r in got]  # of plans equal in bytes and FLOPs, the first listed stands on the front
    got = [got[0], *sorted((r for r in got[1:] if r["plan"] in order), key=lambda r: order[r["plan"]])]
    assert [r["plan"] for r in got] == [r["plan"] for r in rows]
    assert not got[0]["fits"] and 1 < sum(not r["fits"] for r in got) < len(got) - 1
    for r, ref, n in zip(got, rows, need):
        assert r["fits"] == (n <= limit), (r["plan"], r["checkpoint_mode"], n, limit)
        measured = (r["step_bytes"], r["flops"], r["step_MiB"])
        assert measured == ((ref["step_bytes"], ref["flops"], ref["step_MiB"]) if r["fits"] else (None,) * 3)
        assert r["peak_ratio"] is None and r["flops_ratio"] is None and "time_ratio" not in r  # no vanilla to divide by
        assert r["pareto"] <= r["fits"]
    fitting = [*(dict(ref) for r, ref in zip(got, rows) if r["fits"]), *(dict(r) for r in per_unit)]  # per_unit: below
    fitting.sort(key=lambda ref: listed.index(ref["plan"]))
    front = {ref["plan"] for ref in pareto(fitting) if ref["pareto"]}
    assert {r["plan"] for r in extra["candidates"] if r["pareto"]} == front
    assert any("vanilla does not fit" in line for line in extra["notes"])

    share = int(0.6 * budget) - loop_batches(small, IMGSZ, BATCH)  # as training plans: less the loop's batches
    choice, _, _ = on_device(limit, small, lambda: choose_plan(small, StepShape(IMGSZ, BATCH), share, costs=costs))
    chosen = extra["chosen"]
    assert chosen["auto"] and chosen["plan"] == describe(choice.candidate)
    assert chosen["fits"] and chosen["step_bytes"] == choice.measured_bytes
    assert got[0]["largest_imgsz"] < IMGSZ  # predicted from smaller sizes, below the size the device did not hold
    plain = {r["what"]: r["MiB"] for r in untouchable(small, StepShape(IMGSZ, BATCH))}
    assert all(r["MiB"] in (None, plain[r["what"]]) for r in extra["untouchable"])
