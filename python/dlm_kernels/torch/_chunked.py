"""The chunked backend: torch ops over vocabulary chunks, O(N) float32 residuals.

Forward keeps the streaming state of docs/design.md §2 per row and merges chunk partials; backward
recomputes p (and q) chunk by chunk and writes d(logits) slice by slice. Live float32
temporaries are a few [N, C] buffers (C from ``chunk_size_for``), never [N, K]. With a
column ``offset`` the logits are one vocabulary shard (columns [offset, offset + K)); the
vocabulary-parallel path merges the partial states across shards.
"""

from __future__ import annotations

import torch

from .. import _sampling as sampling
from .. import _stats_math as stats_math
from . import _chunked_sampling as chunked_sampling
from .._config import CHUNK_BYTES_CPU, SAMPLE_CHUNK_BYTES_CPU, chunk_size_for
from .._dispatch import BackendBase, NATIVE_DTYPES, Capabilities
from ._buffers import empty
from ._ops import TorchOps as xp


def _chunks(n, k, cfg, device, cpu_bytes=CHUNK_BYTES_CPU):
    c = chunk_size_for(n, k, cfg, on_cpu=device.type == "cpu", cpu_bytes=cpu_bytes)
    return [(c0, min(c0 + c, k)) for c0 in range(0, k, c)]


class ChunkedTorch(BackendBase):
    name = "chunked"
    custom_vjp = True
    capabilities = Capabilities(dtypes=NATIVE_DTYPES, vocab_shards=True, inplace_grad=True,
                                sampling=True)

    @staticmethod
    def unsupported_reason(platform):
        return None

    @staticmethod
    @torch.no_grad()
    def forward_partial(rows, cfg, offset=0):
        # rows.logits, rows.teacher: [N, K] (one shard) -> (State, r_y, found) of [N] f32
        z, u = rows.logits, rows.teacher
        n, k = z.shape
        state = None
        for c0, c1 in _chunks(n, k, cfg, z.device):
            cols = torch.arange(offset + c0, offset + c1, device=z.device)  # [C] global ids
            chunk = rows.columns(z[:, c0:c1], None if u is None else u[:, c0:c1])
            part = stats_math.chunk_partial(xp, chunk, cols, stats_math.column_mask(xp, cols, cfg), cfg)
            state = part if state is None else stats_math.merge(xp, state, part, cfg)
        return (state, *stats_math.target_logit(xp, rows, cfg, offset))

    @classmethod
    def forward(cls, rows, cfg):
        state, r_y, found = cls.forward_partial(rows, cfg)
        return stats_math.finalize(xp, state, r_y, found, rows.active, cfg)

    @staticmethod
    @torch.no_grad()
    def backward(rows, stats, grads, cfg, inplace=False, offset=0):
        # -> dz [N, K] in z's dtype (z itself when ``inplace``), du [N, K] or None
        z, u = rows.logits, rows.teacher
        n, k = z.shape
        dz = z if inplace else empty(z.shape, z.dtype, z.device)
        du = empty(u.shape, u.dtype, u.device) if cfg.teacher_grad else None
        for c0, c1 in _chunks(n, k, cfg, z.device):
            cols = torch.arange(offset + c0, offset + c1, device=z.device)
            chunk = rows.columns(z[:, c0:c1], None if u is None else u[:, c0:c1])
            gz, gu = stats_math.chunk_grads(xp, chunk, cols, stats, grads, cfg)
            dz[:, c0:c1] = gz
            if du is not None:
                du[:, c0:c1] = gu
        return dz, du

    @staticmethod
    @torch.no_grad()
    def sample(z, zu, keys, suppress, cfg):
        # z, zu: [N, K] -> Sample of [N] fields; live temporaries: a few [N, C] chunks
        n, k = z.shape
        chunks = _chunks(n, k, cfg, z.device, SAMPLE_CHUNK_BYTES_CPU)
        if cfg.top_k is None:  # values in the stream, positions from one chunk per row
            return chunked_sampling.sample(z, zu, keys, suppress, cfg, chunks)
        state = None
        for c0, c1 in chunks:
            cols = torch.arange(c0, c1, device=z.device)
            s, sd = sampling.scaled_logits(xp, z[:, c0:c1], None if zu is None else zu[:, c0:c1],
                                           cols, suppress, cfg)
            part = sampling.chunk_state(xp, s, sd, cols, keys, cfg)
            state = part if state is None else sampling.merge_state(xp, state, part, cfg)
        return sampling.finalize(xp, state, keys, cfg)


IMPLEMENTATION = ChunkedTorch()
