"""``checkpoint_stages=auto`` with AutoBatch through the RT-DETR, semantic segmentation and depth trainers.

The budget is set from steps measured here with a fresh exact tracker, beside them the batches Ultralytics' loop
holds (counted from real batches), on the model Ultralytics' own trainer of the task builds (the dataset's classes,
its AutoBatch's label count), so that vanilla does not fit and the whole network does. What training then does is
compared with the independent references: those measured steps, the exact memory of the real epoch, and vanilla
Ultralytics with its own AutoBatch finding the batch planning gave, bit for bit with forward counts.
"""

from pathlib import Path
from unittest import mock

import pytest
import yaml
from ultralytics.utils import YAML
from ultralytics.utils.patches import torch_load

from yolo_ckpt.integration.settings import saved_settings
from yolo_ckpt.memory.step import with_plan
from yolo_ckpt.regions.families import ultralytics_class
from yolo_ckpt.regions.settings import PlanSettings

from support import (
    RTDETR_TINY,
    assert_same_training,
    loop_batches,
    measured_step,
    results,
    train_run,
    val_batch,
    write_depth_set,
    write_polygon_set,
)

CASES = {  # model: (dataset writer, None for the embedded detect set; imgsz; share of its 16 training images used)
    "rtdetr-tiny.yaml": (None, 128, 0.25),  # RTDETR_TINY: RTDETRTrainer, its loss and denoising draws, in seconds
    # (rtdetr-l: a few seconds per planning step on CPU; its recompute is tested in test_rtdetr.py)
    "yolo26n-sem.yaml": (write_polygon_set, 128, 1.0),
    # at 128-160 px the depth model's real epoch peaks in AdamW's step (its temporaries, ~4.5 MiB, which planning does
    # not count), 1-3% over a training step's bytes: 224 px, where the share lies 8.9 MB (7%) above the real epoch's
    # peak, twice those temporaries (192 px: 2.5 MB; 256 px, 23% slower: 17 MB)
    "yolo26n-depth.yaml": (write_depth_set, 224, 1.0),
}
PLAN_KEYS = ("checkpoint_stages", "checkpoint_layers", "checkpoint_mode")


def ultralytics_model(name: str, data: str, imgsz: int, fraction: float, project: Path):
    """The model Ultralytics' own trainer of the task builds for ``data``, and the labelled objects per image its
    AutoBatch counts (the most in one training image, x4 for mosaic) — no yolo-ckpt code involved."""
    plain = ultralytics_class(name)(name)
    trainer = plain.task_map[plain.task]["trainer"](overrides={
        "model": name, "data": data, "imgsz": imgsz, "fraction": fraction, "device": "cpu", "workers": 0,
        "plots": False, "project": str(project)})
    trainer.model = trainer.get_model(cfg=name, verbose=False)
    trainer.set_model_attributes()  # nc, names and the loss's hyperparameters, as in _setup_train
    dataset = trainer.build_dataset(trainer.data["train"], mode="train", batch=16)
    labels = [x for x in getattr(dataset, "labels", []) if isinstance(x, dict) and "cls" in x]
    return trainer.model.float().train(), max(max((len(x["cls"]) for x in labels), default=0) * 4, 1)


@pytest.mark.parametrize("name", list(CASES))
def test_auto_with_autobatch_trains_like_vanilla(name, detect_data, tmp_path):
    write, imgsz, fraction = CASES[name]
    if name == "rtdetr-tiny.yaml":  # "rtdetr" in the name: `yolo train` and yolo-ckpt build it with RTDETR
        YAML.save(tmp_path / name, RTDETR_TINY)
        name = str(tmp_path / name)
    data = detect_data if write is None else write(tmp_path / "data", size=imgsz, images={"train": 4, "val": 2})
    model, objects = ultralytics_model(name, data, imgsz, fraction, tmp_path / "probe")

    def held(plan: PlanSettings, b: int) -> int:  # the plan's step at b, and the training loop's other batches
        return measured_step(with_plan(model, plan), imgsz, b, objects) + loop_batches(model, imgsz, b, objects)

    vanilla_1, whole_1 = (held(plan, 1) for plan in (PlanSettings(), PlanSettings.of("all", "full", "head")))
    assert whole_1 < vanilla_1
    share = (vanilla_1 + whole_1) // 2  # vanilla does not fit even one image; the whole network does
    budget = f"{int(share / 0.6) + 1}B"  # batch=-1: 60% of memory_budget

    kw = dict(epochs=1, imgsz=imgsz, fraction=fraction)
    ckpt = train_run(name, data, tmp_path, "ckpt", {"checkpoint_stages": "auto", "memory_budget": budget},
                     batch=-1, **kw)
    last = torch_load(ckpt / "weights" / "last.pt")
    batch = last["train_args"]["batch"]
    chosen = yaml.safe_load((ckpt / "args.yaml").read_text())
    plan = {k: chosen[k] for k in PLAN_KEYS}
    assert 1 <= batch <= 4 and plan["checkpoint_stages"] != "auto"
    assert {k: saved_settings(last)[k] for k in PLAN_KEYS} == plan  # resume continues with the chosen plan

    # the chosen plan's step at that batch with the loop's batches fits the share, measured again here; vanilla's not
    assert held(PlanSettings.from_keys(plan).with_loss(None), batch) <= share
    assert held(PlanSettings(), batch) > share
    # the real epoch, every tensor of the training process tracked, stayed inside the share too
    assert 0 < float(results(ckpt)[0]["mem/peak_tensor_GB"]) * 2**30 <= share

    # vanilla Ultralytics' own AutoBatch (it builds the training set to count labels, which draws from `random`, as
    # ours does), on a GPU where it finds that batch; its validator at the batch planning gave ours (at most
    # Ultralytics' own: where validation would not fit the share, planning lowers it, and the validation losses
    # average over those batches)
    assert 1 <= (at := val_batch(ckpt)) <= 2 * batch
    with mock.patch("ultralytics.engine.trainer.check_train_batch_size", return_value=batch):
        vanilla = train_run(name, data, tmp_path, "vanilla", batch=-1, val_at=at, **kw)
    assert_same_training(name, plan["checkpoint_stages"], vanilla, ckpt, layers=plan["checkpoint_layers"] or None)
