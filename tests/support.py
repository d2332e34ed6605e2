"""Test helpers shared by several test modules: training pairs, exact comparison, recompute counting, test trainers.

Everything here that a DDP worker needs (callbacks, trainer classes) lives in this importable module, so the
cloudpickle state Ultralytics writes for its workers refers to it by name.
"""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Iterator
from contextlib import contextmanager
from copy import deepcopy
from functools import partial
from pathlib import Path

import cv2
import numpy as np
import torch
import ultralytics
from ultralytics.cfg import get_cfg
from ultralytics.models import yolo
from ultralytics.nn.tasks import DetectionModel
from ultralytics.utils import LOCAL_RANK, RANK
from ultralytics.utils.patches import torch_load
from ultralytics.utils.torch_utils import unwrap_model

from yolo_ckpt import (
    TRAINERS,
    CheckpointPlan,
    DetectionTrainer,
    RTDETRTrainer,
    SegmentationTrainer,
    disable_checkpointing,
    enable_checkpointing,
)
from yolo_ckpt.integration.distributed import WORLD_KEY, DistributedMixin
from yolo_ckpt.integration.settings import CKPT_CFG_DICT
from yolo_ckpt.memory.step import StepShape, measure_peak, state_bytes, step_bytes, step_loss, training_batch
from yolo_ckpt.memory.tracker import LiveTensorTracker
from yolo_ckpt.planning import costs
from yolo_ckpt.regions.families import ultralytics_class
from yolo_ckpt.regions.install import network

# Planning times each probe step (median of TIMED_STEPS) to rank plans by step time. The suite checks what planning
# chooses against bounds and vanilla runs: in every process that imports this module (the suite, the DDP workers
# Ultralytics' launcher starts, torchrun_train.py) no step is timed (TIMED_STEPS = 0: every time 0 s, plans rank by
# FLOPs), the same choice on every run however busy the machine. Tests of the ranking by measured time itself take
# ``conftest.timed_planning``. The CLI in a subprocess (``python -m yolo_ckpt``) keeps the default.
costs.TIMED_STEPS = 0


@contextmanager
def timing(steps: int = 1) -> Iterator[None]:
    """Planning inside the block times ``steps`` steps per probe, as users' runs do (``costs.TIMED_STEPS``)."""
    before, costs.TIMED_STEPS = costs.TIMED_STEPS, steps
    try:
        yield
    finally:
        costs.TIMED_STEPS = before


# A small YOLO11-style detector: four stages, seconds to train or compile on CPU.
TINY = {
    "nc": 4,
    "backbone": [
        [-1, 1, "Conv", [16, 3, 2]],  # 0-P1/2
        [-1, 1, "Conv", [32, 3, 2]],  # 1-P2/4
        [-1, 1, "C3k2", [32, False, 0.25]],  # 2
        [-1, 1, "Conv", [64, 3, 2]],  # 3-P3/8
        [-1, 1, "C3k2", [64, False, 0.25]],  # 4
        [-1, 1, "Conv", [64, 3, 2]],  # 5-P4/16
        [-1, 1, "SPPF", [64, 5]],  # 6
    ],
    "head": [[[4, 6], 1, "Detect", ["nc"]]],  # 7
}

SMALL = {  # TINY with a neck: 5 checkpoint units (4 stages, the head), 62 candidate plans
    **TINY,
    "head": [
        [-1, 1, "nn.Upsample", [None, 2, "nearest"]],  # 7
        [[-1, 4], 1, "Concat", [1]],  # 8
        [-1, 1, "C3k2", [64, False, 0.25]],  # 9
        [[9, 6], 1, "Detect", ["nc"]],  # 10
    ],
}

# A small RT-DETR (HGNet stem and blocks, the deformable transformer decoder): a step in well under a second.
RTDETR_TINY = {
    "nc": 4,
    "backbone": [
        [-1, 1, "HGStem", [16, 32]],  # 0-P2/4
        [-1, 1, "HGBlock", [16, 32, 3]],  # 1
        [-1, 1, "DWConv", [64, 3, 2, 1, False]],  # 2-P3/8
        [-1, 1, "HGBlock", [32, 64, 3]],  # 3
        [-1, 1, "DWConv", [64, 3, 2, 1, False]],  # 4-P4/16
    ],
    "head": [[[3, 4], 1, "RTDETRDecoder", ["nc", 32, 30, 2, 4, 2, 64]]],  # 5: hd, queries, points, heads, layers, ffn
}

MINI = {  # two stages and a head: 3 checkpoint units, 14 candidate plans; for tests that measure every plan twice
    "nc": 4,
    "backbone": [
        [-1, 1, "Conv", [16, 3, 2]],  # 0-P1/2
        [-1, 1, "Conv", [32, 3, 2]],  # 1-P2/4
        [-1, 1, "C3k2", [32, False, 0.25]],  # 2
    ],
    "head": [[-1, 1, "Conv", [64, 3, 2]], [[2, 3], 1, "Detect", ["nc"]]],  # 3-4
}

# Small, bitwise-reproducible CPU training (BRIEF §3) at a size where every loss term is non-zero: the same arguments
# for vanilla and checkpointed runs.
# nbs=batch: an optimizer step every batch, so even a one-epoch run moves the weights (with Ultralytics' nbs=64 a short
# run accumulates gradients without ever stepping, and equal weights would prove nothing about the gradients).
TRAIN_ARGS = dict(epochs=2, imgsz=320, batch=4, nbs=4, workers=0, device="cpu", seed=0, deterministic=True, plots=False)


def results(run_dir: Path) -> list[dict]:
    """results.csv rows without the wall-clock column (a column a row lacks reads as "")."""
    with open(run_dir / "results.csv") as f:
        rows = csv.DictReader(f)
        return [{k.strip(): (v or "").strip() for k, v in row.items() if k.strip() != "time"} for row in rows]


# ------------------------------------------------------------------------------------------ recompute counting
def count_forwards(trainer) -> None:
    """``on_train_start``: count every layer's training forwards; a checkpoint's recompute runs a layer again.

    Forward *pre*-hooks: a recompute stops once every saved tensor is rebuilt (non-reentrant ``early_stop``), so the
    last layer of a region may not finish, but it starts. Only calls in train mode with grad enabled count (the
    forward and the recompute), not validation or EMA.
    """
    model = network(trainer.model)  # distillation: the student, which trains
    trainer.forward_counts = counts = [0] * len(model.model)
    trainer.conv_counts = convs = {}  # every convolution by name: a recomputed part runs its convolutions again

    def hook(m, args):
        if m.training and torch.is_grad_enabled():
            counts[m.i] += 1

    def conv_hook(name, m, args):
        if m.training and torch.is_grad_enabled():
            convs[name] = convs.get(name, 0) + 1

    trainer.forward_hooks = [m.register_forward_pre_hook(hook) for m in model.model] + [
        m.register_forward_pre_hook(partial(conv_hook, name)) for name, m in model.named_modules()
        if isinstance(m, torch.nn.Conv2d)]
    # Ultralytics' per-image mask loss, counted in this process from here on (planning's probes ran before): the
    # forward and the recompute of ``checkpoint_loss=exact``, not validation
    from ultralytics.utils.loss import v8SegmentationLoss

    trainer.mask_calls, plain = [0], v8SegmentationLoss.__dict__["single_mask_loss"]

    def single_mask_loss(*args):
        trainer.mask_calls[0] += torch.is_grad_enabled()
        return plain.__func__(*args)

    v8SegmentationLoss.single_mask_loss = staticmethod(single_mask_loss)
    trainer.mask_loss_restore = lambda: setattr(v8SegmentationLoss, "single_mask_loss", plain)


def dump_training(trainer) -> None:
    """``teardown`` (every process, also DDP workers): write this rank's forward counts and final training model."""
    for h in getattr(trainer, "forward_hooks", []):
        h.remove()
    if hasattr(trainer, "mask_loss_restore"):
        trainer.mask_loss_restore()
    out = Path(trainer.save_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"forwards_rank{RANK}.json").write_text(json.dumps(getattr(trainer, "forward_counts", None)))
    (out / f"convs_rank{RANK}.json").write_text(json.dumps(getattr(trainer, "conv_counts", None)))
    (out / f"mask_calls_rank{RANK}.json").write_text(json.dumps(getattr(trainer, "mask_calls", [None])[0]))
    # whether this rank measured auto's unit costs itself (under DDP only rank 0 plans and broadcasts)
    loader = getattr(trainer, "test_loader", None)  # the validator's batch (auto lowers it where it would not fit)
    (out / f"val_batch_rank{RANK}.json").write_text(json.dumps(getattr(loader, "batch_size", None)))
    escalation = getattr(getattr(trainer, "run_memory", None), "escalation", None)
    (out / f"planned_rank{RANK}.json").write_text(json.dumps(getattr(escalation, "costs", None) is not None))
    if isinstance(trainer.model, torch.nn.Module):
        torch.save(unwrap_model(trainer.model).state_dict(), out / f"model_rank{RANK}.pt")


COUNTING = {"on_train_start": count_forwards, "teardown": dump_training}


def add_counting(model) -> None:
    """Register the counting callbacks on an Ultralytics ``Model`` (they reach its trainer and DDP workers)."""
    for event, fn in COUNTING.items():
        model.add_callback(event, fn)


def forward_counts(run_dir: Path, rank: int = -1) -> list[int]:
    return json.loads((Path(run_dir) / f"forwards_rank{rank}.json").read_text())


def conv_counts(run_dir: Path, rank: int = -1) -> dict[str, int]:
    return json.loads((Path(run_dir) / f"convs_rank{rank}.json").read_text())


def mask_calls(run_dir: Path, rank: int = -1) -> int:
    """Ultralytics' per-image mask loss calls of a run's training steps (forward and recompute) on ``rank``."""
    return json.loads((Path(run_dir) / f"mask_calls_rank{rank}.json").read_text())


def assert_convs_recomputed(vanilla: dict[str, int], ckpt: dict[str, int], plan: CheckpointPlan) -> None:
    """Each convolution ran once per step, as in vanilla, outside every region; inside exactly one region once more
    (its recompute); inside nested regions at least once and at most once per region more (an outer recompute stops
    once the tensors it holds itself are back, torch's early stop, before a part with its own checkpoint). Counted by
    forward pre-hooks, so a part that is itself a convolution (``"3.conv"``) shows no recompute: its checkpoint calls
    its ``forward``, not the module; tests name composite parts."""
    def around(name: str) -> int:
        i, path = int(name.split(".")[1]), name.split(".", 2)[2]
        layer = any(i in r.layers for r in plan.regions if not r.parts)
        parts = sum(any(path == p or path.startswith(p + ".") for p in r.parts) for r in plan.part_regions
                    if r.layers[0] == i)
        return layer + parts

    assert set(vanilla) == set(ckpt)
    for name, n in vanilla.items():
        k = around(name)
        low, high = (n, n) if k == 0 else (2 * n, (1 + k) * n)
        assert low <= ckpt[name] <= high, f"{name}: {ckpt[name]} forwards, not in [{low}, {high}] ({k} regions)"


def one_step(model, batch, layers=None, stages=(), mode="full") -> tuple:
    """Gradients, buffers and convolution forwards of one training step, checkpointed as given or plain."""
    model = deepcopy(model)
    if layers or stages:
        enable_checkpointing(model, CheckpointPlan.from_spec(model, list(stages), layers), mode)
    convs = {}
    hooks = [m.register_forward_pre_hook(lambda m, a, n=n: convs.__setitem__(n, convs.get(n, 0) + 1))
             for n, m in model.named_modules() if isinstance(m, torch.nn.Conv2d)]
    with LiveTensorTracker() as t:
        step_loss(model, batch).backward()
    for h in hooks:
        h.remove()
    disable_checkpointing(model)
    return {n: p.grad for n, p in model.named_parameters()}, dict(model.named_buffers()), convs, t.peak


def assert_exact_and_recomputed(model, batch, layers, stages=(), mode="full") -> None:
    """One step checkpointed as given against the plain model's: gradients and buffers (BatchNorm statistics updated
    once) bit for bit, each convolution recomputed once more per region around it."""
    torch.manual_seed(0)
    grads, buffers, convs, _ = one_step(model, batch)
    torch.manual_seed(0)  # RT-DETR's denoising draws the same queries
    ours, our_buffers, our_convs, _ = one_step(model, batch, layers, stages, mode)
    for n, g in grads.items():
        assert (g is None and ours[n] is None) or torch.equal(g, ours[n]), n
    for n, b in buffers.items():
        assert torch.equal(b, our_buffers[n]), n
    assert_convs_recomputed(convs, our_convs, CheckpointPlan.from_spec(model, list(stages), layers))


def assert_recomputed(vanilla: list[int], ckpt: list[int], layers: set[int]) -> None:
    """Checkpointed layers ran twice per step (forward + recompute), every other layer once, as in vanilla."""
    assert min(vanilla) > 0 and len(vanilla) == len(ckpt)
    expected = [2 * n if i in layers else n for i, n in enumerate(vanilla)]
    assert ckpt == expected, f"forwards per layer {ckpt} != {expected}"


# ---------------------------------------------------------------------------------------- exact comparison
RUN_SPECIFIC = {"name", "save_dir"}  # the two runs of a pair write to different directories


def assert_same(a, b, where: str) -> None:
    """Equal to the bit: tensors by dtype and value, modules by state_dict and saved attributes, containers by item."""
    if isinstance(a, torch.nn.Module):
        assert type(a) is type(b), where
        assert_same(a.state_dict(), b.state_dict(), f"{where}.state_dict")
        # every instance attribute (a leftover plan would be one); `args` may be added: our settings are recorded there
        assert set(vars(a)) | {"args"} == set(vars(b)) | {"args"}, f"{where}: {set(vars(a)) ^ set(vars(b))}"
        for attr in ("yaml", "names", "nc", "stride", "task"):
            assert_same(getattr(a, attr, None), getattr(b, attr, None), f"{where}.{attr}")
        if hasattr(a, "args"):
            assert type(a.args) is type(b.args), f"{where}.args"
        assert_same(plain_args(a), plain_args(b), f"{where}.args")
    elif isinstance(a, dict):
        assert list(a) == list(b), f"{where}: keys {list(a)} != {list(b)}"
        for k in a:
            assert_same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}[{i}]")
    elif isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, (float, np.floating)) and math.isnan(a):
        assert math.isnan(b), where
    else:
        assert type(a) is type(b) and a == b, f"{where}: {a!r} != {b!r}"


def plain_args(model) -> dict:
    """A saved model's ``args`` without what differs by design: run directories, our own keys and the world size we
    record for resume."""
    args = getattr(model, "args", None) or {}
    args = args if isinstance(args, dict) else vars(args)
    return {k: v for k, v in args.items() if k not in RUN_SPECIFIC and k not in CKPT_CFG_DICT and k != WORLD_KEY}


def tensor_differences(a: dict, b: dict, where: str) -> list[tuple[float, str]]:
    """Every tensor of two name -> tensor mappings that is not bitwise equal, as (relative difference, line): how many
    elements differ and by how much at most, absolutely and relative to the largest magnitude in either tensor."""
    out = []
    for k in sorted(a.keys() | b.keys(), key=str):
        x, y = a.get(k), b.get(k)
        if not (isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor)) or x.dtype != y.dtype or \
                x.shape != y.shape:
            out.append((math.inf, f"{where}.{k}: {_about(x)} vs {_about(y)}"))
        elif not torch.equal(x, y):
            x, y = x.double(), y.double()
            d = (x - y).abs().nan_to_num(math.inf)
            rel = float(d.max() / torch.maximum(x.abs().max(), y.abs().max()))  # > 0: the two are not both zero
            out.append((rel, f"{where}.{k}: {int((x != y).sum())}/{x.numel()} elements differ, max |diff| "
                             f"{float(d.max()):.3g}, relative {rel:.3g}"))
    return out


def _about(t) -> str:
    return f"{t.dtype} {tuple(t.shape)}" if isinstance(t, torch.Tensor) else repr(t)


def run_differences(v_dir: Path, c_dir: Path, limit: int = 30) -> list[str]:
    """What differs between two runs, largest first: results.csv values, the final training model (weights and
    BatchNorm buffers) and the model and EMA of every weights file. Empty when they are bitwise equal."""
    found = []
    for i, (v, c) in enumerate(zip(results(v_dir), results(c_dir))):
        found += [(math.inf, f"results.csv row {i} {k}: {v[k]} vs {c.get(k)}") for k in v if v[k] != c.get(k)]
    v, c = (torch.load(d / "model_rank-1.pt", map_location="cpu") for d in (v_dir, c_dir))
    found += tensor_differences(v, c, "training model")
    for path in sorted((v_dir / "weights").glob("*.pt")):
        v, c = (torch_load(d / "weights" / path.name, map_location="cpu") for d in (v_dir, c_dir))
        for key in ("model", "ema"):
            if isinstance(v.get(key), torch.nn.Module):
                found += tensor_differences(v[key].state_dict(), c[key].state_dict(), f"{path.name}:{key}")
    lines = [line for _, line in sorted(found, key=lambda f: -f[0])]
    return lines[:limit] + ([f"... {len(lines) - limit} more"] if len(lines) > limit else [])


def assert_same_checkpoint(v: dict, c: dict, name: str) -> None:
    """Every field of two Ultralytics checkpoint files is equal, but for what differs by design.

    By design: ``date`` (wall clock), run directories in ``train_args``, the ``time`` column and our ``mem/*`` columns
    in ``train_results``, our ``mem/*`` values in ``train_metrics``. Our keys must be absent from ``train_args``.
    """
    assert list(v) == list(c), name
    assert not set(CKPT_CFG_DICT) & set(c["train_args"]), f"{name}: our keys in train_args break plain resume"
    for key in v:
        a, b = v[key], c[key]
        if key == "date":
            continue
        if key == "train_args":
            a, b = ({k: x for k, x in d.items() if k not in RUN_SPECIFIC} for d in (a, b))
        elif key in {"train_metrics", "train_results"}:
            assert all(k.startswith("mem/") for k in set(b) - set(a)), f"{name}:{key} {set(b) - set(a)}"
            a = {k: x for k, x in a.items() if k != "time"}
            b = {k: x for k, x in b.items() if k in a}
        assert_same(a, b, f"{name}:{key}")


def assert_same_run(v_dir: Path, c_dir: Path, ranks=(-1,)) -> None:
    """results.csv, every weights file and each rank's final training model of two runs are equal."""
    rows, reference = results(c_dir), results(v_dir)
    assert len(rows) == len(reference) > 0
    differ = [(i, k, base[k], row.get(k)) for i, (row, base) in enumerate(zip(rows, reference)) for k in base
              if row.get(k) != base[k]]
    assert not differ, differ  # (epoch, column, vanilla, ours); ours has our memory columns besides
    mem = [v for row in rows for k, v in row.items() if k.startswith("mem/")]
    assert mem and all(0 < float(v) < math.inf for v in mem)  # measured in every epoch: our callbacks ran
    files = sorted(p.name for p in (v_dir / "weights").glob("*.pt"))
    assert files == sorted(p.name for p in (c_dir / "weights").glob("*.pt")) and files
    updates = 0
    for name in files:
        v, c = (torch_load(d / "weights" / name, map_location="cpu") for d in (v_dir, c_dir))
        assert_same_checkpoint(v, c, name)
        updates = max(updates, v.get("updates") or 0)
    assert updates > 0, "no optimizer step ran: equal weights would not test the gradients"
    for rank in ranks:  # the live training model: weights, BatchNorm running_mean/running_var/num_batches_tracked
        v, c = (torch.load(d / f"model_rank{rank}.pt") for d in (v_dir, c_dir))
        assert_same(v, c, f"training model of rank {rank}")


# ------------------------------------------------------------------------------------------- test trainers
class OOMTimes:
    """Raise a CUDA-style out-of-memory error on the first ``times`` training steps, inside Ultralytics' retry block;
    ``oom_raised`` counts the steps tried."""

    times = 1

    def preprocess_batch(self, batch):
        self.oom_raised = getattr(self, "oom_raised", 0) + 1
        if self.oom_raised <= self.times:
            raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate 2.00 GiB (raised by the test, "
                                         f"{self.oom_raised} of {self.times})")
        return super().preprocess_batch(batch)


class OOMOnce(OOMTimes):
    times = 1


class OOMTwice(OOMTimes):
    times = 2


class OOMFourTimes(OOMTimes):
    times = 4  # one more than Ultralytics' three halvings take


class VanillaOOMFourTimes(OOMFourTimes, yolo.detect.DetectionTrainer):
    """Ultralytics' detection trainer hitting four OOMs in a row."""


class CkptOOMFourTimes(OOMFourTimes, DetectionTrainer):
    """Our detection trainer hitting four OOMs in a row."""


class VanillaOOMOnce(OOMOnce, yolo.detect.DetectionTrainer):
    """Ultralytics' detection trainer hitting one OOM."""


class CkptOOMOnce(OOMOnce, DetectionTrainer):
    """Our detection trainer hitting one OOM."""


class CkptOOMTwice(OOMTwice, DetectionTrainer):
    """Our detection trainer hitting two OOMs in a row."""


class CkptSegOOMOnce(OOMOnce, SegmentationTrainer):
    """Our segmentation trainer hitting one OOM."""


class VanillaSegOOMOnce(OOMOnce, yolo.segment.SegmentationTrainer):
    """Ultralytics' segmentation trainer hitting one OOM."""


class CkptSegOOMTwice(OOMTwice, SegmentationTrainer):
    """Our segmentation trainer hitting two OOMs in a row."""


class GlooDDP:
    """Ultralytics' own launcher for a two-process run on the CPU: only the launching process is redirected.

    Ultralytics has no CPU DDP (``world_size`` is 0 for cpu, so it never spawns workers); the launching process is
    told the world is two, as for ``device=0,1``. Everything else — the worker file, the launcher, samplers, the DDP
    wrap and its arguments, rank-0 saving — is Ultralytics' own, and its workers train on yolo-ckpt's supported CPU
    path (``yolo_ckpt.integration.distributed.DistributedMixin``: gloo, the CPU DDP wrap and final validation).
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if LOCAL_RANK == -1:  # the launching process spawns workers, as for device=0,1
            self.world_size = 2
            self.ddp = True


class VanillaTorchrun(DistributedMixin, yolo.detect.DetectionTrainer):
    """Ultralytics' detection trainer with only yolo-ckpt's torchrun hooks (no checkpointing code at all)."""


class VanillaGloo(GlooDDP, VanillaTorchrun):
    """Ultralytics' detection trainer in 2-process gloo DDP."""


class CkptGloo(GlooDDP, DetectionTrainer):
    """Our detection trainer in 2-process gloo DDP."""


class VanillaSegGloo(GlooDDP, DistributedMixin, yolo.segment.SegmentationTrainer):
    """Ultralytics' segmentation trainer in 2-process gloo DDP (with only yolo-ckpt's torchrun hooks)."""


class CkptSegGloo(GlooDDP, SegmentationTrainer):
    """Our segmentation trainer in 2-process gloo DDP."""


TORCHRUN_TRAINERS = {"vanilla": VanillaTorchrun, "ckpt": DetectionTrainer}  # by name, for tests/torchrun_train.py


# ------------------------------------------------------------------------- datasets yolo-ckpt did not generate
def _tiny_scene(rng: np.random.Generator, size: int) -> tuple[np.ndarray, list[tuple[int, np.ndarray]]]:
    """A noisy BGR image with two to four filled polygons of two classes; return it and (class, pixel polygon)."""
    img = rng.integers(0, 80, (size, size, 3), dtype=np.uint8)
    shapes = []
    for _ in range(int(rng.integers(2, 5))):
        c = rng.uniform(0.25, 0.75, 2) * size
        angles = np.sort(rng.uniform(0, 2 * np.pi, 5))
        poly = c + rng.uniform(0.1, 0.22, (5, 1)) * size * np.stack([np.cos(angles), np.sin(angles)], 1)
        cls = int(rng.integers(2))
        cv2.fillPoly(img, [np.rint(poly).astype(np.int32)], (200, 60, 60) if cls else (60, 200, 60))
        shapes.append((cls, poly))
    return img, shapes


def _foreign_set(root: Path, size: int, images: dict | None, seed: int, target: str, write_target, extra: str) -> str:
    """Images under images/<split>/, one target file each under <target>/<split>/ (``write_target(stem, shapes,
    size, rng)``), and a data.yaml ending in ``extra``; return the data.yaml path."""
    rng = np.random.default_rng(seed)
    for split, n in (images or {"train": 4, "val": 2}).items():
        for folder in ("images", target):
            (root / folder / split).mkdir(parents=True)
        for i in range(n):
            img, shapes = _tiny_scene(rng, size)
            cv2.imwrite(str(root / "images" / split / f"{i}.jpg"), img)
            write_target(root / target / split / str(i), shapes, size, rng)
    (root / "data.yaml").write_text(f"path: {root}\ntrain: images/train\nval: images/val\n{extra}")
    return str(root / "data.yaml")


def _polygon_rows(stem: Path, shapes: list, size: int, rng: np.random.Generator) -> None:
    rows = [" ".join([str(c), *(f"{v:.5f}" for v in np.clip(p / size, 0, 1).ravel())]) for c, p in shapes]
    stem.with_suffix(".txt").write_text("\n".join(rows) + "\n")


def _depth_png(stem: Path, shapes: list, size: int, rng: np.random.Generator) -> None:
    depth = np.add.outer(np.linspace(3, 8, size), np.zeros(size)) + rng.uniform(-0.5, 0.5)  # a tilted plane
    for cls, poly in shapes:  # nearer objects on it
        cv2.fillPoly(depth, [np.rint(poly).astype(np.int32)], 1.5 + cls)
    depth[rng.uniform(size=depth.shape) < 0.02] = 0  # missing returns, as real sensors have
    cv2.imwrite(str(stem.with_suffix(".png")), np.rint(depth * 1000).astype(np.uint16))


def write_polygon_set(root: Path, size: int = 96, images: dict | None = None) -> str:
    """A two-class YOLO polygon dataset (images/, labels/, data.yaml) made with numpy and cv2; return data.yaml."""
    return _foreign_set(root, size, images, 12, "labels", _polygon_rows, "names:\n  0: a\n  1: b\n")


def write_depth_set(root: Path, size: int = 96, images: dict | None = None) -> str:
    """A depth dataset (images/, depth/ as uint16 PNG in millimetres, data.yaml) made with numpy and cv2: a tilted
    plane with nearer polygons on it, a few pixels without depth (0); return data.yaml."""
    return _foreign_set(root, size, images, 13, "depth", _depth_png, "nc: 1\nnames:\n  0: depth\ndepth_scale: 1000\n")


# ---------------------------------------------------------------------------------- training pairs
def measured_step(model, imgsz, batch, objects=50) -> int:
    """An independent measurement: a fresh tracker around one loss forward + backward, plus the model state."""
    model.zero_grad(set_to_none=True)
    with LiveTensorTracker() as t:
        data = training_batch(model, StepShape(imgsz, batch, objects))  # the batch is on the device during the step
        model.loss(data)[0].sum().backward()
    model.zero_grad(set_to_none=True)
    return state_bytes(model) + t.peak


def loop_batches(model, imgsz, batch, objects=50) -> int:
    """An independent count of the batches Ultralytics' training loop holds beside the one a step trains on (docs,
    Limitations): the loader's uint8 images, and one more batch as the step gets it, from the real tensors of a
    batch of that size (``training_batch``), not from planning's arithmetic."""
    data = training_batch(model, StepShape(imgsz, batch, objects))
    uint8 = torch.zeros(data["img"].shape, dtype=torch.uint8)  # what the loader collates before preprocess_batch
    return uint8.untyped_storage().nbytes() + sum(t.untyped_storage().nbytes() for t in data.values())


def auto_budget(model: str, data: str, imgsz: int, batch: int, share: float) -> str:
    """A ``memory_budget`` whose 60% (auto's share) is ``share`` of a vanilla step at this batch, on top of the model
    state and the batch; below 1 vanilla does not fit. Steps carry the dataset's objects as the trainer counts them."""
    probe = DetectionModel(model, verbose=False).train()
    probe.args = get_cfg()  # the loss reads its hyperparameters here
    labels = Path(data).parent / "labels" / "train"
    objects = 4 * max(len(f.read_text().splitlines()) for f in labels.glob("*.txt"))  # mosaic, as the trainer counts
    peak = measure_peak(probe, training_batch(probe, StepShape(imgsz, batch, objects))).peak
    fixed = step_bytes(probe, StepShape(imgsz, batch, objects)) - peak
    return f"{int((fixed + share * peak) / 0.6)}B"


def val_batch(run: Path, rank: int = -1) -> int | None:
    """The batch a run's validator had (``dump_training``)."""
    return json.loads((run / f"val_batch_rank{rank}.json").read_text())


def validating_at(trainer: type, batch: int) -> type:
    """Ultralytics' ``trainer`` (vanilla), its validator's loader at ``batch``: the reference for a run whose planning
    lowered the validator's batch (training is untouched; the validation losses average over other batches)."""
    def get_dataloader(self, dataset_path, batch_size=16, rank=0, mode="train"):
        return trainer.get_dataloader(self, dataset_path, batch if mode == "val" else batch_size, rank, mode)

    return type(f"{trainer.__name__}ValidatingAt{batch}", (trainer,), {"get_dataloader": get_dataloader})


def train_run(model: str, data: str, project: Path, name: str, ours: dict | None = None, val_at: int | None = None,
              **kw) -> Path:
    """One training with ``TRAIN_ARGS`` updated by ``kw`` (``device=0`` trains on CUDA), counting layer forwards:
    vanilla Ultralytics (its validator at batch ``val_at`` if given), or yolo_ckpt's trainer with our keys ``ours``;
    return the run dir."""
    m = ultralytics_class(model)(model)  # the class `yolo train` picks (RT-DETR by name)
    add_counting(m)
    args = {**TRAIN_ARGS, "data": data, "project": str(project), "save_period": 1, **kw}
    if ours:
        args.update(trainer=RTDETRTrainer if isinstance(m, ultralytics.RTDETR) else TRAINERS.get(m.task), **ours)
    elif val_at is not None:
        args["trainer"] = validating_at(m._smart_load("trainer"), val_at)
    m.train(name=name, **args)
    return Path(m.trainer.save_dir)


def train_pair(model: str, stages, data: str, project: Path, mode: str = "full", layers=None, ours: dict | None = None,
               **kw) -> tuple[Path, Path]:
    """Train vanilla Ultralytics and yolo_ckpt with the same arguments (``ours``: more of our keys), counting layer
    forwards; return the run dirs."""
    ours = {"checkpoint_stages": stages, "checkpoint_mode": mode, "checkpoint_layers": layers, **(ours or {})}
    return train_run(model, data, project, "vanilla", **kw), train_run(model, data, project, "ckpt", ours, **kw)


def assert_plan_recomputed(model: str, stages, vanilla: Path, ckpt: Path, layers=None, ranks=(-1,)) -> None:
    """The plan's regions were recomputed in every step (of each of ``ranks``): each layer region's layers (their
    forward counts), each part region's convolutions (theirs)."""
    plan = CheckpointPlan.from_spec(model, stages, layers)
    recomputed = {i for r in plan.regions if not r.parts for i in r.layers}  # parts recompute inside their layer
    for rank in ranks:
        assert_recomputed(forward_counts(vanilla, rank), forward_counts(ckpt, rank), recomputed)
        if plan.part_regions:
            assert_convs_recomputed(conv_counts(vanilla, rank), conv_counts(ckpt, rank), plan)


def assert_same_training(model: str, stages, vanilla: Path, ckpt: Path, layers=None) -> None:
    """Bit for bit the same run, and the plan's regions were recomputed in every step (the forward counts)."""
    assert_plan_recomputed(model, stages, vanilla, ckpt, layers)
    assert_same_run(vanilla, ckpt)
