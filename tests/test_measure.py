"""The planning batch (``measure.training_batch``) against what Ultralytics' own losses read."""

import pytest
from ultralytics.cfg import get_cfg
from ultralytics.nn.tasks import SegmentationModel

from yolo_ckpt.measure import step_loss, training_batch


@pytest.mark.parametrize("name", ["yolo26n-seg.yaml", "yolo11n-seg.yaml"])
def test_a_segment_planning_batch_carries_every_key_its_loss_reads(name):
    """YOLO26 segmentation trains a semantic auxiliary head whose loss reads ``sem_masks`` (one class id per mask
    pixel, as Ultralytics' ``Format`` gives every segment batch): without it planning such a model ended in
    ``KeyError: 'sem_masks'``."""
    model = SegmentationModel(name, verbose=False).train()
    model.args = get_cfg()  # the loss reads its hyperparameters here
    batch = training_batch(model, 64, 2)
    assert batch["sem_masks"].shape == batch["masks"].shape  # mask resolution, as Format's mask_ratio gives both
    loss = step_loss(model, batch)
    loss.backward()
    assert loss.isfinite() and loss > 0
