"""Multi-GPU training goes through Ultralytics' DDP launcher: a real two-process run (gloo, CPU).

Ultralytics writes a script plus a cloudpickled state (trainer class, ``vars(args)``, model, callbacks) and starts it
with ``torch.distributed.run``; each worker rebuilds the trainer from that state. The tests train our trainer and
Ultralytics' own through that path with the same arguments and compare every saved field, and each worker's counted
layer forwards prove that the recompute ran there. Ultralytics has no CPU DDP: ``support.GlooDDP`` only tells the
launching process of two CPU workers; the workers train on yolo-ckpt's supported CPU path
(``yolo_ckpt.integration.distributed``, also what ``torchrun`` launches use: ``test_torchrun.py``).
"""

import json
from types import SimpleNamespace

import pytest
import ultralytics
import yaml
from ultralytics.nn.tasks import DetectionModel
from ultralytics.utils import DEFAULT_CFG_DICT

from yolo_ckpt import CheckpointConfigError, CheckpointPlan, DetectionTrainer
from yolo_ckpt.integration.epoch_memory import CALLBACKS
from yolo_ckpt.integration.run_dir import WORKER_ERROR, reported_by_workers
from yolo_ckpt.memory.step import grad_bytes

from support import (
    TRAIN_ARGS,
    CkptGloo,
    CkptSegGloo,
    VanillaGloo,
    VanillaSegGloo,
    add_counting,
    assert_convs_recomputed,
    assert_plan_recomputed,
    assert_recomputed,
    assert_same_run,
    auto_budget,
    conv_counts,
    forward_counts,
    mask_calls,
    results,
)

# Two DDP launches at once (one per xdist worker) can race for a port or a rendezvous: one at a time (conftest.py).
pytestmark = [pytest.mark.xdist_group("ddp"), pytest.mark.usefixtures("one_launch_at_a_time")]  # one launch at a time

STAGES, LAYERS = [2, 3], {1, 2, 3, 4}  # yolo11n: stage 2 = layers 1-2, stage 3 = layers 3-4
PARTS = ["4.*", "23.cv2.0", "23.cv3.0.0-cv3.0.1:selective"]  # the DDP pair also has regions inside layers (nested)


@pytest.fixture(scope="module")
def gloo_runs(detect_data, tmp_path_factory):
    """Plain and ``auto`` two-process DDP through Ultralytics' launcher, same arguments."""
    project = tmp_path_factory.mktemp("ddp")
    runs = {}
    # per rank, a simulated device whose 60% vanilla does not fit (DDP's gradient buckets, one gradient copy, on top):
    # every worker trains on its own, rank 0 plans on its
    budget = int(auto_budget("yolo11n.yaml", detect_data, 160, TRAIN_ARGS["batch"] // 2, 0.8)[:-1])
    buckets = grad_bytes(DetectionModel("yolo11n.yaml", verbose=False))
    auto = {"checkpoint_stages": "auto", "simulate_gpu": f"{budget + int(buckets / 0.6)}B"}
    for name, trainer, extra in (("vanilla", VanillaGloo, {}), ("auto", CkptGloo, auto)):
        model = ultralytics.YOLO("yolo11n.yaml")
        add_counting(model)
        model.train(trainer=trainer, data=detect_data, project=str(project), name=name, **{
            **TRAIN_ARGS, "epochs": 1, "imgsz": 160, "save_period": 1, **extra})
        runs[name] = project / name
    return runs


def test_two_process_ddp_matches_plain_ddp(tmp_path, small_data):
    """Instance segmentation in two-process DDP, stages 2-3 with parts inside and beyond them recomputed, and each
    image's mask loss too (``checkpoint_loss=exact``): each worker recomputed the stages, the parts and every mask
    loss, and the run is plain DDP's bit for bit on both ranks. (One pair for the layer plan and the loss plan, which
    reach the workers in the same pickled arguments: a detection pair of its own was one launch more. Detection
    trains in DDP with a plan in the ``auto`` run below.)"""
    data = small_data("segment")
    ours = {"checkpoint_stages": STAGES, "checkpoint_layers": PARTS, "checkpoint_loss": "exact"}
    for name, trainer, extra in (("vanilla", VanillaSegGloo, {}), ("ckpt", CkptSegGloo, ours)):
        model = ultralytics.YOLO("yolo11n-seg.yaml")
        add_counting(model)
        model.train(trainer=trainer, data=data, project=str(tmp_path), name=name, **{
            **TRAIN_ARGS, "epochs": 1, "imgsz": 160, "save_period": 1, **extra})
    vanilla, ckpt = tmp_path / "vanilla", tmp_path / "ckpt"
    plan = CheckpointPlan.from_spec("yolo11n-seg.yaml", STAGES, PARTS)
    for rank in (0, 1):  # each worker recomputed the checkpointed stages, the parts inside and beyond them, the loss
        assert_recomputed(forward_counts(vanilla, rank), forward_counts(ckpt, rank), LAYERS)
        assert_convs_recomputed(conv_counts(vanilla, rank), conv_counts(ckpt, rank), plan)
        assert mask_calls(vanilla, rank) > 0 and mask_calls(ckpt, rank) == 2 * mask_calls(vanilla, rank)
    assert_same_run(vanilla, ckpt, ranks=(0, 1))


def test_two_process_ddp_auto_plans_once_and_matches_plain_ddp(gloo_runs):
    """Each worker on a simulated device: rank 0 plans for its share of the batch on its device and broadcasts; both
    ranks install that plan, record it, and train as plain DDP, within the share planned for."""
    planned = [json.loads((gloo_runs["auto"] / f"planned_rank{r}.json").read_text()) for r in (0, 1)]
    assert planned == [True, False]  # only rank 0 measured
    chosen = yaml.safe_load((gloo_runs["auto"] / "args.yaml").read_text())
    assert chosen["checkpoint_stages"] != "auto" and (chosen["checkpoint_stages"] or chosen["checkpoint_layers"])
    # rank 1 wrote nothing: its counts show it installed the plan rank 0 recorded
    assert_plan_recomputed("yolo11n.yaml", chosen["checkpoint_stages"], gloo_runs["vanilla"], gloo_runs["auto"],
                           chosen["checkpoint_layers"] or None, ranks=(0, 1))
    assert_same_run(gloo_runs["vanilla"], gloo_runs["auto"], ranks=(0, 1))
    device = int(yaml.safe_load((gloo_runs["auto"] / "args.yaml").read_text())["simulate_gpu"][:-1])
    # the epoch of the rank that needed the most stays in auto's share, DDP's gradient buckets included
    assert 0 < float(results(gloo_runs["auto"])[0]["mem/peak_tensor_GB"]) * 2**30 <= 0.6 * device


def test_our_callbacks_are_registered_once_however_the_trainer_is_built(detect_data, tmp_path):
    """A DDP worker builds the trainer with the parent's callbacks, which already hold ours."""
    first = DetectionTrainer(overrides={"data": detect_data, "model": "yolo11n.yaml", "project": str(tmp_path),
                                        "device": "cpu"})
    worker = DetectionTrainer(cfg=DEFAULT_CFG_DICT.copy(), overrides=vars(first.args), _callbacks=first.callbacks)
    for trainer in (first, worker):
        for event, fn in CALLBACKS.items():
            assert trainer.callbacks[event].count(fn) == 1, event


def test_two_process_ddp_nothing_fits_is_one_error_and_no_run_dir(detect_data, tmp_path, capfd):
    """auto finds no plan in the workers (after the run directory exists): the launching process raises the one line
    every worker reported (``reported_by_workers`` names each rank's line where they differ or one is missing), no
    worker prints a traceback, and the run directory is gone. (AutoBatch is single-process
    in Ultralytics: batch=-1 with several devices is Ultralytics' own error, before any worker starts.)"""
    with pytest.raises(CheckpointConfigError, match=r"^checkpoint_stages=auto: nothing fits .* memory_budget=\d+MB "
                                                    r"would fit it") as e:
        ultralytics.YOLO("yolo11n.yaml").train(trainer=CkptGloo, data=detect_data, project=str(tmp_path), name="r",
                                               **{**TRAIN_ARGS, "epochs": 1, "imgsz": 160},
                                               checkpoint_stages="auto", memory_budget="70MB")  # < model state
    out = capfd.readouterr()  # the workers' output (the parent's logger writes past capfd)
    assert "\n" not in str(e.value) and "Traceback" not in out.out + out.err
    assert "auto: choosing the plan" in out.out and list(tmp_path.iterdir()) == []  # the workers planned; nothing left


def test_the_launcher_says_which_rank_reported_what(tmp_path):
    """One line however the workers ended: theirs when all ranks reported it, else each rank's and the silent ones."""
    trainer = SimpleNamespace(save_dir=tmp_path, world_size=2, ddp=True)
    for lines, expected in (({0: "a", 1: "a"}, "a"), ({0: "a", 1: "b"}, "rank 0: a; rank 1: b"),
                            ({0: "a"}, "rank 0: a; ranks [1] reported nothing"), ({}, None)):
        for rank, line in lines.items():
            (tmp_path / WORKER_ERROR.format(rank)).write_text(line)
        assert reported_by_workers(trainer) == expected and list(tmp_path.iterdir()) == []
