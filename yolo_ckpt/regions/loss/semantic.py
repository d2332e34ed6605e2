"""Semantic segmentation's loss in blocks of rows of one image, each block a region returning its sums."""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
import torch.nn.functional as F

from ..recompute import checkpoint_region

CHUNK_PIXELS = 2**22
"""``chunked``: classes times full-resolution pixels per block of the semantic loss (16 MiB per fp32 block of
upsampled logits: 208 rows of a 1024 px mask with Cityscapes' 19 classes), so that its memory no longer grows with the
image's area."""


def _block_sums(criterion: Any, dice: bool, logits: torch.Tensor, masks: torch.Tensor, i: int,
                rows: tuple[int, int, int, int], scale: tuple[int, int]) -> torch.Tensor:
    """One block of image ``i``: its logits upsampled as ``SemanticSegmentationLoss.forward`` upsamples the whole
    batch (bilinear, ``align_corners=False``), from input rows ``start:end`` (the block's rows ``a:b`` and one
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
    """``SemanticSegmentationLoss.forward`` with the full-resolution logits, cross-entropy and Dice
    computed block by block (``_blocked``); the denominators and target counts, which need no gradient, as there."""
    cls = type(criterion)
    aux = None
    main = preds
    if isinstance(preds, tuple):
        main, aux = preds
    masks = batch["semantic_mask"].to(main.device)
    sums = _blocked(criterion, main, masks)  # also without gradients: the validator's loss, bounded the same
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
