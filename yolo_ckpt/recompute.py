"""How a region is recomputed: non-reentrant ``torch.utils.checkpoint`` that leaves module state as vanilla would.

A plain recompute runs the region's forward twice per step, and in train mode BatchNorm updates ``running_mean``,
``running_var`` and ``num_batches_tracked`` on both runs (pytorch/pytorch#96136). Training *looks* identical (the
gradients are), but the saved statistics are not. ``checkpoint_region`` restores every buffer of the region's modules
after the recompute, so any layer with running statistics — BatchNorm of any dimension, SyncBatchNorm, InstanceNorm
with ``track_running_stats`` — ends the step exactly as without checkpointing.

Under ``torch.compile`` the restore is neither needed nor possible: dynamo turns the checkpoint into a
``tag_activation_checkpoint`` region of the traced graph; AOTAutograd (behind inductor, the backend Ultralytics
compiles with, and ``aot_eager``) functionalizes BatchNorm so the graph writes its buffers once; and a compiled
checkpoint accepts no ``context_fn`` but selective-checkpoint dispatch modes (torch 2.14.1; checked bit for bit in
``tests/test_compile.py``). Dynamo's debugging ``eager`` backend does not functionalize, and torch's checkpoint then
fails on the second BatchNorm update with or without yolo-ckpt.

Example:
    >>> import torch
    >>> from torch import nn
    >>> block = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.SiLU())
    >>> x = torch.randn(2, 3, 16, 16)
    >>> y = checkpoint_region(block, x, modules=[block])
    >>> y.sum().backward()
    >>> int(block[1].num_batches_tracked)  # one forward's worth, not two
    1
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager, nullcontext
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts


@contextmanager
def restored_buffers(modules: Iterable[nn.Module]) -> Iterator[None]:
    """Put every buffer of ``modules`` back to its value on entry, in place, when the block exits.

    In-place so that the tensors the model, its EMA pairing and optimizers hold stay the same objects.
    """
    buffers = list({id(b): b for m in modules for b in m.buffers()}.values())
    saved = [b.clone() for b in buffers]
    try:
        yield
    finally:
        with torch.no_grad():
            for b, s in zip(buffers, saved):
                b.copy_(s)


def stored_as_usual() -> torch.autograd.graph.saved_tensors_hooks:
    """Tensors saved for backward inside the block are stored as without checkpointing, also inside a checkpoint's
    forward (the innermost saved-tensor hooks apply): the parts of a layer outside a run it recomputes."""
    return torch.autograd.graph.saved_tensors_hooks(_same, _same)


def _same(t: torch.Tensor) -> torch.Tensor:
    return t


MODES = ("full", "selective")
"""How a region is recomputed: ``full`` keeps only the region's inputs; ``selective`` also keeps the outputs of its
expensive ops (convolutions, matrix products) and recomputes the rest (normalisation, activations, elementwise ops,
concat, upsample, pooling, cheap convolutions) — most of the memory for almost none of the FLOPs."""

_aten = torch.ops.aten
SAVED_OPS = frozenset({  # the expensive ops whose outputs selective recompute keeps
    _aten.convolution.default, _aten.mm.default, _aten.addmm.default, _aten.bmm.default, _aten.baddbmm.default,
    _aten._scaled_dot_product_flash_attention.default, _aten._scaled_dot_product_efficient_attention.default,
    _aten._scaled_dot_product_cudnn_attention.default,
})
CHEAP_CONV_MACS = 32
"""Multiply-adds per output element up to which a convolution is recomputed rather than kept: the RGB stem (3x3x3 =
27), depthwise 3x3 (9), 1x1 over at most 32 channels. Their outputs are as large as any other's, their recompute
nearly free: yolo11n at 640 px, all stages, goes from 0.662x to 0.621x the vanilla peak for 1.006x the FLOPs
(64 would give 0.583x for 1.017x)."""


def _selective_policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """Keep the outputs of expensive ops; recompute everything else (BatchNorm too: its buffers are restored)."""
    if op is _aten.convolution.default and math.prod(args[1].shape[1:]) <= CHEAP_CONV_MACS:  # weight: out, in/g, k..
        return CheckpointPolicy.PREFER_RECOMPUTE
    return CheckpointPolicy.MUST_SAVE if op in SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


@contextmanager
def _recompute(modules: tuple[nn.Module, ...], cached: Any) -> Iterator[None]:
    """The recompute of a selective region: buffers restored *outside* the replaying mode, which admits no op but the
    region's own (a ``copy_`` of ours inside it would be looked up in its cache and fail)."""
    with restored_buffers(modules), cached:
        yield


def _contexts(modules: tuple[nn.Module, ...], mode: str = "full") -> tuple[Any, Any]:
    """``context_fn`` for checkpoint: the forward runs untouched (or caching, selective); the recompute restores
    module buffers."""
    if mode == "full":
        return nullcontext(), restored_buffers(modules)
    caching, cached = create_selective_checkpoint_contexts(_selective_policy)
    return caching, _recompute(modules, cached)


def checkpoint_region(fn: Callable[..., Any], *args: Any, modules: Iterable[nn.Module], mode: str = "full") -> Any:
    """Run ``fn(*args)`` keeping only its inputs (and, ``selective``, its convolution outputs) for backward.

    Args:
        fn: The region's forward.
        *args: Its inputs; the region's parameters get gradients even when no input requires grad (the stem's
            image), which reentrant checkpointing would not give.
        modules: Modules whose buffers ``fn`` may mutate (the region's layers).
        mode: One of ``MODES``.

    Returns:
        Whatever ``fn`` returns, bit-identical to calling it directly.
    """
    if torch.compiler.is_compiling():  # BatchNorm is functionalized: the graph writes its buffers once
        if mode == "full":
            return checkpoint(fn, *args, use_reentrant=False)
        context_fn = partial(create_selective_checkpoint_contexts, _selective_policy)
        return checkpoint(fn, *args, use_reentrant=False, context_fn=context_fn)
    return checkpoint(fn, *args, use_reentrant=False, context_fn=partial(_contexts, tuple(modules), mode))
