"""What Ultralytics' own tests download, made here from the project's embedded datasets and Ultralytics' model YAMLs.

Ultralytics' tests (``tests/`` beside this file) read their datasets by Ultralytics' names (``coco8.yaml``,
``dota8.yaml``, ``imagenet10``, ...) from the ``datasets_dir`` of Ultralytics' settings, and their weights
(``yolo26n.pt``, the ``yolo26s*.pt`` teachers of distillation, ``rtdetr-l.pt``) from its ``weights_dir``; both are
downloaded when missing. ``prepare`` writes a settings file whose directories hold local stand-ins instead:

- each dataset directory Ultralytics' own ``cfg/datasets/<name>.yaml`` points at (``path: coco8`` and so on), filled
  with the first images of the matching embedded ``synthetic_hr`` task (``yolo_ckpt.data.synthetic``), downscaled to
  ``SIDE`` px, their labels as they are; only coco8-pose's labels are of its one class with 17 keypoints (ours 4
  repeated in turn), and
  coco12-formats' images are the detection images in several file formats. Ultralytics' YAMLs are used unchanged
  (their class names, ``kpt_shape``, cityscapes' ``label_mapping``, whose raw ids 7, 11, 21 and 26 our masks use);
- each weights file, a checkpoint as Ultralytics releases them (``model`` in half precision, ``train_args``, epoch -1)
  of the model its name says, built from Ultralytics' ``.yaml`` with a fixed seed and never trained;
- the plotting font ``check_font`` would fetch: matplotlib's DejaVu Sans under Ultralytics' font names.

Nothing is downloaded. Import this only with ``YOLO_CONFIG_DIR`` set to the config directory ``prepare`` is given:
Ultralytics reads its settings once, when it is first imported.
"""

from __future__ import annotations

import json
import shutil
from copy import deepcopy
from datetime import datetime
from pathlib import Path

import cv2

SIDE = 160  # px, the longer side of every image written: the tests train at 32 px (RT-DETR at 160)
IMAGES = 4  # per split, as coco8 has
FORMATS = (".jpg", ".png", ".bmp", ".tif", ".webp", ".jpeg")  # coco12-formats: one image in each, per split
FONTS = ("Arial.ttf", "Arial.Unicode.ttf")

DATASETS = {  # Ultralytics' directory name (its data YAML's ``path``) -> the embedded task that fills it
    "coco8": "detect",
    "coco8-seg": "segment",
    "coco8-pose": "pose",
    "dota8": "obb",
    "cityscapes8": "semantic",
    "depth8-png": "depth",
    "imagenet10": "classify",
    "coco12-formats": "detect",
}

WEIGHTS = {  # file name -> the model YAML it is built from
    "yolo26n.pt": "yolo26n.yaml",
    "yolo26n-seg.pt": "yolo26n-seg.yaml",
    "yolo26n-cls.pt": "yolo26n-cls.yaml",
    "yolo26n-pose.pt": "yolo26n-pose.yaml",
    "yolo26n-obb.pt": "yolo26n-obb.yaml",
    "yolo26n-sem.pt": "yolo26n-sem.yaml",
    "yolo26n-depth.pt": "yolo26n-depth.yaml",
    "yolo26s.pt": "yolo26s.yaml",  # the distillation teachers of test_engine.py and test_cli.py
    "yolo26s-seg.pt": "yolo26s-seg.yaml",
    "yolo26s-pose.pt": "yolo26s-pose.yaml",
    "yolo26s-obb.pt": "yolo26s-obb.yaml",
    "rtdetr-l.pt": "rtdetr-l.yaml",
}
SPACED = "path with spaces"  # tests/__init__.py's MODEL lives in a sub-directory of that name


def settings(root: Path, runs: Path) -> dict:
    """Ultralytics' default settings with its three directories under ``root`` (datasets, weights) and ``runs``, and
    no events or loggers (as Ultralytics has none under pytest)."""
    from ultralytics.utils import SETTINGS

    loggers = dict.fromkeys(("clearml", "comet", "dvc", "mlflow", "raytune", "tensorboard", "wandb"), False)
    return {**SETTINGS.defaults, "datasets_dir": str(root / "datasets"), "weights_dir": str(root / "weights"),
            "runs_dir": str(runs), "sync": False, **loggers}


def write_config(config: Path, values: dict) -> Path:
    """A config directory (``YOLO_CONFIG_DIR``) with Ultralytics' settings file and its fonts; returns the directory."""
    import matplotlib

    home = config / "Ultralytics"  # ultralytics.utils.get_user_config_dir: $YOLO_CONFIG_DIR/Ultralytics
    home.mkdir(parents=True, exist_ok=True)
    (home / "settings.json").write_text(json.dumps(values, indent=2))
    font = Path(matplotlib.get_data_path()) / "fonts" / "ttf" / "DejaVuSans.ttf"
    for name in FONTS:
        if not (home / name).exists():
            shutil.copyfile(font, home / name)
    return config


def _resized(src: Path, dst: Path, interpolation: int = cv2.INTER_AREA) -> None:
    """``src`` with its longer side ``SIDE`` px (depth and mask values kept: nearest neighbour for those)."""
    image = cv2.imread(str(src), cv2.IMREAD_UNCHANGED)
    scale = SIDE / max(image.shape[:2])
    size = (round(image.shape[1] * scale), round(image.shape[0] * scale))
    dst.parent.mkdir(parents=True, exist_ok=True)
    cv2.imwrite(str(dst), cv2.resize(image, size, interpolation=interpolation))


def _pose_17(line: str, kpts: int) -> str:
    """A pose label line as coco8-pose's: class 0 (its one class, person), and 17 keypoints (COCO's count) from our
    ``kpts``, repeated in turn."""
    v = line.split()
    box, points = ["0", *v[1:5]], [v[5 + 3 * i: 8 + 3 * i] for i in range(kpts)]
    return " ".join(box + [x for i in range(17) for x in points[i % kpts]])


def make_dataset(name: str, root: Path) -> Path:
    """The stand-in for Ultralytics' dataset ``name`` under ``root`` (``DATASETS``), written once."""
    import yaml

    from yolo_ckpt.data.synthetic import synthetic_dataset

    out = root / name
    if out.exists():
        return out
    task = DATASETS[name]
    tmp = root / f".{name}.partial"
    shutil.rmtree(tmp, ignore_errors=True)
    src = synthetic_dataset(task)
    if task == "classify":
        for split in ("train", "val"):
            for d in sorted((src / split).iterdir()):
                for f in sorted(d.glob("*.png"))[:IMAGES]:
                    _resized(f, tmp / split / d.name / f.name)
        tmp.rename(out)
        return out
    src = src.parent
    kpts = yaml.safe_load((src / "data.yaml").read_text()).get("kpt_shape", [0])[0]
    for split in ("train", "val"):
        for n, f in enumerate(sorted((src / "images" / split).glob("*.png"))[:IMAGES]):
            image = tmp / "images" / split / f.name
            if name == "coco12-formats":
                image = image.with_suffix(FORMATS[n % len(FORMATS)])
            _resized(f, image)
            if task == "semantic":  # the raw-id masks, in cityscapes8.yaml's masks_dir
                _resized(src / "semantic_masks" / split / f.name, tmp / "masks" / split / f.name, cv2.INTER_NEAREST)
            elif task == "depth":
                _resized(src / "depth" / split / f.name, tmp / "depth" / split / f.name, cv2.INTER_NEAREST)
            else:
                text = (src / "labels" / split / f"{f.stem}.txt").read_text()
                if task == "pose":
                    text = "".join(_pose_17(line, kpts) + "\n" for line in text.splitlines() if line.strip())
                (tmp / "labels" / split).mkdir(parents=True, exist_ok=True)
                (tmp / "labels" / split / f"{f.stem}.txt").write_text(text)
    tmp.rename(out)
    return out


def make_weights(name: str, root: Path) -> Path:
    """``root/name``: a checkpoint in the form of Ultralytics' released weights, of the untrained ``WEIGHTS[name]``."""
    import torch
    from ultralytics import RTDETR, YOLO, __version__
    from ultralytics.cfg import TASK2DATA, get_cfg

    path = root / name
    if path.exists():
        return path
    torch.manual_seed(0)
    yaml_name = WEIGHTS[name]
    built = RTDETR(yaml_name) if yaml_name.startswith("rtdetr") else YOLO(yaml_name, verbose=False)
    model, task = built.model, built.task
    args = vars(get_cfg(overrides={"model": yaml_name, "task": task, "data": TASK2DATA[task]}))
    ckpt = {"date": datetime.now().isoformat(), "version": __version__, "license": "AGPL-3.0 License",
            "docs": "https://docs.ultralytics.com", "epoch": -1, "best_fitness": None, "model": deepcopy(model).half(),
            "ema": None, "updates": None, "optimizer": None, "train_args": args, "train_metrics": {},
            "train_results": {}}
    root.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".partial")
    torch.save(ckpt, tmp)
    tmp.rename(path)
    return path


def prepare(root: Path) -> None:
    """Every dataset and weights file of ``DATASETS`` and ``WEIGHTS`` under ``root/datasets`` and ``root/weights``
    (the ones already there kept: a ``root`` can be reused between runs)."""
    for name in DATASETS:
        make_dataset(name, root / "datasets")
    for name in WEIGHTS:
        make_weights(name, root / "weights")
    spaced = root / "weights" / SPACED / "yolo26n.pt"
    if not spaced.exists():
        spaced.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(root / "weights" / "yolo26n.pt", spaced)
