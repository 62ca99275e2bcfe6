"""The Pallas sampler (``kernels.pallas.sampling``): one split per row, finalised here; the
drawn token's logp and the entropy are the ones its kernel finished as the token statistics'
forward finishes them (docs/design.md §3, "Rollout = trainer")."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from . import core as sampling
from ..kernels.layout import SAMPLE_IDS, SAMPLE_ROW_STATS, SAMPLE_STATE
from ..kernels.pallas import sampling as sampler
from .._jax.batching import fold_vmap_into_rows
from .._jax.ops import JaxOps
from .._jax.pallas import RaceDetection, interpret_mode, unsupported_reason


def sample(z, zu, keys, suppress, cfg):
    # z, zu: [N, K] -> Sample of [N] fields; the kernel's one split finalised here
    n, k = z.shape
    ints = [jax.lax.bitcast_convert_type(keys, jnp.int32)[:, None]]  # [N, 1 + S]
    if suppress is not None:
        ints.append(jnp.broadcast_to(suppress.astype(jnp.int32), (n,) + suppress.shape))
    low = cfg.lowered()
    statics = dict(temperature=low.temperature, stat_temperature=low.stats_temperature,
                   cfg_c=low.cfg_c, greedy=low.GREEDY, two_t=low.TWO_T, top_k=low.top_k,
                   inv_t=sampling.stats_lowered(cfg).inv_t, block_k=low.block_k,
                   interpret=interpret_mode(), detect_races=RaceDetection.enabled)
    call = fold_vmap_into_rows(
        lambda z, *rest: sampler.sample_partial(z, rest[0] if zu is not None else None,
                                                rest[-1], **statics))
    if n == 0:  # no rows: no launch (a grid over zero row blocks reads out of bounds)
        floats, ids = (jnp.zeros((0, len(f)), t) for f, t in
                       ((SAMPLE_STATE + SAMPLE_ROW_STATS, jnp.float32),
                        (SAMPLE_IDS, jnp.int32)))
        top_v, top_i = (jnp.zeros((0, low.top_k), t) for t in (jnp.float32, jnp.int32))
    else:
        floats, ids, top_v, top_i = call(z, *([zu] if zu is not None else []),
                                         jnp.concatenate(ints, axis=1))
    st = sampling.merge_splits(JaxOps, floats.T[:, None, :], ids.T[:, None, :], top_v,
                               top_i, cfg, k)
    row = {f: floats[:, len(SAMPLE_STATE) + j] for j, f in enumerate(SAMPLE_ROW_STATS)}
    return sampling.finalize(JaxOps, st, RowStats(**row), keys, cfg)


class RowStats(NamedTuple):
    """The row statistics the kernel finished (``SAMPLE_ROW_STATS``), [N] each."""

    la: jax.Array
    logp: jax.Array
    entropy: jax.Array


class PallasSampler:
    """The Pallas sampler (``dlm_kernels.sampling.core``'s draw)."""

    name = "pallas"
    unsupported_reason = staticmethod(unsupported_reason)
    sample = staticmethod(sample)


IMPLEMENTATION = PallasSampler()
