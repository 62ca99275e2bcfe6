"""The reference backend: full float32 materialisation, differentiated by JAX autodiff."""

from __future__ import annotations

from .. import _stats_math as M
from ._ops import JaxOps


class ReferenceJax:
    name = "reference"
    custom_vjp = False

    @staticmethod
    def unsupported_reason(platform):
        return None

    @staticmethod
    def compute(z, u, y, active, x, d, cfg):
        # z, u: [N, K]; y, active, x, d: [N] -> 4 x [N] f32
        return M.reference_stats(JaxOps, z, u, y, active, x, d, cfg)


IMPLEMENTATION = ReferenceJax()
