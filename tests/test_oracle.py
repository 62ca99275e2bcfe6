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


def _grad_from_saved(z, lse, entropy, g_lse, g_h, T):
    """d logits of g_lse·lse + g_h·H as a backward forms them from *saved* lse and H
    (float64): p = exp(z/T - lse), dH/dz = -p·(log p + H)/T. An error in the saved numbers
    reaches every term through p and log p."""
    logp = z / T - lse[:, None]
    p = np.exp(logp)
    return (g_lse[:, None] * p - g_h[:, None] * p * (logp + entropy[:, None])) / T


def test_saved_lse_slack_bounds_a_perturbed_backward(rng):
    """saved_lse_slack against what it models: d logits formed from lse and H each moved by
    ±2 float32 ulps of |lse| differ from the exact ones by no more than the slack anywhere,
    and by nearly all of it (it is no looser than the first-order effect) where p is close to
    1 in a row with a large lse."""
    k, T, n = 301, 0.7, 4
    z = rng.normal(size=(n, k)) * 2
    z[0, 5] = 12.0  # a peaked row: p ≈ 1 at column 5, lse ≈ 12/T ≈ 17
    y = rng.integers(0, k, n)
    active = np.array([True, True, True, False])
    g_lse, g_h = rng.normal(size=n), rng.normal(size=n)
    g_h[0] = -np.sign(g_lse[0]) * abs(g_h[0])  # opposite signs: the two terms' errors add up
    zero = np.zeros(n)
    slack = oracle.saved_lse_slack(z, y, active, (g_lse, zero, g_h, zero), T=T)
    P = oracle.stats_parts(z, y, active, T=T)
    lse, entropy = P["lse_all"], P["entropy"]
    exact = _grad_from_saved(z, lse, entropy, g_lse, g_h, T)
    e = 2 * np.spacing(np.abs(lse).astype(np.float32)).astype(np.float64)
    worst = np.zeros_like(exact)
    for s_lse in (-1, 1):
        for s_h in (-1, 1):
            moved = _grad_from_saved(z, lse + s_lse * e, entropy + s_h * e, g_lse, g_h, T)
            worst = np.maximum(worst, np.abs(moved - exact))
    # the slack is the first-order effect; the perturbation's second-order terms are below
    # e²·p·(|g_lse| + |g_h|·(|log p + H| + 3))/T
    la = np.where(P["p"] > 0, P["logp_all"], 0.0)
    second = (e ** 2)[:, None] * P["p"] * (np.abs(g_lse)[:, None] + np.abs(g_h)[:, None]
                                           * (np.abs(la + entropy[:, None]) + 3)) / T
    act = active[:, None] & np.ones(k, bool)
    excess = np.where(act, worst - slack - second, -np.inf)
    assert np.all(excess <= 0), (np.max(excess), np.unravel_index(np.argmax(excess), excess.shape))
    assert np.all(slack[~active] == 0)
    assert P["p"][0, 5] > 0.99 and slack[0, 5] > 2e-6  # past the float32 absolute floor
    assert worst[0, 5] > 0.9 * slack[0, 5], (worst[0, 5], slack[0, 5])

