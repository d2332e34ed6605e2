"""checkpoint_region against plain autograd and plain torch.utils.checkpoint."""

import math
from contextlib import nullcontext

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint
from ultralytics.nn.modules import C3k2, Conv

from yolo_ckpt.memory import LiveTensorTracker
from yolo_ckpt.recompute import CHEAP_CONV_MACS, checkpoint_region

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


def test_selective_keeps_the_outputs_of_expensive_convolutions():
    """Selective keeps, beyond what full recompute keeps, exactly the outputs of the convolutions with more than
    CHEAP_CONV_MACS multiply-adds per output element; far less than plain autograd keeps."""
    block, x = stem_block(nn.BatchNorm2d(8)).train(), torch.randn(2, 3, 32, 32)
    got = {run.__name__: kept_bytes(run, block, x) for run in (plain, full, selective)}
    outputs = {}
    convs = [m for m in block.modules() if isinstance(m, nn.Conv2d)]
    record = lambda m, i, o: outputs.__setitem__(m, o.untyped_storage().nbytes())  # noqa: E731
    hooks = [m.register_forward_hook(record) for m in convs]
    block(x)
    for h in hooks:
        h.remove()
    macs = {m: m.in_channels // m.groups * math.prod(m.kernel_size) for m in convs}  # per output element
    expensive = [n for m, n in outputs.items() if macs[m] > CHEAP_CONV_MACS]
    assert 0 < len(expensive) < len(outputs)  # the RGB stem (27) and the 1x1 convs over 16 channels are cheap
    assert got["selective"] - got["full"] == sum(expensive), (got, outputs)
    assert got["selective"] < got["plain"]
