"""AutoBatch under ``compile=True``: the batch chosen from eager steps is confirmed by the run's compiled step, and
halved while that step passes the share less the loop's batches (``planning.compiled_batch``).

The reference for a compiled step is ``benchmarks/compiled_memory.py``'s own training step, its peak from torch's
profiler allocation records (validated against the exact tracker on eager steps in tests/test_compile.py), counted as
planning counts a step (model state, the batch, the step's peak); for an eager step, the exact tracker. The
partitioner is ``aot_eager_decomp_partition`` (inductor's partitioning without generating code: seconds to compile).
"""

import sys
from copy import deepcopy
from pathlib import Path

import pytest
import torch
from ultralytics.cfg import get_cfg
from ultralytics.nn.tasks import DetectionModel

from yolo_ckpt.memory.step import StepShape, batch_bytes, loop_bytes, planned_copy, state_bytes, step_bytes
from yolo_ckpt.planning import compiled
from yolo_ckpt.planning.compiled import CompiledCandidate
from yolo_ckpt.planning.compiled_batch import confirm_batch
from yolo_ckpt.planning.search import deepest
from yolo_ckpt.planning.units import NothingFits

from support import MINI

BACKEND = "aot_eager_decomp_partition"


def test_autobatch_batch_halves_until_its_compiled_step_fits(monkeypatch):
    """MINI's least-keeping plan keeps more compiled than eagerly at 64 px (the premise, measured below). With the
    share AutoBatch would fill at batch 8 from eager steps (the exact tracker's step there plus the loop's batches), the
    compiled step at 8 is over: the batch halves, and the batch returned fits compiled while twice it does not, both
    measured by the benchmark's step. Each batch tried is one compiled measurement, from 8 halving, counted. At batch 1
    with a share no step fits (the model's state alone) it stops after one measurement, with what batch 1 needs."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from compiled_memory import measure

    monkeypatch.setattr(compiled, "BACKEND", BACKEND)
    calls, real = [], compiled.compiled_step

    def counted(model, shape, candidate, backend=None):
        calls.append(shape.batch)
        return real(model, shape, candidate, backend)

    monkeypatch.setattr(compiled, "compiled_step", counted)
    torch.manual_seed(0)
    model = DetectionModel(deepcopy(MINI), verbose=False).train()
    model.args = get_cfg()
    least, shape, chosen = deepest(model), StepShape(64, 1), 8
    reference = {}

    def compiled_bytes(batch: int) -> int:  # the benchmark's compiled step, counted as planning counts a step
        if batch not in reference:
            row = measure(model, shape.at(batch), "least", compiled=True, budget=None, repeats=0, backend=BACKEND)
            reference[batch] = state_bytes(model) + batch_bytes(model, shape.at(batch)) + row.peak
        return reference[batch]

    with planned_copy(model, least) as m:
        eager = step_bytes(m, shape.at(chosen))
    share = eager + loop_bytes(model, shape.at(chosen))  # AutoBatch from eager steps takes batch 8 here
    assert compiled_bytes(chosen) > eager, (compiled_bytes(chosen), eager)  # the premise: compiled keeps more

    confirmed = confirm_batch(model, shape, chosen, share, CompiledCandidate(least))
    b = confirmed.batch
    assert 1 <= b < chosen and compiled_bytes(b) <= share - loop_bytes(model, shape.at(b)), (confirmed, reference)
    assert compiled_bytes(2 * b) > share - loop_bytes(model, shape.at(2 * b)), (confirmed, reference)
    assert calls == [chosen >> i for i in range(len(calls))] and calls[-1] == b, calls
    assert confirmed.chosen == chosen and f"halved to {b}, confirmed compiled" in confirmed.line()

    calls.clear()
    with pytest.raises(NothingFits) as error:
        confirm_batch(model, shape, 1, state_bytes(model), CompiledCandidate(least))
    assert calls == [1] and error.value.needed > state_bytes(model), error.value
    assert str(error.value).startswith("batch 1's compiled step"), error.value


def test_a_device_that_runs_out_sooner_halves_the_batch_instead_of_ending_the_run(monkeypatch):
    """A device that holds less than it said: the compiled probe at batch 8 and 4 runs out of memory (CUDA's error,
    raised where the device would), which counts as "over", so the batch halves to 2, whose compiled step fits; at
    batch 1 an out-of-memory error is one line (``NothingFits``), never the error itself."""
    monkeypatch.setattr(compiled, "BACKEND", BACKEND)
    real = compiled.compiled_step

    def small_device(model, shape, candidate, backend=None):
        if shape.batch >= 4:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 MiB")
        return real(model, shape, candidate, backend)

    monkeypatch.setattr(compiled, "compiled_step", small_device)
    model = DetectionModel(deepcopy(MINI), verbose=False).train()
    model.args = get_cfg()
    confirmed = confirm_batch(model, StepShape(64, 1), 8, 2**30, CompiledCandidate(deepest(model)))
    assert confirmed.batch == 2 and [m[1] for m in confirmed.measured][:2] == [None, None], confirmed
    assert "batch 8 out of memory" in confirmed.line() and "halved to 2" in confirmed.line()
    monkeypatch.setattr(compiled, "compiled_step", lambda *a, **k: (_ for _ in ()).throw(
        torch.OutOfMemoryError("CUDA out of memory")))
    with pytest.raises(NothingFits, match="ran out of the device's memory"):
        confirm_batch(model, StepShape(64, 1), 1, 2**30, CompiledCandidate(deepest(model)))


def test_autobatch_under_compile_trains_the_batch_confirmed_compiled(detect_data, tmp_path, monkeypatch):
    """A ``compile=True`` run with ``batch=-1``, a fixed plan (MINI's least-keeping) and ``memory_budget``: AutoBatch's
    batch from eager steps is over compiled, so the run halves it; the log says so in one line, each batch tried one
    compiled measurement (counted), and the run trains at the batch confirmed (the training loader's batch, args.yaml).
    Ultralytics' ``attempt_compile`` and planning both compile with ``aot_eager_decomp_partition``."""
    import logging
    import re

    import ultralytics.engine.trainer as engine
    import yaml
    from ultralytics.utils import LOGGER

    from yolo_ckpt import YOLO

    from support import TRAIN_ARGS

    monkeypatch.setattr(compiled, "BACKEND", BACKEND)
    monkeypatch.setattr(engine, "attempt_compile", lambda m, device, mode: torch.compile(m, backend=BACKEND))
    calls, real = [], compiled.compiled_step

    def counted(model, shape, candidate, backend=None):
        calls.append(shape.batch)
        return real(model, shape, candidate, backend)

    monkeypatch.setattr(compiled, "compiled_step", counted)
    path = tmp_path / "yolo11-mini.yaml"
    path.write_text(yaml.safe_dump(MINI, sort_keys=False))
    keys = deepest(DetectionModel(deepcopy(MINI), verbose=False)).keys()
    lines, loaders = [], []
    handler = logging.Handler()
    handler.emit = lambda r: lines.append(r.getMessage())
    model = YOLO(str(path))
    model.add_callback("on_train_start", lambda t: loaders.append(t.train_loader.batch_size))
    LOGGER.addHandler(handler)
    try:
        model.train(data=detect_data, project=str(tmp_path), name="run", **{
            **TRAIN_ARGS, "epochs": 1, "imgsz": 64, "val": False, "compile": True, "deterministic": False,
            "batch": -1, "memory_budget": "15MB", **keys})
    finally:
        LOGGER.removeHandler(handler)
    (eager,) = [int(m.group(1)) for x in lines if "AutoBatch" in x and (m := re.search(r"batch (\d+) with ", x))]
    (said,) = [x for x in lines if "confirmed compiled" in x]
    halved = int(re.search(r"halved to (\d+), confirmed compiled", said).group(1))
    assert halved < eager and calls == [eager >> i for i in range(len(calls))] and calls[-1] == halved, (said, calls)
    saved = yaml.safe_load((tmp_path / "run" / "args.yaml").read_text())
    assert saved["batch"] == loaders[0] == halved, (saved["batch"], loaders, said)
