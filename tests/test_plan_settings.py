"""``PlanSettings``: one value for a plan, whatever spelling the keys came in, that says itself in the keys the CLI
reads back, and installs the regions ``CheckpointPlan.from_spec`` resolves."""

import shlex

import numpy as np
import pytest
import torch

from yolo_ckpt.integration.cli import parse_train_args
from yolo_ckpt.memory.step import build_model
from yolo_ckpt.regions.install import checkpoint_mode, checkpoint_plan, disable_checkpointing
from yolo_ckpt.regions.loss.install import loss_checkpointing
from yolo_ckpt.regions.plan import CheckpointPlan
from yolo_ckpt.regions.recompute import Mode
from yolo_ckpt.regions.settings import PlanSettings
from yolo_ckpt.regions.spec import CheckpointConfigError

SPELLINGS = [  # each group: one plan, written the ways Python and the CLI take it
    [PlanSettings.of([2, 3]), PlanSettings.of((3, 2)), PlanSettings.of([3, 2], "FULL"),
     PlanSettings.from_keys({"checkpoint_stages": [2, 3], "checkpoint_mode": None})],
    [PlanSettings.of("all", "selective", "head"), PlanSettings.of(" ALL ", Mode.SELECTIVE, "Head")],
    [PlanSettings.of(3), PlanSettings.of([3])],
    [PlanSettings(), PlanSettings.of(None), PlanSettings.of([], layers=[])],
]


def test_every_spelling_of_a_plan_is_one_value():
    for group in SPELLINGS:
        assert len(set(group)) == 1, group  # equal and hashing alike: a plan is a dict key
    assert len({g[0] for g in SPELLINGS}) == len(SPELLINGS)
    assert PlanSettings.of([2, 3]) != PlanSettings.of([2, 3], loss="exact") != PlanSettings.of([2, 3], loss="none")


@pytest.mark.parametrize("plan", [
    PlanSettings.of([2, 3]), PlanSettings.of("all", "selective", "head"), PlanSettings(),
    PlanSettings.of([1, 2], "full", [[13, 16], 22, "2.*:selective", "23.cv2.0"], "chunked"),
    PlanSettings.of([], "full", ["0-2", "2.*:selective", "3-4:selective", "10.*"]),
])
def test_a_plan_says_itself_in_keys_the_cli_reads_back(plan):
    """``str(plan)`` as a shell passes it to ``yolo-ckpt train`` (Ultralytics' own ``k=v`` parsing) is the same plan;
    so are its ``keys()`` as ``YOLO.train`` takes them."""
    args = parse_train_args(["train", *shlex.split(str(plan))])
    assert PlanSettings.from_keys(args).with_loss(plan.loss) == plan, (str(plan), args)
    assert PlanSettings.from_keys(plan.keys()) == plan


def test_a_plan_installs_what_from_spec_resolves():
    """Against the plan resolved from the raw keys (``CheckpointPlan.from_spec``): the same regions and mode
    installed, and the loss plan where the value has one."""
    model = build_model("yolo11n-seg.yaml")
    for plan in (PlanSettings.of([2, 3], "selective", [22, "23.*"]), PlanSettings.of("all", layers="head",
                                                                                      loss="exact")):
        plan.install(model)
        try:
            raw = plan.keys()
            expected = CheckpointPlan.from_spec(model, raw["checkpoint_stages"], raw["checkpoint_layers"] or None)
            assert checkpoint_plan(model) == expected and checkpoint_mode(model) == plan.mode
            assert loss_checkpointing(model) == plan.loss
        finally:
            disable_checkpointing(model)


PYTHON_SPELLINGS = [  # (Python value, the command line's token): the same meaning
    ("checkpoint_stages", range(2, 4), "[2,3]"),
    ("checkpoint_stages", np.array([2, 3]), "[2,3]"),
    ("checkpoint_stages", torch.tensor([3, 2]), "[3,2]"),
    ("checkpoint_stages", np.int64(3), "3"),
    ("checkpoint_stages", (3, 2), "(3,2)"),
    ("checkpoint_stages", "[2, 3]", "[2,3]"),
    ("checkpoint_stages", " All ", "all"),
    ("checkpoint_layers", np.array([13, 16]), "[13,16]"),
    ("checkpoint_layers", [np.int64(13), "16:selective"], "[13,'16:selective']"),
    ("checkpoint_layers", [[np.int64(13), 15], 22], "[[13,15],22]"),
]
REFUSED = [  # neither accepts these: the same one line
    ("checkpoint_stages", np.float64(2.5), "2.5"),
    ("checkpoint_stages", np.array([2, 2]), "[2,2]"),
    ("checkpoint_stages", range(0, 2), "[0,1]"),
    ("checkpoint_layers", [np.array([16, 13])], "[[16,13]]"),  # a range that ends before it starts
]


@pytest.mark.parametrize("key,value,token", PYTHON_SPELLINGS)
def test_python_spellings_mean_what_the_command_line_means(key, value, token):
    """numpy and torch integers and arrays, ranges, tuples and strings holding lists: the plan Python's value makes is
    the plan the command line's token makes (read by ``yolo-ckpt train``'s own parser), resolved on the model."""
    cli = parse_train_args(["train", f"{key}={token}"])
    python, command = PlanSettings.from_keys({key: value}), PlanSettings.from_keys(cli)
    assert python == command and hash(python) == hash(command)
    model = build_model("yolo11n.yaml")
    assert python.resolve(model) == command.resolve(model)


@pytest.mark.parametrize("key,value,token", REFUSED)
def test_what_neither_accepts_is_the_same_one_line(key, value, token):
    from yolo_ckpt.integration.settings import check_settings

    def line(v) -> str:
        with pytest.raises(CheckpointConfigError) as e:
            check_settings("yolo11n.yaml", {key: v})
        return str(e.value)

    assert line(value) == line(parse_train_args(["train", f"{key}={token}"])[key]) and "\n" not in line(value)
