"""The chunked backend's sampler from JAX: jax.numpy over vocabulary chunks inside
``lax.fori_loop`` (chunks taken with ``lax.dynamic_slice``; the clamped last chunk masks the
columns an earlier one saw to -inf), live temporaries a few [N, C] chunks. The chunks are
those of the chunked token statistics (``token_stats.jax_chunked.vocab_chunk``) and each
chunk's statistics are ``token_stats.formulas.chunk_partial``, merged by its ``merge`` in the same
order, so the drawn token's logp and the entropy are ``per_token_logps``'s bits
(docs/design.md §3, "Rollout = trainer")."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from . import core as sampling
from .._jax.ops import JaxOps as xp
from ..token_stats.jax_chunked import vocab_chunk


def _slice(a, start, c):
    return None if a is None else lax.dynamic_slice_in_dim(a, start, c, axis=1)


def _padded(st, k):
    """A chunk's state with k top-k slots: a chunk narrower than top_k fills its last slots
    with -inf (probability 0: never drawn, nothing in a statistic), so the running top-k
    keeps one shape through ``lax.fori_loop``."""
    extra = k - st.topv.shape[1]
    if extra == 0:
        return st
    return st._replace(topv=jnp.pad(st.topv, ((0, 0), (0, extra)), constant_values=-jnp.inf),
                       topi=jnp.pad(st.topi, ((0, 0), (0, extra))))  # [N, k]


def sample(z, zu, keys, suppress, cfg):
    # z, zu: [N, K] -> Sample of [N] fields, a lax.fori_loop over vocabulary chunks (the
    # clamped last chunk masks the columns an earlier one saw to -inf). Without top_k the
    # loop keeps maxima only and ``settle`` re-reads one chunk per row for the positions
    # (XLA's argmax on a CPU costs about 18x its max, 100x fused with the noise).
    n, k = z.shape
    if cfg.top_k is not None:  # the slots of a whole row; every chunk's state has them all
        cfg = cfg._replace(top_k=min(cfg.top_k, k))
    c = vocab_chunk(n, k, cfg, jax.default_backend() == "cpu")
    n_chunks = -(-k // c)
    noisy = sampling.noisy_scores(xp, keys)

    def read(i):  # chunk i -> z, s, sd [N, C] (columns an earlier chunk saw at -inf), cols [C]
        start = jnp.minimum(i * c, k - c)
        cols = start + jnp.arange(c, dtype=jnp.int32)
        scores = sampling.scaled_logits(xp, _slice(z, start, c), _slice(zu, start, c), cols,
                                        suppress, cfg)
        fresh = (cols >= i * c)[None, :]
        return tuple(jnp.where(fresh, x, -jnp.inf) for x in scores) + (cols,)

    def reread(chunk):  # chunk [N], one per row -> z, s, sd, cols [N, C]
        cols = jnp.minimum(chunk * c, k - c)[:, None] + jnp.arange(c, dtype=jnp.int32)
        rows = lambda x: None if x is None else jnp.take_along_axis(x, cols, axis=1)  # noqa: E731
        scores = sampling.scaled_logits(xp, rows(z), rows(zu), cols, suppress, cfg)
        fresh = cols >= chunk[:, None] * c
        return tuple(jnp.where(fresh, x, -jnp.inf) for x in scores) + (cols,)

    def part(i):
        z_i, s, sd, cols = read(i)
        if cfg.top_k is None:
            return sampling.chunk_values(xp, z_i, s, sd, cols, jnp.full((n,), i, jnp.int32),
                                         noisy, cfg)
        return _padded(sampling.chunk_state(xp, z_i, s, sd, cols, keys, cfg), cfg.top_k)

    state = part(0)
    if n_chunks > 1:
        state = lax.fori_loop(1, n_chunks,
                              lambda i, st: sampling.merge_state(xp, st, part(i), cfg), state)
    if cfg.top_k is None:
        state = sampling.settle(xp, state, reread, noisy, cfg)
    return sampling.finalize(xp, state, sampling.stream_stats(xp, state, cfg), keys, cfg)


class ChunkedSampler:
    """The chunked sampler from JAX (``dlm_kernels.sampling.core``'s draw)."""

    name = "chunked"

    @staticmethod
    def unsupported_reason(platform):
        return None

    sample = staticmethod(sample)


IMPLEMENTATION = ChunkedSampler()
