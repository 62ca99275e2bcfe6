"""The soft embedding of a distribution over the vocabulary for JAX:
``soft_embedding(logits, embedding)`` = Σ_k softmax(cap(z) / T)_k · embedding[k] per row,
streamed over vocabulary chunks (the twin of ``dlm_kernels.torch.self_conditioning``, whose
docstring has the math: online softmax forward, the backward recomputing each chunk's
probabilities from the saved row maximum and log-normaliser). A ``jax.custom_vjp``; the
chunks are static slices of the trace, so the vocabulary need not divide by the chunk.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

from .._checks import shape_str
from .._config import (CHUNK_COLUMNS_ACCELERATOR, CHUNK_COLUMNS_CPU, ROW_GROUP,
                       check_positive_float, check_positive_int, check_temperature,
                       min_block_rows, row_blocks, rows_per_block)
from .._jax.first_order import first_order
from .._jax.ops import JaxOps
from ..linear_head.head import VOCAB_MAJOR, as_logits, head_rows, resolve_softcap
from ..linear_head.jax_head import LinearHead
from ..token_stats import formulas
from ..token_stats.jax_chunked import (carry_dtype, fold_row_blocks, in_loop, to_carry,
                                      varying_like)

__all__ = ["soft_embedding", "BACKENDS"]

BACKENDS = ("reference", "chunked")
"""As ``dlm_kernels.torch.self_conditioning.BACKENDS``."""



def _vocab_chunk(vocab: int, on_cpu: bool) -> int:
    """Columns of one vocabulary chunk: the token statistics' width
    (``_config.CHUNK_COLUMNS_CPU`` / ``CHUNK_COLUMNS_ACCELERATOR``), at most K. A function of K
    alone, never of the number of rows, so a row's sums run in one order whatever the batch;
    the temporaries are float32 [N, C]."""
    return max(1, min(CHUNK_COLUMNS_CPU if on_cpu else CHUNK_COLUMNS_ACCELERATOR, vocab))


def _acc(*arrays) -> jnp.dtype:
    return jnp.float64 if any(a.dtype == jnp.float64 for a in arrays) else jnp.float32


def _mm(a, b, acc):
    return jnp.matmul(a, b, preferred_element_type=acc).astype(acc)


def _rows_mm(a, b, acc):  # ``_mm`` of a product whose rows are rows' own values
    return JaxOps.rows_matmul(a, b, acc).astype(acc)


def _capped(z, cap):
    return z if cap is None else formulas.softcap(JaxOps, z, cap)


def _exponents(cz, m, inv_t):
    m_safe = jnp.where(jnp.isneginf(m), 0.0, m)
    d = cz - m_safe[:, None]
    return d if inv_t == 1.0 else JaxOps.rounded(d * inv_t)


def _chunks(vocab, chunk):
    return [(c0, min(c0 + chunk, vocab)) for c0 in range(0, vocab, chunk)]


def _z_fn(layout, acc, x, w, b):
    """A function (c0, c1) -> the logits' columns [c0, c1) of every row, [N, C] in acc: of
    the logits x [N, V] (w None), or of the head's hidden states x [N, D] and weight w."""
    if w is None:
        return lambda c0, c1: x[:, c0:c1].astype(acc)

    def z(c0, c1):
        w_c = w[c0:c1] if layout == VOCAB_MAJOR else w[:, c0:c1].T  # [C, D]
        out = _rows_mm(x, w_c.T, acc)
        return out if b is None else out + b[c0:c1].astype(acc)
    return z


class _Rows:
    """The row blocks of one call: every per-row value (the online softmax's state, a row's
    logits, d logits and d hidden) is computed in blocks of exactly ``rows`` rows under
    ``jax_chunked.fold_row_blocks`` (inside a loop of unseen trip count), never in an
    [N, ...] array whose shape XLA's CPU code rounds a row by (one row, one answer,
    docs/design.md §2). The block's size is a function of the chunk and the widths alone
    (``block_rows``), so every matmul and every tile of a call has the same shape at any N: a
    call of fewer rows runs as one block (``n_blocks`` rows), and the last block of a
    call ends at row N, overlapping the one before it (``_config.row_blocks``): there
    ``fresh`` keeps the running state and d hidden of the rows an earlier block already
    updated for this chunk, and ``owned`` also masks the padding out of the vocabulary's
    gradients (dE, dW, db).

    The row arrays (``pad``: ``n_pad`` rows) of a call of at most one block's rows hold
    ROW_GROUP zero rows past the block: were the block the whole array, XLA would fold its
    dynamic slices and updates (every row, at any offset) and hoist the block's then
    loop-invariant work out of the loop of blocks, where XLA's CPU compiler fuses the work
    around the matmuls otherwise (a row's d logits and d hidden came out an ulp apart from
    the same row among two blocks, when only d input was read and dE's sums were dropped).
    With the spare rows every block reads and writes its rows at an offset XLA does not
    know, inside the loop, at any N."""

    def __init__(self, n, chunk, on_cpu, widths):
        self.n, self.rows = n, block_rows(chunk, widths, on_cpu)
        self.n_blocks = max(n, self.rows)
        self.n_pad = n if n > self.rows else self.rows + ROW_GROUP
        rb, full, _ = row_blocks(self.n_blocks, self.rows, self.rows)
        self.full_end = rb * full

    def pad(self, x):
        return JaxOps.pad_rows(x, self.n_pad)

    def fold(self, step, carry):
        return fold_row_blocks(step, self.n_blocks, self.rows, carry, self.rows)

    def fresh(self, row0, nb):
        """[nb, 1] bool: the block's rows that no earlier block took (the last block's
        overlap is False: those rows' running state and sums are already updated)."""
        first = jnp.where(row0 + nb > self.full_end, self.full_end, row0)
        return (row0 + jnp.arange(nb) >= first)[:, None]

    def owned(self, row0, nb):
        """[nb, 1] bool: ``fresh`` rows within the call's N (not padding)."""
        return self.fresh(row0, nb) & (row0 + jnp.arange(nb) < self.n)[:, None]


#: the most rows a block takes unless its widths need more (``block_rows``)
MAX_BLOCK_ROWS: int = 1024


def block_rows(chunk: int, widths: tuple[int, ...], on_cpu: bool) -> int:
    """Rows R of every block of a call: the rows whose float32 [R, C] chunk fits the
    platform's budget (``_config.rows_per_block``), at most MAX_BLOCK_ROWS, and at least
    ``min_block_rows`` of the chunk and of every row width (the [R, D] and [R, Dh] row values
    hold at least MIN_BLOCK_ELEMENTS too), a multiple of HEAD_ROW_GROUP (the matmuls' rows).
    A function of the chunk and the widths, never of N."""
    least = max(min_block_rows(c) for c in (chunk, *widths))
    r = min(rows_per_block(1 << 30, chunk, on_cpu), MAX_BLOCK_ROWS)
    return head_rows(max(r, least))


def _block_rows(i, x, row0, nb):
    """Rows [row0, row0 + nb) of x, read loop-variant (``jax_chunked.in_loop``: a 16-bit
    x is converted a block at a time, never whole)."""
    x, _ = in_loop(i, x, None)
    return lax.dynamic_slice_in_dim(x, row0, nb, axis=0)


def _forward(x, layout, w, b, emb, cap, inv_t, chunk, rows, acc):
    """(out [N, D], m [N], log l [N]) in acc: per vocabulary chunk, the online softmax's state
    of every row block; the last chunk finishes it. One carried [N, D + 2] buffer holds the
    state (a, m, l), then (out, m, log l)."""
    vocab, d = emb.shape
    chunks = _chunks(vocab, chunk)
    x_pad = rows.pad(x)
    state = jnp.concatenate([jnp.zeros((rows.n_pad, d), acc),
                             jnp.full((rows.n_pad, 1), -jnp.inf, acc),
                             jnp.zeros((rows.n_pad, 1), acc)], axis=1)
    state = varying_like(state, x, w, b, emb)
    for c0, c1 in chunks:
        last = c1 == vocab

        def step(state, row0, nb, c0=c0, c1=c1, last=last):
            x_b = _block_rows(row0, x_pad, row0, nb)
            cz = _capped(_z_fn(layout, acc, x_b, w, b)(c0, c1), cap)  # [nb, C]
            s = lax.dynamic_slice_in_dim(state, row0, nb, axis=0)
            a, m, l = s[:, :d], s[:, d], s[:, d + 1]
            m_new = jnp.maximum(m, cz.max(axis=1))
            rescale = jnp.exp(_exponents(m[:, None], m_new, inv_t)[:, 0])
            alpha = jnp.where(jnp.isneginf(m), 0.0, rescale)
            p = jnp.exp(_exponents(cz, m_new, inv_t))
            l = JaxOps.rounded(l * alpha) + p.sum(axis=1)
            a = JaxOps.rounded(a * alpha[:, None]) + _rows_mm(p, emb[c0:c1], acc)
            if last:
                a, l = a / l[:, None], jnp.log(l)
            s_new = jnp.concatenate([a, m_new[:, None], l[:, None]], axis=1)
            s = jnp.where(rows.fresh(row0, nb), s_new, s)
            return lax.dynamic_update_slice_in_dim(state, s, row0, axis=0)

        state = rows.fold(step, state)
    state = state[:rows.n]
    return state[:, :d], state[:, d], state[:, d + 1]


def _backward(x, layout, w, b, emb, cap, inv_t, chunk, rows, out, m, log_l, g, on_cpu, acc):
    """The gradients of (x, w[, b], emb) (x the logits or the hidden states): per vocabulary
    chunk, over the row blocks, each row's d logits (written into the [N, V] gradient) or its
    d hidden (accumulated in [N, Dh]), and the chunk's dE, dW, db summed over the rows each
    block owns (``_Rows.owned``), rounded once per chunk."""
    vocab, d = emb.shape
    dense = w is None
    x_pad, out, m, log_l, g = (rows.pad(a) for a in (x, out, m, log_l, g.astype(acc)))
    if dense:
        dx_dtype = carry_dtype(x.dtype, on_cpu)
        dx = jnp.zeros((rows.n_pad, vocab), dx_dtype)
    else:
        dx = jnp.zeros(x_pad.shape, acc)
    dx = varying_like(dx, x, w, b, emb, g)
    de, dw, db = [], [], []
    for c0, c1 in _chunks(vocab, chunk):
        c = c1 - c0
        sums = tuple(varying_like(jnp.zeros(shape, acc), x, w, b, emb, g)
                     for shape in ((c, d), (c, x.shape[1]), (c,)))

        def step(carry, row0, nb, c0=c0, c1=c1):
            dx, (de_c, dw_c, db_c) = carry
            x_b = _block_rows(row0, x_pad, row0, nb)
            out_b, m_b, l_b, g_b = (lax.dynamic_slice_in_dim(a, row0, nb, axis=0)
                                    for a in (out, m, log_l, g))
            owned = rows.owned(row0, nb)
            z = _z_fn(layout, acc, x_b, w, b)(c0, c1)
            p = jnp.exp(_exponents(_capped(z, cap), m_b, inv_t) - l_b[:, None])  # [nb, C]
            de_c = de_c + _mm(jnp.where(owned, p, 0.0).T, g_b, acc)
            # (g·out per row, again per chunk: an [N, D] sum of its own would round a row by N)
            go = JaxOps.rounded(g_b * out_b).sum(axis=1)
            dz = p * (_rows_mm(g_b, emb[c0:c1].T, acc) - go[:, None])
            if inv_t != 1.0:
                dz = dz * inv_t
            if cap is not None:
                dz = dz * formulas.softcap_slope(JaxOps, z, cap)
            if dense:
                dx = lax.dynamic_update_slice(dx, to_carry(dz, x.dtype, dx_dtype),
                                              (jnp.int32(row0), jnp.int32(c0)))
                return dx, (de_c, dw_c, db_c)
            w_c = w[c0:c1] if layout == VOCAB_MAJOR else w[:, c0:c1].T  # [C, Dh]
            dh_b = lax.dynamic_slice_in_dim(dx, row0, nb, axis=0)
            dh_b = jnp.where(rows.fresh(row0, nb), dh_b + _rows_mm(dz, w_c, acc), dh_b)
            dz_owned = jnp.where(owned, dz, 0.0)
            dw_c = dw_c + _mm(dz_owned.T, x_b, acc)
            db_c = db_c + dz_owned.sum(axis=0)
            return lax.dynamic_update_slice_in_dim(dx, dh_b, row0, axis=0), (de_c, dw_c, db_c)

        dx, (de_c, dw_c, db_c) = rows.fold(step, (dx, sums))
        de.append(de_c.astype(emb.dtype))
        if not dense:
            dw.append(dw_c.astype(w.dtype) if layout == VOCAB_MAJOR else dw_c.T.astype(w.dtype))
            if b is not None:
                db.append(db_c.astype(b.dtype))
    dx = dx[:rows.n]
    d_emb = jnp.concatenate(de, axis=0)
    if dense:
        return (dx if dx_dtype == x.dtype else lax.bitcast_convert_type(dx, x.dtype), d_emb)
    grads = (dx.astype(x.dtype), jnp.concatenate(dw, axis=0 if layout == VOCAB_MAJOR else 1))
    if b is not None:
        grads = grads + (jnp.concatenate(db),)
    return grads + (d_emb,)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3, 4))
def _soft(cap, inv_t, chunk, layout, on_cpu, *arrays):
    return _soft_fwd(cap, inv_t, chunk, layout, on_cpu, *arrays)[0]


def _unpack(arrays):
    """(x, w, b, emb) from the differentiable arrays: (z, emb) or (h, w[, b], emb); w and b
    None for dense logits z."""
    if len(arrays) == 2:
        return arrays[0], None, None, arrays[1]
    if len(arrays) == 3:
        return arrays[0], arrays[1], None, arrays[2]
    return arrays


def _rows_of(x, w, emb, chunk, on_cpu):
    """The row blocks of a call: x the logits [N, V] (w None) or the hidden states [N, Dh]."""
    widths = (emb.shape[1],) if w is None else (emb.shape[1], x.shape[1])
    return _Rows(x.shape[0], chunk, on_cpu, widths)


def _soft_fwd(cap, inv_t, chunk, layout, on_cpu, *arrays):
    return first_order("chunked", lambda arrays: _soft_forward(
        cap, inv_t, chunk, layout, on_cpu, arrays), arrays)


def _soft_forward(cap, inv_t, chunk, layout, on_cpu, arrays):
    x, w, b, emb = _unpack(arrays)
    acc = _acc(*arrays)
    rows = _rows_of(x, w, emb, chunk, on_cpu)
    out, m, log_l = _forward(x, layout, w, b, emb, cap, inv_t, chunk, rows, acc)
    return out.astype(emb.dtype), (arrays, out, m, log_l)


def _soft_bwd(cap, inv_t, chunk, layout, on_cpu, res, g):
    def backward(res, g):
        arrays, out, m, log_l = res
        x, w, b, emb = _unpack(arrays)
        rows = _rows_of(x, w, emb, chunk, on_cpu)
        return _backward(x, layout, w, b, emb, cap, inv_t, chunk, rows, out, m, log_l, g,
                         on_cpu, out.dtype)
    return first_order("chunked", backward, res, g)


_soft.defvjp(_soft_fwd, _soft_bwd)
#: one program per (cap, temperature, chunk, layout, platform, shapes), cached: an eager
#: call otherwise traces its row-block loops afresh every time; inside a jit it is inlined
_soft_program = jax.jit(_soft, static_argnums=(0, 1, 2, 3, 4))


class _Parts:
    def array(self, logits):
        return logits, None

    def head(self, head):
        return None, head


def soft_embedding(
    logits: jax.Array | LinearHead,
    embedding: jax.Array,
    *,
    temperature: float = 1.0,
    softcap: float | None = None,
    chunk_size: int | None = None,
    backend: str | None = None,
) -> jax.Array:
    """As ``dlm_kernels.torch.self_conditioning.soft_embedding``: [..., V] logits or a
    LinearHead (JAX's default weight layout [D, K]) and a [V, D] embedding table in, [..., D]
    in the table's dtype out (float32 sums, rounded once)."""
    if backend is None:
        backend = "chunked"
    if backend not in BACKENDS:
        raise ValueError(f"backend must be None or one of {BACKENDS}; got {backend!r}")
    temperature = check_temperature("temperature", temperature)
    softcap = check_positive_float("softcap", softcap, allow_none=True)
    chunk_size = check_positive_int("chunk_size", chunk_size, allow_none=True)
    if not isinstance(embedding, jax.Array) or not jnp.issubdtype(embedding.dtype,
                                                                   jnp.floating):
        raise TypeError(f"embedding must be a floating jax.Array; got "
                        f"{getattr(embedding, 'dtype', type(embedding).__name__)}")
    if embedding.ndim != 2:
        raise ValueError(f"embedding must be a [V, D] table; got shape "
                         f"{shape_str(embedding.shape)}")
    source, softcap = resolve_softcap(as_logits(logits), softcap)  # a head's cap is the call's
    source.check(JaxOps, "logits")
    dense, head = source.accept(_Parts())
    if dense is not None:
        if not jnp.issubdtype(dense.dtype, jnp.floating) or dense.ndim < 1:
            raise TypeError(f"logits must be a floating [..., V] array; got {dense.dtype} "
                            f"{shape_str(dense.shape)}")
        lead, v_in = tuple(dense.shape[:-1]), dense.shape[-1]
    else:
        lead, v_in = tuple(head.hidden.shape[:-1]), head.vocab
    vocab, width = embedding.shape
    if v_in != vocab:
        raise ValueError(f"embedding must have one row per vocabulary entry: V = {v_in} from "
                         f"logits, but embedding has shape {shape_str(embedding.shape)}")
    n = math.prod(lead)
    if backend == "reference":
        acc = _acc(embedding, *(a for a in source.arrays() if a is not None))
        z = (dense.astype(acc) if dense is not None else
             _z_fn(head.weight_layout, acc, head.hidden.reshape(n, -1), head.weight,
                   head.bias)(0, vocab).reshape(*lead, vocab))
        # rows padded as whole-row arithmetic and a matmul round a row alike at any N
        z = JaxOps.pad_rows(z.reshape(n, vocab), head_rows(JaxOps.whole_row_rows(n, vocab)))
        p = jax.nn.softmax(_capped(z, softcap) / temperature, axis=-1)
        out = _mm(p, embedding.astype(acc), acc)[:n]
        return out.astype(embedding.dtype).reshape(*lead, width)
    on_cpu = jax.default_backend() == "cpu"
    chunk = chunk_size if chunk_size is not None else _vocab_chunk(vocab, on_cpu)
    if dense is not None:
        arrays = (dense.reshape(n, vocab), embedding)
        layout = VOCAB_MAJOR
    else:
        h = head.hidden.reshape(n, head.width)
        arrays = ((h, head.weight, embedding) if head.bias is None
                  else (h, head.weight, head.bias, embedding))
        layout = head.weight_layout
    out = _soft_program(softcap, 1.0 / temperature, chunk, layout, on_cpu, *arrays)
    return out.reshape(*lead, width)
