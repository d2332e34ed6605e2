"""checkpoint_region against plain autograd and plain torch.utils.checkpoint."""

import math
import time
from collections.abc import Callable
from contextlib import nullcontext

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint
from ultralytics.nn.modules import C2PSA, SPPF, C3k2, Conv

from yolo_ckpt.memory.tracker import LiveTensorTracker
from yolo_ckpt.regions.recompute import CHEAP_CONV_MACS, KEEP_NS_PER_BYTE, checkpoint_region, recompute_cost

from support import tensor_differences


def stem_block(norm: nn.Module) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3, 2, 1), norm, nn.SiLU(), Conv(8, 16, 3, 2), C3k2(16, 16, 1, False, 0.5))


def step(block: nn.Sequential, run, x: torch.Tensor, amp: torch.dtype | None = None) -> None:
    """Forward under autocast of ``amp`` (as Ultralytics' loop), backward outside it."""
    block.train()
    with torch.autocast(x.device.type, dtype=amp, enabled=amp is not None):
        loss = run(block, x).float().square().mean()
    loss.backward()


def plain(block, x):
    return block(x)


def full(block, x):
    return checkpoint_region(block, x, modules=[block])


def selective(block, x):
    return checkpoint_region(block, x, modules=[block], mode="selective")


NORMS = [
    lambda: nn.BatchNorm2d(8),
    lambda: nn.BatchNorm2d(8, momentum=None),  # cumulative average: depends on num_batches_tracked
    lambda: nn.InstanceNorm2d(8, affine=True, track_running_stats=True),
]


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
# (device, autocast dtype): CPU in full precision; CUDA in full precision and under both AMP dtypes Ultralytics trains
# with (there BatchNorm may dispatch to cuDNN, and the recompute replays the autocast state)
DEVICE_AMP = [pytest.param("cpu", None, id="cpu"),
              *(pytest.param("cuda", amp, id=f"cuda-{name}", marks=needs_cuda)
                for name, amp in (("fp32", None), ("fp16", torch.float16), ("bf16", torch.bfloat16)))]


@pytest.mark.parametrize("device, amp", DEVICE_AMP)
@pytest.mark.parametrize("ours", [full, selective])
@pytest.mark.parametrize("make_norm", NORMS, ids=["batchnorm", "batchnorm-cumulative", "instancenorm"])
def test_buffers_and_grads_bitwise_equal_to_plain_autograd(make_norm, ours, device, amp):
    x = torch.randn(2, 3, 32, 32).to(device)
    ref, ckpt = stem_block(make_norm()).to(device), stem_block(make_norm()).to(device)
    # deterministic cuDNN algorithms: the same kernels in both runs, so any difference is the recompute's
    with torch.backends.cudnn.flags(enabled=True, benchmark=False, deterministic=True) if device == "cuda" \
            else nullcontext():
        for _ in range(3):
            step(ref, plain, x, amp)
            step(ckpt, ours, x, amp)
    grads = lambda block: {k: p.grad for k, p in block.named_parameters()}  # noqa: E731
    diffs = tensor_differences(ref.state_dict(), ckpt.state_dict(), "buffers and weights") + \
        tensor_differences(grads(ref), grads(ckpt), "grads")
    assert not diffs, "\n".join(line for _, line in sorted(diffs, key=lambda d: -d[0]))


def test_plain_checkpoint_updates_batchnorm_twice():
    """The trap this module exists for: without the buffer restore the statistics drift (torch issue #96136)."""
    x = torch.randn(2, 3, 32, 32)
    ref, naive = stem_block(nn.BatchNorm2d(8)), stem_block(nn.BatchNorm2d(8))
    step(ref, plain, x)
    step(naive, lambda b, x: checkpoint(b, x, use_reentrant=False), x)
    assert int(naive[1].num_batches_tracked) == 2 * int(ref[1].num_batches_tracked)
    assert not torch.equal(naive[1].running_mean, ref[1].running_mean)


def test_stem_gets_gradients_when_input_needs_none():
    x = torch.randn(2, 3, 32, 32)  # an image: requires_grad=False
    ref, ckpt, reentrant = (stem_block(nn.BatchNorm2d(8)) for _ in range(3))
    step(ref, plain, x)
    step(ckpt, full, x)
    assert ckpt[0].weight.grad is not None and ckpt[0].weight.grad.abs().sum() > 0
    assert torch.equal(ckpt[0].weight.grad, ref[0].weight.grad)
    # reentrant checkpointing, the default of older torch, leaves the stem without gradients
    with pytest.warns(UserWarning):
        out = checkpoint(reentrant, x, use_reentrant=True)
    assert not out.requires_grad


def test_buffer_restore_keeps_tensor_identity():
    block = stem_block(nn.BatchNorm2d(8))
    ids = [id(b) for b in block.buffers()]
    step(block, full, torch.randn(2, 3, 32, 32))
    assert ids == [id(b) for b in block.buffers()]  # EMA pairs state_dict tensors by key; objects stay the same


def kept_bytes(run, block, x) -> int:
    """Bytes the forward leaves alive for backward (output included), by exact live-tensor tracking."""
    with LiveTensorTracker() as tracker:
        out = run(block, x)
        kept = tracker.current
        out.sum().backward()
    return kept


def pooled_block() -> nn.Sequential:
    """The stem block and SPPF: convolutions on both sides of ``CHEAP_CONV_MACS`` and 5x5 max pooling windows."""
    torch.manual_seed(0)
    return nn.Sequential(*stem_block(nn.BatchNorm2d(8)), SPPF(16, 16, 5))


def test_selective_keeps_expensive_convolutions_and_pooling_windows():
    """Selective keeps, beyond what full recompute keeps, exactly the outputs of the convolutions with more than
    CHEAP_CONV_MACS multiply-adds per output element and of the pooling windows (SPPF's max pools: 25 compares per
    output element); BatchNorm, SiLU, concat and the cheap convolutions are recomputed. Far less than plain autograd
    keeps."""
    block, x = pooled_block().train(), torch.randn(2, 3, 32, 32)
    got = {run.__name__: kept_bytes(run, block, x) for run in (plain, full, selective)}
    convs = [m for m in block.modules() if isinstance(m, nn.Conv2d)]
    expensive, cheap = [], []
    macs = {m: m.in_channels // m.groups * math.prod(m.kernel_size) for m in convs}  # per output element
    def record(m, i, o):  # max pooling's backward needs the int64 indices of the maxima, kept with the values
        indices = o.numel() * 8 if isinstance(m, nn.MaxPool2d) else 0
        kept = cheap if macs.get(m, math.inf) <= CHEAP_CONV_MACS else expensive
        kept.append(o.untyped_storage().nbytes() + indices)

    hooks = [m.register_forward_hook(record) for m in block.modules() if isinstance(m, (nn.Conv2d, nn.MaxPool2d))]
    block(x)
    for h in hooks:
        h.remove()
    assert len(expensive) > 3 and cheap  # three pooling windows, convolutions over 72; the RGB stem (27), 1x1s
    assert got["selective"] - got["full"] == sum(expensive), (got, expensive, cheap)
    assert got["selective"] < got["plain"]


def test_selective_with_pooling_and_attention_bitwise_equal_to_plain_autograd():
    """What the cost rule keeps beyond convolutions — pooling windows, attention's long-inner-dimension matmul — and
    what it recomputes — BatchNorm, softmax, the short-inner-dimension QK^T — change nothing: buffers, weights and
    gradients after three steps are those of plain autograd."""
    make = lambda: nn.Sequential(*pooled_block(), Conv(16, 128, 3, 2), C2PSA(128, 128))  # noqa: E731
    ref, ckpt, x = make(), make(), torch.randn(2, 3, 64, 64)  # 64 tokens of 32-wide keys in the attention
    for _ in range(3):
        step(ref, plain, x)
        step(ckpt, selective, x)
    grads = lambda block: {k: p.grad for k, p in block.named_parameters()}  # noqa: E731
    diffs = tensor_differences(ref.state_dict(), ckpt.state_dict(), "buffers and weights") + \
        tensor_differences(grads(ref), grads(ckpt), "grads")
    assert not diffs, "\n".join(line for _, line in sorted(diffs, key=lambda d: -d[0]))


def _ns_per_byte(op: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, rounds: int = 7) -> float:
    """Measured CPU time of ``op(x)`` per byte of its output (the fastest of ``rounds``, this thread's own time)."""
    times = []
    for _ in range(rounds):
        t0 = time.thread_time_ns()
        out = op(x)
        times.append(time.thread_time_ns() - t0)
    return min(times) / (out.numel() * out.element_size())


def test_cost_model_orders_ops_as_this_cpu_times_them():
    """The model behind the rule against this machine's clock: SiLU, BatchNorm in training, a 3x3 convolution over 32
    channels and a 5x5 max pool, timed per byte of output, fall in the order their modelled costs give, and
    KEEP_NS_PER_BYTE splits them as the rule acts (SiLU and BatchNorm recomputed, the convolution and the pool kept);
    each is more than 1.25x the one before, so the order is not noise (quiet, each step is 2x or more; on a loaded
    2-core CI machine the two memory-bound ops came within 1.45x of each other)."""
    torch.manual_seed(0)
    x, aten = torch.randn(4, 32, 64, 64), torch.ops.aten
    conv, bn, pool = nn.Conv2d(32, 32, 3, 1, 1, bias=False), nn.BatchNorm2d(32).train(), nn.MaxPool2d(5, 1, 2)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the model's figures are one thread's; thread_time sees only this one
    try:
        with torch.no_grad():
            measured = {"silu": _ns_per_byte(torch.nn.functional.silu, x), "batch norm": _ns_per_byte(bn, x),
                        "conv": _ns_per_byte(conv, x), "pool": _ns_per_byte(pool, x)}
    finally:
        torch.set_num_threads(threads)
    modelled = {"silu": recompute_cost(aten.silu.default, (x,), x),
                "batch norm": recompute_cost(aten.native_batch_norm.default, (x,), x),
                "conv": recompute_cost(aten.convolution.default, (x, conv.weight), x),
                "pool": recompute_cost(aten.max_pool2d_with_indices.default, (x, [5, 5]), x)}
    assert sorted(measured, key=measured.get) == sorted(modelled, key=modelled.get) == list(measured), measured
    assert [modelled[k] >= KEEP_NS_PER_BYTE for k in modelled] == [False, False, True, True]
    ratios = [b / a for a, b in zip(list(measured.values()), list(measured.values())[1:])]
    assert min(ratios) > 1.25, measured
