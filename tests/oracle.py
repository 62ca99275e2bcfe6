"""An independent float64 NumPy oracle for every output and gradient of the package.

Written from the formulas of docs/design.md §2-§3 with plain NumPy (materialised,
float64), sharing no code with the package. Its gradients are checked against central finite differences in
``test_oracle.py``, so the package's VJPs are compared with something proven independently.
"""

from __future__ import annotations

import numpy as np

EPS = 1e-12


def _logsumexp(s):  # [N, K] -> [N]
    m = np.max(s, axis=-1)
    ms = np.where(np.isfinite(m), m, 0.0)
    with np.errstate(divide="ignore"):
        return ms + np.log(np.sum(np.exp(s - ms[:, None]), axis=-1))


def _log_softmax(s):  # [N, K] -> [N, K]
    """(s - max s) - log Σ e^{s - max s}: centred first, so a log-probability near 0 keeps
    its digits however large s is (s - lse rounds log 3 away at |s| = 1e33)."""
    m = np.max(s, axis=-1, keepdims=True)
    c = s - np.where(np.isfinite(m), m, 0.0)
    with np.errstate(divide="ignore"):
        return c - np.log(np.sum(np.exp(c), axis=-1, keepdims=True))


def _kl_rows(s, t):
    """KL(softmax(t) || softmax(s)) per row of s, t [N, K], in their dtype."""
    logq = _log_softmax(t)
    logp = _log_softmax(s)
    q = np.exp(logq)
    terms = np.where(q > 0, q * (np.where(q > 0, logq, 0) - np.where(q > 0, logp, 0)), 0)
    return np.sum(terms, axis=-1).astype(np.float64)


def _kl(r, u, T, T_kl):
    """KL(softmax(u / T_kl) || softmax(r / T)) per row. Its terms are of the size of log K and
    cancel to the KL, which at a large temperature is O(1/T²): float64 keeps about
    1e-16·log K / KL of it (a relative 1e-5 at KL = 1e-10), so rows whose KL is below 1e-6
    are summed again in NumPy's extended precision (np.longdouble, 80 bits on x86-64)."""
    kl = _kl_rows(r / T, u / T_kl)
    small = ~(kl >= 1e-6)  # (and NaN)
    if small.any():
        ld = np.longdouble
        kl[small] = _kl_rows(r[small] / ld(T), u[small] / ld(T_kl))
    return kl


def _shifted(z, x, d, softcap):
    r = softcap * np.tanh(z / softcap) if softcap else z.copy()
    if x is not None:
        k = z.shape[-1]
        r = r + np.where(np.arange(k)[None, :] == x[:, None], d[:, None], 0.0)
    return r


def stats_parts(z, y, active, x=None, d=None, u=None, *, T=1.0, T_ce=None, T_kl=None,
                softcap=None, label_smoothing=0.0, z_loss_weight=0.0):
    """All intermediate quantities of one call (rows flattened: z [N, K]). With label
    smoothing ε and z-loss λ, logp is minus the CE training term at T_ce:
    (1 - ε)·log p'_y + ε·mean_k log p'_k - λ·lse_ce² (lse_ce = logsumexp(r / T_ce))."""
    T_ce = T if T_ce is None else T_ce
    T_kl = T if T_kl is None else T_kl
    z = np.where(active[:, None], np.asarray(z, np.float64), 0.0)
    n, k = z.shape
    r = _shifted(z, x, d, softcap)
    with np.errstate(invalid="ignore", divide="ignore"):
        s = r / T
        lse = _logsumexp(s)
        logp_all = _log_softmax(s)
        p = np.exp(logp_all)
        ent = -np.sum(np.where(p > 0, p * np.where(p > 0, logp_all, 0.0), 0.0), axis=-1)
        s_ce = r / T_ce
        lse_ce = _logsumexp(s_ce)
        logp_ce = _log_softmax(s_ce)
        p_ce = np.exp(logp_ce)
        y_ok = (y >= 0) & (y < k)
        logp = np.where(y_ok, logp_ce[np.arange(n), np.where(y_ok, y, 0)], np.nan)
        if label_smoothing:
            mean_logp = np.mean(s_ce, axis=-1) - lse_ce
            logp = (1.0 - label_smoothing) * logp + label_smoothing * mean_logp
        logp = logp - z_loss_weight * lse_ce ** 2
        kl = np.zeros(n)
        q = logq = lse_u = None
        if u is not None:
            u = np.where(active[:, None], np.asarray(u, np.float64), 0.0)
            t = u / T_kl
            lse_u = _logsumexp(t)
            logq = _log_softmax(t)
            q = np.exp(logq)
            kl = _kl(r, u, T, T_kl)
    act = active.astype(bool)
    out = {name: np.where(act, v, 0.0) for name, v in
           (("lse", lse), ("logp", logp), ("entropy", ent), ("kl", kl))}
    out.update(p=p, p_ce=p_ce, logp_all=logp_all, q=q, logq=logq, z=z, T=T, T_ce=T_ce,
               T_kl=T_kl, lse_all=lse, lse_ce=lse_ce, lse_u=lse_u, eps=label_smoothing,
               lam=z_loss_weight)
    return out


def token_stats(z, y, active, **kw):
    """(lse, logp, entropy, kl) float64 [N]; inactive rows 0."""
    parts = stats_parts(z, y, active, **kw)
    return parts["lse"], parts["logp"], parts["entropy"], parts["kl"]


def token_stats_vjp(z, y, active, grads, *, softcap=None, with_shift=False, **kw):
    """(dz, du) float64 [N, K] for cotangents grads = (g_lse, g_logp, g_entropy, g_kl);
    with ``with_shift`` also d shift [N] (dr at each row's shifted column x)."""
    g_lse, g_lp, g_h, g_kl = (np.asarray(g, np.float64) for g in grads)
    P = stats_parts(z, y, active, softcap=softcap, **kw)
    n, k = P["z"].shape
    p, la = P["p"], P["logp_all"]
    with np.errstate(invalid="ignore"):
        ds = g_lse[:, None] * p - g_h[:, None] * np.where(p > 0, p * (np.where(p > 0, la, 0) + P["entropy"][:, None]), 0.0)
        du = None
        if P["q"] is not None:
            q, lq = P["q"], P["logq"]
            ds = ds + g_kl[:, None] * (p - q)
            du = g_kl[:, None] * np.where(q > 0, q * (np.where(q > 0, lq, 0) - la - P["kl"][:, None]), 0.0) / P["T_kl"]
        onehot = (np.arange(k)[None, :] == y[:, None]).astype(np.float64)
        # d logp / d s' = (1 - ε)·onehot + ε/K - (1 + 2λ·lse_ce)·p'
        target = (1.0 - P["eps"]) * onehot + P["eps"] / k
        p_coef = 1.0 + 2.0 * P["lam"] * P["lse_ce"][:, None]
        dr = ds / P["T"] + g_lp[:, None] * (target - p_coef * P["p_ce"]) / P["T_ce"]
        x = kw.get("x")
        d_shift = None if x is None else dr[np.arange(n), x]  # the shift adds to r: no cap'
        if softcap:
            with np.errstate(over="ignore"):  # 1 - tanh² would lose it where tanh saturates
                dr = dr * np.cosh(P["z"] / softcap) ** -2.0
    act = active.astype(bool)[:, None]
    dz = np.where(act, dr, 0.0)
    du = None if du is None else np.where(act, du, 0.0)
    if with_shift:
        return dz, du, np.where(act[:, 0], d_shift, 0.0)
    return dz, du


def saved_lse_slack(z, y, active, grads, *, ulps=2.0, softcap=None, **kw):
    """[N, K] float64: how far a float32 implementation's d logits may lie from
    ``token_stats_vjp``. Its backward recomputes log p_k = (r_k - m)/T - log Σ from saved
    float32 row statistics (docs/design.md §2: the row's largest logit m and the log of the
    sum relative to it; alike for p' at T_ce and for q), so log p_k carries

    - ``ulps`` float32 ulps of max(1, |log Σ|, |s_k - max s|): the saved log-sum, the scaled
      difference and the exponential, each rounded at its own size (never at the size of
      lse, which may be |z|/T ~ 1e9); and
    - the rounding of the logits the implementation computes itself (under a softcap every
      r_j, with a LOO shift r_x = z_x + d): an error δ_j of ``ulps`` ulps of |s_j| moves
      log p_k by δ_k - Σ_j p_j·δ_j, at most (1 - p_k)·|δ_k| + Σ_{j≠k} p_j·|δ_j| (nothing
      where p = 1).

    With e_k that error, each gradient term g·p_k moves by |g|·p_k·e_k, and the entropy's
    p_k·(log p_k + H) by p_k·(|log p_k + H + 1|·e_k + e_H), where the saved H is off by
    e_H = Σ_j p_j·|log p_j + H|·e_j plus ``ulps`` ulps of max(1, |H|). The tolerance's
    absolute floor is for unit-size terms: this is larger where terms of size |g|·p/T cancel
    (small T) or the logits are large, and it vanishes where p is small or 1."""
    g_lse, g_lp, g_h, g_kl = (np.abs(np.asarray(g, np.float64))[:, None] for g in grads)
    P = stats_parts(z, y, active, softcap=softcap, **kw)
    n, k = P["z"].shape
    x, d = kw.get("x"), kw.get("d")
    rounded = np.full((n, k), bool(softcap))  # logits the implementation rounds itself
    if x is not None:
        rounded = rounded | (np.arange(k)[None, :] == x[:, None])
    r = _shifted(P["z"], x, d, softcap)

    def ulp32(v):
        return np.spacing(np.abs(v).astype(np.float32)).astype(np.float64)

    def log_p_error(s, p, logp, inputs_rounded):  # [N, K]: e_k above, 0 where p = 0
        pos = p > 0
        top = np.max(np.where(pos, s, -np.inf), axis=1, keepdims=True)
        log_sum = -np.max(np.where(pos, logp, -np.inf), axis=1, keepdims=True)
        size = np.maximum(1.0, np.maximum(np.abs(log_sum), np.abs(np.where(pos, s - top, 0))))
        e = ulps * ulp32(size)
        if inputs_rounded is not None:
            delta = np.where(pos & inputs_rounded, ulps * ulp32(np.where(pos, s, 0.0)), 0.0)
            mean = np.sum(p * delta, axis=1, keepdims=True)
            e = e + delta + mean - 2 * p * delta
        return np.where(pos, e, 0.0)

    with np.errstate(invalid="ignore", divide="ignore"):
        p, logp, ent = P["p"], P["logp_all"], P["entropy"][:, None]
        e = log_p_error(r / P["T"], p, logp, rounded)
        pos = p > 0
        lp = np.where(pos, logp, 0.0)
        e_h = (np.sum(np.where(pos, p * np.abs(lp + ent) * e, 0.0), axis=1, keepdims=True)
               + ulps * ulp32(np.maximum(1.0, np.abs(ent))))
        entropy_term = np.where(pos, p * (np.abs(lp + ent + 1.0) * e + e_h), 0.0)
        slack = ((g_lse + g_kl) * p * e + g_h * entropy_term) / P["T"]
        p_ce = P["p_ce"]
        e_ce = log_p_error(r / P["T_ce"], p_ce, np.log(p_ce), rounded)
        # z-loss scales the p' term by (1 + 2λ·lse_ce)
        slack = slack + g_lp * np.abs(1.0 + 2.0 * P["lam"] * P["lse_ce"][:, None]) * p_ce * e_ce / P["T_ce"]
        if P["q"] is not None:
            e_u = log_p_error(P["logq"] + P["lse_u"][:, None], P["q"], P["logq"], None)
            slack = slack + g_kl * P["q"] * e_u / P["T"]
    return np.where(np.asarray(active, bool)[:, None], slack, 0.0)


# -- objectives -------------------------------------------------------------------------

REWEIGHTED = {"reweighted-ce", "reweighted-loo-ce", "loo-reweighted-ce"}
LOO = {"loo-ce", "reweighted-loo-ce", "loo-reweighted-ce"}


def sft_parts(logits, x0, xt, t, mask, variant, vocab_size, clip=None, **ce):
    """(w [B], per-token logp [B, L], shift args) of the SFT objective (``ce``: the CE
    term's label_smoothing and z_loss_weight)."""
    b, l, k = logits.shape
    t = np.asarray(t, np.float64)
    alpha = 1.0 - t
    w = 1.0 / np.maximum(alpha, EPS) if variant in REWEIGHTED else np.ones(b)
    if clip is not None:
        w = np.minimum(w, clip)
    kw = {}
    if variant in LOO:
        delta = np.log1p(vocab_size * alpha / np.maximum(1.0 - alpha, EPS))
        kw = dict(x=xt.reshape(-1), d=np.repeat(delta, l))
    active = mask.reshape(-1) != 0
    _, logp, _, _ = token_stats(logits.reshape(b * l, k), x0.reshape(-1), active, **kw, **ce)
    return w, logp.reshape(b, l), kw


def sft_loss(logits, x0, xt, t, mask, variant, vocab_size, clip=None, **ce):
    w, logp, _ = sft_parts(logits, x0, xt, t, mask, variant, vocab_size, clip, **ce)
    m = mask.astype(np.float64)
    return w * np.sum(m * -logp, axis=1) / np.maximum(m.sum(axis=1), 1.0)


def sft_loss_grad(logits, x0, xt, t, mask, variant, vocab_size, cot, clip=None, **ce):
    """d(Σ_b cot_b·loss_b)/d logits."""
    b, l, k = logits.shape
    w, _, kw = sft_parts(logits, x0, xt, t, mask, variant, vocab_size, clip, **ce)
    m = mask.astype(np.float64)
    g_lp = -(cot * w / np.maximum(m.sum(axis=1), 1.0))[:, None] * m
    zeros = np.zeros(b * l)
    dz, _ = token_stats_vjp(logits.reshape(b * l, k), x0.reshape(-1), mask.reshape(-1) != 0,
                            (zeros, g_lp.reshape(-1), zeros, zeros), **kw, **ce)
    return dz.reshape(b, l, k)


def soft_embedding_vjp(E, g, *, z=None, head=None, T=1.0, softcap=None, ulps=8.0,
                       scaled_first=False):
    """out = softmax(cap(z) / T) @ E per row and the VJP with cotangent g [N, D] of every input,
    with z [N, V] given or formed as h @ W.T + b from ``head`` = (h [N, Dh], W [V, Dh], b or
    None). Returns a dict: out, dE, dz, and with a head dh, dW, db; and ``slack_<name>`` for
    each: how far a float32 implementation may lie from it (below).

    dE[k] = Σ_n p_nk g_n;  ds_nk = p_nk (g_n·E_k - g_n·out_n);  dz = ds / T · (1 - tanh²(z/c)).

    Error model of a float32 implementation that streams the online softmax and recomputes p
    from saved row statistics: log p_k carries ``ulps`` float32 ulps of max(1, |s_k - max s|)
    (the difference, the exponential, the saved log-sum) plus the rounding a_k of s_k where the
    implementation forms the logits itself (capped: |r_k| / T; a head: the matmul's
    Σ|h||W|·cap'(z) / T), moved to log p_k as a_k + Σ_j p_j a_j. Each output then carries
    its terms' relative error e summed in magnitude, plus ``ulps`` ulps of the sum of its
    terms' magnitudes (float32 products and sums that cancel). ``scaled_first``: the
    implementation forms s = r / T before subtracting the maximum (a plain softmax of r / T),
    so each s_k is also rounded at its own size |s_k| (a_k grows by |s_k|)."""
    u = ulps * 2.0 ** -24
    E = np.asarray(E, np.float64)
    g = np.asarray(g, np.float64)
    if head is not None:
        h, W, b = (None if a is None else np.asarray(a, np.float64) for a in head)
        z = h @ W.T + (0.0 if b is None else b)
    z = np.asarray(z, np.float64)
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        if softcap:
            th = np.tanh(z / softcap)
            r, slope = softcap * th, 1.0 - th * th
        else:
            r, slope = z, np.ones_like(z)
        s = r / T
        m = np.max(s, axis=-1, keepdims=True)
        c = s - np.where(np.isfinite(m), m, 0.0)
        ex = np.exp(c)
        p = ex / np.sum(ex, axis=-1, keepdims=True)
        out = p @ E
        ge = g @ E.T
        go = np.sum(g * out, axis=-1, keepdims=True)
        ds = p * (ge - go)
        dz = np.where(p > 0, ds / T * slope, 0.0)
        res = {"out": out, "dE": p.T @ g, "dz": dz}
        # the error model
        a = np.zeros_like(z)
        if softcap:
            a = a + np.abs(r) / T
        if head is not None:
            a = a + (np.abs(h) @ np.abs(W).T) * slope / T
        if scaled_first:
            a = a + np.abs(s)
        a = np.where(p > 0, a, 0.0)
        e = u * (np.maximum(1.0, np.where(p > 0, np.abs(c), 0.0)) + a
                 + np.sum(p * a, axis=-1, keepdims=True))
        pe = p * e
        aE, ag = np.abs(E), np.abs(g)
        res["slack_out"] = pe @ aE + u * (p @ aE)
        res["slack_dE"] = pe.T @ ag + u * (p.T @ ag)
        mag = ag @ aE.T + np.sum(ag * np.abs(out), axis=-1, keepdims=True)
        sdz = np.where(p > 0, (pe * mag + u * p * mag) / T * slope, 0.0)
        res["slack_dz"] = sdz
    if head is not None:
        adz = np.abs(dz)
        res["dh"], res["dW"] = dz @ W, dz.T @ h
        res["slack_dh"] = sdz @ np.abs(W) + u * (adz @ np.abs(W))
        res["slack_dW"] = sdz.T @ np.abs(h) + u * (adz.T @ np.abs(h))
        if b is not None:
            res["db"] = dz.sum(axis=0)
            res["slack_db"] = sdz.sum(axis=0) + u * adz.sum(axis=0)
    return res
