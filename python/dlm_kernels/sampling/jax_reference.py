"""The reference backend's sampler for jax (``dlm_kernels.sampling.core.ReferenceSampler``),
run block by block of 8 rows as the chunked sampler's row blocks run (``fold_row_blocks``):
XLA's CPU code gives a row's whole-row sums other bits at another row count, so every block
has the same shape whatever N is."""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from . import core as sampling
from .core import ReferenceSampler
from .._config import ROW_GROUP
from .._jax.ops import JaxOps
from ..token_stats.jax_chunked import fold_row_blocks, pad_rows, varying_like


class JaxReferenceSampler(ReferenceSampler):
    def sample(self, z, zu, keys, suppress, cfg):
        # z, zu: [N, K] -> Sample of [N] fields, in blocks of ROW_GROUP rows
        n = z.shape[0]
        if n < ROW_GROUP:  # as ROW_GROUP rows (zero rows after them)
            out = self.sample(pad_rows(z, ROW_GROUP), pad_rows(zu, ROW_GROUP),
                              pad_rows(keys, ROW_GROUP), suppress, cfg)
            return sampling.Sample(*(f[:n] for f in out))
        kinds = (jnp.int32, jnp.float32, jnp.int32, jnp.float32, jnp.float32, jnp.float32)
        bufs = tuple(varying_like(jnp.zeros((n,), kind), z, zu, keys) for kind in kinds)

        def step(bufs, row0, nb):
            rows = lambda x: None if x is None else lax.dynamic_slice_in_dim(x, row0, nb)  # noqa: E731
            out = sampling.reference_sample(JaxOps, rows(z), rows(zu), rows(keys), suppress,
                                            cfg)
            return tuple(lax.dynamic_update_slice_in_dim(b, o.astype(b.dtype), row0, axis=0)
                         for b, o in zip(bufs, out))

        return sampling.Sample(*fold_row_blocks(step, n, ROW_GROUP, bufs))


IMPLEMENTATION = JaxReferenceSampler(JaxOps)
