"""The Triton sampler from torch: the ``dlm_kernels::sample_partial`` custom op
(``kernels.triton.sampling``) and the draw that merges its vocabulary splits; the drawn
token's logp and the entropy come from the token statistics' finalize kernel
(``dlm_kernels::token_stats_finalize``) over the splits' statistics, as ``per_token_logps``
finalises its own (docs/design.md §3, "Rollout = trainer")."""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from . import core as sampling
from ..kernels.layout import SAMPLE_IDS, SAMPLE_STATE
from ..kernels.triton import sampling as sampler
from ..kernels.triton import token_stats as kernels
from .._torch.buffers import empty as _empty
from .._torch.ops import TorchOps
from .._torch.triton import unit_col, plan, unsupported_reason
from ..token_stats import formulas as stats_math
from ..token_stats import torch_triton as _stats  # noqa: F401  (registers the finalize op)

Tensor = torch.Tensor


@torch.library.custom_op("dlm_kernels::sample_partial", mutates_args=())
def sample_partial(z: Tensor, zu: Optional[Tensor], keys: Tensor, suppress: Optional[Tensor],
                   temperature: float, top_k: int, cfg_c: float, block_k: Optional[int],
                   stat_temperature: float, greedy: bool, two_t: bool,
                   inv_t: float) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """The sampler's split states of z: [N, K] (``kernels.triton.sampling``): (state
    [SAMPLE_STATE, S, N] f32, ids [SAMPLE_IDS, S, N] i32, top-k slots [S, N, k] f32 and i32,
    empty without top_k)."""
    z, zu = unit_col(z), unit_col(zu)
    n, k = z.shape
    launch = plan(z, zu, block_k)
    s = launch["splits"]
    state = _empty((len(SAMPLE_STATE), s, n), torch.float32, z.device)  # 28·S bytes per row
    ids = _empty((len(SAMPLE_IDS), s, n), torch.int32, z.device)  # 8·S bytes per row
    slots = (s, n, top_k) if top_k else (0,)
    top_v = _empty(slots, torch.float32, z.device)
    top_i = _empty(slots, torch.int32, z.device)
    if n > 0:
        sampler.sample_partial_kernel[(n, s)](
            z, z if zu is None else zu, keys, keys if suppress is None else suppress, n, k,
            0 if suppress is None else suppress.shape[0], z.stride(0),
            0 if zu is None else zu.stride(0), launch["cols_per_split"],
            temperature, stat_temperature, cfg_c, inv_t, state, ids, top_v, top_i,
            GREEDY=greedy, TWO_T=two_t, HAS_UNCOND=zu is not None,
            HAS_SUPPRESS=suppress is not None, TOP_K=top_k,
            TOP_KP=sampler.slot_count(top_k), BLOCK_K=launch["block_k"], VEC=launch["vec"],
            ROWS_ALIGNED=kernels.rows_aligned(z.stride(0), 0 if zu is None else zu.stride(0)),
            num_warps=launch["num_warps"], num_stages=launch["num_stages"],
            # with guidance its multiply and add round as on the host; without, the
            # statistics' sums compile as the token statistics' kernel (contraction on)
            enable_fp_fusion=zu is None)
    return state, ids, top_v, top_i


@sample_partial.register_fake
def _(z, zu, keys, suppress, temperature, top_k, cfg_c, block_k, stat_temperature, greedy,
      two_t, inv_t):
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
    low, stats_low = cfg.lowered(), sampling.stats_lowered(cfg)
    state, ids, top_v, top_i = torch.ops.dlm_kernels.sample_partial(
        z, zu, TorchOps.i32_bits(keys).contiguous(),
        None if suppress is None else suppress.contiguous(), low.temperature, low.top_k,
        low.cfg_c, low.block_k, low.stats_temperature, low.GREEDY, low.TWO_T, stats_low.inv_t)
    if cfg.top_k:  # [S, N, k] -> [N, S·k]
        top_v, top_i = (t.permute(1, 0, 2).reshape(n, t.shape[0] * t.shape[2])
                        for t in (top_v, top_i))
    st = sampling.merge_splits(TorchOps, state, ids, top_v, top_i, cfg, k)
    return sampling.finalize(TorchOps, st, _row_stats(z, zu, state, st, cfg, stats_low), keys,
                             cfg)


def _row_stats(z, zu, state, st, cfg, low):
    """The token statistics (``token_stats.formulas.Stats``) of the splits' statistics state[:3]
    with ``stats_target`` as the target: the token statistics' finalize kernel, as
    ``per_token_logps`` runs it. With guidance the kernel's target logit would be the
    conditional one: logp is then formed from the guided logit gz the kernel kept."""
    active = torch.ones(z.shape[0], dtype=torch.int8, device=z.device)
    target = sampling.stats_target(st, cfg)
    out = torch.ops.dlm_kernels.token_stats_finalize(state, z, target, active, *low)
    stats = stats_math.Stats(*out.unbind(0))
    if zu is not None and not cfg.greedy and cfg.top_k is None:
        found = torch.ones_like(stats.m)
        stats = stats._replace(logp=stats_math.target_logp(TorchOps, st.gz, found, stats.m,
                                                           stats.la_ce, low))
    return stats


class TritonSampler:
    """The Triton sampler from torch (``dlm_kernels.sampling.core``'s draw)."""

    name = "triton"
    unsupported_reason = staticmethod(unsupported_reason)
    sample = staticmethod(sample)


IMPLEMENTATION = TritonSampler()
