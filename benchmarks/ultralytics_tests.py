"""Ultralytics' own training tests, offline, with Ultralytics' trainers and with yolo-ckpt's, side by side (issue 46).

Usage:
    python benchmarks/ultralytics_tests.py                    # every training test, both ways
    python benchmarks/ultralytics_tests.py -k "distill or test_task"   # a subset (pytest's -k)
    python benchmarks/ultralytics_tests.py --tests DIR        # another release's tests/ (an unpacked sdist's)

The tests are Ultralytics' own, as released (``benchmarks/ultralytics_suite/tests``, copied from the ultralytics
8.4.190 sdist on PyPI; the installed package's own ``tests/`` instead where its wheel ships them, as 8.4.162's does):
``tests/test_engine.py`` whole, and the tests of ``test_cli.py`` and ``test_python.py`` that train
(``ultralytics_suite/plugin.py``, ``TRAINING_TESTS``). Their assertions are untouched; what changes is where the data
and weights come from, and whose trainers train:

- offline: a settings file whose ``datasets_dir`` holds stand-ins for coco8, coco8-seg, coco8-pose, dota8,
  cityscapes8, depth8, imagenet10 and coco12-formats made from the project's embedded dataset, and whose
  ``weights_dir`` holds untrained checkpoints of the ``.pt`` names the tests load, built from Ultralytics' ``.yaml``
  models (``ultralytics_suite/offline.py``); nothing is downloaded;
- the two runs: each in its own pytest process, first with Ultralytics' trainers, then with yolo-ckpt's and
  ``checkpoint_stages=all`` (every task trainer the tests construct or a task map resolves, ``ultralytics.YOLO`` as
  ``yolo_ckpt.YOLO``, ``yolo`` on the command line as ``yolo-ckpt``; ``ultralytics_suite/plugin.py``).

Ours must really checkpoint: every run a test saves must say ``checkpoint_stages: all`` in its args.yaml, and a test
that trained must have recomputed regions in backward (counted in the test's process and in the ``yolo-ckpt``
processes it starts, ``ultralytics_suite/counting.py``); otherwise the test counts as failed, "vanilla".

Measured 2026-12-07 (ultralytics 8.4.190, torch 2.14.1, a shared 2-core CPU under other jobs, 1892 s for both runs):
Ultralytics' trainers 52 passed, 5 skipped (test_grayscale's exports, no onnx); ours 52 passed, 5 skipped, 0 vanilla.

Prints one table (Ultralytics' trainers, ours, the regions each training of ours recomputed, the runs it saved with
their ``checkpoint_stages``, the test) and a last line with both counts; exits 1 when a test that passes with
Ultralytics' trainers fails with ours or passes without checkpointing ("VANILLA"), 0 otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path

HERE = Path(__file__).resolve().parent
SUITE = HERE / "ultralytics_suite"
BUNDLED = SUITE / "tests"
BUNDLED_RELEASE = "8.4.190"  # the ultralytics release BUNDLED was copied from
MODES = ("ultralytics", "ours")
TEST_FILES = ("test_engine.py", "test_cli.py", "test_python.py")
MARK = {"passed": "pass", "failed": "FAIL", "skipped": "skip"}


def installed_tests() -> Path | None:
    """The ``tests/`` the installed ultralytics wheel ships (8.4.162's does, 8.4.190's not), else ``None``."""
    dist = metadata.distribution("ultralytics")
    engine = next((f for f in dist.files or () if str(f) == "tests/test_engine.py"), None)
    path = Path(dist.locate_file(engine)).parent if engine else None
    return path if path and (path / "test_engine.py").exists() else None


def tests_source(given: Path | None) -> tuple[Path, str]:
    """Where the tests come from, and a line saying so (with a warning when they are not the installed release's)."""
    version = metadata.version("ultralytics")
    if given:
        return given, f"tests: {given} (ultralytics {version} installed)"
    if shipped := installed_tests():
        return shipped, f"tests: ultralytics {version}'s own, shipped with the package ({shipped})"
    note = "" if version == BUNDLED_RELEASE else (f"; WARNING: ultralytics {version} is installed: copy its release's "
                                                 f"tests/ here, see ultralytics_suite/README.md")
    return BUNDLED, f"tests: ultralytics {BUNDLED_RELEASE}'s ({BUNDLED.relative_to(HERE.parent)}){note}"


def prepare(work: Path, source: Path) -> None:
    """The tests under ``work/tests``, a config directory per mode, the offline datasets and weights."""
    os.environ["YOLO_CONFIG_DIR"] = str(work / "config-ultralytics")  # before Ultralytics is first imported
    os.environ.setdefault("YOLO_OFFLINE", "1")
    os.environ.setdefault("YOLO_VERBOSE", "False")  # building the weights says nothing (not passed on to the tests)
    sys.path.insert(0, str(SUITE))
    import offline

    for mode in MODES:
        offline.write_config(work / f"config-{mode}", offline.settings(work, work / f"runs-{mode}"))
    offline.prepare(work)
    shutil.rmtree(work / "tests", ignore_errors=True)
    shutil.copytree(source, work / "tests", ignore=shutil.ignore_patterns("__pycache__", "tmp"))
    (work / "pytest.ini").write_text("[pytest]\n")  # this directory is the rootdir; no other configuration applies


def run_mode(work: Path, mode: str, keyword: str | None, verbose: bool, environ: dict) -> tuple[list[dict], float, int]:
    """One pytest run of the training tests with the mode's trainers (in ``environ``, the runner's environment as it
    started, plus the run's own settings): its records, seconds and exit status."""
    record = work / f"{mode}.jsonl"
    record.unlink(missing_ok=True)
    files = [f"tests/{f}" for f in TEST_FILES if (work / "tests" / f).exists()]
    cmd = [sys.executable, "-m", "pytest", "-p", "plugin", "-c", "pytest.ini", "--rootdir", ".", "-p",
           "no:cacheprovider", "--basetemp", str(work / f"tmp-{mode}"), "-q", "-rfEs", *files,
           *(["-k", keyword] if keyword else [])]
    env = {**environ, "YOLO_CONFIG_DIR": str(work / f"config-{mode}"), "YOLO_OFFLINE": "1",
           "ULTRALYTICS_SUITE_MODE": mode, "ULTRALYTICS_SUITE_RECORD": str(record),
           "PYTHONPATH": os.pathsep.join([str(SUITE), *filter(None, [environ.get("PYTHONPATH")])]),
           "PATH": os.pathsep.join([str(Path(sys.executable).parent), environ.get("PATH", "")])}
    env.pop("ULTRALYTICS_SUITE_COUNTS", None)
    start = time.time()
    with open(work / f"{mode}.log", "w") as log:
        status = subprocess.run(cmd, cwd=work, env=env, stdout=None if verbose else log, stderr=subprocess.STDOUT
                                if not verbose else None).returncode
    seconds = time.time() - start
    records = [json.loads(line) for line in record.read_text().splitlines()] if record.exists() else []
    return records, seconds, status


def vanilla(record: dict) -> str:
    """Why a passing test of ours did not checkpoint, or ``""``: a saved run without our stages, or a training that
    recomputed nothing."""
    if record["outcome"] != "passed":
        return ""
    if others := [r for r in record["runs"] if r["checkpoint_stages"] != "all"]:
        return f"{len(others)} run(s) with checkpoint_stages={others[0]['checkpoint_stages']!r}: {others[0]['args']}"
    if 0 in record["trainings"]:
        return f"{record['trainings'].count(0)} of {len(record['trainings'])} trainings recomputed no region"
    return ""


def mark(record: dict | None, ours: bool = False) -> str:
    """pass, FAIL, skip, VANILLA (ours passed without checkpointing), or - (did not run)."""
    if not record:
        return "-"
    return "VANILLA" if ours and vanilla(record) else MARK[record["outcome"]]


def table(theirs: dict[str, dict], ours: dict[str, dict]) -> tuple[list[str], list[str]]:
    """The side-by-side lines, and the tests that pass with Ultralytics' trainers but not with ours (each with why)."""
    lines = [f"{'Ultralytics':>11}  {'ours':>7}  {'recomputed':<16}  {'runs':<8}  test"]
    broken = []
    for t in dict.fromkeys([*theirs, *ours]):
        a, b = theirs.get(t), ours.get(t)
        recomputed = "+".join(map(str, b["trainings"])) if b and b["trainings"] else "-"
        stages = sorted({str(r["checkpoint_stages"]) for r in b["runs"]}) if b else []
        runs = f"{len(b['runs'])} ({','.join(stages)})" if stages else "-"
        lines.append(f"{mark(a):>11}  {mark(b, True):>7}  {recomputed:<16}  {runs:<8}  {t.removeprefix('tests/')}")
        if mark(a) == "pass" and mark(b, True) != "pass":
            broken.append(f"{t}: {(b and (vanilla(b) or b['why'])) or 'did not run'}")
    return lines, broken


def counts(records: dict[str, dict], ours: bool = False) -> str:
    """``N passed, N failed, N skipped`` (and ``N vanilla``: passed without checkpointing, counted apart)."""
    marks = [mark(r, ours) for r in records.values()]
    vanilla_runs = f", {marks.count('VANILLA')} vanilla" if ours else ""
    return f"{marks.count('pass')} passed, {marks.count('FAIL')} failed, {marks.count('skip')} skipped{vanilla_runs}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-k", dest="keyword", help="only the tests pytest's -k expression selects")
    parser.add_argument("--tests", type=Path, help="a release's tests/ directory instead of the bundled copy")
    parser.add_argument("--work", type=Path, help="working directory, kept (default: a temporary one, removed)")
    parser.add_argument("--json", type=Path, help="write both runs' records here")
    parser.add_argument("-v", "--verbose", action="store_true", help="show pytest's output instead of logging it")
    args = parser.parse_args(argv)

    environ = dict(os.environ)
    source, line = tests_source(args.tests)
    print(line, flush=True)
    work = args.work or Path(tempfile.mkdtemp(prefix="ultralytics-tests-"))
    work.mkdir(parents=True, exist_ok=True)
    start = time.time()
    try:
        prepare(work, source)
        results = {}
        for mode in MODES:
            records, seconds, status = run_mode(work, mode, args.keyword, args.verbose, environ)
            results[mode] = {r["test"]: r for r in records}
            print(f"{mode}: {len(records)} tests in {seconds:.0f} s (pytest exit {status}; log {work / mode}.log)",
                  flush=True)
        if args.json:
            args.json.write_text(json.dumps(results, indent=1))
    finally:
        if not args.work:
            shutil.rmtree(work, ignore_errors=True)
    lines, broken = table(results["ultralytics"], results["ours"])
    print("\n".join(lines))
    for b in broken:
        print(f"passes with Ultralytics' trainers, not with ours: {b}")
    if not results["ultralytics"] or not results["ours"]:
        broken.append("no test ran")
        print("no test ran in one of the modes: see its log (--work DIR keeps it, -v shows it)")
    print(f"Ultralytics' trainers: {counts(results['ultralytics'])}; ours (checkpoint_stages=all): "
          f"{counts(results['ours'], True)}; {len(broken)} pass with theirs and not with ours; "
          f"{time.time() - start:.0f} s")
    return 1 if broken else 0


if __name__ == "__main__":
    sys.exit(main())
