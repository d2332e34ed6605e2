"""Checkpoint the criterion: the loss of the training step, recomputed in backward, bit for bit or in chunks.

Once the network is checkpointed, the loss holds most of a dense or high-resolution step's memory (instance masks:
``n_fg x h x w`` tensors per image; assignment: ``batch x objects x anchors``), and no layer plan touches it.
``checkpoint_loss`` names what is done to the criterion Ultralytics builds (``model.init_criterion``):

- ``none``: nothing, Ultralytics' own loss.
- ``exact``: bit for bit as vanilla. Instance segmentation (``v8SegmentationLoss`` and YOLO26's ``SegmentLoss26``):
  each image's mask loss, its ground-truth masks built inside, is a region of its own (``checkpoint_region``), so
  that only one image's ``n_fg x h x w`` tensors are alive in backward. Every ``TaskAlignedAssigner`` with
  Ultralytics' own ``get_box_metrics`` (detect, segment, pose, obb; not YOLO26 segmentation's mask-aware one):
  one image at a time, its candidate pairs scored in one call over the batch's list (``assignment._assign_exact``),
  so that its ``objects x anchors`` tensors are one image's, in training and in validation.
- ``chunked``: bounded memory, equal up to float rounding, opt-in only:

  - the mask loss of each image in chunks of at most ``CHUNK_ROWS_PIXELS // (h * w)`` foreground rows, each chunk a
    region: the per-chunk sums and the prototype gradient add up in another order than one sum over all rows;
  - semantic segmentation (``SemanticSegmentationLoss``): the logits upsampled, and cross-entropy and Dice computed,
    in blocks of rows of one image (``CHUNK_PIXELS``), each block a region that returns its cross-entropy sum and its
    Dice sums; the totals add up in another order than one sum over every pixel;
  - assignment (every ``TaskAlignedAssigner``: detect, segment, pose, obb) one image at a time, the path Ultralytics
    itself takes after an out-of-memory error (``TaskAlignedAssigner.forward``), so that the
    ``objects x anchors`` tensors are one image's. Not bitwise on CPU: the alignment metric's ``pow(beta)`` over the
    candidate pairs runs vectorized in the body and scalar in the tail of a list, and per image the tail moves
    (measured on this project's AVX-512 CPU: ``x[:k].pow(6.0)`` differs from ``x.pow(6.0)[:k]`` for 29 of the first
    199 ``k``; the gradients of yolo26n and yolo11n-obb then differ);
  - depth (``DepthLoss26``): the prediction upsampled, and the SILog and multi-scale gradient-matching terms
    computed, in blocks of rows of one image (``CHUNK_DEPTH_PIXELS``, rows aligned to the coarsest scale), each
    block a region returning its sums; the mean of the log differences is the blocks' first sums, the centred
    variance a second pass of blocks. The criterion, a plain class, is wrapped (``ChunkedDepthLoss``);
  - YOLO26 segmentation's mask-aware assignment (``SegTaskAlignedAssigner``, which scores each object's best anchors
    by the IoU of their predicted masks) in groups of objects (``CHUNK_MASK_IOU_PIXELS``), so that it no longer
    decodes a whole image's candidate masks at once: the step's peak at 1024 px with 300 objects per image.

The criterion is shadowed on its *instance*, as ``yolo_ckpt.regions.install`` shadows the layer loop: the model's
``init_criterion`` (so also the criterion a resume or the EMA's validation builds) and any criterion already built.
``disable_loss_checkpointing`` removes every shadow; Ultralytics' ``save_model`` drops the EMA's criterion from what
it pickles, and ``CheckpointMixin.save_model`` removes the ``init_criterion`` shadow, so saved models stay plain.

Private Ultralytics code reproduced here, read in ``versions.ULTRALYTICS_CHECKED`` (``ultralytics/utils/loss.py``,
``ultralytics/utils/tal.py``): the loop of ``v8SegmentationLoss.calculate_segmentation_loss``, the terms of
``SemanticSegmentationLoss.forward`` and the per-image loop of ``TaskAlignedAssigner.forward``, which calls
``_forward``; ``TaskAlignedAssigner.get_box_metrics`` (its candidate pairs, their scores and dense tensors), which
``_forward`` calls through ``get_pos_mask``; what ``SegTaskAlignedAssigner.pair_overlaps`` reads from its arguments.

Examples:
    >>> from yolo_ckpt.memory.step import StepShape, build_model, training_batch
    >>> model = build_model("yolo11n-seg.yaml")
    >>> enable_loss_checkpointing(model, "exact")
    >>> loss, items = model.loss(training_batch(model, StepShape(128, 2)))
    >>> loss_checkpointing(model)
    'exact'
    >>> disable_loss_checkpointing(model)
    >>> loss_checkpointing(model) is None
    True"""

from __future__ import annotations

from functools import partial
from typing import Any

from torch import nn

from ..spec import CheckpointConfigError
from .assignment import _assign_exact, _assign_per_image, _pair_overlaps_by_objects
from .depth import ChunkedDepthLoss
from .segmentation import _scores_masks, _segmentation_loss
from .semantic import _semantic_loss

LOSS_MODES = ("none", "exact", "chunked")
"""Values of ``checkpoint_loss``: ``none`` (Ultralytics' loss), ``exact`` (regions recomputed bit for bit),
``chunked`` (bounded memory, not bitwise)."""
LOSS_HELP = ("'none' (Ultralytics' loss), 'exact' (bit for bit: each image's mask loss recomputed in backward, the "
             "assignment image by image; detect, segment, pose, obb), 'chunked' (not bitwise, equal up to float "
             "rounding: the mask loss in chunks of foreground rows, the semantic and depth losses in blocks of "
             "pixels, the assignment image by image; detect, segment, semantic, depth, pose, obb) or 'least' (the one "
             "that keeps the least for the task: chunked where it has it, else none)")
LOSS_TASKS = {"exact": ("detect", "segment", "pose", "obb"),
              "chunked": ("detect", "segment", "semantic", "depth", "pose", "obb")}
"""Tasks whose criterion each value changes: ``exact`` the instance-mask loss and the task-aligned assignment,
``chunked`` also the semantic and depth losses. Classification and RT-DETR (a Hungarian matcher; its loss holds a few
MiB) have no loss region. With the whole network checkpointed, depth's step peaks in the network's backward, after the
loss's (its network alone is the step, ``benchmarks/loss_memory.py``): ``chunked`` bounds the depth loss's own
memory, not that step's."""
EXACT_REGION_TASKS = ("segment",)
"""Tasks where ``exact`` recomputes regions in backward (each image's mask loss): a step's memory that ``auto`` weighs
and an out-of-memory error escalates to. Elsewhere ``exact`` only assigns image by image, which the user asks for."""


def check_loss_setting(value: Any, task: str | None, model_name: str = "") -> str:
    """The ``checkpoint_loss`` word, or the one-line error naming what is valid. ``least`` is the loss plan that
    keeps the least for ``task``: ``chunked`` where the task has it (each piece bounded by its chunk), else ``none``.

    Args:
        value: The key's value (``None`` or empty means ``none``; words are case-insensitive).
        task: The run's task, when known.
        model_name: The model's name, to refuse RT-DETR (whose matcher is not a task-aligned assigner).

    Raises:
        CheckpointConfigError: For an unknown value, or ``exact`` on a task or model it cannot help.
    """
    word = "none" if value in (None, "", False) else str(value).strip().lower()
    if word == "least":
        chunked = task in (*LOSS_TASKS["chunked"], None) and "rtdetr" not in model_name.lower()
        return "chunked" if chunked else "none"
    if word not in LOSS_MODES:
        raise CheckpointConfigError(f"checkpoint_loss={value!r} is invalid. Valid: {LOSS_HELP}.")
    if word != "none" and (task not in (*LOSS_TASKS[word], None) or "rtdetr" in model_name.lower()):
        _refuse(word, "RT-DETR" if "rtdetr" in model_name.lower() else f"task={task}")
    return word


def auto_loss_modes(setting: str, task: str | None) -> tuple[str, ...]:
    """The loss plans ``checkpoint_stages=auto`` may choose beside its layer plan, or ``()`` where every planning copy
    runs the run's own: ``exact`` (bit for bit, so always allowed) where the task has exact regions, and ``chunked``
    only where the user wrote it (it is not bitwise: never chosen unasked).

    Examples:
        >>> auto_loss_modes("none", "segment"), auto_loss_modes("chunked", "segment"), auto_loss_modes("none", "detect")
        (('exact',), ('exact', 'chunked'), ())
    """
    if setting == "exact":  # the user's: every copy carries it
        return ()
    allowed = ("exact", "chunked") if setting == "chunked" else ("exact",)
    return tuple(m for m in allowed if task in (EXACT_REGION_TASKS if m == "exact" else LOSS_TASKS[m]))


def _refuse(how: str, what: str) -> None:
    valid = "; ".join(f"{k} with task {'/'.join(v)}" for k, v in LOSS_TASKS.items())
    raise CheckpointConfigError(f"checkpoint_loss={how}: {what} has no loss region yolo-ckpt recomputes {how}. "
                                f"Valid: checkpoint_loss=none; {valid}.")


def _criteria(criterion: Any) -> list[Any]:
    """The task-aligned losses inside a criterion: itself, or the one-to-many and one-to-one losses of YOLO26's
    ``E2ELoss``."""
    from ultralytics.utils.loss import v8DetectionLoss

    parts = [getattr(criterion, name, None) for name in ("one2many", "one2one")] if hasattr(criterion, "one2one") \
        else [criterion]
    return [c for c in parts if isinstance(c, v8DetectionLoss)]


def _shadow_criterion(criterion: Any, how: str) -> Any:
    """Shadow the methods ``how`` recomputes on ``criterion``'s instance (and its inner losses'); returns it, or the
    depth loss wrapped (``ChunkedDepthLoss``)."""
    from ultralytics.utils.loss import DepthLoss26, SemanticSegmentationLoss, v8SegmentationLoss

    if how == "chunked" and isinstance(criterion, (DepthLoss26, ChunkedDepthLoss)):
        return criterion if isinstance(criterion, ChunkedDepthLoss) else ChunkedDepthLoss(criterion)
    if how == "chunked" and isinstance(criterion, SemanticSegmentationLoss):
        criterion.forward = partial(_semantic_loss, criterion)
        criterion.checkpoint_loss = how
        return criterion
    parts = _criteria(criterion)
    if not parts:
        _refuse(how, type(criterion).__name__)
    for c in parts:
        if how == "chunked":
            c.assigner._forward = partial(_assign_per_image, c.assigner)
            if _scores_masks(c.assigner):
                c.assigner.pair_overlaps = partial(_pair_overlaps_by_objects, c.assigner)
        else:
            c.assigner._forward = partial(_assign_exact, c.assigner)
        if isinstance(c, v8SegmentationLoss):
            c.calculate_segmentation_loss = partial(_segmentation_loss, c, how)
    criterion.checkpoint_loss = how
    return criterion


def _init_criterion(model: nn.Module, how: str) -> Any:
    """``model.init_criterion()`` of its class, shadowed by ``how``."""
    return _shadow_criterion(type(model).init_criterion(model), how)


def enable_loss_checkpointing(model: nn.Module, how: str) -> None:
    """Make ``model``'s criterion (built now or later) recompute as ``how`` says; ``none`` leaves it Ultralytics'.

    Args:
        model: An Ultralytics task model.
        how: One of ``LOSS_MODES``.

    Raises:
        CheckpointConfigError: When the model's criterion has nothing ``how`` recomputes (raised when it is built:
            Ultralytics' criterion reads ``model.args``, which the trainer sets after ``get_model``;
            ``check_loss_setting`` refuses such a task before any work).
    """
    if how not in LOSS_MODES:
        raise ValueError(f"checkpoint_loss {how!r} is not one of {LOSS_MODES}")
    disable_loss_checkpointing(model)
    if how == "none":
        return
    model.init_criterion = partial(_init_criterion, model, how)
    # built already (a resumed YOLO26 run's); getattr, not __dict__: an nn.Module criterion (the semantic loss) is
    # kept in _modules
    if (criterion := getattr(model, "criterion", None)) is not None:
        model.criterion = _shadow_criterion(criterion, how)


def disable_loss_checkpointing(model: nn.Module) -> None:
    """Ultralytics' own criterion again: the ``init_criterion`` shadow and every method shadow of a built criterion
    removed (no-op on a plain model)."""
    model.__dict__.pop("init_criterion", None)
    criterion = getattr(model, "criterion", None)  # in __dict__ or, an nn.Module, in _modules
    if criterion is None:
        return
    if isinstance(criterion, ChunkedDepthLoss):
        model.criterion = criterion = criterion.loss
    for c in _criteria(criterion):
        c.assigner.__dict__.pop("_forward", None)
        c.assigner.__dict__.pop("pair_overlaps", None)
        c.__dict__.pop("calculate_segmentation_loss", None)
    criterion.__dict__.pop("forward", None)
    criterion.__dict__.pop("checkpoint_loss", None)


def loss_checkpointing(model: nn.Module) -> str | None:
    """How ``model``'s criterion is recomputed (``"exact"``), or ``None`` when it is Ultralytics' own."""
    fn = model.__dict__.get("init_criterion")
    return fn.args[1] if isinstance(fn, partial) and fn.func is _init_criterion else None
