"""Every task's default model, and the other families people train: the batch planning builds carries every key
the model's loss reads, in training and in validation.

Every planning path (``profile``, ``auto``, AutoBatch, escalation, the validator's batch) measures steps on
``step.training_batch``; a key a loss reads and that batch lacks (the YOLO26 segmentation loss's ``sem_masks``
once) ended them all in a ``KeyError``. Here each model's planning step and the plan that keeps the least are
measured as planning measures them and against a fresh exact tracker around the model's own loss
(``support.measured_step``). Then every planning path itself, for every model, as ``benchmarks/every_model.py``
runs it: ``profile`` (the task inferred from the model), ``auto`` at a fixed batch, escalation from vanilla, AutoBatch
with ``auto`` and the validator's batch, each choice measured again by a fresh exact tracker around the model's own
loss.
"""

import sys
from pathlib import Path

import pytest

from yolo_ckpt.memory.step import StepShape, build_model, step_bytes, validation_bytes, with_plan
from yolo_ckpt.planning.search import deepest

from support import measured_step

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import every_model  # noqa: E402  the benchmark's own paths and claims, not a copy of them

MODELS = every_model.MODELS  # Ultralytics' default model of every task, the yolo11 ones where heads differ, RT-DETR
IMGSZ, BATCH, OBJECTS = 64, 2, 4


@pytest.mark.parametrize("name", MODELS)
def test_the_planning_batch_carries_every_key_the_loss_reads(name):
    model = build_model(name)
    # planning's step (its batch, its loss) against the independent one: the same bytes within the batch's own
    # tensors, which planning counts from shapes and the fresh tracker sees allocated
    planned, fresh = step_bytes(model, StepShape(IMGSZ, BATCH, OBJECTS)), measured_step(model, IMGSZ, BATCH, OBJECTS)
    assert abs(planned - fresh) <= 0.02 * fresh, (planned, fresh)
    least = deepest(model)  # escalation's last plan, every unit recomputed
    m = with_plan(model, least.with_loss(None))
    assert measured_step(m, IMGSZ, BATCH, OBJECTS) < fresh
    # the validator's forward and loss in eval mode (its batch, twice the training batch, counted: more than one image)
    shape = StepShape(IMGSZ, BATCH, OBJECTS)
    assert validation_bytes(model, shape.at(2 * BATCH)) > validation_bytes(model, shape.at(1))


# Every planning path on the yolo26 segmentation (the sem_masks key once), classification and semantic models. The
# others (``benchmarks/every_model.py`` runs them all) differ from these in what the planning step and the
# least-keeping plan measure, tested above for every model, not in how a path chooses from those measurements;
# RT-DETR's and yolo26n-depth's auto and AutoBatch also train in ``test_auto_tasks.py``. The seven left out took 310 s
# of CI's 20 minutes (rtdetr-l 80 s, yolo26n 38 s, yolo26n-depth 30 s). yolo26n's paths are yolo26n-seg's: its
# YAML is yolo26n-seg's but for the head (Detect, of which Segment26 is a subclass), so the segmenter's paths plan
# every layer the detector has, and the detector's step and least-keeping plan are tested above
PATHS_MODELS = ["yolo26n-seg.yaml", "yolo26n-cls.yaml", "yolo26n-sem.yaml"]


@pytest.mark.heavy(3)
@pytest.mark.parametrize("name", PATHS_MODELS)
def test_every_planning_path_plans_the_model(name):
    """Each path's claim (``every_model.check``), against a fresh exact tracker: ``profile`` measured the model's
    standard plans and every one fit; the plan that keeps the least keeps less than vanilla; ``auto`` chose a plan with
    regions whose step fits its target; escalation from vanilla keeps less; AutoBatch with ``auto`` chose a plan and
    a batch whose step and loop batches fit a share vanilla's batch 1 does not; validation counts its batch."""
    # profile's candidates table (every candidate plan measured: most of a check) is left out, and no step is timed
    # (no claim here is on a time); this checks the plans table, and tests/test_tradeoff.py and
    # tests/test_profiler.py test the candidates table and the times
    rows = every_model.check(name, IMGSZ, BATCH, candidates=False, timed=False)
    assert [path for path, _, _ in rows] == ["profile", "least-keeping plan", "auto (fixed batch)",
                                             "escalation from vanilla", "AutoBatch with auto", "validation"]
    assert all(ok for _, ok, _ in rows), rows
