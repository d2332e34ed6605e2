"""The stage table of docs/plans.md: layers and module types of each backbone stage, derived from the built models.

Usage:
    python benchmarks/stage_table.py [yolov8n.yaml yolo11n.yaml yolo26n.yaml ...]
"""

import sys

from ultralytics.nn.tasks import parse_model, yaml_model_load

from yolo_ckpt.regions.graph import model_stages


def main(models: list[str]) -> None:
    tables = {name: model_stages(name) for name in models}
    ks = sorted(set().union(*tables.values()))
    print("| model | " + " | ".join(f"stage {k} (P{k}/{2**k})" for k in ks) + " |")
    print("|---" * (len(ks) + 1) + "|")
    for name, stages in tables.items():
        layers, _ = parse_model(yaml_model_load(name), ch=3, verbose=False)
        cells = [", ".join(f"{i} {type(layers[i]).__name__}" for i in stages[k]) if k in stages else "—" for k in ks]
        print(f"| {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main(sys.argv[1:] or ["yolov8n.yaml", "yolo11n.yaml", "yolo26n.yaml", "yolo11n-cls.yaml", "yolov8n-p6.yaml"])
