"""The objectives on the reference backends, torch and JAX."""

from __future__ import annotations

from .suite import ObjectivesSuite


class TestTorchReference(ObjectivesSuite):
    FW, BACKEND = "torch", "reference"
    MASKED_TAIL_SHAPE = (16, 8192)  # materialised whole: no chunk for the rows to size


class TestJaxReference(ObjectivesSuite):
    FW, BACKEND = "jax", "reference"
    MASKED_TAIL_SHAPE = (16, 8192)  # materialised whole: no chunk for the rows to size
