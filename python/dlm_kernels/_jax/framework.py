"""The JAX binding of the shared host code (``dlm_kernels._framework.Framework``)."""

from __future__ import annotations

import jax

from .._dispatch import SAMPLING, TOKEN_STATS, registry
from .._framework import Framework
from ..token_stats.jax_vjp import JaxVJP
from .ops import JaxOps

#: JAX's ops adapter, token-statistics VJP and collectives, and op registries
JAX: Framework[jax.Array] = Framework(
    name="jax", xp=JaxOps, vjp=JaxVJP(), token_stats=registry(TOKEN_STATS, "jax"),
    sampling=registry(SAMPLING, "jax"))
