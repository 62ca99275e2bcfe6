"""The Triton sampler from JAX (``kernels.triton.sampling``, through ``jax_triton.triton_call``)
and the draw that merges its vocabulary splits.

The jax-triton host (its guarded import, the launch wrapper, the vmap fold) is the one of
``token_stats.jax_triton``: importing this module raises the same ImportError where
jax-triton cannot run, and the registry records why.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from . import core as sampling
from ..kernels.layout import SAMPLE_IDS, SAMPLE_STATE
from ..kernels.triton import sampling as sampler
from ..kernels.triton import token_stats as kernels
from .._jax.ops import JaxOps
from ..token_stats.jax_triton import _launch, _num_sms, _rows_vmappable, unsupported_reason


def _sample_partial(z, zu, keys, suppress_rows, cfg):
    # z, zu: [N, K] row-major; keys [N] int32; suppress_rows [N, S_ids] (every row the same
    # ids, so a vmapped call folds it like a row input) -> the split states with rows first:
    # ([N, SAMPLE_STATE, S] f32, [N, SAMPLE_IDS, S] i32, [N, S, k] f32 and i32 slots)
    n, k = z.shape
    low = cfg.lowered()
    lc = kernels.launch_config(n, k, jnp.dtype(z.dtype).itemsize, zu is not None, _num_sms(),
                               low.block_k)
    s, top_k = lc["splits"], low.top_k
    slots = (s, n, top_k) if top_k else (1,)
    types = (jax.ShapeDtypeStruct((len(SAMPLE_STATE), s, n), jnp.float32),  # 28·S B/row
             jax.ShapeDtypeStruct((len(SAMPLE_IDS), s, n), jnp.int32),  # 8·S B/row
             jax.ShapeDtypeStruct(slots, jnp.float32), jax.ShapeDtypeStruct(slots, jnp.int32))
    if n == 0:
        state, ids, top_v, top_i = (jnp.zeros(t.shape, t.dtype) for t in types)
    else:
        n_sup = 0 if suppress_rows is None else suppress_rows.shape[1]
        state, ids, top_v, top_i = _launch(
            sampler.sample_partial_kernel,
            (z, z if zu is None else zu, keys,
             keys if suppress_rows is None else suppress_rows[0]),
            (n, k, n_sup, k, k, lc["cols_per_split"], low.temperature, low.stats_temperature,
             low.cfg_c),
            types, (n, s), num_warps=lc["num_warps"], num_stages=lc["num_stages"],
            enable_fp_fusion=False,  # guidance's multiply and add round as on the host
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
    sup = None if suppress is None else jnp.broadcast_to(suppress, (n,) + suppress.shape)
    state, ids, top_v, top_i = _rows_vmappable(
        lambda *a: _sample_partial(*a, cfg), z, zu,
        jax.lax.bitcast_convert_type(keys, jnp.int32), sup)
    flat = lambda t: t.reshape(n, math.prod(t.shape[1:]))  # [N, S, k] -> [N, S·k]
    st = sampling.merge_splits(JaxOps, jnp.moveaxis(state, 0, 2), jnp.moveaxis(ids, 0, 2),
                               flat(top_v), flat(top_i), cfg, k)
    return sampling.finalize(JaxOps, st, keys, cfg)


class TritonSampler:
    """The Triton sampler from JAX (``dlm_kernels.sampling.core``'s draw)."""

    name = "triton"
    unsupported_reason = staticmethod(unsupported_reason)
    sample = staticmethod(sample)


IMPLEMENTATION = TritonSampler()
