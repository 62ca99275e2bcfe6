"""The objectives on the triton backend: torch under TRITON_INTERPRET=1 on CPU tensors, and
JAX through the jax-triton emulator (``jax_triton_on_cpu`` in conftest)."""

from __future__ import annotations

import pytest

triton = pytest.importorskip("triton")

from triton_marks import needs_interpreter  # noqa: E402

from .suite import KernelObjectivesSuite  # noqa: E402


@needs_interpreter
class TestTorchTritonObjectives(KernelObjectivesSuite):
    FW, BACKEND = "torch", "triton"


@needs_interpreter
@pytest.mark.usefixtures("jax_triton_on_cpu")
class TestJaxTritonEmulatedObjectives(KernelObjectivesSuite):
    FW, BACKEND = "jax", "triton"
