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

from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager, nullcontext
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint


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


def _contexts(modules: tuple[nn.Module, ...]) -> tuple[Any, Any]:
    """``context_fn`` for checkpoint: the forward runs untouched; the recompute restores module buffers."""
    return nullcontext(), restored_buffers(modules)


def checkpoint_region(fn: Callable[..., Any], *args: Any, modules: Iterable[nn.Module]) -> Any:
    """Run ``fn(*args)`` keeping only its inputs for backward, recomputing the rest during backward.

    Args:
        fn: The region's forward.
        *args: Its inputs; the region's parameters get gradients even when no input requires grad (the stem's
            image), which reentrant checkpointing would not give.
        modules: Modules whose buffers ``fn`` may mutate (the region's layers).

    Returns:
        Whatever ``fn`` returns, bit-identical to calling it directly.
    """
    if torch.compiler.is_compiling():  # BatchNorm is functionalized: the graph writes its buffers once
        return checkpoint(fn, *args, use_reentrant=False)
    return checkpoint(fn, *args, use_reentrant=False, context_fn=partial(_contexts, tuple(modules)))
