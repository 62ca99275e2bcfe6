"""The token-statistics primitive on the reference backends, torch and JAX: the suite of
``suite.py`` against the float64 oracle."""

from __future__ import annotations

from harness import cases

from .suite import ROTATED_SHAPE_DTYPES, TokenStatsSuite, TorchBufferChecks, TorchCompileChecks


class TestTorchReference(TorchBufferChecks, TorchCompileChecks, TokenStatsSuite):
    FW, BACKEND = "torch", "reference"


class TestJaxReference(TokenStatsSuite):
    FW, BACKEND = "jax", "reference"
    shape_dtype = cases(*ROTATED_SHAPE_DTYPES)  # the oracle's twin: jnp casts, the same at any shape
