"""The torch binding of the shared host code (``dlm_kernels._framework.Framework``)."""

from __future__ import annotations

import torch

from .._dispatch import SAMPLING, TOKEN_STATS, registry
from .._framework import Framework
from ..token_stats.torch_vjp import TorchVJP
from .ops import TorchOps

#: torch's ops adapter, token-statistics VJP and collectives, and op registries
TORCH: Framework[torch.Tensor] = Framework(
    name="torch", xp=TorchOps, vjp=TorchVJP(), token_stats=registry(TOKEN_STATS, "torch"),
    sampling=registry(SAMPLING, "torch"))
