"""Assignment in bounded memory: one image at a time (bit for bit, or as Ultralytics' own retry does), and YOLO26's
mask-aware scoring in groups of objects."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from functools import partial

import torch
from torch import nn

CHUNK_MASK_IOU_PIXELS = 2**22
"""``chunked``: anchors times mask pixels that YOLO26 segmentation's mask-aware assigner decodes at a time
(``SegTaskAlignedAssigner.pair_overlaps``, which scores up to ``3 * topk`` anchors per object by the IoU of its
predicted mask): objects in groups of ``CHUNK_MASK_IOU_PIXELS // (3 * topk * mask pixels)``, at least one. Measured
at 1024 px, batch 2, 300 objects per image (``tests/test_loss.py`` checks the groups at 160 px): each group's overlaps
at most 24 MiB, each image's whole assignment at most 99 MiB, against 4.0 GB for Ultralytics' assignment of the
batch (its decode takes at least one image's candidate anchors at once)."""


def _assign_per_image(assigner: nn.Module, pd_scores: torch.Tensor, pd_bboxes: torch.Tensor,
                      anc_points: torch.Tensor, gt_labels: torch.Tensor, gt_bboxes: torch.Tensor,
                      mask_gt: torch.Tensor, **extra: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``TaskAlignedAssigner._forward`` as its ``forward`` runs it after an out-of-memory error: one image
    at a time, each with its objects up to its last valid one, the results written into batch-sized outputs.

    Shadowing ``_forward`` (not ``forward``) keeps what ``forward`` does first, on every assigner: no objects at all,
    the pose assigner's per-anchor strides."""
    if assigner.bs == 1:
        return type(assigner)._forward(assigner, pd_scores, pd_bboxes, anc_points, gt_labels, gt_bboxes, mask_gt,
                                       **extra)
    return _each_image(assigner, (pd_scores, pd_bboxes, anc_points, gt_labels, gt_bboxes, mask_gt), extra)


def _each_image(assigner: nn.Module, args: tuple, extra: dict, before: Callable[[int, int], None] | None = None
                ) -> tuple[torch.Tensor, ...]:
    """``_forward`` of ``assigner``'s class on each image of ``args`` (``_forward``'s), with its objects up to its
    last valid one, the results written into batch-sized outputs; ``before(i, start)`` prepares image ``i``."""
    pd_scores, pd_bboxes, anc_points, gt_labels, gt_bboxes, mask_gt = args
    cls, bs, n_max_boxes = type(assigner), assigner.bs, assigner.n_max_boxes
    results = None
    try:
        assigner.bs = 1
        for i, n in enumerate(_last_objects(mask_gt)):
            assigner.n_max_boxes = n
            if before is not None:
                before(i, n)
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
        assigner.__dict__.pop("get_box_metrics", None)  # ``_assign_exact``'s
    return results


def _last_objects(mask_gt: torch.Tensor) -> list[int]:
    """Each image's objects up to its last valid one (at least one), as ``TaskAlignedAssigner.forward`` trims them."""
    n = mask_gt.shape[1]
    return mask_gt.squeeze(-1).bool().mul(torch.arange(1, n + 1, device=mask_gt.device)).amax(1).clamp_(min=1).tolist()


def _assign_exact(assigner: nn.Module, pd_scores: torch.Tensor, pd_bboxes: torch.Tensor, anc_points: torch.Tensor,
                  gt_labels: torch.Tensor, gt_bboxes: torch.Tensor, mask_gt: torch.Tensor,
                  **extra: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``TaskAlignedAssigner._forward`` one image at a time, bit for bit: the ``objects x anchors`` tensors are one
    image's, and every value is the batched call's.

    The batched call scores its candidate pairs (anchors inside an object) as one list: the pair overlap (CIoU's
    ``atan``, OKS's ``exp``, ProbIoU) and the alignment metric's ``pow``, kernels whose vectorized body and scalar
    tail round differently, so a value depends on where its pair sits in the list. Here the list is the batch's own:
    each image's pairs found by the assigner's own ``select_candidates_in_gts`` (elementwise comparisons and IEEE
    arithmetic, the same per element in any layout), concatenated in the batch's row-major order, and scored in one
    call as ``get_box_metrics`` scores them. Everything after the scores is per image and exact in any layout (top-k,
    max, scatter, masks, one multiply and one divide per element), so each image then runs Ultralytics' ``_forward``
    with its slice of those scores. An assigner with its own ``get_box_metrics`` (YOLO26 segmentation's mask-aware
    one) keeps the batched call."""
    from ultralytics.utils.tal import TaskAlignedAssigner

    cls, bs, n_max_boxes = type(assigner), assigner.bs, assigner.n_max_boxes
    args = pd_scores, pd_bboxes, anc_points, gt_labels, gt_bboxes, mask_gt
    if bs == 1 or cls.get_box_metrics is not TaskAlignedAssigner.get_box_metrics:
        return cls._forward(assigner, *args, **extra)
    pairs = []
    try:
        assigner.bs = 1
        for i, n in enumerate(_last_objects(mask_gt)):  # as ``get_pos_mask`` finds them
            assigner.n_max_boxes = n
            inside = assigner.select_candidates_in_gts(anc_points, gt_bboxes[i:i + 1, :n], mask_gt[i:i + 1, :n])
            g, a = (inside * mask_gt[i:i + 1, :n])[0].bool().nonzero(as_tuple=True)
            pairs.append((torch.full_like(g, i), g, a))
            del inside
    finally:
        assigner.bs, assigner.n_max_boxes = bs, n_max_boxes
    b, g, a = (torch.cat(x) for x in zip(*pairs))
    # ``get_box_metrics``' scores of the batch's pairs, in one call over the same list
    scores = pd_scores[b, a, gt_labels[b, g, 0].long()]
    overlaps = _pair_overlaps(assigner, (b, g, a), gt_bboxes, pd_bboxes, **extra)
    aligned = scores.pow(assigner.alpha) * overlaps.pow(assigner.beta)
    starts = [0, *itertools.accumulate(len(p[0]) for p in pairs)]

    def image(i: int, n: int) -> None:
        s, e = starts[i], starts[i + 1]
        assigner.get_box_metrics = partial(_scored_pairs, pairs[i][1:], overlaps[s:e], aligned[s:e])

    return _each_image(assigner, args, extra, image)


def _pair_overlaps(assigner: nn.Module, indices: tuple[torch.Tensor, ...], gt_bboxes: torch.Tensor,
                   pd_bboxes: torch.Tensor, **extra: torch.Tensor) -> torch.Tensor:
    """The assigner's ``pair_overlaps`` of the pairs ``indices``; before it existed (8.4.162) ``get_box_metrics``
    computed the same overlaps inline, as ``iou_calculation`` of the pairs' boxes, which this does there."""
    if hasattr(assigner, "pair_overlaps"):
        return assigner.pair_overlaps(indices, gt_bboxes, pd_bboxes, **extra)
    b, g, a = indices
    return assigner.iou_calculation(gt_bboxes[b, g], pd_bboxes[b, a])


def _scored_pairs(pairs: tuple[torch.Tensor, torch.Tensor], overlaps: torch.Tensor, aligned: torch.Tensor,
                  pd_scores: torch.Tensor, pd_bboxes: torch.Tensor, gt_labels: torch.Tensor, gt_bboxes: torch.Tensor,
                  mask_gt: torch.Tensor, **extra: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``get_box_metrics`` of one image from its pairs' scores (``_assign_exact``): the same dense
    ``(1, objects, anchors)`` tensors, filled as Ultralytics fills them."""
    g, a = pairs
    found = mask_gt[0].bool().nonzero(as_tuple=True)
    if not (torch.equal(found[0], g) and torch.equal(found[1], a)):  # the pairs found twice must agree
        raise RuntimeError("checkpoint_loss=exact: the assigner's candidate pairs changed between two passes")
    shape = 1, mask_gt.shape[1], pd_bboxes.shape[-2]
    dense_overlaps = torch.zeros(shape, dtype=pd_bboxes.dtype, device=pd_bboxes.device)
    align_metric = torch.zeros(shape, dtype=aligned.dtype, device=pd_scores.device)
    indices = torch.zeros_like(g), g, a
    dense_overlaps[indices] = overlaps
    align_metric[indices] = aligned
    return align_metric, dense_overlaps


def _pair_overlaps_by_objects(assigner: nn.Module, indices: tuple[torch.Tensor, ...], gt_bboxes: torch.Tensor,
                              pd_bboxes: torch.Tensor, **extra: torch.Tensor) -> torch.Tensor:
    """``SegTaskAlignedAssigner.pair_overlaps`` run on groups of objects (``CHUNK_MASK_IOU_PIXELS``), each
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
