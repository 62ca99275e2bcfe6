"""The reference backend's sampler for jax (``dlm_kernels.sampling.core.ReferenceSampler``),
run block by block of 8 rows as the chunked sampler's row blocks run (``in_row_blocks``):
XLA's CPU code gives a row's whole-row sums other bits at another row count, so every block
has the same shape whatever N is."""

from __future__ import annotations

from jax import lax

from . import core as sampling
from .core import ReferenceSampler
from .jax_chunked import in_row_blocks
from .._config import ROW_GROUP
from .._jax.ops import JaxOps


class JaxReferenceSampler(ReferenceSampler):
    def sample(self, z, zu, keys, suppress, cfg):
        # z, zu: [N, K] -> Sample of [N] fields, in blocks of ROW_GROUP rows
        def block(z, zu, keys, row0, nb):
            rows = lambda x: None if x is None else lax.dynamic_slice_in_dim(x, row0, nb)  # noqa: E731
            return sampling.reference_sample(JaxOps, rows(z), rows(zu), rows(keys), suppress,
                                             cfg)

        return in_row_blocks(block, z, zu, keys, ROW_GROUP)


IMPLEMENTATION = JaxReferenceSampler(JaxOps)
