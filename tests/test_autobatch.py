"""Budget planning against exact tensor accounting of real training steps, and AutoBatch inside the trainer."""

from pathlib import Path

import pytest
import torch
import ultralytics
from ultralytics.cfg import get_cfg
from ultralytics.utils.patches import override_configs
from ultralytics.utils.torch_utils import unwrap_model

from yolo_ckpt import YOLO, CheckpointConfigError, DetectionTrainer, checkpoint_plan
from yolo_ckpt.memory.step import StepShape, build_model, training_batch, with_plan
from yolo_ckpt.memory.tracker import LiveTensorTracker
from yolo_ckpt.planning.autobatch import parse_memory, plan_batch
from yolo_ckpt.regions.settings import PlanSettings

from support import TRAIN_ARGS, loop_batches, measured_step, results


@pytest.mark.parametrize("text, nbytes", [("24GB", 24 * 2**30), ("512 MiB", 512 * 2**20), (24, 24 * 2**30),
                                          ("1.5gb", int(1.5 * 2**30)), ("80GiB", 80 * 2**30)])
def test_parse_memory(text, nbytes):
    assert parse_memory(text) == nbytes


@pytest.mark.parametrize("bad", ["lots", "24XB", "-1GB", 0, True, "GB", [24]])
def test_parse_memory_rejects(bad):
    with pytest.raises(ValueError, match="Valid: a positive size"):
        parse_memory(bad)


def test_budget_gives_checkpointed_yolo11n_at_least_1_6x_the_batch():
    model, budget, fraction, imgsz = build_model("yolo11n.yaml"), parse_memory("0.75GB"), 0.6, 320
    vanilla = plan_batch(with_plan(model, PlanSettings.of([])), StepShape(imgsz), budget, fraction)
    ckpt_model = with_plan(model, PlanSettings.of("all"))
    ckpt = plan_batch(ckpt_model, StepShape(imgsz), budget, fraction)
    assert ckpt.batch >= 1.6 * vanilla.batch, (ckpt, vanilla)
    def held(b: int) -> int:  # the step at b and the training loop's other batches beside it
        return measured_step(ckpt_model, imgsz, b) + loop_batches(ckpt_model, imgsz, b)

    assert held(ckpt.batch) <= fraction * budget  # the chosen batch fits, the loop's batches included
    assert held(ckpt.batch + 1) > fraction * budget  # and is the largest that does


class SpyTrainer(DetectionTrainer):
    """Records what AutoBatch changed on the model (its probe steps must run on copies), the exact peak of the whole
    planning (the training model's tensors included), the dtypes its steps ran in and the stages it planned for."""

    def auto_batch(self):
        model = unwrap_model(self.model)
        before = {k: v.clone() for k, v in model.state_dict().items()}
        dtypes = set()
        hook = model.model[1].register_forward_hook(lambda m, i, out: dtypes.add(out.dtype))  # copies share the hook
        with LiveTensorTracker() as tracker:
            tracker.track([*model.parameters(), *model.buffers()])
            batch = super().auto_batch()
        hook.remove()
        self.planning_peak, self.step_dtypes = tracker.peak, dtypes
        self.touched = [k for k, v in model.state_dict().items() if not torch.equal(v, before[k])]
        self.planned_stages = checkpoint_plan(model).stages
        return batch


def test_trainer_autobatch_plans_for_the_budget(detect_data, tmp_path):
    model = YOLO("yolo11n.yaml")
    model.train(trainer=SpyTrainer, data=detect_data, project=str(tmp_path), checkpoint_stages="all",
                memory_budget="400MB", **{**TRAIN_ARGS, "epochs": 1, "imgsz": 320, "batch": 0.5})
    trainer = model.trainer
    b = trainer.batch_size
    assert b == trainer.args.batch < 16 and int(trainer.run_memory.batch_without) < b  # planned, not the CPU default 16
    assert trainer.touched == []  # no BatchNorm statistic or weight moved while planning
    assert trainer.step_dtypes == {torch.float32}  # CPU training runs without autocast, and so did planning
    # planning itself, copies and probe steps included, stayed inside the share it planned for
    assert 0 < trainer.planning_peak <= 0.5 * parse_memory("400MB")
    # the real epoch at that batch, measured by the exact tracker, stays within 50% of the budget
    row = results(Path(trainer.save_dir))[0]
    assert 0 < float(row["mem/peak_tensor_GB"]) * 2**30 <= 0.5 * parse_memory("400MB")


def test_budget_planning_measures_the_loss_plan(tmp_path, monkeypatch):
    """``checkpoint_loss=exact`` with ``memory_budget`` AutoBatch: the probe steps run the loss plan (each image's
    mask loss a region), the log names it, and the real epoch at the chosen batch stays within the share."""
    from yolo_ckpt import SegmentationTrainer
    from yolo_ckpt.data.synthetic import synthetic_dataset
    from yolo_ckpt.regions.loss import segmentation

    calls = []
    real = segmentation._image_mask_loss
    monkeypatch.setattr(segmentation, "_image_mask_loss", lambda *a: calls.append(1) or real(*a))

    class Planning(SegmentationTrainer):
        def auto_batch(self):
            batch = super().auto_batch()
            self.planning_calls = len(calls)
            return batch

    model = YOLO("yolo11n-seg.yaml")
    model.train(trainer=Planning, data=str(synthetic_dataset("segment", variant="synthetic_dense")),
                project=str(tmp_path), checkpoint_stages="all", checkpoint_loss="exact", memory_budget="250MB",
                **{**TRAIN_ARGS, "epochs": 1, "imgsz": 192, "batch": 0.5, "val": False})
    trainer = model.trainer
    assert trainer.planning_calls > 0 and 1 < trainer.batch_size < 16  # planned with the loss plan
    row = results(Path(trainer.save_dir))[0]
    assert 0 < float(row["mem/peak_tensor_GB"]) * 2**30 <= 0.5 * parse_memory("250MB")


class BF16Planning(SpyTrainer):
    """AutoBatch as a CUDA run with ``amp=bf16`` plans; Ultralytics' trainer refuses bf16 autocast on CPU, so the
    run's AMP state is set only for AutoBatch, and torch's CPU autocast stands in for CUDA's."""

    def auto_batch(self):
        with override_configs(self.args, {"amp": "bf16"}):
            self.amp = True
            try:
                return super().auto_batch()
            finally:
                self.amp = False


def test_planning_measures_the_runs_autocast_and_the_plan_that_trains(detect_data, tmp_path):
    model = YOLO("yolo11n.yaml")
    model.train(trainer=BF16Planning, data=detect_data, project=str(tmp_path), checkpoint_stages="all", freeze=3,
                memory_budget="200MB", **{**TRAIN_ARGS, "epochs": 1, "imgsz": 128, "batch": 0.5, "val": False})
    trainer = model.trainer
    assert torch.bfloat16 in trainer.step_dtypes  # the probe steps ran under the run's autocast dtype
    assert trainer.planned_stages == [3, 4, 5]  # frozen stages 1-2 were dropped before measuring


def test_bad_budget_rejected_before_any_work(tmp_path):
    with pytest.raises(CheckpointConfigError, match="memory_budget='lots' is invalid"):
        YOLO("yolo11n.yaml").train(data=str(tmp_path / "missing.yaml"), project=str(tmp_path), memory_budget="lots")
    assert list(tmp_path.iterdir()) == []


def vanilla_autobatch(imgsz: int, fraction: float, max_num_obj: int) -> int:
    """Ultralytics' own AutoBatch on a plain yolo11n as its trainer has it on CUDA (channels_last, fp16 autocast), not
    capped by a dataset size: the independent reference for what the same share gives without checkpointing."""
    from ultralytics.utils.autobatch import check_train_batch_size

    plain = ultralytics.YOLO("yolo11n.yaml").model.to(0).to(memory_format=torch.channels_last)
    plain.args = get_cfg()
    try:
        return check_train_batch_size(plain, imgsz, amp=True, batch=fraction, max_num_obj=max_num_obj)
    finally:
        del plain
        torch.cuda.empty_cache()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA AutoBatch needs a GPU")
def test_cuda_autobatch_and_epoch_memory(detect_data, tmp_path):
    """AutoBatch on CUDA for a share of the GPU at which vanilla's batch is well under the 16 training images (so
    neither the dataset cap nor AutoBatch's fallback of 16 can pass the test): the checkpointed model gets a larger
    batch than vanilla, measured independently with Ultralytics' own AutoBatch on a plain model."""
    imgsz, images = 1280, 16
    labels = (Path(detect_data).parent / "labels" / "train").glob("*.txt")
    max_num_obj = 4 * max(len(f.read_text().splitlines()) for f in labels)  # mosaic, as Ultralytics' trainer counts
    free, _ = torch.cuda.mem_get_info(0)
    fraction = min(0.9, 4 * 2**30 / (free + torch.cuda.memory_reserved(0)))  # about 4 GB, on any GPU
    vanilla = vanilla_autobatch(imgsz, fraction, max_num_obj)
    if vanilla > 8:  # less memory per image than assumed: aim at a vanilla batch of about 6
        fraction *= 6 / vanilla
        vanilla = vanilla_autobatch(imgsz, fraction, max_num_obj)
    assert 1 <= vanilla <= 10 < images, (vanilla, fraction)
    model = YOLO("yolo11n.yaml")
    model.train(data=detect_data, project=str(tmp_path), checkpoint_stages="all", epochs=1, imgsz=imgsz,
                batch=fraction, device=0, workers=0, plots=False, val=False)
    trainer = model.trainer
    assert trainer.batch_size > vanilla, (trainer.batch_size, vanilla)  # checkpointing bought batch
    assert abs(int(trainer.run_memory.batch_without) - vanilla) <= 1  # what the log reports for "without" is vanilla's
    row = results(Path(trainer.save_dir))[0]
    alloc, reserved = float(row["mem/peak_alloc_GB"]), float(row["mem/peak_reserved_GB"])
    assert 0 < alloc <= reserved <= torch.cuda.get_device_properties(0).total_memory / 2**30


@pytest.mark.parametrize("name", ["yolo26n-sem.yaml", "yolo26n-depth.yaml"])
def test_budget_planning_counts_the_semantic_and_depth_losses(name):
    """The planned batch's real step — Ultralytics' loss on every pixel included — fits with the training loop's
    other batches beside it, measured independently, in a budget where batch 3's step fits alone but not with them
    (yolo26n-sem plans batch 3 there when the loop's batches are not counted); the whole network checkpointed.

    (The largest fitting batch is not promised: at small images parameter gradients dominate a batch-1 step, and the
    bound planning extrapolates from it is conservative.)"""
    model, imgsz, fraction = with_plan(build_model(name), PlanSettings.of("all", "full", "head")), 96, 0.6
    steps = {b: measured_step(model, imgsz, b) for b in (1, 2, 3)}
    held = {b: steps[b] + loop_batches(model, imgsz, b) for b in steps}
    budget = int((steps[3] + held[3]) / 2 / fraction)  # batch 3's step fits, not with the loop's batches
    batch = plan_batch(model, StepShape(imgsz), budget, fraction).batch
    assert 1 <= batch <= 2 and held[batch] <= fraction * budget


@pytest.mark.parametrize("name", ["yolo26n-sem.yaml", "yolo26n-depth.yaml"])
def test_planning_batch_has_the_format_of_ultralytics_batches(name, tmp_path):
    """The keys the loss reads, with the dtype and shape Ultralytics' dataset, collate and preprocess give them."""
    from ultralytics.models.yolo.depth import DepthTrainer
    from ultralytics.models.yolo.semantic import SemanticSegmentationTrainer

    from support import write_depth_set, write_polygon_set

    semantic = "-sem" in name
    data = (write_polygon_set if semantic else write_depth_set)(tmp_path / "d", size=128)
    cls = SemanticSegmentationTrainer if semantic else DepthTrainer
    trainer = cls(overrides={"model": name, "data": data, "imgsz": 128, "device": "cpu", "workers": 0,
                             "project": str(tmp_path), "plots": False})
    trainer.model = trainer.get_model(cfg=name, verbose=False)  # the dataset reads its stride, as in _setup_train
    loader = trainer.get_dataloader(trainer.data["train"], batch_size=2, rank=-1, mode="train")
    real = trainer.preprocess_batch(next(iter(loader)))
    ours = training_batch(build_model(name), StepShape(128, 2))
    key = "semantic_mask" if semantic else "depth"
    assert ours[key].dtype == real[key].dtype and ours[key].shape == real[key].shape, (real[key].shape, key)
    assert ours["img"].dtype == real["img"].dtype and ours["img"].shape == real["img"].shape
