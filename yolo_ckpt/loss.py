"""Checkpoint the criterion: the loss of the training step, recomputed in backward, bit for bit or in chunks.

Once the network is checkpointed, the loss holds most of a dense or high-resolution step's memory (instance masks:
``n_fg x h x w`` tensors per image; assignment: ``batch x objects x anchors``), and no layer plan touches it.
``checkpoint_loss`` names what is done to the criterion Ultralytics builds (``model.init_criterion``):

- ``none``: nothing, Ultralytics' own loss.
- ``exact``: bit for bit as vanilla, the same ops on the same shapes. Instance segmentation (``v8SegmentationLoss``
  and YOLO26's ``SegmentLoss26``): each image's mask loss, its ground-truth masks built inside, is a region of its
  own (``checkpoint_region``), so that only one image's ``n_fg x h x w`` tensors are alive in backward.
- ``chunked``: bounded memory, equal up to float rounding, opt-in only:

  - the mask loss of each image in chunks of at most ``CHUNK_ROWS_PIXELS // (h * w)`` foreground rows, each chunk a
    region: the per-chunk sums and the prototype gradient add up in another order than one sum over all rows;
  - semantic segmentation (``SemanticSegmentationLoss``): the logits upsampled, and cross-entropy and Dice computed,
    in blocks of rows of one image (``CHUNK_PIXELS``), each block a region that returns its cross-entropy sum and its
    Dice sums; the totals add up in another order than one sum over every pixel;
  - assignment (every ``TaskAlignedAssigner``: detect, segment, pose, obb) one image at a time, the path Ultralytics
    itself takes after an out-of-memory error (``TaskAlignedAssigner.forward``, 8.4.190), so that the
    ``objects x anchors`` tensors are one image's. Not bitwise on CPU: the alignment metric's ``pow(beta)`` over the
    candidate pairs runs vectorized in the body and scalar in the tail of a list, and per image the tail moves
    (measured on this project's AVX-512 CPU: ``x[:k].pow(6.0)`` differs from ``x.pow(6.0)[:k]`` for 29 of the first
    199 ``k``; the gradients of yolo26n and yolo11n-obb then differ);
  - depth (``DepthLoss26``): the prediction upsampled, and the SILog and multi-scale gradient-matching terms
    computed, in blocks of rows of one image (``CHUNK_DEPTH_PIXELS``, rows aligned to the coarsest scale), each
    block a region returning its sums; the mean of the log differences is the blocks' first sums, the centred
    variance a second pass of blocks. The criterion, a plain class, is wrapped (``ChunkedDepthLoss``);
  - YOLO26 segmentation's mask-aware assignment (``SegTaskAlignedAssigner``, which scores each object's best anchors
    by the IoU of their predicted masks) in groups of objects (``CHUNK_MASK_IOU_PIXELS``), so that it no longer
    decodes a whole image's candidate masks at once: the step's peak at 1024 px with 300 objects per image.

The criterion is shadowed on its *instance*, as ``yolo_ckpt.model`` shadows the layer loop: the model's
``init_criterion`` (so also the criterion a resume or the EMA's validation builds) and any criterion already built.
``disable_loss_checkpointing`` removes every shadow; Ultralytics' ``save_model`` drops the EMA's criterion from what
it pickles, and ``CheckpointMixin.save_model`` removes the ``init_criterion`` shadow, so saved models stay plain.

Private Ultralytics code reproduced here, checked against ultralytics 8.4.190 (``ultralytics/utils/loss.py``,
``ultralytics/utils/tal.py``): the loop of ``v8SegmentationLoss.calculate_segmentation_loss``, the terms of
``SemanticSegmentationLoss.forward`` and the per-image loop of ``TaskAlignedAssigner.forward``, which calls
``_forward``; what ``SegTaskAlignedAssigner.pair_overlaps`` reads from its arguments.

Examples:
    >>> from yolo_ckpt.measure import build_model, training_batch
    >>> model = build_model("yolo11n-seg.yaml")
    >>> enable_loss_checkpointing(model, "exact")
    >>> loss, items = model.loss(training_batch(model, 128, 2))
    >>> loss_checkpointing(model)
    'exact'
    >>> disable_loss_checkpointing(model)
    >>> loss_checkpointing(model) is None
    True
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .recompute import checkpoint_region
from .stages import CheckpointConfigError

LOSS_MODES = ("none", "exact", "chunked")
"""Values of ``checkpoint_loss``: ``none`` (Ultralytics' loss), ``exact`` (regions recomputed bit for bit),
``chunked`` (bounded memory, not bitwise)."""
LOSS_HELP = ("'none' (Ultralytics' loss), 'exact' (bit for bit: each image's mask loss recomputed in backward; "
             "segment) or 'chunked' (not bitwise, equal up to float rounding: the mask loss in chunks of foreground "
             "rows, the semantic and depth losses in blocks of pixels, the assignment image by image; detect, segment, "
             "semantic, depth, pose, obb)")
LOSS_TASKS = {"exact": ("segment",), "chunked": ("detect", "segment", "semantic", "depth", "pose", "obb")}
"""Tasks whose criterion each value changes: ``exact`` the instance-mask loss, ``chunked`` also the semantic and depth
losses and every ``TaskAlignedAssigner``. Classification and RT-DETR (a Hungarian matcher; its loss holds a few MiB)
have no loss region. With the whole network checkpointed, depth's step peaks in the network's backward, after the
loss's (its network alone is the step, ``benchmarks/loss_memory.py``): ``chunked`` bounds the depth loss's own
memory, not that step's."""
CHUNK_ROWS_PIXELS = 2**22
"""``chunked``: foreground rows times mask pixels per chunk of the mask loss (16 MiB per ``rows x h x w`` fp32
tensor; 64 rows of 256 x 256 masks, the 1024 px default), so that its memory no longer grows with objects."""
CHUNK_MASK_IOU_PIXELS = 2**22
"""``chunked``: anchors times mask pixels that YOLO26 segmentation's mask-aware assigner decodes at a time
(``SegTaskAlignedAssigner.pair_overlaps``, which scores up to ``3 * topk`` anchors per object by the IoU of its
predicted mask): objects in groups of ``CHUNK_MASK_IOU_PIXELS // (3 * topk * mask pixels)``, at least one. Measured
at 1024 px, batch 2, 300 objects per image (``tests/test_loss.py`` checks the groups at 160 px): each group's overlaps
at most 24 MiB, each image's whole assignment at most 99 MiB, against 4.0 GB for Ultralytics' assignment of the
batch (its decode takes at least one image's candidate anchors at once)."""
CHUNK_DEPTH_PIXELS = 2**18
"""``chunked``: full-resolution pixels per block of the depth loss (1 MiB per fp32 map of a block: 256 rows of a
1024 px image; each block holds a few such maps and their log-depth pyramid), so that its memory no longer grows with
the image's area."""
CHUNK_PIXELS = 2**22
"""``chunked``: classes times full-resolution pixels per block of the semantic loss (16 MiB per fp32 block of
upsampled logits: 208 rows of a 1024 px mask with Cityscapes' 19 classes), so that its memory no longer grows with the
image's area."""


def check_loss_setting(value: Any, task: str | None, model_name: str = "") -> str:
    """The ``checkpoint_loss`` word, or the one-line error naming what is valid.

    Args:
        value: The key's value (``None`` or empty means ``none``; words are case-insensitive).
        task: The run's task, when known.
        model_name: The model's name, to refuse RT-DETR (whose matcher is not a task-aligned assigner).

    Raises:
        CheckpointConfigError: For an unknown value, or ``exact`` on a task or model it cannot help.
    """
    word = "none" if value in (None, "", False) else str(value).strip().lower()
    if word not in LOSS_MODES:
        raise CheckpointConfigError(f"checkpoint_loss={value!r} is invalid. Valid: {LOSS_HELP}.")
    if word != "none" and (task not in (*LOSS_TASKS[word], None) or "rtdetr" in model_name.lower()):
        _refuse(word, "RT-DETR" if "rtdetr" in model_name.lower() else f"task={task}")
    return word


def auto_loss_modes(setting: str, task: str | None) -> tuple[str, ...]:
    """The loss plans ``checkpoint_stages=auto`` may choose beside its layer plan, or ``()`` where every planning copy
    runs the run's own: ``exact`` (bit for bit, so always allowed) where the task has exact regions, and ``chunked``
    only where the user wrote it (it is not bitwise: never chosen unasked).

    Examples:
        >>> auto_loss_modes("none", "segment"), auto_loss_modes("chunked", "segment"), auto_loss_modes("none", "detect")
        (('exact',), ('exact', 'chunked'), ())
    """
    if setting == "exact":  # the user's: every copy carries it
        return ()
    allowed = ("exact", "chunked") if setting == "chunked" else ("exact",)
    return tuple(m for m in allowed if task in LOSS_TASKS[m])


def _refuse(how: str, what: str) -> None:
    valid = "; ".join(f"{k} with task {'/'.join(v)}" for k, v in LOSS_TASKS.items())
    raise CheckpointConfigError(f"checkpoint_loss={how}: {what} has no loss region yolo-ckpt recomputes {how}. "
                                f"Valid: checkpoint_loss=none; {valid}.")


def _criteria(criterion: Any) -> list[Any]:
    """The task-aligned losses inside a criterion: itself, or the one-to-many and one-to-one losses of YOLO26's
    ``E2ELoss``."""
    from ultralytics.utils.loss import v8DetectionLoss

    parts = [getattr(criterion, name, None) for name in ("one2many", "one2one")] if hasattr(criterion, "one2one") \
        else [criterion]
    return [c for c in parts if isinstance(c, v8DetectionLoss)]


def _scores_masks(assigner: nn.Module) -> bool:
    """Whether ``assigner`` is YOLO26 segmentation's mask-aware one (Ultralytics 8.4.190 has it; 8.4.162 does not)."""
    from ultralytics.utils import tal

    return isinstance(assigner, getattr(tal, "SegTaskAlignedAssigner", ()))


def _image_mask_loss(criterion: Any, masks: torch.Tensor, batch_idx: torch.Tensor, i: int, mask_idx: torch.Tensor,
                     pred: torch.Tensor, proto: torch.Tensor, xyxy: torch.Tensor, area: torch.Tensor) -> torch.Tensor:
    """One image's mask loss with its ground-truth masks built inside, as ``calculate_segmentation_loss`` does."""
    if criterion.overlap:
        gt_mask = (masks[i] == (mask_idx + 1).view(-1, 1, 1)).float()
    else:
        gt_mask = masks[batch_idx.view(-1) == i][mask_idx]
    return criterion.single_mask_loss(gt_mask, pred, proto, xyxy, area)


def _segmentation_loss(criterion: Any, how: str, fg_mask: torch.Tensor, masks: torch.Tensor,
                       target_gt_idx: torch.Tensor,
                       target_bboxes: torch.Tensor, batch_idx: torch.Tensor, proto: torch.Tensor,
                       pred_masks: torch.Tensor, imgsz: torch.Tensor) -> torch.Tensor:
    """``v8SegmentationLoss.calculate_segmentation_loss`` (8.4.190) with each image's mask loss one region
    (``exact``), or one region per chunk of its foreground rows (``chunked``)."""
    if not torch.is_grad_enabled():  # validation: nothing is kept for backward
        return type(criterion).calculate_segmentation_loss(criterion, fg_mask, masks, target_gt_idx, target_bboxes,
                                                           batch_idx, proto, pred_masks, imgsz)
    from ultralytics.utils.ops import xyxy2xywh

    _, _, mask_h, mask_w = proto.shape
    loss = 0
    target_bboxes_normalized = target_bboxes / imgsz[[1, 0, 1, 0]]
    marea = xyxy2xywh(target_bboxes_normalized)[..., 2:].prod(2)
    mxyxy = target_bboxes_normalized * torch.tensor([mask_w, mask_h, mask_w, mask_h], device=proto.device)
    for i, single_i in enumerate(zip(fg_mask, target_gt_idx, pred_masks, proto, mxyxy, marea)):
        fg_mask_i, target_gt_idx_i, pred_masks_i, proto_i, mxyxy_i, marea_i = single_i
        if fg_mask_i.any():
            region = partial(_image_mask_loss, criterion, masks, batch_idx, i)
            rows = (target_gt_idx_i[fg_mask_i], pred_masks_i[fg_mask_i], mxyxy_i[fg_mask_i], marea_i[fg_mask_i])
            step = len(rows[0]) if how == "exact" else max(1, CHUNK_ROWS_PIXELS // (mask_h * mask_w))
            for k in range(0, len(rows[0]), step):
                idx, pred, xyxy, area = (r[k:k + step] for r in rows)
                loss += checkpoint_region(region, idx, pred, proto_i, xyxy, area, modules=())
        else:  # as Ultralytics: keeps every prediction in the graph for DDP
            loss += (proto * 0).sum() + (pred_masks * 0).sum()
    return loss / fg_mask.sum()


def _assign_per_image(assigner: nn.Module, pd_scores: torch.Tensor, pd_bboxes: torch.Tensor,
                      anc_points: torch.Tensor, gt_labels: torch.Tensor, gt_bboxes: torch.Tensor,
                      mask_gt: torch.Tensor, **extra: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``TaskAlignedAssigner._forward`` as its ``forward`` runs it after an out-of-memory error (8.4.190): one image
    at a time, each with its objects up to its last valid one, the results written into batch-sized outputs.

    Shadowing ``_forward`` (not ``forward``) keeps what ``forward`` does first, on every assigner: no objects at all,
    the pose assigner's per-anchor strides."""
    cls, bs, n_max_boxes = type(assigner), assigner.bs, assigner.n_max_boxes
    if bs == 1:
        return cls._forward(assigner, pd_scores, pd_bboxes, anc_points, gt_labels, gt_bboxes, mask_gt, **extra)
    last_gt_idx = (mask_gt.squeeze(-1).bool().mul(torch.arange(1, n_max_boxes + 1, device=mask_gt.device))
                   .amax(1).clamp_(min=1).tolist())
    results = None
    try:
        assigner.bs = 1
        for i, n in enumerate(last_gt_idx):
            assigner.n_max_boxes = n
            result = cls._forward(assigner, pd_scores[i:i + 1], pd_bboxes[i:i + 1], anc_points, gt_labels[i:i + 1, :n],
                                  gt_bboxes[i:i + 1, :n], mask_gt[i:i + 1, :n],
                                  **{k: v[i:i + 1] for k, v in extra.items()})
            if results is None:
                results = tuple(x.new_empty((bs, *x.shape[1:])) for x in result)
            for output, x in zip(results, result):
                output[i] = x[0]
            del result
    finally:
        assigner.bs, assigner.n_max_boxes = bs, n_max_boxes
    return results


def _pair_overlaps_by_objects(assigner: nn.Module, indices: tuple[torch.Tensor, ...], gt_bboxes: torch.Tensor,
                              pd_bboxes: torch.Tensor, **extra: torch.Tensor) -> torch.Tensor:
    """``SegTaskAlignedAssigner.pair_overlaps`` (8.4.190) run on groups of objects (``CHUNK_MASK_IOU_PIXELS``), each
    group as if its objects were the image's only ones, the overlaps written back in the pairs' order.

    Every quantity of a pair is its object's alone (the box IoU, the object's ``3 * topk`` best anchors, their
    predicted masks' IoU with its mask), so a group gives its pairs what the whole call gives them, and only the
    group's anchors are decoded. Equal up to float rounding, not guaranteed bitwise on CPU: elementwise kernels (the
    box IoU's ``atan``, the alignment's ``pow``) run vectorized in the body and scalar in the tail of a list, and a
    group moves the tail."""
    cls, n = type(assigner), assigner.n_max_boxes
    mh, mw = extra["proto"].shape[-2:]
    group = max(1, CHUNK_MASK_IOU_PIXELS // (3 * assigner.topk * mh * mw))
    b, g, a = indices
    if group >= n or not len(g):
        return cls.pair_overlaps(assigner, indices, gt_bboxes, pd_bboxes, **extra)
    overlaps = None
    try:
        for g0 in range(0, n, group):
            g1 = min(g0 + group, n)
            if not (keep := (g >= g0) & (g < g1)).any():
                continue
            assigner.n_max_boxes = g1 - g0
            part = cls.pair_overlaps(assigner, (b[keep], g[keep] - g0, a[keep]), gt_bboxes[:, g0:g1], pd_bboxes,
                                     **{**extra, "labels": extra["labels"][:, g0:g1],
                                        "gt_masks": extra["gt_masks"][:, g0:g1]})
            if overlaps is None:
                overlaps = part.new_zeros(len(g))
            overlaps[keep] = part
    finally:
        assigner.n_max_boxes = n
    return overlaps


def _block_sums(criterion: Any, dice: bool, logits: torch.Tensor, masks: torch.Tensor, i: int,
                rows: tuple[int, int, int, int], scale: tuple[int, int]) -> torch.Tensor:
    """One block of image ``i``: its logits upsampled as ``SemanticSegmentationLoss.forward`` upsamples the whole
    batch (8.4.190: bilinear, ``align_corners=False``), from input rows ``start:end`` (the block's rows ``a:b`` and one
    row either side, which bilinear weights read), and the block's cross-entropy sum, then (``dice``) its Dice
    intersection and prediction sums (per class; binary: one each) over its valid pixels, as one tensor."""
    start, a, b, end = rows
    x = logits[i:i + 1, :, start:end]
    if scale != (1, 1):
        x = F.interpolate(x, scale_factor=scale, mode="bilinear", align_corners=False)
    x = x[:, :, (a - start) * scale[0]:(b - start) * scale[0]]
    m = masks[i, a * scale[0]:b * scale[0]]
    flat = m.reshape(-1)
    valid = flat != 255
    if criterion.nc == 1:
        ce = criterion.ce(x.reshape(-1)[valid], flat[valid].float()).float().view(1)
        if not dice:
            return ce
        p = x.squeeze(1).sigmoid()
        target, v = (m == 1).float(), valid.reshape_as(m).float()
        return torch.cat([ce, (p * target * v).sum().float().view(1), ((p + target) * v).sum().float().view(1)])
    ce = criterion.ce(x.permute(0, 2, 3, 1).reshape(-1, criterion.nc), flat.long()).float().view(1)
    if not dice:
        return ce
    target = flat[valid].long()
    p = F.softmax(x, dim=1).float().permute(0, 2, 3, 1).reshape(-1, criterion.nc)[valid]
    inter = torch.zeros(criterion.nc, device=x.device, dtype=torch.float32)
    inter.scatter_add_(0, target, p.gather(1, target[:, None]).squeeze(1))
    return torch.cat([ce, inter, p.sum(dim=0)])


def _blocked(criterion: Any, logits: torch.Tensor, masks: torch.Tensor, dice: bool = True) -> torch.Tensor | None:
    """The sums of ``_block_sums`` over every block of every image, each block a region; ``None`` where the mask is
    not a whole multiple of the logits (bilinear blocks would not line up: Ultralytics' loss runs instead)."""
    (h, w), (mh, mw) = logits.shape[2:], masks.shape[1:]
    if mh % h or mw % w:
        return None
    scale = (mh // h, mw // w)
    step = max(1, CHUNK_PIXELS // (criterion.nc * mw * scale[0]))  # input rows per block
    total = 0
    for i in range(logits.shape[0]):
        for a in range(0, h, step):
            b = min(a + step, h)
            rows = (max(a - 1, 0), a, b, min(b + 1, h))
            total = total + checkpoint_region(partial(_block_sums, criterion, dice, logits, masks, i, rows, scale),
                                              modules=())
    return total


def _semantic_loss(criterion: Any, preds: Any, batch: dict) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``SemanticSegmentationLoss.forward`` (8.4.190) with the full-resolution logits, cross-entropy and Dice
    computed block by block (``_blocked``); the denominators and target counts, which need no gradient, as there."""
    cls = type(criterion)
    aux = None
    main = preds
    if isinstance(preds, tuple):
        main, aux = preds
    masks = batch["semantic_mask"].to(main.device)
    sums = _blocked(criterion, main, masks) if torch.is_grad_enabled() else None
    if sums is None:
        return cls.forward(criterion, preds, batch)
    flat = masks.reshape(-1)
    valid = flat != 255
    target = flat[valid].long()
    weight = None if criterion.nc == 1 else criterion.ce.weight
    denominator = (valid.sum() if weight is None else weight[target].sum()).clamp_min(1)
    ce = sums[0] / denominator
    if criterion.nc == 1:
        dice = 1.0 - (2.0 * sums[1] + 1.0) / (sums[2] + 1.0)
    else:
        nc = criterion.nc
        target_sum = torch.zeros(nc, device=main.device).scatter_add_(0, target, torch.ones_like(target,
                                                                                              dtype=torch.float32))
        dice = (1.0 - (2.0 * sums[1:1 + nc] + 1.0) / (sums[1 + nc:] + target_sum + 1.0)).mean()
    total = ce + dice
    aux_loss = torch.tensor(0.0, device=main.device, dtype=ce.dtype)
    if aux is not None:
        aux_sums = _blocked(criterion, aux, masks, dice=False)
        if aux_sums is None:  # as Ultralytics
            aux_logits = F.interpolate(aux, size=masks.shape[1:], mode="bilinear", align_corners=False)
            aux_loss = cls._ce_loss(criterion, aux_logits, masks, valid) * 0.4
        else:
            aux_loss = aux_sums[0] / denominator * 0.4
        total += aux_loss
    items = {"ce_loss": ce.detach(), "dice_loss": dice.detach(), "aux_loss": aux_loss.detach()}
    return total * main.shape[0], items


def _upsampled_rows(pred: torch.Tensor, a: int, e: int, size: tuple[int, int]) -> torch.Tensor:
    """Rows ``a:e`` of ``pred`` (``1 x 1 x h x w``) upsampled to ``size`` as ``F.interpolate(..., mode="bilinear",
    align_corners=True)`` does (``DepthLoss26``, 8.4.190): torch's bilinear ``grid_sample`` at those rows' source
    points, which reads only the input rows they need; equal up to float rounding (the points are normalised)."""
    (h, w), (big_h, big_w) = pred.shape[-2:], size
    if (h, w) == (big_h, big_w):
        return pred[:, :, a:e]
    y = torch.arange(a, e, device=pred.device, dtype=torch.float32) * (2 / max(big_h - 1, 1)) - 1
    x = torch.arange(big_w, device=pred.device, dtype=torch.float32) * (2 / max(big_w - 1, 1)) - 1
    grid = torch.stack(torch.meshgrid(x, y, indexing="xy"), dim=-1)[None].to(pred.dtype)  # 1 x rows x W x (x, y)
    return F.grid_sample(pred, grid, mode="bilinear", padding_mode="border", align_corners=True)


def _depth_pyramid(criterion: Any, gt: torch.Tensor, valid: torch.Tensor) -> list[tuple]:
    """The ground truth's side of ``DepthLoss26``'s gradient-matching scales, which needs no gradient: per scale its
    log-depth, valid weights and pooling denominator (``None`` at full resolution), stopping where its loop stops."""
    gt_log, valid_f = torch.log(gt.clamp(min=0.001)), valid.float()
    levels = [(gt_log, valid_f, None)]
    for _ in range(1, max(criterion.grad_scales, 1)):
        if gt_log.shape[-1] < 4 or gt_log.shape[-2] < 4:
            break
        vp = F.avg_pool2d(valid_f, 2)
        occupied = vp > 0
        keep = (vp.sum(dim=(1, 2, 3)) > 0.7 * occupied.sum(dim=(1, 2, 3))).view(-1, 1, 1, 1)
        if not keep.any():
            break
        denom = vp.clamp(min=1e-6)
        gt_log = F.avg_pool2d(gt_log * valid_f, 2) / denom
        valid_f = occupied.float() * keep
        levels.append((gt_log, valid_f, denom))
    return levels


def _depth_block(pred: torch.Tensor, gt: torch.Tensor, levels: list[tuple], i: int, rows: tuple[int, int, int],
                 mean: torch.Tensor | None) -> torch.Tensor:
    """Image ``i``'s full-resolution rows ``a:b`` (read with the halo ``b:e`` that the coarser scales' row
    differences need): with ``mean`` ``None``, each scale's sums of ``|pred_dx - gt_dx|`` and ``|pred_dy - gt_dy|``
    over the rows it owns and the sum of its valid log differences; else the sum of their squared deviations from
    ``mean`` (SILog's centred variance)."""
    a, b, e = rows
    p = _upsampled_rows(pred[i:i + 1], a, e, gt.shape[-2:])
    valid = levels[0][1][i:i + 1, :, a:b] > 0
    diff = (torch.log(p[:, :, :b - a].clamp(min=0.001)) - levels[0][0][i:i + 1, :, a:b])[valid]
    if mean is not None:
        return ((diff - mean) ** 2).sum().view(1)
    sums, pred_log = [], torch.log(p.clamp(min=0.001))
    for k, (gt_log, valid_f, denom) in enumerate(levels):
        at, n = a >> k, pred_log.shape[-2] if k == 0 else (pred_log.shape[-2] // 2)
        if k:
            prev = levels[k - 1][1][i:i + 1, :, a >> (k - 1):(a >> (k - 1)) + pred_log.shape[-2]]
            pred_log = F.avg_pool2d(pred_log * prev, 2) / denom[i:i + 1, :, at:at + n]
        g, v = gt_log[i:i + 1, :, at:at + n], valid_f[i:i + 1, :, at:at + n]
        own = n if b == gt.shape[-2] else (b - a) >> k
        pdx = (pred_log[:, :, :own, 1:] - pred_log[:, :, :own, :-1]) * v[:, :, :own, 1:] * v[:, :, :own, :-1]
        gdx = (g[:, :, :own, 1:] - g[:, :, :own, :-1]) * v[:, :, :own, 1:] * v[:, :, :own, :-1]
        dy = min(own, n - 1)
        pdy = (pred_log[:, :, 1:dy + 1] - pred_log[:, :, :dy]) * v[:, :, 1:dy + 1] * v[:, :, :dy]
        gdy = (g[:, :, 1:dy + 1] - g[:, :, :dy]) * v[:, :, 1:dy + 1] * v[:, :, :dy]
        sums += [(pdx - gdx).abs().sum(), (pdy - gdy).abs().sum()]
    return torch.stack([*sums, diff.sum()])


def _depth_loss(criterion: Any, preds: Any, batch: dict) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``DepthLoss26.__call__`` (8.4.190) computed block by block (``_depth_block``, each block a region); Ultralytics'
    own where it returns early, without gradients (validation), or where the rows do not split at the coarsest
    scale."""
    pred = preds["depth"] if isinstance(preds, dict) else preds
    gt = batch["depth"].to(criterion.device)
    gt = gt.unsqueeze(1) if gt.ndim == 3 else gt
    valid = gt > 0.001
    big_h, big_w = gt.shape[-2:]
    levels = _depth_pyramid(criterion, gt, valid) if torch.is_grad_enabled() and valid.sum() >= 10 else []
    align = 2 ** (len(levels) - 1)
    if not levels or big_h % align:
        return type(criterion).__call__(criterion, preds, batch)
    step = max(align, CHUNK_DEPTH_PIXELS // big_w // align * align)
    blocks = [(i, (a, min(a + step, big_h), min(a + step + align, big_h)))
              for i in range(pred.shape[0]) for a in range(0, big_h, step)]
    total = sum(checkpoint_region(partial(_depth_block, pred, gt, levels, i, rows, None), modules=())
                for i, rows in blocks)
    n = valid.sum()
    mean = total[-1] / n
    spread = sum(checkpoint_region(partial(_depth_block, pred, gt, levels, i, rows), mean, modules=())
                 for i, rows in blocks)
    silog = torch.sqrt(spread[0] / n + (1.0 - criterion.silog_lambda) * mean**2 + 1e-6)
    grad = 0
    for k, (gt_log, *_) in enumerate(levels):
        (b, _, h, w) = gt_log.shape
        grad = grad + total[2 * k] / (b * h * (w - 1)) + total[2 * k + 1] / (b * (h - 1) * w)
    loss = torch.stack([silog * criterion.silog_weight, grad * criterion.grad_weight]).float()
    return loss * pred.shape[0], dict(zip(criterion.loss_names, loss.detach()))


class ChunkedDepthLoss:
    """``DepthLoss26`` computed in blocks (``_depth_loss``): a wrapper, since a plain class's ``__call__`` cannot be
    shadowed on its instance. Every attribute reads through to the wrapped criterion (``loss``)."""

    def __init__(self, loss: Any):
        self.loss = loss
        self.checkpoint_loss = "chunked"

    def __call__(self, preds: Any, batch: dict) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        return _depth_loss(self.loss, preds, batch)

    def __getattr__(self, name: str) -> Any:
        if name == "loss":  # not set yet (copy, unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.loss, name)


def _shadow_criterion(criterion: Any, how: str) -> Any:
    """Shadow the methods ``how`` recomputes on ``criterion``'s instance (and its inner losses'); returns it, or the
    depth loss wrapped (``ChunkedDepthLoss``)."""
    from ultralytics.utils.loss import DepthLoss26, SemanticSegmentationLoss, v8SegmentationLoss

    if how == "chunked" and isinstance(criterion, (DepthLoss26, ChunkedDepthLoss)):
        return criterion if isinstance(criterion, ChunkedDepthLoss) else ChunkedDepthLoss(criterion)
    if how == "chunked" and isinstance(criterion, SemanticSegmentationLoss):
        criterion.forward = partial(_semantic_loss, criterion)
        criterion.checkpoint_loss = how
        return criterion
    parts = [c for c in _criteria(criterion) if how == "chunked" or isinstance(c, v8SegmentationLoss)]
    if not parts:
        _refuse(how, type(criterion).__name__)
    for c in parts:
        if how == "chunked":
            c.assigner._forward = partial(_assign_per_image, c.assigner)
            if _scores_masks(c.assigner):
                c.assigner.pair_overlaps = partial(_pair_overlaps_by_objects, c.assigner)
        if isinstance(c, v8SegmentationLoss):
            c.calculate_segmentation_loss = partial(_segmentation_loss, c, how)
    criterion.checkpoint_loss = how
    return criterion


def _init_criterion(model: nn.Module, how: str) -> Any:
    """``model.init_criterion()`` of its class, shadowed by ``how``."""
    return _shadow_criterion(type(model).init_criterion(model), how)


def enable_loss_checkpointing(model: nn.Module, how: str) -> None:
    """Make ``model``'s criterion (built now or later) recompute as ``how`` says; ``none`` leaves it Ultralytics'.

    Args:
        model: An Ultralytics task model.
        how: One of ``LOSS_MODES``.

    Raises:
        CheckpointConfigError: When the model's criterion has nothing ``how`` recomputes (raised when it is built:
            Ultralytics' criterion reads ``model.args``, which the trainer sets after ``get_model``;
            ``check_loss_setting`` refuses such a task before any work).
    """
    if how not in LOSS_MODES:
        raise ValueError(f"checkpoint_loss {how!r} is not one of {LOSS_MODES}")
    disable_loss_checkpointing(model)
    if how == "none":
        return
    model.init_criterion = partial(_init_criterion, model, how)
    # built already (a resumed YOLO26 run's); getattr, not __dict__: an nn.Module criterion (the semantic loss) is
    # kept in _modules
    if (criterion := getattr(model, "criterion", None)) is not None:
        model.criterion = _shadow_criterion(criterion, how)


def disable_loss_checkpointing(model: nn.Module) -> None:
    """Ultralytics' own criterion again: the ``init_criterion`` shadow and every method shadow of a built criterion
    removed (no-op on a plain model)."""
    model.__dict__.pop("init_criterion", None)
    criterion = getattr(model, "criterion", None)  # in __dict__ or, an nn.Module, in _modules
    if criterion is None:
        return
    if isinstance(criterion, ChunkedDepthLoss):
        model.criterion = criterion = criterion.loss
    for c in _criteria(criterion):
        c.assigner.__dict__.pop("_forward", None)
        c.assigner.__dict__.pop("pair_overlaps", None)
        c.__dict__.pop("calculate_segmentation_loss", None)
    criterion.__dict__.pop("forward", None)
    criterion.__dict__.pop("checkpoint_loss", None)


def loss_checkpointing(model: nn.Module) -> str | None:
    """How ``model``'s criterion is recomputed (``"exact"``), or ``None`` when it is Ultralytics' own."""
    fn = model.__dict__.get("init_criterion")
    return fn.args[1] if isinstance(fn, partial) and fn.func is _init_criterion else None
