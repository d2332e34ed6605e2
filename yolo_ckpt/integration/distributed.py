"""Training started by torch's own launcher (``torchrun``: the elastic agent SLURM and Kubernetes jobs run), any
number of nodes, CUDA (NCCL) or CPU (gloo).

Ultralytics starts its own single-node launcher from ``device=0,1,...`` and derives the world size from that
list; a process that ``torchrun`` started (``LOCAL_RANK`` set) runs ``_do_train`` itself, but ``_setup_ddp`` then
initialises a process group of the *local* device count with the *global* ``RANK`` (wrong on several nodes), pins the
device by the local list and forces CUDA. ``DistributedMixin`` reads the launcher's environment instead:

==============================  ==================================================================================
what                            from the launcher (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``)
==============================  ==================================================================================
process group                   joined as the trainer is built (env:// rendezvous), NCCL on CUDA, gloo on CPU
world size                      ``WORLD_SIZE``: the batch splits over every rank as Ultralytics splits it locally
device                          ``cuda:LOCAL_RANK`` (or the ``LOCAL_RANK``-th of a ``device=`` list), or the CPU
run directory                   chosen by global rank 0 and broadcast: one directory, written by rank 0 only
==============================  ==================================================================================

Everything else — samplers, the DDP wrap and its arguments, rank-0 saving, per-node dataset caching
(``torch_distributed_zero_first(LOCAL_RANK)``), validation — stays Ultralytics' own. A world Ultralytics derives
itself (its own launcher's workers on CUDA, ``device=0,1`` with as many processes on one node) is left to it.

Ultralytics has no CPU DDP: for ``device=cpu`` two of its calls name CUDA. They are redirected, for the duration of
that call only, in :func:`cpu_ddp_wrap` and :func:`cpu_final_validation` — the only private touches of this module.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from datetime import timedelta
from types import SimpleNamespace
from typing import Any
from unittest.mock import patch

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from ultralytics.cfg import get_save_dir
from ultralytics.utils import DEFAULT_CFG, LOGGER, RANK, colorstr
from ultralytics.utils.patches import torch_load
from ultralytics.utils.torch_utils import get_torch_device_backend

from ..memory.device import parse_device
from ..regions.spec import CheckpointConfigError

PREFIX = colorstr("torchrun:")
PARENT_ENV = "YOLO_CKPT_DDP_PARENT"  # set by a trainer of ours that starts Ultralytics' launcher, seen by its workers
TIMEOUT = timedelta(seconds=10800)  # as Ultralytics' _setup_ddp: rank 0 may cache a dataset while the others wait
WORLD_KEY = "world_size"  # recorded beside our settings in a saved model's args, for resume


@dataclass(frozen=True)
class Launch:
    """Where this process sits in a launch by ``torchrun`` (or Ultralytics' own launcher, which runs it)."""

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int

    @classmethod
    def from_env(cls, env: dict | None = None) -> Launch | None:
        """The launch in ``env`` (default ``os.environ``), or ``None`` for a single process (``WORLD_SIZE`` unset or
        1, as Ultralytics' own ``RANK``/``LOCAL_RANK`` constants read it)."""
        env = os.environ if env is None else env
        world = int(env.get("WORLD_SIZE", "1"))
        if world <= 1 or "LOCAL_RANK" not in env:
            return None
        local = int(env.get("LOCAL_WORLD_SIZE", world))
        return cls(int(env["RANK"]), int(env["LOCAL_RANK"]), world, local)

    @property
    def nodes(self) -> int:
        """Number of nodes, for log lines (every node runs ``LOCAL_WORLD_SIZE`` processes under ``torchrun``)."""
        return max(self.world_size // max(self.local_world_size, 1), 1)

    def describe(self) -> str:
        """``world size 4 (2 nodes x 2 processes)``."""
        return f"world size {self.world_size} ({self.nodes} node{'s' * (self.nodes > 1)} x {self.local_world_size} " \
               f"process{'es' * (self.local_world_size > 1)})"


def ultralytics_world(device: str) -> int:
    """The world size Ultralytics' trainer derives from ``device=`` (``BaseTrainer.__init__``): 0 on CPU/MPS,
    else the number of listed devices (1 when none is given)."""
    backend, indices = parse_device(device)
    return 0 if backend in {"cpu", "mps"} else max(len(indices), 1)


def from_ultralytics_launcher() -> bool:
    """Whether this process is a worker of Ultralytics' own launcher started by a trainer of ours (its parent waits for
    the workers and shows their one-line error)."""
    return os.environ.get(PARENT_ENV) == "1"


def launch_device(device: str, launch: Launch) -> torch.device:
    """This process's device under ``launch``: the CPU, ``cuda:LOCAL_RANK``, or the ``LOCAL_RANK``-th of a list.

    Raises:
        CheckpointConfigError: For a device that cannot hold one process per local rank.
    """
    backend, indices = parse_device(device)
    if backend == "cpu":
        return torch.device("cpu")
    if backend not in {"", "cuda"}:
        raise CheckpointConfigError(f"device={device} under torchrun: yolo-ckpt runs torchrun launches on CUDA (NCCL) "
                                    f"or the CPU (gloo). Valid: device=cpu, a CUDA list, or no device.")
    if not indices:
        return torch.device("cuda", launch.local_rank)
    if len(indices) != launch.local_world_size:
        raise CheckpointConfigError(
            f"device={device} under torchrun with {launch.local_world_size} processes per node: each process needs its "
            f"own device. Valid: {launch.local_world_size} indices (device="
            f"{','.join(map(str, range(launch.local_world_size)))}), no device (cuda:LOCAL_RANK), or device=cpu.")
    return torch.device("cuda", indices[launch.local_rank])


def check_batch(batch: float, launch: Launch) -> None:
    """One line for a batch the launch cannot split (Ultralytics' launcher checks ``batch<1`` in its parent; under
    ``torchrun`` no such parent runs).

    Raises:
        CheckpointConfigError: For AutoBatch (``batch<1``) or fewer images than ranks.
    """
    if batch < 1:
        raise CheckpointConfigError(
            f"batch={batch} under torchrun: AutoBatch is single-process in Ultralytics. Valid: the global batch, a "
            f"multiple of WORLD_SIZE={launch.world_size} (e.g. batch={8 * launch.world_size}), split over the ranks.")
    if batch < launch.world_size:
        raise CheckpointConfigError(
            f"batch={batch} gives no image to some of the {launch.world_size} ranks. Valid: the global batch, at least "
            f"WORLD_SIZE={launch.world_size} (e.g. batch={8 * launch.world_size}).")


def join_process_group(device: torch.device, launch: Launch) -> bool:
    """Join the launch's process group (env:// rendezvous: ``MASTER_ADDR``/``MASTER_PORT`` from the launcher), NCCL on
    CUDA and gloo on the CPU; return whether this call created it."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
        os.environ.setdefault("TORCH_NCCL_BLOCKING_WAIT", "1")  # as Ultralytics: a timeout ends a stuck collective
    if dist.is_initialized():
        return False
    backend = "nccl" if device.type == "cuda" and dist.is_nccl_available() else "gloo"
    dist.init_process_group(backend, timeout=TIMEOUT, rank=launch.rank, world_size=launch.world_size)
    return True


def leave_process_group() -> None:
    """Destroy the process group, if any: one left alive can abort the process at exit."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def from_rank0(value: Any) -> Any:
    """Rank 0's ``value`` on every rank (``value`` of the others is ignored)."""
    box = [value if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, 0)
    return box[0]


def gather(value: Any) -> list[Any]:
    """Every rank's ``value``, in rank order (``[value]`` without a process group)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return [value]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def saved_world(ckpt: dict) -> int:
    """The world size a checkpoint was trained under (1 when none is recorded: a single process)."""
    model = ckpt.get("ema") or ckpt.get("model")
    args = getattr(model, "args", None) or {}
    args = args if isinstance(args, dict) else vars(args)
    return int(args.get(WORLD_KEY) or 1)


def resume_line(old: int, new: int, batch: int, plan: str) -> str | None:
    """What a resume under another world size changes (``None`` when it is the same)."""
    old, new = max(old, 1), max(new, 1)
    if old == new:
        return None
    return (f"{PREFIX} resumed under world size {new}, trained under {old}: the global batch {batch} is now "
            f"{batch // new} per rank instead of {batch // old} (learning rate, accumulation and {plan} as saved)")


class CPUDistributedDataParallel(DistributedDataParallel):
    """torch's DDP for a CPU module: it takes no ``device_ids``, which Ultralytics always passes (``[device.index]``,
    ``[None]`` on the CPU)."""

    def __init__(self, module: torch.nn.Module, device_ids: list | None = None, **kwargs: Any) -> None:
        """Wrap ``module`` as torch's DDP does, without device ids for a CPU module."""
        super().__init__(module, device_ids=None if device_ids == [None] else device_ids, **kwargs)


@contextmanager
def cpu_ddp_wrap() -> Iterator[None]:
    """While Ultralytics' ``_setup_train`` runs on a CPU process group, its DDP wrap builds the CPU DDP.

    Private, checked against ``versions.ULTRALYTICS_CHECKED``: ``_setup_train`` wraps with
    ``nn.parallel.DistributedDataParallel(self.model, device_ids=[self.device.index], ...)``, looked up on
    ``torch.nn.parallel`` at the call; torch rejects any ``device_ids`` for a CPU module. Nothing else is wrapped there.
    """
    with patch.object(torch.nn.parallel, "DistributedDataParallel", CPUDistributedDataParallel):
        yield


@contextmanager
def cpu_final_validation() -> Iterator[None]:
    """While Ultralytics' ``final_eval`` runs on a CPU process group: its validator loads the best weights on the CPU.

    Private, checked against ``versions.ULTRALYTICS_CHECKED``: ``BaseValidator.__call__``
    (``ultralytics.engine.validator``) puts a
    DDP rank's standalone validation on ``torch.device("cuda", get_torch_device_backend("cuda").current_device())``;
    the two names are redirected to the CPU for this call (validation during training uses the trainer's device).
    """
    import ultralytics.engine.validator as validator
    from ultralytics.nn.autobackend import AutoBackend

    def on_cpu(*args: Any, device: Any = None, **kwargs: Any) -> AutoBackend:
        return AutoBackend(*args, device=torch.device("cpu"), **kwargs)

    with patch.object(validator, "get_torch_device_backend", lambda _: SimpleNamespace(current_device=lambda: 0)), \
            patch.object(validator, "AutoBackend", on_cpu):
        yield


class DistributedMixin:
    """Hooks that make an Ultralytics trainer train under ``torchrun`` (listed before the Ultralytics trainer).

    - ``__init__``: the world size is the launcher's ``WORLD_SIZE``, the device this rank's.
    - ``check_resume``: the first hook with final arguments; the process group is joined here, a batch that cannot
      split stops with one line, and global rank 0 chooses the one run directory for every rank.
    - ``_setup_ddp``: the group exists already; only the device is pinned.
    - ``_setup_train``/``final_eval``: on the CPU, Ultralytics' two CUDA-only calls are redirected (see module doc).
    - ``train``: in a process that starts Ultralytics' launcher, marks the workers as its own (they hand a one-line
      error back); under ``torchrun`` leaves the process group on any exit.
    """

    launch: Launch | None = None  # set when this trainer runs under torchrun (not a world Ultralytics derives)

    def __init__(self, cfg: Any = DEFAULT_CFG, overrides: dict | None = None, _callbacks: dict | None = None):
        """Initialise like the Ultralytics trainer, then take the launcher's world size and device."""
        try:
            super().__init__(cfg, overrides, _callbacks)
        except BaseException:
            if self.launch is not None:
                leave_process_group()
            raise
        if self.launch is not None:
            self.world_size = self.launch.world_size
            self.device = self._launch_device
            self.accelerator = None if self.device.type == "cpu" else get_torch_device_backend(self.device)
            LOGGER.info(f"{PREFIX} rank {self.launch.rank} of {self.launch.describe()} on {self.device}, batch "
                        f"{self.args.batch} split {self.args.batch // self.world_size} per rank, run directory "
                        f"{self.save_dir}")
        if self.resume and RANK in {-1, 0} and not from_ultralytics_launcher():  # one line, from one process
            self._say_resume_world()

    def check_resume(self, overrides: dict) -> None:
        """Resume like Ultralytics; under torchrun join the process group and agree on one run directory."""
        super().check_resume(overrides)
        launch = Launch.from_env()
        if launch is None or (from_ultralytics_launcher() and ultralytics_world(self.args.device) == launch.world_size):
            return  # a single process, or a world Ultralytics derives itself (its own launcher's workers)
        device = launch_device(self.args.device, launch)
        check_batch(self.args.batch, launch)
        self.launch, self._launch_device = launch, device
        join_process_group(device, launch)
        if not getattr(self.args, "save_dir", None):  # one directory for all (each rank would increment the name)
            self.args.save_dir = str(from_rank0(get_save_dir(self.args) if launch.rank == 0 else None))

    def _say_resume_world(self) -> None:
        """One line when a resumed run trains under another world size than it was trained under."""
        try:
            old = saved_world(torch_load(self.args.resume, map_location="cpu"))
        except Exception:  # Ultralytics' own resume reported an unreadable checkpoint already
            return
        plan = getattr(self.args, "checkpoint_stages", None)
        what = f"checkpoint_stages={plan}" if plan is not None else "the model"
        if line := resume_line(old, self.world_size or 1, int(self.args.batch), what):
            LOGGER.warning(line)

    def _setup_ddp(self) -> None:
        """Under torchrun the process group exists since ``check_resume``: pin the device; otherwise Ultralytics'."""
        if self.launch is None:
            return super()._setup_ddp()
        join_process_group(self.device, self.launch)

    def _setup_train(self) -> None:
        """Ultralytics' set-up; on a CPU process group its DDP wrap takes no CUDA device ids."""
        with cpu_ddp_wrap() if self._cpu_group else nullcontext():
            super()._setup_train()

    def final_eval(self) -> None:
        """Ultralytics' final validation of best.pt; on a CPU process group on the CPU, as during training."""
        with cpu_final_validation() if self._cpu_group else nullcontext():
            super().final_eval()

    @property
    def _cpu_group(self) -> bool:
        return self.launch is not None and self.device.type == "cpu"

    def train(self):
        """Train like Ultralytics; starting its launcher, mark the workers as ours; under torchrun, leave the group."""
        if not self.ddp:
            try:
                return super().train()
            finally:
                if self.launch is not None:
                    leave_process_group()
        old = os.environ.get(PARENT_ENV)
        os.environ[PARENT_ENV] = "1"  # inherited by Ultralytics' torch.distributed.run command and its workers
        try:
            return super().train()
        finally:
            if old is None:
                os.environ.pop(PARENT_ENV, None)
            else:
                os.environ[PARENT_ENV] = old


def launch_record(trainer: Any) -> dict[str, int]:
    """What a saved model records of the launch (beside our settings): the world size, when more than one process."""
    world = getattr(trainer, "world_size", 0) or 1
    return {WORLD_KEY: world} if world > 1 else {}

