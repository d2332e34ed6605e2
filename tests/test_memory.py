"""Tests for yolo_ckpt.memory.tracker: exact CPU tensor-memory tracking and CUDA allocator peaks
(RSS: test_epoch_memory).

Every expected number is computed independently of the tracker: from dtype
sizes, from ``untyped_storage().nbytes()`` of the tensors themselves, from
``saved_tensors_hooks``, or from ``.grad`` tensors.
"""

from __future__ import annotations

import gc
import threading
import weakref

import pytest
import torch
import torch.nn as nn
from torch.autograd.graph import saved_tensors_hooks
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode
from torch.utils.checkpoint import checkpoint

from yolo_ckpt.memory.tracker import LiveTensorTracker, cuda_peak

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def nbytes(t: torch.Tensor) -> int:
    return t.untyped_storage().nbytes()


def key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


@pytest.fixture(autouse=True)
def _no_leftover_modes():
    yield
    assert _get_current_dispatch_mode() is None, "a test left a dispatch mode on the stack"


# --------------------------------------------------------------------------- torch facts
def test_storage_pyobject_preserved_until_last_tensor_dies():
    """The tracker's free detection relies on this: a weakref to the storage
    PyObject fires exactly when the last tensor (Python- or C++-held) using it dies."""
    fired: list[str] = []
    t = torch.empty(1000)
    s = t.untyped_storage()
    assert t.untyped_storage() is s  # one PyObject per StorageImpl
    weakref.finalize(s, fired.append, "t")
    del s
    gc.collect()
    assert fired == []  # Python storage object dropped, tensor alive -> preserved
    v = t[10:20]
    del t
    gc.collect()
    assert fired == []  # view keeps the storage
    del v
    assert fired == ["t"]  # fires immediately, no gc needed

    # Storage held only from C++ (a tensor saved by autograd).
    fired.clear()
    x = torch.randn(100, requires_grad=True)
    y = x * 2
    z = y.sin()  # sin saves its input y
    s = y.untyped_storage()
    weakref.finalize(s, fired.append, "y")
    del s, y
    gc.collect()
    assert fired == []
    z.sum().backward()  # frees saved tensors
    assert fired == ["y"]


def test_cpu_backward_runs_on_calling_thread():
    threads: list[int] = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            threads.append(threading.get_ident())
            return func(*args, **(kwargs or {}))

    x = torch.randn(4, 3, requires_grad=True)
    with Record():
        loss = (x.exp() * 2).sum()
        n_fwd = len(threads)
        loss.backward()
    assert len(threads) > n_fwd  # backward ops were seen by the mode...
    assert set(threads[n_fwd:]) == {threading.get_ident()}  # ...on this thread


# ----------------------------------------------------------------- known allocations
def test_known_allocation_views_inplace_free_peak_reset():
    with LiveTensorTracker() as tr:
        a = torch.empty(1000, dtype=torch.float32)
        assert nbytes(a) == 4000
        assert (tr.current, tr.peak) == (4000, 4000)

        v = a.view(10, 100)
        s = a[100:200]
        parts = torch.split(a, 100)  # list output of views
        d = a.detach()
        a.add_(1.0)
        v.mul_(2.0)
        torch.add(a, 1.0, out=a)
        v.t_()  # in-place view op
        assert (tr.current, tr.peak) == (4000, 4000)

        b = a.to(torch.float64)  # 8000 B
        assert (tr.current, tr.peak) == (12000, 12000)
        del b
        assert (tr.current, tr.peak) == (4000, 12000)  # free subtracts, peak persists

        tr.reset_peak()
        assert tr.peak == 4000
        del v, s, parts, d
        assert tr.current == 4000  # a still alive
        del a
        assert (tr.current, tr.peak) == (0, 4000)
        tr.reset_peak()
        assert tr.peak == 0


def test_tuple_outputs_nonscalar_outputs_zero_size_and_out_resize():
    with LiveTensorTracker() as tr:
        a = torch.randn(10, 100)  # 4000
        values, indices = torch.max(a, dim=1)  # 10*4 + 10*8
        assert tr.current == 4000 + 40 + 80 == 4000 + nbytes(values) + nbytes(indices)
        srt = torch.sort(a.flatten())  # namedtuple: values f32 + indices int64
        assert tr.current == 4120 + 4000 + 8000
        del srt, values, indices
        assert tr.current == 4000

        scalar = a.sum().item()  # non-tensor output (_local_scalar_dense)
        assert isinstance(scalar, float)
        assert tr.current == 4000

        z = torch.empty(0)
        assert nbytes(z) == 0 and tr.current == 4000
        torch.mul(a, 2.0, out=z)  # out= resizes the (tracked) zero-size storage in place
        assert nbytes(z) == 4000 and tr.current == 8000
        del z, a
        assert tr.current == 0 and tr.peak == 4000 + 120 + 12000  # a + max outputs + sort outputs


def test_preexisting_tensors_are_not_counted_unless_tracked():
    w = torch.randn(1000)  # allocated before the tracker
    with LiveTensorTracker() as tr:
        v = w.view(10, 100)
        w.add_(1.0)
        wt = v.t()
        assert tr.current == 0
        y = w * 2
        assert tr.current == 4000
        assert tr.track([w, v, wt, y]) == 4000  # only w's storage is new to the tracker
        assert tr.current == tr.peak == 8000
    del v, wt, y
    assert tr.current == 4000
    del w
    assert tr.current == 0  # frees are seen after exit too


def test_nested_with_same_tracker_counts_once():
    tr = LiveTensorTracker()
    with tr:
        with tr:
            a = torch.ones(250)
        assert _get_current_dispatch_mode() is tr
        b = torch.ones(250)
    assert _get_current_dispatch_mode() is None
    assert tr.current == 2000 and tr.num_ops == 2
    del a, b


def test_other_threads_are_not_tracked():
    made_elsewhere: list[torch.Tensor] = []
    with LiveTensorTracker() as tr:
        th = threading.Thread(target=lambda: made_elsewhere.append(torch.ones(1000)))
        th.start()
        th.join()
        assert tr.current == 0  # dispatch modes are thread-local
        mine = torch.ones(1000)
    assert tr.current == 4000
    made_elsewhere.clear()
    del mine


# ---------------------------------------------------------------------------- autograd
def test_backward_allocations_are_counted():
    x = torch.randn(1000, requires_grad=True)  # outside: not counted
    with LiveTensorTracker() as tr:
        loss = (x * 3.0).sum()
        loss.backward()  # allocates x.grad (4000 B) on this thread
        del loss
    assert nbytes(x.grad) == 4000
    assert tr.current == 4000
    x.grad = None
    assert tr.current == 0


def _conv_bn_relu_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1, bias=False),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.Conv2d(8, 16, 3, stride=2, padding=1, bias=False),
        nn.BatchNorm2d(16),
        nn.ReLU(),
        nn.MaxPool2d(2),  # saves int64 indices
    ).train()


def test_forward_live_bytes_equal_saved_tensors_bytes():
    """After a forward, every byte allocated by it that is still alive is either
    saved for backward or is the output. saved_tensors_hooks gives the saved
    tensors independently; dedup by storage, drop storages that existed before
    (input, parameters, buffers), add the output if not saved: that must equal
    tracker.current exactly."""
    net = _conv_bn_relu_net()
    x = torch.randn(2, 3, 32, 32, requires_grad=True)
    preexisting = {key(t) for t in [x, *net.parameters(), *net.buffers()]}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved[key(t)] = nbytes(t)
        return t

    tr = LiveTensorTracker()
    with saved_tensors_hooks(pack, lambda t: t):
        with tr:
            out = net(x)
    live_expected = dict(saved)
    live_expected[key(out)] = nbytes(out)
    expected = sum(n for k, n in live_expected.items() if k not in preexisting)
    assert len(saved) >= 8 and expected > 100_000
    assert tr.current == expected
    assert tr.peak > tr.current  # temporaries (BN outputs before ReLU) were freed

    # Backward: activations are released; what stays is exactly the new .grad tensors.
    with tr:
        out.sum().backward()
        del out
    grads = [x.grad, *(p.grad for p in net.parameters())]
    assert tr.current == sum(nbytes(g) for g in grads)


def _deep_stack(depth: int = 12, ch: int = 8) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Conv2d(ch, ch, 3, padding=1), nn.ReLU()) for _ in range(depth)])


def _fwd_bwd(net: nn.Module, x: torch.Tensor, segment: int | None) -> tuple[int, int, int, list[torch.Tensor]]:
    """Forward+backward under a fresh tracker; ``segment`` blocks per checkpoint (None: plain)."""
    net.zero_grad(set_to_none=True)
    x.grad = None
    tr = LiveTensorTracker()
    with tr:
        h = x
        if segment is None:
            h = net(h)
        else:
            for i in range(0, len(net), segment):
                h = checkpoint(net[i : i + segment], h, use_reentrant=False)
        loss = h.sum()
        del h
        after_fwd, fwd_ops = tr.current, tr.num_ops
        loss.backward()
        bwd_ops = tr.num_ops - fwd_ops
        del loss
    grads = [x.grad, *(p.grad for p in net.parameters())]
    return tr.peak, after_fwd, bwd_ops, grads


def test_checkpoint_lowers_tracked_peak_and_keeps_grads_bitwise():
    net = _deep_stack(depth=12)
    x = torch.randn(2, 8, 32, 32, requires_grad=True)
    act = nbytes(torch.empty(2, 8, 32, 32))  # one activation: 64 KiB
    loss_bytes = 4

    peak_plain, fwd_plain, bwd_ops_plain, g_plain = _fwd_bwd(net, x, segment=None)
    peak_ckpt, fwd_ckpt, bwd_ops_ckpt, g_ckpt = _fwd_bwd(net, x, segment=4)

    # Alive after forward. Plain: the 12 ReLU outputs (ReLU saves its result,
    # the next conv saves the same tensor as its input; conv outputs are freed).
    # Checkpointed in 3 segments: only the 2 segment boundaries fed to the next
    # checkpoint. (x and the weights predate the tracker.)
    assert fwd_plain == 12 * act + loss_bytes
    assert fwd_ckpt == 2 * act + loss_bytes
    # Peak: plain ~13 activations; checkpoint ~2 boundaries + one recomputed segment.
    assert peak_ckpt < 0.6 * peak_plain
    # The recomputation in backward is seen: 3 segments x 4 blocks x (conv + ReLU) ops.
    assert bwd_ops_ckpt >= bwd_ops_plain + 24
    assert all(torch.equal(a, b) for a, b in zip(g_plain, g_ckpt))


# --------------------------------------------------------------------------- numerics
def _step(model: nn.Module, x: torch.Tensor) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    from torch.utils._pytree import tree_leaves

    out = [t for t in tree_leaves(model(x)) if isinstance(t, torch.Tensor)]
    sum(t.sum() for t in out).backward()
    grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    model.zero_grad(set_to_none=True)
    return [t.detach().clone() for t in out], grads


def _assert_bitwise(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    assert len(a) == len(b) and len(a) > 0
    for u, v in zip(a, b):
        assert torch.equal(u, v)


def test_tracker_does_not_change_numerics_small_net():
    net = _conv_bn_relu_net()
    x = torch.randn(2, 3, 32, 32)
    ref = _step(net, x)
    with LiveTensorTracker() as tr:
        got = _step(net, x)
    assert tr.peak > 0
    _assert_bitwise(ref[0], got[0])
    _assert_bitwise(ref[1], got[1])


def test_tracker_does_not_change_numerics_yolo11n():
    from ultralytics.nn.tasks import DetectionModel

    torch.manual_seed(0)
    model = DetectionModel("yolo11n.yaml", nc=4, verbose=False).train()
    x = torch.randn(2, 3, 128, 128)
    ref = _step(model, x)
    with LiveTensorTracker() as tr:
        got = _step(model, x)
    assert tr.num_ops > 500 and tr.peak > 0
    _assert_bitwise(ref[0], got[0])
    _assert_bitwise(ref[1], got[1])


# ------------------------------------------------------------------------------- CUDA
def test_cuda_peak_rejects_cpu_device():
    with pytest.raises(ValueError):
        with cuda_peak("cpu"):
            pass
    with pytest.raises(ValueError):
        with cuda_peak(torch.device("cpu")):
            pass


@needs_cuda
def test_cuda_peak_known_allocation():
    dev = torch.device("cuda", torch.cuda.current_device())
    torch.cuda.synchronize(dev)
    base = torch.cuda.memory_allocated(dev)
    with cuda_peak(dev) as nothing:
        pass
    assert nothing.before == nothing.allocated == base
    with cuda_peak("cuda") as peak:
        a = torch.empty(2**20, dtype=torch.float32, device=dev)  # 4 MiB, block-aligned
        b = a * 2
        del b
    alloc, reserved = peak.allocated, peak.reserved
    assert peak.before == base
    assert alloc == base + 2 * 4 * 2**20
    assert reserved >= alloc
    assert (alloc, reserved) == (torch.cuda.max_memory_allocated(dev), torch.cuda.max_memory_reserved(dev))
    with cuda_peak(dev.index) as again:  # a new block restarts the peak from what is alive
        pass
    assert again.allocated == base + 4 * 2**20
    del a


@needs_cuda
def test_tracker_counts_cuda_tensors():
    with LiveTensorTracker() as tr:
        a = torch.empty(1000, device="cuda")
        assert tr.current == 4000
        del a
    assert (tr.current, tr.peak) == (0, 4000)

