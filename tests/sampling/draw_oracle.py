"""The float64 NumPy oracle of the denoising step's draw (docs/design.md §3): the documented
noise (lowbias32 of (seed, step, row, column)) recomputed on its own, and the tokens and
statistics of the sampling distribution. Shared by the sampler's tests and by those of a
capped linear head (``linear_head/test_softcap.py``)."""

from __future__ import annotations

import numpy as np

M32 = np.uint64(0xFFFFFFFF)


def _mix(x):  # lowbias32 on uint64 holding 32-bit values
    x = x & M32
    x ^= x >> np.uint64(16)
    x = (x * np.uint64(0x7FEB352D)) & M32
    x ^= x >> np.uint64(15)
    x = (x * np.uint64(0x846CA68B)) & M32
    return x ^ (x >> np.uint64(16))


def oracle_keys(seed, step, n):
    """[N] row keys (docs/design.md §3): one seed keys the flattened row index; [B] seeds
    key (seed_b, position p inside the sequence) for row b·P + p."""
    u64 = lambda v: np.asarray(v, np.int64).astype(np.uint64) & M32
    salt = _mix(u64(step) ^ np.uint64(0x9E3779B9))
    if np.ndim(seed) == 0:
        return _mix(u64(np.arange(n)) ^ np.uint64(0x85EBCA6B) ^ _mix(u64(seed) ^ salt))
    base = _mix(u64(seed) ^ salt)  # [B]
    pos = u64(np.arange(n // len(seed)))
    return _mix(pos[None, :] ^ np.uint64(0x85EBCA6B) ^ base[:, None]).reshape(-1)


def oracle_noise(seed, step, n, cols):
    """[N, C] (or [N, k] for per-row cols) Gumbel noise, float64 from the uniform (whose 2^23
    values are exact in float32, so the backends see the same u)."""
    u64 = lambda v: np.asarray(v, np.int64).astype(np.uint64) & M32
    keys = oracle_keys(seed, step, n)
    cols = np.asarray(cols)
    ck = _mix(u64(cols))
    h = _mix(keys[:, None] ^ (ck[None, :] if cols.ndim == 1 else ck))
    u = ((h >> np.uint64(9)).astype(np.float64) + 0.5) * 2.0 ** -23  # exact in float32
    return -np.log(-np.log(u))


def oracle(z, *, temperature, seed=0, step=0, top_k=None, suppress=None, zu=None, cfg_scale=0.0):
    """(token, logp, argmax, top1, top2, entropy) float64 / int, rows flattened."""
    z = np.asarray(z, np.float64)
    if zu is not None:
        z = zu + (cfg_scale + 1.0) * (z - zu)
    n, k = z.shape
    if suppress is not None:
        z = z.copy()
        z[:, np.asarray(suppress)] = -np.inf
    s = z if temperature == 0 else z / temperature
    order = np.argsort(-s, axis=1, kind="stable")  # descending, ties: lowest id first
    if top_k is not None:
        keep = np.zeros_like(s, bool)
        np.put_along_axis(keep, order[:, :top_k], True, axis=1)
        s = np.where(keep, s, -np.inf)
    with np.errstate(divide="ignore", invalid="ignore"):
        m = s.max(1)
        lse = m + np.log(np.exp(s - m[:, None]).sum(1))
        logq = s - lse[:, None]
        q = np.exp(logq)
        entropy = -np.where(q > 0, q * logq, 0.0).sum(1)
    argmax = order[:, 0]
    top1 = logq[np.arange(n), argmax]
    top2 = logq[np.arange(n), order[:, 1]] if k > 1 else np.full(n, -np.inf)
    if temperature == 0:
        token = argmax
    else:
        key = s + oracle_noise(seed, step, n, np.arange(k))
        token = np.argmax(key, axis=1)  # first maximum
    return token, logq[np.arange(n), token], argmax, top1, top2, entropy
