"""The reference backend: full float32 materialisation, differentiated by torch autograd."""

from __future__ import annotations

from .. import _stats_math as M
from ._ops import TorchOps


class ReferenceTorch:
    name = "reference"
    custom_vjp = False

    @staticmethod
    def unsupported_reason(platform):
        return None

    @staticmethod
    def compute(z, u, y, active, x, d, cfg):
        # z, u: [N, K]; y, active, x, d: [N] -> 4 x [N] f32
        return M.reference_stats(TorchOps, z, u, y, active, x, d, cfg)


IMPLEMENTATION = ReferenceTorch()
