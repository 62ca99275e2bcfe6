"""Timing and bandwidth: warm-up, per-call timing with CUDA events (GPU) or perf_counter
(CPU; JAX calls block until ready), medians with the 20th-80th percentile spread; on a GPU
also the mean of the same calls run back to back."""

from __future__ import annotations

import time

import numpy as np


def _torch_cuda():
    try:
        import torch

        return torch if torch.cuda.is_available() else None
    except ImportError:
        return None


def measure(fn, *, cuda=False, warmup=2, reps=10, budget_s=20.0):
    """Time fn(i) for i = 0, 1, ...; returns dict(ms, p20, p80, reps, times) in milliseconds
    (``times``: every timed call, raw)."""
    for i in range(warmup):
        fn(i)
    times = []
    start = time.perf_counter()
    torch = _torch_cuda() if cuda else None
    for i in range(reps):
        if torch is not None:
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            fn(i)
            end.record()
            end.synchronize()
            times.append(begin.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn(i)
            times.append((time.perf_counter() - t0) * 1e3)
        if time.perf_counter() - start > budget_s and len(times) >= 3:
            break
    t = np.asarray(times)
    out = dict(ms=float(np.median(t)), p20=float(np.percentile(t, 20)),
               p80=float(np.percentile(t, 80)), reps=len(times), times=[float(v) for v in t])
    if torch is not None:
        # The same calls back to back, one event pair around them all: the host queues each call
        # while the GPU runs the one before (as in a training step), so host time before the
        # first launch, which the per-call timing above includes with the GPU idle, drops out.
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        for i in range(len(times)):
            fn(i)
        end.record()
        end.synchronize()
        out["back_to_back_ms"] = begin.elapsed_time(end) / len(times)
    return out


def copy_bandwidth(device, nbytes):
    """Device-to-device (or host memory) copy bandwidth in GB/s: reads + writes nbytes each."""
    import torch

    n = nbytes // 4
    src = torch.rand(n, device=device)
    dst = torch.empty_like(src)
    cuda = torch.device(device).type == "cuda"

    def copy(_):
        dst.copy_(src)
        if cuda:
            return None

    t = measure(copy, cuda=cuda, warmup=3, reps=20, budget_s=10.0)
    return 2 * n * 4 / (t["ms"] * 1e-3) / 1e9, t


def copy_bandwidth_jax(nbytes):
    import jax
    import jax.numpy as jnp

    x = jnp.ones((nbytes // 4,), jnp.float32)
    f = jax.jit(lambda a: a * 1.0)
    t = measure(lambda _: f(x).block_until_ready(), warmup=3, reps=20, budget_s=10.0)
    return 2 * nbytes / (t["ms"] * 1e-3) / 1e9, t
