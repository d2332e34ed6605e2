"""One-shot GPU check: what the CPU machine cannot confirm, on one CUDA GPU, as one markdown report.

Usage:
    python benchmarks/gpu_check.py OUT_DIR             # on a CUDA machine: writes OUT_DIR/gpu_check.md
    python benchmarks/gpu_check.py OUT_DIR --quick     # a small run of every section (any device; CI runs it on CPU)

Every section is timed and ends in PASS, FAILED (with the error or the figures that failed) or SKIPPED (what it needs
is absent, e.g. CUDA); a failed section does not stop the others, and the script exits with status 1 if any section
FAILED; the report is rewritten after every section, so a run cut short keeps what it measured. Estimated on one
H200 (none has been lent to this project, so these are estimates, not measurements): about 8 minutes in all, the
section estimates in brackets.

1. CUDA tests [~1.5 min]: every test whose name says ``cuda`` but not ``bitwise``, in one pytest run: allocator
   peaks, the CUDA epoch meter, the tracker on CUDA tensors, AutoBatch on the checkpointed model against an
   independent vanilla AutoBatch, ``auto`` on CUDA free memory. PASS: all passed, none skipped.
2. Exactness on CUDA [~1 min]: the tests named ``cuda`` and ``bitwise``: a yolo11n training with all stages
   recomputed against vanilla Ultralytics on device 0 (``deterministic=True``, fp16 AMP), to the bit; BatchNorm
   buffers and gradients of full and selective recompute against plain autograd in fp32 and under fp16 and bf16
   autocast. A failure lists which tensors differ and by how much (for the training, beside what differs between two
   vanilla runs). PASS: all passed, none skipped.
3. Planning on the device [~1.5 min]: yolo11n at imgsz 2048, one epoch, no ``memory_budget``:
   ``checkpoint_stages=auto`` at batch 8 and ``batch=-1 checkpoint_stages=all``. For each, the planning peak
   (allocator, ``on_pretrain_routine_start`` to ``on_train_start``: model, AutoBatch or auto, loaders, optimizer) and
   the first epoch's peak against the planned target (``trainer.run_memory.target``, where the trainer reports one) and
   results.csv's ``mem/*`` columns; then one training step of each chosen plan with its exact tensor peak
   (``LiveTensorTracker``) next to ``max_memory_allocated``/``max_memory_reserved``, the allocator's margin over
   tensor bytes. PASS: both trained, and no peak passed its target.
4. Escalation under a reduced memory fraction [~1 min]: vanilla's first-epoch peak (``max_memory_reserved``) at
   imgsz 1280 batch 8, then ``torch.cuda.set_per_process_memory_fraction`` leaves the process about 0.6x of it and
   ``checkpoint_stages=[2,3]`` trains at the same batch (restored to 1.0 afterwards). PASS: it trained at batch 8 with
   a plan that keeps less recorded in args.yaml (escalated); FAILED: the batch was halved, training failed, or [2,3]
   trained unchanged (the limit did not bind). The ``checkpoint:`` and out-of-memory log lines are in the report.
5. Memory table [~1.5 min]: yolo11n and yolo11s at 640 and 1280, AMP off and fp16, the standard plans: the exact
   tensor peak next to ``torch.cuda.max_memory_allocated``, FLOP and step-time ratios.
6. AutoBatch with and without checkpointing [~0.5 min]: Ultralytics' ``check_train_batch_size`` (60% of *free*
   memory, fp16 autocast) on yolo11n at 1280 with all stages and plain; and yolo-ckpt's ``memory_budget`` planning
   for 60% of the GPU's *total* memory, both ways.
7. A compiled checkpointed step [~1 min]: ``torch.compile`` (inductor) of yolo11n with stages [2,3] in Ultralytics'
   compiled step (model compiled, loss outside): graph count and breaks, allocator peak and step time against the
   same step eager and against eager vanilla.
8. The whole run on a tight device [~2 min]: yolo11n at imgsz 1280 batch 8, ``checkpoint_stages=auto`` with a
   ``memory_budget`` whose share is a third of vanilla's step (exact tensor bytes), on a device limited to 1.05x
   that share (``set_per_process_memory_fraction``), through the final validation (twice the batch, fp16, best.pt
   loaded beside the training state). PASS: the run ended, the validator's batch is logged, and the allocator's
   reserved peak of the whole run against the share is reported (the margin a GPU needs beyond tensor bytes).

Without CUDA (``--quick`` on a CPU, as CI runs it) sections 1-2 are SKIPPED (section 1 after running the CUDA tests of
test_memory.py, which skip or check CPU behaviour), section 3 plans for ``memory_budget=256MB`` (a CPU has no free
memory to plan for) and reads exact tensor bytes for allocator peaks, and section 4 runs on
``yolo_ckpt.memory.device.SimulatedDevice`` at imgsz 192 batch 4 where the package has it (else SKIPPED), section 8 at
imgsz 128 batch 4 with a share of 0.8x vanilla's step (there the model state is most of a step: at half, batch 1 of
no plan fits) on ``yolo_ckpt.memory.device.UntoldDevice`` (a limit planning is not told about). The quick memory
table has vanilla, ``all``, ``all + head selective`` and auto at 70%. ``--quick --model X.yaml`` runs every section on
that model instead of yolo11n: the suite passes a five-unit model, as it checks the script (yolo11n's 57 probes each
time its units are measured made a quick run 78-84 s of CPU on one core, the five-unit model's 44 s).
"""

from __future__ import annotations

import argparse
import csv
import gc
import logging
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
import traceback
import xml.etree.ElementTree as ET
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from copy import deepcopy
from dataclasses import dataclass
from pathlib import Path
from typing import Any

os.environ.setdefault("YOLO_OFFLINE", "1")  # before Ultralytics is imported: nothing may be downloaded

import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import ultralytics  # noqa: E402
from ultralytics.utils import LOGGER, YAML  # noqa: E402

from yolo_ckpt import YOLO  # noqa: E402
from yolo_ckpt.data.synthetic import synthetic_dataset  # noqa: E402
from yolo_ckpt.memory.step import StepShape, build_model, measure_peak, training_batch, with_plan  # noqa: E402
from yolo_ckpt.memory.tracker import CudaPeak, LiveTensorTracker, cuda_peak  # noqa: E402
from yolo_ckpt.planning import costs  # noqa: E402
from yolo_ckpt.planning.autobatch import plan_batch  # noqa: E402
from yolo_ckpt.regions.settings import PlanSettings  # noqa: E402

from memory_table import table  # noqa: E402

GB = 2**30
EXACTNESS = "bitwise"  # CUDA tests whose name says this make section 2; the other CUDA tests section 1
MODEL = "yolo11n.yaml"  # every section's model; ``--quick --model`` may name a smaller one (main sets it)


def model_name() -> str:
    """The model's name in the report: ``yolo11n`` for ``yolo11n.yaml``, a file's stem for a path."""
    return Path(MODEL).stem


@dataclass
class Section:
    """A section's verdict and its markdown."""

    status: str  # PASS, FAILED or SKIPPED
    body: str


# ------------------------------------------------------------------------------------------- 1-2: pytest on CUDA
def pytest_section(expr: str, device: str, cpu_paths: tuple[str, ...] = ()) -> Section:
    """Run the tests selected by ``-k expr`` and tabulate them. Without CUDA they would skip: SKIPPED, after running
    only those in ``cpu_paths`` (a check of this section itself; some CUDA tests check CPU behaviour too)."""
    if device != "cuda" and not cpu_paths:
        return Section("SKIPPED", "no CUDA device")
    paths = ["tests"] if device == "cuda" else list(cpu_paths)
    with tempfile.TemporaryDirectory() as tmp:
        xml = Path(tmp) / "junit.xml"
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", expr, f"--junitxml={xml}", *paths]
        out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env={**os.environ, "YOLO_OFFLINE": "1"},
                             timeout=1200)
        rows, failures, counts = read_junit(xml)
    summary = f"`pytest -k \"{expr}\"`: exit {out.returncode}, " + ", ".join(f"{n} {k}" for k, n in counts.items())
    body = "\n".join([summary, "", "| test | outcome | s |", "|---|---|---|", *rows, "", *failures])
    if out.returncode not in (0, 5) or counts["failed"]:  # 5: nothing collected
        tail = "\n".join((out.stdout + out.stderr).strip().splitlines()[-15:])
        return Section("FAILED", f"{body}\n```\n{tail}\n```")
    if device != "cuda":
        return Section("SKIPPED", f"no CUDA device\n\n{body}")
    if counts["skipped"] or not counts["passed"]:
        return Section("FAILED", f"on CUDA every selected test must run\n\n{body}")
    return Section("PASS", body)


def read_junit(xml: Path) -> tuple[list[str], list[str], dict[str, int]]:
    """Table rows (test, outcome, seconds), each failure's message, and counts per outcome of a pytest junit file."""
    rows, failures, counts = [], [], {"passed": 0, "failed": 0, "skipped": 0}
    for case in ET.parse(xml).getroot().iter("testcase") if xml.exists() else []:
        outcome = next((c for c in case if c.tag in {"failure", "error", "skipped"}), None)
        state = "passed" if outcome is None else "skipped" if outcome.tag == "skipped" else "failed"
        counts[state] += 1
        name = f"{case.get('classname', '').rsplit('.', 1)[-1]}::{case.get('name')}"
        rows.append(f"| {name} | {state} | {float(case.get('time', 0)):.1f} |")
        if state == "failed":
            failures.append(f"**{name}**\n\n```\n{(outcome.text or outcome.get('message') or '')[-4000:]}\n```")
    return rows, failures, counts


# ------------------------------------------------------------------------------- 3-4: trainings on the device
class Meter:
    """Peak device memory from ``reset`` to ``peaks``: the CUDA caching allocator's (allocated, reserved) over a
    ``cuda_peak`` block that ``reset`` enters and ``peaks`` ends; elsewhere the exact live tensor bytes of ``tracker``,
    entered around the run with ``with meter:`` (both figures the same)."""

    def __init__(self, device: str, tracker: LiveTensorTracker | None = None) -> None:
        self.device = torch.device("cuda", 0) if device == "cuda" else torch.device("cpu")
        self.tracker = None if device == "cuda" else tracker or LiveTensorTracker()
        self._block: AbstractContextManager[CudaPeak] | None = None  # the open ``cuda_peak`` block, and its figures
        self._peak: CudaPeak | None = None

    def __enter__(self) -> Meter:
        if self.tracker is not None:
            self.tracker.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.tracker is not None:
            self.tracker.__exit__(*exc)

    def reset(self) -> None:
        if self.tracker is not None:
            self.tracker.reset_peak()
        else:  # a block reset again before its end is dropped unread
            self._block = cuda_peak(self.device)
            self._peak = self._block.__enter__()

    def peaks(self) -> tuple[int, int]:
        if self.tracker is not None:
            return self.tracker.peak, self.tracker.peak
        if self._block is not None:
            self._block.__exit__(None, None, None)
            self._block = None
        return self._peak.allocated, self._peak.reserved


class PhasePeaks:
    """Callbacks measuring the planning phase (the trainer's start to ``on_train_start``: model, AutoBatch or auto,
    loaders, optimizer) and the first epoch (its last start — an out-of-memory retry restarts it — to its end)."""

    def __init__(self, meter: Meter) -> None:
        self.meter = meter
        self.planning: tuple[int, int] | None = None
        self.epoch: tuple[int, int] | None = None

    def add_to(self, model: ultralytics.YOLO) -> None:
        model.add_callback("on_pretrain_routine_start", lambda trainer: self.meter.reset())
        model.add_callback("on_train_start", self._planned)
        model.add_callback("on_train_epoch_start", lambda trainer: self.meter.reset())
        model.add_callback("on_train_epoch_end", self._epoch_end)

    def _planned(self, trainer: Any) -> None:
        self.planning = self.meter.peaks()

    def _epoch_end(self, trainer: Any) -> None:
        if self.epoch is None:
            self.epoch = self.meter.peaks()


@contextmanager
def log_lines(*needles: str) -> Iterator[list[str]]:
    """Collect Ultralytics' log lines that contain any of ``needles`` (colour codes removed)."""
    lines: list[str] = []
    ansi = re.compile(r"\x1b\[[0-9;]*m")

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            text = ansi.sub("", record.getMessage())
            lines.extend(s.strip() for s in text.splitlines() if any(n in s for n in needles))

    handler = Collect()
    LOGGER.addHandler(handler)
    try:
        yield lines
    finally:
        LOGGER.removeHandler(handler)


@dataclass
class Run:
    """One training run and what was measured around it."""

    trainer: Any
    peaks: PhasePeaks
    log: list[str]
    args: dict  # args.yaml as the run left it (auto records its choice there)

    @property
    def csv(self) -> dict:
        """The first row of results.csv (column names and values stripped, as Ultralytics pads them)."""
        with open(Path(self.trainer.save_dir) / "results.csv") as f:
            return next(({k.strip(): (v or "").strip() for k, v in r.items()} for r in csv.DictReader(f)), {})


def train(meter: Meter, ours: bool, name: str, project: Path, **kw: Any) -> Run:
    """Train once (yolo-ckpt's trainer, or vanilla Ultralytics), measured by ``meter``; the run's settings in ``kw``."""
    model = YOLO(MODEL) if ours else ultralytics.YOLO(MODEL)
    peaks = PhasePeaks(meter)
    peaks.add_to(model)
    args = dict(data=str(synthetic_dataset("detect")), epochs=1, workers=0, plots=False, val=False, name=name,
                project=str(project), exist_ok=True, device=0 if meter.device.type == "cuda" else "cpu", **kw)
    with log_lines("checkpoint:", "AutoBatch", "out of memory") as log, meter:
        model.train(**args)
    trainer = model.trainer
    return Run(trainer, peaks, log, YAML.load(Path(trainer.save_dir) / "args.yaml"))


def gb(nbytes: int | float | None) -> str:
    return "n/a" if nbytes is None else f"{nbytes / GB:.3f}"


def plan_of(args: dict) -> tuple[Any, str, Any]:
    """``(checkpoint_stages, checkpoint_mode, checkpoint_layers)`` a run trained with, from its args.yaml: the report's
    cell."""
    return args.get("checkpoint_stages"), args.get("checkpoint_mode") or "full", args.get("checkpoint_layers") or None


def step_against_allocator(device: str, plan: tuple, imgsz: int, batch: int, amp: torch.dtype | None) -> str:
    """One training step of ``plan`` at ``batch`` and ``imgsz`` under autocast of ``amp``, channels_last as the
    trainer on CUDA: the exact tensor peak (weights and batch included) next to the allocator's peaks. A first step
    warms up (cuDNN handles and workspaces, the loss)."""
    if device != "cuda":
        return "n/a (no allocator on CPU)"
    dev = torch.device("cuda", 0)
    built = build_model(MODEL).to(dev).to(memory_format=torch.channels_last)
    model = with_plan(built, PlanSettings.of(*plan))
    del built
    data = training_batch(model, StepShape(imgsz, batch))
    try:
        measure_peak(model, data, amp)
        with cuda_peak(dev) as peak:  # peak.before: model and batch, alive through the step
            tensors = measure_peak(model, data, amp)[0]
        tensors, alloc, reserved = peak.before + tensors, peak.allocated, peak.reserved
    finally:
        del model, data
        release(device)
    return (f"{gb(tensors)} GB exact tensor bytes, {gb(alloc)} GB max allocated ({alloc / tensors:.3f}x), "
            f"{gb(reserved)} GB max reserved ({reserved / tensors:.3f}x)")


def release(device: str) -> None:
    """Drop what the last section left: collected garbage and, on CUDA, the allocator's cached blocks."""
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


def planning(quick: bool, device: str) -> Section:
    """Section 3: ``auto`` at a fixed batch and ``batch=-1`` with all stages, planned for the device's memory."""
    cuda = device == "cuda"
    imgsz, batch = (64, 4) if quick else (2048, 8)
    target = {} if cuda else {"memory_budget": "256MB"}  # CPU: no device memory to plan for
    size = {"fraction": batch} if quick else {}  # images: a quick run trains one batch
    rows, steps, failed, logs = [], [], [], []
    with tempfile.TemporaryDirectory() as tmp:
        for name, kw in (("auto", {"checkpoint_stages": "auto", "batch": batch}),
                         ("batch=-1 all", {"checkpoint_stages": "all", "batch": -1})):
            run = train(Meter(device), True, re.sub(r"\W", "", name), Path(tmp), imgsz=imgsz, **target, **size, **kw)
            row, over, step = planned_against_target(name, run)
            rows.append(row)
            failed += over
            logs += [f"{name}: {line}" for line in run.log]
            del run  # its trainer holds the model, EMA and optimizer on the device
            release(device)
            steps.append(f"- {name}, {step[0]} at batch {step[2]}: {step_against_allocator(device, *step)}")
    unit = "allocated / reserved (CUDA allocator)" if cuda else "exact tensor bytes (CPU)"
    planned = "the GPU's free memory" if cuda else "memory_budget=256MB"
    body = "\n".join([
        f"{model_name()}, imgsz {imgsz}, 1 epoch, planned for {planned}; GB = 2^30 bytes, peaks {unit}. target: "
        "`trainer.run_memory.target` (n/a: the trainer reports none for this path).", "",
        "| run | batch | plan (stages, mode, layers) | target GB | planning peak GB | first epoch peak GB | "
        "results.csv alloc / reserved / tensor GB |", "|---|---|---|---|---|---|---|", *rows, "",
        "One training step of each chosen plan (AMP and channels_last as the run):", "", *steps, "",
        "Log:", "", "```", *logs, "```", *([""] + failed if failed else [])])
    return Section("FAILED" if failed else "PASS", body)


def planned_against_target(name: str, run: Run) -> tuple[str, list[str], tuple]:
    """A run's table row, the peaks over its target (where the trainer reports one), and the step to check its plan
    with: ``(plan, imgsz, batch, autocast dtype)``."""
    t, share = run.trainer, getattr(getattr(run.trainer, "run_memory", None), "target", None)
    (p_alloc, p_res), (e_alloc, e_res) = run.peaks.planning, run.peaks.epoch
    columns = [run.csv.get(k) or "n/a" for k in ("mem/peak_alloc_GB", "mem/peak_reserved_GB", "mem/peak_tensor_GB")]
    row = (f"| {name} | {t.batch_size} | {plan_of(run.args)} | {gb(share)} | {gb(p_alloc)} / {gb(p_res)} | "
           f"{gb(e_alloc)} / {gb(e_res)} | {' / '.join(columns)} |")
    over = [] if share is None else [f"{name}: {what} peak {gb(peak)} GB reserved is over the target {gb(share)} GB"
                                     for what, peak in (("planning", p_res), ("first epoch", e_res)) if peak > share]
    amp = torch.bfloat16 if t.args.amp == "bf16" else torch.float16 if t.amp else None  # as Ultralytics' loop
    return row, over, (plan_of(run.args), t.args.imgsz, t.batch_size, amp)


def simulated_device_class() -> type | None:
    """``yolo_ckpt.memory.device.SimulatedDevice`` (a CPU memory limit raising CUDA-style OOMs), where the package
    has it."""
    try:
        from yolo_ckpt.memory.device import SimulatedDevice
    except ImportError:
        return None
    return SimulatedDevice


@contextmanager
def memory_limit(device: str, limit: int) -> Iterator[LiveTensorTracker | None]:
    """The device limited to ``limit`` bytes: on CUDA this process's allocator fraction (always restored to 1.0), on
    CPU a simulated device of that size (yielded, to be the run's meter)."""
    if device == "cuda":
        dev = torch.device("cuda", 0)
        release(device)
        torch.cuda.set_per_process_memory_fraction(limit / torch.cuda.get_device_properties(dev).total_memory, dev)
        try:
            yield None
        finally:
            torch.cuda.set_per_process_memory_fraction(1.0, dev)
            release(device)
    else:
        yield simulated_device_class()(limit)


def escalation(quick: bool, device: str, share: float) -> Section:
    """Section 4: ``checkpoint_stages=[2,3]`` on a device of ``share`` x vanilla's first-epoch peak, same batch."""
    if device != "cuda" and simulated_device_class() is None:
        return Section("SKIPPED",
                       "needs CUDA (set_per_process_memory_fraction) or yolo_ckpt.memory.device.SimulatedDevice")
    imgsz, batch = (192, 4) if quick else (1280, 8)  # quick: still activations, not model state, dominate
    size = {"fraction": batch} if quick else {}  # images: one batch per epoch
    with tempfile.TemporaryDirectory() as tmp:
        vanilla = train(Meter(device), False, "vanilla", Path(tmp), imgsz=imgsz, batch=batch, **size)
        peak = vanilla.peaks.epoch[1]
        limit = int(share * peak)
        del vanilla
        release(device)
        error, run = None, None
        with memory_limit(device, limit) as simulated:
            try:
                run = train(Meter(device, simulated), True, "ckpt", Path(tmp), imgsz=imgsz, batch=batch,
                            checkpoint_stages=[2, 3], **size)
            except Exception as e:  # the check's verdict, not a crash of the check
                error = f"{type(e).__name__}: {str(e)[:500]}"
        head = (f"{model_name()}, imgsz {imgsz}, batch {batch}: vanilla's first epoch peaked at {gb(peak)} GB; the "
                f"device was limited to {share:g}x that, {gb(limit)} GB, and `checkpoint_stages=[2,3]` started at "
                f"batch {batch}.")
        if device == "cuda":
            head += (" (`set_per_process_memory_fraction` limits the caching allocator only: `mem_get_info`, and with "
                     "it any free-memory figure a planner reads, still reports the whole GPU.)")
        if run is None:
            return Section("FAILED", f"{head}\n\ntraining failed: {error}")
        plan, trained = plan_of(run.args), run.trainer.batch_size
        lines = [head, "", f"- trained at batch {trained} with (stages, mode, layers) {plan} in args.yaml, first epoch "
                           f"peak {gb(run.peaks.epoch[1])} GB", "", "Log:", "", "```", *run.log, "```"]
    if trained < batch:
        return Section("FAILED", "\n".join([f"batch halved: {batch} -> {trained}", "", *lines]))
    if plan == ([2, 3], "full", None):
        return Section("FAILED", "\n".join(["nothing escalated: [2,3] trained unchanged (did the limit bind?)", "",
                                            *lines]))
    return Section("PASS", "\n".join(lines))


def whole_run(quick: bool, device: str) -> Section:
    """Section 8: ``auto`` at a third of vanilla's step on a device of 1.05x its share, to the end of the run."""
    from yolo_ckpt.memory.device import UntoldDevice
    from yolo_ckpt.memory.step import step_bytes

    imgsz, batch = (128, 4) if quick else (1280, 8)  # quick: 128 px, where the YOLO object's own model alone once
    size = {"fraction": batch} if quick else {}  # made the final validation run out (the meter enters the device)
    objects = 4 * max(len(f.read_text().splitlines())  # mosaic, as the trainer counts the dataset's labels
                      for f in (synthetic_dataset("detect").parent / "labels" / "train").glob("*.txt"))
    vanilla = step_bytes(build_model(MODEL).to(0 if device == "cuda" else "cpu"),
                         StepShape(imgsz, batch, objects))
    release(device)
    budget = int(vanilla * (0.8 if quick else 1 / 3) / 0.6)  # quick: at 128 px the model state is most of a step
    share = int(0.6 * budget)
    limit = int(1.05 * share)
    with tempfile.TemporaryDirectory() as tmp:
        # on CPU the run's meter enters the untold device once the YOLO model is built, as a GPU holds none of the
        # model the YOLO object keeps on the host while its trainer trains a copy of its own
        untold = None if device == "cuda" else UntoldDevice(limit)
        error, run = None, None
        # the allocator's peak when the run ends: since the last reset of its statistics (the run's meter, auto)
        with cuda_peak(0) if device == "cuda" else nullcontext() as whole, \
                memory_limit(device, limit) if device == "cuda" else nullcontext():
            try:
                with log_lines("validation", "auto chose", "out of memory", "escalated") as lines:
                    run = train(Meter(device, untold), True, "whole", Path(tmp), imgsz=imgsz, batch=batch,
                                checkpoint_stages="auto", memory_budget=f"{budget}B", **size)
            except Exception as e:  # the check's verdict, not a crash of the check
                error = f"{type(e).__name__}: {str(e)[:500]}"
        peak = whole.reserved if device == "cuda" else untold.peak
    head = (f"{model_name()}, imgsz {imgsz}, batch {batch}: vanilla's step {gb(vanilla)} GB (exact tensor bytes); "
            f"memory_budget={budget}B, share {gb(share)} GB; device limited to {gb(limit)} GB "
            f"({'set_per_process_memory_fraction' if device == 'cuda' else 'UntoldDevice'}).")
    if run is None:
        return Section("FAILED", f"{head}\n\nthe run failed: {error}")
    body = [head, "", f"- ended at batch {run.trainer.batch_size} with {plan_of(run.args)}, validator batch "
                      f"{run.trainer.run_memory.val_batch or 'Ultralytics own'}; the run's peak {gb(peak)} GB "
                      f"({'reserved' if device == 'cuda' else 'tensor bytes'}), {peak / share:.3f}x the share",
            "", "Log:", "", "```", *lines, "```"]
    return Section("PASS", "\n".join(body))


# --------------------------------------------------------------------------------------- 5-7: measurement only
def memory_table(quick: bool, device: str) -> str:
    models, sizes = ([MODEL], [128]) if quick else (["yolo11n.yaml", "yolo11s.yaml"], [640, 1280])
    amps = ["off", "fp16"] if device == "cuda" else ["off"]
    # quick: one plan of stages, one of layers and one selective beside vanilla and auto, each kind of row the
    # table makes (the others differ only in their settings), and none that names yolo11n's own layers
    return "\n".join(table(models, sizes, 4, amps, device, repeats=1 if quick else 3,
                           shares=[0.7] if quick else [0.5, 0.6, 0.7, 0.8, 0.9],
                           fixed_plans=("all", "all + head selective") if quick else True))


def autobatch(quick: bool, device: str) -> str:
    imgsz = 128 if quick else 1280
    model = build_model(MODEL).to(device)
    plans = {"all": with_plan(model, PlanSettings.of("all")), "none": with_plan(model, PlanSettings.of([]))}
    lines = ["| stages | method | batch | note |", "|---|---|---|---|"]
    if device == "cuda":
        from ultralytics.utils.autobatch import check_train_batch_size

        for name, m in plans.items():
            t = time.perf_counter()
            b = check_train_batch_size(m, imgsz, amp=True, batch=-1, max_num_obj=200)
            lines.append(f"| {name} | Ultralytics AutoBatch, 60% of free memory, fp16 | {b} | "
                         f"{time.perf_counter() - t:.0f} s |")
        budget = torch.cuda.get_device_properties(0).total_memory
    else:
        budget = 2**28 if quick else 2**30
    amp = torch.float16 if device == "cuda" else None
    for name, m in plans.items():
        p = plan_batch(deepcopy(m), StepShape(imgsz, objects=200, amp=amp), budget, fraction=0.6)
        lines.append(f"| {name} | memory_budget={budget / 2**30:g}GB, 60% | {p.batch} | measured "
                     f"{p.measured_bytes / 2**30:.2f} of {p.target_bytes / 2**30:.2f} GB (exact tensors) |")
    return f"imgsz {imgsz}, {model_name()}\n\n" + "\n".join(lines)


def compiled_step(quick: bool, device: str, backend: str) -> str:
    from torch._dynamo.utils import counters

    imgsz, repeats = (64, 2) if quick else (640, 5)
    model = build_model(MODEL).to(device)
    batch = training_batch(model, StepShape(imgsz, 4))
    ckpt = with_plan(model, PlanSettings.of([2, 3]))
    rows = ["| step | graphs | graph breaks | CUDA peak MiB | median step s |", "|---|---|---|---|---|"]

    def run(m, fn, name, counted=False):
        times, peak = [], None
        for _ in range(repeats + 1):  # the first call compiles
            if device == "cuda":
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            t = time.perf_counter()
            loss, _ = m.loss(batch, fn(batch["img"]))
            loss.sum().backward()
            m.zero_grad(set_to_none=True)
            if device == "cuda":
                torch.cuda.synchronize()
                peak = torch.cuda.max_memory_allocated() / 2**20
            times.append(time.perf_counter() - t)
        med = sorted(times[1:])[len(times[1:]) // 2]
        # the graphs dynamo made and the breaks between them, counted while the first call compiled (not a separate
        # trace by torch._dynamo.explain: on a CPU that took 2/5 of the compile's own time)
        graphs, breaks = (counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())) if counted else (
            "", "")
        rows.append(f"| {name} | {graphs} | {breaks} | {f'{peak:.0f}' if peak else 'n/a'} | {med:.4f} |")

    run(model, model, "eager vanilla")
    run(ckpt, ckpt, "eager [2,3]")
    torch._dynamo.reset()  # no graph of an earlier compile in this process reused, none counted
    counters.clear()
    run(ckpt, torch.compile(ckpt, backend=backend), f"compiled [2,3] ({backend})", counted=True)
    return f"{model_name()}, imgsz {imgsz}, batch 4\n\n" + "\n".join(rows)


# -------------------------------------------------------------------------------------------------------- main
def run_section(section: Callable[[], Section | str], device: str) -> Section:
    """A section's verdict; one that returns plain markdown passes; an exception fails it, with its traceback."""
    try:
        result = section()
    except Exception:
        result = Section("FAILED", f"```\n{traceback.format_exc()[-3000:]}\n```")
    finally:
        release(device)
    return result if isinstance(result, Section) else Section("PASS", result)


def main() -> None:
    global MODEL
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", type=Path, help="directory for gpu_check.md")
    p.add_argument("--quick", action="store_true",
                   help="small sizes, one repeat, no planning probe timed (as the suite plans): checks the script, "
                        "not the GPU")
    p.add_argument("--compile-backend", default="inductor")
    p.add_argument("--escalation-share", type=float, default=0.6, help="device memory as a share of vanilla's peak")
    p.add_argument("--model", default=MODEL,
                   help="with --quick: every section's model (a model YAML; the suite passes a small one, as each "
                        "section's checks are the script's, not the model's)")
    a = p.parse_args()
    if a.model != MODEL and not a.quick:
        p.error("--model is for --quick: the GPU check itself is yolo11n's")
    MODEL = a.model
    if a.quick:
        costs.TIMED_STEPS = 0
    device = "cuda" if torch.cuda.is_available() else "cpu"
    name = torch.cuda.get_device_name(0) if device == "cuda" else platform.processor() or "CPU"
    report = [f"# yolo-ckpt GPU check{' (quick)' if a.quick else ''}", "",
              f"{name}; torch {torch.__version__}, ultralytics {ultralytics.__version__}, device {device}", ""]
    sections = {
        "CUDA tests": lambda: pytest_section(f"cuda and not {EXACTNESS}", device, ("tests/test_memory.py",)),
        "Exactness on CUDA": lambda: pytest_section(f"cuda and {EXACTNESS}", device),
        "Planning on the device": lambda: planning(a.quick, device),
        "Escalation under a reduced memory fraction": lambda: escalation(a.quick, device, a.escalation_share),
        "Memory table": lambda: memory_table(a.quick, device),
        "AutoBatch with and without checkpointing": lambda: autobatch(a.quick, device),
        "Compiled checkpointed step": lambda: compiled_step(a.quick, device, a.compile_backend),
        "Whole run on a tight device": lambda: whole_run(a.quick, device),
    }
    a.out.mkdir(parents=True, exist_ok=True)
    path, start, failed = a.out / "gpu_check.md", time.perf_counter(), []
    for title, section in sections.items():
        t = time.perf_counter()
        result = run_section(section, device)
        failed += [title] if result.status == "FAILED" else []
        report += [f"## {title}: {result.status} ({time.perf_counter() - t:.0f} s)", "", result.body, ""]
        print(f"{title}: {result.status} ({time.perf_counter() - t:.0f} s)", flush=True)
        path.write_text("\n".join(report) + "\n")  # after every section: a run cut short keeps what it measured
    report.append(f"Total {time.perf_counter() - start:.0f} s; " + (f"FAILED: {', '.join(failed)}." if failed else
                                                                     "no section failed."))
    path.write_text("\n".join(report) + "\n")
    print(f"report: {path}")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
