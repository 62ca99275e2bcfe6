"""The Tunix-compatible batch contract's logic, written once for both front ends.

Each front end declares its own typed ``WeightedSum``, ``DiffusionTokenBatch`` and
``DiffusionDistillationBatch`` dataclasses (the JAX ones registered as pytrees); their
methods call the functions here with the framework's binding (``_framework.Framework``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from . import _checks as checks
from ._framework import Framework
from .linear_head.head import as_logits


def weighted_mean(framework: Framework[Any], unreduced_sum: Any, denominator: Any) -> Any:
    """unreduced_sum / denominator, and exactly 0 (gradient too) when the denominator is 0;
    NaN (never a plausible number) for a NaN or negative denominator, which no weights
    give (what the checks could not read, under jit or torch.compile, is NaN in both sums).

    The denominator's gradient is formed as -ratio / denominator, not as autodiff's
    -unreduced_sum / denominator², whose square underflows float32 for a denominator below
    about 1e-19 (weights summing to 1e-29 would get an infinite gradient)."""
    xp = framework.xp
    empty = denominator == 0
    safe = xp.where(empty, 1.0, xp.where(denominator > 0, denominator, float("nan")))
    d0 = xp.stop_gradient(safe)
    ratio = unreduced_sum / d0
    fixed = xp.stop_gradient(xp.where(xp.isfinite(ratio), ratio, 0.0))
    ratio = ratio - fixed * ((safe - d0) / d0)  # value unchanged; d/d denominator = -ratio/d
    return xp.where(empty, 0.0, ratio)


def validate_token_batch(framework: Framework[Any], batch: Any) -> None:
    """A DiffusionTokenBatch's checks: static ones always (TypeError for a wrong kind or
    dtype, ValueError for a shape); value checks (finite, non-negative weights; active
    targets >= 0) on concrete arrays."""
    xp = framework.xp
    checks.check_token_batch_static(xp, batch.model_inputs, batch.target_ids, batch.loss_weights)
    checks.check_token_batch_values(xp, batch.target_ids, batch.loss_weights)


def validate_distillation_batch(framework: Framework[Any], batch: Any, token_batch: type,
                                vocab_extent: Callable[[Any], int]) -> None:
    """A DiffusionDistillationBatch's checks: its student batch (a ``token_batch``), the
    teacher logits' shape and dtype against it, and on concrete arrays every active target
    inside the teacher's vocabulary (``vocab_extent(teacher_logits)``)."""
    xp = framework.xp
    checks.require_instance("student_batch", batch.student_batch, token_batch)
    batch.student_batch.validate()
    student = batch.student_batch
    checks.check_logits_for_batch(xp, "teacher_logits", as_logits(batch.teacher_logits),
                                  student.target_ids.shape)
    checks.check_active_targets(xp, student.target_ids, student.loss_weights,
                                vocab_extent(batch.teacher_logits), allow_sync=True)
