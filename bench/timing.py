"""Timing and bandwidth: warm-up, per-call timing with CUDA events (GPU) or perf_counter
(CPU; JAX calls block until ready), medians with the 20th-80th percentile spread; on a GPU
also the mean of the same calls run back to back.

``measure_interleaved`` times several functions rep by rep (A B A B ..., never all of A
then all of B), so that a slower stretch of a shared machine falls on every one of them
alike instead of on whichever happened to run then."""

from __future__ import annotations

import time

import numpy as np


def _torch_cuda():
    try:
        import torch

        return torch if torch.cuda.is_available() else None
    except ImportError:
        return None


def _time_call(fn, i, torch) -> float:
    """Milliseconds of fn(i): CUDA events around it (``torch``), else the host clock."""
    if torch is not None:
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        fn(i)
        end.record()
        end.synchronize()
        return begin.elapsed_time(end)
    t0 = time.perf_counter()
    fn(i)
    return (time.perf_counter() - t0) * 1e3


def _stats(times: list[float]) -> dict:
    t = np.asarray(times)
    return dict(ms=float(np.median(t)), p20=float(np.percentile(t, 20)),
                p80=float(np.percentile(t, 80)), reps=len(times), times=[float(v) for v in t])


def _back_to_back(fn, calls: int, torch) -> float:
    """The mean of ``calls`` calls run back to back, one event pair around them all: the host
    queues each call while the GPU runs the one before (as in a training step), so host time
    before the first launch, which the per-call timing includes with the GPU idle, drops out."""
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for i in range(calls):
        fn(i)
    end.record()
    end.synchronize()
    return begin.elapsed_time(end) / calls


def measure(fn, *, cuda=False, warmup=2, reps=10, budget_s=20.0):
    """Time fn(i) for i = 0, 1, ...; returns dict(ms, p20, p80, reps, times) in milliseconds
    (``times``: every timed call, raw)."""
    for i in range(warmup):
        fn(i)
    times = []
    start = time.perf_counter()
    torch = _torch_cuda() if cuda else None
    for i in range(reps):
        times.append(_time_call(fn, i, torch))
        if time.perf_counter() - start > budget_s and len(times) >= 3:
            break
    out = _stats(times)
    if torch is not None:
        out["back_to_back_ms"] = _back_to_back(fn, len(times), torch)
    return out


def measure_interleaved(fns, *, cuda=False, warmup=2, reps=10, budget_s=20.0):
    """Time every fn(i) of ``fns`` ({name: fn}) rep by rep: the warm-up calls of each, then
    for i = 0, 1, ...: fns[a](i), fns[b](i), ... in the order given. Returns {name: the dict
    ``measure`` returns, or dict(error=...) for a function that raised}; a function that
    raises leaves the loop, the others go on. Stops past ``budget_s`` per function (all
    together) once each has 3 timed calls."""
    torch = _torch_cuda() if cuda else None
    errors, live = {}, {}
    for name, fn in fns.items():
        try:
            for i in range(warmup):
                fn(i)
            live[name] = fn
        except Exception as err:  # noqa: BLE001 - e.g. the reference out of memory
            errors[name] = error_line(err)
    times = {name: [] for name in live}
    start = time.perf_counter()
    for i in range(reps):
        for name, fn in list(live.items()):
            try:
                times[name].append(_time_call(fn, i, torch))
            except Exception as err:  # noqa: BLE001
                errors[name] = error_line(err)
                del live[name]
        if (time.perf_counter() - start > budget_s * max(len(live), 1)
                and all(len(times[name]) >= 3 for name in live)):
            break
    out = {}
    for name in fns:
        if name in errors:
            out[name] = dict(error=errors[name])
            continue
        out[name] = _stats(times[name])
        if torch is not None:
            out[name]["back_to_back_ms"] = _back_to_back(fns[name], len(times[name]), torch)
    return out


def error_line(err: Exception) -> str:
    """One line naming an exception: its type and the first line of its message."""
    text = str(err).splitlines()[0][:200] if str(err) else ""
    return f"{type(err).__name__}: {text}"


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
