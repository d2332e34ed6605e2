"""The planning batch and the training loop's other batches (``measure``) against what Ultralytics' losses read and
its loader holds."""

from copy import deepcopy

import pytest
from ultralytics.cfg import get_cfg
from ultralytics.nn.tasks import SegmentationModel

from yolo_ckpt.memory.step import StepShape, step_loss, training_batch


@pytest.mark.parametrize("name", ["yolo26n-seg.yaml", "yolo11n-seg.yaml"])
def test_a_segment_planning_batch_carries_every_key_its_loss_reads(name):
    """YOLO26 segmentation trains a semantic auxiliary head whose loss reads ``sem_masks`` (one class id per mask
    pixel, as Ultralytics' ``Format`` gives every segment batch): without it planning such a model ended in
    ``KeyError: 'sem_masks'``."""
    model = SegmentationModel(name, verbose=False).train()
    model.args = get_cfg()  # the loss reads its hyperparameters here
    batch = training_batch(model, StepShape(64, 2))
    assert batch["sem_masks"].shape == batch["masks"].shape  # mask resolution, as Format's mask_ratio gives both
    loss = step_loss(model, batch)
    loss.backward()
    assert loss.isfinite() and loss > 0


def test_the_loops_host_images_count_only_where_the_model_trains_on_the_cpu():
    """Ultralytics' loader collates uint8 images in host memory: on the CPU (and a simulated device) they share the
    memory a step uses, on an accelerator they do not (a model on the meta device stands in for one here), where
    only the previous batch, on the device, is held beside the step."""
    from ultralytics.nn.tasks import DetectionModel

    from yolo_ckpt.memory.step import batch_bytes, loop_bytes

    from support import MINI, loop_batches

    model = DetectionModel(deepcopy(MINI), verbose=False)
    assert loop_bytes(model, StepShape(64, 2)) == loop_batches(model, 64, 2)  # the independent count, from real tensors
    accelerator = DetectionModel(deepcopy(MINI), verbose=False).to("meta")
    shape = StepShape(64, 2)
    assert loop_bytes(accelerator, shape) == batch_bytes(model, shape) < loop_batches(model, 64, 2)


def test_one_copy_for_many_plans_measures_as_a_fresh_copy_each():
    """``copy_for_plans`` against a fresh ``planned_copy`` per plan: the same exact peak, bytes kept for backward and
    FLOPs for each plan in turn, a loss plan and Ultralytics' loss after it included (each step builds its loss as a
    fresh copy's first step does)."""
    from yolo_ckpt.memory.step import build_model, copy_for_plans, measure_peak, planned_copy
    from yolo_ckpt.regions.settings import PlanSettings

    model = build_model("yolo11n-seg.yaml")
    plans = [PlanSettings.of(*p) for p in (([],), ([2, 3],), ("all", "full", "head"), ([], "full", None, "exact"),
                                           ([2, 3], "selective"), ([],))]
    with copy_for_plans(model) as install:
        shared = [measure_peak(m := install(p), training_batch(m, StepShape(64, 2)), flops=True) for p in plans]
    for p, got in zip(plans, shared):
        with planned_copy(model, p) as m:
            assert got == measure_peak(m, training_batch(m, StepShape(64, 2)), flops=True), p
    assert len({s.flops for s in shared[:3]}) == 3  # each recomputes more: a copy that kept its first plan would fail
