"""The objectives on the chunked backends, torch and JAX."""

from __future__ import annotations

from .suite import ObjectivesSuite


class TestTorchChunked(ObjectivesSuite):
    FW, BACKEND = "torch", "chunked"


class TestJaxChunked(ObjectivesSuite):
    FW, BACKEND = "jax", "chunked"
