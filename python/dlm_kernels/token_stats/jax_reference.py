"""The reference backend for JAX (see ``dlm_kernels.token_stats.op.ReferenceBackend``).

Its values run in row blocks of ``_config.min_block_rows(K)`` rows through
``jax_chunked.fold_row_outputs``, as the JAX reference sampler's do: under ``jax.jit`` XLA
fuses a whole-row log-softmax into whatever reads it, so a program that scored rows and one
that computed a loss from them gave the same row log-probs an ulp apart at T != 1; out of a
loop buffer every program reads the same bits. Derivatives of every order stay those of
JAX's autodiff of the plain formulas (a ``jax.custom_jvp`` whose rule is ``jax.jvp`` of
``formulas.reference_stats``), taken in blocks of the same rows under ``lax.map`` (at least
two: XLA unrolls a loop of one trip), so that every program runs one block's derivative
code: on whole [N, K] arrays XLA fused a product into a sum (one multiply-add) in some
programs and not in others, and a row's gradient differed between a batch and the row alone
(``test_invariance.py::test_jax_gradient_rows_alone``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

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
            (rows,), (dots,) = primals, tangents
            n, r = rows.targets.shape[0], min_block_rows(rows.logits.shape[1])
            blocks = max(-(-n // r), 2)  # (a loop of one trip XLA would unroll)

            def one_block(block):  # the tangents of one block of r rows
                return jax.jvp(plain, *block)[1]

            dout = jax.lax.map(one_block, ((_blocks(rows, blocks, r),),
                                           (_blocks(dots, blocks, r),)))
            return stats(rows), tuple(d.reshape(-1)[:n] for d in dout)

        return stats(rows)


IMPLEMENTATION = JaxReferenceBackend(JaxOps)


def _blocks(rows, blocks, r):
    """A bundle (or its tangent) of N rows as ``blocks`` blocks of r rows, [blocks, r, ...]
    (zero rows appended: inactive; an integer field's float0 tangent likewise)."""
    def split(x):
        if x is None:
            return None
        if x.dtype == jax.dtypes.float0:
            return np.zeros((blocks, r) + x.shape[1:], jax.dtypes.float0)
        x = JaxOps.pad_rows(x, blocks * r)
        return x.reshape((blocks, r) + x.shape[1:])

    return Rows(*(split(f) for f in rows))
