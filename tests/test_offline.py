"""``YOLO_OFFLINE=1``: no run of ours resolves a host name or opens a connection (a socket audit hook proves it).

Each command runs in a fresh interpreter with ``sys.addaudithook`` recording every ``socket.getaddrinfo``,
``socket.gethostbyname`` and ``socket.connect`` event, and with an empty Ultralytics config dir
(``YOLO_CONFIG_DIR``), as on a fresh machine where Ultralytics has never downloaded its plotting font.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

AUDITED = """
import json, sys
calls = []
def hook(event, args):
    if event in ("socket.getaddrinfo", "socket.gethostbyname", "socket.connect"):
        calls.append([event, repr(args)[:200]])
sys.addaudithook(hook)
try:
    rc = RUN
finally:
    open(OUT, "w").write(json.dumps(calls))
sys.exit(rc)
"""
CLI = "__import__('yolo_ckpt.integration.cli').integration.cli.main(sys.argv[1:])"


def network_calls(tmp_path: Path, *args: str, run: str = CLI) -> list:
    """Run ``yolo-ckpt *args`` (or the expression ``run``) audited, offline; return the network events it raised."""
    out = tmp_path / "calls.json"
    env = {**os.environ, "YOLO_OFFLINE": "1", "YOLO_CONFIG_DIR": str(tmp_path / "config"),
           "PYTHONPATH": str(Path(__file__).parents[1])}
    code = AUDITED.replace("RUN", run).replace("OUT", repr(str(out)))
    done = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=600, env=env,
                          cwd=tmp_path)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def trained(detect_data, tmp_path_factory):
    """An audited one-epoch training run; its ``best.pt`` is what the val run validates."""
    tmp = tmp_path_factory.mktemp("offline")
    calls = network_calls(tmp, "train", f"data={detect_data}", "imgsz=64", "batch=2", "epochs=1", "workers=0",
                          "fraction=0.25", "checkpoint_stages=[2,3]", f"project={tmp}", "name=r")  # two steps
    return calls, tmp / "r" / "weights" / "best.pt"


def test_train_makes_no_network_call(trained):
    calls, best = trained
    assert best.is_file() and calls == []


def test_val_handed_to_yolo_makes_no_network_call(trained, detect_data, tmp_path):
    calls = network_calls(tmp_path, "val", f"model={trained[1]}", f"data={detect_data}", "imgsz=64", "batch=2",
                          f"project={tmp_path}", "name=v")
    assert calls == [] and (tmp_path / "v").is_dir()


def test_profile_makes_no_network_call(tmp_path):
    micro = tmp_path / "micro.yaml"  # three stages and a head: 30 plans to measure, seconds at 64 px
    micro.write_text(yaml.safe_dump({"nc": 4, "backbone": [[-1, 1, "Conv", [8, 3, 2]], [-1, 1, "Conv", [16, 3, 2]],
                                                           [-1, 1, "Conv", [16, 3, 2]]],
                                     "head": [[[2], 1, "Detect", ["nc"]]]}))
    assert network_calls(tmp_path, "profile", f"model={micro}", "imgsz=64", "batch=1", f"project={tmp_path}") == []
    assert (tmp_path / "profile" / "tradeoff.png").is_file()


def test_the_audit_sees_the_lookup_that_yolo_offline_alone_makes(detect_data, tmp_path):
    """The hook is not blind: Ultralytics' own dataset check, with YOLO_OFFLINE=1 but without our fonts, still looks
    its plotting font up on GitHub."""
    check = "__import__('ultralytics.data.utils').data.utils.check_det_dataset(sys.argv[1]) and 0"
    calls = network_calls(tmp_path, detect_data, run=check)
    assert any("github.com" in args for event, args in calls if event == "socket.getaddrinfo"), calls
