"""Does ``checkpoint_loss=chunked`` train as well as vanilla? Final metrics of the same run, side by side.

``chunked`` is not bitwise (sums in another order, the assignment image by image), so its run drifts from vanilla's
by float rounding, as two runs with another seed drift by more. Trains on the embedded dense aerial set
(``synthetic_dense``), deterministic CPU: plain Ultralytics (seed 0 and ``--seed2``, the run-to-run scale of the
metrics), and yolo-ckpt with the whole network and the loss chunked (seed 0). Prints each run's final validation
metrics and losses, and the chunked run's differences to vanilla beside the two vanilla seeds' differences. The margin:
the chunked run is within vanilla's run-to-run spread where every value's ``|chunked - vanilla|`` is at most
``|seed 1 - seed 0|`` (or 1e-4, the printed precision, where two seeds happen to agree); the last line says whether.

Usage:
    python benchmarks/chunked_metrics.py --model yolo11n-seg.yaml --imgsz 512 --batch 2 --epochs 20
"""

import argparse
import csv
import tempfile
from pathlib import Path

import ultralytics

from yolo_ckpt import YOLO
from yolo_ckpt.data.synthetic import synthetic_dataset


def last_row(run: Path) -> dict[str, float]:
    with open(run / "results.csv") as f:
        rows = [{k.strip(): v.strip() for k, v in r.items()} for r in csv.DictReader(f)]
    return {k: float(v) for k, v in rows[-1].items() if k.startswith(("metrics/", "val/", "train/")) and v}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="yolo11n-seg.yaml")
    p.add_argument("--imgsz", type=int, default=512)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--seed2", type=int, default=1, help="the second vanilla run's seed")
    a = p.parse_args()
    project = Path(tempfile.mkdtemp(prefix="chunked_metrics_"))
    data = str(synthetic_dataset(YOLO(a.model).task, variant="synthetic_dense"))
    args = dict(data=data, epochs=a.epochs, imgsz=a.imgsz, batch=a.batch, device="cpu", workers=0, deterministic=True,
                plots=False, project=str(project), verbose=False)
    ultralytics.YOLO(a.model).train(name="vanilla", seed=0, **args)
    ultralytics.YOLO(a.model).train(name="vanilla_seed2", seed=a.seed2, **args)
    YOLO(a.model).train(name="chunked", seed=0, checkpoint_stages="all", checkpoint_layers="head",
                        checkpoint_loss="chunked", **args)
    runs = {name: last_row(project / name) for name in ("vanilla", "vanilla_seed2", "chunked")}
    print(f"\n{a.model} on synthetic_dense, imgsz={a.imgsz} batch={a.batch}, {a.epochs} epochs, the last epoch:")
    print(f"| value | vanilla (seed 0) | vanilla (seed {a.seed2}) | chunked (seed 0) | chunked - vanilla "
          f"| seed {a.seed2} - seed 0 | within |")
    print("|---|---|---|---|---|---|---|")
    v, s, c = runs["vanilla"], runs["vanilla_seed2"], runs["chunked"]
    outside = []
    for k in v:
        if k in s and k in c:
            within = abs(c[k] - v[k]) <= max(abs(s[k] - v[k]), 1e-4)
            outside += [] if within else [k]
            print(f"| {k} | {v[k]:.5f} | {s[k]:.5f} | {c[k]:.5f} | {c[k] - v[k]:+.5f} | {s[k] - v[k]:+.5f} "
                  f"| {'yes' if within else 'NO'} |")
    print("chunked is within vanilla's seed-to-seed spread on every value" if not outside
          else f"chunked is outside vanilla's seed-to-seed spread on: {', '.join(outside)}")


if __name__ == "__main__":
    main()
