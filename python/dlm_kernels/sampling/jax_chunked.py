"""The chunked backend's sampler from JAX: jax.numpy over tiles of rows and vocabulary
columns inside ``lax.fori_loop`` (tiles taken with ``lax.dynamic_slice`` from the whole
logits; the clamped last chunk masks the columns an earlier one saw to -inf), live
temporaries a few [R, C] tiles. The chunks and the row blocks are those of the chunked token
statistics (``token_stats.jax_chunked``: C fixed by K, blocks of a multiple of 8 rows, the
last overlapping) and each chunk's statistics are ``token_stats.formulas.chunk_partial``, merged
by its ``merge`` in the same order, so the drawn token's logp and the entropy are
``per_token_logps``'s bits (docs/design.md §3, "Rollout = trainer"), and every field of a
row is the same whatever other rows the call holds (§2, "One row, one answer")."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from . import core as sampling
from .._jax.ops import JaxOps as xp
from .._config import SAMPLE_CHUNK_BYTES_CPU, group_rows_per_block
from ..token_stats.jax_chunked import (in_loop, fold_row_outputs, least_rows, tile,
                                       vocab_chunk)


def _padded(st, k):
    """A chunk's state with k top-k slots: a chunk narrower than top_k fills its last slots
    with -inf (probability 0: never drawn, nothing in a statistic), so the running top-k
    keeps one shape through ``lax.fori_loop``."""
    extra = k - st.topv.shape[1]
    if extra == 0:
        return st
    return st._replace(topv=jnp.pad(st.topv, ((0, 0), (0, extra)), constant_values=-jnp.inf),
                       topi=jnp.pad(st.topi, ((0, 0), (0, extra))))  # [N, k]


def _sample_block(z, zu, keys, suppress, cfg, row0, nb, on_cpu):
    # rows [row0, row0 + nb) of z, zu: [N, K] -> Sample of [nb] fields, a lax.fori_loop over
    # vocabulary chunks (the clamped last chunk masks the columns an earlier one saw to
    # -inf). Without top_k the loop keeps maxima only and ``settle`` re-reads one chunk per
    # row for the positions (XLA's argmax on a CPU costs about 18x its max, 100x fused with
    # the noise).
    k = z.shape[1]
    c = vocab_chunk(k, cfg, on_cpu)
    n_chunks = -(-k // c)
    keys = lax.dynamic_slice_in_dim(keys, row0, nb, axis=0)
    # loop-variant operands, in the loop of blocks and in the chunk loop, so that XLA's CPU
    # compiler converts each bfloat16 tile, never the whole logits, to float32
    # (token_stats.jax_chunked.in_loop)
    z, zu = in_loop(row0, z, zu)
    noisy = sampling.noisy_scores(xp, keys)
    row_ids = row0 + jnp.arange(nb)

    def read(i):  # chunk i -> z, s, sd [nb, C] (columns an earlier chunk saw at -inf), cols [C]
        start = jnp.minimum(i * c, k - c)
        cols = start + jnp.arange(c, dtype=jnp.int32)
        z_i, zu_i = in_loop(i, z, zu)
        scores = sampling.scaled_logits(xp, tile(z_i, row0, nb, start, c),
                                        tile(zu_i, row0, nb, start, c), cols, suppress, cfg)
        fresh = (cols >= i * c)[None, :]
        return tuple(jnp.where(fresh, x, -jnp.inf) for x in scores) + (cols,)

    def reread(chunk):  # chunk [nb], one per row -> z, s, sd, cols [nb, C]
        cols = jnp.minimum(chunk * c, k - c)[:, None] + jnp.arange(c, dtype=jnp.int32)
        rows = lambda x: None if x is None else x[row_ids[:, None], cols]  # noqa: E731
        scores = sampling.scaled_logits(xp, rows(z), rows(zu), cols, suppress, cfg)
        fresh = cols >= chunk[:, None] * c
        return tuple(jnp.where(fresh, x, -jnp.inf) for x in scores) + (cols,)

    def part(i):
        z_i, s, sd, cols = read(i)
        if cfg.top_k is None:
            return sampling.chunk_values(xp, z_i, s, sd, cols, jnp.full((nb,), i, jnp.int32),
                                         noisy, cfg)
        return _padded(sampling.chunk_state(xp, z_i, s, sd, cols, keys, cfg), cfg.top_k)

    state = part(0)
    if n_chunks > 1:
        state = lax.fori_loop(1, n_chunks,
                              lambda i, st: sampling.merge_state(xp, st, part(i), cfg), state)
    if cfg.top_k is None:
        state = sampling.settle(xp, state, reread, noisy, cfg)
    return sampling.finalize(xp, state, sampling.stream_stats(xp, state, cfg), keys, cfg)


def in_row_blocks(block, z, zu, keys, rows, least):
    """The Sample of [N] fields that ``block(row0, nb)`` (a Sample of rows [row0, row0 + nb))
    gives over the row blocks of at most ``rows`` and at least ``least`` rows
    (``fold_row_blocks``; z, zu: [N, K], keys [N]). A call of fewer than ``least`` rows runs
    as ``least`` rows, zero rows after them, so a row's block is compiled alike whatever N
    is."""
    n = z.shape[0]
    if n < least:
        pad = lambda x: xp.pad_rows(x, least)  # noqa: E731
        z, zu, keys = pad(z), pad(zu), pad(keys)
    kinds = (jnp.int32, jnp.float32, jnp.int32, jnp.float32, jnp.float32, jnp.float32)
    out = fold_row_outputs(lambda row0, nb: block(z, zu, keys, row0, nb), z.shape[0], rows,
                           least, kinds, (z, zu, keys))
    return sampling.Sample(*(f[:n] for f in out))


def sample(z, zu, keys, suppress, cfg):
    # z, zu: [N, K] -> Sample of [N] fields, block by block of rows (in_row_blocks)
    k = z.shape[1]
    if cfg.top_k is not None:  # the slots of a whole row; every chunk's state has them all
        cfg = cfg._replace(top_k=min(cfg.top_k, k))
    on_cpu = jax.default_backend() == "cpu"
    r = group_rows_per_block(vocab_chunk(k, cfg, on_cpu), on_cpu, SAMPLE_CHUNK_BYTES_CPU)
    return in_row_blocks(
        lambda z, zu, keys, row0, nb: _sample_block(z, zu, keys, suppress, cfg, row0, nb,
                                                    on_cpu), z, zu, keys, r,
        least_rows(k, cfg))


class ChunkedSampler:
    """The chunked sampler from JAX (``dlm_kernels.sampling.core``'s draw)."""

    name = "chunked"

    @staticmethod
    def unsupported_reason(platform):
        return None

    #: one program per (configuration, shapes), cached: an eager call otherwise traces its
    #: loops afresh every time (as the token statistics' ``jax_vjp._token_stats_program``)
    sample = staticmethod(jax.jit(sample, static_argnums=(4,)))


IMPLEMENTATION = ChunkedSampler()
