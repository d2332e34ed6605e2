"""``checkpoint_compare``: the run's plan against vanilla at the batch each process trained."""

from copy import deepcopy
from types import SimpleNamespace

import torch
from ultralytics.cfg import get_cfg
from ultralytics.nn.tasks import DetectionModel

from yolo_ckpt.memory.step import StepShape, measure_peak, training_batch
from yolo_ckpt.regions.install import enable_checkpointing
from yolo_ckpt.regions.plan import CheckpointPlan
from yolo_ckpt.report import summary

from support import MINI


def test_compare_under_ddp_measures_the_batch_of_one_rank(monkeypatch, tmp_path):
    """Ultralytics' ``batch_size`` is the global batch; under DDP each rank trains ``batch_size // world_size``
    images, and that is the step compared (it measured the global batch, on one GPU), checked against the plain step
    measured independently at that batch."""
    model = DetectionModel(deepcopy(MINI), verbose=False).train()
    model.args = get_cfg()
    enable_checkpointing(model, CheckpointPlan.from_spec(model, [1, 2]))
    batches = []

    def compare(m, shape, *args, **kwargs):
        batches.append(shape.batch)
        return real(m, shape, *args, **kwargs)

    real = summary.compare_plans
    monkeypatch.setattr(summary, "compare_plans", compare)
    trainer = SimpleNamespace(model=model, batch_size=4, world_size=2, csv=tmp_path / "results.csv", amp=False,
                              device=torch.device("cpu"),
                              args=SimpleNamespace(checkpoint_compare=True, imgsz=64, amp=False))
    vanilla, ours = summary.compare_with_vanilla(trainer)
    assert batches == [2]
    plain = DetectionModel(deepcopy(MINI), verbose=False).train()
    plain.load_state_dict(model.state_dict())
    plain.args = get_cfg()
    peak = measure_peak(plain, training_batch(plain, StepShape(64, 2))).peak
    assert vanilla["peak_MiB"] == round(peak / 2**20, 1) and ours["peak_MiB"] < vanilla["peak_MiB"]


def test_compare_counts_the_loss_plan(tmp_path):
    """A run that recomputes only its loss (``checkpoint_loss=exact``) is compared too: vanilla's step is the plain
    model's and ours the model with the loss plan, each against an independent ``measure_peak``."""
    from yolo_ckpt.memory.step import build_model
    from yolo_ckpt.regions.loss.install import enable_loss_checkpointing

    model = build_model("yolo11n-seg.yaml")
    plain = deepcopy(model)
    enable_loss_checkpointing(model, "exact")
    trainer = SimpleNamespace(model=model, batch_size=2, world_size=1, csv=tmp_path / "results.csv", amp=False,
                              device=torch.device("cpu"),
                              args=SimpleNamespace(checkpoint_compare=True, imgsz=128, amp=False))
    vanilla, ours = summary.compare_with_vanilla(trainer)
    data = training_batch(plain, StepShape(128, 2))
    assert vanilla["peak_MiB"] == round(measure_peak(plain, data).peak / 2**20, 1)
    assert ours["plan"] == "loss exact" and ours["peak_MiB"] == round(measure_peak(model, data).peak / 2**20, 1)
    assert ours["peak_MiB"] < vanilla["peak_MiB"]
