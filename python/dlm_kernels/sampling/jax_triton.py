"""The Triton sampler from JAX (``kernels.triton.sampling``, through ``jax_triton.triton_call``)
and the draw that merges its vocabulary splits.

The jax-triton host (its guarded import, the launch wrapper, the vmap fold) is
``_jax.triton``'s: importing this module raises the same ImportError where jax-triton cannot
run, and the registry records why. The drawn token's logp and the entropy
come from the token statistics' finalize kernel over the splits' statistics, as
``per_token_logps`` finalises its own (docs/design.md §3, "Rollout = trainer").
"""

from __future__ import annotations

# first: where jax-triton cannot run, the import fails here, saying so
from .._jax.triton import launch, rows_vmappable, unsupported_reason

import math

import jax
import jax.numpy as jnp

from . import core as sampling
from ..kernels.layout import SAMPLE_IDS, SAMPLE_STATE
from ..kernels.triton import sampling as sampler
from ..kernels.triton import token_stats as kernels
from .._jax.ops import JaxOps
from ..token_stats import formulas as stats_math
from ..token_stats.jax_triton import finalize


def _sample_partial(z, zu, keys, suppress_rows, cfg, inv_t):
    # z, zu: [N, K] row-major; keys [N] int32; suppress_rows [N, S_ids] (every row the same
    # ids, so a vmapped call folds it like a row input) -> the split states with rows first:
    # ([N, SAMPLE_STATE, S] f32, [N, SAMPLE_IDS, S] i32, [N, S, k] f32 and i32 slots)
    n, k = z.shape
    low = cfg.lowered()
    lc = kernels.launch_config(k, jnp.dtype(z.dtype).itemsize, zu is not None, low.block_k)
    s, top_k = lc["splits"], low.top_k
    slots = (s, n, top_k) if top_k else (1,)
    types = (jax.ShapeDtypeStruct((len(SAMPLE_STATE), s, n), jnp.float32),  # 28·S B/row
             jax.ShapeDtypeStruct((len(SAMPLE_IDS), s, n), jnp.int32),  # 8·S B/row
             jax.ShapeDtypeStruct(slots, jnp.float32), jax.ShapeDtypeStruct(slots, jnp.int32))
    if n == 0:
        state, ids, top_v, top_i = (jnp.zeros(t.shape, t.dtype) for t in types)
    else:
        n_sup = 0 if suppress_rows is None else suppress_rows.shape[1]
        state, ids, top_v, top_i = launch(
            sampler.sample_partial_kernel,
            (z, z if zu is None else zu, keys,
             keys if suppress_rows is None else suppress_rows[0]),
            (n, k, n_sup, k, k, lc["cols_per_split"], low.temperature, low.stats_temperature,
             low.cfg_c, inv_t),
            types, (n, s), num_warps=lc["num_warps"], num_stages=lc["num_stages"],
            # with guidance its multiply and add round as on the host; without, the
            # statistics' sums compile as the token statistics' kernel (contraction on)
            enable_fp_fusion=zu is None,
            GREEDY=low.GREEDY, TWO_T=low.TWO_T, HAS_UNCOND=zu is not None,
            HAS_SUPPRESS=suppress_rows is not None, TOP_K=top_k,
            TOP_KP=sampler.slot_count(top_k), BLOCK_K=lc["block_k"], VEC=lc["vec"],
            ROWS_ALIGNED=kernels.rows_aligned(k))
    if not top_k:
        top_v, top_i = (jnp.zeros((n, 0), t.dtype) for t in (top_v, top_i))
    else:
        top_v, top_i = (jnp.moveaxis(t, 1, 0) for t in (top_v, top_i))
    return jnp.moveaxis(state, 2, 0), jnp.moveaxis(ids, 2, 0), top_v, top_i




def sample(z, zu, keys, suppress, cfg):
    # z, zu: [N, K] -> Sample of [N] fields: the kernel's split states merged here
    n, k = z.shape
    low = sampling.stats_lowered(cfg)
    sup = None if suppress is None else jnp.broadcast_to(suppress, (n,) + suppress.shape)
    state, ids, top_v, top_i = rows_vmappable(
        lambda *a: _sample_partial(*a, cfg, low.inv_t), z, zu,
        jax.lax.bitcast_convert_type(keys, jnp.int32), sup)
    flat = lambda t: t.reshape(n, math.prod(t.shape[1:]))  # [N, S, k] -> [N, S·k]
    state = jnp.moveaxis(state, 0, 2)  # [SAMPLE_STATE, S, N]
    st = sampling.merge_splits(JaxOps, state, jnp.moveaxis(ids, 0, 2), flat(top_v),
                               flat(top_i), cfg, k)
    return sampling.finalize(JaxOps, st, _row_stats(z, zu, state, st, cfg, low), keys, cfg)


def _row_stats(z, zu, state, st, cfg, low):
    """The token statistics (``token_stats.formulas.Stats``) of the splits' statistics state[:3]
    with ``stats_target`` as the target: the token statistics' finalize kernel, as
    ``per_token_logps`` runs it (the torch twin: ``sampling.torch_triton._row_stats``)."""
    n = z.shape[0]
    active = jnp.ones((n,), jnp.int8)
    target = sampling.stats_target(st, cfg)
    if n == 0:
        stats = stats_math.Stats(*jnp.zeros((len(stats_math.Stats._fields), 0), jnp.float32))
    else:
        part = state[:3]  # PARTIAL_STATE's m, a, b
        rows_first = lambda p, z, y, a: tuple(  # noqa: E731  p: [N, 3, S]
            finalize(jnp.moveaxis(p, 0, 2), z, y, None, None, a, low))
        stats = rows_vmappable(rows_first, jnp.moveaxis(part, 2, 0), z, target, active)
        stats = stats_math.Stats(*stats)
    if zu is not None and not cfg.greedy and cfg.top_k is None:
        stats = stats._replace(logp=stats_math.target_logp(
            JaxOps, st.gz, jnp.ones_like(stats.m), stats.m, stats.la_ce, low))
    return stats


class TritonSampler:
    """The Triton sampler from JAX (``dlm_kernels.sampling.core``'s draw)."""

    name = "triton"
    unsupported_reason = staticmethod(unsupported_reason)
    sample = staticmethod(sample)


IMPLEMENTATION = TritonSampler()
