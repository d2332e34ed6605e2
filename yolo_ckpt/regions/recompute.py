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

A compiled backward is one graph, and the partitioner recomputes a region's nodes once, from what the forward saved.
It tells regions apart by the id each node of a region carries (``ac_graph_id``): where a recomputed node feeds a
node of a later region, it saves that node (``torch._functorch.partitioners.cleanup_recompute_tags``). torch's
selective-checkpoint mode, which stamps the id while AOTAutograd traces, lets the enclosing region's mode stamp last,
so a region nested in another (a layer's parts inside a stage's region) carried the enclosing id: the whole stage was
recomputed at once and alive together in backward. ``checkpoint_region`` therefore always compiles with a caching mode
of its own (``_RegionMode``) that re-stamps the nodes of its region with the region's own id after the op is traced:
the nested region's inputs are saved, and the backward recomputes it from them, region by region, as eagerly. Eager
checkpointing recomputes a nested region twice instead (inside the enclosing recompute, then again for its own
backward), which keeps less (its inputs are not kept from the forward); one graph recomputes a node once.

Examples:
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
import types
import weakref
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager, nullcontext
from enum import Enum
from functools import partial
from itertools import islice
from typing import Any

import torch
from torch import nn
from torch.fx.experimental.proxy_tensor import get_proxy_mode
from torch.utils._pytree import tree_leaves
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

try:  # private (torch 2.14.1): the selective-checkpoint caching mode; its compile-time ``ac_graph_id`` stamp
    from torch.utils.checkpoint import _CachingTorchDispatchMode
except ImportError:  # a torch without it: compiled nested regions recompute with their enclosing region
    _CachingTorchDispatchMode = None


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


def enclosing_hooks() -> tuple[Callable[..., Any], Callable[..., Any]] | None:
    """The saved-tensor hooks active now (an enclosing checkpoint's, or its recompute's), ``None`` outside any.

    Private torch API, the one call ``torch.utils.checkpoint`` itself makes to find them (torch 2.14.1): there is no
    public way to read the innermost ``saved_tensors_hooks``.
    """
    return torch._C._autograd._top_saved_tensors_default_hooks(False)


def stored_as_around(hooks: tuple[Callable[..., Any], Callable[..., Any]] | None) -> Any:
    """Inside the block, tensors saved for backward are stored as ``hooks`` (``enclosing_hooks`` taken before a
    checkpoint began) store them, or as without checkpointing: the innermost saved-tensor hooks apply, so the parts of
    a layer outside a run it recomputes store as they would without that run, nested in a larger region or not."""
    return torch.autograd.graph.saved_tensors_hooks(*(hooks or (_same, _same)))


def _same(t: torch.Tensor) -> torch.Tensor:
    return t


class Mode(str, Enum):
    """How a region is recomputed: ``full`` keeps only the region's inputs; ``selective`` also keeps the outputs whose
    recompute costs most per byte kept (convolutions over more than ``CHEAP_CONV_MACS`` multiply-adds per output
    element, matrix products with a long inner dimension, attention, pooling windows, reductions) and recomputes the
    rest (BatchNorm, activations, elementwise ops, concat, upsample, the cheapest convolutions): ``recompute_cost``.

    A ``str`` as well, so that the value a user writes (``checkpoint_mode=selective``) compares equal to it.
    """

    FULL = "full"
    SELECTIVE = "selective"

    def __str__(self) -> str:
        return self.value

    __format__ = str.__format__


MODES = tuple(m.value for m in Mode)  # the values checkpoint_mode takes, in the order help lists them

_aten = torch.ops.aten
_MATMULS = {_aten.mm.default: 0, _aten.addmm.default: 1, _aten.bmm.default: 0, _aten.baddbmm.default: 1}
"""Matrix products, each with the argument whose last dimension is the inner (multiply-add) dimension."""
SAVED_OPS = frozenset({  # attention: its recompute is a whole softmax(QK^T)V, always kept
    _aten._scaled_dot_product_flash_attention.default, _aten._scaled_dot_product_efficient_attention.default,
    _aten._scaled_dot_product_cudnn_attention.default, _aten._scaled_dot_product_flash_attention_for_cpu.default,
})
_POOLS = frozenset({_aten.max_pool2d_with_indices.default, _aten.max_pool2d.default, _aten.avg_pool2d.default})
_BATCH_NORMS = frozenset(getattr(_aten, name).default for name in (
    "native_batch_norm", "cudnn_batch_norm", "_batch_norm_with_update", "_native_batch_norm_legit",
    "_native_batch_norm_legit_functional") if hasattr(_aten, name))

# Modelled recompute time in nanoseconds per byte of the op's output (fp32, one CPU thread), fitted to the per-op
# times of yolo11n's backbone at 640 px, batch 4 (``python benchmarks/selective_policy.py`` prints them measured):
NS_PER_MAC = 0.0042  # convolution/matmul, per multiply-add per output element: 27 MACs 0.22, 144 MACs 0.71 measured
NS_COMPUTE = 0.11  # ... plus a fixed part (reading the input, writing the output)
NS_PER_TAP = 0.28  # pooling, per window element per byte of values (scalar compares): SPPF's 5x5 max pool 6.9
# measured per byte of its values, 2.3 per byte kept with its int64 indices
NS_BATCH_NORM = 0.33  # BatchNorm in training: two reductions over the input for its statistics, then normalising
NS_PER_BYTE_TOUCHED = 0.03  # any other op, per byte it reads and writes: SiLU 0.06, concat 0.05 measured
KEEP_NS_PER_BYTE = 0.35
"""Selective keeps an op's output when its modelled recompute costs at least this per byte kept; below it, the
recompute is the cheaper way to have the tensor in backward. The exchange rate between memory and time sits just above
BatchNorm, the costliest memory-bound op: yolo11n's whole backbone at 640 px, batch 4 keeps 0.596x the vanilla peak at
1.015x the FLOPs and 1.118x the CPU step time (the by-name rule before: 0.621x, 1.006x, 1.129x); with BatchNorm's
outputs kept too, 0.758x at 1.061x; keeping everything, 1.040x at 1.021x, the selective machinery alone
(``python benchmarks/selective_policy.py``, docs/figures.md, "Selective: where the bytes and the time are")."""
CHEAP_CONV_MACS = math.floor((KEEP_NS_PER_BYTE - NS_COMPUTE) / NS_PER_MAC)
"""Multiply-adds per output element up to which a convolution (or matmul) is recomputed rather than kept (57): the
RGB stem (3x3x3 = 27), depthwise 3x3 to 7x7, 1x1 over at most 57 channels, attention's QK^T over 32-wide heads; their
outputs are as large as any other's and their recompute costs less per byte than BatchNorm's."""


def _nbytes(value: Any) -> int:
    """Bytes of the tensors in an op's argument or output (nested lists/tuples; fake tensors under compile too)."""
    return sum(t.numel() * t.element_size() for t in tree_leaves(value) if isinstance(t, torch.Tensor))


def recompute_cost(op: Any, args: tuple, output: Any) -> float:
    """Modelled time to recompute ``op`` per byte of its ``output``, in nanoseconds (``inf``: always keep).

    Compute-bound ops (convolutions, matrix products, attention, pooling) cost by their work per output element;
    everything else is memory-bound and costs by the bytes it touches per byte it writes, so reductions, whose outputs
    are small, are kept; BatchNorm, which reads its input three times and reduces per channel, has a measured figure of
    its own, five times SiLU's.
    """
    if op is _aten.convolution.default:  # weight: out, in/groups, kernel...
        return NS_COMPUTE + NS_PER_MAC * math.prod(args[1].shape[1:])
    if op in _MATMULS:
        return NS_COMPUTE + NS_PER_MAC * args[_MATMULS[op]].shape[-1]
    if op in SAVED_OPS:
        return math.inf
    if op in _POOLS:
        kernel = args[1]  # int[2]; one int stands for a square window
        taps = math.prod(kernel) if len(kernel) > 1 else kernel[0] ** 2
        values = output[0] if isinstance(output, (tuple, list)) else output  # max pooling also keeps int64 indices
        return NS_PER_TAP * taps * _nbytes(values) / max(_nbytes(output), 1)
    if op in _BATCH_NORMS:
        return NS_BATCH_NORM
    written = _nbytes(output)
    return NS_PER_BYTE_TOUCHED * (_nbytes(args) + written) / written if written else 0.0


def _aliases(op: Any) -> bool:
    """Does ``op`` return a view of, or write into, one of its inputs? Keeping such an output keeps (or caches a
    mutated) input storage: always recomputed (the second ``num_batches_tracked.add_`` is undone by the restore)."""
    schema = getattr(op, "_schema", None)
    return schema is None or any(r.alias_info is not None for r in schema.returns)


def _selective_policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """Keep the output when its recompute costs at least ``KEEP_NS_PER_BYTE`` per byte kept (``recompute_cost``);
    recompute everything else (BatchNorm too: its buffers are restored)."""
    if _aliases(op) or recompute_cost(op, args, ctx.op_output) < KEEP_NS_PER_BYTE:
        return CheckpointPolicy.PREFER_RECOMPUTE
    return CheckpointPolicy.MUST_SAVE


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


def _recompute_all(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """A full region under compile: every op recomputed (what a compiled checkpoint without ``context_fn`` uses)."""
    return CheckpointPolicy.PREFER_RECOMPUTE


if _CachingTorchDispatchMode is not None:

    class _RegionMode(_CachingTorchDispatchMode):
        """torch's selective-checkpoint caching mode that stamps the graph nodes each op of its region traces to with
        its region's id (``ac_graph_id``, set by ``tag_activation_checkpoint`` while AOTAutograd traces).

        Modes run innermost first and the op is traced in the outermost, whose id torch stamps on the node; this mode
        re-stamps after the op returns, so a nested region's nodes carry its own id and the partitioner saves its
        inputs (see the module doc). Outside AOTAutograd's tracing (eager, a region run without compile) it is
        torch's mode unchanged.
        """

        def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
            tracer = getattr(get_proxy_mode(), "tracer", None)
            if tracer is None or getattr(self, "ac_graph_id", None) is None:  # set by torch 2.14.1 when tracing
                return super().__torch_dispatch__(func, types, args, kwargs)
            graph = tracer.graph
            before = len(graph.nodes)
            out = super().__torch_dispatch__(func, types, args, kwargs)
            for node in islice(reversed(graph.nodes), len(graph.nodes) - before):  # the op's nodes are the last
                node.meta["ac_graph_id"] = self.ac_graph_id
            return out


def _compiled_contexts(policy: Callable[..., CheckpointPolicy]) -> tuple[Any, Any]:
    """``context_fn`` of a compiled region: torch's selective-checkpoint modes for ``policy``, the caching one stamping
    the region's own id on its nodes (``_RegionMode``; torch's own modes where torch has no such mode)."""
    caching, cached = create_selective_checkpoint_contexts(policy)
    if _CachingTorchDispatchMode is None or type(caching) is not _CachingTorchDispatchMode:
        return caching, cached
    return _RegionMode(policy, caching.storage), cached


def checkpoint_region(fn: Callable[..., Any], *args: Any, modules: Iterable[nn.Module], mode: str = "full") -> Any:
    """Run ``fn(*args)`` keeping only its inputs (and, ``selective``, the outputs costly to recompute) for backward.

    Args:
        fn: The region's forward.
        *args: Its inputs; the region's parameters get gradients even when no input requires grad (the stem's
            image), which reentrant checkpointing would not give.
        modules: Modules whose buffers ``fn`` may mutate (the region's layers).
        mode: One of ``MODES``.

    Returns:
        Whatever ``fn`` returns, bit-identical to calling it directly.
    """
    if not torch.is_grad_enabled():  # nothing is kept for a backward that will not come: nothing to recompute
        return fn(*args)
    if torch.compiler.is_compiling() and _apart.backend and mode == "full":
        return _checkpoint_apart(fn, args, tuple(modules))
    if torch.compiler.is_compiling():  # BatchNorm is functionalized: the graph writes its buffers once
        policy = _recompute_all if mode == "full" else _selective_policy
        return checkpoint(fn, *args, use_reentrant=False, context_fn=partial(_compiled_contexts, policy))
    return checkpoint(fn, *args, use_reentrant=False, context_fn=partial(_contexts, tuple(modules), mode))


# ------------------------------------------------------------------------------- regions compiled apart (opt-in)
# Under ``regions_compiled_apart(backend)``, a compiled model's ``full`` regions leave its graph: dynamo breaks the
# graph at each region (``torch.compiler.disable``), the region runs under eager non-reentrant checkpointing, and its
# inside is compiled as a graph of its own (``torch.compile`` with ``backend``), called both in the forward and in the
# recompute (the backward runs outside the model's compiled frames, where nothing else would compile it). The
# backward then recomputes region by region exactly as eagerly, nested regions twice, with compiled kernels.


class _Apart:
    backend: str | None = None
    layout: bool = True  # inductor's layout_optimization before regions were compiled apart
    recompiles: int = 8  # dynamo's recompile_limit before


RECOMPILE_LIMIT = 64
"""dynamo's ``recompile_limit`` while regions compile apart (torch's default 8): the frames a region's break leaves
(``checkpoint_region``'s, guarded on its first module's type; a block's forward resumed after a nested part) compile
once per region kind, and ``least`` on yolo11n passed 8, after which dynamo ran those frames eagerly, their regions
no longer compiled apart ("hit config.recompile_limit (8)")."""


_apart = _Apart()
_compiled_regions: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


@contextmanager
def regions_compiled_apart(backend: str | None = "inductor") -> Iterator[None]:
    """While the block runs, a compiled model's ``full`` regions are compiled apart from its graph, each with
    ``backend`` (see above; ``selective`` regions stay in the graph), and inductor compiles channels first
    (``torch._inductor.config.layout_optimization`` off). Hold it for every step of the compiled model:
    dynamo guards on it, and a step outside it compiles the model again, in one graph. ``None``: held off, until
    ``compile_regions_apart`` switches it on inside (a run whose ``auto`` chooses once it started); either way
    both are put back when the block exits.

    On yolo11n at 640 px, batch 4 (CPU, inductor), ``least-stem`` then keeps 0.296x of eager vanilla's step peak at
    1.27-1.41x its time (six runs, median 1.34x), against 0.336x in one graph, channels first (docs/compile.md)."""
    prior = _apart.backend
    compile_regions_apart(backend)
    try:
        yield
    finally:
        compile_regions_apart(prior)


def compile_regions_apart(backend: str | None) -> None:
    """Compile regions apart with ``backend`` from now on, or (``None``) in the model's graph again, with inductor's
    own layout back. Channels first while apart: the frames dynamo resumes after each region's break (our loop's,
    shared by every region) recompile with symbolic sizes, which inductor's channels-last layout failed to order
    (yolo11n, 640 px: "cannot determine truth value of Relational"); channels-last also copies every weight each
    step. dynamo's ``recompile_limit`` is raised meanwhile (``RECOMPILE_LIMIT``)."""
    if backend and not _apart.backend:
        _apart.layout, torch._inductor.config.layout_optimization = torch._inductor.config.layout_optimization, False
        _apart.recompiles = torch._dynamo.config.recompile_limit
        torch._dynamo.config.recompile_limit = max(_apart.recompiles, RECOMPILE_LIMIT)
    elif not backend and _apart.backend:
        torch._inductor.config.layout_optimization = _apart.layout
        torch._dynamo.config.recompile_limit = _apart.recompiles
    _apart.backend = backend


def _run(fn: Callable[..., Any], *args: Any) -> Any:
    return fn(*args)


def _compiled_region(fn: Callable[..., Any], modules: tuple[nn.Module, ...]) -> Callable[..., Any]:
    """The region's own compiled ``_run``, made once per region, with a code object of its own: dynamo caches and
    counts recompiles per code object, and one shared by every region would pass ``recompile_limit`` (8) on yolo11n."""
    own = _compiled_regions.setdefault(modules[0], {})
    key = (getattr(fn, "func", fn), tuple(map(id, modules)), _apart.backend)
    if key not in own:
        code = _run.__code__.replace(co_name=f"_run_region_{len(own)}")
        own[key] = torch.compile(types.FunctionType(code, _run.__globals__, code.co_name), backend=_apart.backend)
    return own[key]


@torch.compiler.disable
def _checkpoint_apart(fn: Callable[..., Any], args: tuple, modules: tuple[nn.Module, ...]) -> Any:
    """A region left out of the compiled graph: eager checkpointing (buffers restored after the recompute, as
    eagerly) of its inside compiled apart."""
    from .install import _part_forward  # install imports this module

    if isinstance(fn, partial) and fn.func is _part_forward:
        # dynamo, resuming after the graph break, rebuilt a part's bound ``forward`` as the attribute ``forward``,
        # which is the part's shadow: run the forward it shadows
        module, prior = fn.args[:2]
        fn = prior if prior is not None else type(module).forward.__get__(module)
    return checkpoint(_compiled_region(fn, modules), fn, *args, use_reentrant=False,
                      context_fn=partial(_contexts, modules, "full"))
