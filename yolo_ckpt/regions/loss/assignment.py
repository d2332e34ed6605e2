"""Assignment in bounded memory: one image at a time, and YOLO26's mask-aware scoring in groups of objects."""

from __future__ import annotations

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
