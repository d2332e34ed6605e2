"""One-shot GPU check: what the CPU machine cannot confirm, on one CUDA GPU in under 8 minutes, as one markdown report.

Usage:
    python benchmarks/gpu_check.py OUT_DIR             # on a CUDA machine: writes OUT_DIR/gpu_check.md
    python benchmarks/gpu_check.py OUT_DIR --quick     # a small run of every section (any device; CI runs it on CPU)

Sections, each timed; a section that fails is reported with its error and the check goes on:

1. CUDA tests: every test whose name says ``cuda`` (they skip without a GPU): allocator peaks, the CUDA epoch meter,
   the tracker on CUDA tensors, Ultralytics' AutoBatch and a training epoch on the checkpointed model.
2. Memory table: yolo11n and yolo11s at 640 and 1280, AMP off and fp16, plans none / [2,3] / all: the exact tensor
   peak (``LiveTensorTracker``) next to ``torch.cuda.max_memory_allocated``, FLOP and step-time ratios.
3. AutoBatch with and without checkpointing: Ultralytics' ``check_train_batch_size`` (60% of *free* memory, fp16
   autocast) on yolo11n at 1280 with all stages and plain; and yolo-ckpt's ``memory_budget`` planning for 60% of the
   GPU's *total* memory, both ways.
4. A compiled checkpointed step: ``torch.compile`` (inductor) of yolo11n with stages [2,3] in Ultralytics' compiled
   step (model compiled, loss outside): graph count and breaks, allocator peak and step time against the same step
   eager and against eager vanilla.
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import time
import traceback
from copy import deepcopy
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from yolo_ckpt.autobatch import plan_batch  # noqa: E402
from yolo_ckpt.measure import build_model, training_batch, with_plan  # noqa: E402

from memory_table import table  # noqa: E402


def cuda_tests(quick: bool) -> str:
    """Run the CUDA tests with pytest; return its summary."""
    cmd = [sys.executable, "-m", "pytest", "-q", "-rs", "-k", "cuda", str(ROOT / "tests")]
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env={**os.environ, "YOLO_OFFLINE": "1"})
    tail = "\n".join(out.stdout.strip().splitlines()[-15:])
    return f"`{' '.join(cmd[2:])}` exit {out.returncode}\n\n```\n{tail}\n```"


def memory_table(quick: bool, device: str) -> str:
    models, sizes = (["yolo11n.yaml"], [128]) if quick else (["yolo11n.yaml", "yolo11s.yaml"], [640, 1280])
    amps = ["off", "fp16"] if device == "cuda" else ["off"]
    return "\n".join(table(models, sizes, 4, amps, device, repeats=1 if quick else 3,
                           shares=[0.7] if quick else [0.5, 0.6, 0.7, 0.8, 0.9]))


def autobatch(quick: bool, device: str) -> str:
    imgsz = 128 if quick else 1280
    model = build_model("yolo11n.yaml").to(device)
    plans = {"all": with_plan(model, "all"), "none": with_plan(model, [])}
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
        p = plan_batch(deepcopy(m), imgsz, budget, fraction=0.6, objects=200, amp=amp)
        lines.append(f"| {name} | memory_budget={budget / 2**30:g}GB, 60% | {p.batch} | measured "
                     f"{p.measured_bytes / 2**30:.2f} of {p.target_bytes / 2**30:.2f} GB (exact tensors) |")
    return f"imgsz {imgsz}, yolo11n\n\n" + "\n".join(lines)


def compiled_step(quick: bool, device: str, backend: str) -> str:
    imgsz, repeats = (64, 2) if quick else (640, 5)
    model = build_model("yolo11n.yaml").to(device)
    batch = training_batch(model, imgsz, 4)
    ckpt = with_plan(model, [2, 3])
    rows = ["| step | graphs | graph breaks | CUDA peak MiB | median step s |", "|---|---|---|---|---|"]

    def run(m, fn, name, graphs="", breaks=""):
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
        rows.append(f"| {name} | {graphs} | {breaks} | {f'{peak:.0f}' if peak else 'n/a'} | {med:.4f} |")

    torch._dynamo.reset()
    explained = torch._dynamo.explain(ckpt)(batch["img"])
    torch._dynamo.reset()
    run(model, model, "eager vanilla")
    run(ckpt, ckpt, "eager [2,3]")
    run(ckpt, torch.compile(ckpt, backend=backend), f"compiled [2,3] ({backend})", explained.graph_count,
        explained.graph_break_count)
    return f"yolo11n, imgsz {imgsz}, batch 4\n\n" + "\n".join(rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", type=Path, help="directory for gpu_check.md")
    p.add_argument("--quick", action="store_true", help="small sizes, one repeat: checks the script, not the GPU")
    p.add_argument("--compile-backend", default="inductor")
    a = p.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    import ultralytics

    name = torch.cuda.get_device_name(0) if device == "cuda" else platform.processor() or "CPU"
    report = [f"# yolo-ckpt GPU check{' (quick)' if a.quick else ''}", "",
              f"{name}; torch {torch.__version__}, ultralytics {ultralytics.__version__}, device {device}", ""]
    sections = {
        "CUDA tests": lambda: cuda_tests(a.quick) if device == "cuda" else "skipped: no CUDA device",
        "Memory table": lambda: memory_table(a.quick, device),
        "AutoBatch with and without checkpointing": lambda: autobatch(a.quick, device),
        "Compiled checkpointed step": lambda: compiled_step(a.quick, device, a.compile_backend),
    }
    start = time.perf_counter()
    for title, section in sections.items():
        t = time.perf_counter()
        try:
            body = section()
        except Exception:
            body = f"FAILED\n\n```\n{traceback.format_exc()[-3000:]}\n```"
        report += [f"## {title} ({time.perf_counter() - t:.0f} s)", "", body, ""]
        print(f"{title}: {time.perf_counter() - t:.0f} s", flush=True)
    report.append(f"Total {time.perf_counter() - start:.0f} s.")
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "gpu_check.md").write_text("\n".join(report) + "\n")
    print(f"report: {a.out / 'gpu_check.md'}")


if __name__ == "__main__":
    main()
