"""Deterministic synthetic high-resolution datasets for the Ultralytics tasks, generated locally.

Each variant is a recipe in ``datasets/<variant>.yaml`` (installed as ``yolo_ckpt.datasets``), drawn by the same
generator:

- ``synthetic_hr`` (the default): 1024x1024 aerial-style colour scenes with many small non-overlapping objects
  (vehicle, building, tree, boat) on a textured background; labels for all seven Ultralytics tasks.
- ``synthetic_medical``: 2048x2048 grayscale (1-channel) scan-like images with a few smooth blob and ellipse findings
  (lesion, cyst, mass) on a smooth noisy background; detect, segment, obb, semantic and depth labels, ``channels: 1``
  in its data.yaml.
- ``synthetic_dense``: the aerial scenes crowded, 250-350 objects of 8-24 px per 1024x1024 tile (8 train / 4 val):
  the scenes where the loss, not the network, holds most of a training step's memory; detect, segment, obb and
  semantic labels.

Semantic labels come in both forms Ultralytics reads: raw-id PNG masks under ``semantic_masks/`` (``masks_dir``) with
a Cityscapes-style ``label_mapping`` (data.yaml) and the same outlines as YOLO polygons under ``labels/``
(polygons.yaml), with the same classes (background last). Depth maps are uint16 PNGs under ``depth/`` (metres x
``depth_scale``).

The same recipe always yields byte-identical PNG images and labels, so runs on different days train on the same data.

Each task gets its own directory under ``<root>/<variant>-v<version>-<hash>/<task>/``, where ``root`` is the
``root`` argument, else ``$YOLO_CKPT_DATASETS``, else ``~/.cache/yolo_ckpt/datasets``, and ``hash`` is a short hash of
the recipe content. A task directory is written under a temporary name and renamed into place, so it is either
complete or absent; an existing one is reused as is. The scene tasks share the same images (hard-linked
when possible) and differ only in their label files. For classify, Ultralytics numbers the classes by sorted directory
name (boat, building, tree, vehicle), not by the recipe's ``names`` order.

Examples:
    >>> from ultralytics import YOLO
    >>> from yolo_ckpt.data.synthetic import synthetic_dataset
    >>> data = synthetic_dataset("detect")  # .../synthetic_hr-v1-<hash>/detect/data.yaml, generated on first use
    >>> YOLO("yolo11n.yaml").train(data=str(data), epochs=1, imgsz=1024, batch=2)  # doctest: +SKIP
    >>> synthetic_dataset("classify")  # a directory with train/<class>/*.png and val/<class>/*.png
    >>> synthetic_dataset("segment", variant="synthetic_medical")  # .../synthetic_medical-v1-<hash>/segment/data.yaml
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import uuid
from pathlib import Path
from typing import Any

import cv2
import numpy as np
import yaml

from .resources import data_file

TASKS = ("detect", "segment", "obb", "pose", "classify", "semantic", "depth")
SCENE_TASKS = ("detect", "segment", "obb", "pose", "semantic", "depth")  # tasks that share the same scene images
POLYGONS = "polygons.yaml"  # semantic/: the same labels as YOLO polygons, beside data.yaml (PNG masks)
MASKS_DIR = "semantic_masks"  # not "masks": Ultralytics picks a masks/ folder beside images/ even without masks_dir
VARIANTS = ("synthetic_hr", "synthetic_medical", "synthetic_dense")  # recipe file stems in datasets/
DEFAULT_VARIANT = "synthetic_hr"
_SHIFT = 4  # cv2 fixed-point bits: polygons are drawn at 1/16 pixel precision
_ELLIPSE_POINTS = 24  # polygon vertices used to draw and label an ellipse
_BLOB_POINTS = 32  # polygon vertices of a blob: more than an ellipse, as its margin wobbles


def recipe(variant: str = DEFAULT_VARIANT) -> dict[str, Any]:
    """Load the recipe of a dataset variant, ``datasets/<variant>.yaml``.

    Args:
        variant (str): One of :data:`VARIANTS`.

    Returns:
        (dict[str, Any]): The parsed recipe.

    Raises:
        ValueError: If ``variant`` is unknown.
    """
    return yaml.safe_load(_recipe_path(variant).read_text(encoding="utf-8"))


def recipe_tasks(r: dict[str, Any]) -> tuple[str, ...]:
    """Tasks a recipe can label: every scene task; pose, classify, semantic and depth only with their recipe section
    (``keypoints``, ``classify``, ``semantic``, ``depth``).

    Args:
        r (dict[str, Any]): A recipe, as returned by :func:`recipe`.

    Returns:
        (tuple[str, ...]): The tasks, in the order of :data:`TASKS`.
    """
    needs = {"pose": "keypoints", "classify": "classify", "semantic": "semantic", "depth": "depth"}
    return tuple(t for t in TASKS if needs.get(t, "names") in r)


def synthetic_dataset(task: str = "detect", root: str | Path | None = None, variant: str = DEFAULT_VARIANT) -> Path:
    """Generate (once) and return the data path for ``task``.

    Args:
        task (str): One of :data:`TASKS` that the variant labels.
        root (str | Path | None): Cache root; defaults to ``$YOLO_CKPT_DATASETS``, else ``~/.cache/yolo_ckpt/datasets``.
        variant (str): Which recipe, one of :data:`VARIANTS`.

    Returns:
        (Path): The data YAML path for the scene tasks, or the dataset root directory (holding ``train/`` and
            ``val/``) for classify, as Ultralytics classification takes a directory. For semantic, data.yaml reads
            the PNG masks (``masks_dir``, ``label_mapping``); :data:`POLYGONS` beside it reads the same labels as
            YOLO polygons.

    Raises:
        ValueError: If ``task`` or ``variant`` is unknown, or the variant has no labels for ``task``.
    """
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}, expected one of {TASKS}")
    r = recipe(variant)
    if task not in (tasks := recipe_tasks(r)):
        raise ValueError(f"{variant} has no {task} labels, expected one of {tasks}")
    base = _cache_root(root) / dataset_name(r, variant)
    final = base / task
    if not final.is_dir():
        base.mkdir(parents=True, exist_ok=True)
        tmp = base / f".{task}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp"  # unique to this call
        tmp.mkdir()
        try:
            if task == "classify":
                _write_classify(r, tmp)
            else:
                _write_scenes(r, task, tmp, final, variant)
            try:
                os.rename(tmp, final)  # atomic; fails if a concurrent caller got there first
            except OSError:
                if not final.is_dir():
                    raise
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    return final if task == "classify" else final / "data.yaml"


def dataset_name(r: dict[str, Any], variant: str = DEFAULT_VARIANT) -> str:
    """Return the directory name for a recipe: ``<variant>-v<version>-<8 hex digits of its content hash>``.

    Args:
        r (dict[str, Any]): A recipe, as returned by :func:`recipe`.
        variant (str): The variant the recipe belongs to.

    Returns:
        (str): The dataset directory name.
    """
    digest = hashlib.sha256(json.dumps(r, sort_keys=True, default=str).encode()).hexdigest()[:8]
    return f"{variant}-v{r['version']}-{digest}"


def _recipe_path(variant: str = DEFAULT_VARIANT) -> Path:
    """The recipe file of a variant, in an installed wheel or a source checkout."""
    if variant not in VARIANTS:
        raise ValueError(f"unknown dataset variant {variant!r}, expected one of {VARIANTS}")
    return data_file("datasets", f"{variant}.yaml")


def _cache_root(root: str | Path | None) -> Path:
    """Resolve the cache root from the argument, ``$YOLO_CKPT_DATASETS`` or the default."""
    root = root or os.environ.get("YOLO_CKPT_DATASETS") or Path.home() / ".cache" / "yolo_ckpt" / "datasets"
    return Path(root).expanduser().resolve()


# Scenes: detect, segment, obb, pose ---------------------------------------------------------------------------------


def _write_scenes(r: dict[str, Any], task: str, out: Path, final: Path, variant: str) -> None:
    """Write images, labels and data.yaml for one scene task into ``out`` (which will be renamed to ``final``)."""
    names = {int(k): v for k, v in r["names"].items()}
    for split_idx, split in enumerate(("train", "val")):
        (out / "images" / split).mkdir(parents=True)
        for i in range(int(r[split])):
            stem = f"{split}_{i:04d}"
            rng = np.random.default_rng([int(r["seed"]), 0, split_idx, i])  # own stream per image
            objects = _scene(rng, r)
            if task != "depth":  # depth has no label rows, only its maps
                lines = [_label_line(o, "segment" if task == "semantic" else task, r) for o in objects]
                (out / "labels" / split).mkdir(parents=True, exist_ok=True)
                (out / "labels" / split / f"{stem}.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
            if task == "semantic":
                (out / MASKS_DIR / split).mkdir(parents=True, exist_ok=True)
                _write_png(out / MASKS_DIR / split / f"{stem}.png", _semantic_mask(r, objects))
            elif task == "depth":
                (out / "depth" / split).mkdir(parents=True, exist_ok=True)
                depth_rng = np.random.default_rng([int(r["seed"]), 2, split_idx, i])  # leaves the image stream alone
                _write_png(out / "depth" / split / f"{stem}.png", _depth_map(depth_rng, r, objects))
            image = out / "images" / split / f"{stem}.png"
            if not _link_sibling(final.parent, task, image.relative_to(out), image):
                _write_png(image, _render(rng, r, objects, int(r["imgsz"])))  # same rng, drawn after the layout

    data: dict[str, Any] = {"path": str(final), "train": "images/train", "val": "images/val", "names": names}
    if "channels" in r:  # Ultralytics reads it to load grayscale images and build a model with that many inputs
        data["channels"] = int(r["channels"])
    if task == "pose":
        kpts = list(r["keypoints"])
        data["kpt_shape"] = [len(kpts), int(r["kpt_dims"])]
        data["flip_idx"] = [int(x) for x in r["flip_idx"]]
        data["kpt_names"] = {k: list(kpts) for k in names}  # distinct lists: no YAML anchors
    if task == "depth":
        d = r["depth"]
        data.update(names={0: "depth"}, nc=1, depth_scale=d["scale"], max_depth=d["max_depth"])
    header = f"# {final.parent.name} ({task}), generated by yolo_ckpt.data.synthetic from {variant}.yaml; do not edit\n"
    if task == "semantic":  # polygons: Ultralytics appends the background class itself (add_polygon_background)
        _write_yaml(out / POLYGONS, header + "# YOLO polygon labels (labels/); data.yaml reads the PNG masks\n", data)
        data.update(masks_dir=MASKS_DIR, names={**names, len(names): "background"}, label_mapping=_label_mapping(r))
    _write_yaml(out / "data.yaml", header, data)


def _write_yaml(path: Path, header: str, data: dict[str, Any]) -> None:
    text = header + yaml.safe_dump(data, sort_keys=False, default_flow_style=None, allow_unicode=True)
    path.write_text(text, encoding="utf-8")


def _scene(rng: np.random.Generator, r: dict[str, Any]) -> list[dict[str, Any]]:
    """Lay out non-overlapping objects fully inside the image.

    Returns:
        (list[dict[str, Any]]): One dict per object: cls, shape, cx, cy, length, width, angle (radians), color.
    """
    size, nc = int(r["imgsz"]), len(r["names"])
    lo, hi = r["objects"]
    objects: list[dict[str, Any]] = []
    for _ in range(int(rng.integers(lo, hi + 1))):
        for _attempt in range(50):
            o = _object(rng, r, int(rng.integers(nc)), r["object_size"])
            rad = o["radius"]
            o["cx"], o["cy"] = rng.uniform(rad + 1, size - rad - 1, 2)
            if all(np.hypot(o["cx"] - p["cx"], o["cy"] - p["cy"]) > rad + p["radius"] + 2 for p in objects):
                objects.append(o)
                break
    return objects


def _object(rng: np.random.Generator, r: dict[str, Any], cls: int, size_range: list[int]) -> dict[str, Any]:
    """Draw the class-specific size, aspect, angle, colour and outline of one object (position left to the caller).

    The colour has one value per image channel (one for grayscale). A blob draws its outline after everything else,
    so recipes without blobs draw exactly the values they always did.
    """
    spec = r["shapes"][r["names"][cls]]
    length = float(rng.uniform(size_range[0], size_range[1]))
    width = length / float(rng.uniform(*spec["aspect"]))
    jitter = int(spec["jitter"])
    base = np.atleast_1d(spec["color"])
    color = np.clip(base + rng.integers(-jitter, jitter + 1, base.size), 0, 255)
    return {
        "cls": cls,
        "shape": spec["shape"],
        "length": length,
        "width": width,
        "angle": float(rng.uniform(0, 2 * np.pi)),
        "color": tuple(int(c) for c in color),
        "radius": 0.5 * float(np.hypot(length, width)),
        "outline": _blob(rng, float(spec["irregularity"])) if spec["shape"] == "blob" else _outline(spec["shape"]),
    }


def _blob(rng: np.random.Generator, irregularity: float) -> np.ndarray:
    """Return a random smooth outline in unit local coordinates, like a lesion's margin.

    A circle whose radius wobbles with harmonics 2-4 of random phase, scaled so its farthest point lies on the circle
    of radius 0.5: inside the unit box, like the fixed shapes, so layout and labels treat it alike.

    Args:
        rng (np.random.Generator): The object's random stream.
        irregularity (float): Wobble amplitude in [0, 0.9): 0 is an ellipse; below 0.9 the radius stays positive, so
            the outline is star-shaped around the centre and never crosses itself.
    """
    if not 0 <= irregularity < 0.9:
        raise ValueError(f"blob irregularity {irregularity} must lie in [0, 0.9)")
    t = np.linspace(0, 2 * np.pi, _BLOB_POINTS, endpoint=False)
    k = np.arange(2, 5)[:, None]
    amp = irregularity * rng.uniform(0, 1, (3, 1)) / k  # weaker at higher frequency: smooth, not jagged
    radius = 1 + (amp * np.cos(k * t + rng.uniform(0, 2 * np.pi, (3, 1)))).sum(0)
    return 0.5 * (radius / radius.max())[:, None] * np.stack([np.cos(t), np.sin(t)], 1)


def _outline(shape: str) -> np.ndarray:
    """Return a shape's outline in unit local coordinates: x along the length (front = +0.5), y across (+-0.5)."""
    if shape == "rect":
        return np.array([[0.5, -0.5], [0.5, 0.5], [-0.5, 0.5], [-0.5, -0.5]])
    if shape == "ellipse":
        t = np.linspace(0, 2 * np.pi, _ELLIPSE_POINTS, endpoint=False)
        return 0.5 * np.stack([np.cos(t), np.sin(t)], 1)
    if shape == "hull":
        return np.array([[0.5, 0.0], [0.25, 0.5], [-0.5, 0.5], [-0.5, -0.5], [0.25, -0.5]])
    raise ValueError(f"unknown shape {shape!r}, expected rect, ellipse, hull or blob")


def _to_image(o: dict[str, Any], local: np.ndarray) -> np.ndarray:
    """Map unit local points (N, 2) of object ``o`` to image pixel coordinates (N, 2)."""
    pts = np.asarray(local, dtype=np.float64) * [o["length"], o["width"]]
    c, s = np.cos(o["angle"]), np.sin(o["angle"])
    return pts @ np.array([[c, s], [-s, c]]) + [o["cx"], o["cy"]]


def _label_line(o: dict[str, Any], task: str, r: dict[str, Any]) -> str:
    """Format one object as an Ultralytics label row for ``task`` (coordinates normalized to [0, 1])."""
    size = float(r["imgsz"])
    poly = _to_image(o, o["outline"]) / size
    if task == "segment":
        values = poly.ravel()
    elif task == "obb":
        values = (_to_image(o, _outline("rect")) / size).ravel()
    else:
        (x0, y0), (x1, y1) = poly.min(0), poly.max(0)
        values = np.array([(x0 + x1) / 2, (y0 + y1) / 2, x1 - x0, y1 - y0])
        if task == "pose":
            kpts = np.clip(_to_image(o, np.array(list(r["keypoints"].values()), dtype=np.float64)) / size, 0.0, 1.0)
            if int(r["kpt_dims"]) == 3:
                kpts = np.concatenate([kpts, np.full((len(kpts), 1), 2.0)], 1)  # 2 = labelled and visible
            values = np.concatenate([values, kpts.ravel()])
    return " ".join([str(o["cls"])] + [f"{v:.6f}" for v in np.clip(values, 0.0, 2.0)])  # objects lie inside the image


def _link_sibling(base: Path, task: str, rel: Path, dst: Path) -> bool:
    """Hard-link ``rel`` from a finished sibling scene task of the same recipe; return whether it worked."""
    for other in SCENE_TASKS:
        src = base / other / rel
        if other != task and src.is_file():
            try:
                os.link(src, dst)
                return True
            except OSError:
                return False  # e.g. no hard links on this filesystem: write the file instead
    return False


# Drawing ------------------------------------------------------------------------------------------------------------


def _background(rng: np.random.Generator, r: dict[str, Any], size: int) -> np.ndarray:
    """Ground or tissue: cubic-upsampled noise octaves, a linear gradient and fine grain (uint8, size x size x ch).

    Channels are BGR, or one (grayscale) for a recipe with ``channels: 1``. Octave cells are given per ``imgsz``
    pixels, so smaller images (classify) look like crops of the same ground.
    """
    bg, ch = r["background"], int(r.get("channels", 3))
    img = np.zeros((size, size, ch), np.float64) + np.asarray(bg["color"], np.float64)
    for cells, amp in bg["octaves"]:
        n = max(2, round(int(cells) * size / int(r["imgsz"])))
        grid = rng.standard_normal((n, n, 1)) + float(bg["tint"]) * rng.standard_normal((n, n, ch))
        # cv2.resize drops a single channel's axis: put it back
        img += float(amp) * cv2.resize(grid, (size, size), interpolation=cv2.INTER_CUBIC).reshape(size, size, ch)
    theta = rng.uniform(0, 2 * np.pi)
    ramp = (np.arange(size) / size - 0.5) * float(bg["gradient"])
    img += (np.cos(theta) * ramp[None, :] + np.sin(theta) * ramp[:, None])[..., None]
    grain = int(bg["grain"])
    if grain:
        img += rng.integers(-grain, grain + 1, img.shape)
    return np.clip(np.rint(img), 0, 255).astype(np.uint8)


def _fill(img: np.ndarray, pts: np.ndarray, color: tuple[int, ...]) -> None:
    """Fill a polygon given in float pixel coordinates, anti-aliased, at 1/16 pixel precision."""
    fixed = np.rint(pts * (1 << _SHIFT)).astype(np.int32)
    cv2.fillPoly(img, [fixed], color, lineType=cv2.LINE_AA, shift=_SHIFT)


def _draw(img: np.ndarray, o: dict[str, Any]) -> None:
    """Draw object ``o``: its labelled outline plus an interior detail that marks its front (a blob: a dark core)."""
    _fill(img, _to_image(o, o["outline"]), o["color"])
    dark = tuple(int(c * 0.45) for c in o["color"])
    if o["shape"] == "rect":  # windshield / roof edge band near the front
        detail = [[0.15, -0.4], [0.3, -0.4], [0.3, 0.4], [0.15, 0.4]]
    elif o["shape"] == "hull":  # cabin
        detail = [[-0.3, -0.25], [0.0, -0.25], [0.0, 0.25], [-0.3, 0.25]]
    elif o["shape"] == "blob":  # necrotic core: its own outline at half size, inside it as the outline is star-shaped
        detail = 0.5 * o["outline"]
    else:  # sunlit crown toward the front
        detail = 0.5 * _outline("ellipse") + [0.15, 0.0]
        dark = tuple(min(255, int(c * 1.4)) for c in o["color"])
    _fill(img, _to_image(o, np.asarray(detail, dtype=np.float64)), dark)


def _render(rng: np.random.Generator, r: dict[str, Any], objects: list[dict[str, Any]], size: int) -> np.ndarray:
    """Render a background and draw ``objects`` on it."""
    img = _background(rng, r, size)
    for o in objects:
        _draw(img, o)
    return img


def _write_png(path: Path, img: np.ndarray) -> None:
    """Write a lossless PNG, raising on failure (cv2.imwrite only returns False)."""
    if not cv2.imwrite(str(path), img, [cv2.IMWRITE_PNG_COMPRESSION, 3]):
        raise OSError(f"could not write {path}")


# Semantic masks and depth maps ----------------------------------------------------------------------------------------


def _label_mapping(r: dict[str, Any]) -> dict[int, int | str]:
    """Cityscapes-style ``label_mapping``: raw mask id -> training id (classes in ``names`` order, background last),
    and the recipe's unlabelled id -> ``ignore_label``."""
    sem, names = r["semantic"], {int(k): v for k, v in r["names"].items()}
    mapping: dict[int, int | str] = {int(sem["ids"][name]): k for k, name in names.items()}
    mapping[int(sem["background_id"])] = len(names)
    mapping[int(sem["unlabelled_id"])] = "ignore_label"
    return dict(sorted(mapping.items()))


def _semantic_mask(r: dict[str, Any], objects: list[dict[str, Any]]) -> np.ndarray:
    """Raw-id mask (uint8, imgsz x imgsz): each object's labelled outline filled with its class's raw id (not
    anti-aliased, at 1/16 pixel precision) on the background id."""
    sem, size = r["semantic"], int(r["imgsz"])
    mask = np.full((size, size), int(sem["background_id"]), np.uint8)
    for o in objects:
        fixed = np.rint(_to_image(o, o["outline"]) * (1 << _SHIFT)).astype(np.int32)
        cv2.fillPoly(mask, [fixed], int(sem["ids"][r["names"][o["cls"]]]), lineType=cv2.LINE_8, shift=_SHIFT)
    return mask


def _depth_map(rng: np.random.Generator, r: dict[str, Any], objects: list[dict[str, Any]]) -> np.ndarray:
    """Metric depth as Ultralytics reads it (uint16 PNG values = metres x ``scale``): the camera's distance to a tilted
    ground with smooth relief, less each object's height over its labelled outline (flat tops)."""
    d, size = r["depth"], int(r["imgsz"])
    grid = rng.standard_normal((4, 4))
    depth = float(d["distance"]) + float(d["relief"]) * cv2.resize(grid, (size, size), interpolation=cv2.INTER_CUBIC)
    theta = rng.uniform(0, 2 * np.pi)
    ramp = (np.arange(size) / size - 0.5) * float(d["tilt"])
    depth += np.cos(theta) * ramp[None, :] + np.sin(theta) * ramp[:, None]
    for o in objects:
        top = float(depth[int(o["cy"]), int(o["cx"])]) - float(rng.uniform(*d["heights"][r["names"][o["cls"]]]))
        fixed = np.rint(_to_image(o, o["outline"]) * (1 << _SHIFT)).astype(np.int32)
        cv2.fillPoly(depth, [fixed], top, lineType=cv2.LINE_8, shift=_SHIFT)
    scaled = np.rint(depth * float(d["scale"]))
    if scaled.min() < 1 or scaled.max() > np.iinfo(np.uint16).max:
        raise ValueError(f"depth {depth.min():.3f}-{depth.max():.3f} m does not fit uint16 at scale {d['scale']}")
    return scaled.astype(np.uint16)


# Classification -----------------------------------------------------------------------------------------------------


def _write_classify(r: dict[str, Any], out: Path) -> None:
    """Write ``train/<class>/*.png`` and ``val/<class>/*.png``: small images, each dominated by one object."""
    c = r["classify"]
    size = int(c["imgsz"])
    for split_idx, split in enumerate(("train", "val")):
        for cls, name in ((int(k), v) for k, v in r["names"].items()):
            (out / split / name).mkdir(parents=True)
            for i in range(int(c[split])):
                rng = np.random.default_rng([int(r["seed"]), 1, split_idx, cls, i])
                o = _object(rng, r, cls, c["object_size"])
                o["cx"], o["cy"] = size / 2 + rng.uniform(-0.1, 0.1, 2) * size
                _write_png(out / split / name / f"{name}_{i:03d}.png", _render(rng, r, [o], size))
