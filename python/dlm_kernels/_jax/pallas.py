"""What every op's Pallas call shares: interpret mode, race detection, the lowered call's
statics, and the int / float columns the kernels of ``kernels.pallas`` read."""

from __future__ import annotations

import os
from typing import Optional

import jax
import jax.numpy as jnp

from ..token_stats import formulas as stats_math
from .._env import PALLAS_INTERPRET_ENV
from ..kernels.layout import ROW_STATS
from ..kernels.pallas import token_stats as kernels
from .ops import JaxOps


def interpret_mode() -> bool:
    value = os.environ.get(PALLAS_INTERPRET_ENV, "").strip()
    if value in ("0", "1"):
        return value == "1"
    if value:
        raise ValueError(f"{PALLAS_INTERPRET_ENV} must be 0 or 1; got {value!r}")
    return jax.default_backend() == "cpu"


def unsupported_reason(platform: str) -> Optional[str]:
    """None where the Pallas kernels take JAX arrays of ``platform``, else why not."""
    forced = os.environ.get(PALLAS_INTERPRET_ENV, "").strip()
    if platform == "tpu" or forced == "0" or interpret_mode():
        return None  # "0" forces compiled Mosaic: lowering for TPU works anywhere
    return (f"the Pallas kernels target TPUs (arrays are on {platform!r}; set "
            f"{PALLAS_INTERPRET_ENV}=1 for interpret mode)")


class RaceDetection:
    """Whether interpret mode also detects races between grid steps (a test aid, switched by
    ``dlm_kernels.testing.pallas_race_detection``)."""

    enabled = False


def kernel_statics(cfg):
    # the lowered call's statics, and how this process runs the kernels
    return dict(cfg.pallas_statics(), interpret=interpret_mode(),
                detect_races=RaceDetection.enabled)


def int_columns(y, x, offset=0):  # [N, 3] int32: target, shift column, global id of column 0
    y = y.astype(jnp.int32)
    return jnp.stack([y, (y if x is None else x).astype(jnp.int32),
                      jnp.zeros_like(y) + jnp.asarray(offset, jnp.int32)], axis=1)


def _shift(rows):  # [N] float32: the shift of each row (0 without one)
    d = rows.shift
    return jnp.zeros(rows.targets.shape, jnp.float32) if d is None else d.astype(jnp.float32)


def forward_float_columns(rows, active):  # [N, 2]: shift, active (the forward's F_* columns)
    return jnp.stack([_shift(rows), active.astype(jnp.float32)], axis=1)


def row_stats(out, active, cfg):
    """The Stats of the forward's output [N, stats_width] (ROW_STATS, logp the target's
    log-probability, then Σ r with label smoothing), logp made the CE term (O(N)) with label
    smoothing or z-loss."""
    stats = stats_math.Stats(*(out[:, j] for j in range(len(ROW_STATS))))
    if not cfg.CE_TERMS:
        return stats
    sr = out[:, len(ROW_STATS)] if cfg.SMOOTH else None
    return stats._replace(logp=stats_math.ce_objective(JaxOps, stats.logp, sr, stats.m,
                                                       stats.la_ce, active, cfg))


def backward_float_columns(rows, stats, grads, cfg):  # [N, 16]: the backward's F_* columns
    n = rows.targets.shape[0]
    cols = [_shift(rows), rows.active.astype(jnp.float32), stats.m, stats.la, stats.entropy,
            stats.kl_shift, stats.la_ce, stats.mu, stats.la_u, *grads]
    if cfg.CE_TERMS:  # F_GY, F_GU, F_GP: the CE term's per-row coefficients
        g_y, g_u, g_p = stats_math.ce_coefficients(JaxOps, grads[1], stats, cfg)
        cols += [g_y, jnp.zeros_like(g_y) if g_u is None else g_u, g_p]
    return jnp.stack(cols + [jnp.zeros((n,), jnp.float32)] * (kernels.BWD_FLOATS - len(cols)),
                     axis=1)
