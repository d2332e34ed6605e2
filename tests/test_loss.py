"""checkpoint_loss: the criterion recomputed in backward, against Ultralytics' own loss on the same predictions."""

from __future__ import annotations

import copy

import pytest
import torch
import ultralytics
from ultralytics.utils.loss import v8SegmentationLoss
from ultralytics.utils.tal import TaskAlignedAssigner

from yolo_ckpt.memory.step import StepShape, build_model, training_batch
from yolo_ckpt.memory.tracker import LiveTensorTracker
from yolo_ckpt.regions.loss import assignment, depth, install, segmentation, semantic
from yolo_ckpt.regions.loss.install import disable_loss_checkpointing, enable_loss_checkpointing, loss_checkpointing
from yolo_ckpt.regions.spec import CheckpointConfigError

from support import TRAIN_ARGS, assert_plan_recomputed, assert_same, assert_same_run, train_run


@pytest.fixture
def counted(monkeypatch):
    """Calls of Ultralytics' ``single_mask_loss`` (one per image, or per chunk, forward and recompute) and of
    ``TaskAlignedAssigner._forward`` (the batch it assigned each time)."""
    calls = {"mask": 0, "assign": []}
    mask_loss, assign = v8SegmentationLoss.single_mask_loss, TaskAlignedAssigner._forward

    def single_mask_loss(*args):
        if torch.is_grad_enabled():  # the forward and the recompute; validation is not counted
            calls["mask"] += 1
        return mask_loss(*args)

    def _forward(self, pd_scores, *args, **kwargs):
        calls["assign"].append(pd_scores.shape[0])
        return assign(self, pd_scores, *args, **kwargs)

    monkeypatch.setattr(v8SegmentationLoss, "single_mask_loss", staticmethod(single_mask_loss))
    monkeypatch.setattr(TaskAlignedAssigner, "_forward", _forward)
    return calls


def step(model, batch, how: str = "none", amp=None) -> dict:
    """One training step of a copy of ``model`` with ``checkpoint_loss=how``: loss, loss items, every gradient and the
    exact peak of live tensor bytes."""
    model = copy.deepcopy(model)
    enable_loss_checkpointing(model, how)
    with LiveTensorTracker() as tracker:
        with torch.autocast("cpu", dtype=amp, enabled=amp is not None):
            loss, items = model.loss(batch)
        loss.sum().backward()
    disable_loss_checkpointing(model)
    return {"loss": loss.detach(), "items": items, "peak": tracker.peak,
            "grads": {n: p.grad for n, p in model.named_parameters()}}


def assert_within_rounding(chunked: dict, vanilla: dict) -> None:
    """``step``'s loss and loss items within 1e-5 relative of vanilla's, every gradient within 1e-4 of the largest
    (the bound of ``test_chunked_is_equal_up_to_float_rounding``), and a lower peak."""
    torch.testing.assert_close(chunked["loss"], vanilla["loss"], rtol=1e-5, atol=0)
    for k in vanilla["items"]:
        torch.testing.assert_close(chunked["items"][k], vanilla["items"][k], rtol=1e-5, atol=0)
    grads = {k: g for k, g in vanilla["grads"].items() if g is not None}
    top = max(float(g.abs().max()) for g in grads.values())
    for k, g in grads.items():
        assert float((chunked["grads"][k] - g).abs().max()) <= 1e-4 * top, k
    assert chunked["peak"] < vanilla["peak"]


def instance_masks(batch: dict) -> dict:
    """The batch with ``overlap_mask=False`` masks: one mask per object (Ultralytics' format without overlap)."""
    idx = batch["batch_idx"].long()
    within = torch.arange(len(idx)) - torch.searchsorted(idx, idx)
    return {**batch, "masks": (batch["masks"][idx] == (within + 1).view(-1, 1, 1)).float()}


@pytest.mark.parametrize("threads", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("name", ["yolo11n-seg.yaml", "yolo26n-seg.yaml"])
def test_exact_mask_loss_is_ultralytics_bit_for_bit_on_every_thread_count(name, threads, counted):
    """YOLO shapes (320 px: 80 x 80 prototypes, 2100 anchors), 50 objects per image: loss, items and every gradient
    equal to the bit, each image's mask loss run twice (forward and recompute), and less memory kept."""
    torch.manual_seed(0)
    model = build_model(name)
    batch = training_batch(model, StepShape(320, 2))
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        vanilla = step(model, batch)
        images, counted["mask"] = counted["mask"], 0
        exact = step(model, batch, "exact")
    finally:
        torch.set_num_threads(before)
    assert images == (2 if name.startswith("yolo11") else 4)  # YOLO26: one-to-many and one-to-one, each per image
    assert counted["mask"] == 2 * images
    assert_same({k: exact[k] for k in ("loss", "items", "grads")},
                {k: vanilla[k] for k in ("loss", "items", "grads")}, f"{name}, {threads} threads")
    assert exact["peak"] < vanilla["peak"]


@pytest.mark.parametrize("name", ["yolo11n.yaml", "yolo11n-pose.yaml", "yolo11n-obb.yaml"])
def test_exact_assignment_is_ultralytics_bit_for_bit_image_by_image(name, counted):
    """``exact`` on the task-aligned assigners (detect, pose, obb): 3 images of up to 120 objects at 192 px (756
    anchors, so each image's pairs sit anywhere in the batch's list, vector body or scalar tail), on 1 and 2 threads
    (pose and obb, whose pair overlaps are their own, on 2): loss, items and every gradient equal to Ultralytics' own
    to the bit, the assignment run one image at a time, and its peak (the loss forward, where the ``objects x
    anchors`` tensors live) lower."""
    torch.manual_seed(0)
    model = build_model(name)
    batch = training_batch(model, StepShape(192, 3, 120))
    keep = batch["batch_idx"] != 1
    keep[(batch["batch_idx"] == 1).nonzero()[:37]] = True  # images of different object counts
    batch = {k: v[keep] if k in ("batch_idx", "cls", "bboxes", "keypoints") else v for k, v in batch.items()}
    before = torch.get_num_threads()
    try:
        for threads in (1, 2) if name == "yolo11n.yaml" else (2,):  # pose and obb: their own pair overlaps
            torch.set_num_threads(threads)
            counted["assign"].clear()
            vanilla = step(model, batch)
            assert counted["assign"] == [3]
            counted["assign"].clear()
            exact = step(model, batch, "exact")
            assert counted["assign"] == [1, 1, 1]
            assert_same({k: exact[k] for k in ("loss", "items", "grads")},
                        {k: vanilla[k] for k in ("loss", "items", "grads")}, f"{name}, {threads} threads")
            assert exact["peak"] < vanilla["peak"], (exact["peak"], vanilla["peak"])
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("case", ["instance masks", "bf16 autocast"])
def test_exact_mask_loss_without_overlap_and_under_amp(case, counted):
    """``overlap_mask=False`` (a mask per object, picked by image inside the region) and CPU AMP (bfloat16)."""
    torch.manual_seed(0)
    overlap = case != "instance masks"
    model = build_model("yolo11n-seg.yaml", {"overlap_mask": overlap})
    batch = training_batch(model, StepShape(256, 2))
    batch = batch if overlap else instance_masks(batch)
    amp = torch.bfloat16 if case == "bf16 autocast" else None
    vanilla, exact = step(model, batch, amp=amp), step(model, batch, "exact", amp=amp)
    assert counted["mask"] == 2 + 4
    assert_same({k: exact[k] for k in ("loss", "items", "grads")},
                {k: vanilla[k] for k in ("loss", "items", "grads")}, case)


@pytest.mark.parametrize("name", ["yolo11n-seg.yaml", "yolo26n-seg.yaml"])
def test_chunked_is_equal_up_to_float_rounding(name, counted, monkeypatch):
    """Chunks of 32 foreground rows (several per image) and the assignment image by image: the loss and every gradient
    within float32 rounding of vanilla's, and less memory.

    Bound: reordering a float32 sum of n terms moves it by up to about n * 2^-24 of the magnitudes summed, and
    backward carries that absolute error on; a gradient that cancels to about zero (a BatchNorm bias inside attention)
    shows it at its own scale. So the loss is held to 1e-5 relative and every gradient to 1e-4 of the model's largest
    gradient magnitude (measured at this size: loss 1.4e-7, gradients 4.3e-6 (yolo11n-seg) and 6.9e-6 (yolo26n-seg))."""
    torch.manual_seed(0)
    model = build_model(name)
    batch = training_batch(model, StepShape(256, 2))
    vanilla = step(model, batch)
    calls, counted["mask"], counted["assign"] = counted["mask"], 0, []
    monkeypatch.setattr(segmentation, "CHUNK_ROWS_PIXELS", 32 * 64 * 64)  # 64 x 64 prototypes at 256 px
    chunked = step(model, batch, "chunked")
    assert counted["assign"] == [1] * (2 if name.startswith("yolo11") else 4)  # YOLO26: one-to-many, one-to-one
    assert counted["mask"] > 2 * calls  # several chunks per image, each run twice
    torch.testing.assert_close(chunked["loss"], vanilla["loss"], rtol=1e-5, atol=0)
    torch.testing.assert_close(torch.stack(list(chunked["items"].values())),
                               torch.stack(list(vanilla["items"].values())), rtol=1e-5, atol=0)
    grads = {k: g for k, g in vanilla["grads"].items() if g is not None}
    assert all(chunked["grads"][k] is None for k in vanilla["grads"].keys() - grads.keys())
    top = max(float(g.abs().max()) for g in grads.values())
    for k, g in grads.items():
        assert float((chunked["grads"][k] - g).abs().max()) <= 1e-4 * top, k
    assert chunked["peak"] < vanilla["peak"]


@pytest.mark.parametrize("case", ["19 classes", "class weights", "binary"])
def test_chunked_semantic_loss_is_equal_up_to_float_rounding(case, monkeypatch):
    """The semantic loss in blocks of 24 mask rows of one image (3 rows of logits at 1/8): cross-entropy (ignored
    pixels, class weights), Dice and the auxiliary cross-entropy within float32 rounding of vanilla's (the bound of
    ``test_chunked_is_equal_up_to_float_rounding``; measured 3.7e-6 of the largest gradient, binary bitwise), each
    block run twice (forward and recompute), and less memory."""
    from ultralytics.cfg import get_cfg
    from ultralytics.nn.tasks import SemanticSegmentationModel

    torch.manual_seed(0)
    if case == "binary":
        model = SemanticSegmentationModel("yolo26n-sem.yaml", nc=1, verbose=False).train()
        model.args, model.nc = get_cfg(overrides={"task": "semantic"}), 1
    else:
        model = build_model("yolo26n-sem.yaml")
    if case == "class weights":
        model.class_weights = torch.rand(19) + 0.5  # as Ultralytics' cls_pw frequency weights
    batch = training_batch(model, StepShape(256, 2))
    if case == "binary":
        batch["semantic_mask"] = batch["semantic_mask"] % 2
    batch["semantic_mask"][:, :5] = 255  # ignored
    blocks = []
    real = semantic._block_sums
    monkeypatch.setattr(semantic, "_block_sums", lambda *a: blocks.append(a[1]) or real(*a))
    monkeypatch.setattr(semantic, "CHUNK_PIXELS", (model.nc or 19) * 256 * 8 * 3)
    vanilla, chunked = step(model, batch), step(model, batch, "chunked")
    # per image, twice: the main logits' 32 rows (1/8) in 11 blocks of 3, the auxiliary's 16 rows (1/16) one by one
    assert blocks.count(True) == 2 * 2 * 11 and blocks.count(False) == 2 * 2 * 16
    assert_within_rounding(chunked, vanilla)


@pytest.mark.parametrize("case", ["dense", "invalid rows", "sparse: coarse scales stop for one image"])
def test_chunked_depth_loss_is_equal_up_to_float_rounding(case, monkeypatch):
    """The depth loss in blocks of 24 rows of one image (the prediction upsampled from 1/4 inside each block): SILog
    and every scale of the gradient-matching loss within float32 rounding of vanilla's (the bound of
    ``test_chunked_is_equal_up_to_float_rounding``), each block run twice per pass (forward and recompute), and
    less memory. Invalid rows, and a sparse image (one valid pixel in four, as LiDAR: its coarser scales stop, as
    Ultralytics' per-image ``keep`` says) cross block boundaries."""
    torch.manual_seed(0)
    model = build_model("yolo26n-depth.yaml")
    batch = training_batch(model, StepShape(256, 2))
    if case == "invalid rows":
        batch["depth"][0, 20:70] = 0
    if case.startswith("sparse"):
        batch["depth"][1] *= (torch.rand(256, 256) < 0.25).float()
    blocks = []
    real = depth._depth_block
    monkeypatch.setattr(depth, "_depth_block", lambda *a: blocks.append(a[-1] is None) or real(*a))
    monkeypatch.setattr(depth, "CHUNK_DEPTH_PIXELS", 256 * 24)
    vanilla, chunked = step(model, batch), step(model, batch, "chunked")
    # per image 11 blocks (10 of 24 rows, 16 left), each in both passes, forward and recompute
    assert blocks.count(True) == blocks.count(False) == 2 * 2 * 11
    assert_within_rounding(chunked, vanilla)


def retried_then_chunked(model, batch, seen: list, between=None) -> tuple[list, list]:
    """``model.loss(batch)`` without grad twice: first with Ultralytics' own image-by-image assignment (its retry after
    an out-of-memory error, which an assigner's ``fail`` forces in the test's recording ``_forward``), then, after
    ``between()``, with ``checkpoint_loss=chunked``. Returns the criterion's task-aligned losses and what ``seen``
    recorded of the first; ``seen`` holds the second's."""
    model.criterion = model.init_criterion()
    parts = install._criteria(model.criterion)
    for c in parts:
        c.assigner.fail = True
    with torch.no_grad():
        model.loss(batch)
    theirs, seen[:] = list(seen), []
    for c in parts:
        c.assigner.fail = False
    if between is not None:
        between()
    enable_loss_checkpointing(model, "chunked")
    with torch.no_grad():
        model.loss(batch)
    return parts, theirs


@pytest.mark.parametrize("name", ["yolo11n.yaml", "yolo26n-seg.yaml", "yolo11n-pose.yaml", "yolo11n-obb.yaml"])
def test_chunked_assigns_as_ultralytics_out_of_memory_path(name, monkeypatch):
    """The image-by-image assignment gives what Ultralytics' own retry after an out-of-memory error gives
    (``TaskAlignedAssigner.forward``, forced here by an error on the batched attempt), to the bit."""
    torch.manual_seed(0)
    model = build_model(name)
    batch = training_batch(model, StepShape(160, 3, 20))
    batch["batch_idx"] = batch["batch_idx"][batch["batch_idx"] != 1]  # image 1 without objects, image 2 fewer
    for key in ("cls", "bboxes", "keypoints"):
        if key in batch:
            batch[key] = batch[key][:len(batch["batch_idx"])]
    seen = []
    assign = TaskAlignedAssigner._forward

    def record(self, *args, **kwargs):
        out = assign(self, *args, **kwargs)
        if self.bs > 1 and getattr(self, "fail", False):
            raise torch.OutOfMemoryError("CUDA out of memory. (forced by the test)")
        seen.append(out)
        return out

    monkeypatch.setattr(TaskAlignedAssigner, "_forward", record)
    parts, theirs = retried_then_chunked(model, batch, seen)
    assert len(seen) == len(theirs) == 3 * len(parts)
    assert_same(seen, theirs, name)


def test_chunked_scores_yolo26_masks_in_groups_of_objects(monkeypatch):
    """YOLO26 segmentation's mask-aware assignment, its objects in groups of 2 (``CHUNK_MASK_IOU_PIXELS``): each image's
    assignment gives what Ultralytics' own image-by-image retry gives (labels, boxes, foreground, object indices to the
    bit; scores within float32 rounding, bitwise at this size), every group ran, and the assignment's peak is lower
    (measured: 0.35 MB against 1.03 MB per image)."""
    from ultralytics.utils.tal import SegTaskAlignedAssigner

    torch.manual_seed(0)
    model = build_model("yolo26n-seg.yaml")
    batch = training_batch(model, StepShape(160, 2, 20))
    seen, peaks, groups = [], [], []
    assign, overlaps = TaskAlignedAssigner._forward, SegTaskAlignedAssigner.pair_overlaps

    def record(self, *args, **kwargs):
        if self.bs > 1 and getattr(self, "fail", False):
            raise torch.OutOfMemoryError("CUDA out of memory. (forced by the test)")
        with LiveTensorTracker() as tracker:
            out = assign(self, *args, **kwargs)
        seen.append(out)
        peaks.append(tracker.peak)
        return out

    monkeypatch.setattr(TaskAlignedAssigner, "_forward", record)
    monkeypatch.setattr(SegTaskAlignedAssigner, "pair_overlaps",
                        lambda self, *a, **k: groups.append(self.n_max_boxes) or overlaps(self, *a, **k))
    their_peaks = []

    def grouped():  # 40 x 40 prototypes at 160 px; the one-to-many assigner scores 3 * 10 anchors per object
        their_peaks[:], peaks[:], groups[:] = peaks, [], []
        monkeypatch.setattr(assignment, "CHUNK_MASK_IOU_PIXELS", 2 * 3 * 10 * 40 * 40)

    parts, theirs = retried_then_chunked(model, batch, seen, grouped)
    topks = [c.assigner.topk for c in parts]
    assert len(seen) == len(theirs) == 2 * len(parts) and topks == [10, 7], topks
    assert groups == [2] * 2 * 2 * 10, groups  # per image and criterion, 20 objects in 10 groups of 2
    for ours, ref in zip(seen, theirs):
        labels, boxes, scores, fg, idx = ours
        for a, b in zip((labels, boxes, fg, idx), (ref[0], ref[1], ref[3], ref[4])):
            assert torch.equal(a, b)
        torch.testing.assert_close(scores, ref[2], rtol=1e-6, atol=1e-7)
    assert max(peaks) < max(their_peaks), (peaks, their_peaks)


def test_loss_plan_is_installed_and_removed(counted):
    """A built criterion is shadowed too (a resumed YOLO26 run builds it before training), and removing the plan
    leaves nothing of ours on the model or the criterion."""
    model = build_model("yolo26n-seg.yaml")
    plain = set(vars(model))
    model.criterion = model.init_criterion()
    criterion = set(vars(model.criterion.one2one))
    enable_loss_checkpointing(model, "exact")
    assert loss_checkpointing(model) == "exact"
    model.loss(training_batch(model, StepShape(128, 2)))[0].sum().backward()
    assert counted["mask"] == 2 * 4  # two images, two losses, forward and recompute
    disable_loss_checkpointing(model)
    assert loss_checkpointing(model) is None and set(vars(model)) == plain | {"criterion"}
    assert set(vars(model.criterion.one2one)) == criterion
    assert "_forward" not in vars(model.criterion.one2one.assigner)


def test_a_built_semantic_criterion_is_shadowed_and_restored(monkeypatch):
    """Ultralytics' semantic loss is an ``nn.Module``, so the model keeps it among its submodules once a step built it
    (a planning step, a validation): a chunked plan installed after that still computes it block by block, and
    removing the plan gives Ultralytics' own loss back, to the bit of a model that never had one."""
    torch.manual_seed(0)
    model = build_model("yolo26n-sem.yaml")
    batch = training_batch(model, StepShape(128, 2))
    blocks = []
    real = semantic._block_sums
    monkeypatch.setattr(semantic, "_block_sums", lambda *a: blocks.append(a[1]) or real(*a))
    vanilla = step(model, batch)
    model.criterion = model.init_criterion()
    assert "criterion" in model._modules and "criterion" not in vars(model)  # where nn.Module keeps it
    enable_loss_checkpointing(model, "chunked")
    model.loss(batch)
    assert blocks and model.criterion.checkpoint_loss == "chunked"
    disable_loss_checkpointing(model)
    assert "forward" not in vars(model.criterion) and not hasattr(model.criterion, "checkpoint_loss")
    blocks.clear()
    plain = step(model, batch)
    assert not blocks
    assert_same({k: plain[k] for k in ("loss", "items", "grads")}, {k: vanilla[k] for k in ("loss", "items", "grads")},
                "restored")


def test_a_built_depth_criterion_is_wrapped_and_restored(monkeypatch):
    """Ultralytics' depth loss is a plain class, so ``chunked`` wraps it (a resume or a validation built it already):
    the wrapper runs the loss in blocks, and removing the plan puts Ultralytics' own criterion object back."""
    model = build_model("yolo26n-depth.yaml")
    batch = training_batch(model, StepShape(64, 2))
    model.criterion = built = model.init_criterion()
    blocks = []
    real = depth._depth_block
    monkeypatch.setattr(depth, "_depth_block", lambda *a: blocks.append(a) or real(*a))
    enable_loss_checkpointing(model, "chunked")
    assert isinstance(model.criterion, depth.ChunkedDepthLoss) and model.criterion.loss is built
    assert model.criterion.loss_names == built.loss_names  # attributes read through
    model.loss(batch)[0].sum().backward()
    assert blocks
    disable_loss_checkpointing(model)
    assert model.criterion is built and loss_checkpointing(model) is None


@pytest.mark.parametrize("how, name", [("exact", "yolov8n-cls.yaml"), ("chunked", "yolov8n-cls.yaml"),
                                       ("exact", "yolo26n-sem.yaml")])
def test_a_criterion_without_regions_is_refused(how, name):
    model = build_model(name)
    enable_loss_checkpointing(model, how)
    with pytest.raises(CheckpointConfigError, match=f"checkpoint_loss={how}: .* Valid: checkpoint_loss=none"):
        model.loss(training_batch(model, StepShape(64, 1)))


def test_exact_trains_bit_for_bit_on_the_dense_set(tmp_path, counted):
    """yolo11n-seg on the embedded dense aerial set (hundreds of polygons per tile), the whole backbone and the mask
    loss recomputed: results, every saved field and the final model as vanilla's; the backbone's layers and each
    image's mask loss of every step ran twice."""
    from yolo_ckpt.data.synthetic import synthetic_dataset

    data = str(synthetic_dataset("segment", variant="synthetic_dense"))
    runs = []
    for ours in (None, {"checkpoint_stages": "all", "checkpoint_loss": "exact"}):
        before = counted["mask"]
        run = train_run("yolo11n-seg.yaml", data, tmp_path, "ckpt" if ours else "vanilla", ours, epochs=1, imgsz=256)
        runs.append((run, counted["mask"] - before))
    (vanilla, v_calls), (ckpt, c_calls) = runs
    assert v_calls > 0 and c_calls == 2 * v_calls
    assert_plan_recomputed("yolo11n-seg.yaml", "all", vanilla, ckpt)
    assert_same_run(vanilla, ckpt)


def test_exact_through_ultralytics_out_of_memory_retry(tmp_path, counted, small_data):
    """A run recomputing only its loss has no layer plan to escalate: Ultralytics' retry halves the batch, rebuilds
    the loaders and restarts the epoch, and the run is vanilla's under the same retry, bit for bit, each image's mask
    loss still run twice."""
    from yolo_ckpt import YOLO

    from support import CkptSegOOMOnce, VanillaSegOOMOnce, add_counting

    data = small_data("segment")
    runs = []
    for name, trainer, model, ours in (("vanilla", VanillaSegOOMOnce, ultralytics.YOLO, {}),
                                       ("ckpt", CkptSegOOMOnce, YOLO, {"checkpoint_loss": "exact"})):
        before = counted["mask"]
        m = model("yolo11n-seg.yaml")
        add_counting(m)
        # nbs=2: an optimizer step at every batch of 2, the batch the retry halves to
        m.train(trainer=trainer, data=data, project=str(tmp_path), name=name,
                **{**TRAIN_ARGS, "epochs": 1, "imgsz": 64, "nbs": 2, "save_period": 1}, **ours)
        assert m.trainer.batch_size == TRAIN_ARGS["batch"] // 2  # halved by Ultralytics' retry
        runs.append((m.trainer.save_dir, counted["mask"] - before))
    (vanilla, v_calls), (ckpt, c_calls) = runs
    assert v_calls > 0 and c_calls == 2 * v_calls
    assert_same_run(vanilla, ckpt)


def test_auto_may_choose_no_loss_plan_where_chunked_was_allowed(tmp_path, counted, small_data):
    """``checkpoint_loss=chunked`` with ``auto`` allows the loss plan without imposing it: where vanilla fits the
    budget, ``auto`` chooses nothing recomputed, the loss Ultralytics' own: args.yaml and best.pt say
    ``checkpoint_loss=none``, each image's mask loss ran once per training step (planning's probes before the first
    epoch not counted) and the assignment took the whole batch, as vanilla's, and the run is vanilla's bit for bit."""
    import yaml
    from ultralytics.utils.patches import torch_load

    from yolo_ckpt import YOLO
    from yolo_ckpt.integration.settings import saved_settings

    from support import add_counting

    data = small_data("segment")
    runs, seen = [], {}

    def training_starts(trainer):  # the counts once planning is done
        seen.update(mask=counted["mask"], assign=len(counted["assign"]))

    for name, model, ours in (("vanilla", ultralytics.YOLO, {}), ("ckpt", YOLO, {
            "checkpoint_stages": "auto", "checkpoint_loss": "chunked", "memory_budget": "64GB"})):
        m = model("yolo11n-seg.yaml")
        add_counting(m)
        m.add_callback("on_train_epoch_start", training_starts)
        # save_period: epoch1.pt keeps the optimizer state (last.pt is stripped)
        args = {**TRAIN_ARGS, "epochs": 1, "imgsz": 64, "save_period": 1, **ours}
        m.train(data=data, project=str(tmp_path), name=name, **args)
        runs.append((m.trainer.save_dir, counted["mask"] - seen["mask"], counted["assign"][seen["assign"]:]))
    (vanilla, v_calls, v_assign), (ckpt, c_calls, c_assign) = runs
    assert v_calls > 0 and c_calls == v_calls and c_assign == v_assign and max(v_assign) > 1
    chosen = yaml.safe_load((ckpt / "args.yaml").read_text())
    assert chosen["checkpoint_loss"] == "none" and chosen["checkpoint_stages"] == []
    assert saved_settings(torch_load(ckpt / "weights" / "best.pt"))["checkpoint_loss"] == "none"
    assert_same_run(vanilla, ckpt)


def test_chunked_depth_trains_and_saves_plain_ultralytics(tmp_path, small_data, monkeypatch):
    """yolo26n-depth trained with ``checkpoint_loss=chunked`` through Ultralytics' trainer (the criterion a wrapper:
    its EMA copy, validation and saving): its training steps and its validation ran the depth loss in blocks,
    args.yaml records the loss plan, and best.pt loads in plain Ultralytics with safe loading, yolo_ckpt
    unimportable, without a criterion."""
    import os
    import subprocess
    import sys

    import yaml

    from yolo_ckpt import YOLO

    calls = []
    real = depth._depth_block
    monkeypatch.setattr(depth, "_depth_block", lambda *a: calls.append(torch.is_grad_enabled()) or real(*a))
    m = YOLO("yolo26n-depth.yaml")
    m.train(data=small_data("depth"), project=str(tmp_path), name="r", checkpoint_loss="chunked",
            **{**TRAIN_ARGS, "epochs": 1, "imgsz": 64})
    run = m.trainer.save_dir
    assert True in calls and False in calls  # training's blocks, and validation's (without gradients)
    assert yaml.safe_load((run / "args.yaml").read_text())["checkpoint_loss"] == "chunked"
    code = f"""
import sys
sys.modules["yolo_ckpt"] = None
from ultralytics import YOLO
m = YOLO(r"{run / 'weights' / 'best.pt'}")
print("OK", m.task, type(getattr(m.model, "criterion", None)).__name__)
"""
    env = {**os.environ, "ULTRALYTICS_SAFE_LOAD": "1", "YOLO_OFFLINE": "1"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0 and "OK depth NoneType" in out.stdout, out.stderr[-2000:]


def _items(items) -> torch.Tensor:
    """Loss items as one tensor (a dict of them, or a tensor already)."""
    return torch.stack([torch.as_tensor(v).float() for v in items.values()]) if isinstance(items, dict) else items


VALIDATION_PLANS = [("yolo11n-seg.yaml", "exact"), ("yolo26n-seg.yaml", "exact"), ("yolo11n-seg.yaml", "chunked"),
                    ("yolo11n.yaml", "exact"), ("yolo11n.yaml", "chunked"), ("yolo11n-pose.yaml", "chunked"),
                    ("yolo11n-obb.yaml", "chunked"),
                    ("yolo26n-sem.yaml", "chunked"), ("yolo26n-depth.yaml", "chunked")]


@pytest.mark.parametrize("name,how", VALIDATION_PLANS)
def test_the_validators_loss_under_the_loss_plan_is_ultralytics(name, how, monkeypatch):
    """What Ultralytics' validator computes in training, on the EMA in eval mode without gradients
    (``model.loss(batch, preds)``), under each task's loss plan: ``exact`` bit for bit, ``chunked`` within 1e-5
    relative (the bound of ``test_chunked_is_equal_up_to_float_rounding``). The plan ran without gradients, in its
    pieces (counted, chunks made small): several mask, pixel or depth regions, and the assignment image by image."""
    regions, sizes = [], []

    def counting(fn):
        def run(*args, **kwargs):
            regions.append(torch.is_grad_enabled())
            return fn(*args, **kwargs)
        return run

    assign = TaskAlignedAssigner._forward

    def assigned(self, pd_scores, *args, **kwargs):
        sizes.append(pd_scores.shape[0])
        return assign(self, pd_scores, *args, **kwargs)

    for module in (segmentation, semantic, depth):
        monkeypatch.setattr(module, "checkpoint_region", counting(module.checkpoint_region))
    monkeypatch.setattr(TaskAlignedAssigner, "_forward", assigned)
    monkeypatch.setattr(segmentation, "CHUNK_ROWS_PIXELS", 32 * 64 * 64)
    monkeypatch.setattr(semantic, "CHUNK_PIXELS", 64 * 256)
    monkeypatch.setattr(depth, "CHUNK_DEPTH_PIXELS", 64 * 256)
    torch.manual_seed(0)
    model = build_model(name).eval()
    batch = training_batch(model, StepShape(256, 2, 20))

    def validation_loss(plan: str) -> torch.Tensor:
        m = copy.deepcopy(model)
        enable_loss_checkpointing(m, plan)
        with torch.no_grad():
            items = _items(m.loss(batch, m(batch["img"]))[1])
        disable_loss_checkpointing(m)
        return items

    vanilla = validation_loss("none")
    assert not regions and set(sizes) <= {2}  # Ultralytics' own: the whole batch assigned at once
    sizes.clear()
    ours = validation_loss(how)
    assert not any(regions)  # without gradients, as the validator runs
    criteria = 2 if name.startswith("yolo26") else 1  # YOLO26: the one-to-many and the one-to-one loss
    if "-sem" in name or "-depth" in name or "-seg" in name:  # exact: one region per image, chunked: several
        assert len(regions) == 2 * criteria if how == "exact" else len(regions) > 2 * criteria, regions
    if "-sem" not in name and "-depth" not in name and not (how == "exact" and name.startswith("yolo26n-seg")):
        assert sizes and set(sizes) == {1}, sizes  # the assignment image by image (exact: not YOLO26's mask-aware one)
    if how == "exact":
        assert torch.equal(ours, vanilla), (ours, vanilla)
    else:
        torch.testing.assert_close(ours, vanilla, rtol=1e-5, atol=0)


def test_every_epochs_validation_computes_its_loss_under_the_run_plan(tmp_path, small_data, monkeypatch):
    """Ultralytics' validator computes its losses on the EMA, which each checkpoint save strips of the plan: every
    epoch's validation (not only the first, before any save) runs the run's loss plan, its mask regions counted
    without gradients, and the run, validation losses included, is vanilla's bit for bit under ``exact``."""
    regions, per_epoch = [], []
    region = segmentation.checkpoint_region

    def counting(*args, **kwargs):
        regions.append(torch.is_grad_enabled())
        return region(*args, **kwargs)

    monkeypatch.setattr(segmentation, "checkpoint_region", counting)
    data = small_data("segment")
    vanilla = train_run("yolo11n-seg.yaml", data, tmp_path, "vanilla", epochs=2, imgsz=64)
    assert not regions

    from yolo_ckpt import SegmentationTrainer

    class Counting(SegmentationTrainer):
        def validate(self):
            before = regions.count(False)
            try:
                return super().validate()
            finally:
                per_epoch.append(regions.count(False) - before)

    from support import add_counting

    m = ultralytics.YOLO("yolo11n-seg.yaml")
    add_counting(m)
    m.train(trainer=Counting, data=data, project=str(tmp_path), name="ckpt", checkpoint_loss="exact",
            **{**TRAIN_ARGS, "epochs": 2, "imgsz": 64, "save_period": 1})
    ckpt = m.trainer.save_dir
    assert len(per_epoch) == 2 and all(n > 0 for n in per_epoch), per_epoch  # each epoch's validation: the plan
    assert_same_run(vanilla, ckpt)


def test_least_is_the_tasks_chunked_plan_and_trains_as_it(tmp_path, small_data, counted):
    """``checkpoint_loss=least``: the loss plan that keeps the least for the run's task, recorded as what it chose
    (args.yaml: resume and ``cfg=`` train it). On segment it trains as ``chunked`` does, bit for bit (both runs' mask
    loss recomputed: forwards counted); where no chunked plan exists it is Ultralytics' loss."""
    import yaml

    runs, masks = {}, {}
    for how in ("chunked", "least"):
        before = counted["mask"]
        runs[how] = train_run("yolo11n-seg.yaml", small_data("segment"), tmp_path, how, {"checkpoint_loss": how},
                              epochs=1, imgsz=64, nbs=2)
        masks[how] = counted["mask"] - before
    assert yaml.safe_load((runs["least"] / "args.yaml").read_text())["checkpoint_loss"] == "chunked"
    assert masks["least"] == masks["chunked"] > 0
    assert_same_run(runs["chunked"], runs["least"])
    assert install.check_loss_setting("least", "classify") == "none"
    assert install.check_loss_setting("least", "detect", "rtdetr-l.yaml") == "none"  # a Hungarian matcher


@pytest.mark.parametrize("name, how", [("yolo11n-seg.yaml", "chunked"), ("yolo11n.yaml", "chunked"),
                                       ("yolo11n.yaml", "exact")])
def test_the_validators_loss_under_a_loss_plan_peaks_lower_than_ultralytics_on_a_dense_batch(name, how):
    """The validator's loss (eval mode, no gradients, ``model.loss(batch, preds)``) on a dense batch, 4 images of 200
    objects at 320 px, at the same batch: under ``chunked`` (and ``exact`` on detection) its peak, every tensor it
    allocates tracked exactly, is below Ultralytics' own loss's (segmentation's masks in chunks, the assignment image
    by image); ``exact``'s losses are Ultralytics' to the bit."""
    torch.manual_seed(0)
    model = build_model(name).eval()
    batch = training_batch(model, StepShape(320, 4, 200))
    with torch.no_grad():
        preds = model(batch["img"])

    def peak(plan: str) -> tuple[int, torch.Tensor]:
        enable_loss_checkpointing(model, plan)
        try:
            with torch.no_grad(), LiveTensorTracker() as t:
                items = _items(model.loss(batch, preds)[1])
            return t.peak, items
        finally:
            disable_loss_checkpointing(model)

    (vanilla, reported), (ours, items) = peak("none"), peak(how)
    assert ours < 0.8 * vanilla, (ours / 2**20, vanilla / 2**20)
    assert how != "exact" or torch.equal(items, reported), (items, reported)
