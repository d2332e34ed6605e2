"""The run directory a training run creates, and the one-line errors of DDP workers left in it.

A one-line error of ours (a plan or batch that cannot fit) removes the directory this run created, never one that
existed before; a worker of Ultralytics' DDP launcher leaves its line in the directory for the launching process,
which raises it as the run's one line.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path
from typing import Any, NoReturn

from ultralytics.cfg import get_save_dir
from ultralytics.utils import RANK

from ..regions.spec import CheckpointConfigError

WORKER_ERROR = "yolo_ckpt_error_rank{}.txt"  # each DDP worker's one-line error, for the launching process


def new_run_dir(args: Any) -> Path | None:
    """The run directory Ultralytics will create for ``args`` (``get_save_dir``, as ``BaseTrainer.__init__`` calls it
    next), or ``None`` when it exists already (``exist_ok=True``): only a directory this run creates is ever removed."""
    path = get_save_dir(args)
    return None if path.exists() else path


def remove_created_dir(trainer: Any) -> None:
    """Remove the run directory, if this run created it (never a pre-existing one, never on resume)."""
    created = getattr(trainer, "created_dir", None)
    if created is not None and Path(trainer.save_dir).resolve() == created:
        shutil.rmtree(created, ignore_errors=True)


def report_to_launcher(trainer: Any, error: CheckpointConfigError) -> NoReturn:
    """In a DDP worker: leave this rank's line where the launching process looks, and end the worker at once.

    ``os._exit``: a worker leaving Python normally after the error intermittently aborts in gloo's threads
    (``terminate called without an active exception``, SIGABRT: 2 of 8 runs under load with the process group
    destroyed first, torch 2.14.1), and the launcher then prints its own traceback. Every rank has raised the same
    line (rank 0 decided it), so no collective is left waiting; there is nothing of the worker's to clean up.
    """
    (Path(trainer.save_dir) / WORKER_ERROR.format(RANK)).write_text(str(error))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def reported_by_workers(trainer: Any) -> str | None:
    """In the launching process of DDP: the line the workers reported (their files are removed), or ``None``.

    Every rank stops with the line rank 0 decided (``memory_hooks.auto_plan`` broadcasts it), so all ranks report one
    line; where they do not, the line says what each rank reported, and which reported nothing."""
    files = {r: Path(trainer.save_dir) / WORKER_ERROR.format(r) for r in range(max(trainer.world_size, 1))}
    lines = {r: f.read_text() for r, f in files.items() if f.is_file()}
    for f in files.values():
        f.unlink(missing_ok=True)
    if not trainer.ddp or not lines:
        return None
    if len(set(lines.values())) == 1 and len(lines) == len(files):
        return next(iter(lines.values()))
    silent = [r for r in files if r not in lines]
    return "; ".join([*(f"rank {r}: {line}" for r, line in lines.items()),
                      *([f"ranks {silent} reported nothing"] if silent else [])])
