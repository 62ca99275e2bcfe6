"""The chunked backends never allocate [N, K] float32 temporaries."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(__file__)


def test_jax_chunked_temp_bytes_are_a_fraction_of_reference():
    """XLA's own accounting of forward+gradient temporaries at N = 2048, K = 32768, f32."""
    import jax
    import jax.numpy as jnp

    import dlm_kernels.jax as D

    n, k = 2048, 32768

    def temp_bytes(backend):
        def loss(z, y):
            s = D.token_stats(z, y, backend=backend)
            return jnp.sum(s.logp) + jnp.sum(s.entropy)

        args = (jax.ShapeDtypeStruct((n, k), jnp.float32), jax.ShapeDtypeStruct((n,), jnp.int32))
        compiled = jax.jit(jax.value_and_grad(loss)).trace(*args).lower().compile()
        return compiled.memory_analysis().temp_size_in_bytes

    ref, chunked = temp_bytes("reference"), temp_bytes("chunked")
    full = n * k * 4
    assert ref >= full, f"reference temp {ref} should hold at least one [N, K] f32 buffer"
    assert chunked <= ref / 8, f"chunked temp {chunked / 2**20:.1f} MiB vs reference {ref / 2**20:.1f} MiB"
    assert chunked < full / 4, f"chunked temp {chunked / 2**20:.1f} MiB is not O(N)"


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux /proc")
def test_torch_chunked_peak_memory():
    """VmHWM growth of forward+backward at N = 4096, K = 32768 f32 (512 MiB logits)."""
    n, k = 4096, 32768

    def peak(backend):
        out = subprocess.run([sys.executable, os.path.join(HERE, "mem_probe.py"), backend, str(n), str(k)],
                             check=True, capture_output=True, text=True)
        return int(out.stdout.strip().splitlines()[-1])

    grad_bytes = n * k * 4  # the gradient itself must exist
    ref, chunked = peak("reference"), peak("chunked")
    assert chunked < 1.5 * grad_bytes, f"chunked peak {chunked / 2**20:.0f} MiB beyond inputs"
    assert ref > 3 * chunked, f"reference {ref / 2**20:.0f} MiB vs chunked {chunked / 2**20:.0f} MiB"
