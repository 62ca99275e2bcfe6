"""The chunked backends never allocate [N, K] float32 temporaries; their chunk follows the
device they run on."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from bench.memory import PROBE_ENV

HERE = os.path.dirname(__file__)


def _jax_compiled(backend, dtype, features, grad, n, k):
    """One token_stats call compiled by XLA (for CPU, the machine the tests run on)."""
    import jax
    import jax.numpy as jnp

    import dlm_kernels.jax as D

    def loss(z, u, y, x, d):
        kw = {}
        if features == "all":  # every per-row and per-element feature, the teacher's gradient too
            kw = dict(teacher_logits=u, teacher_grad=True, softcap=30.0, shift_ids=x, shift=d,
                      temperature=0.7, ce_temperature=1.3, teacher_temperature=1.1)
        s = D.token_stats(z, y, backend=backend, **kw)
        return jnp.sum(s.logp) + jnp.sum(s.entropy) + jnp.sum(s.kl)

    S = jax.ShapeDtypeStruct
    args = (S((n, k), jnp.dtype(dtype)), S((n, k), jnp.dtype(dtype)), S((n,), jnp.int32),
            S((n,), jnp.int32), S((n,), jnp.float32))
    fn = jax.grad(loss, argnums=(0, 1) if features == "all" else 0) if grad else loss
    return jax.jit(fn).trace(*args).lower().compile()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("features", ["plain", "all"])
def test_jax_chunked_temp_bytes_are_a_fraction_of_reference(dtype, features):
    """Forward and forward+gradient at N = 2048, K = 32768: the chunked backend holds a few
    [N, C] chunks, never a [N, K] float32 buffer. (On CPU a 16-bit gradient is carried as
    its bits, one buffer of the gradient's own size: see token_stats/jax_chunked.py. Before
    that, and before the loop-index barrier, XLA converted whole bfloat16 logits to float32.)"""
    from dlm_kernels._config import CHUNK_BYTES_CPU

    n, k = 2048, 32768
    full = n * k * 4  # one [N, K] float32 buffer
    chunks = 8 * CHUNK_BYTES_CPU  # a handful of [N, C] float32 chunks of the CPU's budget
    carry = n * k * 2 if dtype == "bfloat16" else 0
    temp = lambda compiled: compiled.memory_analysis().temp_size_in_bytes
    fwd = temp(_jax_compiled("chunked", dtype, features, False, n, k))
    compiled = _jax_compiled("chunked", dtype, features, True, n, k)
    both = temp(compiled)
    ref = temp(_jax_compiled("reference", dtype, features, True, n, k))
    mib = lambda b: f"{b / 2**20:.1f} MiB"
    assert ref >= full, f"reference temp {mib(ref)} should hold at least one [N, K] f32 buffer"
    assert fwd <= chunks, f"chunked forward temp {mib(fwd)} is not O(N·C)"
    assert both <= carry + chunks, f"chunked fwd+grad temp {mib(both)} (bit carry {mib(carry)})"
    assert both <= ref / 2, f"chunked temp {mib(both)} vs reference {mib(ref)}"
    if dtype != "float32":
        # not even inside a fusion (no temporary to count): XLA's CPU compiler made each
        # chunk's bfloat16 update of the gradient a float32 round trip of the whole buffer
        update = re.compile(rf"f32\[{n},{k}\](\{{[0-9,]*\}})? dynamic-update-slice\(")
        assert not update.search(compiled.as_text()), "a [N, K] float32 update in the loop"


@pytest.mark.parametrize("platform", ["cpu", "cuda", "tpu"])
def test_jax_chunk_follows_the_platform_it_is_lowered_for(platform):
    """Tiles of R rows and C columns by platform, whatever N: a CPU's C is
    CHUNK_COLUMNS_CPU and its [R, C] float32 tile 8 MiB; an accelerator's C is
    CHUNK_COLUMNS_ACCELERATOR and its tile 128 MiB, so its passes outlast their kernel
    launches (N 4096, K 262144: 512 x 4096 vs 1024 x 32768). JAX picks while lowering
    (lax.platform_dependent), seen in the chunk loops' slices."""
    import jax
    import jax.numpy as jnp

    import dlm_kernels.jax as D
    from dlm_kernels._config import (CHUNK_BYTES_ACCELERATOR, CHUNK_BYTES_CPU,
                                     CHUNK_COLUMNS_ACCELERATOR, CHUNK_COLUMNS_CPU)

    n, k = 4096, 262144

    def loss(z, y):
        return jnp.sum(D.token_stats(z, y, backend="chunked", entropy=False).logp)

    args = (jax.ShapeDtypeStruct((n, k), jnp.bfloat16), jax.ShapeDtypeStruct((n,), jnp.int32))
    text = jax.jit(jax.value_and_grad(loss)).trace(*args).lower(
        lowering_platforms=(platform,)).as_text()
    tiles = {(int(r), int(c))
             for r, c in re.findall(r"dynamic_slice .*sizes = \[(\d+), (\d+)\]", text)}
    on_cpu = platform == "cpu"
    c = CHUNK_COLUMNS_CPU if on_cpu else CHUNK_COLUMNS_ACCELERATOR
    budget = CHUNK_BYTES_CPU if on_cpu else CHUNK_BYTES_ACCELERATOR
    assert tiles == {(budget // (4 * c), c)}, f"{platform}: tiles {sorted(tiles)}"


def test_torch_chunk_follows_the_device():
    """Chunks of a fixed width by device, whatever N; rows in blocks within the budget."""
    import torch

    from dlm_kernels._config import (CHUNK_BYTES_ACCELERATOR, CHUNK_BYTES_CPU,
                                     CHUNK_COLUMNS_ACCELERATOR, CHUNK_COLUMNS_CPU, make_config)
    from dlm_kernels.token_stats.torch_chunked import _blocks, _chunks

    n, k = 4096, 262144
    for device, width, budget in (("cpu", CHUNK_COLUMNS_CPU, CHUNK_BYTES_CPU),
                                  ("cuda", CHUNK_COLUMNS_ACCELERATOR, CHUNK_BYTES_ACCELERATOR),
                                  ("mps", CHUNK_COLUMNS_ACCELERATOR, CHUNK_BYTES_ACCELERATOR)):
        spans = _chunks(k, make_config(), torch.device(device))
        assert spans == [(c0, c0 + width) for c0 in range(0, k, width)], (device, spans[:2])
        rows = budget // (4 * width)
        assert _blocks(n, spans, torch.device(device)) == [
            (r0, min(r0 + rows, n)) for r0 in range(0, n, rows)], device


def _mem_probe(*args):
    """The last line ``mem_probe.py ARGS`` prints, run in a fresh process with the allocator's
    fixed mapping threshold (``bench.memory.PROBE_ENV``): its peak is that of live buffers.
    Without it the same head probe measured 19, 41, 64 MiB here and 88 MiB on the CI machine."""
    out = subprocess.run([sys.executable, os.path.join(HERE, "mem_probe.py"), *map(str, args)],
                         check=True, capture_output=True, text=True,
                         env={**os.environ, **PROBE_ENV})
    return out.stdout.strip().splitlines()[-1]


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux /proc")
def test_torch_chunked_peak_memory():
    """VmHWM growth of forward+backward at N = 4096, K = 8192 f32 (128 MiB logits; 2^25 of
    them, so the compiled CPU loops run, compiled by a warm-up call before the measure)."""
    n, k = 4096, 8192

    grad_bytes = n * k * 4  # the gradient itself must exist
    ref, chunked = (int(_mem_probe(backend, n, k)) for backend in ("reference", "chunked"))
    assert chunked < 1.5 * grad_bytes, f"chunked peak {chunked / 2**20:.0f} MiB beyond inputs"
    assert ref > 3 * chunked, f"reference {ref / 2**20:.0f} MiB vs chunked {chunked / 2**20:.0f} MiB"


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux /proc")
def test_torch_bf16_head_gradient_needs_no_float32_weight():
    """A bfloat16 head's weight gradient on a CPU: peak growth of forward+backward at K 131072,
    D 128 (a 32 MiB weight), N 64, within the weight gradient itself plus 1.25x the weight.
    Before vocabulary blocks of 16 MiB (``HEAD_DW_ACC_BYTES_TORCH_CPU``), a float32 dW
    accumulator [K, D] and a float32 copy of the whole weight per token chunk took 6x it
    (192 MiB; 68 MiB of live buffers after)."""
    n, k, d = 64, 131072, 128
    peak = int(_mem_probe("head", n, k, d))
    weight = k * d * 2
    assert peak < 2.25 * weight, (
        f"peak {peak / 2**20:.0f} MiB beyond inputs; the bf16 weight is {weight / 2**20:.0f} MiB")


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="needs Linux /proc")
def test_large_cpu_gradients_are_not_advised_into_huge_pages():
    """The chunked backend's [N, K] gradient on a CPU lives in the kernel's default pages
    (no VmFlags ``hg``): advised into 2 MiB pages, a fresh 2 GiB gradient took 4-6 s
    instead of 0.44 s to fill on a virtual machine whose free memory had gone back to its
    host (bench/NOTES.md, "Shifted tiles, dynamic threads, huge pages withdrawn"). Checked in
    a fresh process (``mem_probe.py vmflags``): in a test worker the gradient can land in heap
    memory that another library advised before (seen once in the whole suite's run)."""
    flags = _mem_probe("vmflags", 256, 32768).split()
    assert flags and "hg" not in flags, flags
