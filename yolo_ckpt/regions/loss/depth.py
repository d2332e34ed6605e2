"""Depth's loss (``DepthLoss26``) in blocks of rows of one image, each block a region returning its sums."""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
import torch.nn.functional as F

from ..recompute import checkpoint_region

CHUNK_DEPTH_PIXELS = 2**18
"""``chunked``: full-resolution pixels per block of the depth loss (1 MiB per fp32 map of a block: 256 rows of a
1024 px image; each block holds a few such maps and their log-depth pyramid), so that its memory no longer grows with
the image's area."""


def _upsampled_rows(pred: torch.Tensor, a: int, e: int, size: tuple[int, int]) -> torch.Tensor:
    """Rows ``a:e`` of ``pred`` (``1 x 1 x h x w``) upsampled to ``size`` as ``F.interpolate(..., mode="bilinear",
    align_corners=True)`` does (``DepthLoss26``): torch's bilinear ``grid_sample`` at those rows' source
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
    """``DepthLoss26.__call__`` computed block by block (``_depth_block``, each block a region); Ultralytics'
    own where it returns early or where the rows do not split at the coarsest scale; without gradients (the
    validator's loss) in the same blocks, simply run."""
    pred = preds["depth"] if isinstance(preds, dict) else preds
    gt = batch["depth"].to(criterion.device)
    gt = gt.unsqueeze(1) if gt.ndim == 3 else gt
    valid = gt > 0.001
    big_h, big_w = gt.shape[-2:]
    levels = _depth_pyramid(criterion, gt, valid) if valid.sum() >= 10 else []
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
