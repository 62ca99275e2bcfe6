"""The reference backend's sampler for jax (``dlm_kernels.sampling.core.ReferenceSampler``),
run block by block of ``_config.min_block_rows(K)`` rows as the chunked sampler's row
blocks run (``in_row_blocks``): XLA's CPU code gives a row's whole-row sums other bits at
another row count, so every block has the same shape whatever N is (the reference token
statistics run on at least as many rows: ``JaxOps.whole_row_rows``)."""

from __future__ import annotations

from jax import lax

from . import core as sampling
from .core import ReferenceSampler
from .jax_chunked import in_row_blocks
from .._config import min_block_rows
from .._jax.ops import JaxOps


class JaxReferenceSampler(ReferenceSampler):
    def sample(self, z, zu, keys, suppress, cfg):
        # z, zu: [N, K] -> Sample of [N] fields, in blocks of min_block_rows(K) rows
        def block(z, zu, keys, row0, nb):
            rows = lambda x: None if x is None else lax.dynamic_slice_in_dim(x, row0, nb)  # noqa: E731
            return sampling.reference_sample(JaxOps, rows(z), rows(zu), rows(keys), suppress,
                                             cfg)

        rows = min_block_rows(z.shape[1])
        return in_row_blocks(block, z, zu, keys, rows, rows)


IMPLEMENTATION = JaxReferenceSampler(JaxOps)
