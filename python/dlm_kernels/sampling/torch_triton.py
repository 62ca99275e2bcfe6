"""The Triton sampler from torch: the ``dlm_kernels::sample_partial`` custom op
(``kernels.triton.sampling``) and the draw that merges its vocabulary splits."""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from . import core as sampling
from ..kernels.layout import SAMPLE_IDS, SAMPLE_STATE
from ..kernels.triton import sampling as sampler
from ..kernels.triton import token_stats as kernels
from .._torch.buffers import empty as _empty
from .._torch.ops import TorchOps
from .._torch.triton import _unit_col, plan, unsupported_reason

Tensor = torch.Tensor


@torch.library.custom_op("dlm_kernels::sample_partial", mutates_args=())
def sample_partial(z: Tensor, zu: Optional[Tensor], keys: Tensor, suppress: Optional[Tensor],
                   temperature: float, top_k: int, cfg_c: float, block_k: Optional[int],
                   stat_temperature: float, greedy: bool,
                   two_t: bool) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """The sampler's split states of z: [N, K] (``kernels.triton.sampling``): (state
    [SAMPLE_STATE, S, N] f32, ids [SAMPLE_IDS, S, N] i32, top-k slots [S, N, k] f32 and i32,
    empty without top_k)."""
    z, zu = _unit_col(z), _unit_col(zu)
    n, k = z.shape
    cfg = plan(z, zu, block_k)
    s = cfg["splits"]
    state = _empty((len(SAMPLE_STATE), s, n), torch.float32, z.device)  # 28·S bytes per row
    ids = _empty((len(SAMPLE_IDS), s, n), torch.int32, z.device)  # 8·S bytes per row
    slots = (s, n, top_k) if top_k else (0,)
    top_v = _empty(slots, torch.float32, z.device)
    top_i = _empty(slots, torch.int32, z.device)
    if n > 0:
        sampler.sample_partial_kernel[(n, s)](
            z, z if zu is None else zu, keys, keys if suppress is None else suppress, n, k,
            0 if suppress is None else suppress.shape[0], z.stride(0),
            0 if zu is None else zu.stride(0), cfg["cols_per_split"],
            temperature, stat_temperature, cfg_c, state, ids, top_v, top_i,
            GREEDY=greedy, TWO_T=two_t, HAS_UNCOND=zu is not None,
            HAS_SUPPRESS=suppress is not None, TOP_K=top_k,
            TOP_KP=sampler.slot_count(top_k), BLOCK_K=cfg["block_k"], VEC=cfg["vec"],
            ROWS_ALIGNED=kernels.rows_aligned(z.stride(0), 0 if zu is None else zu.stride(0)),
            num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
            enable_fp_fusion=False)  # guidance's multiply and add round as on the host
    return state, ids, top_v, top_i


@sample_partial.register_fake
def _(z, zu, keys, suppress, temperature, top_k, cfg_c, block_k, stat_temperature, greedy,
      two_t):
    s = plan(z, zu, block_k)["splits"]  # the same plan as the launch
    n = z.shape[0]
    slots = (s, n, top_k) if top_k else (0,)
    return (z.new_empty((len(SAMPLE_STATE), s, n), dtype=torch.float32),
            z.new_empty((len(SAMPLE_IDS), s, n), dtype=torch.int32),
            z.new_empty(slots, dtype=torch.float32), z.new_empty(slots, dtype=torch.int32))


@torch.no_grad()
def sample(z, zu, keys, suppress, cfg):
    # z, zu: [N, K] -> Sample of [N] fields: the kernel's split states merged here
    n, k = z.shape
    low = cfg.lowered()
    state, ids, top_v, top_i = torch.ops.dlm_kernels.sample_partial(
        z, zu, TorchOps.i32_bits(keys).contiguous(),
        None if suppress is None else suppress.contiguous(), low.temperature, low.top_k,
        low.cfg_c, low.block_k, low.stats_temperature, low.GREEDY, low.TWO_T)
    if cfg.top_k:  # [S, N, k] -> [N, S·k]
        top_v, top_i = (t.permute(1, 0, 2).reshape(n, t.shape[0] * t.shape[2])
                        for t in (top_v, top_i))
    st = sampling.merge_splits(TorchOps, state, ids, top_v, top_i, cfg, k)
    return sampling.finalize(TorchOps, st, keys, cfg)


class TritonSampler:
    """The Triton sampler from torch (``dlm_kernels.sampling.core``'s draw)."""

    name = "triton"
    unsupported_reason = staticmethod(unsupported_reason)
    sample = staticmethod(sample)


IMPLEMENTATION = TritonSampler()
