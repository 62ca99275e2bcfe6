"""Where the Triton kernels run in the tests: compiled on a CUDA GPU, else in Triton's
interpreter (TRITON_INTERPRET=1, which conftest sets); the Triton test classes skip where
neither is there. Shared by tests/token_stats/test_triton.py and
tests/objectives/test_triton.py."""

from __future__ import annotations

import os

import pytest

ON_GPU = False
try:
    import torch

    ON_GPU = torch.cuda.is_available()
except ImportError:  # pragma: no cover
    pass

needs_interpreter = pytest.mark.skipif(
    not ON_GPU and os.environ.get("TRITON_INTERPRET") != "1",
    reason="Triton kernels need a GPU or TRITON_INTERPRET=1")
