"""``token_stats`` for JAX: validation, dispatch and the ``jax.custom_vjp``."""

from __future__ import annotations

import functools
import importlib

import jax
import jax.numpy as jnp

from .._dispatch import Registry
from .._stats_api import TOKEN_STATS_DOC, TokenStats, prepare
from ._ops import JaxOps

REGISTRY = Registry("jax")

_BACKEND_MODULES = {
    "reference": "dlm_kernels.jax._reference",
    "chunked": "dlm_kernels.jax._chunked",
    "triton": "dlm_kernels.jax._triton",
    "pallas": "dlm_kernels.jax._pallas",
}


def _register_backends():
    for name, module in _BACKEND_MODULES.items():
        try:
            REGISTRY.register(importlib.import_module(module).IMPLEMENTATION)
        except ImportError as err:
            REGISTRY.mark_unavailable(name, f"import failed ({err})")


_register_backends()


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _token_stats_vjp(impl, cfg, z, u, y, active, x, d):
    return tuple(impl.forward(z, u, y, active, x, d, cfg)[:4])


def _token_stats_fwd(impl, cfg, z, u, y, active, x, d):
    stats = impl.forward(z, u, y, active, x, d, cfg)
    # Residuals: the inputs plus six [N] float32 row statistics, never [N, K].
    return tuple(stats[:4]), (z, u, y, active, x, d, stats)


def _token_stats_bwd(impl, cfg, residuals, cotangents):
    z, u, y, active, x, d, stats = residuals
    grads = tuple(g.astype(jnp.float32) for g in cotangents)
    dz, du = impl.backward(z, u, y, active, x, d, stats, grads, cfg)
    if u is not None and du is None:
        du = jnp.zeros_like(u)  # the teacher is stop-gradient unless teacher_grad=True
    return dz, du, None, None, None, None


_token_stats_vjp.defvjp(_token_stats_fwd, _token_stats_bwd)


def token_stats(logits, targets, weights=None, *, temperature=1.0, ce_temperature=None,
                softcap=None, shift_ids=None, shift=None, teacher_logits=None,
                teacher_temperature=None, teacher_grad=False, chunk_size=None, inplace_grad=False,
                backend=None):
    if inplace_grad:
        raise ValueError("inplace_grad=True is torch-only: JAX arrays are immutable (donate the "
                         "logits buffer to jit to let XLA reuse it instead)")
    cfg, rows, (z, u, y, active, x, d) = prepare(
        JaxOps, logits, targets, weights, temperature=temperature,
        ce_temperature=ce_temperature, softcap=softcap, shift_ids=shift_ids, shift=shift,
        teacher_logits=teacher_logits, teacher_temperature=teacher_temperature,
        teacher_grad=teacher_grad, chunk_size=chunk_size)
    impl = REGISTRY.resolve(backend, JaxOps.platform(logits))
    if u is not None and not cfg.teacher_grad:
        u = jax.lax.stop_gradient(u)
    if impl.custom_vjp:
        outs = _token_stats_vjp(impl, cfg, z, u, y, active, x, d)
    else:
        outs = impl.compute(z, u, y, active, x, d, cfg)
    return TokenStats(*(o.reshape(rows) for o in outs))


token_stats.__doc__ = TOKEN_STATS_DOC


def backend_for(logits, backend=None) -> str:
    """The name of the backend ``backend`` (None = auto) resolves to for this array."""
    return REGISTRY.resolve(backend, JaxOps.platform(logits)).name
