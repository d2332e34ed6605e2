"""The Ultralytics releases yolo-ckpt supports, checked when it is imported.

yolo-ckpt extends Ultralytics' trainers through their hooks and a few private points (``_predict_once``,
``_build_train_pipeline``, the first-epoch out-of-memory retry and its ``_oom_retries``), so it names the releases
whose code it was checked against instead of failing somewhere inside a training run.

Where yolo-ckpt touches Ultralytics' private code, one module of ours for each; every such place was read in
``ULTRALYTICS_CHECKED``, so the modules name no release of their own:

- the layer loop, shadowed on the model's instance: ``BaseModel._predict_once``, ``RTDETRDetectionModel.predict``
  -> ``yolo_ckpt/regions/install.py``
- the first-epoch out-of-memory retry of ``BaseTrainer._do_train``, joined where it rebuilds the loaders:
  ``BaseTrainer._build_train_pipeline`` (overridden) -> ``yolo_ckpt/integration/trainer.py``
- that retry's count, one retry given back after an escalation: ``BaseTrainer._oom_retries``
  -> ``yolo_ckpt/integration/memory_hooks.py``
- the errors that retry counts as out of memory (``CUDA_MEMORY_ERRORS``) -> ``yolo_ckpt/memory/device.py``
- the mask loss loop, re-implemented: ``v8SegmentationLoss.calculate_segmentation_loss``
  -> ``yolo_ckpt/regions/loss/segmentation.py``
- assignment, re-implemented: ``TaskAlignedAssigner._forward`` (shadowed) and ``forward``'s per-image loop,
  ``SegTaskAlignedAssigner.pair_overlaps`` -> ``yolo_ckpt/regions/loss/assignment.py``
- the semantic loss, re-implemented: ``SemanticSegmentationLoss.forward`` and its ``_ce_loss``
  -> ``yolo_ckpt/regions/loss/semantic.py``
- the depth loss, re-implemented: ``DepthLoss26.__call__`` -> ``yolo_ckpt/regions/loss/depth.py`` (these four
  shadowed on the criterion's instance by ``yolo_ckpt/regions/loss/install.py``)
- the DDP launcher: the world size ``BaseTrainer.__init__`` derives from ``device=``, ``_setup_ddp`` (replaced under
  torchrun), ``_setup_train``'s ``DistributedDataParallel`` wrap (swapped on a CPU process group), the launcher's
  workers inheriting the environment -> ``yolo_ckpt/integration/distributed.py``
- the validator's module globals ``get_torch_device_backend`` and ``AutoBackend`` (``ultralytics.engine.validator``),
  patched for a CPU process group's final validation -> ``yolo_ckpt/integration/distributed.py``
- knowledge distillation's wrapper, ``DistillationModel.student_model`` (read by attribute, not imported)
  -> ``yolo_ckpt/regions/install.py`` (``network``)
- the command ``MultiTrainer`` trains each tuning iteration with, ``ultralytics.engine.trainer._YOLO_CLI_COMMAND``
  (``python -m yolo_ckpt`` for the tuning call) -> ``yolo_ckpt/integration/tuning.py``
- ``MultiTrainer.train``'s frame (found on the stack) and its locals ``self.save_dir`` and ``save_dir``, the
  folders it makes before building a trainer -> ``yolo_ckpt/integration/multitrain.py`` (``stop_sweep``)
- ``check_font``'s lookup (config dir, matplotlib's fonts, then a download even offline)
  -> ``yolo_ckpt/integration/offline.py``
- the AMP and ``channels_last`` choice of ``BaseTrainer._setup_train`` and the train loop's autocast dtype
  -> ``yolo_ckpt/report/summary.py`` (``training_formats``)

Public behaviour that a module reproduces and says it does "as Ultralytics" (``device=`` spellings, AutoBatch's
dataset facts, the validator's batch and padding, the model class a name picks) was read in the same release.
"""

import sys

import ultralytics
from ultralytics.utils.checks import check_version

# As pyproject.toml pins it. CI runs the whole suite on the newest and .ci/run's bit-for-bit subset on the oldest.
# 8.4.162 is the first release whose out-of-memory retry, which escalation joins through ``_build_train_pipeline``,
# keeps the optimizer and hands the rebuilt loader to the validator as 8.4.190's does; everything else yolo-ckpt
# touches reads as in 8.4.190 from there on (8.4.113 is the first in which yolo-ckpt runs at all), except YOLO26
# segmentation's mask-aware assigner (``SegTaskAlignedAssigner``), which 8.4.162 lacks: ``checkpoint_loss=chunked``
# groups its objects where it exists and has nothing to group where it does not. Three differences are met where they
# are read: the assigner's ``pair_overlaps`` (8.4.162 computes those overlaps inside ``get_box_metrics``:
# ``assignment._pair_overlaps``), ``PoseModel.kpt_shape`` (the head's is read) and RT-DETR's loss, which builds its
# criterion only where the attribute is missing (``step.put_back_criterion``); .ci/run's subset covers each.
ULTRALYTICS_RANGE = ">=8.4.162,<8.5"
ULTRALYTICS_CHECKED = "8.4.190"  # the release every private name yolo-ckpt touches was read in; the suite runs on it

__version__ = "0.1.0"


def check_ultralytics(version: str = ultralytics.__version__) -> None:
    """Raise ``ImportError`` naming the supported range when ``version`` lies outside it (Ultralytics' own
    ``check_version``)."""
    if not check_version(version, ULTRALYTICS_RANGE):
        raise ImportError(f"yolo-ckpt supports ultralytics{ULTRALYTICS_RANGE}, not {version}: "
                          f"pip install 'ultralytics{ULTRALYTICS_RANGE}'")


def torchvision_error() -> str | None:
    """Why torch and torchvision do not work together, in one line, or ``None`` when they do.

    A torchvision built for another torch imports, but its compiled operators are missing, and Ultralytics' NMS then
    ends a run in its first validation (``RuntimeError: operator torchvision::nms does not exist``); one call of
    ``torchvision.ops.nms`` on two boxes finds it before any work.
    """
    import torch
    try:
        import torchvision

        torchvision.ops.nms(torch.tensor([[0.0, 0.0, 1.0, 1.0], [0.0, 0.0, 1.0, 1.0]]), torch.tensor([1.0, 0.5]), 0.5)
    except (ImportError, RuntimeError) as e:
        version = getattr(sys.modules.get("torchvision"), "__version__", "not importable")
        return (f"torch {torch.__version__} and torchvision {version} do not work together "
                f"({str(e).splitlines()[0]}). Valid: the torchvision release built for this torch "
                f"(pip install torch torchvision from one index, e.g. torch==2.14.1 with torchvision==0.29.1).")
    return None


check_ultralytics()
