"""The triton backend for JAX on NVIDIA GPUs: the same kernel source as the torch backend
(``dlm_kernels.kernels.triton.token_stats``), called through ``jax_triton.triton_call``
under the front end's ``custom_vjp``.

jax-triton refuses to import unless jaxlib has GPU support, so on CPU-only machines this
module raises ImportError and the registry records why (``backend="triton"`` then says so).
Install it where it can run: ``pip install jax-triton`` beside ``jax[cuda]``.
"""

from __future__ import annotations

try:
    import jax_triton as jt
except Exception as err:  # noqa: BLE001 - jax-triton raises ImportError or RuntimeError
    raise ImportError(
        f"jax-triton is not importable here (it needs a GPU-enabled jaxlib): {err}") from err

import jax
import jax.numpy as jnp
import triton

from .. import _stats_math as M
from ..kernels.triton import token_stats as K


def _num_sms():
    dev = jax.local_devices()[0]
    return int(getattr(dev, "core_count", 0) or 132)


def _scalars(cfg):
    return (1.0 / cfg.temperature, 1.0 / cfg.ce_temperature, 1.0 / cfg.teacher_temperature,
            float(cfg.softcap or 0.0))


def _flags(cfg, has_shift):
    return dict(HAS_SOFTCAP=cfg.softcap is not None, HAS_SHIFT=has_shift,
                HAS_TEACHER=cfg.has_teacher, SEPARATE_CE=cfg.separate_ce)


def _plan(z, cfg):
    n, k = z.shape
    return n, k, K.launch_config(n, k, jnp.dtype(z.dtype).itemsize, cfg.has_teacher, _num_sms(),
                                 cfg.chunk_size)


class TritonJax:
    name = "triton"
    custom_vjp = True

    @staticmethod
    def unsupported_reason(platform):
        if platform in ("gpu", "cuda"):
            return None
        return f"the Triton kernels run on NVIDIA GPUs only (arrays are on {platform!r})"

    @staticmethod
    def forward(z, u, y, active, x, d, cfg):
        # z, u: [N, K] (row-major, so row stride K); y, active, x, d: [N] -> Stats
        n, k, lc = _plan(z, cfg)
        s = lc["splits"]
        inv_t, inv_t_ce, inv_t_kl, softcap = _scalars(cfg)
        act = active.astype(jnp.int8)
        xs = y if x is None else x
        ds = jnp.zeros((1,), jnp.float32) if d is None else d
        flags = _flags(cfg, x is not None)
        part = jt.triton_call(
            z, z if u is None else u, xs, ds, act, n, k, k, k, lc["cols_per_split"], 0, k,
            inv_t, inv_t_ce, inv_t_kl, softcap,
            kernel=K.stats_partial_kernel,
            out_shape=jax.ShapeDtypeStruct((8, s, n), jnp.float32),  # 32·S bytes per row
            grid=(n, s), num_warps=lc["num_warps"], num_stages=lc["num_stages"],
            BLOCK_K=lc["block_k"], **flags)
        block_n, block_s = K.finalize_blocks(s)
        out = jt.triton_call(
            part, z, y, xs, ds, act, n, k, s, k, inv_t_ce, softcap,
            kernel=K.stats_finalize_kernel,
            out_shape=jax.ShapeDtypeStruct((7, n), jnp.float32),  # 28 bytes per row
            grid=(triton.cdiv(n, block_n),), num_warps=4,
            BLOCK_N=block_n, BLOCK_S=block_s, **flags)
        return M.Stats(*out)

    @staticmethod
    def backward(z, u, y, active, x, d, stats, grads, cfg):
        n, k, lc = _plan(z, cfg)
        inv_t, inv_t_ce, inv_t_kl, softcap = _scalars(cfg)
        xs = y if x is None else x
        ds = jnp.zeros((1,), jnp.float32) if d is None else d
        du_shape = (jax.ShapeDtypeStruct(u.shape, u.dtype) if cfg.teacher_grad
                    else jax.ShapeDtypeStruct((1,), z.dtype))
        dz, du = jt.triton_call(
            z, z if u is None else u, y, xs, ds, active.astype(jnp.int8), jnp.stack(stats),
            *grads, n, k, k, k, k, k, lc["cols_per_split"], 0, k, inv_t, inv_t_ce, inv_t_kl,
            softcap,
            kernel=K.stats_grad_kernel,
            out_shape=(jax.ShapeDtypeStruct(z.shape, z.dtype), du_shape),
            grid=(n, lc["splits"]), num_warps=lc["num_warps"], num_stages=lc["num_stages"],
            TEACHER_GRAD=cfg.teacher_grad, BLOCK_K=lc["block_k"], **_flags(cfg, x is not None))
        return dz, (du if cfg.teacher_grad else None)


IMPLEMENTATION = TritonJax()
