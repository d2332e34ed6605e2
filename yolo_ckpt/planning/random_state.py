"""The random generators' states, taken and put back.

Planning runs training steps on copies of the model and builds datasets; the training that follows must draw what
vanilla Ultralytics draws. Python's and NumPy's generators feed the datasets' augmentations, torch's the training
forwards (RT-DETR's denoising queries) and, on CUDA, the devices' generators.

Examples:
    >>> import random
    >>> with random_state_kept(Generators.PYTHON):
    ...     _ = random.random()  # planning draws; training afterwards draws as if it had not
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from enum import Flag, auto
from typing import Any

import numpy as np
import torch


class Generators(Flag):
    """Which generators a ``RandomState`` holds."""

    PYTHON = auto()  # Python's and NumPy's
    TORCH = auto()  # torch's CPU generator and, where CUDA is initialised, every CUDA device's
    ALL = PYTHON | TORCH


@dataclass(frozen=True)
class RandomState:
    """The states of the generators ``which`` names, as ``take`` found them (``None``: not held).

    Attributes:
        python (Any): ``random.getstate()``.
        numpy (Any): ``np.random.get_state()``.
        torch (torch.Tensor | None): ``torch.get_rng_state()``.
        cuda (list | None): ``torch.cuda.get_rng_state_all()``, where CUDA is initialised.
    """

    python: Any = None
    numpy: Any = None
    torch: torch.Tensor | None = None
    cuda: list | None = None

    @classmethod
    def take(cls, which: Generators = Generators.ALL) -> RandomState:
        """The generators' states now."""
        python, tensors = Generators.PYTHON in which, Generators.TORCH in which
        cuda = tensors and torch.cuda.is_initialized()
        return cls(random.getstate() if python else None, np.random.get_state() if python else None,
                   torch.get_rng_state() if tensors else None, torch.cuda.get_rng_state_all() if cuda else None)

    def restore(self) -> None:
        """Put the generators it holds back to these states."""
        if self.python is not None:
            random.setstate(self.python)
            np.random.set_state(self.numpy)
        if self.torch is not None:
            torch.set_rng_state(self.torch)
        if self.cuda is not None:
            torch.cuda.set_rng_state_all(self.cuda)


@contextmanager
def random_state_kept(which: Generators = Generators.ALL) -> Iterator[None]:
    """Leave the generators ``which`` names as the block found them."""
    state = RandomState.take(which)
    try:
        yield
    finally:
        state.restore()
