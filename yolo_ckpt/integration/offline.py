"""``YOLO_OFFLINE=1`` without a network call: give Ultralytics its plotting fonts locally.

Ultralytics (``ultralytics/utils/checks.py`` ``check_font``, called by ``check_det_dataset`` in every train
and val run, and by the ``Annotator`` of plots) looks for ``Arial.ttf`` (``Arial.Unicode.ttf`` for non-ASCII class
names) in its config dir (``USER_CONFIG_DIR``, ``$YOLO_CONFIG_DIR``), then in matplotlib's list of system fonts, and
otherwise sends a HEAD request to GitHub for it — also when ``YOLO_OFFLINE=1``, whose flag only stops the ``is_online``
probe. On an air-gapped machine that lookup can wait for the resolver's full timeout on every run.

Matplotlib's font list is the supported way round it, as for any system font: ``provide_fonts`` registers a copy of
matplotlib's bundled DejaVu Sans under those file names with ``font_manager.fontManager.addfont`` (public matplotlib
API, this process only). Nothing is written to Ultralytics' config dir and nothing of Ultralytics is patched; a real
Arial, in the config dir or installed on the system, is found first and used as before.

Examples:
    >>> provide_fonts()  # doctest: +SKIP
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

FONTS = ("Arial.ttf", "Arial.Unicode.ttf")  # the names check_font asks for
FONT_DIR = Path.home() / ".cache" / "yolo_ckpt" / "fonts"


def provide_fonts(root: Path | None = None) -> list[Path]:
    """With ``YOLO_OFFLINE`` set, make every font ``check_font`` asks for resolvable without the network.

    Args:
        root: Where the named copies of DejaVu Sans are kept (created on first use); ``~/.cache/yolo_ckpt/fonts`` by
            default.

    Returns:
        (list[Path]): The font files registered with matplotlib in this call (none when online or already present).
    """
    from ultralytics.utils import USER_CONFIG_DIR, env_bool

    if not env_bool("YOLO_OFFLINE"):
        return []
    import matplotlib
    from matplotlib import font_manager

    known = [f.fname for f in font_manager.fontManager.ttflist]
    missing = [n for n in FONTS if not (USER_CONFIG_DIR / n).exists() and not any(n in f for f in known)]
    added = []
    for name in missing:
        path = (root or FONT_DIR) / name
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.tmp")  # atomic: parallel processes never read half a file
            shutil.copyfile(Path(matplotlib.get_data_path()) / "fonts" / "ttf" / "DejaVuSans.ttf", tmp)
            os.replace(tmp, path)
        font_manager.fontManager.addfont(str(path))
        added.append(path)
    return added
