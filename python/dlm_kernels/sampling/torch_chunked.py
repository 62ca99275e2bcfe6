"""The chunked backend's sampler from torch: torch ops over vocabulary chunks, live
temporaries a few [N, C] chunks. With top-k, one pass merging each chunk's state
(``sampling.core.chunk_state``); without, one read of the logits, then a second look at one
chunk per row (``sampling.core.chunk_values`` and ``settle``):

  pass 1, every chunk (the one read of the logits): its maxima and sums only
  merge: ``sampling.core.merge_splits`` over the chunks as over the Triton kernel's vocabulary
      splits, each chunk's number standing in for its ids: it says which chunk of each row
      holds the largest s and which the largest s + g
  pass 2: those chunks re-read (1/S of the logits each) for the positions

The noise is the same integers as ``sampling.core.gumbel``, computed in place in scratch buffers
(each lowbias32 step a shift, a mask and an xor; under torch.compile ``sampling.core.gumbel``
itself, exact int64 arithmetic: ``TorchOps.u32``), so every backend draws the same tokens.
"""

from __future__ import annotations

import torch

from . import core as sampling
from .._config import SAMPLE_CHUNK_BYTES_CPU, chunk_size_for
from ..kernels.layout import SAMPLE_IDS, SAMPLE_STATE
from .._torch.ops import TorchOps as xp, signed32

_NEG_INF = float("-inf")
_F32_LOWEST = torch.finfo(torch.float32).min


def noisy_scores_(s, keys, cols, scratch):
    """s + g [N, C] float32, bit for bit ``s + sampling.core.gumbel(xp, keys, cols)``: s [N, C],
    keys [N] row keys (``xp.u32``), cols [C] or [N, C] global column ids, scratch (int32,
    int32, float32) buffers of at least [N, C], the result in the third. Under torch.compile
    it is ``sampling.core.gumbel`` itself (exact int64 products: ``TorchOps.u32``)."""
    if torch.compiler.is_compiling():
        return s + sampling.gumbel(xp, keys, cols)
    h, t, out = (buf[:, :s.shape[1]] for buf in scratch)
    col_keys = sampling.mix(xp, xp.u32(cols))
    torch.bitwise_xor(keys[:, None], col_keys if cols.dim() == 2 else col_keys[None, :], out=h)
    for shift, mul in sampling.MIX_STEPS:  # h = mix(h): x ^= x >>> shift; x *= mul (wrapping)
        torch.bitwise_right_shift(h, shift, out=t)
        t &= (1 << (32 - shift)) - 1
        h ^= t
        if mul is not None:
            h.mul_(signed32(mul))
    torch.bitwise_right_shift(h, 9, out=t)  # u = ((h >>> 9) + 1/2)·2^-23, exact in float32
    t &= (1 << 23) - 1
    out.copy_(t).add_(0.5).mul_(2.0 ** -23)
    out.log_().neg_().log_()  # log(-log u) = -g
    return torch.sub(s, out, out=out)


_FIELD = {name: i for i, name in enumerate(SAMPLE_STATE)}


def _chunk_values_(z, s, sd, cols, noisy, cfg, out, work):
    """``sampling.core.chunk_values`` of z, s, sd [N, C] into out [len(SAMPLE_STATE), N], its
    [N, C] temporaries in the two float32 buffers ``work``: a CPU allocator hands large freed
    buffers back to the system and faults their pages in again, so fresh temporaries per
    chunk cost as much as the arithmetic (N 1024, K 32768: twice the step's time).

    The exponents are s - max s here, not ``sampling.core.exponents``' (z - max z) / T_s: eager
    torch rounds each s = z / T_s once, so a tie is exactly 0 all the same (the logit
    differences guard against a compiler contracting z·(1/T) - m into a fused multiply-add),
    and the division of the differences would be one more pass over the chunk."""
    del z  # the same state from s alone (above)
    v1 = xp.rowmax(s)
    m = torch.where(v1 == _NEG_INF, 0.0, v1)
    d, e = (buf[:, :s.shape[1]] for buf in work)
    torch.sub(s, m[:, None], out=d).clamp_min_(_F32_LOWEST)  # -inf out of e·d (0·inf: NaN)
    torch.exp(d, out=e)
    out[_FIELD["a"]] = xp.rowsum(e)
    out[_FIELD["b"]] = xp.rowsum(e.mul_(d))
    out[_FIELD["m"]], out[_FIELD["v1"]] = m, v1
    out[_FIELD["v2"]], out[_FIELD["gs"]] = _NEG_INF, 0.0  # as chunk_values: found later
    out[_FIELD["gv"]] = _NEG_INF if cfg.greedy else xp.rowmax(noisy(sd, cols))


def _scratch(n, c, device):
    """The [N, C] buffers of one chunk: two int32 for the hash, three float32."""
    return [torch.empty((n, c), dtype=dt, device=device)
            for dt in (torch.int32, torch.int32) + (torch.float32,) * 3]


def _two_pass(z, zu, keys, suppress, cfg, chunks):
    """Sample of [N] fields of z [N, K] (and zu) over the vocabulary chunks [(c0, c1)] of one
    width (the last may be narrower); cfg.top_k is None."""
    n, k = z.shape
    c = chunks[0][1] - chunks[0][0]
    scratch = _scratch(n, c, z.device)
    noisy = lambda s, cols: noisy_scores_(s, keys, cols, scratch[:3])  # noqa: E731
    state = torch.empty((len(SAMPLE_STATE), len(chunks), n), device=z.device)
    for j, (c0, c1) in enumerate(chunks):  # pass 1: every logit once
        cols = torch.arange(c0, c1, device=z.device)
        scores = sampling.scaled_logits(xp, z[:, c0:c1], None if zu is None else zu[:, c0:c1],
                                        cols, suppress, cfg)
        # a narrower last chunk gets buffers of its own width: torch.compile's out= takes
        # contiguous tensors only, and a buffer's first columns are not
        bufs = scratch if c1 - c0 == c else _scratch(n, c1 - c0, z.device)
        _chunk_values_(*scores, cols, lambda s, cols: noisy_scores_(s, keys, cols, bufs[:3]),
                       cfg, state[:, j], bufs[3:])
    chunk_ids = torch.arange(len(chunks), dtype=torch.int32, device=z.device)
    ids = chunk_ids[None, :, None].expand(len(SAMPLE_IDS), len(chunks), n)
    st = sampling.merge_splits(xp, state, ids, None, None, cfg, k)

    ragged = k % c != 0  # the last chunk reaches past K

    def reread(chunk):  # [N] -> z, s, sd, cols [N, c] of that chunk of each row, past K at -inf
        cols = chunk[:, None].long() * c + torch.arange(c, device=z.device)[None, :]
        if ragged:
            inside = cols < k
            cols = torch.where(inside, cols, k - 1)
        zu_rows = None if zu is None else zu.gather(1, cols)
        scores = sampling.scaled_logits(xp, z.gather(1, cols), zu_rows, cols, suppress, cfg)
        if ragged:
            outside = ~inside
            for x in {id(x): x for x in scores}.values():  # z, s and sd may be one tensor
                x.masked_fill_(outside, _NEG_INF)
        return scores + (cols,)

    st = sampling.settle(xp, st, reread, noisy, cfg)
    return sampling.finalize(xp, st, keys, cfg)


@torch.no_grad()
def sample(z, zu, keys, suppress, cfg):
    # z, zu: [N, K] -> Sample of [N] fields; live temporaries: a few [N, C] chunks
    n, k = z.shape
    c = chunk_size_for(n, k, cfg, on_cpu=z.device.type == "cpu",
                       cpu_bytes=SAMPLE_CHUNK_BYTES_CPU)
    chunks = [(c0, min(c0 + c, k)) for c0 in range(0, k, c)]
    if cfg.top_k is None:  # values in the stream, positions from one chunk per row
        return _two_pass(z, zu, keys, suppress, cfg, chunks)
    state = None
    for c0, c1 in chunks:
        cols = torch.arange(c0, c1, device=z.device)
        scores = sampling.scaled_logits(xp, z[:, c0:c1], None if zu is None else
                                        zu[:, c0:c1], cols, suppress, cfg)
        part = sampling.chunk_state(xp, *scores, cols, keys, cfg)
        state = part if state is None else sampling.merge_state(xp, state, part, cfg)
    return sampling.finalize(xp, state, keys, cfg)


class ChunkedSampler:
    """The chunked sampler from torch (``dlm_kernels.sampling.core``'s draw)."""

    name = "chunked"

    @staticmethod
    def unsupported_reason(platform):
        return None

    sample = staticmethod(sample)


IMPLEMENTATION = ChunkedSampler()
