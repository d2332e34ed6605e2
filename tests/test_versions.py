"""The Ultralytics releases yolo-ckpt supports: pyproject.toml pins what ``yolo_ckpt.versions`` checks at import."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

from yolo_ckpt.versions import ULTRALYTICS_RANGE, check_ultralytics

ROOT = Path(__file__).resolve().parents[1]


def test_the_range_checked_is_the_range_pyproject_pins():
    pin = re.search(r'"ultralytics(>=[\d.]+,<[\d.]+)"', (ROOT / "pyproject.toml").read_text())
    assert pin.group(1) == ULTRALYTICS_RANGE == ">=8.4.162,<8.5"


@pytest.mark.parametrize("version", ["8.4.162", "8.4.190", "8.4.199rc1"])
def test_releases_inside_the_range_import(version):
    check_ultralytics(version)


@pytest.mark.parametrize("version", ["8.3.250", "8.4.161", "8.5.0", "9.0.0"])
def test_an_ultralytics_outside_the_range_stops_the_import_in_one_line(version):
    """Imported with that Ultralytics version, yolo-ckpt raises before any of its modules reads Ultralytics."""
    code = f"import ultralytics; ultralytics.__version__ = {version!r}; import yolo_ckpt"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 1
    assert out.stderr.strip().splitlines()[-1] == (
        f"ImportError: yolo-ckpt supports ultralytics>=8.4.162,<8.5, not {version}: "
        "pip install 'ultralytics>=8.4.162,<8.5'"), out.stderr[-2000:]
