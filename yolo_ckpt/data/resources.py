"""Find the project's data folders (``cfg/``, ``datasets/``) in a source checkout and in an installed wheel."""

from __future__ import annotations

from pathlib import Path

_PACKAGE = Path(__file__).resolve().parents[1]  # yolo_ckpt/


def data_file(folder: str, name: str) -> Path:
    """Path of ``folder/name``, where ``folder`` is ``"cfg"`` or ``"datasets"``.

    A wheel installs them inside the package (``yolo_ckpt/cfg``, see pyproject's package-dir); a checkout, editable
    or on ``sys.path``, keeps them beside the package at the repository root.

    Examples:
        >>> data_file("cfg", "default.yaml").name
        'default.yaml'
    """
    for base in (_PACKAGE, _PACKAGE.parent):
        if (path := base / folder / name).is_file():
            return path
    raise FileNotFoundError(f"yolo_ckpt data file {folder}/{name} is missing from {_PACKAGE} and {_PACKAGE.parent}")
