"""Every detection model family Ultralytics ships, at scale n: stages derived and one training step bit for bit with
all stages recomputed, or one clear line.

The list is read from Ultralytics' own ``cfg/models`` (every YAML whose last layer is a detection head), so a family
added upstream is tested without editing this file. One ``model.loss`` forward + backward per model at 64 px on two
copies, vanilla and checkpointed: gradients, BatchNorm buffers and the loss equal to the bit, and every stage layer
run twice (forward + recompute), every other layer once.
"""

import re
from copy import deepcopy
from pathlib import Path

import pytest
import torch
import ultralytics
from ultralytics.utils import YAML

from yolo_ckpt import CheckpointPlan, enable_checkpointing, model_stages
from yolo_ckpt.memory.step import StepShape, build_model, training_batch
from yolo_ckpt.regions.families import check_supported
from yolo_ckpt.regions.install import UnsupportedModelError

from support import assert_same

MODELS = Path(ultralytics.__file__).parent / "cfg" / "models"
DETECT_HEADS = {"Detect", "v10Detect", "RTDETRDecoder", "WorldDetect", "YOLOEDetect"}
SIZES = "tnsmbclex"  # Ultralytics' size letters, smallest first (yolov9 ships t, s, m, c, e as separate files)


def detection_models() -> list[str]:
    """Each detection YAML at scale n: ``scales`` with n -> the n name (yolov8-p2 -> yolov8n-p2); a file per size
    (yolov9t..e, yolov10n..x) -> the smallest of its directory; a file without sizes (yolov3, -spp, -tiny) as it is."""
    smallest: dict[str, tuple[int, str]] = {}
    names = []
    for f in sorted(MODELS.glob("*/*.yaml")):
        cfg = YAML.load(f)
        if cfg["head"][-1][2] not in DETECT_HEADS:
            continue
        scales = list(cfg.get("scales") or {})
        size = re.match(r"yolo(?:e-)?v?\d+([a-z])\b", f.stem)
        if "n" in scales and len(scales) > 1:
            names.append(re.sub(r"^(yolo(?:e-)?v?\d+)", r"\g<1>n", f.stem) + ".yaml")
        elif size or len(scales) == 1:
            letter = size.group(1) if size else scales[0]
            rank = SIZES.index(letter) if letter in SIZES else len(SIZES)
            if f.parent.name not in smallest or rank < smallest[f.parent.name][0]:
                smallest[f.parent.name] = (rank, f.name)
        elif not scales:
            names.append(f.name)
    return names + [name for _, name in smallest.values() if not name.startswith("rtdetr")]  # rtdetr-l: its own test


def one_step(model: torch.nn.Module, batch: dict) -> tuple:
    """Loss, gradients and state (BatchNorm buffers) after one forward + backward, and each layer's forwards."""
    counts = [0] * len(model.model)

    def count(m, args):
        counts[m.i] += 1

    hooks = [m.register_forward_pre_hook(count) for m in model.model]
    torch.manual_seed(0)  # the same draws for both copies (RT-DETR's denoising queries)
    loss = model.loss(batch)[0]
    loss.sum().backward()
    for h in hooks:
        h.remove()
    grads = {k: p.grad for k, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads, model.state_dict(), counts


def test_the_list_covers_every_family():
    names = detection_models()
    for expected in ("yolov3-tiny.yaml", "yolov3.yaml", "yolov5n.yaml", "yolov5n-p6.yaml", "yolov6n.yaml",
                     "yolov8n.yaml", "yolov8n-ghost-p2.yaml", "yolov8n-p6.yaml", "yolov9t.yaml", "yolov10n.yaml",
                     "yolo11n.yaml", "yolo12n.yaml", "yolo26n.yaml", "yolo26n-p2.yaml", "yolo26n-p6.yaml"):
        assert expected in names
    assert len(names) == len(set(names))


@pytest.mark.parametrize("name", detection_models())
def test_family_trains_one_step_bitwise_with_all_stages(name):
    try:
        check_supported(name)
    except UnsupportedModelError as e:  # the other outcome: one line naming what is valid
        message = str(e)
        assert "\n" not in message and "Valid" in message and name in message, message
        with pytest.raises(UnsupportedModelError):  # and a built model is refused, not trained unrecomputed
            model = build_model(name)
            enable_checkpointing(model, CheckpointPlan.from_spec(model, "all"))
        return
    vanilla = build_model(name)
    stages = model_stages(vanilla)  # raises for a model without stages: none of Ultralytics' detectors
    assert min(stages) >= 1 and sorted(i for v in stages.values() for i in v) == list(
        range(sum(map(len, stages.values())))), stages  # contiguous from layer 0: every backbone layer in a stage
    ckpt = deepcopy(vanilla)
    plan = CheckpointPlan.from_spec(ckpt, "all")
    enable_checkpointing(ckpt, plan)
    batch = training_batch(vanilla, StepShape(64, 2, 3))  # 2: a P6 BatchNorm sees 1x1 maps
    torch.use_deterministic_algorithms(True)  # as Ultralytics' deterministic=True
    try:
        v_loss, v_grads, v_state, v_counts = one_step(vanilla, batch)
        c_loss, c_grads, c_state, c_counts = one_step(ckpt, batch)
    finally:
        torch.use_deterministic_algorithms(False)
    assert_same(c_loss, v_loss, f"{name} loss")
    assert_same(c_grads, v_grads, f"{name} gradients")
    assert_same(c_state, v_state, f"{name} state (BatchNorm buffers)")
    recomputed = {i for r in plan.regions for i in r.layers}
    assert c_counts == [2 * n if i in recomputed else n for i, n in enumerate(v_counts)] and min(v_counts) == 1
