"""The run's memory decisions on devices planning is not told about (``device.UntoldDevice``: a hard limit that
``device_memory`` does not see, as a GPU whose free memory moved after it was read): the whole run fits, validation
included, and a probe that runs out narrows the batch instead of collapsing it."""

import pytest
import torch
from ultralytics.utils.torch_utils import unwrap_model

from yolo_ckpt import YOLO
from yolo_ckpt.data.synthetic import synthetic_dataset
from yolo_ckpt.integration import memory_hooks, run_facts
from yolo_ckpt.integration.validation_batch import plan_validation
from yolo_ckpt.memory.device import SimulatedDevice, UntoldDevice
from yolo_ckpt.memory.step import StepShape, build_model, planned_copy, state_bytes, validation_bytes, weight_bytes
from yolo_ckpt.memory.tracker import LiveTensorTracker
from yolo_ckpt.planning.autobatch import plan_batch
from yolo_ckpt.regions.settings import PlanSettings

from support import TRAIN_ARGS

ARGS = {**TRAIN_ARGS, "epochs": 1, "imgsz": 160, "val": False}


def test_autobatch_on_an_untold_device_narrows_the_batch_to_what_the_told_device_plans():
    """``memory_budget`` far above the device: told the device, the probes stop at it and the batch is extrapolated
    from the largest step it holds; untold, the first jump runs out of memory, and the batch is narrowed between
    batch 1 and that failure, then extrapolated the same way: within 25% of the told plan (it fell back to batch 1,
    the last measured, before), and no probe passed the device."""
    model = build_model("yolo11n.yaml")
    budget, device = 2**30, 160 * 2**20
    with planned_copy(model, PlanSettings.of("all")) as m:
        with SimulatedDevice(device) as gpu:
            gpu.track([*m.parameters(), *m.buffers()])
            told = plan_batch(m, StepShape(160), budget, 0.6)
        with UntoldDevice(device) as dev:
            dev.track([*m.parameters(), *m.buffers()])
            untold = plan_batch(m, StepShape(160), budget, 0.6)
    assert told.extrapolated and untold.extrapolated and max(told.points) > 1
    assert max(untold.points) > 1 and abs(untold.batch / told.batch - 1) <= 0.25, (told, untold)
    assert dev.peak <= device


def test_validation_is_planned_at_the_validators_real_size_and_bounds_its_peak(detect_data, tmp_path):
    """What planning measures for validation against the real validator: every tensor allocated from
    ``on_val_start`` to ``on_val_end`` of the epoch's validation (Ultralytics' own, in training), tracked with a
    fresh exact tracker. Planning's figure bounds it, tightly: Ultralytics pads the validator's rectangular batches
    by half a stride (160 px images validate at 192), and planning at 160 px counted 14.9 of its 21.4 MiB."""
    peaks, trackers = [], []

    def start(validator):
        trackers.append(LiveTensorTracker().__enter__())

    def end(validator):
        t = trackers.pop()
        t.__exit__(None, None, None)
        peaks.append(t.peak)

    model = YOLO("yolo11n.yaml")
    model.add_callback("on_val_start", start)
    model.add_callback("on_val_end", end)
    model.train(data=detect_data, project=str(tmp_path), checkpoint_stages=[2, 3], **{**ARGS, "val": True})
    t = model.trainer
    plain = unwrap_model(t.model)
    size = run_facts.validation_imgsz(t)  # what plan_validation measures at
    assert size == t.test_loader.dataset.batch_shapes.max() == 192  # the validator's own batches
    planned = validation_bytes(plain, StepShape(size, t.test_loader.batch_size, run_facts.validation_of(t).objects))
    planned -= state_bytes(plain) + weight_bytes(plain)  # the tracker saw what validation allocated, not the state
    real = peaks[0]  # the epoch's (the final one validates best.pt, fused: less)
    assert len(peaks) == 2 and real <= planned <= 1.05 * real, (planned / 2**20, [p / 2**20 for p in peaks])


def test_a_validator_that_would_not_fit_is_given_the_batch_planned_to_fit(detect_data, tmp_path):
    """A target that the real validator at Ultralytics' batch passes (twice the training batch: the 8 validation
    images): planning gives it a smaller batch, the validator's loader is rebuilt at it, and the real validator at
    that batch stays within the target (its exact peak, tracked from ``on_val_start`` to ``on_val_end``, beside the
    training state planning counts resident)."""
    peaks, trackers = [], []
    model = YOLO("yolo11n.yaml")
    model.add_callback("on_val_start", lambda v: trackers.append(LiveTensorTracker().__enter__()))
    model.add_callback("on_val_end", lambda v: (t := trackers.pop()).__exit__(None, None, None) or peaks.append(t.peak))
    model.train(data=detect_data, project=str(tmp_path), checkpoint_stages=[2, 3], **ARGS)
    t, plain = model.trainer, unwrap_model(model.trainer.model)
    static = state_bytes(plain) + weight_bytes(plain)
    t.validate()
    assert t.test_loader.batch_size == 8 == 2 * t.batch_size, (t.test_loader.batch_size, t.batch_size)
    ultralytics_own = peaks[-1]
    target = static + int(0.8 * ultralytics_own)
    planned = plan_validation(plain, run_facts.validation_of(t), t.batch_size, target, 0, 0)
    batch = planned.batch
    assert batch is not None and 1 <= batch < 8 and f"validating at batch {batch}," in planned.line, planned.line
    t.run_memory.val_batch = batch
    memory_hooks.validate_at_planned_batch(t)
    t.validate()
    assert t.test_loader.batch_size == batch and t.validator.dataloader is t.test_loader
    assert static + peaks[-1] <= target, (batch, peaks[-1] / 2**20, (target - static) / 2**20)


class _LoadersBuilt(Exception):
    pass


@pytest.mark.parametrize("cfg,task", [("yolo11n.yaml", "detect"), ("yolo26n-sem.yaml", "semantic"),
                                      ("yolo26n-depth.yaml", "depth")])
def test_the_validation_size_planned_is_the_validators_largest_image(cfg, task, tmp_path):
    """The image side validation is planned at (``validation_imgsz``) is the largest the real validator's loader
    gives, task by task: Ultralytics pads detection's rectangular batches by half a stride, semantic segmentation's
    not, and validates depth on squares (planning padded all three: semantic and depth at 192 for 160)."""
    seen = {}

    def loaders_built(trainer):  # Ultralytics built its loaders: stop before training
        seen["planned"] = run_facts.validation_imgsz(trainer)
        seen["real"] = max(max(b["img"].shape[-2:]) for b in trainer.test_loader)
        raise _LoadersBuilt

    model = YOLO(cfg)
    model.add_callback("on_pretrain_routine_end", loaders_built)
    with pytest.raises(_LoadersBuilt):
        model.train(data=str(synthetic_dataset(task)), task=task, project=str(tmp_path), **ARGS)
    assert seen["planned"] == seen["real"] == (192 if task == "detect" else 160), seen


def _peaks_on(dev, data, project, name, plan, epochs=2, ballast=0):
    """Train ``plan`` inside ``dev`` (an ``UntoldDevice``), each phase's peak on it: the epochs', validations', and
    the peak just before each validation. ``ballast`` bytes appear on the device from each epoch's end to its
    ``on_fit_epoch_end`` (another tenant of a shared GPU, or fragmentation, while validation runs)."""
    import logging

    from ultralytics.utils import LOGGER

    seen, lines, held = {"train": [], "pre": [], "val": []}, [], []

    def phase(name):
        def mark(_):
            seen[name].append(dev.peak) if name else None
            dev.reset_peak()
        return mark

    def arrive(_):
        held.append(torch.empty(ballast, dtype=torch.uint8)) if ballast else None

    handler = logging.Handler()
    handler.emit = lambda r: lines.append(r.getMessage())
    model = YOLO("yolo11n.yaml")
    dev.track([*model.model.parameters(), *model.model.buffers()])
    for event, what in (("on_train_epoch_start", None), ("on_train_epoch_end", "train"), ("on_val_start", "pre"),
                        ("on_val_end", "val")):
        model.add_callback(event, phase(what))
    model.add_callback("on_train_epoch_end", arrive)
    model.add_callback("on_fit_epoch_end", lambda _: held.clear())
    LOGGER.addHandler(handler)
    try:
        # 8 of the 16 images (two steps, the second with AdamW's moments, as every later one): the sizes come from
        # a first run of the same test with the same images
        model.train(data=data, project=str(project), name=name, **{**ARGS, "epochs": epochs, "val": True,
                                                                   "save_period": 1, "fraction": 8}, **plan)
    finally:
        LOGGER.removeHandler(handler)
    return model.trainer, seen, lines


def test_validation_that_runs_out_retries_smaller_and_the_run_keeps_every_epoch(detect_data, tmp_path):
    """A device planning is not told about (nothing plans validation for it), on which memory that training did not
    need is taken while validation runs (``ballast``: another tenant of a shared GPU): Ultralytics' validation at
    twice the training batch runs out of memory, retries at half the batch, and the run completes: every epoch
    validated at that batch, its losses and peaks in results.csv, every epoch's weights saved.

    Sizes from a first run on an unlimited untold device in the same test: the device holds 1.05x the larger of the
    epoch's and validation's peaks; the ballast leaves validation room for a quarter less than its increase at
    batch 8 (at batch 4 it is about half that increase)."""
    plan = {"checkpoint_stages": "all", "checkpoint_layers": "head"}
    with UntoldDevice(2**40) as dev:
        _, free, _ = _peaks_on(dev, detect_data, tmp_path, "free", plan, epochs=1)
    train, pre, val = max(free["train"]), free["pre"][0], free["val"][0]  # the epoch's validation, at batch 8
    limit = int(1.05 * max(train, val))
    ballast = limit - int(pre + 0.75 * (val - pre))
    with UntoldDevice(limit) as dev:
        t, seen, lines = _peaks_on(dev, detect_data, tmp_path, "untold", plan, ballast=ballast)
    assert t.batch_size == ARGS["batch"]  # training fitted: Ultralytics' retry never halved it
    retried = [x for x in lines if "validation ran out of memory at batch 8: validating at batch 4" in x]
    assert len(retried) == 1 and t.test_loader.batch_size == 4 == t.run_memory.val_batch, lines[-30:]
    rows = (t.save_dir / "results.csv").read_text().splitlines()
    header = [c.strip() for c in rows[0].split(",")]
    assert len(rows) == 3 and "mem/val_peak_tensor_GB" in header
    for row in rows[1:]:
        values = dict(zip(header, (float(v) for v in row.split(","))))
        assert 0 < values["mem/val_peak_tensor_GB"] and values["metrics/mAP50(B)"] >= 0
        assert all(v == v for k, v in values.items() if k.startswith("val/"))  # validated with its loss
    weights = {p.name for p in (t.save_dir / "weights").glob("*.pt")}
    assert weights == {"epoch0.pt", "epoch1.pt", "last.pt", "best.pt"}, weights  # save_period=1: each epoch


def test_validation_runs_out_at_one_image_then_leaves_its_loss_out(detect_data, tmp_path):
    """The retries after the batch: at one image validation leaves its loss out (the val loss figures NaN, never a
    made-up 0; metrics as before), and where even that does not fit, the epoch is not validated (the last metrics,
    no fitness) rather than the run ended."""
    model = YOLO("yolo11n.yaml")
    model.train(data=detect_data, project=str(tmp_path), checkpoint_stages="all", **{**ARGS, "val": True})
    t = model.trainer
    memory = t.run_memory
    assert "batch 4" in memory.after_validation_oom(8) and memory.val_batch == 4
    assert "without its loss" in memory.after_validation_oom(1) and memory.val_without_loss
    assert memory.after_validation_oom(1) is None  # nothing left to try
    metrics, fitness = t.validate()
    losses = {k: v for k, v in metrics.items() if k.startswith("val/")}
    assert losses and all(v != v for v in losses.values()), losses  # NaN: not computed
    assert fitness is not None and "metrics/mAP50-95(B)" in metrics
    assert "loss" not in vars(t.ema.ema)  # the shadow is gone after the validation

    def out_of_memory():
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    t.test_loader = t.get_dataloader(t.data["val"], batch_size=1, mode="val")
    last = dict(t.metrics)
    assert memory_hooks.validate_within_memory(t, out_of_memory) == (last, None)
