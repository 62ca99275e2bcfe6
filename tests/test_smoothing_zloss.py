"""Label smoothing (``label_smoothing`` ε) and z-loss (``z_loss_weight`` λ) of the CE term:
``logp`` = (1 - ε)·log p'_y + ε·mean_k log p'_k - λ·lse_ce², on every backend (kernels in
their interpreters, at tiny shapes), through a linear head and under vocabulary
parallelism, values and every gradient against the float64 oracle (tests/oracle.py)."""

from __future__ import annotations

import numpy as np
import pytest

import oracle
from harness import assert_close, assert_exact_zero, framework

BACKENDS = [("torch", "reference"), ("torch", "chunked"), ("torch", "triton"),
            ("jax", "reference"), ("jax", "chunked"), ("jax", "triton"), ("jax", "pallas")]
# (K, chunk, features): a chunk that does not divide K; softcap, T != 1, a separate CE
# temperature and the LOO shift together; a teacher beside the CE term
CASES = {
    "k37": (37, 16, dict(label_smoothing=0.1, z_loss_weight=0.01)),
    "k130-all": (130, 48, dict(label_smoothing=0.3, z_loss_weight=0.02, temperature=0.8,
                               ce_temperature=1.3, softcap=4.0, shift=True)),
    "k130-teacher": (130, 48, dict(label_smoothing=1.0, z_loss_weight=0.0, temperature=1.2,
                                   teacher=True, shift=True)),
    "k37-zloss": (37, 16, dict(z_loss_weight=0.05, temperature=0.7)),
}
N = 5


@pytest.fixture
def backend_env(request, monkeypatch):
    """Puts the kernel backends on the CPU: Pallas in TPU interpret mode, JAX's triton
    through the jax-triton emulator."""
    fw_name, backend = request.param
    monkeypatch.setenv("DLM_KERNELS_PALLAS_INTERPRET", "1")
    if backend == "triton":
        pytest.importorskip("triton")
        if fw_name == "jax":
            request.getfixturevalue("jax_triton_on_cpu")
    return fw_name, backend


def _draw(rng, k, feat, n=N):
    z = (rng.normal(size=(n, k)) * 3).astype(np.float32)
    y = rng.integers(0, k, n)
    w = np.ones(n, np.float32)
    w[[1, 3]] = 0.0  # inactive rows, poisoned: nothing of them may leak
    z[1], z[3], y[1], y[3] = np.nan, np.inf, -1, k + 5
    case = dict(z=z, y=y, w=w, k=k, x=None, d=None, u=None)
    if feat.get("shift"):
        case.update(x=rng.integers(0, k, n), d=rng.uniform(0, 4, n).astype(np.float32))
    if feat.get("teacher"):
        case["u"] = (rng.normal(size=(n, k)) * 3).astype(np.float32)
    return case


def _api_kw(feat):
    return {key: feat[key] for key in ("label_smoothing", "z_loss_weight", "temperature",
                                       "ce_temperature", "softcap") if key in feat}


def _oracle_kw(case, feat):
    kw = dict(T=feat.get("temperature", 1.0), T_ce=feat.get("ce_temperature"),
              softcap=feat.get("softcap"), label_smoothing=feat.get("label_smoothing", 0.0),
              z_loss_weight=feat.get("z_loss_weight", 0.0))
    if case["x"] is not None:
        kw.update(x=case["x"], d=case["d"].astype(np.float64))
    if case["u"] is not None:
        kw["u"] = case["u"].astype(np.float64)
    return kw


@pytest.mark.parametrize("backend_env", BACKENDS, ids=lambda b: "-".join(b), indirect=True)
@pytest.mark.parametrize("name", list(CASES))
def test_token_stats_against_the_oracle(backend_env, name, rng):
    """The four statistics, d logits (with the saved-statistics slack of the other tests),
    d shift, and exact zeros in inactive rows."""
    fw_name, backend = backend_env
    fw = framework(fw_name)
    k, chunk, feat = CASES[name]
    case = _draw(rng, k, feat)
    shift = case["x"] is not None
    teacher = None if case["u"] is None else fw.array(case["u"])

    def fn(z, *d):
        kw = dict(shift_ids=fw.array(case["x"]), shift=d[0]) if shift else {}
        s = fw.api.token_stats(z, fw.array(case["y"]), fw.array(case["w"]),
                               teacher_logits=teacher, chunk_size=chunk, backend=backend,
                               **kw, **_api_kw(feat))
        return tuple(s)

    cots = [rng.normal(size=N).astype(np.float32) for _ in range(4)]
    if teacher is None:
        cots[3] = np.zeros(N, np.float32)
    primals = [fw.array(case["z"])] + ([fw.array(case["d"])] if shift else [])
    outs, grads = fw.vjp(fn, primals, cots)
    active = case["w"] != 0
    ora = _oracle_kw(case, feat)
    z64 = case["z"].astype(np.float64)
    expected = oracle.token_stats(z64, case["y"], active, **ora)
    for stat, got, exp in zip(("lse", "logp", "entropy", "kl"), outs, expected):
        assert_close(got, exp, "float32", stat)
    dz, _, d_shift = oracle.token_stats_vjp(z64, case["y"], active, cots, with_shift=True, **ora)
    slack = oracle.saved_lse_slack(z64, case["y"], active, cots, **ora)
    assert_close(grads[0], dz, "float32", "d logits", slack=slack)
    assert_exact_zero(grads[0][~active], "d logits of inactive rows")
    if shift:
        assert_close(grads[1], d_shift, "float32", "d shift")
