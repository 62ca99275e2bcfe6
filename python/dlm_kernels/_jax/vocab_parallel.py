"""The vocabulary-parallel merge of the token statistics over a JAX mesh axis: shared by the
token statistics' custom VJP (``token_stats.jax_vjp``) and the linear head's path
(``linear_head.jax_head``), so neither imports the other for it."""

from __future__ import annotations

import jax

from ..token_stats import formulas as stats_math
from .ops import JaxOps


def vocab_parallel_stats(rows, impl, cfg, axis):
    """``stats_math.shard_stats`` over the mesh axis ``axis``: rows.logits is this device's
    vocabulary shard [N, K_local]. Returns (Stats, column offset)."""
    offset = jax.lax.axis_index(axis) * rows.logits.shape[1]
    stats = stats_math.shard_stats(JaxOps, impl, rows, cfg, offset,
                                   lambda v: jax.lax.pmax(v, axis),
                                   lambda v: jax.lax.psum(v, axis))
    return stats, offset
