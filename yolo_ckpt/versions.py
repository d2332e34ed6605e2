"""The Ultralytics releases yolo-ckpt supports, checked when it is imported.

yolo-ckpt extends Ultralytics' trainers through their hooks and a few private points (``_predict_once``,
``_build_train_pipeline``, the first-epoch out-of-memory retry and its ``_oom_retries``), so it names the releases
whose code it was checked against instead of failing somewhere inside a training run.
"""

import ultralytics

# As pyproject.toml pins them. CI runs the whole suite on the newest and .ci/run's bit-for-bit subset on the oldest.
# 8.4.162 is the first release whose out-of-memory retry, which escalation joins through ``_build_train_pipeline``,
# keeps the optimizer and hands the rebuilt loader to the validator as 8.4.190's does; everything else yolo-ckpt
# touches reads as in 8.4.190 from there on (8.4.113 is the first in which yolo-ckpt runs at all).
SUPPORTED = ("8.4.162", "8.5")  # ultralytics>=8.4.162,<8.5


def release(version: str) -> tuple[int, ...]:
    """``"8.4.190"`` as ``(8, 4, 190)``; a pre-release or local suffix (``"8.4.190rc1"``) counts as its release."""
    return tuple(int("".join(c for c in part if c.isdigit()) or 0) for part in version.split(".")[:3])


ULTRALYTICS_RANGE = tuple(release(v) for v in SUPPORTED)  # ((8, 4, 162), (8, 5)): 8.5.0 is not below (8, 5)


def check_ultralytics(version: str = ultralytics.__version__) -> None:
    """Raise ``ImportError`` naming the supported range when ``version`` lies outside it."""
    low, high = SUPPORTED
    if not ULTRALYTICS_RANGE[0] <= release(version) < ULTRALYTICS_RANGE[1]:
        raise ImportError(f"yolo-ckpt supports ultralytics>={low},<{high}, not {version}: "
                          f"pip install 'ultralytics>={low},<{high}'")


check_ultralytics()
