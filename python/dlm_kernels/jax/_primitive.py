"""``token_stats`` for JAX: validation, dispatch and the ``jax.custom_vjp``."""

from __future__ import annotations

import contextlib
import contextvars
import functools

import jax
import jax.numpy as jnp

from .._dispatch import Registry
from .. import _stats_math as M
from .._stats_api import (TOKEN_STATS_DOC, apply_vocab_parallel, prepare, public_stats,
                          require_dtype, shard_capable)
from ._ops import JaxOps

REGISTRY = Registry("jax")

REGISTRY.load()  # every row of the backend table (_dispatch.BACKENDS) with a JAX module


def _cotangent(rows, dz, du):
    if rows.teacher is not None and du is None:
        du = jnp.zeros_like(rows.teacher)  # the teacher is stop-gradient unless teacher_grad
    return rows.gradients(dz, du)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _token_stats_vjp(impl, cfg, rows):
    return tuple(impl.forward(rows, cfg)[:4])


def _token_stats_fwd(impl, cfg, rows):
    stats = impl.forward(rows, cfg)
    # Residuals: the row bundle plus seven [N] float32 row statistics, never [N, K].
    return tuple(stats[:4]), (rows, stats)


def _token_stats_bwd(impl, cfg, residuals, cotangents):
    rows, stats = residuals
    grads = tuple(g.astype(jnp.float32) for g in cotangents)
    return (_cotangent(rows, *impl.backward(rows, stats, grads, cfg)),)


_token_stats_vjp.defvjp(_token_stats_fwd, _token_stats_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _vocab_parallel_vjp(impl, cfg, axis, rows):
    return _vocab_parallel_fwd(impl, cfg, axis, rows)[0]


def _vocab_parallel_fwd(impl, cfg, axis, rows):
    # rows.logits: this device's vocabulary shard [N, K_local] of the mesh axis ``axis``
    offset = jax.lax.axis_index(axis) * rows.logits.shape[1]
    state, r_y, found = impl.forward_partial(rows, cfg, offset)
    state, (r_y, found) = M.merge_collective(
        JaxOps, state, lambda v: jax.lax.pmax(v, axis), lambda v: jax.lax.psum(v, axis), cfg,
        [r_y, found])
    stats = M.finalize(JaxOps, state, r_y, found, rows.active, cfg)
    return tuple(stats[:4]), (rows, stats, offset)


def _vocab_parallel_bwd(impl, cfg, axis, residuals, cotangents):
    rows, stats, offset = residuals
    grads = tuple(g.astype(jnp.float32) for g in cotangents)
    return (_cotangent(rows, *impl.backward(rows, stats, grads, cfg, offset=offset)),)


_vocab_parallel_vjp.defvjp(_vocab_parallel_fwd, _vocab_parallel_bwd)

_VOCAB_PARALLEL = contextvars.ContextVar("dlm_kernels_jax_vocab_parallel", default=None)


@contextlib.contextmanager
def vocab_parallel(vocab_axis, vocab_size=None):
    """Within this block (traced inside ``jax.shard_map``), every objective treats its logits
    as this device's shard of the mesh axis ``vocab_axis`` (as ``token_stats(...,
    vocab_axis=..., vocab_size=...)`` does)."""
    token = _VOCAB_PARALLEL.set((vocab_axis, vocab_size))
    try:
        yield
    finally:
        _VOCAB_PARALLEL.reset(token)


def vocab_extent(logits) -> int:
    """The full vocabulary the logits' last axis belongs to (K·axis size inside vocab_parallel)."""
    ctx = _VOCAB_PARALLEL.get()
    if ctx is None:
        return logits.shape[-1]
    axis, vocab_size = ctx
    return vocab_size or logits.shape[-1] * jax.lax.axis_size(axis)


def token_stats(logits, targets, weights=None, *, temperature=1.0, ce_temperature=None,
                softcap=None, shift_ids=None, shift=None, teacher_logits=None,
                teacher_temperature=None, teacher_grad=False, entropy=True, chunk_size=None,
                inplace_grad=False,
                vocab_size=None, vocab_axis=None, backend=None):
    if inplace_grad:
        raise ValueError("inplace_grad=True is torch-only: JAX arrays are immutable (donate the "
                         "logits buffer to jit to let XLA reuse it instead)")
    vocab_axis, vocab_size, logits, teacher_logits = apply_vocab_parallel(
        vocab_axis, _VOCAB_PARALLEL.get(), vocab_size, logits, teacher_logits)
    cfg, lead, rows = prepare(
        JaxOps, logits, targets, weights, temperature=temperature,
        ce_temperature=ce_temperature, softcap=softcap, shift_ids=shift_ids, shift=shift,
        teacher_logits=teacher_logits, teacher_temperature=teacher_temperature,
        teacher_grad=teacher_grad, entropy=entropy, chunk_size=chunk_size,
        vocab_size=vocab_size)
    impl = REGISTRY.resolve(backend, JaxOps.platform(logits))
    require_dtype(impl, logits)
    if rows.teacher is not None and not cfg.teacher_grad:
        rows = rows._replace(teacher=jax.lax.stop_gradient(rows.teacher))
    if vocab_axis is not None:
        impl = shard_capable(REGISTRY, impl, backend)
        outs = _vocab_parallel_vjp(impl, cfg, vocab_axis, rows)
    elif impl.custom_vjp:
        outs = _token_stats_vjp(impl, cfg, rows)
    else:
        outs = impl.compute(rows, cfg)
    extent = None
    if rows.shift_ids is not None:  # the full vocabulary the shift ids index
        shards = 1 if vocab_axis is None else jax.lax.axis_size(vocab_axis)
        extent = cfg.vocab_size or rows.logits.shape[1] * shards
    return public_stats(JaxOps, outs, lead, cfg, rows, extent)


token_stats.__doc__ = TOKEN_STATS_DOC


def backend_for(logits, backend=None) -> str:
    """The name of the backend ``backend`` (None = auto) resolves to for this array."""
    return REGISTRY.resolve(backend, JaxOps.platform(logits)).name
