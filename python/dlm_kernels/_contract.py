"""The Tunix-compatible batch contract, defined once for both front ends.

:func:`make_contract` builds ``WeightedSum``, ``DiffusionTokenBatch`` and
``DiffusionDistillationBatch`` for one framework's ops adapter; the JAX front end
registers them as pytrees, the torch front end uses them as they are.
"""

from __future__ import annotations

import dataclasses

from . import _checks as checks


def weighted_mean(xp, unreduced_sum, denominator):
    """unreduced_sum / denominator, and exactly 0 (gradient too) when the denominator is 0.

    The denominator's gradient is formed as -ratio / denominator, not as autodiff's
    -unreduced_sum / denominator², whose square underflows float32 for a denominator below
    about 1e-19 (weights summing to 1e-29 would get an infinite gradient)."""
    safe = xp.where(denominator > 0, denominator, 1.0)
    d0 = xp.stop_gradient(safe)
    ratio = unreduced_sum / d0
    fixed = xp.stop_gradient(xp.where(xp.isfinite(ratio), ratio, 0.0))
    ratio = ratio - fixed * ((safe - d0) / d0)  # value unchanged; d/d denominator = -ratio/d
    return xp.where(denominator > 0, ratio, 0.0)


def make_contract(xp, module: str, vocab_extent=lambda logits: logits.shape[-1]):
    """(WeightedSum, DiffusionTokenBatch, DiffusionDistillationBatch) for ops adapter ``xp``;
    ``vocab_extent(logits)`` is the full vocabulary of a logits array (K, or K x shards inside
    a vocabulary-parallel context)."""

    @dataclasses.dataclass(frozen=True)
    class WeightedSum:
        """A loss kept as ``unreduced_sum`` over ``denominator`` (sums across micro-batches
        or devices add field by field); ``compute()`` is their ratio, 0 for a 0 denominator."""

        unreduced_sum: object  # [] float32
        denominator: object  # [] float32

        def compute(self):
            return weighted_mean(xp, self.unreduced_sum, self.denominator)

        def replace(self, **fields):
            return dataclasses.replace(self, **fields)

    @dataclasses.dataclass(frozen=True)
    class DiffusionTokenBatch:
        """Target-aligned diffusion batch: position (b, l) predicts ``target_ids[b, l]``
        from ``model_inputs`` (the noisy canvas); it is active when its weight is non-zero.

        model_inputs: a batch-major pytree of arrays (a dict such as {"input_tokens": [B, L]
          int, "positions": [B, L] int, "time": [B] float}, any nesting, or one bare array):
          every leaf non-scalar with leading dimension B and a bool or real numeric dtype.
        target_ids: [B, L] int.
        loss_weights: [B, L] bool, int or float, kept as given (objectives convert to float32).
        """

        model_inputs: object
        target_ids: object
        loss_weights: object

        @classmethod
        def create(cls, *, model_inputs, target_ids, loss_weights):
            batch = cls(model_inputs=model_inputs, target_ids=target_ids, loss_weights=loss_weights)
            return batch.validate()

        def validate(self):
            """Static checks always (TypeError for a wrong kind or dtype, ValueError for a
            shape); value checks (finite, non-negative weights; active targets >= 0) on
            concrete arrays. Returns self."""
            checks.check_token_batch_static(xp, self.model_inputs, self.target_ids, self.loss_weights)
            checks.check_token_batch_values(xp, self.target_ids, self.loss_weights)
            return self

        def replace(self, **fields):
            return dataclasses.replace(self, **fields)

    @dataclasses.dataclass(frozen=True)
    class DiffusionDistillationBatch:
        """A student batch plus the teacher's logits at the same positions.

        student_batch: DiffusionTokenBatch;  teacher_logits: [B, L, K] float.
        On concrete arrays, active targets must lie in [0, K) of the teacher logits. Teacher
        values (finite at active positions) are checked by ``opd_loss`` when its soft term
        is enabled, so a batch for a hard-only loss may carry any finite-shaped teacher.
        """

        student_batch: object
        teacher_logits: object

        @classmethod
        def create(cls, *, student_batch, teacher_logits):
            return cls(student_batch=student_batch, teacher_logits=teacher_logits).validate()

        def validate(self):
            checks.require_instance("student_batch", self.student_batch, DiffusionTokenBatch)
            self.student_batch.validate()
            checks.check_logits_for_batch(xp, "teacher_logits", self.teacher_logits,
                                     self.student_batch.target_ids.shape)
            checks.check_ids(xp, "target_ids", self.student_batch.target_ids,
                        vocab_extent(self.teacher_logits), where=self.student_batch.loss_weights,
                        at=" at active positions", allow_sync=True)
            return self

        def replace(self, **fields):
            return dataclasses.replace(self, **fields)

    classes = (WeightedSum, DiffusionTokenBatch, DiffusionDistillationBatch)
    for cls in classes:
        cls.__module__ = module
        cls.__qualname__ = cls.__name__
    return classes
