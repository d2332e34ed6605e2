"""The medical recipe: 1-channel (grayscale) segmentation, its stages, its CLI path, and training bit for bit."""

from pathlib import Path

import pytest
import ultralytics
import yaml
from ultralytics.nn.tasks import SegmentationModel
from ultralytics.utils.patches import torch_load

from yolo_ckpt import TRAINERS, CheckpointPlan, model_stages
from yolo_ckpt.data.synthetic import recipe, synthetic_dataset
from yolo_ckpt.integration import cli
from yolo_ckpt.integration.settings import check_settings
from yolo_ckpt.integration.trainer import YOLO

from support import TRAIN_ARGS, add_counting, assert_recomputed, assert_same_run, forward_counts

MEDICAL = "synthetic_medical"
RECIPE = ["train", "cfg=cfg/medical_2048.yaml"]
YOLO11_STAGES = {1: (0,), 2: (1, 2), 3: (3, 4), 4: (5, 6), 5: (7, 8, 9, 10)}  # docs/plans.md's stage table


@pytest.fixture(scope="module")
def medical_data() -> str:
    """The grayscale segmentation dataset, in the shared dataset cache (generated once)."""
    return str(synthetic_dataset("segment", variant=MEDICAL))


@pytest.mark.parametrize("name", ["yolo11n-seg.yaml", "yolo11s-seg.yaml"])
def test_stages_of_a_one_channel_model(name):
    """A 1-channel stem changes no stage: the dry run feeds the model's own channel count."""
    rgb, gray = (SegmentationModel(name, ch=ch, verbose=False) for ch in (3, 1))
    assert gray.model[0].conv.in_channels == 1 and gray.yaml["channels"] == 1  # really a grayscale model
    assert model_stages(gray) == model_stages(rgb) == YOLO11_STAGES
    assert model_stages(dict(gray.yaml)) == YOLO11_STAGES  # the YAML a grayscale .pt embeds: channels 1, rebuilt
    plan = CheckpointPlan.from_spec(gray, "all")
    assert plan == CheckpointPlan.from_spec(rgb, "all")
    assert [r.layers for r in plan.regions] == [(0, 1, 2, 3, 4), (5, 6), (7, 8, 9, 10)]


def test_recipe_loads_through_the_cli():
    args = cli.parse_train_args(RECIPE)
    assert args["imgsz"] == 2048 and args["checkpoint_stages"] == "all" and args["checkpoint_mode"] == "full"
    assert args["model"].endswith("-seg.yaml") and args["data"] == MEDICAL and cli.embedded_variant(args["data"])
    assert recipe(MEDICAL)["channels"] == 1 and recipe(MEDICAL)["imgsz"] == args["imgsz"]
    check_settings(args["model"], args)  # valid stages and mode for the recipe's model
    plan = CheckpointPlan.from_spec(args["model"], args["checkpoint_stages"], args["checkpoint_layers"])
    assert plan.stages == [1, 2, 3, 4, 5] and args["checkpoint_layers"] == "head" and plan.layer_regions
    mine = cli.parse_train_args([*RECIPE, "data=my_scans.yaml", "imgsz=1024"])  # the command line wins
    assert mine["data"] == "my_scans.yaml" and mine["imgsz"] == 1024 and not cli.embedded_variant(mine["data"])


def test_local_data_of_the_same_name_wins(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert cli.embedded_variant(MEDICAL)
    (tmp_path / MEDICAL).mkdir()  # e.g. the user's own dataset folder
    assert not cli.embedded_variant(MEDICAL) and not cli.embedded_variant("my_scans.yaml")


def test_cli_trains_the_recipe_on_the_grayscale_variant(medical_data, monkeypatch):
    """`yolo-ckpt train cfg=cfg/medical_2048.yaml` reaches Model.train with the grayscale data (not run at 2048)."""
    seen = {}
    monkeypatch.setattr(YOLO, "train", lambda self, **kw: seen.update(kw, task=self.task))
    cli.train([*RECIPE, "epochs=1"])
    assert seen["task"] == "segment" and seen["data"] == medical_data
    assert seen["imgsz"] == 2048 and seen["checkpoint_stages"] == "all" and seen["epochs"] == 1
    assert yaml.safe_load(Path(seen["data"]).read_text())["channels"] == 1


def test_variant_without_the_task_is_one_line(capsys):
    assert cli.main(["pose", "train", f"data={MEDICAL}", "checkpoint_stages=all"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == ("yolo-ckpt: error: data=synthetic_medical: the embedded dataset has no pose labels. "
                   "Valid tasks: detect, segment, obb, semantic, depth.")


def test_one_channel_segmentation_trains_bitwise_like_vanilla(medical_data, tmp_path):
    """yolo11n-seg on the grayscale data, the recipe's whole network: the same run as vanilla Ultralytics, recompute
    counted."""
    model = "yolo11n-seg.yaml"
    # 128 px: the 80-360 px findings of the 2048 px scans become 5-22 px, so box and DFL losses are real (~1e-5 at 96)
    args = {**TRAIN_ARGS, "epochs": 1, "imgsz": 128, "data": medical_data, "project": str(tmp_path), "save_period": 1}
    runs = {}
    for name, extra in (("vanilla", {}), ("ckpt", {"checkpoint_stages": "all", "checkpoint_layers": "head"})):
        m = ultralytics.YOLO(model)
        add_counting(m)
        m.train(**({"trainer": TRAINERS["segment"]} if extra else {}), name=name, **extra, **args)
        runs[name] = Path(m.trainer.save_dir)
    trained = torch_load(runs["ckpt"] / "weights" / "last.pt")["model"]
    assert trained.yaml["channels"] == 1 and trained.model[0].conv.in_channels == 1  # trained as a 1-channel model
    layers = {i for r in CheckpointPlan.from_spec(trained, "all", "head").regions for i in r.layers}
    assert layers == {*range(11), 13, 16, 17, 19, 20, 22, 23}  # all but Upsample and Concat
    assert_recomputed(forward_counts(runs["vanilla"]), forward_counts(runs["ckpt"]), layers)
    assert_same_run(runs["vanilla"], runs["ckpt"])
