"""The pallas backend for JAX: the Mosaic TPU kernels of ``dlm_kernels.kernels.pallas``
under the front end's ``custom_vjp``.

Interpret mode (TPU semantics emulated on CPU) is on when ``DLM_KERNELS_PALLAS_INTERPRET=1``,
off when ``=0``, and by default on exactly when JAX's default backend is the CPU. With it off
on a CPU machine, the kernels still *lower* for TPU (``lowering_platforms=("tpu",)``), which
is how the block rules are checked without a TPU.
"""

from __future__ import annotations

import jax.numpy as jnp

from . import formulas as stats_math
from .._dispatch import BackendBase, Capabilities
from ..kernels.pallas import token_stats as kernels
from .._jax.batching import fold_vmap_into_rows
from .._jax.ops import JaxOps
from .._jax.pallas import (backward_float_columns, forward_float_columns, int_columns,
                           kernel_statics, row_stats, unsupported_reason)


class PallasJax(BackendBase):
    name = "pallas"
    custom_vjp = True
    capabilities = Capabilities(vocab_shards=True)

    unsupported_reason = staticmethod(unsupported_reason)

    @staticmethod
    def _run_forward(rows, active, cfg, offset, partial):
        z, u, y, x = rows.logits, rows.teacher, rows.targets, rows.shift_ids
        if z.shape[0] == 0:  # no rows: no launch (a grid over zero row blocks reads out of bounds)
            return jnp.zeros((0, kernels.stats_width(cfg.SMOOTH)), jnp.float32)
        floats = forward_float_columns(rows, active)  # [N, 2]
        statics = dict(kernel_statics(cfg), partial=partial)
        call = fold_vmap_into_rows(
            lambda z, *rest: kernels.stats_forward(z, rest[0] if u is not None else None, *rest[-2:],
                                             **statics))
        return call(z, *([u] if u is not None else []), int_columns(y, x, offset), floats)  # [N, F]

    @classmethod
    def forward(cls, rows, cfg):
        # rows: [N, K] logits / teacher, [N] per-row inputs -> Stats of [N] f32
        return row_stats(cls._run_forward(rows, rows.active, cfg, 0, False), rows.active, cfg)

    @classmethod
    def forward_partial(cls, rows, cfg, offset=0):
        # one vocabulary shard starting at global column ``offset`` -> (State, r_y, found)
        active = jnp.ones(rows.targets.shape, jnp.bool_)
        out = cls._run_forward(rows, active, cfg, offset, True)
        state = _partial_state(out, cfg)
        return (state, *stats_math.target_logit(JaxOps, rows, cfg, offset))

    @staticmethod
    def backward(rows, stats, grads, cfg, offset=0):
        z, u, y, x = rows.logits, rows.teacher, rows.targets, rows.shift_ids
        if z.shape[0] == 0:  # no rows: nothing to launch
            empty = lambda a: jnp.zeros(a.shape, a.dtype)
            return empty(z), (empty(u) if u is not None and cfg.TEACHER_GRAD else None)
        floats = backward_float_columns(rows, stats, grads, cfg)  # [N, 16]
        statics = kernel_statics(cfg)
        call = fold_vmap_into_rows(
            lambda z, *rest: kernels.stats_backward(z, rest[0] if u is not None else None, *rest[-2:],
                                              teacher_grad=cfg.TEACHER_GRAD, **statics))
        return call(z, *([u] if u is not None else []), int_columns(y, x, offset), floats)


def _partial_state(out, cfg):
    """The State of a shard's partial output [N, stats_width] (Σ r only with label
    smoothing)."""
    fields = [out[:, j] for j in range(kernels.scratch_rows(cfg.SMOOTH))]
    if not cfg.SMOOTH:
        fields.append(jnp.zeros_like(fields[0]))
    return stats_math.State(*fields)


IMPLEMENTATION = PallasJax()
