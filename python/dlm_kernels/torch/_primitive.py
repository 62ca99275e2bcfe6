"""``token_stats`` for torch: validation, dispatch and the autograd.Function (custom VJP)."""

from __future__ import annotations

import importlib

import torch

from .._dispatch import Registry
from .._stats_api import TOKEN_STATS_DOC, TokenStats, prepare
from .._stats_math import Stats
from ._ops import TorchOps

REGISTRY = Registry("torch")

# Backends in preference-independent order; each module defines IMPLEMENTATION on import.
_BACKEND_MODULES = {
    "reference": "dlm_kernels.torch._reference",
    "chunked": "dlm_kernels.torch._chunked",
    "triton": "dlm_kernels.torch._triton",
}


def _register_backends():
    for name, module in _BACKEND_MODULES.items():
        try:
            REGISTRY.register(importlib.import_module(module).IMPLEMENTATION)
        except ImportError as err:
            REGISTRY.mark_unavailable(name, f"import failed ({err})")


_register_backends()


class _TokenStatsFunction(torch.autograd.Function):
    """Custom VJP: saves the inputs plus O(N) float32 row statistics, never [N, K]."""

    @staticmethod
    def forward(ctx, z, u, y, active, x, d, impl, cfg, inplace):
        stats = impl.forward(z, u, y, active, x, d, cfg)
        ctx.save_for_backward(z, u, y, active, x, d, *stats)
        ctx.impl, ctx.cfg, ctx.inplace = impl, cfg, inplace
        return stats.lse, stats.logp, stats.entropy, stats.kl

    @staticmethod
    def backward(ctx, g_lse, g_lp, g_h, g_kl):
        z, u, y, active, x, d, *saved = ctx.saved_tensors
        grads = tuple(g.float() for g in (g_lse, g_lp, g_h, g_kl))
        dz, du = ctx.impl.backward(z, u, y, active, x, d, Stats(*saved), grads, ctx.cfg,
                                   inplace=ctx.inplace)
        return dz, du, None, None, None, None, None, None, None


def token_stats(logits, targets, weights=None, *, temperature=1.0, ce_temperature=None,
                softcap=None, shift_ids=None, shift=None, teacher_logits=None,
                teacher_temperature=None, teacher_grad=False, chunk_size=None, inplace_grad=False,
                backend=None):
    cfg, rows, (z, u, y, active, x, d) = prepare(
        TorchOps, logits, targets, weights, temperature=temperature,
        ce_temperature=ce_temperature, softcap=softcap, shift_ids=shift_ids, shift=shift,
        teacher_logits=teacher_logits, teacher_temperature=teacher_temperature,
        teacher_grad=teacher_grad, chunk_size=chunk_size)
    impl = REGISTRY.resolve(backend, logits.device.type)
    if u is not None and not cfg.teacher_grad:
        u = u.detach()
    if inplace_grad and not getattr(impl, "supports_inplace_grad", False):
        raise ValueError(f"inplace_grad=True is not supported by backend {impl.name!r}; "
                         "use 'chunked' or 'triton'")
    if impl.custom_vjp:
        outs = _TokenStatsFunction.apply(z, u, y, active, x, d, impl, cfg, bool(inplace_grad))
    else:
        outs = impl.compute(z, u, y, active, x, d, cfg)
    return TokenStats(*(o.reshape(rows) for o in outs))


token_stats.__doc__ = TOKEN_STATS_DOC


def backend_for(logits, backend=None) -> str:
    """The name of the backend ``backend`` (None = auto) resolves to for these logits."""
    return REGISTRY.resolve(backend, logits.device.type).name
