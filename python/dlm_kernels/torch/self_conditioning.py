"""The soft embedding of a distribution over the vocabulary, streamed over vocabulary chunks.

A self-conditioned diffusion LM (DiffusionGemma) feeds its next denoising step the expected
embedding under the previous step's prediction:

    out[n] = Σ_k p_nk · E[k],   p_n = softmax(s_n),   s = cap(z) / T,

z the logits ([N, V], or a ``LinearHead`` ``h·W (+ b)`` standing for them), cap(z) =
c·tanh(z / c) (or z), E the [V, D] embedding table. ``soft_embedding`` computes it without
the [N, V] probabilities: the chunked backend walks the vocabulary in chunks of C columns
with an online softmax (a running row maximum m, normaliser l = Σ e^{(cap(z) - m)/T} and
weighted sum a = Σ e^{(cap(z) - m)/T}·E[k], l and a rescaled by e^{(m_old - m_new)/T} at each
new maximum), so beyond the inputs it holds one [N, C] chunk, [N, D] of float32 state and
O(N) row statistics. The backward recomputes each chunk's probabilities from the saved m and
log l; with g = dL/dout:

    dE[k]  = Σ_n p_nk g_n,        ds_nk = p_nk (g_n·E[k] - g_n·out_n),
    dz     = ds / T · cap'(z),    dh = dz·W,  dW = dzᵀ·h,  db = Σ_n dz_n,

one vocabulary chunk of dE, dW and db at a time (each finished and rounded once per chunk,
as every chunk sees all N rows). Every sum is accumulated in float32 (float64 for float64
inputs); 16-bit inputs are read as they are.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .._checks import shape_str
from .._config import (CHUNK_COLUMNS_ACCELERATOR, CHUNK_COLUMNS_CPU, check_positive_float,
                       check_positive_int, check_temperature)
from .._torch.buffers import empty
from .._torch.ops import TorchOps
from ..linear_head.head import VOCAB_MAJOR, as_logits, head_rows, resolve_softcap
from ..linear_head.torch_head import LinearHead
from ..token_stats import formulas

__all__ = ["soft_embedding", "BACKENDS"]

BACKENDS = ("reference", "chunked")
"""The backends of ``soft_embedding``: "reference" forms the float32 [N, V] probabilities
(torch's softmax and matmul, differentiated by autograd: the oracle's formula), "chunked"
streams the vocabulary (the default)."""



def _vocab_chunk(vocab: int, on_cpu: bool) -> int:
    """Columns of one vocabulary chunk: the token statistics' width
    (``_config.CHUNK_COLUMNS_CPU`` / ``CHUNK_COLUMNS_ACCELERATOR``), at most K. A function of K
    alone, never of the number of rows, so a row's sums run in one order whatever the batch;
    the temporaries are float32 [N, C]."""
    return max(1, min(CHUNK_COLUMNS_CPU if on_cpu else CHUNK_COLUMNS_ACCELERATOR, vocab))


def _acc_dtype(*dtypes: torch.dtype) -> torch.dtype:
    return torch.float64 if torch.float64 in dtypes else torch.float32


class _Source:
    """The logits of one call, read a vocabulary chunk at a time: dense [N, V] or a head."""

    def __init__(self, dense: torch.Tensor | None, hidden: torch.Tensor | None,
                 weight: torch.Tensor | None, bias: torch.Tensor | None, layout: str,
                 acc: torch.dtype) -> None:
        self.dense, self.hidden, self.weight, self.bias = dense, hidden, weight, bias
        self.layout, self.acc = layout, acc

    def w_rows(self, c0: int, c1: int) -> torch.Tensor:  # [C, D]
        w = self.weight
        assert w is not None
        return w[c0:c1] if self.layout == VOCAB_MAJOR else w[:, c0:c1].t()

    def z(self, c0: int, c1: int) -> torch.Tensor:
        """The logits' columns [c0, c1) of every row, [N, C] in the accumulation dtype."""
        if self.dense is not None:
            return self.dense[:, c0:c1].to(self.acc)
        assert self.hidden is not None
        z = TorchOps.rows_matmul(self.hidden, self.w_rows(c0, c1).t(), self.acc)
        return z if self.bias is None else z + self.bias[c0:c1].to(self.acc)


def _capped(z: torch.Tensor, cap: float | None) -> torch.Tensor:
    return z if cap is None else formulas.softcap(TorchOps, z, cap)


def _exponents(cz: torch.Tensor, m: torch.Tensor, inv_t: float) -> torch.Tensor:
    """(cap(z) - m)/T per element, as differences scaled afterwards; a row whose maximum is
    still -inf (every column so far masked) gives -inf, never NaN."""
    m_safe = torch.where(torch.isneginf(m), 0.0, m)
    d = cz - m_safe[:, None]
    return d if inv_t == 1.0 else d * inv_t


def _forward(src: _Source, emb: torch.Tensor, cap: float | None, inv_t: float,
             chunk: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(out [N, D] acc, m [N] acc, log l [N] acc) of the online softmax over the chunks."""
    acc_t = src.acc
    n, d = (src.dense.shape[0] if src.dense is not None else src.hidden.shape[0]), emb.shape[1]
    dev, vocab = emb.device, emb.shape[0]
    m = torch.full((n,), -math.inf, dtype=acc_t, device=dev)
    l = torch.zeros(n, dtype=acc_t, device=dev)
    a = torch.zeros(n, d, dtype=acc_t, device=dev)
    for c0 in range(0, vocab, chunk):
        c1 = min(c0 + chunk, vocab)
        cz = _capped(src.z(c0, c1), cap)
        m_new = torch.maximum(m, cz.max(dim=1).values)
        # rescale what was summed under the old maximum (0 where nothing was: l = a = 0)
        rescale = torch.exp(_exponents(m[:, None], m_new, inv_t)[:, 0])
        alpha = torch.where(torch.isneginf(m), 0.0, rescale)
        p = torch.exp(_exponents(cz, m_new, inv_t))  # [N, C], the unnormalised weights
        l = l * alpha + p.sum(dim=1)
        a = a * alpha[:, None] + TorchOps.rows_matmul(p, emb[c0:c1], acc_t)
        m = m_new
    out = a / l[:, None]
    return out, m, torch.log(l)


def _backward(src: _Source, emb: torch.Tensor, cap: float | None, inv_t: float, chunk: int,
              out: torch.Tensor, m: torch.Tensor, log_l: torch.Tensor, g: torch.Tensor,
              need: tuple[bool, bool, bool, bool, bool]):
    """(d dense, d hidden, d weight, d bias, d emb) for ``need`` in that order (None where not
    needed); each finished in the accumulation dtype and rounded once to its input's dtype."""
    acc_t = src.acc
    need_dense, need_h, need_w, need_b, need_e = need
    vocab = emb.shape[0]
    g = g.to(acc_t)
    go = (g * out).sum(dim=1)  # [N]  g_n·out_n
    d_dense = empty(src.dense.shape, src.dense.dtype, src.dense.device) if need_dense else None
    dh = torch.zeros(src.hidden.shape, dtype=acc_t, device=src.hidden.device) if need_h else None
    dw = empty(src.weight.shape, src.weight.dtype, src.weight.device) if need_w else None
    db = empty(src.bias.shape, src.bias.dtype, src.bias.device) if need_b else None
    de = empty(emb.shape, emb.dtype, emb.device) if need_e else None
    m_safe = torch.where(torch.isneginf(m), 0.0, m)
    for c0 in range(0, vocab, chunk):
        c1 = min(c0 + chunk, vocab)
        z = src.z(c0, c1)
        cz = _capped(z, cap)
        e_c = emb[c0:c1]
        p = torch.exp(_exponents(cz, m_safe, inv_t) - log_l[:, None])  # [N, C]
        if de is not None:
            de[c0:c1] = TorchOps.matmul(p.t(), g, acc_t).to(de.dtype)
        if not (need_dense or need_h or need_w or need_b):
            continue
        ge = TorchOps.rows_matmul(g, e_c.t(), acc_t)  # [N, C]  g_n·E[k]
        dz = p * (ge - go[:, None])
        if inv_t != 1.0:
            dz = dz * inv_t
        if cap is not None:
            dz = dz * formulas.softcap_slope(TorchOps, z, cap)
        if d_dense is not None:
            d_dense[:, c0:c1] = dz.to(d_dense.dtype)
            continue
        if dh is not None:
            dh += TorchOps.rows_matmul(dz, src.w_rows(c0, c1), acc_t)
        if dw is not None:
            dw_c = TorchOps.matmul(dz.t(), src.hidden, acc_t).to(dw.dtype)  # [C, D]
            if src.layout == VOCAB_MAJOR:
                dw[c0:c1] = dw_c
            else:
                dw[:, c0:c1] = dw_c.t()
        if db is not None:
            db[c0:c1] = dz.sum(dim=0).to(db.dtype)
    if dh is not None:
        dh = dh.to(src.hidden.dtype)
    return d_dense, dh, dw, db, de


class _SoftEmbedding(torch.autograd.Function):
    """The chunked backend: inputs (dense, hidden, weight, bias, emb), dense or the three head
    tensors None as the logits are given."""

    @staticmethod
    def forward(ctx, cap, inv_t, chunk, layout, dense, hidden, weight, bias, emb):
        acc_t = _acc_dtype(*(t.dtype for t in (dense, hidden, weight, bias, emb) if t is not None))
        src = _Source(dense, hidden, weight, bias, layout, acc_t)
        out, m, log_l = _forward(src, emb, cap, inv_t, chunk)
        result = empty(out.shape, emb.dtype, emb.device)
        result.copy_(out)
        ctx.save_for_backward(dense, hidden, weight, bias, emb, out, m, log_l)
        ctx.cfg = (cap, inv_t, chunk, layout)
        return result

    @staticmethod
    def backward(ctx, g):
        dense, hidden, weight, bias, emb, out, m, log_l = ctx.saved_tensors
        cap, inv_t, chunk, layout = ctx.cfg
        src = _Source(dense, hidden, weight, bias, layout, out.dtype)
        need = tuple(bool(x) for x in ctx.needs_input_grad[4:9])
        need = tuple(n and t is not None for n, t in
                     zip(need, (dense, hidden, weight, bias, emb)))
        grads = _backward(src, emb, cap, inv_t, chunk, out, m, log_l, g, need)
        return (None, None, None, None) + tuple(grads)


def _reference(dense, head, emb, cap, temperature):
    """The materialised formula: float32 (float64) logits, softmax, p @ E, by torch autograd,
    over rows padded to ``head_rows`` (its matmuls' row count: one row, one answer)."""
    if head is not None:
        h, w, b = head.hidden, head.weight, head.bias
        lead = h.shape[:-1]
        h = h.reshape(-1, h.shape[-1])
        h = TorchOps.pad_rows(h, head_rows(h.shape[0]))
        acc_t = _acc_dtype(h.dtype, emb.dtype)
        z = F.linear(h.to(acc_t), w.to(acc_t) if head.weight_layout == VOCAB_MAJOR
                     else w.to(acc_t).t(), None if b is None else b.to(acc_t))
    else:
        lead = dense.shape[:-1]
        acc_t = _acc_dtype(dense.dtype, emb.dtype)
        z = dense.reshape(-1, dense.shape[-1])
        z = TorchOps.pad_rows(z, head_rows(z.shape[0])).to(acc_t)
    p = torch.softmax(_capped(z, cap) / temperature, dim=-1)
    n = math.prod(lead)
    return (p @ emb.to(acc_t))[:n].to(emb.dtype).reshape(*lead, emb.shape[1])



class _Parts:
    """(dense, head) of a logits source, the other None (``LogitsSource.accept``)."""

    def array(self, logits: torch.Tensor) -> tuple[torch.Tensor | None, LinearHead | None]:
        return logits, None

    def head(self, head: LinearHead) -> tuple[torch.Tensor | None, LinearHead | None]:
        return None, head


def _require_float(name: str, x: object) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor; got {type(x).__name__}")
    if not x.dtype.is_floating_point:
        raise TypeError(f"{name} must have a floating dtype; got {x.dtype}")
    return x


def soft_embedding(
    logits: torch.Tensor | LinearHead,
    embedding: torch.Tensor,
    *,
    temperature: float = 1.0,
    softcap: float | None = None,
    chunk_size: int | None = None,
    backend: str | None = None,
) -> torch.Tensor:
    """Σ_k softmax(cap(z) / T)_k · embedding[k] per row, differentiable, without the [..., V]
    probabilities (module docstring).

    Args:
      logits: [..., V] logits z (float32, bfloat16, float16 or float64), or a LinearHead
        (hidden [..., D_h], weight, bias) standing for them: then they are never formed whole.
      embedding: [V, D] floating table (DiffusionGemma: the tied ``embed_tokens.weight``, the
        same tensor as the head's weight; gradients of both add up in autograd).
      temperature: T > 0 (at least 2^-102), applied after the cap.
      softcap: c > 0 for cap(z) = c·tanh(z / c), or None (a LinearHead's own softcap is
        used when it has one; both given must be equal).
      chunk_size: vocabulary columns per chunk of the chunked backend (default: the token
        statistics' width, 4096 columns on a CPU and 32768 elsewhere, at most V: fixed by V).
      backend: None or "chunked" (streamed), or "reference" (the materialised formula).
    Returns:
      [..., D] in the embedding's dtype (accumulated in float32, rounded once). A row whose
      logits are all -inf (no cap) is NaN, as its softmax is.
    """
    if backend is None:
        backend = "chunked"
    if backend not in BACKENDS:
        raise ValueError(f"backend must be None or one of {BACKENDS}; got {backend!r}")
    temperature = check_temperature("temperature", temperature)
    softcap = check_positive_float("softcap", softcap, allow_none=True)
    chunk_size = check_positive_int("chunk_size", chunk_size, allow_none=True)
    _require_float("embedding", embedding)
    if embedding.ndim != 2:
        raise ValueError(f"embedding must be a [V, D] table; got shape "
                         f"{shape_str(embedding.shape)}")
    vocab, width = embedding.shape
    source, softcap = resolve_softcap(as_logits(logits), softcap)  # a head's cap is the call's
    source.check(TorchOps, "logits")
    dense, head = source.accept(_Parts())
    if head is not None:
        lead, v_in, device = tuple(head.hidden.shape[:-1]), head.vocab, head.hidden.device
    else:
        assert dense is not None
        _require_float("logits", dense)
        if dense.ndim < 1:
            raise ValueError(f"logits must be [..., V]; got shape {shape_str(dense.shape)}")
        lead, v_in, device = tuple(dense.shape[:-1]), dense.shape[-1], dense.device
    if v_in != vocab:
        raise ValueError(f"embedding must have one row per vocabulary entry: V = {v_in} from "
                         f"logits, but embedding has shape {shape_str(embedding.shape)}")
    if embedding.device != device:
        raise ValueError(f"embedding is on {embedding.device} but logits on {device}")
    if backend == "reference":
        return _reference(dense, head, embedding, softcap, temperature)
    n = math.prod(lead)
    chunk = chunk_size if chunk_size is not None else _vocab_chunk(vocab, device.type == "cpu")
    if head is not None:
        h = head.hidden.reshape(n, head.hidden.shape[-1])
        out = _SoftEmbedding.apply(softcap, 1.0 / temperature, chunk, head.weight_layout, None,
                                   h, head.weight, head.bias, embedding)
    else:
        assert dense is not None
        out = _SoftEmbedding.apply(softcap, 1.0 / temperature, chunk, VOCAB_MAJOR,
                                   dense.reshape(n, vocab), None, None, None, embedding)
    return out.reshape(*lead, width)
