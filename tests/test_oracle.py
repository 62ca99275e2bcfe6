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
    dict(label_smoothing=0.2, z_loss_weight=0.05),
    dict(label_smoothing=0.7, z_loss_weight=0.1, T=1.3, T_ce=0.6, softcap=2.5, shift=True),
]


def _inputs(rng, feat, n=3, k=7):
    z = rng.normal(size=(n, k)) * 2
    y = rng.integers(0, k, n)
    active = np.array([True, False, True])
    kw = {key: feat[key] for key in ("T", "T_ce", "T_kl", "softcap", "label_smoothing",
                                     "z_loss_weight") if key in feat}
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


def _grad_from_saved(logp, entropy, g_lse, g_h, T):
    """d logits of g_lse·lse + g_h·H as a backward forms them from its recomputed log p and
    the saved H (float64): p = exp(log p), dH/dz = -p·(log p + H)/T. An error in either
    reaches every term through p and log p."""
    p = np.exp(logp)
    return (g_lse[:, None] * p - g_h[:, None] * p * (logp + entropy[:, None])) / T


def _ulp32(v):
    return np.spacing(np.abs(v).astype(np.float32)).astype(np.float64)


@pytest.mark.parametrize("T", [0.7, 1e-6])
def test_saved_lse_slack_bounds_a_perturbed_backward(rng, T):
    """saved_lse_slack against what it models: d logits formed from log p and H moved by
    the errors it allows (log p_k by 2 float32 ulps of max(1, |log Σ|, |s_k - max s|), H by
    its weighted sum of those plus 2 ulps of max(1, |H|), every sign) differ from the exact
    ones by no more than the slack anywhere, and by nearly all of it (it is no looser than
    the first-order effect) where p is close to 1. At T = 1e-6 the logits scaled by 1/T are
    near 1e7, and so is lse; the slack stays of the size of log Σ: where p is 1 it is within
    the float32 tolerance of the value itself (2e-5 of it), which a slack of 2 ulps of |lse|
    (2 at 1e7, 2e6 in units of 1/T) would not be."""
    k, n = 301, 4
    z = rng.normal(size=(n, k)) * 2
    z[0, 5] = 12.0  # a peaked row: p close to 1 at column 5
    z[0, 6] = 12.0 - 4.6 * T  # ... but not 1: the column beside holds about 1 %
    z[2, 7] = 12.0  # p = 1 to float64 at column 7 (at T = 1e-6; a peak at T = 0.7)
    y = rng.integers(0, k, n)
    active = np.array([True, True, True, False])
    g_lse, g_h = rng.normal(size=n), rng.normal(size=n)
    g_h[0] = -np.sign(g_lse[0]) * abs(g_h[0])  # opposite signs: the two terms' errors add up
    # where p is 1 (row 2, column 7) d logits is g_lse / T alone (the entropy's share is 0):
    # a g_lse near 0 leaves no value there for the slack, which g_h's share enters, to be
    # small against (seed 2083917811: g_lse 0.06, g_h -3.0)
    g_lse[2] = np.copysign(0.5 + abs(g_lse[2]), g_lse[2])
    zero = np.zeros(n)
    slack = oracle.saved_lse_slack(z, y, active, (g_lse, zero, g_h, zero), T=T)
    P = oracle.stats_parts(z, y, active, T=T)
    logp, entropy, p = P["logp_all"], P["entropy"], P["p"]
    exact = _grad_from_saved(logp, entropy, g_lse, g_h, T)
    s = z / T
    size = np.maximum(1.0, np.maximum(-np.max(logp, axis=1, keepdims=True),
                                      np.abs(s - s.max(axis=1, keepdims=True))))
    e = 2 * _ulp32(size)
    e_h = (np.sum(p * np.abs(logp + entropy[:, None]) * e, axis=1)
           + 2 * _ulp32(np.maximum(1.0, np.abs(entropy))))
    worst = np.zeros_like(exact)
    for s_lp in (-1, 1):
        for s_h in (-1, 1):
            moved = _grad_from_saved(logp + s_lp * e, entropy + s_h * e_h, g_lse, g_h, T)
            worst = np.maximum(worst, np.abs(moved - exact))
    # the slack is the first-order effect; the perturbation's second-order terms are below
    # e²·p·(|g_lse| + |g_h|·(|log p + H| + 3))/T (e_h <= e·max|log p + H| here)
    big = np.maximum(e, e_h[:, None])
    second = big ** 2 * p * (np.abs(g_lse)[:, None] + np.abs(g_h)[:, None]
                             * (np.abs(logp + entropy[:, None]) + 3)) / T
    act = active[:, None] & np.ones(k, bool)
    excess = np.where(act, worst - slack - second, -np.inf)
    assert np.all(excess <= 0), (np.max(excess), np.unravel_index(np.argmax(excess), excess.shape))
    assert np.all(slack[~active] == 0)
    assert 0.98 < p[0, 5] < 0.999 and worst[0, 5] > 0.9 * slack[0, 5], (
        p[0, 5], worst[0, 5], slack[0, 5])
    if T < 1e-3:
        assert P["lse_all"][2] > 1e6 and p[2, 7] == 1.0
        assert slack[2, 7] < 2e-5 * abs(exact[2, 7]), (slack[2, 7], exact[2, 7])


def test_oracle_exact_at_float32s_largest_logits():
    """Ties far from 0 (logits near float32's largest, a saturated softcap): each
    distribution still sums to 1, so the KL, entropy and gradients are those of the
    closed form. A log-softmax formed as s - lse rounds log 3 away at |s| = 1e33 (every
    tied column got probability 1: a KL 3x too large)."""
    u = np.array([[6e36, 6e36, 6e36, -3e38]])  # q uniform over the first three
    z = np.array([[-1.9e37, 2.5e36, -2e37, -3e38]])  # p one-hot on column 1
    T = 1e4
    _, logp, ent, kl = oracle.token_stats(z, np.array([0]), np.array([True]), u=u, T=T)
    gap = (2.5e36 + 1.9e37) / T  # log p_0 = -gap
    np.testing.assert_allclose(logp, [-gap], rtol=1e-15)
    np.testing.assert_array_equal(ent, [0.0])
    expected_kl = (gap + (2.5e36 + 2e37) / T) / 3 - np.log(3.0)
    np.testing.assert_allclose(kl, [expected_kl], rtol=1e-15)
    g = [np.zeros(1), np.zeros(1), np.zeros(1), np.ones(1)]
    dz, du = oracle.token_stats_vjp(z, np.array([0]), np.array([True]), g, u=u, T=T)
    np.testing.assert_allclose(dz, [[-1 / 3 / T, 2 / 3 / T, -1 / 3 / T, 0.0]], rtol=1e-15)
    # d KL / d u_k = q_k·(log q_k - log p_k - KL) / T
    lq_lp = np.array([-np.log(3) + gap, -np.log(3), -np.log(3) + (2.5e36 + 2e37) / T])
    np.testing.assert_allclose(du[0, :3], (lq_lp - expected_kl) / 3 / T, rtol=1e-12)
    assert du[0, 3] == 0.0
    # a softcap saturating at c: tied student logits at 1e30 share the probability
    _, _, ent, _ = oracle.token_stats(np.array([[np.inf, np.inf, 0.0]]), np.array([2]),
                                      np.array([True]), softcap=1e30)
    np.testing.assert_allclose(ent, [np.log(2.0)], rtol=1e-15)
