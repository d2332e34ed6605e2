"""Stage derivation against an independent reference: the `Pk/2^k` comments of Ultralytics' own model YAMLs."""

import re
from copy import deepcopy
from pathlib import Path
from unittest import mock

import pytest
import torch
import ultralytics
from ultralytics.nn.tasks import ClassificationModel, DetectionModel

from yolo_ckpt import enable_checkpointing
from yolo_ckpt.regions import graph
from yolo_ckpt.regions.graph import backbone_stages, head_layers, model_stages
from yolo_ckpt.regions.plan import CheckpointPlan
from yolo_ckpt.regions.spec import CheckpointConfigError, Span, parse_layer_spec, parse_stage_spec

CFG = Path(ultralytics.__file__).parent / "cfg" / "models"


def commented_stage_starts(yaml_file: Path) -> dict[int, int]:
    """Stage k -> first layer index, read from comments such as `- [-1, 1, Conv, [128, 3, 2]] # 1-P2/4`."""
    text = yaml_file.read_text().split("head:")[0]
    return {int(k): int(i) for i, k in re.findall(r"#\s*(\d+)-P(\d+)/\d+", text)}


@pytest.mark.parametrize(
    "family, name",
    [("v8", "yolov8"), ("11", "yolo11"), ("26", "yolo26"), ("v8", "yolov8-p6"), ("11", "yolo11-cls")],
)
@pytest.mark.parametrize("scale", ["n", "s", "x"])
def test_stages_match_yaml_comments(family, name, scale):
    yaml_file = CFG / family / f"{name}.yaml"
    starts = commented_stage_starts(yaml_file)
    stem, _, suffix = name.partition("-")
    stages = model_stages(f"{stem}{scale}{'-' + suffix if suffix else ''}.yaml")
    assert {k: layers[0] for k, layers in stages.items()} == starts
    flat = [i for k in sorted(stages) for i in stages[k]]
    assert flat == list(range(len(flat)))  # contiguous, whole backbone, ascending


@pytest.mark.parametrize("family, name", [("v3", "yolov3-tiny"), ("v3", "yolov3"), ("rt-detr", "rtdetr-l"),
                                          ("rt-detr", "rtdetr-x")])
def test_stride_one_stems_and_hgnet_match_yaml_comments(family, name):
    """yolov3's stride-1 stem convolution joins stage 1 (the first layer to change the stride); RT-DETR's HGStem
    starts at P2/4, so its stages are 2-5."""
    starts = commented_stage_starts(CFG / family / f"{name}.yaml")
    stages = model_stages(f"{name}.yaml")
    first = min(starts)
    assert {k: layers[0] for k, layers in stages.items()} == {**starts, first: 0}
    assert starts[first] > 0 or family == "rt-detr"  # yolov3: layer 0 keeps stride 1, not commented as a stage
    flat = [i for k in sorted(stages) for i in stages[k]]
    assert flat == list(range(len(flat)))


def test_a_model_without_stages_names_checkpoint_layers():
    """A backbone that never changes the stride has no stages: the line names what still works, layer ranges."""
    cfg = {"nc": 2, "backbone": [[-1, 1, "Conv", [8, 3, 1]], [-1, 1, "Conv", [8, 3, 1]]],
           "head": [[-1, 1, "Conv", [8, 3, 2]], [[-1], 1, "Detect", ["nc"]]]}
    with pytest.raises(CheckpointConfigError, match=r"no recognisable backbone stages.*checkpoint_layers=\[first,"):
        CheckpointPlan.from_spec(cfg, "all")
    assert CheckpointPlan.from_spec(cfg, [], [[0, 1]]).regions[0].layers == (0, 1)


def test_built_model_and_task_heads_agree():
    model = DetectionModel("yolo11n.yaml", verbose=False)
    assert model_stages(model) == model_stages("yolo11n.yaml") == model_stages("yolo11n-obb.yaml")
    assert model_stages(model)[5] == (7, 8, 9, 10)  # Conv, C3k2, SPPF, C2PSA
    backbone_stages(model.model, model.yaml)  # the dry run itself (``model_stages`` may find it already done)
    assert all(m.training for m in model.modules())  # the dry run leaves train mode as it found it


def test_dry_run_leaves_batchnorm_untouched():
    model = DetectionModel("yolov8n.yaml", verbose=False)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    backbone_stages(model.model, model.yaml)
    assert all((before[k] == v).all() for k, v in model.state_dict().items())


def test_dry_runs_run_once_per_architecture(monkeypatch):
    """Plans resolved on copies of a model, with other plans installed meanwhile (as planning resolves them), equal
    the plans resolved with every dry run run afresh, and each dry run (stages, head, parts) runs once for the
    architecture; another architecture (yolov8n) runs its own; at most
    ``FOUND_KEPT`` are remembered."""
    specs = [([2, 3], None), ("all", "head"), ([], ["2.cv1", "6.*:selective"]), ([3], ["8.*"]), ("all", "head")]
    n, s = DetectionModel("yolo11n.yaml", verbose=False), DetectionModel("yolov8n.yaml", verbose=False)

    def fresh(model, spec):
        graph._FOUND.clear()
        return CheckpointPlan.from_spec(model, *spec)

    alone = {name: [fresh(model, spec) for spec in specs] for name, model in (("n", n), ("s", s))}
    assert alone["n"] != alone["s"]  # not one architecture's answer for both
    graph._FOUND.clear()
    runs = {f: mock.patch.object(graph, f, wraps=getattr(graph, f)) for f in
            ("backbone_stages", "head_layers", "model_parts")}
    with runs["backbone_stages"] as backbone, runs["head_layers"] as head, runs["model_parts"] as parts:
        for name, model in (("n", n), ("s", s)):
            copy = deepcopy(model)
            for spec, expected in zip(specs, alone[name]):
                plan = CheckpointPlan.from_spec(deepcopy(model), *spec)
                enable_checkpointing(copy, CheckpointPlan.from_spec(copy, *spec))  # one copy, plan after plan
                assert plan == expected
        assert backbone.call_count == head.call_count == parts.call_count == 2  # once per architecture
        monkeypatch.setattr(graph, "FOUND_KEPT", 1)
        CheckpointPlan.from_spec(ClassificationModel("yolo11n-cls.yaml", verbose=False), "all")
        assert len(graph._FOUND) == 1 and backbone.call_count == 3
        CheckpointPlan.from_spec(n, "all")  # forgotten: found again
        assert len(graph._FOUND) == 1 and backbone.call_count == 4


@pytest.mark.parametrize(
    "spec, expected",
    [(None, []), ([], []), (3, [3]), ([3, 2], [2, 3]), ((1, 5), [1, 5]), ("all", None), ("ALL", None),
     ("2", [2]), ("[3, 2]", [2, 3])],  # a string holding a value means what the command line's token means
)
def test_parse_valid_specs(spec, expected):
    assert parse_stage_spec(spec) == expected


@pytest.mark.parametrize("spec", [0, -1, [2, 2], 2.0, [2, 3.5], "two", ["2"], {"a": 1}, [[2]], True, [2, None]])
def test_parse_invalid_specs(spec):
    with pytest.raises(CheckpointConfigError) as e:
        CheckpointPlan.from_spec("yolo11n.yaml", spec)
    message = str(e.value)
    assert "\n" not in message and "{1, 2, 3, 4, 5}" in message  # one line naming this model's stages


def test_plan_beyond_model_stages_names_valid_ones():
    with pytest.raises(CheckpointConfigError, match=r"no stage 6.*\{1, 2, 3, 4, 5\}"):
        CheckpointPlan.from_spec("yolo11n.yaml", [2, 6])
    assert CheckpointPlan.from_spec("yolov8n-p6.yaml", [6]).regions[0].layers == (9, 10, 11)


def test_model_without_recognisable_stages():
    flat = {"nc": 1, "backbone": [[-1, 1, "Conv", [16, 3, 1]], [-1, 1, "Conv", [16, 3, 1]]], "head": []}
    with pytest.raises(CheckpointConfigError, match="no recognisable backbone stages"):
        CheckpointPlan.from_spec(flat, "all")
    assert CheckpointPlan.from_spec(flat, []).regions == ()  # off needs no stages


def test_consecutive_stages_share_a_region_only_where_the_boundary_is_read_by_nothing_else():
    model = DetectionModel("yolo11n.yaml", verbose=False)
    plan = CheckpointPlan.from_spec(model, "all")
    assert [r.layers for r in plan.regions] == [(0, 1, 2, 3, 4), (5, 6), (7, 8, 9, 10)]
    assert all(r.layers[-1] in model.save for r in plan.regions)  # each boundary is a tensor the neck reads anyway
    assert [r.stages for r in CheckpointPlan.from_spec(model, [1, 3]).regions] == [(1,), (3,)]  # not consecutive
    assert plan.stages == [1, 2, 3, 4, 5]


def test_stages_merge_only_where_the_next_stage_reads_the_previous_layer():
    """Stage 3's first layer reads layer 1, not layer 2: running stages 2 and 3 as one chain would feed it layer 2."""
    cfg = {"nc": 2, "backbone": [[-1, 1, "Conv", [8, 3, 2]],  # 0-P1/2
                                 [-1, 1, "Conv", [16, 3, 2]],  # 1-P2/4
                                 [-1, 1, "Conv", [16, 3, 1]],  # 2 (read by nothing)
                                 [1, 1, "Conv", [32, 3, 2]]],  # 3-P3/8, from layer 1
           "head": [[-1, 1, "Classify", ["nc"]]]}
    model = ClassificationModel(cfg, verbose=False).train()
    plan = CheckpointPlan.from_spec(model, "all")
    assert [r.layers for r in plan.regions] == [(0, 1, 2), (3,)]
    x = torch.rand(2, 3, 64, 64)
    plain = deepcopy(model)
    enable_checkpointing(model, plan)
    for m in (plain, model):
        m(x).sum().backward()
    for (k, a), b in zip(plain.named_parameters(), model.parameters()):  # layer 2 feeds nothing: no gradient
        assert (a.grad is None and b.grad is None) if k.startswith("model.2.") else torch.equal(a.grad, b.grad), k


def test_frozen_stages_are_dropped_from_the_plan():
    model = DetectionModel("yolo11n.yaml", verbose=False)
    plan = CheckpointPlan.from_spec(model, "all")
    for name, p in model.named_parameters():  # as Ultralytics' freeze=3: layers 0-2
        p.requires_grad = not name.startswith(("model.0.", "model.1.", "model.2."))
    kept, dropped = plan.without_frozen(model)
    assert dropped == [1, 2] and kept.stages == [3, 4, 5]
    for name, p in model.named_parameters():  # layer 1 frozen, but layer 0 trains: a gradient flows through it
        p.requires_grad = not name.startswith("model.1.")
    assert plan.without_frozen(model) == (plan, [])


# ------------------------------------------------------------------------------------------- checkpoint_layers
def storing_head_layers(yaml_file: Path) -> list[int]:
    """Reference: head layers of a model YAML other than nn.Upsample and Concat, which store nothing for backward."""
    cfg = ultralytics.utils.YAML.load(yaml_file)
    n = len(cfg["backbone"])
    return [n + i for i, (_, _, module, _) in enumerate(cfg["head"]) if module not in {"nn.Upsample", "Concat"}]


@pytest.mark.parametrize("family, name", [
    ("11/yolo11.yaml", "yolo11n.yaml"), ("v8/yolov8.yaml", "yolov8s.yaml"), ("26/yolo26.yaml", "yolo26n.yaml"),
    ("11/yolo11-seg.yaml", "yolo11n-seg.yaml"), ("v8/yolov8-p6.yaml", "yolov8n-p6.yaml"),
    ("11/yolo11-cls.yaml", "yolo11n-cls.yaml"),
])
def test_head_regions_are_the_layers_that_store_activations(family, name):
    yaml_file = CFG / family
    built = ultralytics.YOLO(name).model
    plan = CheckpointPlan.from_spec(built, [], "head")
    assert [r.layers for r in plan.regions] == [(i,) for i in storing_head_layers(yaml_file)]
    assert CheckpointPlan.from_spec(built, "all", "head").regions == (
        *CheckpointPlan.from_spec(built, "all").regions, *plan.regions)  # with all stages: the whole network
    built.half().requires_grad_(False)  # as a loaded .pt: what a layer stores in training does not change
    assert CheckpointPlan.from_spec(built, [], "head") == plan and not next(built.parameters()).requires_grad


def test_head_regions_hold_no_tensor_only_for_the_recompute():
    """Every input of a head region is a tensor the plain model's backward keeps anyway."""
    model = DetectionModel("yolo11n.yaml", verbose=False).train()
    stored, outputs = set(), {}

    def pack(t):
        stored.add(t.untyped_storage().data_ptr())
        return t

    hooks = [m.register_forward_hook(lambda m, i, o: outputs.__setitem__(m.i, o)) for m in model.model]
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(torch.zeros(1, 3, 128, 128))
    for h in hooks:
        h.remove()
    for i in head_layers(model.model, model.yaml, first=11):
        m = model.model[i]
        for j in [m.f] if isinstance(m.f, int) else m.f:
            assert outputs[i + j if j < 0 else j].untyped_storage().data_ptr() in stored, (i, j)


@pytest.mark.parametrize("spec, expected", [
    (None, []), ([], []), ("head", None), (" HEAD ", None), (12, [Span(12, 12)]),
    ([22, [13, 15], 16], [Span(13, 15), Span(16, 16), Span(22, 22)]), ((0, (1, 1)), [Span(0, 0), Span(1, 1)]),
    (["13-15", "16:selective", "2.m.0-cv2:FULL", "23.*", "23.cv2.0"],
     [Span(2, 2, ("m.0", "cv2"), "full"), Span(13, 15), Span(16, 16, None, "selective"), Span(23, 23, "*"),
      Span(23, 23, ("cv2.0", "cv2.0"))]),
])
def test_parse_valid_layer_specs(spec, expected):
    assert parse_layer_spec(spec) == expected


@pytest.mark.parametrize("spec", ["neck", "all", -1, 1.0, True, [[3, 2]], [[1, 2, 3]], [[1, 3], 2], [4, 4], {"a": 1},
                                  ["2.cv1:fast"], ["2-4.cv1"], ["2.*-cv2"], ["4-2"], ["1-2", 2], ["2."], ["x.cv1"]])
def test_invalid_layer_specs_name_what_is_valid(spec):
    with pytest.raises(CheckpointConfigError, match=r"Valid: 'head' .* layer indices 0-23, \[first, last\] ranges"):
        CheckpointPlan.from_spec("yolo11n.yaml", [], spec)


def test_layers_beyond_the_model_or_inside_checkpointed_stages_are_rejected():
    with pytest.raises(CheckpointConfigError, match="has no layer 24. Valid: .*0-23"):
        CheckpointPlan.from_spec("yolo11n.yaml", [], [24])
    with pytest.raises(CheckpointConfigError, match=r"layer 4 is already in checkpoint_stages=\[3\] \(stage 3\)"):
        CheckpointPlan.from_spec("yolo11n.yaml", [3], [[4, 6]])


def test_layer_regions_read_earlier_layers_like_ultralytics():
    """Regions whose layers read outside tensors by absolute and relative (-3) index: gradients and BatchNorm
    statistics as the plain model's, and the layers ran twice."""
    cfg = {"nc": 2, "backbone": [[-1, 1, "Conv", [8, 3, 2]],  # 0-P1/2
                                 [-1, 1, "Conv", [16, 3, 2]],  # 1-P2/4
                                 [-1, 1, "Conv", [16, 3, 1]]],  # 2
           "head": [[-1, 1, "Conv", [16, 3, 1]],  # 3
                    [[-1, -3], 1, "Concat", [1]],  # 4: layers 3 and 1 (outside the region)
                    [-1, 1, "Conv", [16, 1, 1]],  # 5
                    [[-1, 3], 1, "Concat", [1]],  # 6: layers 5 and 3 (inside)
                    [-1, 1, "Conv", [16, 1, 1]],  # 7
                    [[-1, 2], 1, "Concat", [1]],  # 8
                    [-1, 1, "Classify", ["nc"]]]}  # 9
    model = ClassificationModel(cfg, verbose=False).train()
    plan = CheckpointPlan.from_spec(model, [], [[3, 7], 9])
    plain = deepcopy(model)
    enable_checkpointing(model, plan)
    counts = [0] * len(model.model)
    for m in model.model:
        m.register_forward_pre_hook(lambda m, a: counts.__setitem__(m.i, counts[m.i] + 1))
    x = torch.rand(2, 3, 32, 32)
    for m in (plain, model):
        m(x).sum().backward()
    assert counts == [1, 1, 1, 2, 2, 2, 2, 2, 1, 2]
    for (k, a), b in zip(plain.state_dict().items(), model.state_dict().values()):
        assert torch.equal(a, b), k
    for (k, a), b in zip(plain.named_parameters(), model.parameters()):
        assert torch.equal(a.grad, b.grad), k


def test_frozen_layer_regions_are_dropped():
    model = DetectionModel("yolo11n.yaml", verbose=False)
    plan = CheckpointPlan.from_spec(model, [3, 4], [[0, 2], 13])
    for name, p in model.named_parameters():  # freeze=3
        p.requires_grad = not name.startswith(("model.0.", "model.1.", "model.2."))
    kept, dropped = plan.without_frozen(model)
    assert dropped == ["layer 0", "layer 1", "layer 2"] and kept.describe() == "stages [3, 4] + layers [13]"
