"""Tests for yolo_ckpt.data.synthetic: determinism, label validity, Ultralytics acceptance, caching and atomicity,
for the aerial dataset, its grayscale medical variant and its dense (crowded) variant."""

from __future__ import annotations

import os
from pathlib import Path

import cv2
import numpy as np
import pytest
import torch
import yaml

from yolo_ckpt.data import synthetic
from yolo_ckpt.data.synthetic import (
    DEFAULT_VARIANT,
    SCENE_TASKS,
    TASKS,
    VARIANTS,
    dataset_name,
    recipe,
    recipe_tasks,
    synthetic_dataset,
)

REPO = Path(__file__).resolve().parents[1]
COLUMNS = {"detect": 5, "obb": 9}  # fixed label row widths; segment and pose are checked separately
MEDICAL = "synthetic_medical"
CROWDED = "synthetic_dense"
# (variant, task) for every scene task each variant labels
BOXES = ("detect", "segment", "obb", "pose")  # scene tasks with object label rows (semantic and depth: own tests)
SCENES = [pytest.param(v, t, id=f"{v}-{t}") for v in VARIANTS for t in recipe_tasks(recipe(v)) if t in BOXES]
SEMANTIC = [pytest.param(v, id=v) for v in VARIANTS if "semantic" in recipe_tasks(recipe(v))]
DEPTH = [pytest.param(v, id=v) for v in VARIANTS if "depth" in recipe_tasks(recipe(v))]


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    """One cache root with every task generated once."""
    r = tmp_path_factory.mktemp("root_a")
    for task in TASKS:
        synthetic_dataset(task, r)
    return r


def _every_task(tmp_path_factory, variant: str) -> Path:
    """A fresh cache root with every task ``variant`` labels generated once."""
    r = tmp_path_factory.mktemp(f"root_{variant}")
    for task in recipe_tasks(recipe(variant)):
        synthetic_dataset(task, r, variant=variant)
    return r


@pytest.fixture(scope="module")
def medical_root(tmp_path_factory) -> Path:
    """The grayscale medical variant, every task."""
    return _every_task(tmp_path_factory, MEDICAL)


@pytest.fixture(scope="module")
def crowded_root(tmp_path_factory) -> Path:
    """The dense aerial variant, every task."""
    return _every_task(tmp_path_factory, CROWDED)


def _root(request, variant: str) -> Path:
    """The module's cache root of a variant (generated on first use by a test that needs it)."""
    return request.getfixturevalue({MEDICAL: "medical_root", CROWDED: "crowded_root"}.get(variant, "root"))


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    """Ultralytics must not try the network."""
    monkeypatch.setenv("YOLO_OFFLINE", "1")


def _files(base: Path) -> dict[str, Path]:
    """Generated files under base (ignoring caches Ultralytics writes next to labels), keyed by relative path."""
    return {
        str(p.relative_to(base)): p
        for p in sorted(base.rglob("*"))
        if p.is_file() and p.suffix in {".png", ".txt", ".yaml"}
    }


def _task_dir(root: Path, task: str, variant: str = DEFAULT_VARIANT) -> Path:
    return root / dataset_name(recipe(variant), variant) / task


def _split_labels(root: Path, task: str, split: str, variant: str = DEFAULT_VARIANT) -> list[list[list[float]]]:
    """Parse every label file of a split: per image, per object, the row as floats."""
    files = sorted((_task_dir(root, task, variant) / "labels" / split).glob("*.txt"))
    return [[[float(v) for v in line.split()] for line in f.read_text().splitlines()] for f in files]


def test_recipe_is_data_only():
    r = recipe()
    assert r["imgsz"] == 1024 and isinstance(r["version"], int)
    assert set(r["shapes"]) == set(r["names"].values())
    assert len(r["flip_idx"]) == len(r["keypoints"])
    assert not list((REPO / "datasets").glob("*.py")), "datasets/ must hold data only"
    assert synthetic._recipe_path().read_bytes() == (REPO / "datasets" / "synthetic_hr.yaml").read_bytes()
    assert sorted(p.stem for p in (REPO / "datasets").glob("*.yaml")) == sorted(VARIANTS)
    for variant in VARIANTS:
        assert synthetic._recipe_path(variant).read_bytes() == (REPO / "datasets" / f"{variant}.yaml").read_bytes()


def test_medical_recipe_is_grayscale():
    r = recipe(MEDICAL)
    assert r["channels"] == 1 and r["imgsz"] == 2048 and isinstance(r["version"], int)
    assert len(r["background"]["color"]) == 1 and all(len(s["color"]) == 1 for s in r["shapes"].values())
    assert set(r["shapes"]) == set(r["names"].values())
    assert recipe_tasks(r) == ("detect", "segment", "obb", "semantic", "depth") and recipe_tasks(recipe()) == TASKS
    assert dataset_name(r, MEDICAL).startswith("synthetic_medical-v1-") and dataset_name(r, MEDICAL) != dataset_name(r)


def test_dense_variant_crowds_every_tile_with_small_objects(crowded_root):
    """The scenes where the loss holds the memory: every tile has hundreds of objects (all the recipe draws were
    placed), each small, in detect, segment (polygons), obb and semantic labels of the same scenes."""
    r = recipe(CROWDED)
    assert recipe_tasks(r) == ("detect", "segment", "obb", "semantic") and r["imgsz"] == 1024
    lo, hi = r["objects"]
    assert lo >= 200 and r["object_size"][1] <= 32
    for split in ("train", "val"):
        boxes = _split_labels(crowded_root, "detect", split, CROWDED)
        assert len(boxes) == r[split] and all(lo <= len(rows) <= hi for rows in boxes), [len(b) for b in boxes]
        widest = max(max(row[3], row[4]) for rows in boxes for row in rows) * r["imgsz"]
        assert widest <= 2**0.5 * r["object_size"][1] + 1  # a rotated object's box: at most its diagonal
        assert [len(rows) for rows in _split_labels(crowded_root, "segment", split, CROWDED)] == [len(b) for b in boxes]


def test_unknown_variant_or_unlabelled_task(tmp_path):
    with pytest.raises(ValueError, match="unknown dataset variant 'ct'"):
        synthetic_dataset("segment", tmp_path, variant="ct")
    for task in ("pose", "classify"):  # the medical recipe has no keypoints and no classify section
        with pytest.raises(ValueError, match=f"synthetic_medical has no {task} labels"):
            synthetic_dataset(task, tmp_path, variant=MEDICAL)
    assert list(tmp_path.iterdir()) == []  # rejected before anything is written


def test_paths_returned(root):
    name = dataset_name(recipe())
    for task in SCENE_TASKS:
        assert synthetic_dataset(task, root) == root / name / task / "data.yaml"
    assert synthetic_dataset("classify", root) == root / name / "classify"
    with pytest.raises(ValueError):
        synthetic_dataset("panoptic", root)


def test_env_root(tmp_path, monkeypatch):
    monkeypatch.setenv("YOLO_CKPT_DATASETS", str(tmp_path))
    assert synthetic_dataset("classify") == tmp_path / dataset_name(recipe()) / "classify"


def test_byte_identical_regeneration(root, tmp_path):
    for task in reversed(TASKS):  # a different order: images get written by pose, not detect
        synthetic_dataset(task, tmp_path)
    a, b = _files(root), _files(tmp_path)
    assert a.keys() == b.keys()
    # scene images, semantic masks, depth maps, classify images
    assert sum(k.endswith(".png") for k in a) == len(SCENE_TASKS) * 24 + 24 + 24 + 2 * 4 * 8
    for rel in a:
        if rel.endswith(".yaml"):  # data.yaml and polygons.yaml hold the absolute root path; the rest must match
            ya, yb = yaml.safe_load(a[rel].read_text()), yaml.safe_load(b[rel].read_text())
            assert ya.pop("path") != yb.pop("path") and ya == yb
        else:
            assert a[rel].read_bytes() == b[rel].read_bytes(), rel


def test_recipe_change_gives_new_dir():
    r = recipe()
    changed = dict(r, seed=r["seed"] + 1)
    assert dataset_name(changed) != dataset_name(r)


def test_medical_byte_identical_regeneration(medical_root, tmp_path):
    """The grayscale variant regenerates byte for byte; its scene tasks share the same image bytes."""
    synthetic_dataset("segment", tmp_path, variant=MEDICAL)  # alone: its images are written, not linked
    r = recipe(MEDICAL)
    name = dataset_name(r, MEDICAL)
    a, b = _files(medical_root / name / "segment"), _files(tmp_path / name / "segment")
    assert a.keys() == b.keys() and sum(k.endswith(".png") for k in a) == r["train"] + r["val"]
    for rel in a:
        if rel != "data.yaml":  # holds the absolute root path
            assert a[rel].read_bytes() == b[rel].read_bytes(), rel
    for task in ("detect", "obb"):
        other = _files(medical_root / name / task)
        assert all(other[k].read_bytes() == a[k].read_bytes() for k in a if k.endswith(".png"))


def test_medical_images_are_single_channel(medical_root):
    r = recipe(MEDICAL)
    for task in recipe_tasks(r):
        data = yaml.safe_load(_task_dir(medical_root, task, MEDICAL).joinpath("data.yaml").read_text())
        assert data["channels"] == 1
    pngs = sorted(_task_dir(medical_root, "segment", MEDICAL).rglob("*.png"))
    assert len(pngs) == r["train"] + r["val"]
    for png in pngs:
        with open(png, "rb") as f:
            head = f.read(26)
        assert head[:8] == b"\x89PNG\r\n\x1a\n" and head[24:26] == bytes([8, 0]), png  # IHDR: 8-bit, grayscale
    img = cv2.imread(str(pngs[0]), cv2.IMREAD_UNCHANGED)
    assert img.shape == (r["imgsz"], r["imgsz"]) and img.dtype == np.uint8 and img.std() > 5  # not a flat image


@pytest.mark.parametrize("variant, task", SCENES)
def test_labels_parse_and_are_normalized(request, variant, task):
    root = _root(request, variant)
    r = recipe(variant)
    lo, hi = r["objects"]
    for split in ("train", "val"):
        images = sorted((_task_dir(root, task, variant) / "images" / split).glob("*.png"))
        labels = _split_labels(root, task, split, variant)
        assert len(images) == len(labels) == r[split]
        for rows in labels:
            assert lo // 2 <= len(rows) <= hi
            for row in rows:
                assert row[0] in range(len(r["names"]))
                if task == "segment":
                    assert len(row) % 2 == 1 and len(row) >= 7
                    assert cv2.contourArea(np.float32(row[1:]).reshape(-1, 2)) > 0  # a polygon, not a line
                elif task == "pose":
                    nkpt, ndim = len(r["keypoints"]), r["kpt_dims"]
                    assert len(row) == 5 + nkpt * ndim
                    assert all(v == 2 for v in row[5 + 2 :: ndim])  # visibility flags
                else:
                    assert len(row) == COLUMNS[task]
                assert all(0.0 <= v <= 1.0 for v in row[1:] if not (task == "pose" and v == 2))


def test_formats_agree(root):
    """The detect box is the bounding box of the segment polygon; pose boxes equal detect boxes."""
    for d, s, p in zip(*(_split_labels(root, t, "train") for t in ("detect", "segment", "pose"))):
        assert len(d) == len(s) == len(p)
        for rd, rs, rp in zip(d, s, p):
            poly = np.array(rs[1:]).reshape(-1, 2)
            (x0, y0), (x1, y1) = poly.min(0), poly.max(0)
            assert np.allclose(rd[1:], [(x0 + x1) / 2, (y0 + y1) / 2, x1 - x0, y1 - y0], atol=2e-6)
            assert rd == rp[:5] and rd[0] == rs[0]


@pytest.mark.parametrize("variant, images, min_checked, min_share", [
    (DEFAULT_VARIANT, 3, 20, 0.25), (MEDICAL, 4, 10, 0.25),
    (CROWDED, 1, 50, 0.15),  # 8-24 px objects: after erosion, anti-aliased edge pixels are a larger share
])
def test_labels_match_pixels(request, variant, images, min_checked, min_share):
    """Inside each labelled polygon, many pixels have the recipe colour (within jitter) of the labelled class, more
    than of any other class."""
    root = _root(request, variant)
    r = recipe(variant)
    size = r["imgsz"]
    task_dir = _task_dir(root, "segment", variant)
    checked = 0
    for img_file in sorted((task_dir / "images" / "val").glob("*.png"))[:images]:
        img = cv2.imread(str(img_file), cv2.IMREAD_UNCHANGED)  # BGR, or 2-D grayscale
        for row in _split_labels(root, "segment", "val", variant)[int(img_file.stem.split("_")[1])]:
            poly = np.array(row[1:]).reshape(-1, 2) * size
            mask = np.zeros(img.shape[:2], np.uint8)
            cv2.fillPoly(mask, [np.rint(poly).astype(np.int32)], 1)
            mask = cv2.erode(mask, np.ones((3, 3), np.uint8))
            if mask.sum() < 40:  # too small to judge after erosion
                continue
            inside = img[mask.astype(bool)].astype(int).reshape(int(mask.sum()), -1)  # pixels x channels
            share = {  # share of pixels that could be each class's body fill (the front detail is darker/lighter)
                name: np.all(np.abs(inside - spec["color"]) <= spec["jitter"], axis=1).mean()
                for name, spec in r["shapes"].items()
            }
            labelled = r["names"][int(row[0])]
            assert share[labelled] > min_share and max(share, key=share.get) == labelled, (img_file.name, row[0], share)
            checked += 1
    assert checked > min_checked


@pytest.mark.parametrize("variant, task", SCENES)
def test_ultralytics_accepts_scene_dataset(request, variant, task, tmp_path):
    from ultralytics.data.dataset import YOLODataset
    from ultralytics.data.utils import check_det_dataset

    r = recipe(variant)
    data = check_det_dataset(str(synthetic_dataset(task, _root(request, variant), variant)))
    assert data["nc"] == len(r["names"]) and data["names"] == r["names"]
    channels = r.get("channels", 3)
    assert data["channels"] == channels  # what the trainer builds the model with (ch=data["channels"])
    if task == "pose":
        assert data["kpt_shape"] == [len(r["keypoints"]), r["kpt_dims"]] and data["flip_idx"] == r["flip_idx"]
    for split in ("train", "val"):
        ds = YOLODataset(img_path=data[split], data=data, task=task, imgsz=256, augment=False)
        scan = ds.cache_labels(tmp_path / f"{split}.cache")  # Ultralytics' own per-file verification
        nf, nm, ne, nc, total = scan["results"]
        assert (nf, nm, ne, nc, total) == (r[split], 0, 0, 0, r[split]) and scan["msgs"] == []
        assert ds.channels == channels
        assert len(ds.labels) == r[split] and sum(len(lb["cls"]) for lb in ds.labels) > r[split] * r["objects"][0] // 2
        item = ds[0]
        assert item["img"].shape == (channels, 256, 256) and len(item["cls"]) > 0
        if task == "segment":
            assert item["masks"].any()
        if task == "pose":
            assert tuple(item["keypoints"].shape[1:]) == (len(r["keypoints"]), 3)


def test_ultralytics_accepts_classify_dataset(root):
    from ultralytics.data.utils import check_cls_dataset

    r = recipe()
    data = check_cls_dataset(str(synthetic_dataset("classify", root)))
    assert data["nc"] == len(r["names"]) and sorted(data["names"].values()) == sorted(r["names"].values())
    for split in ("train", "val"):
        for name in r["names"].values():
            files = sorted((data[split] / name).glob("*.png"))
            assert len(files) == r["classify"][split]
            assert cv2.imread(str(files[0])).shape == (r["classify"]["imgsz"],) * 2 + (3,)


def test_existing_dataset_is_reused(tmp_path):
    # classify: every task is reused by the same check (its directory exists), and classify's 64 small images
    # generate in a fraction of a scene task's 24 full-size tiles
    data = synthetic_dataset("classify", tmp_path)
    before = {p: p.stat().st_mtime_ns for p in data.rglob("*")}
    image = next(data.glob("train/*/*.png"))
    image.write_bytes(b"sentinel")  # a regeneration would overwrite this
    before[image] = image.stat().st_mtime_ns
    assert synthetic_dataset("classify", tmp_path) == data
    assert {p: p.stat().st_mtime_ns for p in data.rglob("*")} == before
    assert image.read_bytes() == b"sentinel"


def test_generation_is_atomic(tmp_path, monkeypatch):
    base = tmp_path / dataset_name(recipe())

    def boom(*args, **kwargs):
        raise RuntimeError("crash mid-generation")

    monkeypatch.setattr(synthetic, "_write_png", boom)
    with pytest.raises(RuntimeError):
        synthetic_dataset("classify", tmp_path)
    assert not any(base.iterdir()), "a failed generation must leave nothing behind"
    monkeypatch.undo()
    monkeypatch.setenv("YOLO_OFFLINE", "1")

    (tmp_path / "keep.txt").write_text("unrelated")
    synthetic_dataset("classify", tmp_path)
    synthetic_dataset("detect", tmp_path)
    assert sorted(p.name for p in base.iterdir()) == ["classify", "detect"]  # no temporary directories
    assert (tmp_path / "keep.txt").read_text() == "unrelated"


def test_concurrent_callers(tmp_path):
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(4) as pool:
        paths = list(pool.map(lambda _: synthetic_dataset("classify", tmp_path), range(4)))
    assert len(set(paths)) == 1 and len(list(paths[0].rglob("*.png"))) == 2 * 4 * 8
    assert [p.name for p in paths[0].parent.iterdir()] == ["classify"]


def test_images_shared_between_scene_tasks(root):
    """Scene tasks hold the same image bytes (hard-linked where the filesystem allows)."""
    rel = Path("images/train/train_0000.png")
    files = [_task_dir(root, t) / rel for t in SCENE_TASKS]
    assert len({f.read_bytes() for f in files}) == 1
    if hasattr(os, "link"):
        assert len({f.stat().st_ino for f in files}) in (1, len(files))


def _loaded(cls, data: dict, split: str, tmp_path: Path, task: str):
    """An Ultralytics dataset of ``cls`` over a split, with its own per-file scan, which must find everything."""
    ds = cls(img_path=data[split], data=data, task=task, imgsz=256, augment=False)
    nf, nm, ne, nc, total = ds.cache_labels(tmp_path / f"{cls.__name__}_{split}.cache")["results"]
    assert (nm, nc) == (0, 0) and nf == total == len(ds.labels) > 0, (cls.__name__, nf, nm, ne, nc, total)
    return ds


@pytest.mark.parametrize("variant", SEMANTIC)
def test_ultralytics_reads_semantic_masks_and_polygons(request, variant, tmp_path):
    """Both forms load through Ultralytics' own semantic datasets with the same classes, and Ultralytics'
    rasterization of the polygons agrees with the PNG masks after label_mapping."""
    from ultralytics.data.dataset import PolygonSemanticDataset, SemanticDataset
    from ultralytics.data.utils import add_polygon_background, check_det_dataset

    r = recipe(variant)
    masks_yaml = synthetic_dataset("semantic", _root(request, variant), variant)
    masks = check_det_dataset(str(masks_yaml))
    polygons = add_polygon_background(check_det_dataset(str(masks_yaml.parent / synthetic.POLYGONS)))
    nc = len(r["names"]) + 1  # the classes, then background
    assert masks["nc"] == polygons["nc"] == nc and masks["names"] == polygons["names"]
    assert masks["names"][nc - 1] == "background" and polygons["bg_class_idx"] == nc - 1
    assert masks["channels"] == polygons["channels"] == r.get("channels", 3)
    seen = set()
    for split in ("train", "val"):
        a = _loaded(SemanticDataset, masks, split, tmp_path, "semantic")
        b = _loaded(PolygonSemanticDataset, polygons, split, tmp_path, "semantic")
        assert a.im_files == b.im_files and len(a.im_files) == r[split]
        # full-resolution masks: a few images per split keep the test short; one of the dense set's, of its training
        # split only (Ultralytics rasterizes its 300 polygons a full-size mask each: 13 s an image)
        for i in range(3 if variant != CROWDED else 1 if split == "train" else 0):
            m = a.load_mask(i)  # training ids, at the image's native resolution
            p = b.load_mask(i, image_shape=m.shape)
            assert m.shape == (r["imgsz"],) * 2 and set(np.unique(m)) <= set(range(nc))
            assert (m == p).mean() > 0.99, (split, i, (m == p).mean())  # outlines differ by rasterization only
            seen |= set(np.unique(m).tolist())
        item = a[0]
        assert item["semantic_mask"].shape == (256, 256) and item["semantic_mask"].dtype == torch.int32
        assert item["img"].shape == (r.get("channels", 3), 256, 256)
    assert seen == set(range(nc)), seen  # every class and background occur


@pytest.mark.parametrize("variant", DEPTH)
def test_ultralytics_reads_depth_maps(request, variant, tmp_path):
    """Ultralytics' DepthDataset reads the uint16 maps in metres (``depth_scale``), and each labelled object is nearer
    to the camera than the ground around it by about its recipe height."""
    from ultralytics.data.dataset import DepthDataset
    from ultralytics.data.utils import check_det_dataset

    r = recipe(variant)
    d = r["depth"]
    root = _root(request, variant)
    data = check_det_dataset(str(synthetic_dataset("depth", root, variant)))
    assert data["depth_scale"] == d["scale"] and data["nc"] == 1 and data["channels"] == r.get("channels", 3)
    ds = _loaded(DepthDataset, data, "val", tmp_path, "depth")
    lowest = min(h[0] for h in d["heights"].values())
    labels = _split_labels(root, "segment", "val", variant)  # the same scenes' outlines
    checked = 0
    for i, rows in enumerate(labels[:2]):
        depth = ds._load_depth(i)
        assert depth.dtype == np.float32 and depth.shape == (r["imgsz"],) * 2
        assert 0 < depth.min() and depth.max() < d["max_depth"]
        for row in rows:
            inside = np.zeros(depth.shape, np.uint8)
            cv2.fillPoly(inside, [np.rint(np.array(row[1:]).reshape(-1, 2) * r["imgsz"]).astype(np.int32)], 1)
            ring = cv2.dilate(inside, np.ones((9, 9), np.uint8)) - cv2.dilate(inside, np.ones((5, 5), np.uint8))
            core = cv2.erode(inside, np.ones((3, 3), np.uint8)).astype(bool)
            if core.sum() < 20:
                continue
            assert np.median(depth[ring.astype(bool)]) - np.median(depth[core]) > 0.5 * lowest, (i, row[0])
            checked += 1
    assert checked >= 3
    item = ds[0]
    assert item["depth"].shape == (1, 256, 256) and item["depth"].dtype == torch.float32
