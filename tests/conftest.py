import os
import sys

# Triton's interpreter must be chosen before triton is imported anywhere.
os.environ.setdefault("TRITON_INTERPRET", "1")
# Several host devices for the JAX sharding tests; set before jax initialises.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

sys.path.insert(0, os.path.dirname(__file__))

import pytest  # noqa: E402

from harness import new_seed  # noqa: E402


@pytest.fixture
def rng():
    import numpy as np

    return np.random.default_rng(new_seed())
