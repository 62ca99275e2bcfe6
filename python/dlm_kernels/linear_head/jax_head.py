"""The linear head for JAX: ``LinearHead`` (a pytree; weight [D, K] by default, as a Flax
``Dense`` kernel holds it; "KD" for a tied ``nnx.Embed`` table) and the custom VJPs that run
a backend's kernels over token chunks of ``hidden @ weight`` inside ``lax.fori_loop`` (the
math and the two gradient schedules: ``dlm_kernels.linear_head.head``).

Token chunks are taken with ``lax.dynamic_slice`` (no padded copy of the hidden states):
N need not divide by the chunk R, the last chunk starts at N - R and its rows that an
earlier chunk already covered are treated as inactive (zero gradient) and keep the values
written before.
"""

from __future__ import annotations

import functools

from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.custom_derivatives import SymbolicZero

from . import head as base
from ..token_stats import formulas as stats_math
from .head import HEAD_CHUNK_BYTES_CPU_JAX, HIDDEN_MAJOR, VOCAB_MAJOR, DenseLogits, row_chunk_for
from .._rows import Rows
from ..token_stats.formulas import Stats
from .._jax.first_order import first_order
from .._jax.ops import JaxOps
from .._jax.vocab_parallel import vocab_parallel_stats
from .._dispatch import FUSED_HEAD, registry
from ..token_stats.jax_chunked import unseen_trip_loop, varying_like

#: kernels that run a whole head, by backend name (``linear_head.jax_pallas``)
_FUSED_HEADS = registry(FUSED_HEAD, "jax")


@jax.tree_util.register_pytree_node_class
class LinearHead(base.LinearHead[jax.Array]):
    """``logits = cap(hidden @ weight (+ bias))`` of JAX arrays (``softcap=c``: cap(z) =
    c·tanh(z / c), else z), given in place of a logits array:
    ``LinearHead(hidden, weight, bias=None, softcap=None, *, weight_layout, row_chunk)``;
    weight [D, K] by default (a Flax ``Dense`` kernel), or [K, D] with
    ``weight_layout="KD"`` (a tied embedding table). A pytree; gradients flow to hidden,
    weight and bias; no backend but "reference" forms the [N, K] logits
    (``dlm_kernels.linear_head.head.LinearHead`` has the whole story)."""

    DEFAULT_LAYOUT: str = HIDDEN_MAJOR  # a Flax Dense kernel: [D, K]

    def tree_flatten(self) -> tuple[tuple[Any, Any, Any], tuple[str, int | None, float | None]]:
        """(hidden, weight, bias) as leaves; the layout, row chunk and softcap (a Python
        float: part of what jit traces for) as static metadata."""
        return ((self.hidden, self.weight, self.bias),
                (self.weight_layout, self.row_chunk, self.softcap))

    @classmethod
    def tree_unflatten(cls, aux: tuple[str, int | None, float | None],
                       children: tuple[Any, Any, Any]) -> LinearHead:
        """The head rebuilt from ``tree_flatten``'s parts, unchecked."""
        head = object.__new__(cls)  # leaves may be tracers, sentinels or None: no checks
        head.hidden, head.weight, head.bias = children
        head.weight_layout, head.row_chunk, head.softcap = aux
        return head


# a logits array beside a head in the rows of the head path: a pytree of that one array
jax.tree_util.register_pytree_node(DenseLogits, lambda x: ((x.array,), None),
                                   lambda _, children: DenseLogits(children[0]))


def _dot_f32(a, b):  # a @ b accumulated and returned in float32 (float64 stays float64)
    out = jnp.promote_types(a.dtype, jnp.float32)
    return jnp.matmul(a, b, preferred_element_type=out)


def _rows_dot_f32(a, b):  # ``_dot_f32`` of rows' own values (d hidden): JaxOps.rows_matmul
    return JaxOps.rows_matmul(a, b, jnp.promote_types(a.dtype, jnp.float32))


def _acc_dtype(x):
    return jnp.promote_types(x.dtype, jnp.float32)


# The head path's token chunks, its vocabulary chunk and a head's logits are the ops
# adapter's (JaxOps.head_token_chunks, head_vocab_chunk, head_logits), which the
# framework-neutral code (linear_head.head, the sampler) calls too.


def _slice(a, start, r):
    return lax.dynamic_slice_in_dim(a, start, r, axis=0)


def _put(buf, start, new, fresh):
    """buf with rows [start, start + R) set to ``new`` where ``fresh`` ([R] bool)."""
    old = _slice(buf, start, new.shape[0])
    mask = fresh.reshape((-1,) + (1,) * (new.ndim - 1))
    return lax.dynamic_update_slice_in_dim(buf, jnp.where(mask, new, old), start, axis=0)


class _ArrayPart:
    """The gradient of a logits array in the rows of the head path (a teacher's, or a
    student's beside a teacher head): [N, K] in its dtype, each chunk's rows put in."""

    def __init__(self, x):
        self.x = x  # [N, K]

    def zeros(self):
        return jnp.zeros(self.x.shape, self.x.dtype)

    def add(self, acc, g, start, fresh, r):
        return _put(acc, start, g, fresh)

    def cotangent(self, acc, scale):
        g = acc if scale is None else (acc.astype(jnp.float32) * scale).astype(acc.dtype)
        return DenseLogits(_summed_like(g, self.x))


class _HeadPart:
    """The gradients of a head: float32 (dH, dW, db) accumulated chunk by chunk."""

    def __init__(self, head):
        self.head = head

    def zeros(self):
        z = lambda a: None if a is None else jnp.zeros(a.shape, _acc_dtype(a))
        return (z(self.head.hidden), z(self.head.weight), z(self.head.bias))

    def add(self, acc, g, start, fresh, r):
        x = self.head
        dh, dw, db = acc
        w, h = x.weight, _slice(x.hidden, start, r)
        major = x.weight_layout == VOCAB_MAJOR
        g = _through_cap(x, g, lambda: JaxOps.head_logits(x.without_softcap().replace(hidden=h)))
        # [R, K] x [K, D] -> dH rows; [K, R] x [R, D] (or [D, R] x [R, K]) -> dW: R·K·D each
        dh = _put(dh, start, _rows_dot_f32(g, w if major else w.T), fresh)
        dw = dw + (_dot_f32(g.T, h) if major else _dot_f32(h.T, g))
        db = None if db is None else db + jnp.sum(g, axis=0, dtype=db.dtype)
        return (dh, dw, db)

    def cotangent(self, acc, scale):
        x = self.head
        parts = []
        for g, like in zip(acc, (x.hidden, x.weight, x.bias)):
            if g is not None and scale is not None:
                g = g * scale
            parts.append(None if g is None else _summed_like(g, like).astype(like.dtype))
        return x.replace(*parts)


def _through_cap(head, g, raw):
    """g: the gradient of a head's chunk of logits; with a softcap (a teacher head's, applied
    where its chunk is formed) the chunk is cap(z), so g·cap'(z) of the chunk's uncapped
    logits z = ``raw()`` (a matmul formed again), in the head's dtype as any d(logits)."""
    if head.softcap is None:
        return g
    slope = stats_math.softcap_slope(JaxOps, raw().astype(jnp.float32), head.softcap)
    return (g.astype(jnp.float32) * slope).astype(head.dtype)


class _Parts:
    """The gradient part of one source of the rows, by its kind (``LogitsSource.accept``)."""

    array = staticmethod(_ArrayPart)
    head = staticmethod(_HeadPart)


_PARTS = _Parts()


class _Sweep:
    """One pass over the token chunks of a head's rows (see the torch twin in
    ``dlm_kernels.linear_head.torch_head``): statistics when not given, and given per-row
    cotangents the float32 gradients of the heads (and of a teacher array)."""

    def __init__(self, impl, cfg, rows, axis):
        self.impl, self.cfg, self.rows, self.axis = impl, cfg, rows, axis
        self.plan = base.head_plan(rows.logits, rows.teacher, cfg.TEACHER_GRAD)  # once
        z = rows.logits  # rows of LogitsSources: the logits and/or the teacher a head
        self.n, k = rows.targets.shape[0], z.shape[-1]
        on_cpu = jax.default_backend() == "cpu"
        self.r = row_chunk_for(self.n, k, jnp.dtype(z.dtype).itemsize, on_cpu, z.row_chunk,
                               HEAD_CHUNK_BYTES_CPU_JAX)
        self.n_chunks = -(-self.n // self.r)

    def _chunk(self, start, fresh):
        r, rows = self.r, self.rows
        take = lambda a: _slice(a, start, r)
        part = lambda x: None if x is None else x.chunk(JaxOps, take)
        sl = lambda a: None if a is None else take(a)
        return Rows(part(rows.logits), part(rows.teacher), sl(rows.targets),
                    sl(rows.active) & fresh, sl(rows.shift_ids), sl(rows.shift))

    def _offset(self, k_local):
        return 0 if self.axis is None else lax.axis_index(self.axis) * k_local

    def _stats(self, rc):
        if self.axis is None:
            return self.impl.forward(rc, self.cfg)
        return vocab_parallel_stats(rc, self.impl, self.cfg, self.axis)[0]

    def _zero_grads(self):
        """The float32 accumulators: per part (student, teacher) a head's (dH, dW, db), an
        array's gradient [N, K] in its dtype, or None."""
        def zeros(x, wanted):
            return None if x is None or not wanted else x.accept(_PARTS).zeros()

        return (zeros(self.rows.logits, True),
                zeros(self.rows.teacher, self.cfg.TEACHER_GRAD))

    def _add(self, acc, x, g, start, fresh):
        if acc is None:
            return None
        return x.accept(_PARTS).add(acc, g, start, fresh, self.r)

    @property
    def fused(self):
        """The fused head kernels of the backend's name (the head op's registry) when they
        take these rows (else None): they return gradients already in the inputs' dtypes."""
        fused = _FUSED_HEADS.IMPLEMENTATIONS.get(self.impl.name)
        takes = fused is not None and fused.takes(self.rows, self.axis, self.plan)
        return fused if takes else None

    def blocks(self):
        """The vocabulary blocks of the gradient pass (``base.dw_blocks``), or None for token
        chunks over the whole vocabulary: blocks when a 16-bit student head's float32 dW
        would pass ``HEAD_DW_ACC_BYTES``, outside a vocabulary-parallel map, with no teacher
        head needing a gradient, on a backend whose backward takes a column offset (the
        schedule of the torch twin)."""
        z = self.rows.logits
        if (not self.plan.student_head_grad_only or self.axis is not None
                or not self.impl.capabilities.vocab_shards
                or jnp.dtype(z.weight.dtype) in (jnp.float32, jnp.float64)):
            return None
        return base.dw_blocks(z.vocab, z.width, base.HEAD_DW_ACC_BYTES)

    def run_blocked(self, stats, grads, blocks):
        """The gradient pass over vocabulary blocks (outer, unrolled) and token chunks
        (inner): each block's logits [R, K_b] and d(logits) from the row statistics as for a
        vocabulary shard at its offset; dH (and db) accumulate across blocks in float32,
        each block's float32 dW [K_b, D] is finished and rounded to the weight's dtype
        before the next, so no float32 [K, D] accumulator exists."""
        rows, cfg, r, n = self.rows, self.cfg, self.r, self.n
        z, u = rows.logits, rows.teacher
        major = z.weight_layout == VOCAB_MAJOR
        # blocks run only when no teacher head needs a gradient: a teacher needing one is an
        # array, its [N, K] gradient written block by block
        teacher_grad = u is not None and cfg.TEACHER_GRAD
        sl = lambda a, start: None if a is None else _slice(a, start, r)
        cols = lambda a, b0, b1: a[b0:b1] if major else a[:, b0:b1]  # a weight's columns
        dh = jnp.zeros(z.hidden.shape, _acc_dtype(z.hidden))  # [N, D]
        db = None if z.bias is None else jnp.zeros(z.bias.shape, _acc_dtype(z.bias))  # [K]
        du = jnp.zeros(u.shape, u.dtype) if teacher_grad else None  # [N, K]
        dw = []
        for b0, b1 in blocks:
            w_b = cols(z.weight, b0, b1)  # [K_b, D] or [D, K_b]
            b_b = None if z.bias is None else z.bias[b0:b1]

            def teacher_chunk(start, b0=b0, b1=b1):
                take = lambda a: _slice(a, start, r)
                return None if u is None else u.chunk(JaxOps, take, (b0, b1))

            def body(i, carry, b0=b0, b1=b1, w_b=w_b, b_b=b_b, teacher_chunk=teacher_chunk):
                dh, dw_b, db, du = carry
                start = jnp.minimum(i * r, n - r)
                fresh = start + jnp.arange(r) >= i * r  # rows no earlier chunk covered
                h = _slice(z.hidden, start, r)  # [R, D]
                logits = JaxOps.head_logits(z.replace(hidden=h, weight=w_b, bias=b_b))  # [R, K_b]
                rc = Rows(logits, teacher_chunk(start), sl(rows.targets, start),
                          sl(rows.active, start) & fresh, sl(rows.shift_ids, start),
                          sl(rows.shift, start))
                sc = Stats(*(_slice(s, start, r) for s in stats))
                gc = tuple(_slice(g, start, r) for g in grads)
                dz, du_c = self.impl.backward(rc, sc, gc, cfg, offset=b0)  # stale rows: 0
                # [R, K_b] x [K_b, D] -> dH rows; [K_b, R] x [R, D] -> dW_b: R·K_b·D each
                dh = _put(dh, start,
                          _slice(dh, start, r) + _rows_dot_f32(dz, w_b if major else w_b.T),
                          fresh)
                dw_b = dw_b + (_dot_f32(dz.T, h) if major else _dot_f32(h.T, dz))
                if db is not None:
                    db = db.at[b0:b1].add(jnp.sum(dz, axis=0, dtype=db.dtype))
                if du is not None:
                    at = (jnp.int32(start), jnp.int32(b0))  # one index dtype, x64 or not
                    old = lax.dynamic_slice(du, at, du_c.shape)
                    du = lax.dynamic_update_slice(du, jnp.where(fresh[:, None], du_c, old), at)
                return dh, dw_b, db, du

            dh, dw_b, db, du = self._chunk_loop(
                body, (dh, jnp.zeros(w_b.shape, _acc_dtype(w_b)), db, du), rows, stats, grads)
            dw.append(dw_b.astype(z.weight.dtype))
        return stats, ((dh, jnp.concatenate(dw, axis=0 if major else 1), db), du)

    def run(self, stats=None, grads=None):
        """-> (Stats [N] f32 fields, accumulators or None)."""
        if self.n == 0:  # no rows: no token chunk (a chunk of one row cannot be sliced)
            empty = Stats(*(jnp.zeros((0,), jnp.float32) for _ in Stats._fields))
            return (empty if stats is None else stats,
                    None if grads is None else self._zero_grads())
        fused = self.fused
        if stats is not None and grads is not None:
            blocks = None if fused is not None else self.blocks()
            if blocks is not None:
                return self.run_blocked(stats, grads, blocks)
        if fused is not None:  # one kernel per pass
            if stats is None:
                stats = fused.forward(self.rows, self.cfg)
            return stats, (None if grads is None else
                           fused.backward(self.rows, stats, grads, self.cfg))
        r, n, cfg, rows = self.r, self.n, self.cfg, self.rows
        given = stats is not None
        stats0 = stats if given else Stats(*(jnp.zeros((n,), jnp.float32)
                                             for _ in Stats._fields))
        acc0 = None if grads is None else self._zero_grads()

        def body(i, carry):
            stats, acc = carry
            start = jnp.minimum(i * r, n - r)
            fresh = start + jnp.arange(r) >= i * r  # rows no earlier chunk covered
            rc = self._chunk(start, fresh)
            if given:
                sc = Stats(*(_slice(s, start, r) for s in stats))
            else:
                sc = self._stats(rc)
                stats = Stats(*(_put(s, start, c, fresh) for s, c in zip(stats, sc)))
            if acc is not None:
                kw = {} if self.axis is None else {"offset": self._offset(rc.logits.shape[1])}
                gc = tuple(_slice(g, start, r) for g in grads)
                dz, du = self.impl.backward(rc, sc, gc, cfg, **kw)
                acc = (self._add(acc[0], rows.logits, dz, start, fresh),
                       self._add(acc[1], rows.teacher, du, start, fresh))
            return stats, acc

        return self._chunk_loop(body, (stats0, acc0), rows, stats, grads)

    def _chunk_loop(self, body, carry, *like):
        """``body(i, carry)`` over the token chunks: every chunk, the first and a lone one
        too, in one loop whose trip count XLA cannot see (``unseen_trip_loop``; a chunk
        peeled out of the loop compiled to other bits: a row's d hidden with a softcap and a
        teacher head), the carry made to vary over the shard_map axes of ``like``."""
        carry = jax.tree.map(lambda x: varying_like(x, *like), carry)
        return unseen_trip_loop(self.n_chunks, body, carry)


def _summed_like(g, primal):
    """Inside shard_map: ``g`` summed over the mesh axes it varies over and ``primal`` does
    not. A replicated input's gradient is the sum of every device's part: the hidden states
    (replicated over the vocabulary axis) get dH summed over the shards, each shard having
    seen only its columns; a weight replicated over a data axis gets dW summed over it."""
    extra = JaxOps.varying_axes(g) - JaxOps.varying_axes(primal)
    return lax.psum(g, tuple(sorted(extra))) if extra else g


def _shift_grad(cfg, axis, rows, stats, grads):
    """d shift [N] (None without a shift) of the rows' whole cotangent ``grads``: the
    shifted column's logit is one dot product per row (``stats_math.shift_columns``),
    summed over the vocabulary shards of ``axis`` (one of them holds each column)."""
    if rows.shift_ids is None:
        return None
    k_local = rows.logits.shape[1]
    offset = 0 if axis is None else lax.axis_index(axis) * k_local
    columns = stats_math.shift_columns(JaxOps, rows, cfg, offset)
    d_shift = stats_math.shift_grad(JaxOps, columns, rows, stats, grads, cfg)
    return d_shift if axis is None else lax.psum(d_shift, axis)


def _with_shift(cotangent, d_shift):
    return cotangent if d_shift is None else cotangent._replace(shift=d_shift)


def _cotangent(rows, acc, scale=None):
    """The Rows cotangent of the accumulators: gradients in the inputs' dtypes (zeros for a
    part without one), None for the ids, masks and shift."""
    def one(x, a):
        if x is None:
            return None
        if a is None:
            return jax.tree_util.tree_map(jnp.zeros_like, x)
        return x.accept(_PARTS).cotangent(a, scale)

    return rows.gradients(one(rows.logits, acc[0]), one(rows.teacher, acc[1]))


def _add_trees(a, b):
    return jax.tree_util.tree_map(lambda x, y: x + y, a, b)


def _row_grads(cotangents, n):
    """4 [N] float32 cotangents, zeros for the symbolic (or absent) ones."""
    return tuple(jnp.zeros((n,), jnp.float32) if g is None or isinstance(g, SymbolicZero)
                 else g.astype(jnp.float32) for g in cotangents)


# -- recompute schedule: statistics out, 4 matmuls ------------------------------------

@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _head_stats(impl, cfg, axis, rows):
    return stats_math.public_stats(_Sweep(impl, cfg, rows, axis).run()[0])


def _head_stats_fwd(impl, cfg, axis, rows):
    stats, _ = first_order(impl.name, lambda rows: _Sweep(impl, cfg, rows, axis).run(), rows)
    return stats_math.public_stats(stats), (rows, stats)


def _head_stats_bwd(impl, cfg, axis, residuals, cotangents):
    backward = lambda residuals, cotangents: _head_stats_backward(impl, cfg, axis, residuals,
                                                                  cotangents)
    return first_order(impl.name, backward, residuals, cotangents)


def _head_stats_backward(impl, cfg, axis, residuals, cotangents):
    rows, stats = residuals
    grads = _row_grads(cotangents, rows.targets.shape[0])
    _, acc = _Sweep(impl, cfg, rows, axis).run(stats=stats, grads=grads)
    return (_with_shift(_cotangent(rows, acc), _shift_grad(cfg, axis, rows, stats, grads)),)


_head_stats.defvjp(_head_stats_fwd, _head_stats_bwd)


# -- gradient in the forward: statistics and Σ c·stats out, 3 matmuls ---------------------

@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _head_total(impl, cfg, axis, rows, coefficients):
    stats, _ = _Sweep(impl, cfg, rows, axis).run()
    return (*stats_math.public_stats(stats), base.planned_total(JaxOps, stats, coefficients))


def _head_total_fwd(impl, cfg, axis, rows, coefficients):
    value = lambda p: p.value
    rows = jax.tree_util.tree_map(value, rows)
    coefficients = jax.tree_util.tree_map(value, coefficients)
    forward = lambda rows, coefficients: _head_total_forward(impl, cfg, axis, rows,
                                                             coefficients)
    return first_order(impl.name, forward, rows, coefficients)


def _head_total_forward(impl, cfg, axis, rows, coefficients):
    n = rows.targets.shape[0]
    sweep = _Sweep(impl, cfg, rows, axis)
    if sweep.fused is not None or sweep.blocks() is not None:
        # fused kernels round their gradients once, to the inputs' dtypes, so scaling them
        # afterwards would round twice; a gradient over vocabulary blocks is rounded block by
        # block: the total's gradient is recomputed in the backward (5 matmuls either way)
        stats, acc = sweep.run()[0], None
    else:
        stats, acc = sweep.run(grads=_row_grads(coefficients, n))
    total = base.planned_total(JaxOps, stats, coefficients)
    return (*stats_math.public_stats(stats), total), (rows, stats, acc, coefficients)


def _head_total_bwd(impl, cfg, axis, residuals, cotangents):
    backward = lambda residuals, cotangents: _head_total_backward(impl, cfg, axis, residuals,
                                                                  cotangents)
    return first_order(impl.name, backward, residuals, cotangents)


def _head_total_backward(impl, cfg, axis, residuals, cotangents):
    rows, stats, acc, coefficients = residuals
    *row_cts, g_total = cotangents
    n = rows.targets.shape[0]
    planned = not isinstance(g_total, SymbolicZero)
    if planned and acc is None:  # nothing formed in the forward: fold the total in, recompute
        g = g_total.astype(jnp.float32)
        row_cts = [c * g if isinstance(r, SymbolicZero) else r.astype(jnp.float32) + c * g
                   for r, c in zip(row_cts, _row_grads(coefficients, n))]
        planned = False
    out = None
    if planned:
        out = _cotangent(rows, acc, g_total.astype(jnp.float32))
    if any(not isinstance(g, SymbolicZero) for g in row_cts):  # the recompute schedule
        grads = _row_grads(row_cts, rows.targets.shape[0])
        _, more = _Sweep(impl, cfg, rows, axis).run(stats=stats, grads=grads)
        more = _cotangent(rows, more)
        out = more if out is None else _add_trees(out, more)
    if out is None:
        out = _cotangent(rows, (None, None))
    if rows.shift_ids is not None:  # the whole row cotangent, the total's share included
        grads = _row_grads(cotangents[:len(stats_math.PUBLIC_STATS)], n)
        if not isinstance(g_total, SymbolicZero):
            g = g_total.astype(jnp.float32)
            grads = tuple(r + c * g for r, c in zip(grads, _row_grads(coefficients, n)))
        out = _with_shift(out, _shift_grad(cfg, axis, rows, stats, grads))
    return out, None


_head_total.defvjp(_head_total_fwd, _head_total_bwd, symbolic_zeros=True)


#: the two VJPs as one program per (backend, lowered configuration, axis, shapes), cached:
#: an eager call otherwise traces its loops afresh every time (as the token statistics'
#: ``jax_vjp._token_stats_program``); inside an enclosing jit they are inlined
_head_stats_program = jax.jit(_head_stats, static_argnums=(0, 1, 2))
_head_total_program = jax.jit(_head_total, static_argnums=(0, 1, 2))


def apply_head(impl, cfg, rows, axis, coefficients):
    """(lse, logp, entropy, kl, total) of rows whose logits and/or teacher are heads."""
    if coefficients is None:
        return (*_head_stats_program(impl, cfg, axis, rows), None)
    return _head_total_program(impl, cfg, axis, rows, tuple(coefficients))
