"""The oracle's own gradients against central finite differences (float64)."""

import numpy as np
import pytest

import oracle

FEATURES = [
    dict(),
    dict(T=0.7),
    dict(T=1.3, T_ce=1.0),
    dict(softcap=2.5),
    dict(shift=True),
    dict(teacher=True, T=0.8),
    dict(teacher=True, T=1.2, T_kl=0.9, softcap=3.0, shift=True, T_ce=0.6),
]


def _inputs(rng, feat, n=3, k=7):
    z = rng.normal(size=(n, k)) * 2
    y = rng.integers(0, k, n)
    active = np.array([True, False, True])
    kw = {key: feat[key] for key in ("T", "T_ce", "T_kl", "softcap") if key in feat}
    if feat.get("shift"):
        kw.update(x=rng.integers(0, k, n), d=rng.normal(size=n))
    if feat.get("teacher"):
        kw.update(u=rng.normal(size=(n, k)) * 2)
    return z, y, active, kw


@pytest.mark.parametrize("feat", FEATURES, ids=str)
def test_oracle_vjp_matches_finite_differences(rng, feat):
    z, y, active, kw = _inputs(rng, feat)
    g = [rng.normal(size=3) for _ in range(4)]
    if "u" not in kw:
        g[3] = np.zeros(3)

    def f(z_, u_=None):
        extra = dict(kw, u=u_) if u_ is not None else kw
        outs = oracle.token_stats(z_, y, active, **extra)
        return sum(np.sum(gi * o) for gi, o in zip(g, outs))

    dz, du = oracle.token_stats_vjp(z, y, active, g, **kw)
    h = 1e-6
    num = np.zeros_like(z)
    for idx in np.ndindex(z.shape):
        e = np.zeros_like(z)
        e[idx] = h
        num[idx] = (f(z + e, kw.get("u")) - f(z - e, kw.get("u"))) / (2 * h)
    np.testing.assert_allclose(dz, num, atol=1e-7, rtol=1e-6)
    if "u" in kw:
        u = kw["u"]
        num_u = np.zeros_like(u)
        for idx in np.ndindex(u.shape):
            e = np.zeros_like(u)
            e[idx] = h
            num_u[idx] = (f(z, u + e) - f(z, u - e)) / (2 * h)
        np.testing.assert_allclose(du, num_u, atol=1e-7, rtol=1e-6)


def test_saved_lse_slack():
    """The d-logits allowance for float32 saved log-normalisers: 2 ulps of |lse| times
    |g|·p/T per term, so it is large only where p is close to 1 in a row with a large lse,
    and nothing on inactive rows."""
    k, T = 301, 0.7
    z = np.zeros((3, k))
    z[:, 5] = 12.0  # peaked rows: p ≈ 1 at column 5, lse ≈ 12/T ≈ 17
    y = np.array([5, 7, 9])
    active = np.array([True, True, False])
    g_lse = np.array([1.5, -2.0, 3.0])
    zero = np.zeros(3)
    slack = oracle.saved_lse_slack(z, y, active, (g_lse, zero, zero, zero), T=T)
    P = oracle.stats_parts(z, y, active, T=T)
    ulp = np.spacing(np.float32(P["lse_all"][0]))
    assert 16 < P["lse_all"][0] < 18 and P["p"][0, 5] > 0.99
    np.testing.assert_allclose(slack[:2, 5], 2 * ulp * np.abs(g_lse[:2]) * P["p"][:2, 5] / T,
                               rtol=1e-12)
    assert slack[0, 5] > 2e-6  # more than the float32 absolute floor of the tolerance table
    assert np.all(slack[:2, :5] < 1e-12) and np.all(slack[2] == 0)
    # each cotangent contributes, the entropy's with its |log p + H + 1| + 1
    g_h = np.array([1.0, 0.0, 0.0])
    slack_h = oracle.saved_lse_slack(z, y, active, (zero, zero, g_h, zero), T=T)
    la, H = P["logp_all"][0, 5], P["entropy"][0]
    np.testing.assert_allclose(slack_h[0, 5], 2 * ulp * P["p"][0, 5] * (abs(la + H + 1) + 1) / T,
                               rtol=1e-12)
