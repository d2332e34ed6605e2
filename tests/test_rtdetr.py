"""RT-DETR: backbone stages and the transformer decoder recomputed, bit for bit as vanilla Ultralytics.

RT-DETR's decoder draws random denoising queries from the training targets in every training forward
(``get_cdn_group``: ``torch.rand``, ``randint_like``, ``rand_like``); a recompute must draw exactly the same ones.
"""

from unittest import mock

import torch
import ultralytics
from ultralytics.cfg import get_cfg
from ultralytics.nn.tasks import RTDETRDetectionModel
from ultralytics.utils import YAML

from yolo_ckpt import RTDETR, YOLO, CheckpointPlan, RTDETRTrainer, checkpoint_plan, enable_checkpointing
from yolo_ckpt.memory.step import StepShape, build_model, training_batch

from support import (
    RTDETR_TINY,
    assert_exact_and_recomputed,
    assert_same,
    assert_same_training,
    train_pair,
    write_polygon_set,
)


def tiny_rtdetr() -> RTDETRDetectionModel:
    torch.manual_seed(0)
    model = RTDETRDetectionModel(RTDETR_TINY, nc=4, verbose=False).train()
    model.args, model.nc = get_cfg(), 4  # what the trainer's set_model_attributes gives the loss
    return model


def recorded_step(model: RTDETRDetectionModel, batch: dict, seed: int) -> tuple[list, dict, torch.Tensor]:
    """One loss forward + backward from ``seed``; every denoising draw the decoder saw (forward and any recompute),
    the gradients and the RNG state after the step."""
    decoder, draws = model.model[-1], []
    real = decoder._get_decoder_input

    def record(feats, shapes, dn_embed=None, dn_bbox=None):
        draws.append((dn_embed.detach().clone(), dn_bbox.detach().clone()))
        return real(feats, shapes, dn_embed, dn_bbox)

    torch.manual_seed(seed)
    with mock.patch.object(decoder, "_get_decoder_input", record):
        model.loss(batch)[0].backward()
    grads = {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return draws, grads, torch.get_rng_state()


def test_decoder_recompute_replays_the_denoising_draws():
    """The decoder checkpointed: its recompute sees the forward's random queries, and the step equals vanilla's."""
    vanilla, ckpt = tiny_rtdetr(), tiny_rtdetr()
    plan = CheckpointPlan.from_spec(ckpt, [], "head")
    assert [r.layers for r in plan.regions] == [(5,)]  # the decoder stores activations: `head` includes it
    enable_checkpointing(ckpt, plan)
    batch = training_batch(vanilla, StepShape(64, 2, 5))
    torch.use_deterministic_algorithms(True)  # as Ultralytics' deterministic=True: index backward sums in order
    try:
        v_draws, v_grads, v_rng = recorded_step(vanilla, batch, seed=1)
        c_draws, c_grads, c_rng = recorded_step(ckpt, batch, seed=1)
        other, _, _ = recorded_step(vanilla, batch, seed=2)
    finally:
        torch.use_deterministic_algorithms(False)
    assert len(v_draws) == 1 and len(c_draws) == 2  # the forward, then the recompute in backward
    assert not torch.equal(other[0][1], v_draws[0][1])  # the draws are random: another seed gives others
    for draw in c_draws:  # forward and recompute draw exactly what vanilla drew
        assert_same(draw, v_draws[0], "denoising queries")
    assert_same(c_grads, v_grads, "gradients")
    assert torch.equal(c_rng, v_rng)  # the recompute leaves the generator where vanilla's step left it


def test_rtdetr_model_classes(tmp_path):
    """`yolo_ckpt.RTDETR` trains with our trainer; our `YOLO` turns an RT-DETR checkpoint into it, as Ultralytics'
    turns it into its own."""
    model = RTDETR("rtdetr-l.yaml")
    assert model.task_map["detect"]["trainer"] is RTDETRTrainer
    assert issubclass(RTDETRTrainer, ultralytics.models.rtdetr.train.RTDETRTrainer)
    assert checkpoint_plan(model.model) is None
    cfg = tmp_path / "rtdetr-tiny.yaml"
    YAML.save(cfg, RTDETR_TINY)
    RTDETR(str(cfg)).save(tmp_path / "tiny.pt")
    assert type(ultralytics.YOLO(str(tmp_path / "tiny.pt"))) is ultralytics.RTDETR  # what Ultralytics does
    loaded = YOLO(str(tmp_path / "tiny.pt"))
    assert type(loaded) is RTDETR and loaded.task_map["detect"]["trainer"] is RTDETRTrainer


def test_rtdetr_l_all_stages_and_decoder_bitwise_equal_to_vanilla():
    """rtdetr-l, every backbone stage (HGStem/HGBlock) and every head layer incl. the decoder recomputed: one
    training step (RT-DETR's own loss, its denoising draws from the same seed) bit for bit in gradients and BatchNorm
    statistics, each convolution recomputed once more per region around it. Training through ``RTDETRTrainer``:
    the tiny RT-DETR below (rtdetr-l's epoch took 35 s of CI's 20 minutes)."""
    regions = CheckpointPlan.from_spec("rtdetr-l.yaml", "all", "head").regions
    assert [r.stages for r in regions if r.stages] == [(2, 3), (4,), (5,)] and regions[-1].layers == (28,)
    model = build_model("rtdetr-l.yaml")
    batch = training_batch(model, StepShape(64, 2, 5))
    torch.use_deterministic_algorithms(True)  # as Ultralytics' deterministic=True: index backward sums in order
    try:
        assert_exact_and_recomputed(model, batch, "head", stages=[2, 3, 4, 5])  # "all"
    finally:
        torch.use_deterministic_algorithms(False)


def test_rtdetr_trainer_with_every_stage_and_the_decoder_trains_like_vanilla(tmp_path):
    """The RT-DETR trainer, every stage and the head (decoder included) recomputed, on a detection set yolo-ckpt did
    not generate (polygon labels, which Ultralytics reads as boxes for detection): the same run bit for bit."""
    cfg = tmp_path / "rtdetr-tiny.yaml"
    YAML.save(cfg, RTDETR_TINY)
    assert [r.layers for r in CheckpointPlan.from_spec(str(cfg), "all", "head").regions][-1] == (5,)  # the decoder
    data = write_polygon_set(tmp_path / "data", size=64)
    pair = train_pair(str(cfg), "all", data, tmp_path, layers="head", epochs=1, imgsz=64)
    assert_same_training(str(cfg), "all", *pair, layers="head")
