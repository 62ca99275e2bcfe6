"""The chunked backend: jax.numpy over vocabulary chunks inside ``lax.fori_loop``.

Chunks are taken with ``lax.dynamic_slice`` (a reshape + scan would copy the logits). K need
not divide by the chunk C: the last chunk starts at K - C and masks the columns an earlier
chunk already counted. Backward recomputes p (and q) per chunk and writes d(logits) with
``lax.dynamic_update_slice``; overlapping columns are rewritten with identical values.
Live float32 temporaries are a few [N, C] buffers, never [N, K]. With a column ``offset``
(traced: ``axis_index * K`` inside ``shard_map``) the logits are one vocabulary shard.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from .. import _stats_math as M
from .._common import chunk_size_for
from ._ops import JaxOps as xp


def _plan(z, cfg):
    n, k = z.shape
    c = chunk_size_for(n, k, cfg)
    return n, k, c, -(-k // c)


def _slice(a, start, c):
    return None if a is None else lax.dynamic_slice_in_dim(a, start, c, axis=1)


class ChunkedJax:
    name = "chunked"
    custom_vjp = True
    supports_vocab_shards = True

    @staticmethod
    def unsupported_reason(platform):
        return None

    @staticmethod
    def forward_partial(z, u, y, x, d, cfg, offset=0):
        # z, u: [N, K] (one shard); y, x, d: [N] -> (State, r_y, found) of [N] f32
        n, k, c, n_chunks = _plan(z, cfg)

        def body(i, state):
            start = jnp.minimum(i * c, k - c)
            local = start + jnp.arange(c, dtype=jnp.int32)  # [C]
            cols = offset + local  # global column ids
            valid = M.column_mask(xp, cols, cfg, local >= i * c)  # clamped last chunk: skip seen
            part = M.chunk_partial(xp, _slice(z, start, c), _slice(u, start, c), cols, valid,
                                   x, d, cfg)
            return M.merge(xp, M.State(*state), part, cfg)

        # The first chunk is peeled so the loop carry starts from values that vary over the
        # same shard_map axes as the inputs (a constant initial state would not).
        first = M.chunk_partial(xp, _slice(z, 0, c), _slice(u, 0, c),
                                offset + jnp.arange(c, dtype=jnp.int32),
                                M.column_mask(xp, offset + jnp.arange(c, dtype=jnp.int32), cfg),
                                x, d, cfg)
        state = lax.fori_loop(1, n_chunks, body, first)
        return (M.State(*state), *M.target_logit(xp, z, y, x, d, cfg, offset))

    @classmethod
    def forward(cls, z, u, y, active, x, d, cfg):
        state, r_y, found = cls.forward_partial(z, u, y, x, d, cfg)
        return M.finalize(xp, state, r_y, found, active, cfg)

    @staticmethod
    def backward(z, u, y, active, x, d, stats, grads, cfg, offset=0):
        # -> dz [N, K] in z's dtype, du [N, K] in u's dtype or None
        n, k, c, n_chunks = _plan(z, cfg)

        def body(i, carry):
            dz, du = carry
            start = jnp.minimum(i * c, k - c)
            cols = offset + start + jnp.arange(c, dtype=jnp.int32)
            gz, gu = M.chunk_grads(xp, _slice(z, start, c), _slice(u, start, c), cols, y, active,
                                   x, d, stats, grads, cfg)
            dz = lax.dynamic_update_slice_in_dim(dz, gz.astype(dz.dtype), start, axis=1)
            if du is not None:
                du = lax.dynamic_update_slice_in_dim(du, gu.astype(du.dtype), start, axis=1)
            return dz, du

        du0 = jnp.zeros(u.shape, u.dtype) if cfg.teacher_grad else None
        # peeled first chunk: the carry then varies like the inputs under shard_map
        first = body(0, (jnp.zeros(z.shape, z.dtype), du0))
        return lax.fori_loop(1, n_chunks, body, first)


IMPLEMENTATION = ChunkedJax()
