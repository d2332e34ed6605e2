"""The profiler's trade-off figures against independent measurement: every plan's step, the front, imgsz, state."""

from copy import deepcopy

import pytest
from ultralytics.cfg import get_cfg
from ultralytics.nn.tasks import DetectionModel

from yolo_ckpt.measure import state_bytes, step_bytes, with_plan
from yolo_ckpt.tradeoff import largest_imgsz, measure_candidates, untouchable

from support import SMALL

IMGSZ, BATCH = 128, 2


@pytest.fixture(scope="module")
def small():
    model = DetectionModel(deepcopy(SMALL), verbose=False).train()
    model.args = get_cfg()
    return model


@pytest.fixture(scope="module")
def rows(small):
    return measure_candidates(small, IMGSZ, BATCH)


def measured(small, row, imgsz=IMGSZ) -> int:
    m = with_plan(small, row["checkpoint_stages"], row["checkpoint_mode"], row["checkpoint_layers"] or None)
    return step_bytes(m, imgsz, BATCH)


def test_every_candidate_is_measured(small, rows):
    assert len(rows) == 1 + 62 and rows[0]["plan"] == "none" and rows[0]["peak_ratio"] == rows[0]["flops_ratio"] == 1
    assert len({(r["plan"], r["checkpoint_mode"]) for r in rows}) == len(rows)
    for r in (rows[0], rows[7], rows[-1], min(rows, key=lambda r: r["step_bytes"])):
        assert r["step_bytes"] == measured(small, r)


def test_pareto_front(rows):
    front = [r for r in rows if r["pareto"]]
    assert min(rows, key=lambda r: (r["flops"], r["step_bytes"]))["pareto"]  # the cheapest, and the smallest
    assert min(rows, key=lambda r: (r["step_bytes"], r["flops"]))["pareto"]
    for r in rows:  # every plan off the front is matched or beaten on both axes by one on it, and none on it is
        beaten = [f for f in front if f is not r and f["step_bytes"] <= r["step_bytes"] and f["flops"] <= r["flops"]]
        assert bool(beaten) != r["pareto"], r["plan"]
    assert all(r["time_ratio"] > 0 for r in front) and not any("time_ratio" in r for r in rows if not r["pareto"])


def test_largest_imgsz_fits(small, rows):
    row = min(rows, key=lambda r: r["step_bytes"])
    target = measured(small, row, 224)
    s = largest_imgsz(small, row, BATCH, target, IMGSZ)
    assert 192 <= s <= 256 and measured(small, row, s) <= target * 1.02  # a prediction from two measured sizes
    assert largest_imgsz(small, row, BATCH, 2 * target, IMGSZ) > s


def test_untouchable_memory(small):
    rows = {r["what"]: r["MiB"] for r in untouchable(small, IMGSZ, BATCH, objects=(10, 200))}
    state = rows["weights"] + rows["EMA copy"] + rows["optimizer (AdamW, 2 moments)"]
    assert state == pytest.approx(state_bytes(small) / 2**20, abs=0.2)  # what planning counts as model state
    assert rows["loss + assigner, 200 objects per image"] > rows["loss + assigner, 10 objects per image"] > 0
