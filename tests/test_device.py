"""Memory decisions on a simulated device with a hard limit, measured by an independent exact tracker around them."""

import dataclasses
import logging
import re
from copy import deepcopy
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

import pytest
import torch
import yaml
from ultralytics.cfg import get_cfg
from ultralytics.nn.tasks import DetectionModel
from ultralytics.utils import LOGGER
from ultralytics.utils.torch_utils import unwrap_model

from yolo_ckpt.integration.run_facts import objects as objects_of
from yolo_ckpt.memory.device import (
    LimitReached,
    MemoryLimit,
    SimulatedDevice,
    device_memory,
    is_oom,
    output_bytes,
    simulated_device,
    unless_oom,
)
from yolo_ckpt.memory.step import StepShape, planned_copy, state_bytes, step_bytes, weight_bytes
from yolo_ckpt.memory.tracker import LiveTensorTracker
from yolo_ckpt.planning.autobatch import plan_batch
from yolo_ckpt.planning.choice import choose_plan
from yolo_ckpt.planning.costs import unit_costs
from yolo_ckpt.regions.settings import PlanSettings
from yolo_ckpt.regions.spec import CheckpointConfigError

from support import MINI, SMALL, TRAIN_ARGS, auto_budget, loop_batches, measured_step, results

IMGSZ = 128


def small_model(cfg: dict = SMALL) -> DetectionModel:
    model = DetectionModel(deepcopy(cfg), verbose=False).train()
    model.args = get_cfg()
    return model


def test_simulated_device_raises_cuda_out_of_memory_and_reports_like_cuda():
    with LiveTensorTracker() as outside, SimulatedDevice(2**20) as gpu:
        assert simulated_device() is gpu and device_memory("cpu").total == 2**20
        a = torch.zeros(2**17)  # 512 KiB
        assert gpu.mem_get_info() == (2**19, 2**20) and gpu.memory_allocated() == 2**19
        with pytest.raises(torch.OutOfMemoryError, match="^CUDA out of memory. Tried to allocate 1.00 MiB") as e:
            torch.ones(2**18)
        assert is_oom(e.value) and "out of memory" in str(e.value).lower()  # what Ultralytics' retry looks for
        del e
        assert gpu.memory_allocated() == 2**19 and gpu.max_memory_allocated() == 2**19  # the refused one never counts
        b = a + 1
        assert gpu.max_memory_allocated() == 2**20 and outside.peak == 2**19 + 2**20  # outside saw the refused MiB
        del a, b
    assert device_memory("cpu") is None and simulated_device() is None


OPS = {  # ATen ops planning steps run, as a tracker sees them allocate (views and in-place ops allocate nothing)
    "conv": lambda x: torch.nn.functional.conv2d(x, torch.ones(8, 3, 3, 3)),
    "factory": lambda x: torch.zeros(5, 7, 9, dtype=torch.float64),
    "cat": lambda x: torch.cat([x, x, x], 1),
    "matmul": lambda x: x.flatten(1) @ x.flatten(1).T,
    "view": lambda x: x.view(-1),
    "in-place": lambda x: x.mul_(2),
    "expand+copy": lambda x: x[:, :1].expand(2, 16, 32, 32).contiguous(),
    "reduction": lambda x: x.sum((2, 3)),
}


@pytest.mark.parametrize("op", OPS)
def test_output_bytes_are_what_the_op_allocates(op):
    """``output_bytes`` (meta tensors, before the op runs) against the exact tracker (after it ran)."""
    x = torch.rand(2, 3, 32, 32)
    seen = []

    class Predict(LiveTensorTracker):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(output_bytes(func, args, kwargs or {}))
            return super().__torch_dispatch__(func, types, args, kwargs)

    with LiveTensorTracker() as exact, Predict():
        out = OPS[op](x)
    assert None not in seen and sum(seen) == exact.peak, (seen, exact.peak)  # the conv weight dies after it: the peak
    del out


def test_a_probe_refuses_an_op_before_it_allocates():
    """What a probe may not allocate never reaches the trackers around it (the device, planning's exact tracker),
    except for an op whose output size depends on the data, which is checked after it ran."""
    with LiveTensorTracker() as outside:
        x = torch.ones(2**16)  # 256 KiB
        with pytest.raises(LimitReached, match="Tried to allocate 2.00 MiB"), MemoryLimit(2**20, device=False):
            torch.cat([x] * 8)
        assert outside.peak == 2**18  # the 2 MiB were never allocated
        with pytest.raises(LimitReached, match="Tried to allocate 512.00 KiB|Tried to allocate 0.50 MiB"), \
                MemoryLimit(2**18, device=False):
            x.nonzero()  # 2**16 int64 indices: meta cannot size it before it runs
        assert outside.peak == 2**18 + 2**19


def test_batch_planning_never_passes_the_share_and_plans_past_a_small_device():
    """A budget three times the device: probes fit the device, the batch is extrapolated from them, within 10% of
    what an unlimited device plans; on a device as large as the budget, planning never passes the share."""
    model = small_model()
    with planned_copy(model, PlanSettings.of("all")) as m:
        budget = 30 * step_bytes(m, StepShape(IMGSZ, 1))
        unlimited = plan_batch(m, StepShape(IMGSZ), budget, 0.6)
        with LiveTensorTracker() as outside, SimulatedDevice(budget) as gpu:
            gpu.track([*m.parameters(), *m.buffers()])
            same = plan_batch(m, StepShape(IMGSZ), budget, 0.6)
        assert same.batch == unlimited.batch and outside.peak <= 0.6 * budget  # model, batches and steps included
        with SimulatedDevice(budget // 3) as gpu:
            gpu.track([*m.parameters(), *m.buffers()])
            small = plan_batch(m, StepShape(IMGSZ), budget, 0.6)
            assert gpu.max_memory_allocated() <= gpu.limit
    assert small.extrapolated and max(small.points) < unlimited.batch
    assert abs(small.batch - unlimited.batch) <= 0.1 * unlimited.batch, (small, unlimited)


def test_auto_on_a_device_smaller_than_vanilla_never_measures_vanilla():
    """The share is half the vanilla step: vanilla is predicted, never run; every probe stops at the share; the whole
    planning, the training model included, stays within it; the choice fits. (MINI: four units, 20 unit steps.)"""
    model = small_model(MINI)
    batch, costs = 4, unit_costs(model, StepShape(IMGSZ))
    vanilla = step_bytes(model, StepShape(IMGSZ, batch))
    share = vanilla // 2 + vanilla // 10
    with LiveTensorTracker() as outside, SimulatedDevice(int(share / 0.6)) as gpu:
        gpu.track([*model.parameters(), *model.buffers()])
        choice = choose_plan(model, StepShape(IMGSZ, batch), share, costs=costs)
    assert all(t.candidate.units for t in choice.tried)  # vanilla was never measured
    assert choice.candidate.units and choice.measured_bytes <= share
    assert outside.peak <= share  # probes that did not fit stopped before the share
    with planned_copy(model, choice.candidate.installs) as m:  # as its settings install it
        # the measurement is a plain, unguarded step
        assert step_bytes(m, StepShape(IMGSZ, batch)) == choice.measured_bytes


def test_timing_probes_run_only_where_their_bounded_step_fit(monkeypatch, timed_planning):
    """Planning times each unit's batch-1 step on the device: on a device that holds them, every unit is timed and
    the whole measurement, the model included, stays on the device; on one too small for vanilla's batch-1 step, no
    step is ever timed and nothing passes the device. (MINI: four units, 20 unit steps.)"""
    import yolo_ckpt.planning.costs as planner

    model = small_model(MINI)
    timed = []

    def counted(models, batch, repeats, amp=None):
        timed.append(batch["img"].shape)
        return time_steps(models, batch, repeats, amp)

    time_steps = planner.time_steps
    monkeypatch.setattr(planner, "time_steps", counted)
    with planned_copy(model, PlanSettings.of(())) as m:
        one = step_bytes(m, StepShape(IMGSZ, 1))  # vanilla's batch-1 step, as planning counts it
    state = [*model.parameters(), *model.buffers()]
    with LiveTensorTracker() as outside, SimulatedDevice(3 * one) as gpu:
        gpu.track(state)
        costs = unit_costs(model, StepShape(IMGSZ))
    assert outside.peak <= gpu.limit and len(timed) == 1 + len(costs.unit)  # vanilla, each unit in each mode
    assert costs.plain.seconds > 0 and all(p.seconds > 0 for p in costs.unit.values())
    timed.clear()
    big = 2 * IMGSZ  # at 128 px the step is no larger than the stride dry run (no grad, 256 px): a size above it
    with planned_copy(model, PlanSettings.of(())) as m:
        one = step_bytes(m, StepShape(big, 1))
    small = 2 * weight_bytes(model) + (one - state_bytes(model)) // 3  # the model and a copy, not the step
    with LiveTensorTracker() as outside, SimulatedDevice(small) as gpu:
        gpu.track(state)
        with pytest.raises(ValueError, match=f"a training step at batch 1, imgsz {big} does not fit the device"):
            unit_costs(model, StepShape(big))
    assert not timed and outside.peak <= gpu.limit


def test_escalation_from_a_per_unit_plan_moves_to_a_plan_measured_to_keep_less():
    """A plan auto wrote with a mode per unit (layer items, outside the planner's units) runs out of memory: its own
    step at the batch is measured, and the next plan is one measured to keep less — never a plan that is only
    predicted to, such as the failed plan itself. Here the failed plan is put first among the plans escalation tries
    (as the planner's time ranking put it once in CI, and escalation chose it again)."""
    from yolo_ckpt.planning import escalation
    from yolo_ckpt.planning.search import candidates

    model, imgsz, batch = small_model(), IMGSZ, 2
    costs = unit_costs(model, StepShape(imgsz))
    per_unit = [c for c in candidates(costs, batch, 0)
                if any(isinstance(x, str) for x in c.settings.layers or ())]
    failed = max(per_unit, key=lambda c: c.predicted_bytes)  # one that keeps much: plans that keep less exist
    real = escalation.escalations

    def failed_first(*args, **kwargs):
        return [failed, *(c for c in real(*args, **kwargs) if c.settings != failed.settings)]

    def held(settings: PlanSettings) -> int:  # a fresh tracker's step of the plan at the batch
        with planned_copy(model, settings.with_loss(None)) as m:
            return measured_step(m, imgsz, batch)

    with mock.patch.object(escalation, "escalations", failed_first):
        settings, measured = escalation.next_plan(model, failed.settings, StepShape(imgsz, batch), costs=costs)
    assert settings != failed.settings and measured is not None and held(settings) < held(failed.settings)


def test_escalation_leaves_room_for_the_loops_other_batches():
    """Out of memory at batch 4 with stage 2: the next plan, measured on a copy on the simulated device beside the
    training model and its EMA, fits with the training loop's other batches: its step (a fresh tracker) and those
    batches (real batch sizes) within the device, on a device where the plan escalation tries first fits without them
    (by half of them, more than the planning copy's weights), not with them."""
    from yolo_ckpt.planning.escalation import next_plan

    model, imgsz, batch = small_model(), 2 * IMGSZ, 4
    failed = PlanSettings.of([2])
    costs = unit_costs(model, StepShape(imgsz))
    untimed = dict(seconds=0.0)  # plans ranked by FLOPs: the order must not hang on how busy this machine is
    costs = dataclasses.replace(costs, plain=dataclasses.replace(costs.plain, **untimed),
                                unit={k: dataclasses.replace(v, **untimed) for k, v in costs.unit.items()})

    def held(settings: PlanSettings) -> tuple[int, int]:  # a plan's step at the batch, and the loop's batches beside it
        with planned_copy(model, settings.with_loss(None)) as m:
            return measured_step(m, imgsz, batch), loop_batches(m, imgsz, batch)

    first, _ = next_plan(model, failed, StepShape(imgsz, batch), costs=costs)  # no device: the first plan it tries fits
    step, loop = held(first)
    assert loop > 2 * weight_bytes(model)  # else the planning copy's own weights would leave room for them anyway
    device = step + weight_bytes(model) + loop // 2
    with LiveTensorTracker() as outside, SimulatedDevice(device) as gpu:
        gpu.track([*model.parameters(), *model.buffers()])
        ema = deepcopy(model)  # resident on the device, as the trainer's EMA
        settings, measured = next_plan(model, failed, StepShape(imgsz, batch), costs=costs)
        del ema
    assert outside.peak <= device and sum(held(settings)) <= device, (held(settings), device)
    assert measured is not None and settings != first


def test_escalation_where_no_plan_fits_measures_only_those_predicted_to_keep_the_least(monkeypatch):
    """Out of memory on a device that holds half of the least-keeping plan's step (a fresh tracker's): escalation
    measures the plans predicted to keep the least (at most ``LEAST_MEASURED``), none faster, each over the device
    when stepped by a fresh tracker, and goes to the plan that keeps the least, unmeasured."""
    from yolo_ckpt.planning import escalation
    from yolo_ckpt.planning.choice import LEAST_MEASURED
    from yolo_ckpt.planning.search import escalations, least_keeping

    model, imgsz, batch = small_model(), IMGSZ, 2
    costs = unit_costs(model, StepShape(imgsz), timed=False)
    least = least_keeping(costs, batch)

    def step(settings: PlanSettings) -> int:
        with planned_copy(model, settings.with_loss(None)) as m:
            return measured_step(m, imgsz, batch)

    seen, real = [], escalation.measure_candidate
    monkeypatch.setattr(escalation, "measure_candidate", lambda m, c, *a: seen.append(c) or real(m, c, *a))
    device = weight_bytes(model) + step(least.settings) // 2
    with SimulatedDevice(device) as gpu:
        gpu.track([*model.parameters(), *model.buffers()])
        settings, measured = escalation.next_plan(model, PlanSettings.of([2]), StepShape(imgsz, batch), costs=costs)
    assert settings == least.settings and measured is None
    assert 0 < len(seen) <= LEAST_MEASURED < len(escalations(costs, None, batch, 0))
    assert all(step(c.settings) > device for c in seen)


# ------------------------------------------------------------------------ training on a simulated device
RUN = {**TRAIN_ARGS, "epochs": 1, "imgsz": 160, "val": False}
KEYS = ("checkpoint_stages", "checkpoint_layers", "checkpoint_mode")


@pytest.fixture(scope="module")
def small_cfg(tmp_path_factory) -> str:
    """``SMALL`` as a YAML file: for the runs whose subject is planning on the device, not a particular real model
    (yolo11n's 57 unit probes made most of their time)."""
    cfg = tmp_path_factory.mktemp("small") / "small.yaml"
    cfg.write_text(yaml.safe_dump(SMALL, sort_keys=False))
    return str(cfg)


def sim_run(data: str, project: Path, name: str, cfg: str = "yolo11n.yaml", **kw) -> SimpleNamespace:
    """``cfg`` trained on a simulated device: the trainer, the device's peak until the first epoch (``planning``:
    every planning step, the training model, the loaders built), the batch planned, the epoch's peak (results.csv,
    read from the device), whether an out-of-memory error escalated the plan, and the log."""
    from yolo_ckpt import YOLO

    seen = {}
    model = YOLO(cfg)

    def planned(trainer):  # planning (AutoBatch, auto) is over before the first epoch
        seen.update(planning=simulated_device().peak, plan={k: getattr(trainer.args, k) for k in KEYS},
                    batch=trainer.batch_size)

    model.add_callback("on_train_start", planned)
    log = logging.Handler()
    log.emit = lambda record: lines.append(record.getMessage())
    lines: list[str] = []
    LOGGER.addHandler(log)
    try:
        model.train(data=data, project=str(project), name=name, **{**RUN, **kw})
    finally:
        LOGGER.removeHandler(log)
    epoch = float(results(Path(model.trainer.save_dir))[0]["mem/peak_tensor_GB"]) * 2**30
    escalated = seen["plan"] != {k: getattr(model.trainer.args, k) for k in KEYS}
    return SimpleNamespace(trainer=model.trainer, planning=seen["planning"], batch=seen["batch"], epoch=epoch,
                           escalated=escalated, log="\n".join(lines))


def device_bytes(data: str, share: float, batch: int = 4, cfg: str = "yolo11n.yaml") -> int:
    """A device whose 60% is ``share`` of vanilla ``cfg``'s step at ``batch`` (model state and batch on top)."""
    return int(auto_budget(cfg, data, RUN["imgsz"], batch, share)[:-1])


def test_auto_at_a_fixed_batch_plans_and_trains_within_a_tight_device_share(detect_data, tmp_path):
    """No memory_budget: auto plans for 60% of the simulated device, which holds 40% of vanilla's step, planning
    included; the epoch at the user's batch stays within that share, where Ultralytics' loop holds the loader's uint8
    images and every second step the previous batch too (it passed the share by 1.2 MB before those were counted): no
    out-of-memory, no escalation, no halving; the log says how long planning took and what it measured."""
    device = device_bytes(detect_data, 0.4)
    r = sim_run(detect_data, tmp_path, "tight", checkpoint_stages="auto", simulate_gpu=f"{device}B")
    share = int(0.6 * device)
    assert r.trainer.run_memory.target == share and r.batch == r.trainer.batch_size == RUN["batch"]
    assert 0 < r.planning <= share and 0 < r.epoch <= share and not r.escalated
    chosen = yaml.safe_load((Path(r.trainer.save_dir) / "args.yaml").read_text())
    assert chosen["checkpoint_stages"] != "auto" and (chosen["checkpoint_stages"] or chosen["checkpoint_layers"])
    assert "less the training loop's other batches" in r.log
    planned = re.search(r"auto: planned in ([0-9.]+) s \((\d+) timed batch-1 steps: .*; (\d+) candidates measured at "
                        r"batch 4\)", r.log)
    assert planned and float(planned[1]) > 0 and int(planned[2]) > 6 and int(planned[3]) >= 1  # how long it took


@pytest.mark.parametrize("stages, fraction, vanillas", [([2, 3], 0.5, 2.0), ("auto", -1, 1.2)])
def test_autobatch_for_the_device_without_memory_budget(detect_data, tmp_path, small_cfg, stages, fraction, vanillas):
    """``batch=0.5`` (``-1``: 60%) on a simulated device: the batch is planned for that share of it, planning
    included; the epoch at that batch stays within the share; the exact tracker on an unlimited CPU confirms a fixed
    plan's batch is the largest whose step, with the training loop's other batches, fits."""
    from yolo_ckpt.memory.step import planned_copy

    # the share holds vanilla's batch 4 (``vanillas`` x 5/6 of it); auto keeps so much less that twice that share
    # would pass the 16 training images AutoBatch stops at
    device = device_bytes(detect_data, vanillas, cfg=small_cfg) * 5 // 6
    r = sim_run(detect_data, tmp_path, "ab", small_cfg, checkpoint_stages=stages, batch=fraction,
                simulate_gpu=f"{device}B")
    share, b = int((0.6 if fraction == -1 else fraction) * device), r.batch
    assert r.trainer.run_memory.target == share and 4 < b == r.trainer.batch_size < 16, b  # beyond vanilla's 4
    assert 0 < r.planning <= share and 0 < r.epoch <= share and not r.escalated
    if stages != "auto":
        objects = objects_of(r.trainer)
        run_model = unwrap_model(r.trainer.model)
        with planned_copy(run_model, PlanSettings.of(stages)) as m:  # the run's classes and frozen layers
            held = [measured_step(m, RUN["imgsz"], n, objects) + loop_batches(m, RUN["imgsz"], n, objects)
                    for n in (b, b + 1)]
            assert held[0] <= share < held[1]


def test_autobatch_leaves_room_for_the_loops_other_batches(detect_data, tmp_path):
    """``batch=-1`` with the whole network recomputed on a device whose 60% holds batch 8's step (measured here with
    a fresh tracker) but not the loader's uint8 images and the previous batch beside it: the batch planned trains its
    real epoch within the share (planned for the step alone, batch 8's epoch passed it). The whole network, so that
    the peak is a recompute in backward: where it is in the loss, the planned step's mosaic count of labels (x4)
    leaves more room than the loop's batches take."""
    b, imgsz, plan = 8, RUN["imgsz"], {"checkpoint_stages": "all", "checkpoint_layers": "head"}
    data = yaml.safe_load(Path(detect_data).read_text())
    labels = (Path(detect_data).parent / "labels" / "train").glob("*.txt")
    objects = 4 * max(len(f.read_text().splitlines()) for f in labels)  # mosaic, as the trainer counts
    model = DetectionModel("yolo11n.yaml", nc=len(data["names"]), verbose=False).train()
    model.args = get_cfg()
    with planned_copy(model, PlanSettings.of(plan["checkpoint_stages"], "full", plan["checkpoint_layers"])) as m:
        step, loop = measured_step(m, imgsz, b, objects), loop_batches(m, imgsz, b, objects)
    device = int((step + loop // 2) / 0.6)
    r = sim_run(detect_data, tmp_path, "loop", batch=-1, simulate_gpu=f"{device}B", **plan)
    share = r.trainer.run_memory.target
    assert share == int(0.6 * device) and 0 < r.epoch <= share, (r.epoch, share)
    assert 1 < r.batch < b and 0 < r.planning <= share and not r.escalated
    assert "the training loop's other batches" in r.log


def test_a_budget_larger_than_the_device_is_planned_from_steps_the_device_holds(detect_data, tmp_path, small_cfg):
    """``batch=-1 memory_budget`` of 2.5x the simulated device: one warning naming both, the probes stop at the
    device, and the batch is extrapolated to within 10% of what planning on an unlimited device gives."""
    from yolo_ckpt.memory.step import planned_copy

    budget = device_bytes(detect_data, 2.0, cfg=small_cfg) * 5 // 6
    device = int(budget / 2.5)
    r = sim_run(detect_data, tmp_path, "big", small_cfg, checkpoint_stages=[2, 3], batch=-1,
                memory_budget=f"{budget}B", simulate_gpu=f"{device}B")
    run_model = unwrap_model(r.trainer.model)  # plain after training, the run's classes
    with planned_copy(run_model, PlanSettings.of([2, 3])) as m:
        unlimited = plan_batch(m, StepShape(RUN["imgsz"], objects=objects_of(r.trainer)), budget, 0.6)
    assert unlimited.batch < 16 and abs(r.batch - unlimited.batch) <= 0.1 * unlimited.batch, (r.batch, unlimited)
    assert r.planning <= device
    assert r.log.count("is more than simulated device") == 1 and "extrapolated from steps at batches" in r.log
    # the batch planned for the budget does not fit this device: the first epoch runs out, and escalation (a plan that
    # keeps less at that batch) or the retry's halving takes it
    escalated = f"out of memory at batch {r.batch} with stages [2, 3]: escalated" in r.log
    assert escalated or r.trainer.batch_size < r.batch, r.log


@pytest.mark.parametrize("message", [
    "CUDA out of memory. Tried to allocate 2.00 GiB",
    "CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`",
    "cuDNN error: CUDNN_STATUS_INTERNAL_ERROR",
    "GET was unable to find an engine to execute this computation",
])
def test_every_memory_error_ultralytics_retries_means_does_not_fit(message):
    """The messages Ultralytics' first-epoch retry takes for memory errors (``BaseTrainer._do_train``, 8.4.190): a
    probe that raises one of them did not fit, as the retry would have it; any other error stays an error."""
    def raising(text: str):
        def probe():
            raise RuntimeError(text)
        return probe

    assert is_oom(RuntimeError(message)) and unless_oom(raising(message)) is None
    with pytest.raises(RuntimeError, match="shape mismatch"):
        unless_oom(raising("shape mismatch"))


def test_cuda_memory_honours_the_per_process_fraction(monkeypatch):
    """``torch.cuda.set_per_process_memory_fraction(0.5)`` caps what this process may reserve: half of a 16 GB GPU,
    however much of it is free (torch.cuda mocked: the numbers of a GPU with 10 GB free, 2 GB reserved, 1 GB allocated
    by this process)."""
    gb = 2**30
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda i: (10 * gb, 16 * gb))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda i: 2 * gb)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda i: 1 * gb)
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda i: 1.0)
    whole = device_memory("cuda:0")
    assert (whole.usable, whole.free) == (12 * gb, 11 * gb)  # free + reserved, less what is allocated
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda i: 0.5)
    half = device_memory("cuda:0")
    assert (half.total, half.usable, half.free) == (16 * gb, 8 * gb, 7 * gb)


def test_device_strings_read_as_ultralytics_reads_them():
    """One parser for ``device=`` (``select_device``'s spellings, 8.4.190): the CUDA check, Ultralytics' world size
    and torchrun's device all read it."""
    from yolo_ckpt.integration.distributed import ultralytics_world
    from yolo_ckpt.memory.device import parse_device

    assert parse_device("cuda:0,1") == parse_device("[0, 1]") == parse_device([0, 1]) == ("cuda", [0, 1])
    assert parse_device("0") == ("cuda", [0]) and parse_device(-1) == ("cuda", [-1])
    assert parse_device("cuda") == ("cuda", []) and parse_device(None) == parse_device("") == ("", [])
    assert parse_device("cpu") == ("cpu", []) and parse_device("xpu:0")[0] == "xpu" and parse_device("mps")[0] == "mps"
    assert [ultralytics_world(d) for d in ("cpu", "mps", "", "0", "0,1,2", "cuda:1")] == [0, 0, 1, 1, 3, 1]


def test_a_simulated_allocator_counts_cuda_blocks():
    """``simulate_allocator``: each tensor counts for its caching-allocator block — 512-byte multiples, a request
    of 10 MiB or more its own segment rounded to 2 MiB unless the tail left is more than 1 MiB (then split off) —
    so a step's peak there is above its exact bytes, by at most a block's rounding per live tensor."""
    from yolo_ckpt.memory.device import cuda_block_bytes

    mib = 2**20
    assert [cuda_block_bytes(n) for n in (1, 512, 513, mib)] == [512, 512, 1024, mib]
    assert cuda_block_bytes(11 * mib + 1) == 12 * mib and cuda_block_bytes(10 * mib + 1) == 10 * mib + 512
    with SimulatedDevice(2**30, allocator=True) as gpu:
        a = torch.zeros(1, dtype=torch.uint8)
        b = torch.zeros(11 * mib + 1, dtype=torch.uint8)
        assert gpu.memory_allocated() == 512 + 12 * mib
        del a, b
    assert gpu.current == 0
    model = small_model(MINI)
    exact = step_bytes(model, StepShape(64, 2))
    with SimulatedDevice(2**30, allocator=True) as gpu:  # the step's peak is the device's peak above what it held
        held = gpu.current
        step_bytes(model, StepShape(64, 2))
        rounded_peak = gpu.peak - held
    with SimulatedDevice(2**30) as gpu:
        held = gpu.current
        step_bytes(model, StepShape(64, 2))
        exact_peak = gpu.peak - held
    assert exact_peak < rounded_peak, (exact_peak, rounded_peak)
    assert exact_peak <= exact  # the device sees the step's tensors, not the model state step_bytes adds


def test_simulate_allocator_needs_a_simulated_gpu():
    from yolo_ckpt.integration.settings import check_settings

    with pytest.raises(CheckpointConfigError, match=r"^simulate_allocator=True .* Valid: with simulate_gpu=SIZE"):
        check_settings("yolo11n.yaml", {"simulate_allocator": True, "device": "cpu"})
    check_settings("yolo11n.yaml", {"simulate_allocator": True, "simulate_gpu": "1GB", "device": "cpu"})
