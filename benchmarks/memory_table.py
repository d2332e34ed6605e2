"""README's memory table: checkpointed vs vanilla training steps, measured side by side in one run.

For each model and image size, one real training step (``model.loss`` forward + backward, 50 boxes per image) per plan:
exact peak of live tensor bytes (``LiveTensorTracker``), convolution/matmul FLOPs (``FlopCounterMode``, recompute
included) and the median step time on this machine's device, each as a ratio to vanilla. With CUDA, the allocator's
``max_memory_allocated`` ratio is added.

Usage:
    python benchmarks/memory_table.py                       # yolo11n, yolo11s at 640 and 1280, batch 4
    python benchmarks/memory_table.py --models yolo11n.yaml --imgsz 640 --batch 4 --device cpu
"""

import argparse

import torch

from yolo_ckpt.profiler import build_model, compare_plans

PLANS = {"none": [], "[2,3]": [2, 3], "all": "all"}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=["yolo11n.yaml", "yolo11s.yaml"])
    p.add_argument("--imgsz", nargs="+", type=int, default=[640, 1280])
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    a = p.parse_args()
    cuda = a.device.startswith("cuda")
    head = "| model | imgsz | batch | stages | peak MiB | peak ratio | FLOP ratio | step time ratio |"
    print(head + (" CUDA peak MiB | CUDA peak ratio |" if cuda else ""))
    print("|---" * (head.count("|") - 1 + 2 * cuda) + "|")
    for name in a.models:
        model = build_model(name).to(a.device)
        for imgsz in a.imgsz:
            for r in compare_plans(model, imgsz, a.batch, PLANS, repeats=a.repeats):
                row = (f"| {name} | {imgsz} | {a.batch} | {r['plan']} | {r['peak_MiB']:.0f} | {r['peak_ratio']:.3f} "
                       f"| {r['flops_ratio']:.3f} | {r['time_ratio']:.3f} ({a.device}) |")
                if cuda:
                    row += f" {r['cuda_peak_MiB']:.0f} | {r['cuda_peak_ratio']:.3f} |"
                print(row, flush=True)


if __name__ == "__main__":
    main()
