"""Training launched by torch's own launcher: two nodes of one process each and one node of two, on localhost.

Every launch is ``torchrun --nnodes=N --node-rank=i --nproc-per-node=P --rdzv-backend=c10d --rdzv-endpoint=...`` (one
agent per node, as a SLURM or Kubernetes job starts them), on the CPU (gloo). The reference for each checkpointed
launch is the same launch of Ultralytics' own detection trainer with only yolo-ckpt's torchrun hooks
(``support.VanillaTorchrun``, no checkpointing code): every saved field equal, both ranks' final models identical,
and each rank's counted layer forwards show the recompute ran there.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from functools import cache
from pathlib import Path

import pytest
import torch
import yaml
from torchrun_train import EXTRA
from ultralytics.nn.tasks import DetectionModel

from yolo_ckpt import CheckpointConfigError
from yolo_ckpt.integration.distributed import Launch, check_batch, launch_device
from yolo_ckpt.integration.epoch_memory import most_of
from yolo_ckpt.memory.step import grad_bytes

from support import (
    MINI,
    TRAIN_ARGS,
    assert_plan_recomputed,
    assert_recomputed,
    assert_same,
    assert_same_run,
    auto_budget,
    forward_counts,
    results,
    val_batch,
)

pytestmark = [pytest.mark.xdist_group("ddp"), pytest.mark.usefixtures("one_launch_at_a_time")]  # one launch at a time

TESTS = Path(__file__).parent
SCRIPT = TESTS / "torchrun_train.py"
LAYOUTS = {"2 nodes x 1": (2, 1), "1 node x 2": (1, 2)}  # (nodes, processes per node): world size 2 either way
STAGES, LAYERS = [2, 3], {1, 2, 3, 4}  # yolo11n: stage 2 = layers 1-2, stage 3 = layers 3-4
ARGS = {**TRAIN_ARGS, "epochs": 2, "imgsz": 128, "save_period": 1}  # batch 4: 2 per rank; epoch0.pt for resume
TRAIN_IMAGES = 16  # the embedded detection set
BN_BUFFERS = ("running_mean", "running_var", "num_batches_tracked")
LAUNCH_TIMEOUT = 240  # s for one launch, start-up included; a hang fails the test instead of stalling CI


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(nodes: int, procs: int, argv: list[str], timeout: float = LAUNCH_TIMEOUT) -> list[tuple[int, str]]:
    """Start one torchrun agent per node on localhost (c10d rendezvous on a free port); return each agent's return
    code and output. Agents still running after ``timeout`` are killed with their workers, and the test fails."""
    port, env = free_port(), {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS.parent), str(TESTS)]),
                              "OMP_NUM_THREADS": "1", "YOLO_OFFLINE": "1"}
    agents = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", f"--nnodes={nodes}", f"--node-rank={i}",
                                f"--nproc-per-node={procs}", "--rdzv-backend=c10d",
                                f"--rdzv-endpoint=127.0.0.1:{port}", *argv],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                               start_new_session=True) for i in range(nodes)]
    deadline, outs = time.monotonic() + timeout, []
    try:
        for agent in agents:
            outs.append(agent.communicate(timeout=max(deadline - time.monotonic(), 1))[0])
    except subprocess.TimeoutExpired:
        for agent in agents:
            if agent.poll() is None:
                os.killpg(agent.pid, signal.SIGKILL)  # the agent's session: its workers too
        pytest.fail(f"a torchrun launch of {nodes} x {procs} did not end within {timeout} s", pytrace=False)
    return [(agent.returncode, out) for agent, out in zip(agents, outs)]


def train(layout: str, project: Path, name: str, trainer: str, **kw) -> tuple[Path, str]:
    """One launch of ``tests/torchrun_train.py``; return the run directory and the output of every node."""
    spec = {"trainer": trainer, "model": "yolo11n.yaml", **ARGS, "project": str(project), "name": name, **kw}
    done = torchrun(*LAYOUTS[layout], [str(SCRIPT), json.dumps(spec)])
    log = "\n".join(out for _, out in done)
    assert all(rc == 0 for rc, _ in done), log[-12000:]
    return project / name, log


@pytest.fixture(scope="module")
def launches(detect_data, tmp_path_factory):
    """Plain, checkpointed and ``auto`` launches per layout, each once for every test that needs it.

    ``auto``'s planning may lower its validator's batch (where Ultralytics' own would not fit the share); the plain
    and checkpointed launches then validate at that batch too (``support.validating_at``), so that the one plain
    launch is the reference of both (training is untouched), instead of a fourth launch, plain at Ultralytics' own
    validator batch, for the checkpointed one."""
    budget = auto_budget("yolo11n.yaml", detect_data, ARGS["imgsz"], ARGS["batch"] // 2, 0.8)  # vanilla won't fit,
    buckets = grad_bytes(DetectionModel("yolo11n.yaml", verbose=False))  # with DDP's gradient buckets on top
    budget = f"{int(budget[:-1]) + int(buckets / 0.6)}B"

    @cache
    def projects(layout: str) -> Path:  # runs differ only in name (a saved field), as in Ultralytics' own pairs
        return tmp_path_factory.mktemp(layout.replace(" ", ""), numbered=False)

    @cache
    def run(layout: str, name: str):
        project = projects(layout)
        at = ARGS["batch"] if name == "auto" else val_batch(run(layout, "auto")[0], 0)  # auto's validator batch
        val_at = {"val_batch": at} if at < ARGS["batch"] else {}  # Ultralytics': twice the per-rank batch
        kw = {"vanilla": {"trainer": "vanilla", "extra": val_at},
              "ckpt": {"trainer": "ckpt", "checkpoint_stages": STAGES, "extra": {"alloc_rank": 1, **val_at}},
              "auto": {"trainer": "ckpt", "checkpoint_stages": "auto", "memory_budget": budget}}[name]
        epochs = ARGS["epochs"] if layout == "2 nodes x 1" else 1  # two nodes: epoch0.pt is resumed
        return train(layout, project, name, data=detect_data, epochs=epochs, **kw)

    return run


def run_dirs(project: Path) -> list[str]:
    return sorted(p.name for p in project.iterdir() if p.is_dir())


# two nodes only: one node of two processes against plain DDP is test_ddp.py's pair, and trains under torchrun in
# test_the_cli_trains_under_torchrun (CI's 20 minutes)
@pytest.mark.parametrize("layout", ["2 nodes x 1"])
def test_checkpointed_launch_matches_plain_launch(launches, layout, tmp_path):
    (vanilla, _), (ckpt, log) = launches(layout, "vanilla"), launches(layout, "ckpt")
    assert "rank 0 of world size 2" in log and "batch 4 split 2 per rank" in log
    steps = math.ceil(math.ceil(TRAIN_IMAGES / 2) / 2) * len(results(vanilla))  # each rank's share, 2 a batch
    for rank in (0, 1):  # each rank recomputed the checkpointed stages, in every step of its share of the batch
        counts = forward_counts(vanilla, rank)
        assert min(counts) == max(counts) == steps
        assert_recomputed(counts, forward_counts(ckpt, rank), LAYERS)
    assert_same_run(vanilla, ckpt, ranks=(0, 1))
    # both ranks end with the same weights; BatchNorm statistics are each rank's own (Ultralytics' DDP does not sync
    # buffers, forward_sync_buffers=False), and every rank's equal the plain launch's rank (assert_same_run above)
    weights = [{k: v for k, v in torch.load(ckpt / f"model_rank{r}.pt").items() if not k.endswith(BN_BUFFERS)}
               for r in (0, 1)]
    assert_same(*weights, "weights of rank 0 vs rank 1")
    assert set(run_dirs(ckpt.parent)) <= {"vanilla", "ckpt", "auto"}  # one directory a launch (no "ckpt2")
    if layout == "2 nodes x 1":  # the weights load in plain Ultralytics, without yolo_ckpt, with its safe loader
        code = ("import sys; sys.modules['yolo_ckpt'] = None\nfrom ultralytics import YOLO\n"
                f"m = YOLO(r'{ckpt / 'weights' / 'best.pt'}')\nprint('OK', m.task, len(m.model.model))")
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                             env={**os.environ, "ULTRALYTICS_SAFE_LOAD": "1", "YOLO_OFFLINE": "1"}, cwd=tmp_path)
        assert out.returncode == 0 and "OK detect 24" in out.stdout, out.stderr[-2000:]


def test_auto_is_chosen_once_across_nodes_and_matches_plain_launch(launches):
    """Rank 0 plans for its share of the batch and broadcasts to the other node; both ranks install that plan and
    train as plain. (One node of two processes: ``test_ddp``'s ``auto`` run, whose workers train on this path.)"""
    auto, log = launches("2 nodes x 1", "auto")
    # the plain launch's validator at the batch planning gave ours (where Ultralytics' own would not fit the share)
    at, own = val_batch(auto, 0), ARGS["batch"]  # Ultralytics': twice the per-rank batch, batch // 2 on two ranks
    assert 1 <= at <= own
    vanilla, _ = launches("2 nodes x 1", "vanilla")
    assert val_batch(vanilla, 0) == at
    planned = [json.loads((auto / f"planned_rank{r}.json").read_text()) for r in (0, 1)]
    assert planned == [True, False] and log.count("auto: choosing the plan") == 1  # only rank 0 measured
    chosen = yaml.safe_load((auto / "args.yaml").read_text())
    assert chosen["checkpoint_stages"] != "auto" and (chosen["checkpoint_stages"] or chosen["checkpoint_layers"])
    assert_plan_recomputed("yolo11n.yaml", chosen["checkpoint_stages"], vanilla, auto,
                           chosen["checkpoint_layers"] or None, ranks=(0, 1))
    assert_same_run(vanilla, auto, ranks=(0, 1))


def test_memory_per_rank_results_carry_the_most_and_name_its_rank(launches):
    """Rank 1 holds 512 MiB more during every batch (``torchrun_train.hold_extra``): results.csv carries its peak,
    the maximum over ranks, and the console names it."""
    ckpt, log = launches("2 nodes x 1", "ckpt")
    own = [json.loads((ckpt / f"own_memory_rank{r}.json").read_text()) for r in (0, 1)]
    rows = results(ckpt)
    assert len(rows) == ARGS["epochs"]
    for epoch, row in enumerate(rows):
        peaks = [o[str(epoch)]["mem/peak_tensor_GB"] for o in own]
        assert peaks[1] >= EXTRA / 2**30 > peaks[0] > 0  # each rank measured its own process
        assert float(row["mem/peak_tensor_GB"]) == pytest.approx(max(peaks), abs=5e-5)  # csv rounds to 5 places
        assert f"epoch {epoch + 1} peak {peaks[1]:.3f} GB live tensor bytes (exact, CPU), rank 1 of 2" in log


@pytest.fixture(scope="module")
def resumed(launches, tmp_path_factory):
    """Resume the two-node runs after their first epoch under the same launch, and the checkpointed one in a single
    process. ``epoch0.pt`` holds what an interruption after that epoch leaves in ``last.pt`` (``save_model`` writes
    the same bytes to both), so no run is killed to get it; each resume writes a directory of its own."""
    project = tmp_path_factory.mktemp("resumed")
    weights, out = project / "interrupted" / "last.pt", {}  # one path: the resumed runs record it (model, resume)
    weights.parent.mkdir()
    for name in ("vanilla", "ckpt"):
        shutil.copy(launches("2 nodes x 1", name)[0] / "weights" / "epoch0.pt", weights)
        spec = {"trainer": name, "model": str(weights), "resume": True, "save_dir": str(project / name)}
        done = torchrun(*LAYOUTS["2 nodes x 1"], [str(SCRIPT), json.dumps(spec)])
        out[name] = "\n".join(o for _, o in done)
        assert all(rc == 0 for rc, _ in done), out[name][-12000:]
    spec = {"trainer": "ckpt", "model": str(weights), "resume": True, "save_dir": str(project / "single")}
    single = subprocess.run([sys.executable, str(SCRIPT), json.dumps(spec)], capture_output=True, text=True,
                            timeout=LAUNCH_TIMEOUT, env={**os.environ, "PYTHONPATH": str(TESTS.parent),
                                                         "OMP_NUM_THREADS": "1", "YOLO_OFFLINE": "1"})
    out["single"] = single.stdout + single.stderr
    assert single.returncode == 0, out["single"][-12000:]
    return project, out


def test_resume_under_the_same_launch_continues_plan_and_world_size(resumed):
    project, logs = resumed
    vanilla, ckpt = project / "vanilla", project / "ckpt"
    assert "Resuming training" in logs["ckpt"] and "resumed under world size" not in logs["ckpt"]
    assert "rank 0 of world size 2 (2 nodes x 1 process) on cpu, batch 4 split 2 per rank" in logs["ckpt"]
    assert [r["epoch"] for r in results(ckpt)] == ["2"]  # the second epoch only
    assert yaml.safe_load((ckpt / "args.yaml").read_text())["checkpoint_stages"] == STAGES  # restored from the file
    for rank in (0, 1):  # the saved plan, in the second epoch's share of each rank at 2 a batch
        counts = forward_counts(vanilla, rank)
        assert min(counts) == max(counts) == math.ceil(math.ceil(TRAIN_IMAGES / 2) / 2)
        assert_recomputed(counts, forward_counts(ckpt, rank), LAYERS)
    assert_same_run(vanilla, ckpt, ranks=(0, 1))


def test_resume_under_another_world_size_says_what_changes(resumed):
    project, logs = resumed
    lines = [line for line in logs["single"].splitlines() if "resumed under world size" in line]
    assert len(lines) == 1 and lines[0].endswith(
        "resumed under world size 1, trained under 2: the global batch 4 is now 4 per rank instead of 2 (learning "
        "rate, accumulation and checkpoint_stages=[2, 3] as saved)"), lines
    counts = forward_counts(project / "single")  # one process: the whole batch of 4, the saved plan
    steps = math.ceil(TRAIN_IMAGES / 4)
    assert_recomputed([steps] * len(counts), counts, LAYERS)  # every yolo11n layer runs once per plain forward


@pytest.mark.parametrize("layout, args, line", [
    # support.MINI (14 plans) in 1 MB, less than its step needs under any plan: rank 0 measures it in under half
    # yolo11n's time (each plan's step timed, as users' runs do)
    ("2 nodes x 1", ["checkpoint_stages=auto", "memory_budget=1MB", "model=MINI"],
     r"yolo-ckpt: error: checkpoint_stages=auto: nothing fits .* memory_budget=\d+MB would fit it"),
    ("1 node x 2", ["batch=-1"],
     r"yolo-ckpt: error: batch=-1 under torchrun: AutoBatch is single-process in Ultralytics\. Valid: the global "
     r"batch, a multiple of WORLD_SIZE=2 \(e\.g\. batch=16\), split over the ranks\."),
])
def test_a_failing_launch_stops_every_rank_with_one_line(detect_data, tmp_path, layout, args, line):
    """``python -m yolo_ckpt train`` under torchrun: nothing fits (decided by rank 0 after the run directory exists,
    broadcast) or bad input (every rank, before any work): every rank stops, rank 0 shows the line once, no worker
    prints a traceback, nothing is left in the project, and no launch hangs."""
    model = "model=yolo11n.yaml"
    if "model=MINI" in args:
        (tmp_path / "mini.yaml").write_text(yaml.safe_dump(MINI))
        model, args = f"model={tmp_path / 'mini.yaml'}", [a for a in args if a != "model=MINI"]
    argv = ["-m", "yolo_ckpt", "train", model, f"data={detect_data}", "imgsz=64", "epochs=1",
            "batch=4", "device=cpu", "workers=0", f"project={tmp_path / 'p'}", "name=r", *args]
    done = torchrun(*LAYOUTS[layout], argv, timeout=120)
    log = "\n".join(out for _, out in done)
    assert all(rc != 0 for rc, _ in done), log[-3000:]  # each agent reports its failed workers
    codes = re.findall(r"exitcode  : (-?\d+)", log)  # per rank: the CLI's error status, or the agent ended it
    assert "2" in codes and set(codes) <= {"2", str(-signal.SIGTERM)}, log[-3000:]
    ours = [x for x in log.splitlines() if "yolo-ckpt: error:" in x]
    assert len(ours) == 1 and re.search(line, ours[0]), ours
    assert "CheckpointConfigError" not in log and not re.search(r'File ".*[/\\]yolo_ckpt[/\\]', log)  # no traceback
    assert not (tmp_path / "p").exists() or run_dirs(tmp_path / "p") == []
    shutil.rmtree(tmp_path, ignore_errors=True)


def test_the_cli_trains_under_torchrun(detect_data, tmp_path):
    """``torchrun ... -m yolo_ckpt train`` as a user types it: both ranks train the plan to the end, into one run
    directory that rank 0 writes, with the epoch's memory of the rank that needed the most; the weights load in plain
    Ultralytics."""
    argv = ["-m", "yolo_ckpt", "train", "model=yolo11n.yaml", f"data={detect_data}", "imgsz=64", "epochs=1",
            "batch=4", "device=cpu", "workers=0", "plots=False", f"project={tmp_path / 'p'}", "name=r",
            "checkpoint_stages=[2,3]"]
    done = torchrun(*LAYOUTS["1 node x 2"], argv)
    log = "\n".join(out for _, out in done)
    assert all(rc == 0 for rc, _ in done) and "rank 0 of world size 2" in log, log[-3000:]
    assert run_dirs(tmp_path / "p") == ["r"]
    row = results(tmp_path / "p" / "r")[0]
    assert float(row["mem/peak_tensor_GB"]) > 0 and re.search(r"rank [01] of 2 \(the most", log), log[-3000:]
    assert yaml.safe_load((tmp_path / "p" / "r" / "args.yaml").read_text())["checkpoint_stages"] == STAGES
    code = ("import sys; sys.modules['yolo_ckpt'] = None\nfrom ultralytics import YOLO\n"
            f"print('OK', YOLO(r'{tmp_path / 'p' / 'r' / 'weights' / 'last.pt'}').task)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "ULTRALYTICS_SAFE_LOAD": "1", "YOLO_OFFLINE": "1"}, cwd=tmp_path)
    assert out.returncode == 0 and "OK detect" in out.stdout, out.stderr[-2000:]


def test_a_rank_failing_alone_ends_the_other_node(detect_data, tmp_path):
    """Rank 1 alone raises as training starts (as a node missing its data would): rank 0, on the other node, is not
    left waiting in its first gradient all-reduce; gloo reports the closed connection and both agents end."""
    spec = {"trainer": "ckpt", "model": "yolo11n.yaml", **ARGS, "epochs": 1, "imgsz": 64, "data": detect_data,
            "project": str(tmp_path), "name": "f", "checkpoint_stages": STAGES, "extra": {"fail_rank": 1}}
    (rc0, out0), (rc1, out1) = torchrun(*LAYOUTS["2 nodes x 1"], [str(SCRIPT), json.dumps(spec)], timeout=120)
    assert rc1 != 0 and "RuntimeError: rank 1 fails alone (raised by the test)" in out1, out1[-3000:]
    assert rc0 != 0 and "rank 1 fails alone" not in out0, out0[-3000:]  # node 0 ended because its peer did
    assert not survivors(str(tmp_path), within=30), "a worker outlived its agent"  # whichever agent held the store


def survivors(marker: str, within: float) -> list[int]:
    """Processes whose command line holds ``marker`` still alive after ``within`` seconds (killed, then listed)."""
    deadline = time.monotonic() + within
    while True:
        pids = [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit() and marker in cmdline(p)]
        if not pids or time.monotonic() > deadline:
            break
        time.sleep(1)
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    return pids


def cmdline(proc: Path) -> str:
    try:
        return (proc / "cmdline").read_bytes().decode(errors="replace")
    except OSError:  # ended meanwhile
        return ""


def test_launch_from_the_environment_and_what_it_rejects():
    """What torchrun's variables mean, and the one-line errors for a device or batch a launch cannot use."""
    env = {"WORLD_SIZE": "8", "RANK": "5", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4"}
    launch = Launch.from_env(env)
    assert launch == Launch(rank=5, local_rank=1, world_size=8, local_world_size=4) and launch.nodes == 2
    assert Launch.from_env({}) is None and Launch.from_env({**env, "WORLD_SIZE": "1"}) is None  # a single process
    assert launch_device("", launch) == torch.device("cuda", 1)  # cuda:LOCAL_RANK
    assert launch_device("4,5,6,7", launch) == torch.device("cuda", 5)  # the LOCAL_RANK-th of the list
    assert launch_device("cpu", launch) == torch.device("cpu")
    with pytest.raises(CheckpointConfigError, match=r"^device=0 under torchrun with 4 processes per node: .* Valid: "
                                                    r"4 indices \(device=0,1,2,3\)"):
        launch_device("0", launch)
    with pytest.raises(CheckpointConfigError, match=r"^batch=4 gives no image to some of the 8 ranks"):
        check_batch(4, launch)
    check_batch(8, launch)


def test_memory_of_ranks_is_the_most_of_each_column():
    nan = math.nan
    ranks = [{"a": 1.0, "b": nan}, {"a": 3.0, "b": 2.0}, {"a": nan, "b": 5.0}]
    peaks, top = most_of(ranks, ("a", "b"))
    assert peaks == {"a": 3.0, "b": 5.0} and top == 1  # the rank named is the first column's
    peaks, _ = most_of([{"a": nan}, {"a": nan}], ("a",))
    assert math.isnan(peaks["a"])  # measured by no rank: not a made-up figure
