"""The linear head in Mosaic kernels (``kernels.pallas.linear_head``): the pallas backend's
fused head (the head op's registry, ``_dispatch.FUSED_HEAD``)."""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax.numpy as jnp

from ..kernels.pallas import linear_head as head_kernels
from .._jax.batching import map_vmap
from .._jax.pallas import (backward_float_columns, forward_float_columns, int_columns,
                           kernel_statics, row_stats)


class _Teacher(NamedTuple):
    """A teacher as the fused head kernels take it."""

    operand: Any  # [N, K] logits, or a head's (hidden, weight, bias)
    statics: dict  # what the kernels' statics add for it
    kernel_dtype: bool  # whether the kernels take its dtypes


class _TeacherOperand:
    """The ``_Teacher`` of a teacher source, by its kind (``LogitsSource.accept``)."""

    @staticmethod
    def array(logits):  # read as it is
        return _Teacher(logits, {}, True)

    @staticmethod
    def head(head):  # its arrays in its layout; the kernels apply no teacher softcap, so a
        # capped teacher head goes through the token-chunked path (its chunks capped there)
        return _Teacher(head.arrays(), {"teacher_layout": head.weight_layout},
                        FusedHead._kernel_dtype(head) and head.softcap is None)


class FusedHead:
    """The linear head in Mosaic kernels (``kernels.pallas.linear_head``): statistics and the
    gradients of hidden, weight and bias with every logits tile made on the MXU and used in
    VMEM. It takes rows whose logits are a head of float32 or bfloat16 hidden states and a
    weight of the same dtype, whose teacher is absent, an array, or a head of its own (then
    without teacher_grad), outside a vocabulary-parallel map; other rows go through the
    token-chunked path (XLA matmuls feeding the logits kernels). Gradient schedule: always
    recompute (1 matmul forward, 4 backward). Under ``jax.vmap`` the kernels run once per
    mapped element (``map_vmap``: each element's weight gradient is its own)."""

    name = "pallas"

    @staticmethod
    def _kernel_dtype(head):
        dt = jnp.dtype(head.hidden.dtype)
        return dt in (jnp.float32, jnp.bfloat16) and jnp.dtype(head.weight.dtype) == dt

    @classmethod
    def takes(cls, rows, axis, plan):
        """Whether the kernels take these rows: ``plan`` (``linear_head.head.HeadPlan``) says
        whether the student is the one head needing a gradient; the dtypes are checked here."""
        if not plan.student_head_grad_only or axis is not None:
            return False
        teacher = rows.teacher  # a LogitsSource or None
        return cls._kernel_dtype(rows.logits) and (
            teacher is None or teacher.accept(_TeacherOperand).kernel_dtype)

    @staticmethod
    def _args(rows, cfg):
        head, teacher = rows.logits, rows.teacher
        statics = dict(kernel_statics(cfg), layout=head.weight_layout, block_n=head.row_chunk)
        if teacher is not None:
            operand = teacher.accept(_TeacherOperand)
            teacher = operand.operand
            statics.update(operand.statics)
        return (head.hidden, head.weight, head.bias), teacher, statics

    @classmethod
    def forward(cls, rows, cfg):
        """-> Stats of [N] f32 (one kernel: 1 matmul)."""
        head, teacher, statics = cls._args(rows, cfg)
        run = map_vmap(functools.partial(head_kernels.head_forward, **statics))
        out = run(head, teacher, int_columns(rows.targets, rows.shift_ids),
                  forward_float_columns(rows, rows.active))
        return row_stats(out, rows.active, cfg)

    @classmethod
    def backward(cls, rows, stats, grads, cfg):
        """-> ((dH, dW, db or None) float32, the teacher's gradient or None): two kernels,
        2 matmuls each."""
        head, teacher, statics = cls._args(rows, cfg)
        run = map_vmap(functools.partial(head_kernels.head_backward,
                                         teacher_grad=cfg.TEACHER_GRAD, **statics))
        dh, dw, db, du = run(head, teacher, int_columns(rows.targets, rows.shift_ids),
                             backward_float_columns(rows, stats, grads, cfg))
        return (dh, dw, db), du


IMPLEMENTATION = FusedHead()
