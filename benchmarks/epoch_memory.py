"""Peak memory of real training epochs, checkpointed vs vanilla, from the memory column of results.csv.

Trains the same run in one process (deterministic CPU by default) on the embedded dataset: with plain Ultralytics,
with ``checkpoint_stages=[]`` (vanilla training, memory measured) and once per plan. Prints each plan's per-epoch
peak as a ratio to vanilla, whether the losses are identical to plain Ultralytics, and each epoch's duration (from
results.csv's cumulative ``time``) as a ratio to plain Ultralytics' same epoch; for ``[]`` that is the cost of
measuring memory. Use ``--epochs 2`` or more: epoch 1 includes one-off warm-up. Then the whole run's peak of each plan
(training, validation and the final evaluation of best.pt) as a ratio to vanilla's.

Usage:
    python benchmarks/epoch_memory.py --model yolo11n.yaml --imgsz 640 --batch 4 --epochs 1 --stages all "[2,3]"
    python benchmarks/epoch_memory.py --stages --third   # only whole_network.THIRD (regions inside layers, nested)
    python benchmarks/epoch_memory.py --epochs 3 --plot docs/img/epoch_memory.png   # docs/figures.md's picture
    python benchmarks/epoch_memory.py --model yolo11n-seg.yaml --data synthetic_dense --imgsz 1024 --batch 2 \
        --stages all --layers head --loss none exact chunked   # the whole network, and with the loss recomputed
    python benchmarks/epoch_memory.py ... --vanilla-peak 1.318   # only the plans, against vanilla's whole run
        # measured before by the same command (its "[]" row's run peak GB): the two reference runs skipped
"""

import argparse
import ast
import csv
import math
import re
import tempfile
from pathlib import Path

import ultralytics
from whole_network import THIRD

from yolo_ckpt import YOLO
from yolo_ckpt.data.synthetic import synthetic_dataset
from yolo_ckpt.report.plots import epoch_ticks


def plot(runs: dict[str, list[dict]], mem: str, title: str, path: Path) -> None:
    """One line per plan: its peak per epoch, as results.csv's ``mem`` column says."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4), tight_layout=True)
    top = max(float(r[mem]) for rows in runs.values() for r in rows)
    for spec, rows in runs.items():
        epochs = [int(r["epoch"]) for r in rows]
        ax.plot(epochs, [float(r[mem]) for r in rows], marker="o", label="vanilla ([])" if spec == "[]" else spec)
    epoch_ticks(ax, epochs)
    ax.set(xlabel="epoch", ylabel=f"{mem} (GB = 2^30 B)", title=title, ylim=(0, 1.15 * top))
    ax.legend(title="checkpoint_stages")
    ax.grid(alpha=0.3)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=150)
    plt.close(fig)


def per_epoch(runs: dict[str, list[dict]], mem: str) -> None:
    """Each run's per-epoch peak against ``[]``'s, whether its losses are plain Ultralytics', and its epoch time."""
    print("| stages | epoch | peak GB | ratio to [] | losses identical to Ultralytics | epoch time / Ultralytics |")
    print("|---|---|---|---|---|---|")
    plain = runs.pop("ultralytics")

    def durations(rows):
        ends = [float(r["time"]) for r in rows]
        return [b - a for a, b in zip([0.0, *ends], ends)]

    for spec, rows in runs.items():
        for row, base, ref, t, t_ref in zip(rows, runs["[]"], plain, durations(rows), durations(plain)):
            same = all(row[k] == ref[k] for k in ref if "loss" in k)
            ratio = float(row[mem]) / float(base[mem])
            print(f"| {spec} | {row['epoch']} | {float(row[mem]):.3f} | {ratio:.3f} | {same} | {t / t_ref:.2f} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="yolo11n.yaml")
    p.add_argument("--imgsz", type=int, default=640)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--device", default="cpu")
    p.add_argument("--stages", nargs="*", default=["all", "[2,3]"])
    p.add_argument("--third", action="store_true", help="also whole_network.THIRD, named 'third'")
    p.add_argument("--plot", type=Path, help="draw each plan's peak per epoch into this PNG")
    p.add_argument("--data", default="synthetic_hr", help="the embedded variant (synthetic_hr, synthetic_dense, ...)")
    p.add_argument("--loss", nargs="+", default=["none"], help="checkpoint_loss values to run each plan with")
    p.add_argument("--layers", help="checkpoint_layers of each plan (head: with --stages all, the whole network)")
    p.add_argument("--vanilla-peak", type=float, help="vanilla's whole-run peak GB, from an earlier run of the same "
                   "command: skip the plain Ultralytics and [] runs, ratios against it")
    a = p.parse_args()
    project = Path(tempfile.mkdtemp(prefix="epoch_memory_"))
    runs = {}
    data = str(synthetic_dataset(YOLO(a.model).task, variant=a.data))
    args = dict(data=data, epochs=a.epochs, imgsz=a.imgsz, batch=a.batch, device=a.device, workers=0, plots=False,
                val=False, project=str(project), verbose=False)
    plans = [(s, loss) for s in [*a.stages, *(["third"] if a.third else [])] for loss in a.loss]
    whole = {}  # each of our runs' peak over training, validation and the final evaluation
    references = [] if a.vanilla_peak else [("ultralytics", "none"), ("[]", "none")]
    for stages, loss in [*references, *plans]:
        spec = (stages if not a.layers or stages in ("ultralytics", "[]") else f"{stages} + {a.layers}") + \
            ("" if loss == "none" else f" + loss {loss}")
        # the run's directory, in plain characters: with --layers "['1-2', ...]" Ultralytics' final validation looked
        # for best.pt at the path without its quotes, and the run died
        name = re.sub(r"[^\w+.,-]", "_", spec.replace(" ", ""))
        model = ultralytics.YOLO(a.model) if stages == "ultralytics" else YOLO(a.model)
        peaks = whole.setdefault(spec, [])  # every on_fit_epoch_end's memory figures, the final evaluation's included
        model.add_callback("on_fit_epoch_end", lambda t, peaks=peaks: peaks.extend(
            v for k, v in t.metrics.items() if k.startswith("mem/") and math.isfinite(v)))
        if stages == "ultralytics":
            model.train(name=name, **args)
        elif stages == "third":
            model.train(name=name, **THIRD.keys(), checkpoint_loss=loss, **args)
        else:
            layers = None if stages == "[]" else a.layers
            model.train(name=name, checkpoint_stages=stages if stages in ("all", "least") else ast.literal_eval(stages),
                        checkpoint_layers=layers, checkpoint_loss=loss, **args)
        with open(project / name / "results.csv") as f:
            runs[spec] = [{k.strip(): v.strip() for k, v in r.items()} for r in csv.DictReader(f)]
    mem = next(k for rows in runs.values() for k in rows[0] if k.startswith("mem/"))  # Ultralytics' own has none
    print(f"\n{a.model} on {a.data}, imgsz={a.imgsz} batch={a.batch} device={a.device}: per-epoch {mem}")
    if a.vanilla_peak:
        for spec, rows in runs.items():
            print(f"| {spec} | epochs {', '.join(r[mem] for r in rows)} GB | ratio to vanilla's run "
                  f"{', '.join(f'{float(r[mem]) / a.vanilla_peak:.3f}' for r in rows)} |")
    else:
        per_epoch(runs, mem)
    vanilla = a.vanilla_peak or max(whole["[]"])
    print(f"\nthe whole run's peak ({mem} and its mem/val_peak_ twin: training, validation, the final evaluation)"
          + (f", against vanilla's whole run given, {vanilla} GB" if a.vanilla_peak else ""))
    print("| stages | run peak GB | ratio to [] |")
    print("|---|---|---|")
    for spec, peaks in whole.items():
        if spec != "ultralytics":
            print(f"| {spec} | {max(peaks):.3f} | {max(peaks) / vanilla:.3f} |")
    if a.plot:
        plot(runs, mem, f"{Path(a.model).stem} {a.imgsz} px, batch {a.batch}: peak per epoch", a.plot)
        print(f"picture: {a.plot}")


if __name__ == "__main__":
    main()
