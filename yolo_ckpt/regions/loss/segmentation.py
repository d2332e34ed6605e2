"""Instance segmentation's mask loss, one image (``exact``) or one chunk of foreground rows (``chunked``) a region."""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
from torch import nn

from ..recompute import checkpoint_region

CHUNK_ROWS_PIXELS = 2**22
"""``chunked``: foreground rows times mask pixels per chunk of the mask loss (16 MiB per ``rows x h x w`` fp32
tensor; 64 rows of 256 x 256 masks, the 1024 px default), so that its memory no longer grows with objects."""


def _scores_masks(assigner: nn.Module) -> bool:
    """Whether ``assigner`` is YOLO26 segmentation's mask-aware one (8.4.162, the oldest supported, lacks it)."""
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
    """``v8SegmentationLoss.calculate_segmentation_loss`` with each image's mask loss one region
    (``exact``), or one region per chunk of its foreground rows (``chunked``). Without gradients (the validator's
    loss) the regions are simply run: the same pieces, so validation is bounded as training is."""
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
