"""Out of memory in the first epoch on a simulated device: the plan escalates at the same batch instead of halving it,
and the run is then the run a user would have started with the escalated plan."""

import logging
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
import ultralytics
import yaml
from ultralytics.utils import LOGGER
from ultralytics.utils.torch_utils import unwrap_model

from yolo_ckpt import YOLO
from yolo_ckpt.integration.run_facts import objects as objects_of
from yolo_ckpt.memory.step import build_model, planned_copy
from yolo_ckpt.planning.search import deepest
from yolo_ckpt.regions.settings import PlanSettings

from support import (
    TRAIN_ARGS,
    add_counting,
    assert_plan_recomputed,
    assert_same_run,
    forward_counts,
    results,
)

# 8 of the 16 images: two steps, the second with AdamW's moments alive as in every later one (a plain run's epoch peak,
# which the simulated devices below are sized from, is the same as with 16)
ARGS = {**TRAIN_ARGS, "epochs": 1, "save_period": 1, "imgsz": 160, "fraction": 8}
KEYS = ("checkpoint_stages", "checkpoint_layers", "checkpoint_mode")


@contextmanager
def escalations_logged() -> Iterator[list[str]]:
    """The log lines that say a plan escalated, while the block runs."""
    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda r: lines.append(r.getMessage()) if "escalated to" in r.getMessage() else None
    LOGGER.addHandler(handler)
    try:
        yield lines
    finally:
        LOGGER.removeHandler(handler)


def run(data, project, name, cfg="yolo11n.yaml", **ours):
    model = YOLO(cfg)
    add_counting(model)
    model.train(data=data, project=str(project), name=name, **{**ARGS, **ours})
    return model.trainer, Path(model.trainer.save_dir)


@pytest.fixture(scope="module")
def small_cfg(tmp_path_factory) -> str:
    """``support.SMALL`` as a YAML file (five planning units, C3k2 and Detect with parts): for the tests whose subject
    is how escalation meets Ultralytics' retry, not a particular real model (yolo11n's 57 unit probes made most of
    their time)."""
    from support import SMALL

    cfg = tmp_path_factory.mktemp("small") / "small.yaml"
    cfg.write_text(yaml.safe_dump(SMALL, sort_keys=False))
    return str(cfg)


@pytest.fixture(scope="module")
def small_plain(detect_data, small_cfg, tmp_path_factory) -> Path:
    """``SMALL``'s plain run at ``ARGS`` (forwards counted), as ``plain`` is yolo11n's."""
    model = YOLO(small_cfg)
    add_counting(model)
    model.train(data=detect_data, project=str(tmp_path_factory.mktemp("small_plain")), name="plain",
                checkpoint_stages=[], **ARGS)
    return Path(model.trainer.save_dir)


@pytest.fixture(scope="module")
def plain(detect_data, tmp_path_factory) -> Path:
    """The plain run at ``ARGS`` (forwards counted): the reference the escalated runs' fresh runs recompute against."""
    return run(detect_data, tmp_path_factory.mktemp("plain"), "plain", checkpoint_stages=[])[1]


def test_oom_escalates_the_plan_at_the_same_batch_and_trains_as_a_fresh_run(detect_data, tmp_path, small_cfg):
    # the device: 0.6x of what vanilla training peaks at on a device (exact tensor bytes, model and optimizer included);
    # SMALL (five units; yolo11n's 57 unit probes at 320 px made this test 110 s): at 160 px [2, 3] runs out in the
    # first step and escalates to nested parts, which fit (yolo11n at 160 px ran out in the second step, after AdamW
    # made its moments: training then goes on from that step, as Ultralytics' retry does, not as a fresh run, and
    # assert_same_run below fails; at 256 px no plan fit and the batch halved)
    size = {"imgsz": 160}
    _, plain = run(detect_data, tmp_path, "plain", small_cfg, checkpoint_stages=[], simulate_gpu="64GB", **size)
    device = int(0.6 * float(results(plain)[0]["mem/peak_tensor_GB"]) * 2**30)
    trainer, esc = run(detect_data, tmp_path, "escalated", small_cfg, checkpoint_stages=[2, 3],
                       simulate_gpu=f"{device}B", **size)
    assert trainer.batch_size == ARGS["batch"]  # kept, not halved
    chosen = {k: v for k, v in yaml.safe_load((esc / "args.yaml").read_text()).items() if k in KEYS}
    assert (chosen["checkpoint_stages"], chosen["checkpoint_layers"] or [], chosen["checkpoint_mode"]) != (
        [2, 3], [], "full")
    # the same plan from the start, on the same device: no out-of-memory error, and bit for bit the escalated run
    fresh_trainer, fresh = run(detect_data, tmp_path, "fresh", small_cfg, simulate_gpu=f"{device}B", **size, **chosen)
    assert fresh_trainer.batch_size == ARGS["batch"] and fresh_trainer.args.checkpoint_stages == chosen[
        "checkpoint_stages"]
    assert_same_run(fresh, esc)
    assert_plan_recomputed(small_cfg, chosen["checkpoint_stages"], plain, fresh,
                           chosen["checkpoint_layers"] or None)  # the escalated plan recomputes
    # + the step that ran out and the probes on copies (a deep copy carries the counting hooks)
    assert all(e >= f for e, f in zip(forward_counts(esc), forward_counts(fresh))) and forward_counts(esc) != \
        forward_counts(fresh)


def test_a_plan_that_keeps_the_least_hands_over_to_ultralytics_halving(detect_data, tmp_path):
    """Nothing keeps less than every unit recomputed with its block layers' parts nested inside: Ultralytics halves
    the batch, as vanilla does."""
    from support import CkptOOMOnce

    least = deepest(build_model("yolo11n.yaml")).keys()
    model = ultralytics.YOLO("yolo11n.yaml")
    with escalations_logged() as plans:
        model.train(trainer=CkptOOMOnce, data=detect_data, project=str(tmp_path), **least,
                    **{**ARGS, "save_period": -1})
    t = model.trainer  # (flaky beside other tests, cause not found yet: the message says what escalation compared)
    assert t.oom_raised and t.batch_size == ARGS["batch"] // 2 and not plans, (plans, least,
                                                                                t.run_memory.escalation.least)


def test_the_whole_network_in_full_still_escalates_to_nested_parts(detect_data, tmp_path, small_cfg):
    """Every stage and the head, full, is not the plan that keeps the least where layers have parts (C3k2's,
    Detect's branches): an out-of-memory error escalates at the same batch to a plan whose step, measured here with a
    fresh tracker, keeps less (escalation once halved here: its least-keeping plan ignored parts)."""
    from support import CkptOOMOnce, measured_step

    whole = {"checkpoint_stages": "all", "checkpoint_layers": "head", "checkpoint_mode": "full"}
    model = YOLO(small_cfg)
    with escalations_logged() as plans:
        model.train(trainer=CkptOOMOnce, data=detect_data, project=str(tmp_path), **whole,
                    **{**ARGS, "save_period": -1})
    assert model.trainer.oom_raised and model.trainer.batch_size == ARGS["batch"] and len(plans) == 1, plans
    chosen = {k: v for k, v in yaml.safe_load((Path(model.trainer.save_dir) / "args.yaml").read_text()).items()
              if k in KEYS}
    trained, objects = unwrap_model(model.trainer.model), objects_of(model.trainer)

    def step(plan: dict) -> int:
        with planned_copy(trained, PlanSettings.from_keys(plan).with_loss(None)) as m:
            return measured_step(m, ARGS["imgsz"], ARGS["batch"], objects)

    assert step(chosen) < step(whole), chosen


def test_escalations_spend_none_of_ultralytics_halving_retries(detect_data, tmp_path, small_cfg):
    """Four out-of-memory errors at the start of the first epoch: Ultralytics' retry halves three times at most, so
    vanilla ends at the fourth. Here the first errors escalate at the same batch and spend none of those three: the
    run trains, and it halved once for each error that escalation did not take."""
    from support import CkptOOMFourTimes, VanillaOOMFourTimes

    with pytest.raises(torch.OutOfMemoryError, match="4 of 4"):
        ultralytics.YOLO(small_cfg).train(trainer=VanillaOOMFourTimes, data=detect_data, project=str(tmp_path),
                                          name="vanilla", **ARGS)
    model = YOLO(small_cfg)
    with escalations_logged() as plans:
        model.train(trainer=CkptOOMFourTimes, data=detect_data, project=str(tmp_path), name="ours",
                    checkpoint_stages=[2, 3], **ARGS)
    assert model.trainer.oom_raised > 4 and plans, plans  # trained on, after at least one escalation
    assert model.trainer.batch_size == max(ARGS["batch"] // 2 ** (4 - len(plans)), 1)
    assert len(results(Path(model.trainer.save_dir))) == ARGS["epochs"]


def test_auto_that_chose_vanilla_still_escalates(detect_data, tmp_path, small_cfg):
    """``auto`` with room for vanilla installs no plan; an out-of-memory error then escalates at the same batch, as
    from any plan (it halved the batch: no plan was installed to escalate from)."""
    from support import CkptOOMOnce, auto_budget

    budget = auto_budget(small_cfg, detect_data, ARGS["imgsz"], ARGS["batch"], 4.0)  # four vanilla steps' room
    model = YOLO(small_cfg)
    with escalations_logged() as plans:
        model.train(trainer=CkptOOMOnce, data=detect_data, project=str(tmp_path), checkpoint_stages="auto",
                    memory_budget=budget, **ARGS)
    assert model.trainer.oom_raised and model.trainer.batch_size == ARGS["batch"] and len(plans) == 1, plans
    chosen = {k: v for k, v in yaml.safe_load((Path(model.trainer.save_dir) / "args.yaml").read_text()).items()
              if k in KEYS}
    assert chosen["checkpoint_stages"] or chosen["checkpoint_layers"], chosen  # a plan, where auto had none


def test_two_escalations_in_a_row_train_as_a_fresh_run_with_the_last_plan(detect_data, tmp_path, small_cfg,
                                                                           small_plain):
    """Out of memory twice at the start: two escalations, each to a plan keeping less, at the same batch; the run is
    then bit for bit the run started with the last plan (BatchNorm buffers and generators back to the epoch start).
    (``SMALL``: the subject is no model's; yolo11n's 57 unit probes took most of the time.)"""
    from support import CkptOOMTwice

    model = YOLO(small_cfg)
    add_counting(model)
    with escalations_logged() as plans:
        model.train(trainer=CkptOOMTwice, data=detect_data, project=str(tmp_path), name="twice",
                    checkpoint_stages=[2, 3], **ARGS)
    esc = Path(model.trainer.save_dir)
    assert model.trainer.oom_raised > 2 and model.trainer.batch_size == ARGS["batch"] and len(plans) == 2, plans
    first, second = (re.search(r"with (.*): escalated to (.*) at the same batch", line).groups() for line in plans)
    assert first[0] == "stages [2, 3]" and second[0] == first[1] != second[1]  # from [2,3], then from the first
    chosen = {k: v for k, v in yaml.safe_load((esc / "args.yaml").read_text()).items() if k in KEYS}
    _, fresh = run(detect_data, tmp_path, "fresh", cfg=small_cfg, **chosen)
    assert_same_run(fresh, esc)
    assert_plan_recomputed(small_cfg, chosen["checkpoint_stages"], small_plain, fresh,
                           chosen["checkpoint_layers"] or None)


def test_a_plan_of_parts_escalates_and_trains_as_a_fresh_run(detect_data, tmp_path, plain):
    """Regions inside layers (C3k2's ``cv1``, each branch of Detect) out of memory on the first step, through
    Ultralytics' own retry: the plan is outside the planner's units, so its own step at the batch is measured; the run
    escalates once, at the same batch, to a plan whose step keeps less (measured again here with a fresh tracker: the
    plan's batch-1 step scaled to the batch put it above stage 1 alone, which keeps more), and trains bit for bit as a
    fresh run with that plan."""
    from support import CkptOOMOnce, measured_step

    parts = {"checkpoint_stages": [], "checkpoint_layers": ["2.cv1", "23.*"], "checkpoint_mode": "full"}
    model = YOLO("yolo11n.yaml")
    add_counting(model)
    with escalations_logged() as lines:
        model.train(trainer=CkptOOMOnce, data=detect_data, project=str(tmp_path), name="parts",
                    **ARGS, **parts)
    esc = Path(model.trainer.save_dir)
    assert model.trainer.oom_raised and model.trainer.batch_size == ARGS["batch"] and len(lines) == 1, lines
    assert "with parts 2.cv1 23.cv2.0 " in lines[0] and "its step measured" in lines[0], lines[0]
    chosen = {k: v for k, v in yaml.safe_load((esc / "args.yaml").read_text()).items() if k in KEYS}
    trained, objects = unwrap_model(model.trainer.model), objects_of(model.trainer)  # the run's classes, plain again

    def step(plan: dict) -> int:
        with planned_copy(trained, PlanSettings.from_keys(plan).with_loss(None)) as m:
            return measured_step(m, 160, ARGS["batch"], objects)

    assert step(chosen) < step(parts), chosen
    _, fresh = run(detect_data, tmp_path, "fresh", **chosen)
    assert_same_run(fresh, esc)
    assert_plan_recomputed("yolo11n.yaml", chosen["checkpoint_stages"], plain, fresh,
                           chosen["checkpoint_layers"] or None)  # layers by their forwards, parts by convolutions


def test_the_least_keeping_plan_escalates_the_loss_before_the_batch_halves(tmp_path, small_data):
    """Instance segmentation with the layer plan that keeps the least: the first out-of-memory error escalates to
    ``checkpoint_loss=exact`` at the same batch (bit for bit, so the run is a fresh run with it from the start); a
    second one, with nothing left to escalate, halves the batch."""
    from support import CkptSegOOMOnce, CkptSegOOMTwice

    data = small_data("segment")
    least = deepest(build_model("yolo11n-seg.yaml")).keys()
    runs = {}
    for name, trainer, ours in (("once", CkptSegOOMOnce, {}), ("twice", CkptSegOOMTwice, {}),
                                ("fresh", None, {"checkpoint_loss": "exact"})):
        model = YOLO("yolo11n-seg.yaml")
        add_counting(model)
        with escalations_logged() as lines:
            model.train(**({"trainer": trainer} if trainer else {}), data=data, project=str(tmp_path), name=name,
                        **least, **ours, **ARGS)
        runs[name] = (model.trainer, Path(model.trainer.save_dir), lines)
    once, esc, lines = runs["once"]
    assert once.oom_raised and once.batch_size == ARGS["batch"] and len(lines) == 1, lines
    assert "escalated to checkpoint_loss=exact" in lines[0]
    assert yaml.safe_load((esc / "args.yaml").read_text())["checkpoint_loss"] == "exact"  # resume restores it
    assert_same_run(runs["fresh"][1], esc)
    twice, _, lines = runs["twice"]
    assert twice.batch_size == ARGS["batch"] // 2 and len(lines) == 1, lines


def test_validation_after_an_escalation_fits_the_device_that_ran_out(detect_data, tmp_path):
    """At 192 px on 0.6x of vanilla's epoch peak, [2, 3] runs out, escalates and trains at batch 4; Ultralytics then
    validates at twice that batch, which ran out of this device (benchmarks/gpu_check.py's escalation at 192 px,
    2026-12-04). The validator's batch is planned for the device the escalation met, and the run ends whole."""
    size = {"imgsz": 192}
    _, plain = run(detect_data, tmp_path, "plain", checkpoint_stages=[], simulate_gpu="64GB", **size)
    device = int(0.6 * float(results(plain)[0]["mem/peak_tensor_GB"]) * 2**30)
    with escalations_logged() as plans:
        trainer, esc = run(detect_data, tmp_path, "escalated", checkpoint_stages=[2, 3], simulate_gpu=f"{device}B",
                           **size)
    assert plans and trainer.batch_size == ARGS["batch"], plans  # escalated, not halved
    val_batch = trainer.run_memory.val_batch
    assert val_batch is not None and val_batch < 2 * ARGS["batch"], val_batch
    assert trainer.test_loader.batch_size == val_batch
    assert len(results(esc)) == ARGS["epochs"] and (esc / "weights" / "best.pt").exists()
