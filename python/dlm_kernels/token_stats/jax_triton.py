"""The triton backend for JAX on NVIDIA GPUs: the same kernel source as the torch backend
(``dlm_kernels.kernels.triton.token_stats``), called through ``jax_triton.triton_call``
under the front end's ``custom_vjp``.

The jax-triton host (its guarded import, the launch wrapper, the vmap fold) is
``_jax.triton``'s: where jax-triton cannot import, neither does this module, and the registry
records why (``backend="triton"`` then says so). Traced scalars are this module's care: only
static Python scalars are passed by value, so a shard's column offset travels as an array.
"""

from __future__ import annotations

# first: where jax-triton cannot run, the import fails here, saying so
from .._jax.triton import launch, rows_vmappable, unsupported_reason

import jax
import jax.numpy as jnp
import triton

from . import formulas as stats_math
from .._dispatch import BackendBase, Capabilities
from ..kernels.layout import PARTIAL_STATE, ROW_STATS
from ..kernels.triton import token_stats as kernels
from .._rows import Rows
from .._jax.ops import JaxOps


def _scalars(cfg):
    # the kernels' (inv_t, inv_t_ce, inv_t_kl, softcap) of the lowered call
    return cfg.inv_t, cfg.inv_t_ce, cfg.inv_t_kl, cfg.softcap


def _plan(z, cfg):
    n, k = z.shape
    return n, k, kernels.launch_config(k, jnp.dtype(z.dtype).itemsize, cfg.HAS_TEACHER,
                                       cfg.chunk_size)


def _per_row(x, d):
    # [N] shift column / value; placeholders (never read) without a shift
    return (jnp.zeros((1,), jnp.int32) if x is None else x,
            jnp.zeros((1,), jnp.float32) if d is None else d)


def _offsets(offset, n):
    # [N] int32: the global id of column 0 (under shard_map axis_index · K_local, traced), one
    # per row so that a vmapped call folds it like any row input; the kernels read element 0
    return jnp.full((n,), offset, jnp.int32)


def _state_rows(cfg):
    """Rows of the partial buffer: PARTIAL_STATE, its last (Σ r) only with label smoothing."""
    return len(PARTIAL_STATE) if cfg.SMOOTH else len(PARTIAL_STATE) - 1


def _partial(z, u, active, x, d, offsets, cfg):
    # z, u: [N, K] row-major (row stride K); active, x, d, offsets: [N]
    # -> part [PARTIAL_STATE, S, N] f32 (the Σ r row only with label smoothing)
    n, k, lc = _plan(z, cfg)
    if n == 0:  # a zero-size grid is not a launch
        return jnp.zeros((_state_rows(cfg), lc["splits"], 0), jnp.float32)
    return launch(
        kernels.stats_partial_kernel,
        (z, z if u is None else u, *_per_row(x, d), active.astype(jnp.int8), offsets),
        (n, k, k, k, lc["cols_per_split"], cfg.vocab_limit, *_scalars(cfg)),
        jax.ShapeDtypeStruct((_state_rows(cfg), lc["splits"], n), jnp.float32),  # 32·S B/row
        (n, lc["splits"]), num_warps=lc["num_warps"], num_stages=lc["num_stages"],
        BLOCK_K=lc["block_k"], VEC=lc["vec"], ROWS_ALIGNED=kernels.rows_aligned(k),
        **cfg.triton_flags(), **({"SMOOTH": True} if cfg.SMOOTH else {}))


def _forward(rows, cfg):
    # rows: the bundle (logits, teacher [N, K]; targets, active, shift ids, shift [N])
    # -> Stats of [N] f32
    z, u, y, active, x, d = (rows.logits, rows.teacher, rows.targets, rows.active,
                             rows.shift_ids, rows.shift)
    n, k = z.shape
    if n == 0:
        return stats_math.Stats(*jnp.zeros((len(ROW_STATS), 0), jnp.float32))
    part = _partial(z, u, active, x, d, _offsets(0, n), cfg)
    stats, sr = finalize(part, z, y, x, d, active, cfg, with_sr=True)
    if not cfg.CE_TERMS:
        return stats
    # the CE term on the host (O(N)), from Σ r that the finalize kernel merged
    return stats._replace(logp=stats_math.ce_objective(JaxOps, stats.logp, sr, stats.m,
                                                       stats.la_ce, active, cfg))


def finalize(part, z, y, x, d, active, cfg, with_sr=False):
    """Stats of [N] f32 from the partial states part [>= 3, S, N] of z: [N, K] (row-major),
    the targets y [N] read from z (the statistics' finalize kernel; the Triton sampler
    finalises its own split states so too); ``with_sr``: (Stats, Σ r merged over the splits
    with label smoothing, else None)."""
    n, k = z.shape
    s = part.shape[1]
    smooth = with_sr and cfg.SMOOTH
    out = launch(
        kernels.stats_finalize_kernel, (part, z, y, *_per_row(x, d), active.astype(jnp.int8)),
        (n, k, s, k, *_scalars(cfg)),
        jax.ShapeDtypeStruct((len(ROW_STATS) + smooth, n), jnp.float32),  # 40 bytes per row
        (triton.cdiv(n, kernels.FINALIZE_ROWS),), num_warps=kernels.FINALIZE_WARPS,
        BLOCK_N=kernels.FINALIZE_ROWS,
        **cfg.triton_flags(), **({"SMOOTH": True} if smooth else {}))
    stats = stats_math.Stats(*out[:len(ROW_STATS)])
    if not with_sr:
        return stats
    return stats, (out[len(ROW_STATS)] if smooth else None)


def _backward(rows, offsets, stats, grads, cfg):
    z, u, y, active, x, d = (rows.logits, rows.teacher, rows.targets, rows.active,
                             rows.shift_ids, rows.shift)
    n, k, lc = _plan(z, cfg)
    if n == 0:
        return jnp.zeros_like(z), (jnp.zeros_like(u) if cfg.TEACHER_GRAD else None)
    du_type = (jax.ShapeDtypeStruct(u.shape, u.dtype) if cfg.TEACHER_GRAD
               else jax.ShapeDtypeStruct((1,), z.dtype))
    ce_terms = {}
    if cfg.CE_TERMS:  # the CE term's per-row coefficients [3, N] in place of g_lp
        g_y, g_u, g_p = stats_math.ce_coefficients(JaxOps, grads[1], stats_math.Stats(*stats),
                                                   cfg)
        g_u = jnp.zeros_like(g_y) if g_u is None else g_u
        grads = (grads[0], jnp.stack((g_y, g_u, g_p)), grads[2], grads[3])
        ce_terms = {"CE_TERMS": True}
    dz, du = launch(
        kernels.stats_grad_kernel,
        (z, z if u is None else u, y, *_per_row(x, d), active.astype(jnp.int8),
         jnp.stack(stats), *grads, offsets),
        (n, k, k, k, k, k, lc["cols_per_split"], cfg.vocab_limit, *_scalars(cfg)),
        (jax.ShapeDtypeStruct(z.shape, z.dtype), du_type),
        (n, lc["splits"]), num_warps=lc["num_warps"], num_stages=lc["num_stages"],
        TEACHER_GRAD=cfg.TEACHER_GRAD, BLOCK_K=lc["block_k"], ROWS_ALIGNED=kernels.rows_aligned(k),
        **cfg.triton_flags(), **ce_terms)
    return dz, (du if cfg.TEACHER_GRAD else None)


class TritonJax(BackendBase):
    name = "triton"
    custom_vjp = True
    capabilities = Capabilities(vocab_shards=True)

    unsupported_reason = staticmethod(unsupported_reason)

    @staticmethod
    def forward(rows, cfg):
        # the bundle's fields travel flat through the vmap rule and are rebuilt inside
        return stats_math.Stats(*rows_vmappable(lambda *a: tuple(_forward(Rows(*a), cfg)),
                                                 *rows))

    @staticmethod
    def forward_partial(rows, cfg, offset=0):
        # one vocabulary shard whose column 0 has global id ``offset`` -> (State, r_y, found)
        z = rows.logits
        rows_first = lambda *a: jnp.moveaxis(_partial(*a, cfg), 2, 0)  # [N, PARTIAL_STATE, S]
        part = rows_vmappable(rows_first, z, rows.teacher, jnp.ones(z.shape[:1], jnp.int8),
                               rows.shift_ids, rows.shift, _offsets(offset, z.shape[0]))
        splits = [part[:, i] for i in range(part.shape[1])]  # one [N, S] per field
        state = stats_math.merge_splits(JaxOps, splits, cfg)
        return (state, *stats_math.target_logit(JaxOps, rows, cfg, offset))

    @staticmethod
    def backward(rows, stats, grads, cfg, offset=0):
        fields, n_stats = len(Rows._fields), len(ROW_STATS)

        def call(*flat):  # the bundle's fields, the offsets, the statistics, the cotangents
            per_row = flat[fields + 1:]
            return _backward(Rows(*flat[:fields]), flat[fields], per_row[:n_stats],
                             per_row[n_stats:], cfg)

        return rows_vmappable(call, *rows, _offsets(offset, rows.logits.shape[0]), *stats,
                               *grads)


IMPLEMENTATION = TritonJax()
