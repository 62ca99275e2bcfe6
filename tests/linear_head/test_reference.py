"""The linear head on the reference backends, torch and JAX."""

from __future__ import annotations

from harness import cases

from .suite import LinearHeadSuite


class TestTorchReference(LinearHeadSuite):
    FW, BACKEND = "torch", "reference"
    head_case = cases(("KD", "float32"), ("DK", "bfloat16"))


class TestJaxReference(LinearHeadSuite):
    FW, BACKEND = "jax", "reference"
    head_case = cases(("DK", "bfloat16"))
