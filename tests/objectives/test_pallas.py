"""The objectives on the pallas backend, in TPU interpret mode on CPU."""

from __future__ import annotations

import pytest

pytest.importorskip("jax.experimental.pallas.tpu")

from .suite import KernelObjectivesSuite  # noqa: E402


@pytest.fixture(autouse=True)
def _interpret(monkeypatch):
    monkeypatch.setenv("DLM_KERNELS_PALLAS_INTERPRET", "1")


class TestJaxPallasObjectives(KernelObjectivesSuite):
    FW, BACKEND = "jax", "pallas"
