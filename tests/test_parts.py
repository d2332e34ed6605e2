"""Regions inside layers: parts found from the built modules, the ``checkpoint_layers`` grammar for them, and every
kind of part region (one part, each part, a run of a layer's own parts, a run inside a Sequential, nested in a layer,
a stage or a run, per-region modes) bit for bit against the plain model, with each convolution's forwards counted.

The reference is the plain model (no yolo-ckpt) for gradients and buffers, and forward hooks on every
``nn.Conv2d`` for what was recomputed: a part recomputed once more runs each of its convolutions once more.
"""

import pickle
from copy import deepcopy

import pytest
import torch
import yaml
from ultralytics.nn.tasks import DetectionModel
from ultralytics.utils import YAML

from yolo_ckpt import CheckpointPlan, disable_checkpointing, enable_checkpointing
from yolo_ckpt.memory.step import StepShape, build_model, step_loss, training_batch
from yolo_ckpt.memory.tracker import LiveTensorTracker
from yolo_ckpt.regions.graph import model_parts
from yolo_ckpt.regions.spec import CheckpointConfigError

from support import RTDETR_TINY, SMALL, assert_exact_and_recomputed, assert_same_training, one_step, train_pair


@pytest.fixture(scope="module")
def yolo11n():
    torch.manual_seed(0)
    return build_model("yolo11n.yaml").train()


def test_parts_are_what_the_forward_calls(yolo11n):
    """As Ultralytics' forwards read (8.4.190): C2f/C3k2 ``cv1``, each of ``m``, ``cv2``; SPPF calls ``m`` three
    times; C2PSA's ``m`` is a Sequential (its blocks are parts too); Detect per branch and scale, then each branch's
    layers; the SiLU every Conv shares is no layer's part."""
    parts = model_parts(yolo11n)
    assert parts[2] == {"": ("cv1", "m.0", "cv2")}
    assert parts[9] == {"": ("cv1", "m", "cv2")}
    assert parts[10] == {"": ("cv1", "m", "cv2"), "m": ("m.0",)}
    assert parts[0] == {"": ("conv", "bn")} and parts[11] == {}  # Conv (its act is shared), Upsample
    detect = parts[23]
    assert detect[""] == tuple(f"{b}.{i}" for b in ("cv2", "cv3") for i in range(3))
    assert detect["cv2.0"] == ("cv2.0.0", "cv2.0.1", "cv2.0.2") and detect["cv3.0.0"] == ("cv3.0.0.0", "cv3.0.0.1")
    c3 = model_parts("yolov5n.yaml")[2]  # C3: cv3(cat(m(cv1(x)), cv2(x))), m a Sequential of Bottlenecks
    assert c3[""] == ("cv1", "m", "cv2", "cv3") and c3["m"] == ("m.0",)


@pytest.mark.parametrize("cfg", ["yolov8n.yaml", "yolo11n-seg.yaml", "yolo11n-pose.yaml", "yolo11n-obb.yaml",
                                 "yolo26n.yaml", "yolo12n.yaml", "yolov9t.yaml", "yolov8n-cls.yaml"])
def test_parts_cover_every_trained_parameter(cfg):
    """Each parameter that gets a gradient in a training step lies in exactly one top-level part of its layer, or
    directly in the layer; parts are named as in state_dict keys."""
    model = build_model(cfg).train()
    step_loss(model, training_batch(model, StepShape(64, 1))).backward()
    parts = model_parts(model)
    for name, p in model.named_parameters():
        i, path = int(name.split(".")[1]), name.split(".", 2)[2]
        if p.grad is None or not parts[i]:
            continue
        owners = [q for q in parts[i][""] if path.startswith(q + ".")]
        assert len(owners) <= 1, (name, owners)
        assert owners or "." not in path, f"{name}: in no part of layer {i} ({parts[i]['']})"


KINDS = [  # (stages, checkpoint_layers, mode)
    ((), ["2.m.0"], "full"),  # one part
    ((), ["2.*", "23.*"], "selective"),  # each part of a layer
    ((), ["2.m.0-cv2"], "full"),  # a run of the layer's own parts (cv1 outside it, served from the forward)
    ((), ["2.cv1-m.0", "2.m.0"], "full"),  # a part nested inside a run
    ((), ["23.cv3.0.0-cv3.0.1:selective", "23.cv2.1"], "full"),  # a run inside a Sequential, per-region modes
    ((), [[0, 4], "2.*", "4.m.0:selective"], "full"),  # parts nested in a layer region
    ((1, 2, 3, 4), ["23.*", "16", "19", "23", "2.*", "4.*", "7-10:selective"], "full"),  # the 0.30x plan
    ((), ["9.cv1-cv2", "10.m.0", "10.cv1"], "full"),  # SPPF's thrice-called m inside a run; C2PSA
    ((2, 3), ["4.cv1-m.0:full", "2.m.0"], "selective"),  # a run of a layer's own parts nested in a stage
]


@pytest.mark.parametrize("stages, layers, mode", KINDS)
def test_part_regions_are_exact_and_recompute_their_parts(yolo11n, stages, layers, mode):
    assert_exact_and_recomputed(yolo11n, training_batch(yolo11n, StepShape(96, 2)), layers, stages, mode)


@pytest.mark.parametrize("cfg", ["yolo11n-seg.yaml", "yolo11n-pose.yaml", "yolo11n-obb.yaml", "yolo26n-sem.yaml",
                                 "yolo26n-depth.yaml", "yolo11n-cls.yaml", "rtdetr-tiny.yaml"])
def test_every_head_per_part_is_exact(cfg, tmp_path):
    """Each task's head (Segment, Pose, OBB per branch and scale; the semantic, depth, classify heads; RT-DETR's
    decoder with its denoising draws) with every part its own region: exact, and every part recomputed."""
    if cfg == "rtdetr-tiny.yaml":
        YAML.save(tmp_path / cfg, RTDETR_TINY)
        cfg = str(tmp_path / cfg)
    torch.manual_seed(0)
    model = build_model(cfg).train()
    layers = [f"{len(model.model) - 1}.*"]
    assert_exact_and_recomputed(model, training_batch(model, StepShape(96, 2)), layers)


@pytest.mark.parametrize("cfg", ["yolov8n.yaml", "yolov5n.yaml", "yolo12n.yaml", "yolov9t.yaml", "yolov10n.yaml"])
def test_every_block_per_part_is_exact(cfg):
    """C2f, C3, A2C2f, RepNCSPELAN4/ADown/SPPELAN, C2fCIB/SCDown/PSA: every part of every layer its own region,
    nested in regions of whole layers two by two."""
    torch.manual_seed(0)
    model = build_model(cfg).train()
    parts = model_parts(model)
    composite = [i for i, tree in parts.items() if any(list(model.model[i].get_submodule(n).children())
                                                      for n in tree.get("", ()))]  # a leaf part's recompute is no call
    layers = [*(f"{i}.*" for i in composite),
              *([i, i + 1] for i in range(0, len(model.model) - 1, 4))]
    assert_exact_and_recomputed(model, training_batch(model, StepShape(64, 1)), layers)


def test_nesting_lowers_the_backward_peak(yolo11n):
    """The whole-network plan with parts nested keeps less than with whole layers only (the exact tracker)."""
    batch = training_batch(yolo11n, StepShape(160, 2))
    layers = ["16", "19", "23", "7-10:selective"]
    coarse = one_step(yolo11n, batch, layers, (1, 2, 3, 4))[3]
    fine = one_step(yolo11n, batch, ["23.*", "2.*", "4.*", *layers], (1, 2, 3, 4))[3]
    assert fine < 0.85 * coarse


def test_part_regions_leave_the_model_plain():
    """state_dict keys and module types unchanged while on; deep copies (the EMA) follow the plan; after
    ``disable_checkpointing`` no module has a forward of its own and the model pickles without yolo_ckpt."""
    model = DetectionModel(SMALL, verbose=False)
    keys, types = list(model.state_dict()), [type(m) for m in model.modules()]
    enable_checkpointing(model, CheckpointPlan.from_spec(model, [2], ["10.*", "9.m.0-cv2", "4.m.0"]), "full")
    assert list(model.state_dict()) == keys and [type(m) for m in model.modules()] == types
    assert any("forward" in vars(m) for m in deepcopy(model).modules())
    disable_checkpointing(model)
    assert not any("forward" in vars(m) for m in model.modules())
    assert b"yolo_ckpt" not in pickle.dumps(model)


@pytest.mark.parametrize("layers, match", [
    (["2.m.1"], r"'m.1' is not a part of layer 2\. Valid parts of layer 2 \(C3k2\): cv1, m.0, cv2"),
    (["23.cv2.0-cv3.0.1"], r"'cv3.0.1' is not a part of layer 23 called by the same module as 'cv2.0'"),
    (["2.cv2-cv1"], r"layer 2 calls 'cv1' before 'cv2'"),
    (["2.cv1-m.0", "2.m.0-cv2"], r"2.cv1-m.0 and 2.m.0-cv2 overlap"),
    (["9.cv1-m", "9.m-cv2"], r"overlap"),
    (["11.*"], r"layer 11 \(Upsample\) has no parts"),
    (["2.m.0-cv2:selective"], r"recomputed full only. Valid: give it ':full'"),
])
def test_bad_part_regions_say_what_is_valid(yolo11n, layers, match):
    with pytest.raises(CheckpointConfigError, match=match):
        enable_checkpointing(deepcopy(yolo11n), CheckpointPlan.from_spec(yolo11n, [], layers), "full")


def test_training_with_parts_is_vanilla_training(tmp_path, detect_data):
    """Ultralytics' trainer end to end (two epochs, EMA, optimizer, validation, saved checkpoints): a stage, parts
    nested in it, Detect per branch selective, a run of a layer's own parts: every saved field bit for bit, and each
    part's convolutions ran once more per region around them."""
    layers = ["10.*:selective", "9.m.0-cv2", "2.*", "4.cv1"]
    cfg = tmp_path / "small.yaml"
    cfg.write_text(yaml.safe_dump(SMALL))
    vanilla, ckpt = train_pair(str(cfg), [1, 2], detect_data, tmp_path, layers=layers, epochs=1)
    assert_same_training(str(cfg), [1, 2], vanilla, ckpt, layers)


def test_compile_with_a_run_of_a_layers_own_parts_is_one_line_before_any_work():
    from yolo_ckpt.integration.settings import check_settings

    with pytest.raises(CheckpointConfigError, match=r"2.m.0-cv2 is a run of parts of layer 2's own forward, which "
                                                    r"compile=True cannot trace in one graph. Valid with compile:"):
        check_settings("yolo11n.yaml", {"checkpoint_layers": ["2.m.0-cv2"], "compile": True})
    check_settings("yolo11n.yaml", {"checkpoint_layers": ["2.m.0", "23.*"], "compile": True})  # single parts compile


def test_a_run_of_all_parts_keeps_what_torch_checkpoint_of_the_layer_keeps(yolo11n):
    """The reference is plain ``torch.utils.checkpoint`` of the whole layer: a run of all the layer's own parts keeps
    exactly its bytes after the forward; a shorter run keeps more (its outside parts store as usual), and less than the
    plain layer."""
    x = torch.randn(2, 32, 64, 64, requires_grad=True)  # layer 2's input

    def kept(run=None, reference=False):
        model = deepcopy(yolo11n)
        if run:
            enable_checkpointing(model, CheckpointPlan.from_spec(model, [], [f"2.{run}"]), "full")
        layer = model.model[2]
        with LiveTensorTracker() as t:
            y = torch.utils.checkpoint.checkpoint(layer, x * 1, use_reentrant=False) if reference else layer(x * 1)
            saved = t.current - y.untyped_storage().nbytes()
        y.sum().backward()
        return saved

    whole = kept(reference=True)
    assert kept("cv1-cv2") == whole
    assert whole < kept("cv1-m.0") < kept()


@pytest.mark.parametrize("layers", [["23.cv3.0", "23.cv3.0.0-cv3.0.1"], ["23.cv3.0.0-cv3.0.1", "23.cv3.0"]])
def test_a_run_inside_a_part_with_its_own_region_is_recomputed_twice(yolo11n, layers):
    """Detect's branch ``cv3.0`` is a region, and a run of its children another one inside it: the branch's recompute
    needs the run's output (the last layer of the branch reads it), so the run's convolutions run three times per
    step, forward, the branch's recompute and their own, whichever order the items are given in."""
    batch = training_batch(yolo11n, StepShape(96, 2))
    assert_exact_and_recomputed(yolo11n, batch, layers)
    convs = one_step(yolo11n, batch, layers)[2]
    run = [n for n in convs if n.startswith(("model.23.cv3.0.0.", "model.23.cv3.0.1."))]
    assert run and all(convs[n] == 3 for n in run), {n: convs[n] for n in run}
