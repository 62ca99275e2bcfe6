"""``token_stats`` for JAX: the ``jax.custom_vjp``, the shard_map merge, and the JAX side of
the front-end shell."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from . import formulas as stats_math
from .._jax.first_order import first_order
from ..linear_head.jax_head import apply_head
from .._jax.ops import JaxOps
from .._jax.vocab_parallel import vocab_parallel_stats
from .._config import ROW_GROUP, padded_rows
from .._rows import Rows


def _cotangent(rows, stats, grads, cfg, impl, offset=None, axis=None):
    """The bundle's cotangent: the backend's d(logits), d(teacher), and d(shift) from the
    shifted column (summed over the vocabulary shards of ``axis``: one of them holds it)."""
    columns = None
    if cfg.HAS_SHIFT:
        columns = stats_math.shift_columns(JaxOps, rows, cfg, 0 if offset is None else offset)
    kw = {} if offset is None else {"offset": offset}
    dz, du = impl.backward(rows, stats, grads, cfg, **kw)
    if rows.teacher is not None and du is None:
        du = jnp.zeros_like(rows.teacher)  # the teacher is stop-gradient unless teacher_grad
    d_shift = None
    if columns is not None:
        d_shift = _shift_grad(columns, rows, stats, grads, cfg)
        if axis is not None:
            d_shift = jax.lax.psum(d_shift, axis)
    return rows.gradients(dz, du, d_shift)


def _shift_grad(columns, rows, stats, grads, cfg):
    """``stats_math.shift_grad`` ([N] float32) computed over rows padded to a multiple of
    ``ROW_GROUP``: XLA's CPU compiler computes the exp of the last N mod 8 lanes of an [N]
    array with other code than the rest, so a row's bits would depend on N and its position
    (docs/design.md §2, "One row, one answer"). The padding copies O(N) numbers."""
    n = rows.targets.shape[0]
    pad = lambda x: JaxOps.pad_rows(x, padded_rows(n, ROW_GROUP))  # noqa: E731
    small = Rows(None, targets=pad(rows.targets), active=pad(rows.active),
                 shift_ids=pad(rows.shift_ids), shift=pad(rows.shift))
    d_shift = stats_math.shift_grad(JaxOps, tuple(map(pad, columns)), small,
                                    type(stats)(*map(pad, stats)), tuple(map(pad, grads)), cfg)
    return d_shift[:n]


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _token_stats_vjp(impl, cfg, rows):
    return stats_math.public_stats(impl.forward(rows, cfg))


def _token_stats_fwd(impl, cfg, rows):
    stats = first_order(impl.name, lambda rows: impl.forward(rows, cfg), rows)
    # Residuals: the row bundle plus the row statistics (one [N] float32 array per field of
    # ROW_STATS, kernels/layout.py), never [N, K].
    return stats_math.public_stats(stats), (rows, stats)


def _token_stats_bwd(impl, cfg, residuals, cotangents):
    rows, stats = residuals
    grads = tuple(g.astype(jnp.float32) for g in cotangents)
    rule = lambda rows, stats, grads: _cotangent(rows, stats, grads, cfg, impl)
    return (first_order(impl.name, rule, rows, stats, grads),)


_token_stats_vjp.defvjp(_token_stats_fwd, _token_stats_bwd)

#: ``_token_stats_vjp`` as one program per (backend, lowered configuration, shapes), cached:
#: an eager call (no enclosing jit) otherwise traces its loops afresh every time (a
#: ``lax.fori_loop`` of a new closure compiles again: about 0.2 s a call on a CPU), and its
#: values are then those of the same call under ``jax.jit`` (inside one, it is inlined)
_token_stats_program = jax.jit(_token_stats_vjp, static_argnums=(0, 1))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _vocab_parallel_vjp(impl, cfg, axis, rows):
    return _vocab_parallel_forward(impl, cfg, axis, rows)[0]


def _vocab_parallel_fwd(impl, cfg, axis, rows):
    return first_order(impl.name, lambda rows: _vocab_parallel_forward(impl, cfg, axis, rows),
                       rows)


def _vocab_parallel_forward(impl, cfg, axis, rows):
    stats, offset = vocab_parallel_stats(rows, impl, cfg, axis)
    return stats_math.public_stats(stats), (rows, stats, offset)


def _vocab_parallel_bwd(impl, cfg, axis, residuals, cotangents):
    rows, stats, offset = residuals
    grads = tuple(g.astype(jnp.float32) for g in cotangents)
    rule = lambda rows, stats, grads, offset: _cotangent(rows, stats, grads, cfg, impl, offset,
                                                         axis)
    return (first_order(impl.name, rule, rows, stats, grads, offset),)


_vocab_parallel_vjp.defvjp(_vocab_parallel_fwd, _vocab_parallel_bwd)

class JaxVJP:
    """The JAX side of the front-end shell (``dlm_kernels.token_stats.op``)."""

    inplace_grad = False  # arrays are immutable
    apply_head = staticmethod(apply_head)

    @staticmethod
    def apply(impl, cfg, rows, inplace, axis):
        if axis is not None:
            return _vocab_parallel_vjp(impl, cfg, axis, rows)
        return _token_stats_program(impl, cfg, rows)

    @staticmethod
    def check_shard(axis, bound=True):
        names = axis if isinstance(axis, tuple) else (axis,)
        if not names or not all(isinstance(name, str) for name in names):
            got = repr(axis) if isinstance(axis, tuple) else type(axis).__name__
            raise TypeError(f"vocab_axis must be a mesh axis name (a str such as 'vocab', or a "
                            f"tuple of them); got {got}")
        if bound:
            try:
                jax.lax.axis_size(axis)
            except NameError:
                raise ValueError(
                    f"vocab_axis {axis!r} is not an axis of the enclosing jax.shard_map: call "
                    f"inside jax.shard_map over a mesh with that axis") from None

    @staticmethod
    def shards(axis) -> int:
        return 1 if axis is None else jax.lax.axis_size(axis)
