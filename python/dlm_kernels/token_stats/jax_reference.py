"""The reference backend for JAX (see ``dlm_kernels.token_stats.op.ReferenceBackend``).

Its values run in row blocks of ``_config.min_block_rows(K)`` rows through
``jax_chunked.fold_row_outputs``, as the JAX reference sampler's do: under ``jax.jit`` XLA
fuses a whole-row log-softmax into whatever reads it, so a program that scored rows and one
that computed a loss from them gave the same row log-probs an ulp apart at T != 1; out of a
loop buffer every program reads the same bits. Derivatives of every order stay those of
JAX's autodiff of the plain formulas (a ``jax.custom_jvp`` whose rule is ``jax.jvp`` of
``formulas.reference_stats`` on the same rows).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from . import formulas as stats_math
from .jax_chunked import _row_slice, fold_row_outputs
from .op import ReferenceBackend
from .._config import min_block_rows
from .._jax.ops import JaxOps
from .._rows import Rows


class JaxReferenceBackend(ReferenceBackend):
    def whole_rows(self, rows, cfg):
        # rows: a bundle of N >= min_block_rows(K) rows -> (lse, logp, entropy, kl) [N]
        def plain(rows):
            return tuple(stats_math.reference_stats(JaxOps, rows, cfg))

        if rows.targets.shape[0] == 0:  # no rows, no blocks
            return plain(rows)

        @jax.custom_jvp
        def stats(rows):
            n, r = rows.targets.shape[0], min_block_rows(rows.logits.shape[1])

            def block(row0, nb):
                return plain(Rows(*(_row_slice(f, row0, nb) for f in rows)))

            return fold_row_outputs(block, n, r, r, (jnp.float32,) * 4, (rows,))

        @stats.defjvp
        def stats_jvp(primals, tangents):
            _, dout = jax.jvp(plain, primals, tangents)
            return stats(*primals), dout

        return stats(rows)


IMPLEMENTATION = JaxReferenceBackend(JaxOps)
