"""A training script the torchrun tests launch: ``torchrun ... tests/torchrun_train.py '<json>'``.

The JSON holds ``trainer`` (``ckpt``: yolo-ckpt's detection trainer; ``vanilla``: Ultralytics' own with only the
torchrun hooks), ``model``, ``extra`` (``"alloc_rank": r`` holds 512 MiB more on rank ``r`` during every training
batch; ``"fail_rank": r`` makes rank ``r`` alone raise as training starts) and the training arguments. Every rank
counts its layers' forwards and writes its final training model (``support.COUNTING``), and its own epoch peaks.
"""

import json
import sys
from pathlib import Path

import torch
import ultralytics
from ultralytics.utils import RANK

from support import TORCHRUN_TRAINERS, add_counting, validating_at

EXTRA = 2**29  # bytes rank `alloc_rank` holds during a batch: more than a whole step of these runs


def hold_extra(trainer) -> None:
    """``on_train_batch_start``: a 512 MiB tensor (never written, so no page is touched) alive while the epoch's meter
    runs, on this rank only: its peak, and no other, is at least 0.5 GB."""
    trainer.extra = torch.empty(EXTRA, dtype=torch.uint8)


def drop_extra(trainer) -> None:
    trainer.extra = None


def own_peaks(trainer) -> None:
    """``on_fit_epoch_end``: this rank's own peaks per epoch, for the test to compare with results.csv."""
    out = Path(trainer.save_dir)
    out.mkdir(parents=True, exist_ok=True)
    file = out / f"own_memory_rank{RANK}.json"
    epochs = json.loads(file.read_text()) if file.exists() else {}
    own = getattr(getattr(trainer, "run_memory", None), "epoch_own", None)
    epochs.setdefault(str(trainer.epoch), own)  # not the final validation's
    file.write_text(json.dumps(epochs))


def fail_here(trainer) -> None:
    """``on_train_start``: this rank alone fails, as a node missing its data would, while the others train on."""
    raise RuntimeError(f"rank {RANK} fails alone (raised by the test)")


def main(spec: dict) -> None:
    model = ultralytics.YOLO(spec.pop("model"))
    add_counting(model)
    extra = spec.pop("extra", {})
    if extra.get("alloc_rank") == RANK:
        model.add_callback("on_train_batch_start", hold_extra)
        model.add_callback("on_train_batch_end", drop_extra)
    if extra.get("fail_rank") == RANK:
        model.add_callback("on_train_start", fail_here)
    model.add_callback("on_fit_epoch_end", own_peaks)
    trainer = TORCHRUN_TRAINERS[spec.pop("trainer")]
    if extra.get("val_batch"):  # vanilla's validator at the batch a planned run gave its own
        trainer = validating_at(trainer, extra["val_batch"])
    model.train(trainer=trainer, **spec)


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
