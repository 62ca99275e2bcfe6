"""Numerical checking helpers shared by the test suite and the benchmark's parity check.

``TOLERANCES`` is the one (atol, rtol) table per dtype; ``assert_close`` compares every
element and, on failure, says how many differ, the max abs/rel error and the first bad index.
"""

from __future__ import annotations

import contextlib
import os

import numpy as np

# (atol, rtol) per dtype of the *output* compared. All math is float32, so every row shares
# the float32 absolute floor; rtol is the final rounding to the output dtype: its unit
# roundoff u (float32 2^-24, bfloat16 2^-8, float16 2^-11), the most a round-to-nearest can
# move a value, relative to it. A result truncated instead of rounded, or rounded twice
# (two 16-bit terms each rounded, then their sum), errs by up to 2u and fails. The float32
# row's rtol is wider than its u: float32 results carry the float32 sums' own error.
# Row statistics are float32 whatever the input dtype (the oracle sees the same rounded
# inputs), so they use the float32 row; gradients use the row of the input dtype. The
# absolute floor is for terms of unit size; where a value is a difference of larger float32
# terms (the teacher gradient q·((t - s) - E_q[t - s]) cancels terms of size |t - s|),
# callers pass ``scale`` = the size of those terms (``cancellation_scale``), and the floor
# grows by CANCELLATION_ULP per unit of it: each of the five terms of log q_k - log p_k - kl
# (t_k, s_k, the two log-normalisers, the KL) carries up to one float32 rounding of its own
# size, 2^-24 of it. Likewise a backward recomputes log p from saved float32 row statistics
# (the row maximum and log Σ), which every term in p carries as a relative error: d-logits
# checks pass ``slack`` = that error per element (``tests/oracle.py: saved_lse_slack``),
# large only where terms of size |g|·p/T cancel or p is close to (but not) 1.
TOLERANCES = {
    "float32": (2e-6, 2e-5),
    "bfloat16": (2e-6, 2.0 ** -8),
    "float16": (2e-6, 2.0 ** -11),
}
DTYPES = tuple(TOLERANCES)
CANCELLATION_ULP = 5 * 2.0 ** -24


def tolerance(dtype, rounded_twice=False):
    """(atol, rtol) of ``TOLERANCES[dtype]``. ``rounded_twice``: for comparing two results
    that were each rounded to the dtype on their own (two backends' 16-bit gradients), which
    may lie an ulp apart although each is within u of the truth: twice the rtol."""
    atol, rtol = TOLERANCES[dtype]
    return (atol, 2 * rtol) if rounded_twice and dtype != "float32" else (atol, rtol)


def new_seed():
    env = os.environ.get("DLM_TEST_SEED")
    seed = int(env) if env else int(np.random.SeedSequence().entropy % (2**31))
    print(f"DLM_TEST_SEED={seed}")
    return seed


def cancellation_scale(cotangent, *scaled_logits, temperature=1.0):
    """max|cotangent| x max(|t| + |s|) / temperature over finite scaled logits, at least 1:
    the size, in units of the gradient, of the float32 terms that cancel in a KL gradient
    g·q·(log q - log p - kl) / T_kl (``temperature`` = T_kl); the ``scale`` of
    ``assert_close``."""
    size = sum(float(np.max(np.abs(np.where(np.isfinite(a), a, 0.0)), initial=0.0))
               for a in scaled_logits)
    return max(1.0, float(np.max(np.abs(cotangent), initial=0.0)) * size / temperature)


def assert_close(actual, expected, dtype="float32", name="value", scale=None, slack=None):
    """Every element within the dtype's (atol + CANCELLATION_ULP·scale, rtol); NaN only where
    NaN is expected. ``scale``: the size of float32 terms that cancel in the value (None:
    none larger than 1).

    ``slack``: an optional per-element absolute allowance (an array broadcast against the
    values) from an error model that the unit-size floor does not cover, added to the floor
    (``tests/oracle.py: saved_lse_slack``).
    On failure: how many elements differ, max abs/rel error, the first bad index and values.
    """
    atol, rtol = TOLERANCES[dtype]
    if scale is not None:
        atol = atol + CANCELLATION_ULP * scale
    a = np.asarray(actual, dtype=np.float64)
    e = np.asarray(expected, dtype=np.float64)
    assert a.shape == e.shape, f"{name}: shape {a.shape} != expected {e.shape}"
    slack = None if slack is None else np.broadcast_to(slack, a.shape)
    allow = atol if slack is None else atol + slack
    ok = np.isclose(a, e, atol=allow, rtol=rtol, equal_nan=True)
    if not ok.all():
        bad = np.argwhere(~ok)
        idx = tuple(int(i) for i in bad[0])
        with np.errstate(invalid="ignore", divide="ignore"):
            err = np.abs(a - e)
            rel = err / np.maximum(np.abs(e), 1e-30)
        finite = np.isfinite(err)
        extra = "" if slack is None else f" + slack there {slack[idx]:.2g}"
        raise AssertionError(
            f"{name} ({dtype}, atol={atol:.2g}{extra}, rtol={rtol}): {len(bad)} of {a.size} "
            f"elements differ; max abs err {np.max(err[finite], initial=0):.3e}, max rel err "
            f"{np.max(rel[finite], initial=0):.3e}; first bad index {idx}: got {a[idx]!r}, "
            f"expected {e[idx]!r}"
        )


def assert_exact_zero(actual, name="value"):
    a = np.asarray(actual, dtype=np.float64)
    nz = np.argwhere(a != 0)
    assert len(nz) == 0, f"{name}: {len(nz)} non-zero elements; first at {tuple(nz[0])}: {a[tuple(nz[0])]!r}"


@contextlib.contextmanager
def poisoned_outputs():
    """Within this block every output buffer a torch backend allocates (chunked, triton, the
    linear head's) starts as NaN: an element left unwritten then fails a parity check instead
    of passing with whatever the allocator held. (The Pallas kernels' outputs start as NaN in
    interpret mode, and the tests' jax-triton emulator allocates them NaN-filled.)"""
    from dlm_kernels._torch.buffers import Poison

    previous, Poison.enabled = Poison.enabled, True
    try:
        yield
    finally:
        Poison.enabled = previous


@contextlib.contextmanager
def pallas_race_detection():
    """Within this block the Pallas kernels run in TPU interpret mode with race detection
    between grid steps (slow; for a test)."""
    import jax

    from dlm_kernels._jax.pallas import RaceDetection

    # the kernels read the switch when a program is traced, and the package's programs are
    # cached by shapes and configuration: none traced outside the block runs inside it, and
    # none traced inside it outlives it
    jax.clear_caches()
    previous, RaceDetection.enabled = RaceDetection.enabled, True
    try:
        yield
    finally:
        RaceDetection.enabled = previous
        jax.clear_caches()
