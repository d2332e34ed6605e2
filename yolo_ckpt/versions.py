"""The Ultralytics releases yolo-ckpt supports, checked when it is imported.

yolo-ckpt extends Ultralytics' trainers through their hooks and a few private points (``_predict_once``,
``_build_train_pipeline``, the first-epoch out-of-memory retry and its ``_oom_retries``), so it names the releases
whose code it was checked against instead of failing somewhere inside a training run.
"""

import ultralytics
from ultralytics.utils.checks import check_version

# As pyproject.toml pins it. CI runs the whole suite on the newest and .ci/run's bit-for-bit subset on the oldest.
# 8.4.162 is the first release whose out-of-memory retry, which escalation joins through ``_build_train_pipeline``,
# keeps the optimizer and hands the rebuilt loader to the validator as 8.4.190's does; everything else yolo-ckpt
# touches reads as in 8.4.190 from there on (8.4.113 is the first in which yolo-ckpt runs at all), except YOLO26
# segmentation's mask-aware assigner (``SegTaskAlignedAssigner``), which 8.4.162 lacks: ``checkpoint_loss=chunked``
# groups its objects where it exists and has nothing to group where it does not.
ULTRALYTICS_RANGE = ">=8.4.162,<8.5"
ULTRALYTICS_CHECKED = "8.4.190"  # the release every private name yolo-ckpt touches was read in; the suite runs on it

__version__ = "0.1.0"


def check_ultralytics(version: str = ultralytics.__version__) -> None:
    """Raise ``ImportError`` naming the supported range when ``version`` lies outside it (Ultralytics' own
    ``check_version``)."""
    if not check_version(version, ULTRALYTICS_RANGE):
        raise ImportError(f"yolo-ckpt supports ultralytics{ULTRALYTICS_RANGE}, not {version}: "
                          f"pip install 'ultralytics{ULTRALYTICS_RANGE}'")


check_ultralytics()
