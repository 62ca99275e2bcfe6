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

from .._checks import shape_str
from .._config import (CHUNK_COLUMNS_ACCELERATOR, CHUNK_COLUMNS_CPU, check_positive_float,
                       check_positive_int, check_temperature)
from .._jax.ops import JaxOps
from ..linear_head.head import VOCAB_MAJOR, as_logits, head_rows, resolve_softcap
from ..linear_head.jax_head import LinearHead
from ..token_stats import formulas

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
    return d if inv_t == 1.0 else d * inv_t


def _chunks(vocab, chunk):
    return [(c0, min(c0 + chunk, vocab)) for c0 in range(0, vocab, chunk)]


def _z_fn(layout, acc, dense, h, w, b):
    """A function (c0, c1) -> the logits' columns [c0, c1) of every row, [N, C] in acc."""
    if dense is not None:
        return lambda c0, c1: dense[:, c0:c1].astype(acc)

    def z(c0, c1):
        w_c = w[c0:c1] if layout == VOCAB_MAJOR else w[:, c0:c1].T  # [C, D]
        out = _rows_mm(h, w_c.T, acc)
        return out if b is None else out + b[c0:c1].astype(acc)
    return z


def _forward(z_of, emb, cap, inv_t, chunk, n, acc):
    vocab, d = emb.shape
    m = jnp.full((n,), -jnp.inf, acc)
    l = jnp.zeros((n,), acc)
    a = jnp.zeros((n, d), acc)
    for c0, c1 in _chunks(vocab, chunk):
        cz = _capped(z_of(c0, c1), cap)
        m_new = jnp.maximum(m, cz.max(axis=1))
        rescale = jnp.exp(_exponents(m[:, None], m_new, inv_t)[:, 0])
        alpha = jnp.where(jnp.isneginf(m), 0.0, rescale)
        p = jnp.exp(_exponents(cz, m_new, inv_t))
        l = l * alpha + p.sum(axis=1)
        a = a * alpha[:, None] + _rows_mm(p, emb[c0:c1], acc)
        m = m_new
    return a / l[:, None], m, jnp.log(l)


def _backward(z_of, layout, dense, h, w, b, emb, cap, inv_t, chunk, out, m, log_l, g, acc):
    vocab = emb.shape[0]
    g = g.astype(acc)
    go = (g * out).sum(axis=1)
    m_safe = jnp.where(jnp.isneginf(m), 0.0, m)
    d_dense, de, dw, db = [], [], [], []
    dh = None if h is None else jnp.zeros(h.shape, acc)
    for c0, c1 in _chunks(vocab, chunk):
        z = z_of(c0, c1)
        cz = _capped(z, cap)
        p = jnp.exp(_exponents(cz, m_safe, inv_t) - log_l[:, None])
        de.append(_mm(p.T, g, acc).astype(emb.dtype))
        dz = p * (_rows_mm(g, emb[c0:c1].T, acc) - go[:, None])
        if inv_t != 1.0:
            dz = dz * inv_t
        if cap is not None:
            dz = dz * formulas.softcap_slope(JaxOps, z, cap)
        if dense is not None:
            d_dense.append(dz.astype(dense.dtype))
            continue
        w_c = w[c0:c1] if layout == VOCAB_MAJOR else w[:, c0:c1].T
        dh = dh + _rows_mm(dz, w_c, acc)
        dw_c = _mm(dz.T, h, acc).astype(w.dtype)
        dw.append(dw_c if layout == VOCAB_MAJOR else dw_c.T)
        if b is not None:
            db.append(dz.sum(axis=0).astype(b.dtype))
    d_emb = jnp.concatenate(de, axis=0)
    if dense is not None:
        return (jnp.concatenate(d_dense, axis=1), d_emb)
    d_w = jnp.concatenate(dw, axis=0 if layout == VOCAB_MAJOR else 1)
    grads = (dh.astype(h.dtype), d_w)
    if b is not None:
        grads = grads + (jnp.concatenate(db),)
    return grads + (d_emb,)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3))
def _soft(cap, inv_t, chunk, layout, *arrays):
    return _soft_fwd(cap, inv_t, chunk, layout, *arrays)[0]


def _unpack(layout, arrays):
    """(dense, h, w, b, emb) from the differentiable arrays: (z, emb) or (h, w[, b], emb)."""
    if len(arrays) == 2:
        return arrays[0], None, None, None, arrays[1]
    if len(arrays) == 3:
        return None, arrays[0], arrays[1], None, arrays[2]
    return None, *arrays


def _soft_fwd(cap, inv_t, chunk, layout, *arrays):
    dense, h, w, b, emb = _unpack(layout, arrays)
    acc = _acc(*arrays)
    z_of = _z_fn(layout, acc, dense, h, w, b)
    n = (dense if dense is not None else h).shape[0]
    out, m, log_l = _forward(z_of, emb, cap, inv_t, chunk, n, acc)
    return out.astype(emb.dtype), (arrays, out, m, log_l)


def _soft_bwd(cap, inv_t, chunk, layout, res, g):
    arrays, out, m, log_l = res
    dense, h, w, b, emb = _unpack(layout, arrays)
    acc = out.dtype
    z_of = _z_fn(layout, acc, dense, h, w, b)
    return _backward(z_of, layout, dense, h, w, b, emb, cap, inv_t, chunk, out, m, log_l, g,
                     acc)


_soft.defvjp(_soft_fwd, _soft_bwd)


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
        acc = _acc(embedding, *(source.arrays()))
        z = (dense.astype(acc) if dense is not None else
             _z_fn(head.weight_layout, acc, None, head.hidden.reshape(n, -1), head.weight,
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
    out = _soft(softcap, 1.0 / temperature, chunk, layout, *arrays)
    return out.reshape(*lead, width)
