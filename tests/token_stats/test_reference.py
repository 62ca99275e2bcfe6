"""The token-statistics primitive on the reference backends, torch and JAX: the suite of
``suite.py`` against the float64 oracle."""

from __future__ import annotations

import numpy as np
from harness import cases

from .suite import ROTATED_SHAPE_DTYPES, TokenStatsSuite, TorchBufferChecks, TorchCompileChecks


class TestTorchReference(TorchBufferChecks, TorchCompileChecks, TokenStatsSuite):
    FW, BACKEND = "torch", "reference"


class TestJaxReference(TokenStatsSuite):
    FW, BACKEND = "jax", "reference"
    shape_dtype = cases(*ROTATED_SHAPE_DTYPES)  # the oracle's twin: jnp casts, the same at any shape

    def test_plus_inf_row_in_a_jitted_vjp(self):
        """A +inf logit leaves no distribution under ``jax.jit`` of the forward with its VJP
        too. XLA on a CPU compiled the old test for it, ``max(row) == inf``, so that in this
        program (six rows, a teacher, a LOO shift, T = 100, no entropy) the row's lse came out
        finite (3.7 at K 4099, 4.1 at K 64) while the eager and forward-only calls gave NaN."""
        jax, jnp = self.fw.jax, self.fw.jnp
        rng = np.random.default_rng(0)  # the defect showed for every seed tried
        n, k, row = 6, 64, 3
        z = rng.normal(size=(n, k))
        z[row, 7] = np.inf
        u = rng.normal(size=(n, k))
        y, x = rng.integers(0, k, n), rng.integers(0, k, n)
        d = rng.uniform(0.0, 6.0, n).astype(np.float32)

        def stats(z_, d_, u_, y_, x_):
            st = self.fw.api.token_stats(z_, y_, teacher_logits=u_, shift=d_, shift_ids=x_,
                                         temperature=100.0, entropy=False, backend="reference")
            return st.lse, st.logp, st.kl

        def program(z_, d_, u_, y_, x_):
            out, vjp = jax.vjp(lambda a, b: stats(a, b, u_, y_, x_), z_, d_)
            return out, vjp(tuple(jnp.ones(n, jnp.float32) for _ in out))

        out, (dz, dd) = jax.jit(program)(jnp.asarray(z, jnp.float32), jnp.asarray(d),
                                         jnp.asarray(u, jnp.float32), jnp.asarray(y),
                                         jnp.asarray(x))
        for name, v in zip(("lse", "logp", "kl"), out):
            v = np.asarray(v)
            assert np.isnan(v[row]), f"{name} of the +inf row: {v[row]}"
            assert np.isfinite(np.delete(v, row)).all(), f"{name} of the finite rows: {v}"
        assert np.isnan(np.asarray(dz)[row]).all() and np.isnan(np.asarray(dd)[row]), (
            "the +inf row's gradient is NaN")
