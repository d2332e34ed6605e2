"""A plan or batch that cannot fit stops with one line and leaves no run directory behind (single process here; DDP
in ``test_ddp.py``).

These errors come after Ultralytics has created the run directory (AutoBatch and ``auto`` measure the model on its
device, inside ``_setup_train``), so the directory this run created is removed before the line is shown: a
pre-existing run is never touched and the next run gets the name this one would have had.
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from yolo_ckpt import YOLO, CheckpointConfigError

from support import MINI

NOTHING_FITS = {  # 160 px: yolo11n's model state alone (weights, EMA, gradients, two moments) is ~50 MB
    "AutoBatch, fixed": (["checkpoint_stages=all", "batch=-1", "memory_budget=50MB"], "batch 1 at imgsz=160 needs"),
    # auto measures the model's units and plans before it finds none fits: on support.MINI (3 checkpoint units, 14
    # plans), whose step at batch 1 needs more than 1 MB under every plan; yolo11n's made this case 6x the other
    "AutoBatch with auto": (["checkpoint_stages=auto", "batch=-1", "memory_budget=1MB", "model=MINI"],
                            "not even batch 1"),
}


def tree(root: Path) -> dict:
    return {str(p.relative_to(root)): p.read_bytes() if p.is_file() else None for p in sorted(root.rglob("*"))}


@pytest.mark.parametrize("case", NOTHING_FITS)
def test_cli_one_line_and_no_run_dir(case, detect_data, tmp_path):
    args, message = NOTHING_FITS[case]
    earlier = tmp_path / "runs" / "train"
    (earlier / "weights").mkdir(parents=True)
    (earlier / "results.csv").write_text("epoch\n1\n")
    if "model=MINI" in args:
        (tmp_path / "mini.yaml").write_text(yaml.safe_dump(MINI))
        args = [f"model={tmp_path / 'mini.yaml'}" if a == "model=MINI" else a for a in args]
    before = tree(tmp_path)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])}
    out = subprocess.run([sys.executable, "-m", "yolo_ckpt", "train", f"data={detect_data}", "imgsz=160",
                          "epochs=1", "workers=0", *args, f"project={tmp_path / 'runs'}", "name=train"],
                         capture_output=True, text=True, timeout=600, env=env)
    errors = [line for line in out.stderr.splitlines() if line.startswith("yolo-ckpt: error:")]
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-3000:]
    assert len(errors) == 1 and message in errors[0] and "\n" not in errors[0]
    created = Path(re.search(r"save_dir=([^,]+),", out.stdout)[1])  # Ultralytics made the next run directory ...
    assert created.parent == earlier.parent and created != earlier
    assert tree(tmp_path) == before  # ... and it is gone; the earlier run is untouched


def test_existing_run_dir_is_kept(detect_data, tmp_path):
    """With exist_ok=True the run writes into a directory it did not create: that one stays."""
    earlier = tmp_path / "train"
    earlier.mkdir()
    (earlier / "notes.txt").write_text("mine")
    with pytest.raises(CheckpointConfigError, match="batch 1 at imgsz=160 needs"):
        YOLO("yolo11n.yaml").train(data=detect_data, imgsz=160, epochs=1, workers=0, batch=-1, memory_budget="50MB",
                                   checkpoint_stages="all", project=str(tmp_path), name="train", exist_ok=True)
    assert (earlier / "notes.txt").read_text() == "mine" and sorted(p.name for p in tmp_path.iterdir()) == ["train"]
