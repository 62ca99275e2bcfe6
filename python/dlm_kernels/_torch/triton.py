"""What every op's Triton launch from torch shares: the launch plan of
``kernels.triton.token_stats.launch_config``, unit-stride columns."""

from __future__ import annotations

import os
from typing import Optional

import torch

from ..kernels.triton import token_stats as kernels

Tensor = torch.Tensor


# Triton picks its interpreter when it is first imported, from this variable: read it once.
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def unsupported_reason(platform: str) -> Optional[str]:
    """None where the Triton kernels take torch tensors of ``platform``, else why not."""
    if platform == "cuda":
        return None
    if platform == "cpu" and _INTERPRETED:
        return None  # the Triton interpreter runs the kernels on CPU tensors
    return ("the Triton kernels need CUDA tensors (CPU tensors only under "
            "TRITON_INTERPRET=1, set before triton is imported)")


def unit_col(t: Optional[Tensor]) -> Optional[Tensor]:
    """Rows may be strided; columns must be unit-stride (an explicit copy otherwise)."""
    if t is None or t.stride(-1) == 1:
        return t
    return t.contiguous()


def plan(z, u, block_k=0):
    """The launch plan (block size, warps, stages, splits) the heuristic picks for z: [N, K]:
    a function of K, the dtype and the block asked for, never of N (``launch_config``)."""
    return kernels.launch_config(z.shape[1], z.element_size(), u is not None, block_k or None)
