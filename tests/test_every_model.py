"""Every task's default model, and the other families people train: the batch planning builds carries every key
the model's loss reads, in training and in validation.

Every planning path (``profile``, ``auto``, AutoBatch, escalation, the validator's batch) measures steps on
``measure.training_batch``; a key a loss reads and that batch lacks (the YOLO26 segmentation loss's ``sem_masks``
once) ended them all in a ``KeyError``. Here each model's planning step and the plan that keeps the least are
measured as planning measures them and against a fresh exact tracker around the model's own loss
(``support.measured_step``). The paths themselves, for every model, are ``benchmarks/every_model.py`` (40 minutes
of CPU: more than CI has).
"""

import pytest

from yolo_ckpt.measure import build_model, step_bytes, validation_bytes, with_plan
from yolo_ckpt.planner import deepest

from support import measured_step

MODELS = [  # Ultralytics' default model of every task (8.4.190: yolo26), the yolo11 ones yolo-ckpt defaults to
    # where their heads differ, and RT-DETR
    "yolo26n.yaml", "yolo26n-seg.yaml", "yolo26n-pose.yaml", "yolo26n-obb.yaml", "yolo26n-cls.yaml",
    "yolo26n-sem.yaml", "yolo26n-depth.yaml", "yolo11n-seg.yaml", "yolo11n-pose.yaml", "rtdetr-l.yaml",
]
IMGSZ, BATCH, OBJECTS = 64, 2, 4


@pytest.mark.parametrize("name", MODELS)
def test_the_planning_batch_carries_every_key_the_loss_reads(name):
    model = build_model(name)
    # planning's step (its batch, its loss) against the independent one: the same bytes within the batch's own
    # tensors, which planning counts from shapes and the fresh tracker sees allocated
    planned, fresh = step_bytes(model, IMGSZ, BATCH, OBJECTS), measured_step(model, IMGSZ, BATCH, OBJECTS)
    assert abs(planned - fresh) <= 0.02 * fresh, (planned, fresh)
    least = deepest(model)  # escalation's last plan, every unit recomputed
    m = with_plan(model, least["checkpoint_stages"], least["checkpoint_mode"], least["checkpoint_layers"] or None)
    assert measured_step(m, IMGSZ, BATCH, OBJECTS) < fresh
    # the validator's forward and loss in eval mode (its batch, twice the training batch, counted: more than one image)
    assert validation_bytes(model, IMGSZ, 2 * BATCH, OBJECTS) > validation_bytes(model, IMGSZ, 1, OBJECTS)
