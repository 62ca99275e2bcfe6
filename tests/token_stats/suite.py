"""Parity of the token-statistics primitive (values and VJPs) against the float64 oracle.

The shared suite and its builders; the classes that run it, one per framework x backend,
are in this folder's test_<backend>.py files. Inputs are fresh random draws; inactive rows carry NaN/inf logits and
sentinel targets (-1, K + 5) that must not leak into anything.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

import oracle
from dlm_kernels.testing import TOLERANCES, cancellation_scale
from harness import DTYPES, assert_close, assert_exact_zero, cases, framework, new_seed

SHAPES = [((1, 1), 1), ((2, 3), 7), ((3, 5), 1271), ((1, 2), 50257), ((7,), 130),
          ((2, 3), 256)]  # the last: whole blocks only (no ragged tail)
LARGE_K = 50257  # a real vocabulary: seconds a case in an interpreter, so one dtype (the
#                  16-bit one models train in); every smaller shape runs in every dtype
SHAPE_DTYPES = tuple((rows, k, dtype) for rows, k in SHAPES for dtype in DTYPES
                     if k != LARGE_K or dtype == "bfloat16")
# An interpreted kernel's sweep (seconds a case): each shape once, the dtypes taken in turn
# (so each dtype meets small, ragged, whole-block and large shapes), plus the ragged shapes
# of K = 7 and 1271 in every dtype; every feature test runs on top.
ROTATED_SHAPE_DTYPES = tuple(
    [(rows, k, ("bfloat16", "float32", "float16")[i % 3]) for i, (rows, k) in enumerate(SHAPES)]
    + [((2, 3), 7, "float16"), ((3, 5), 1271, "bfloat16"), ((3, 5), 1271, "float32")])

FEATURES = {
    "plain": dict(),
    "temperature": dict(temperature=0.7),
    "ce_temperature": dict(temperature=1.6, ce_temperature=1.0),
    "softcap": dict(softcap=4.0),
    "shift": dict(shift=True),
    "teacher": dict(teacher=True, temperature=1.3),
    "teacher_grad": dict(teacher=True, teacher_grad=True, teacher_temperature=0.8),
    "all": dict(temperature=0.9, ce_temperature=1.2, softcap=5.0, shift=True, teacher=True,
                teacher_grad=True, teacher_temperature=1.1),
}


# Masked vocabulary columns (an attention-style mask, a padded vocabulary): the standard
# finfo.min idiom and -inf, at temperatures where finfo.min / T overflows to -inf (0.5) and
# where it stays finite (the rest); T = 1e3 and 1e4 are distillation's large temperatures.
MASKS = {"finfo.min": float(np.finfo(np.float32).min), "-inf": -np.inf}
MASK_TEMPERATURES = (0.5, 1.0, 2.0, 1e3, 1e4)
MASK_K = 1271  # = 31 x 41: unaligned to every block size, divided by a chunk of 41
# where the span is masked: both halves of one call's rows (``masked_pair``), each half a
# ``masked_case`` of its own
WHERE_MASKED = ("student and teacher", "teacher")
MASKED_SPANS = tuple((mask, T) for mask in MASKS for T in MASK_TEMPERATURES)
STUDENT_MASKS = tuple((mask, T) for mask in MASKS for T in MASK_TEMPERATURES)
# An interpreted kernel's cases (seconds each): finfo.min (finite, or -inf at T < 1) at every
# temperature, -inf at one
KERNEL_MASKED_SPANS = tuple((mask, T) for mask, T in MASKED_SPANS
                            if mask == "finfo.min" or T == 2.0)
KERNEL_STUDENT_MASKS = (("finfo.min", 0.5), ("finfo.min", 2.0), ("finfo.min", 1e4), ("-inf", 1.0))


def masked_columns(k=MASK_K):
    """[K] bool: [0, 130) and [384, 1152) of K = 1271. They cover whole vocabulary chunks at
    every block size the suites run: the first ones of 41, 100 and 128 columns (a running
    state that starts masked), middle blocks of 128, whole lanes of a Triton block, and the
    second and third of the four Triton vocabulary splits at blocks of 128 (splits of 384
    columns); the columns left hold the targets."""
    cols = np.arange(k)
    return (cols < 130) | ((cols >= 384) & (cols < 1152))


def masked_case(fw, rng, temperature, mask, student, teacher, *, teacher_grad=True):
    """A (2, 3)-row case of K = MASK_K at T = T_kl = ``temperature`` whose active rows hold
    logits of unit size and ``mask`` in the ``masked_columns`` of the student and/or the
    teacher (inactive rows keep make_case's poison); active targets lie in unmasked columns.
    (Unit size: at T = 0.5 logits of size 3 make rows with q near 1, where the reference
    backend's autodiff teacher gradient carries lse_u's float32 rounding times |t - s|,
    more than the cancellation floor of ``cancellation_scale`` allows.)"""
    feat = dict(teacher=True, teacher_grad=teacher_grad, temperature=temperature)
    case = make_case(fw, rng, (2, 3), MASK_K, "float32", feat)
    cols = masked_columns()
    act = case["active"]
    z, u, y = case["z_np"].copy(), case["ora_kw"]["u"].copy(), case["y_np"].copy()
    z[act], u[act] = z[act] / 3, u[act] / 3
    z, u = (a.astype(np.float32).astype(np.float64) for a in (z, u))  # what the call sees
    for arr, on in ((z, student), (u, teacher)):
        if on:
            arr[np.ix_(act, cols)] = MASKS[mask]
    y[act] = rng.choice(np.flatnonzero(~cols), act.sum())
    shape = case["rows"] + (MASK_K,)
    case.update(z=fw.array(z.reshape(shape), "float32"), z_np=z, y_np=y,
                y=fw.array(y.reshape(case["rows"])), u=fw.array(u.reshape(shape), "float32"))
    case["ora_kw"]["u"] = u
    return case


def masked_pair(fw, rng, temperature, mask):
    """The ``masked_case`` of each place in ``WHERE_MASKED`` (the span masked in the student
    and the teacher, or in the teacher alone) as the two halves of one (4, 3)-row call: rows
    0-5 and 6-11, each half with its own active and poisoned rows (a row's statistics and
    gradients are its own on every backend). ``case["groups"]``: (where, [N] bool) of each
    half, which ``check_masked`` checks on its own."""
    halves = [masked_case(fw, rng, temperature, mask, student=where != "teacher", teacher=True)
              for where in WHERE_MASKED]
    cat = lambda key: np.concatenate([h[key] for h in halves])  # noqa: E731
    z_np, y_np, u_np = cat("z_np"), cat("y_np"), np.concatenate([h["ora_kw"]["u"] for h in halves])
    w = np.concatenate([fw.numpy(h["w"]).reshape(-1) for h in halves]).astype(np.float32)
    rows, k = (4, 3), MASK_K
    n = halves[0]["n"]
    case = dict(halves[0], rows=rows, n=2 * n, z_np=z_np, y_np=y_np, active=cat("active"),
                z=fw.array(z_np.reshape(rows + (k,)), "float32"), y=fw.array(y_np.reshape(rows)),
                w=fw.array(w.reshape(rows)), u=fw.array(u_np.reshape(rows + (k,)), "float32"),
                ora_kw=dict(halves[0]["ora_kw"], u=u_np),
                groups=[(where, np.arange(2 * n) // n == i)
                        for i, where in enumerate(WHERE_MASKED)])
    return case


def capped_logit_slack(case):
    """{statistic: [N] allowance} for the float32 rounding of the capped, shifted logits r
    (c·tanh(z/c) is a float32 number, half an ulp from the oracle's), which 1/T scales into
    each exponent: dx_k = 2^-24·|r_k| / T. To first order the entropy moves by
    Σ p_k·|x_k - x̄|·dx_k, log p'_y by (1 - p'_y)·dx'_y + Σ_{k≠y} p'_k·dx'_k (at T_ce) and the
    KL by Σ |p_k - q_k|·dx_k: a few ulps of the scaled logits that carry probability
    (docs/design.md §9), zero where a row is one-hot on its target. Doubled for the
    rounding of the exponent's own product."""
    kw = case["ora_kw"]
    r = oracle._shifted(case["z_np"], kw.get("x"), kw.get("d"), kw.get("softcap"))  # [N, K]
    ulp = 2.0 * 2.0 ** -24 * np.abs(r)

    def probs(x):
        e = np.exp(x - x.max(axis=1, keepdims=True))
        return e / e.sum(axis=1, keepdims=True)

    T, T_ce = kw["T"], kw["T_ce"] or kw["T"]
    x, x_ce = r / T, r / T_ce
    p, p_ce = probs(x), probs(x_ce)
    x_bar = (p * x).sum(axis=1, keepdims=True)
    y = np.arange(r.shape[0]), case["y_np"].reshape(-1) % r.shape[1]
    not_y = np.ones_like(r, bool)
    not_y[y] = False
    slack = {"entropy": (p * np.abs(x - x_bar) * ulp / T).sum(axis=1),
             "logp": (1.0 - p_ce[y]) * ulp[y] / T_ce
             + (np.where(not_y, p_ce, 0.0) * ulp / T_ce).sum(axis=1)}
    if kw.get("u") is not None:
        T_kl = kw["T_kl"] or T
        q = probs(kw["u"] / T_kl)
        slack["kl"] = (np.abs(p - q) * ulp / T).sum(axis=1)
    return slack


def make_case(fw, rng, rows, k, dtype, feat, *, active_frac=0.75, poison=True, scale=1.0):
    """Framework kwargs, oracle kwargs and float64 copies of what the framework sees.
    ``scale`` multiplies the logits, the shift and the teacher logits (drawn at unit size)."""
    n = math.prod(rows)
    z64 = rng.normal(size=rows + (k,)) * 3.0 * scale
    active = rng.uniform(size=rows) < active_frac
    if n > 1:
        active.reshape(-1)[0] = True
    w = np.where(active, rng.uniform(0.5, 2.0, size=rows), 0.0).astype(np.float32)
    y = rng.integers(0, k, size=rows)
    if poison:  # inactive rows: NaN/inf logits, sentinel targets
        flat_z, flat_y = z64.reshape(n, k), y.reshape(n)
        for i in np.flatnonzero(~active.reshape(n)):
            flat_z[i, :] = np.nan if i % 2 else np.inf
            flat_y[i] = -1 if i % 2 else k + 5
    z = fw.array(z64, dtype)
    api_kw = {key: feat[key] for key in ("temperature", "ce_temperature", "softcap",
                                         "teacher_temperature", "teacher_grad") if key in feat}
    ora_kw = dict(T=feat.get("temperature", 1.0), T_ce=feat.get("ce_temperature"),
                  T_kl=feat.get("teacher_temperature"), softcap=feat.get("softcap"))
    case = dict(z=z, y=fw.array(y), w=fw.array(w), api_kw=api_kw, ora_kw=ora_kw, n=n, k=k,
                rows=rows, z_np=fw.numpy(z).reshape(n, k), y_np=y.reshape(n),
                active=active.reshape(n), u=None)
    if feat.get("shift"):
        x = rng.integers(0, k, size=rows)
        d = (rng.uniform(0.0, 6.0, size=rows) * scale).astype(np.float32)
        api_kw.update(shift_ids=fw.array(x), shift=fw.array(d))
        ora_kw.update(x=x.reshape(n), d=d.reshape(n).astype(np.float64))
    if feat.get("teacher"):
        u64 = rng.normal(size=rows + (k,)) * 3.0 * scale
        if poison:  # inactive rows: NaN/inf teacher logits too
            flat_u = u64.reshape(n, k)
            for i in np.flatnonzero(~active.reshape(n)):
                flat_u[i, :] = np.inf if i % 2 else np.nan
        u = fw.array(u64, dtype)
        case["u"] = u
        ora_kw["u"] = fw.numpy(u).reshape(n, k)
    return case


def shift_tie_case(fw, rng, kind, temperature, k, dtype="float32"):
    """Six rows whose LOO shift lands where fl(z_x + d) rounds and ties with the row max.
    ``huge`` (float32): logits near 1e7 (float32 spacing 1) at columns 0-3 and of size 3
    elsewhere, x one of those four, d in (0.5, 3). ``small T``: logits of size 20 in
    ``dtype``, the largest two (at 24-28) within 3 T of each other, and d putting
    fl(z_x + d) within 3 T of them: from a z_x in (-15, 15) (d of 9 to 43; even rows, float32)
    or from one 0.5 to 6 below the max. In every row z_x + d is not a float32 number (d, and
    a float32 z_x, moved by ulps until so). Targets: the shifted column in rows 0 and 3.
    Returns the inputs (``z`` in ``dtype``) and ``r`` [N, K] float64: the float32 shifted
    logits every backend's forward forms."""
    n = 6
    rows = np.arange(n)
    if kind == "huge":
        x = rng.integers(0, 4, size=n)
        z = rng.normal(size=(n, k)) * 3.0
        z[:, :4] = 1e7 - rng.integers(0, 4, size=(n, 4))
        d = rng.uniform(0.5, 3.0, size=n).astype(np.float32)
    else:
        x, top, second = np.array([rng.choice(k, 3, replace=False) for _ in rows]).T
        z = (rng.normal(size=(n, k)) * 10.0).clip(-20.0, 20.0)
        z[rows, top] = rng.uniform(24.0, 28.0, size=n)
        z[rows, second] = z[rows, top] - temperature * rng.uniform(0.0, 3.0, size=n)
        raised = (rows % 2 == 0) & (dtype == "float32")
        z[rows, x] = np.where(raised, rng.uniform(-15.0, 15.0, size=n),
                              z[rows, top] - rng.uniform(0.5, 6.0, size=n))
    z = fw.numpy(fw.array(z, dtype)).astype(np.float32)  # what the backend reads
    if kind != "huge":
        gap = temperature * rng.uniform(-3.0, 3.0, size=n)
        d = (z[rows, top].astype(np.float64) - z[rows, x] + gap).astype(np.float32)
    for i in range(64):
        exact = z[rows, x].astype(np.float64) + d == z[rows, x] + d
        if not exact.any():
            break
        if i % 2 or dtype != "float32":
            d = np.where(exact, np.nextafter(d, np.float32(np.inf)), d)
        else:
            z[rows, x] = np.where(exact, np.nextafter(z[rows, x], np.float32(-np.inf)),
                                  z[rows, x])
    assert not exact.any(), (z[rows, x], d)
    y = rng.integers(0, k, size=n)
    y[[0, 3]] = x[[0, 3]]
    r = z.copy()
    r[rows, x] = z[rows, x] + d  # a float32 sum, rounded as the forward does
    return dict(n=n, z=fw.array(z, dtype), d=d, x=x, y=y, r=r.astype(np.float64))


class TokenStatsSuite:
    FW = None
    BACKEND = None
    #: (rows, K, dtype) of the shape sweep
    shape_dtype = cases(*SHAPE_DTYPES)
    CHUNK_SIZES = (None,)
    #: the block sizes of the shape sweep (default CHUNK_SIZES); an interpreted kernel suite
    #: runs the sweep at its many-block size only, its features at every size
    SHAPE_CHUNK_SIZES = None

    @property
    def fw(self):
        return framework(self.FW)

    def run_case(self, case, rng, chunk_size=None, entropy=True, seen=None):
        """(outputs, gradients, cotangents) of one call. With ``entropy=False`` the outputs
        are (lse, logp, None, kl) and the entropy's cotangent is 0 (it has no output).
        ``seen``: a list that receives the differentiated arrays the call got."""
        api = self.fw.api
        u = case["u"]
        teacher_grad = case["api_kw"].get("teacher_grad", False)

        def fn(z, *maybe_u):
            if seen is not None:
                seen.extend((z,) + maybe_u)
            teacher = maybe_u[0] if maybe_u else u
            s = api.token_stats(z, case["y"], case["w"], teacher_logits=teacher,
                                chunk_size=chunk_size, entropy=entropy, backend=self.BACKEND,
                                **case["api_kw"])
            if entropy:
                return s
            assert s.entropy is None, f"entropy=False returned entropy {s.entropy!r}"
            return s.lse, s.logp, s.kl

        primals = [case["z"]] + ([u] if teacher_grad else [])
        cots = [rng.normal(size=case["rows"]).astype(np.float32) for _ in range(4)]
        if entropy:
            outs, grads = self.fw.vjp(fn, primals, cots)
        else:
            cots[2] = np.zeros_like(cots[2])
            (lse, logp, kl), grads = self.fw.vjp(fn, primals, [cots[0], cots[1], cots[3]])
            outs = [lse, logp, None, kl]
        return outs, grads, [c.reshape(case["n"]) for c in cots]

    def check(self, case, rng, dtype, chunk_size=None, entropy=True, stats_slack=None):
        outs, grads, cots = self.run_case(case, rng, chunk_size, entropy)
        self.compare(case, outs, grads, cots, dtype, stats_slack)

    def compare(self, case, outs, grads, cots, dtype, stats_slack=None):
        """Every output and gradient of one call vs the float64 oracle; inactive rows' d
        logits (and d teacher) exact zeros. ``stats_slack``: per-statistic [N] allowances of
        an error model the unit floor does not cover (``capped_logit_slack``)."""
        n, k = case["n"], case["k"]
        expected = oracle.token_stats(case["z_np"], case["y_np"], case["active"], **case["ora_kw"])
        for name, got, exp in zip(("lse", "logp", "entropy", "kl"), outs, expected):
            if got is not None:
                slack = None if stats_slack is None else stats_slack.get(name)
                assert_close(got.reshape(n), exp, "float32", name, slack=slack)
        dz, du = oracle.token_stats_vjp(case["z_np"], case["y_np"], case["active"], cots,
                                        **case["ora_kw"])
        slack = oracle.saved_lse_slack(case["z_np"], case["y_np"], case["active"], cots,
                                       **case["ora_kw"])
        assert_close(grads[0].reshape(n, k), dz, dtype, "d logits", slack=slack)
        inactive = ~case["active"]
        assert_exact_zero(grads[0].reshape(n, k)[inactive], "d logits of inactive rows")
        if len(grads) > 1:
            ora = case["ora_kw"]
            t = ora["u"][case["active"]] / (ora["T_kl"] or ora["T"])
            s = case["z_np"][case["active"]] / ora["T"]
            assert_close(grads[1].reshape(n, k), du, dtype, "d teacher_logits",
                         scale=cancellation_scale(cots[3], t, s,
                                                  temperature=ora["T_kl"] or ora["T"]))
            assert_exact_zero(grads[1].reshape(n, k)[inactive], "d teacher of inactive rows")

    def check_masked(self, case, rng, chunk_size):
        """Every statistic and gradient of a ``masked_case`` against the oracle. The KL is
        compared as distillation's T²·KL (T >= 1): at T = 1e4 the KL itself is about 1e-7,
        below the absolute floor. d teacher's cancellation scale counts the teacher's
        unmasked columns (where q can be non-zero)."""
        n, k, T = case["n"], case["k"], case["ora_kw"]["T"]
        outs, grads, cots = self.run_case(case, rng, chunk_size)
        args = (case["z_np"], case["y_np"], case["active"])
        expected = oracle.token_stats(*args, **case["ora_kw"])
        for name, got, exp in zip(("lse", "logp", "entropy", "kl"), outs, expected):
            scale = max(1.0, T * T) if name == "kl" else 1.0
            assert_close(got.reshape(n) * scale, exp * scale, "float32",
                         f"{name} (x T²)" if scale != 1.0 else name)
        dz, du = oracle.token_stats_vjp(*args, cots, **case["ora_kw"])
        assert_close(grads[0].reshape(n, k), dz, "float32", "d logits",
                     slack=oracle.saved_lse_slack(*args, cots, **case["ora_kw"]))
        act = case["active"]
        for where, rows in case.get("groups", [("", np.ones(n, bool))]):
            # each group of rows (``masked_pair``'s halves) at its own cancellation scale
            on = act & rows
            u, z = case["ora_kw"]["u"][on], case["z_np"][on]
            live = u > np.finfo(np.float32).min  # the teacher's unmasked columns
            scale = cancellation_scale(cots[3][rows], np.where(live, u, 0) / T,
                                       np.where(live, z, 0) / T, temperature=T)
            assert_close(grads[1].reshape(n, k)[rows], du[rows], "float32",
                         f"d teacher_logits (masked in the {where})" if where
                         else "d teacher_logits", scale=scale)
        assert_exact_zero(grads[0].reshape(n, k)[~act], "d logits of inactive rows")
        assert_exact_zero(grads[1].reshape(n, k)[~act], "d teacher of inactive rows")

    #: the block sizes of the masked-span tests (default CHUNK_SIZES); their cases, (mask,
    #: where, T) and (mask, T)
    MASK_CHUNK_SIZES = None
    masked_span = cases(*MASKED_SPANS)
    student_mask = cases(*STUDENT_MASKS)

    def test_masked_spans_match_the_oracle(self, rng, masked_span):
        """Spans of the vocabulary masked with finfo.min or -inf (``masked_columns``: whole
        chunks, blocks, lanes and vocabulary splits), in the student and the teacher alike
        (rows 0-5 of the call) and in the teacher alone (rows 6-11, ``masked_pair``): a
        masked column has probability 0 and adds exactly nothing, so every statistic and
        gradient is the oracle's, at T = 0.5 (finfo.min / T is -inf), 1, 2, 1e3 and 1e4. (A
        part of the vocabulary whose maximum is finfo.min once merged as 0 · -inf = NaN:
        entropy, KL and their gradients.)"""
        mask, temperature = masked_span
        case = masked_pair(self.fw, rng, temperature, mask)
        for chunk_size in self.MASK_CHUNK_SIZES or self.CHUNK_SIZES:
            self.check_masked(case, rng, chunk_size)

    def test_student_masked_where_the_teacher_is_not(self, rng, student_mask):
        """Student columns masked where the teacher's probability is not 0: KL(q || p) is
        +inf for -inf (q > 0 where p = 0), and of order q·|finfo.min| / T for finfo.min, which
        float32 holds only for a large T (else +inf). Every backend returns +inf or that
        value (above 1e30), never NaN; lse, logp, entropy and d logits (g·(p - q) / T,
        finite) are the oracle's. (d teacher is not checked: it is not finite where the KL
        is infinite, and is of order |finfo.min| / T otherwise.)"""
        mask, temperature = student_mask
        case = masked_case(self.fw, rng, temperature, mask, student=True, teacher=False,
                           teacher_grad=False)
        n, k, act = case["n"], case["k"], case["active"]
        args = (case["z_np"], case["y_np"], act)
        expected = oracle.token_stats(*args, **case["ora_kw"])
        for chunk_size in self.MASK_CHUNK_SIZES or self.CHUNK_SIZES:
            outs, grads, cots = self.run_case(case, rng, chunk_size)
            for name, got, exp in zip(("lse", "logp", "entropy"), outs, expected):
                assert_close(got.reshape(n), exp, "float32", name)
            kl = outs[3].reshape(n)
            assert (kl[act] > 1e30).all() and (kl[~act] == 0).all(), (chunk_size, kl)
            dz, _ = oracle.token_stats_vjp(*args, cots, **case["ora_kw"])
            assert_close(grads[0].reshape(n, k), dz, "float32", "d logits",
                         slack=oracle.saved_lse_slack(*args, cots, **case["ora_kw"]))

    #: (K, chunk sizes) of test_kl_at_large_temperatures
    LARGE_T_SHAPES = ((1271, None), (2**17, (None,)))

    @pytest.mark.parametrize("temperature", [1.0, 10.0, 1e3, 1e4])
    def test_kl_at_large_temperatures(self, rng, temperature):
        """Distillation reports T²·KL, and at a large T the KL is O(1/T²) while the sums it
        comes from are of the size of log K: it must be accurate relative to itself. T²·KL
        within the float32 tolerance of the oracle (and KL >= 0) for logits of size 1, 3 and
        30, and a teacher within 0.1 of the student, at K = 1271 and 2^17. (Formed as
        E_q[t - s] - lse_u + lse it came out 1e-2 off at T = 1e3 and negative at 1e4.)"""
        fw, T = self.fw, temperature
        for k, chunk_sizes in self.LARGE_T_SHAPES:
            z = rng.normal(size=(4, k)) * np.array([1.0, 3.0, 30.0, 3.0])[:, None]
            u = rng.normal(size=(4, k)) * np.array([1.0, 3.0, 30.0, 0.0])[:, None]
            u[3] = z[3] + 0.1 * rng.normal(size=k)
            z, u = z.astype(np.float32), u.astype(np.float32)
            y = rng.integers(0, k, 4)
            exp = oracle.token_stats(z, y, np.ones(4, bool), u=u, T=T)[3]
            for chunk_size in chunk_sizes or self.CHUNK_SIZES:
                st = fw.api.token_stats(fw.array(z), fw.array(y), teacher_logits=fw.array(u),
                                        temperature=T, chunk_size=chunk_size,
                                        backend=self.BACKEND)
                kl = fw.numpy(st.kl)
                assert (kl >= 0).all(), kl
                assert_close(kl * T * T, exp * T * T, "float32", f"T²·KL at K={k}")

    def test_parity_shapes_dtypes(self, rng, shape_dtype):
        rows, k, dtype = shape_dtype
        case = make_case(self.fw, rng, rows, k, dtype, FEATURES["all"])
        for chunk_size in self.SHAPE_CHUNK_SIZES or self.CHUNK_SIZES:
            self.check(case, rng, dtype, chunk_size)

    @pytest.mark.parametrize("feature", list(FEATURES))
    def test_parity_features(self, rng, feature):
        case = make_case(self.fw, rng, (4, 3), 301, "float32", FEATURES[feature])
        for chunk_size in self.CHUNK_SIZES:
            self.check(case, rng, "float32", chunk_size)

    @pytest.mark.parametrize("feature,dtype", [("plain", "float32"), ("all", "bfloat16")])
    def test_parity_without_entropy(self, rng, feature, dtype):
        """entropy=False (what the CE and distillation objectives ask for): entropy is None,
        every other output and the VJP are the oracle's."""
        case = make_case(self.fw, rng, (4, 3), 1271, dtype, FEATURES[feature])
        for chunk_size in self.CHUNK_SIZES:
            self.check(case, rng, dtype, chunk_size, entropy=False)

    # (temperature, size of the logits): logits of size T put the scaled logits at unit size
    # (a spread-out distribution); unit-size logits put |z| / T near 1e9 at T = 1e-8 (p close
    # to one-hot, lse as large)
    SMALL_TEMPERATURE_CASES = tuple((t, size) for size in ("T", "unit")
                                    for t in (1e-2, 1e-4, 1e-6, 1e-8))

    @pytest.mark.parametrize("temperature,size", SMALL_TEMPERATURE_CASES, ids=str)
    def test_small_temperatures(self, rng, temperature, size):
        """Every output and gradient at temperatures down to 1e-8 (T_ce = 1.5 T, T_kl =
        1.25 T, a LOO shift, a softcap, teacher gradients). With unit-size logits p is close
        to one-hot and |lse| near 1e9: the statistics must still be the oracle's to float32
        precision (the saved statistics' slack is of the size of log Σ, not of lse, and
        nothing where p = 1)."""
        scale = temperature if size == "T" else 1.0
        feat = dict(temperature=temperature, ce_temperature=1.5 * temperature,
                    teacher_temperature=1.25 * temperature, softcap=30.0 * scale, shift=True,
                    teacher=True, teacher_grad=True)
        case = make_case(self.fw, rng, (4, 3), 301, "float32", feat, scale=scale)
        slack = capped_logit_slack(case) if size == "unit" else None
        for chunk_size in self.CHUNK_SIZES:
            self.check(case, rng, "float32", chunk_size, stats_slack=slack)

    def test_minimum_temperature(self, rng):
        """At the smallest temperature accepted (``FLOAT32_MIN_TEMPERATURE`` = 2^-102),
        logits of size T (gaps between them of 2^-109 and less, none subnormal) give the
        oracle's statistics and gradients; every temperature argument below it is a ValueError
        that names it."""
        from dlm_kernels._config import FLOAT32_MIN_TEMPERATURE

        t = FLOAT32_MIN_TEMPERATURE
        feat = dict(temperature=t, ce_temperature=1.5 * t, teacher_temperature=1.25 * t,
                    shift=True, teacher=True, teacher_grad=True)
        case = make_case(self.fw, rng, (4, 3), 301, "float32", feat, scale=t)
        self.check(case, rng, "float32")
        below = float(np.nextafter(np.float64(t), 0.0))
        for name in ("temperature", "ce_temperature", "teacher_temperature"):
            with pytest.raises(ValueError, match=f"^{name} must be at least"):
                self.fw.api.token_stats(case["z"], case["y"], teacher_logits=case["u"],
                                        backend=self.BACKEND, **{name: below})

    @pytest.mark.parametrize("softcap", [1e-3, 1.0, 30.0, 1e4, 1e6, 1e30, 1e38], ids=str)
    def test_softcap_range(self, rng, softcap):
        """cap(z) = c·tanh(z / c) and its derivative 1 - tanh²(z / c) as the oracle computes
        them for every c: saturated (c = 1e-3, where z / c overflows for |z| past 3.4e35),
        and c so large that z / c is tiny or, past 2^126, not even a normal float32 (cap(z)
        = z to float32 there, never 0)."""
        case = make_case(self.fw, rng, (4, 3), 301, "float32",
                         dict(FEATURES["all"], softcap=softcap))
        for chunk_size in self.CHUNK_SIZES:
            self.check(case, rng, "float32", chunk_size)

    def test_all_rows_inactive_give_exact_zeros(self, rng):
        case = make_case(self.fw, rng, (2, 3), 50, "float32", FEATURES["all"], active_frac=0.0)
        case["w"] = self.fw.array(np.zeros((2, 3), np.float32))
        case["active"] = np.zeros(6, bool)
        outs, grads, _ = self.run_case(case, rng)
        for name, v in zip(("lse", "logp", "entropy", "kl", "d logits", "d teacher"),
                           list(outs) + list(grads)):
            assert_exact_zero(v, name)

    def test_neg_inf_logits_in_active_rows(self, rng):
        fw = self.fw
        case = make_case(fw, rng, (3, 2), 97, "float32", FEATURES["teacher_grad"], poison=False)
        z = case["z_np"].copy()
        u = case["ora_kw"]["u"].copy()
        z[:, ::3] = -np.inf  # masked-out vocabulary entries in the student ...
        u[:, 1::4] = -np.inf  # ... and in the teacher, at other columns
        z[np.arange(6), case["y_np"]] = 1.0  # the target itself stays finite
        u[:, ::3] = -np.inf  # q = 0 wherever p = 0, so the KL stays finite
        case.update(z=fw.array(z.reshape(3, 2, 97), "float32"), z_np=z,
                    u=fw.array(u.reshape(3, 2, 97), "float32"))
        case["ora_kw"]["u"] = u
        outs, grads, _ = self.run_case(case, rng)
        for name, v in zip(("lse", "logp", "entropy", "kl"), outs):
            assert np.isfinite(v).all(), f"{name} not finite with -inf logits: {v}"
        assert np.isfinite(grads[0]).all() and np.isfinite(grads[1]).all()
        self.check(case, rng, "float32")

    def test_active_target_out_of_range_is_nan_not_silent(self, rng):
        fw = self.fw
        z = fw.array(rng.normal(size=(4, 11)), "float32")
        y = fw.array(np.array([0, 11, -3, 10]))
        st = fw.api.token_stats(z, y, backend=self.BACKEND)
        logp = fw.numpy(st.logp)
        assert np.isfinite(logp[[0, 3]]).all() and np.isnan(logp[[1, 2]]).all(), logp

    def test_per_position_shift_matches_the_materialised_shift(self, rng):
        """A [B, L] shift (per-position alpha, as with per-token diffusion times) in the fused
        primitive equals loo_to_denoiser_logits with alpha [B, L] plus an unshifted call, and
        the float64 oracle; gradients too."""
        fw = self.fw
        b, l, k = 3, 4, 67
        z64 = rng.normal(size=(b, l, k)) * 3
        y, xt = rng.integers(0, k, (b, l)), rng.integers(0, k, (b, l))
        alpha = rng.uniform(0.05, 0.95, (b, l)).astype(np.float32)
        w = (rng.uniform(size=(b, l)) < 0.8).astype(np.float32)
        w[0, 0] = 1.0
        z = fw.array(z64, "float32")
        delta = fw.numpy(fw.api.loo_to_denoiser_logits(fw.array(np.zeros((b, l, k), np.float32)),
                                                       fw.array(xt), fw.array(alpha), k))
        delta = delta[np.arange(b)[:, None], np.arange(l)[None, :], xt].astype(np.float32)  # [B, L]
        fused = lambda z_: fw.api.token_stats(z_, fw.array(y), fw.array(w), shift_ids=fw.array(xt),
                                              shift=fw.array(delta), backend=self.BACKEND)
        shifted = lambda z_: fw.api.token_stats(
            fw.api.loo_to_denoiser_logits(z_, fw.array(xt), fw.array(alpha), k), fw.array(y),
            fw.array(w), backend=self.BACKEND)
        cots = [rng.normal(size=(b, l)).astype(np.float32) for _ in range(4)]
        got, (g_got,) = fw.vjp(fused, [z], cots)
        ref, (g_ref,) = fw.vjp(shifted, [z], cots)
        active = w.reshape(-1) != 0
        exp = oracle.token_stats(z64.reshape(-1, k), y.reshape(-1), active, x=xt.reshape(-1),
                                 d=delta.reshape(-1).astype(np.float64))
        for name, a, r, e in zip(("lse", "logp", "entropy", "kl"), got, ref, exp):
            assert_close(a.reshape(-1), e, "float32", f"{name} with a [B, L] shift vs oracle")
            assert_close(a.reshape(-1), r.reshape(-1), "float32", f"{name}: fused vs materialised")
        g = [c.reshape(-1) for c in cots]
        dz, _ = oracle.token_stats_vjp(z64.reshape(-1, k), y.reshape(-1), active, g,
                                       x=xt.reshape(-1), d=delta.reshape(-1).astype(np.float64))
        slack = oracle.saved_lse_slack(z64.reshape(-1, k), y.reshape(-1), active, g,
                                       x=xt.reshape(-1), d=delta.reshape(-1).astype(np.float64))
        assert_close(g_got.reshape(-1, k), dz, "float32", "d logits with a [B, L] shift", slack=slack)
        assert_close(g_got, g_ref, "float32", "d logits: fused vs materialised", slack=2 * slack.reshape(g_got.shape))

    @pytest.mark.parametrize("feature", ["shift", "all"])
    def test_shift_gradient(self, rng, feature):
        """d shift (the LOO shift is differentiable: it carries the diffusion time) against
        central differences of the float64 oracle, with every cotangent at once; rows where
        the shifted column is the target, inactive rows (exact 0) and a vocab_size below K
        included."""
        fw = self.fw
        rows, k = (3, 4), 37
        case = make_case(fw, rng, rows, k, "float32", FEATURES[feature])
        n, ora = case["n"], dict(case["ora_kw"])
        # active targets below vocab_size (the last column is padding here)
        y_np = np.where(case["active"], np.minimum(case["y_np"], k - 2), case["y_np"])
        x = ora["x"].copy()
        x[:3] = y_np[:3]  # shifted column = target (its δ[x = y] term)
        x[3] = k - 1  # a column past vocab_size: no shift there, no gradient
        ora["x"] = x
        api_kw = dict(case["api_kw"], shift_ids=fw.array(x.reshape(rows)))
        api_kw.pop("shift")
        cots = [rng.normal(size=n) for _ in range(4)]
        y_ora = np.where(y_np < k - 1, y_np, -1)

        def fn(d):
            st = fw.api.token_stats(case["z"], fw.array(y_np.reshape(rows)), case["w"], teacher_logits=case["u"],
                                    shift=d, vocab_size=k - 1, backend=self.BACKEND, **api_kw)
            return tuple(st)

        d0 = ora["d"]
        _, (grad,) = fw.vjp(fn, [fw.array(d0.reshape(rows).astype(np.float32))],
                            [c.reshape(rows).astype(np.float32) for c in cots])

        def objective(d):  # float64 Σ g·stats, the shift past vocab_size left out
            kw = dict(ora, d=np.where(x < k - 1, d, 0.0))
            stats = oracle.token_stats(case["z_np"][:, :k - 1], y_ora, case["active"],
                                       **{**kw, "u": None if kw.get("u") is None
                                          else kw["u"][:, :k - 1],
                                          "x": np.where(x < k - 1, x, 0)})
            return np.array([sum(np.nan_to_num(c[i] * v[i]) for c, v in zip(cots, stats))
                             for i in range(n)])

        h = 1e-5
        expected = (objective(d0 + h) - objective(d0 - h)) / (2 * h)
        expected[3] = 0.0
        assert_close(grad.reshape(n), np.where(case["active"], expected, 0.0), "float32",
                     "d shift")
        assert_exact_zero(grad.reshape(n)[~case["active"]], "d shift of inactive rows")

    #: (kind, temperature, entropy) of test_shift_gradient_at_ties
    SHIFT_TIES = (("huge", 1.0, False), ("small T", 1e-3, False), ("small T", 1e-3, True))

    @pytest.mark.parametrize("kind,temperature,entropy", SHIFT_TIES, ids=str)
    def test_shift_gradient_at_ties(self, rng, kind, temperature, entropy):
        """The shifted column's logit is the float32 sum fl(z_x + d) in the forward, so the
        backward must use that same number: d z_x equals d shift (§2, "Gradients") and the
        row's gradient sums to g_lse / T. At inputs where z_x + d rounds and the shifted
        column ties with the row max (logits near 1e7 at T = 1; logits of size 30 and shifts
        of tens at T = 1e-3), each output and gradient against the float64 oracle of those
        float32 shifted logits. (An interpreted kernel: at its many-block size only.)"""
        for chunk_size in self.SHAPE_CHUNK_SIZES or self.CHUNK_SIZES:
            self.check_shift_ties(rng, kind, temperature, entropy, chunk_size)

    def check_shift_ties(self, rng, kind, temperature, entropy, chunk_size=None, k=307):
        fw = self.fw
        case = shift_tie_case(fw, rng, kind, temperature, k)
        n, x, y, T = case["n"], case["x"], case["y"], temperature
        active = np.ones(n, bool)
        cots = [rng.normal(size=n).astype(np.float32) for _ in range(4)]
        cots[3][:] = 0.0  # no teacher
        if not entropy:
            cots[2][:] = 0.0

        def fn(z, d):
            st = fw.api.token_stats(z, fw.array(y), shift_ids=fw.array(x), shift=d,
                                    temperature=T, entropy=entropy, chunk_size=chunk_size,
                                    backend=self.BACKEND)
            return (st.lse, st.logp, st.kl) if not entropy else tuple(st)

        used = [c for i, c in enumerate(cots) if entropy or i != 2]
        outs, (dz, d_shift) = fw.vjp(fn, [case["z"], fw.array(case["d"])], used)
        r = case["r"]  # [N, K] float64 of the float32 shifted logits
        exp = oracle.token_stats(r, y, active, T=T)
        for name, got, e in zip(("lse", "logp", "entropy") if entropy else ("lse", "logp"),
                                outs, exp):
            assert_close(got, e, "float32", f"{name} ({kind})")
        dz_exp, _ = oracle.token_stats_vjp(r, y, active, cots, T=T)
        slack = oracle.saved_lse_slack(r, y, active, cots, T=T)
        rows = np.arange(n)
        assert_close(dz, dz_exp, "float32", f"d logits ({kind})", slack=slack)
        assert_close(d_shift, dz_exp[rows, x], "float32", f"d shift ({kind})",
                     slack=slack[rows, x])
        assert_close(dz[rows, x], d_shift, "float32", f"d logits at x vs d shift ({kind})",
                     slack=2 * slack[rows, x])
        atol, rtol = TOLERANCES["float32"]
        assert_close(dz.sum(axis=1), cots[0] / T, "float32", f"Σ_k d logits ({kind})",
                     slack=(slack + atol + rtol * np.abs(dz_exp)).sum(axis=1))

    def test_shift_ids_out_of_range_give_nan_not_an_unshifted_row(self, rng):
        fw = self.fw
        k = 29
        z = fw.array(rng.normal(size=(6, k)), "float32")
        y = rng.integers(0, k, 6)
        x = np.array([3, -1, k, k + 7, 0, -4])
        w = np.array([1, 1, 1, 1, 1, 0], np.float32)  # the last row is inactive
        st = fw.api.token_stats(z, fw.array(y), fw.array(w), shift_ids=fw.array(x), shift=2.0,
                                backend=self.BACKEND)
        for name, v in zip(("lse", "logp", "entropy", "kl"), st):
            v = fw.numpy(v)
            assert np.isfinite(v[[0, 4]]).all(), f"{name}: rows with valid shift ids: {v}"
            assert np.isnan(v[1:4]).all(), f"{name}: rows with out-of-range shift ids: {v}"
            assert v[5] == 0.0, f"{name}: an inactive row stays 0 whatever its shift id: {v}"

    NON_FINITE_ROWS = ("+inf", "+inf target", "nan", "all -inf", "-inf target")

    @pytest.mark.parametrize("k,temperature,shifted,kinds", [
        (37, 0.9, False, ("finite",) + NON_FINITE_ROWS + ("finite",)),
        (64, 100.0, True, ("finite",) * 3 + ("+inf",) + ("finite",) * 2)], ids=["mixed", "shift"])
    def test_non_finite_logits_in_active_rows(self, rng, k, temperature, shifted, kinds):
        """The documented result of every backend alike: a NaN or +inf logit, or an all -inf
        row, leaves no distribution (every statistic NaN, lse -inf for the all -inf row, the
        row's gradient NaN); a target at -inf has logp -inf with the oracle's finite gradient.
        One call holds a row of each kind between finite rows, which stay untouched. With a
        LOO shift at T = 100 the jitted JAX reference once took a +inf row's lse for a finite
        number (XLA on a CPU compiled its row-max test of +inf wrongly in the program with
        the VJP)."""
        fw = self.fw
        n = len(kinds)
        z64 = rng.normal(size=(n, k)) * 2
        u64 = rng.normal(size=(n, k))
        y = rng.integers(0, k, n)
        x = rng.integers(0, k, n) if shifted else None
        d = rng.uniform(0.0, 6.0, n).astype(np.float32) if shifted else None
        for i, kind in enumerate(kinds):
            other = (y[i] + 5) % k
            if kind == "+inf":
                z64[i, other] = np.inf
            elif kind == "+inf target":
                z64[i, y[i]] = np.inf
            elif kind == "nan":
                z64[i, other] = np.nan
            elif kind == "all -inf":
                z64[i] = -np.inf
            elif kind == "-inf target":
                z64[i, y[i]] = -np.inf
        shift = dict(shift_ids=fw.array(x), shift=fw.array(d)) if shifted else {}
        fn = lambda z_: fw.api.token_stats(z_, fw.array(y), teacher_logits=fw.array(u64, "float32"),
                                           temperature=temperature, backend=self.BACKEND, **shift)
        cots = [rng.uniform(0.5, 1.5, n).astype(np.float32) for _ in range(4)]
        outs, (grad,) = fw.vjp(fn, [fw.array(z64, "float32")], cots)
        kinds = np.array(kinds)
        keep = (kinds == "finite") | (kinds == "-inf target")  # rows with a distribution
        ora = dict(u=u64[keep], T=temperature)
        if shifted:
            ora.update(x=x[keep], d=d[keep].astype(np.float64))
        args = (z64[keep], y[keep], np.ones(keep.sum(), bool))
        exp = oracle.token_stats(*args, **ora)
        for name, got, e in zip(("lse", "logp", "entropy", "kl"), outs, exp):
            assert_close(got[keep], e, "float32", f"{name} of the rows with a distribution")
        for i in np.flatnonzero(kinds == "-inf target"):
            assert outs[1][i] == -np.inf, outs[1][i]
        g = [c[keep] for c in cots]
        dz, _ = oracle.token_stats_vjp(*args, g, **ora)
        assert_close(grad[keep], dz, "float32", "d logits of the rows with a distribution",
                     slack=oracle.saved_lse_slack(*args, g, **ora))
        for i in np.flatnonzero(~keep):
            lse = outs[0][i]
            assert (lse == -np.inf) if kinds[i] == "all -inf" else np.isnan(lse), (kinds[i], lse)
            for name, got in zip(("logp", "entropy", "kl"), outs[1:]):
                assert np.isnan(got[i]), f"{name} of the row with {kinds[i]}: {got[i]}"
            assert np.isnan(grad[i]).all(), (
                f"d logits of the row with {kinds[i]}: {np.count_nonzero(~np.isnan(grad[i]))} of "
                f"{k} not NaN")
        # each statistic's own gradient too (the entropy's NaN must not hide another's)
        for j, name in enumerate(("lse", "logp", "entropy", "kl")):
            alone = lambda z_, j=j: (fn(z_)[j],)  # only this statistic is differentiated
            _, (grad,) = fw.vjp(alone, [fw.array(z64, "float32")], [cots[j]])
            for i in np.flatnonzero(~keep):
                assert np.isnan(grad[i]).all(), (
                    f"d {name} / d logits of the row with {kinds[i]}: "
                    f"{np.count_nonzero(~np.isnan(grad[i]))} of {k} not NaN")

    def test_scalar_shift_equals_broadcast_shift(self, rng):
        fw = self.fw
        z = fw.array(rng.normal(size=(3, 4, 29)) * 3, "float32")
        y, x = fw.array(rng.integers(0, 29, (3, 4))), fw.array(rng.integers(0, 29, (3, 4)))
        a = fw.api.token_stats(z, y, shift_ids=x, shift=2.5, backend=self.BACKEND)
        b = fw.api.token_stats(z, y, shift_ids=x, shift=fw.array(np.full((3, 4), 2.5, np.float32)),
                               backend=self.BACKEND)
        for got, exp in zip(a, b):
            assert_close(fw.numpy(got), fw.numpy(exp), "float32", "scalar shift")

    @pytest.mark.parametrize("rows", [(0,), (2, 0)])
    def test_no_rows(self, rng, rows):
        """Zero rows (an empty batch or length): empty statistics and empty gradients, every
        feature on, as the reference gives; no kernel launches over an empty grid."""
        fw = self.fw
        case = make_case(fw, rng, rows, 37, "float32", FEATURES["all"])
        outs, grads, _ = self.run_case(case, rng)
        for name, got in zip(("lse", "logp", "entropy", "kl"), outs):
            assert got.shape == rows, f"{name}: shape {got.shape}, expected {rows}"
        assert [g.shape for g in grads] == [rows + (37,)] * 2, [g.shape for g in grads]

    @pytest.mark.parametrize("softcap", [1.0, 1e30])
    def test_softcap_of_minus_inf_columns(self, rng, softcap):
        """A -inf logit under a softcap is capped to -c: a finite column whose gradient is 0
        (cap' = 0 there), never NaN (the series branch is not evaluated at ±inf)."""
        fw = self.fw
        z64 = rng.normal(size=(3, 37)) * 2
        z64[:, 5:9] = -np.inf
        y = rng.integers(9, 37, 3)
        cots = [rng.normal(size=3).astype(np.float32) for _ in range(4)]
        fn = lambda z_: fw.api.token_stats(z_, fw.array(y), softcap=softcap,
                                           backend=self.BACKEND)[:3]
        outs, (grad,) = fw.vjp(fn, [fw.array(z64, "float32")], cots[:3])
        active = np.ones(3, bool)
        exp = oracle.token_stats(z64, y, active, softcap=softcap)
        for name, got, e in zip(("lse", "logp", "entropy"), outs, exp):
            assert_close(got, e, "float32", name)
        g = cots[:3] + [np.zeros(3)]
        dz, _ = oracle.token_stats_vjp(z64, y, active, g, softcap=softcap)
        assert_close(grad, dz, "float32", "d logits",
                     slack=oracle.saved_lse_slack(z64, y, active, g, softcap=softcap))

    @pytest.mark.parametrize("softcap", [1e-3, 1.0])
    def test_softcap_derivative_near_saturation(self, rng, softcap):
        """cap'(z) = 1 - tanh²(z / c) to float32's relative precision where tanh saturates
        (|z / c| from 4 to 12: cap' from 1.3e-3 down to 1.5e-10). Formed as 1 - th² from a
        float32 th it is known only to float32's absolute precision, 6e-8: 100 % off past
        |z / c| = 9, where th rounds to 1. A large cotangent of the lse puts d logits =
        g·p·cap' / T far above the absolute floor."""
        fw, n, k = self.fw, 3, 37
        x = rng.uniform(4.0, 12.0, (n, k)) * rng.choice([-1.0, 1.0], (n, k))
        z64 = fw.numpy(fw.array(x * softcap, "float32"))
        y = rng.integers(0, k, n)
        g = [np.full(n, 1e9, np.float32)] + [np.zeros(n, np.float32)] * 3
        fn = lambda z_: fw.api.token_stats(z_, fw.array(y), softcap=softcap,  # noqa: E731
                                           backend=self.BACKEND)[:1]
        _, (grad,) = fw.vjp(fn, [fw.array(z64, "float32")], g[:1])
        active = np.ones(n, bool)
        dz, _ = oracle.token_stats_vjp(z64, y, active, g, softcap=softcap)
        cap = np.cosh(z64 / softcap) ** -2.0
        assert_close(grad, dz, "float32", "d logits",
                     slack=cap * oracle.saved_lse_slack(z64, y, active, g, softcap=softcap))

    def test_weights_none_means_all_active(self, rng):
        fw = self.fw
        z64 = rng.normal(size=(5, 33))
        y = rng.integers(0, 33, 5)
        st = fw.api.token_stats(fw.array(z64, "float32"), fw.array(y), backend=self.BACKEND)
        exp = oracle.token_stats(z64.astype(np.float32), y, np.ones(5, bool))
        for got, e in zip(st, exp):
            assert_close(fw.numpy(got), e)


def check_jit_grad_vmap(backend):
    """jit(vmap(grad)) of a kernel backend equals the reference (kernel calls have no vmap
    rule of their own: the backend folds the mapped axis into the rows)."""
    import jax
    import jax.numpy as jnp

    import dlm_kernels.jax as D

    rng = np.random.default_rng(new_seed())
    z = jnp.asarray(rng.normal(size=(3, 4, 150)) * 3, jnp.float32)
    u = jnp.asarray(rng.normal(size=(3, 4, 150)), jnp.float32)
    y = jnp.asarray(rng.integers(0, 150, (3, 4)))
    w = jnp.asarray(rng.uniform(size=(3, 4)) > 0.25, jnp.float32)

    def per_example(zi, ui, yi, wi, backend):
        s = D.token_stats(zi, yi, wi, teacher_logits=ui, temperature=0.7, backend=backend)
        return jnp.sum(s.logp) + 0.2 * jnp.sum(s.entropy) + jnp.sum(s.kl)

    grad_fn = jax.jit(jax.vmap(jax.grad(per_example), in_axes=(0, 0, 0, 0, None)), static_argnums=4)
    got = grad_fn(z, u, y, w, backend)
    exp = jax.vmap(jax.grad(per_example), in_axes=(0, 0, 0, 0, None))(z, u, y, w, "reference")
    assert_close(np.asarray(got), np.asarray(exp), "float32", f"{backend}: jit(vmap(grad))")


class ChunkedSuite(TokenStatsSuite):
    BACKEND = "chunked"
    CHUNK_SIZES = (None, 100)  # one chunk, and many ragged ones
    # the masked spans over many chunks, ragged (100) and dividing K (41): a span covering
    # whole chunks is what their merge must hold (one chunk is the reference's case)
    MASK_CHUNK_SIZES = (100, 41)


class TorchBufferChecks:
    """What a torch backend may do to its inputs' memory (JAX arrays are immutable, so the
    JAX classes have nothing to check here)."""

    @pytest.mark.parametrize("feature,dtype", [("shift", "float32"), ("all", "bfloat16")])
    def test_inputs_are_left_as_they_were(self, rng, feature, dtype):
        """Forward and backward only read the logits and teacher logits (writing the gradient
        into the logits is opt-in: inplace_grad). float32 logits without a softcap are their
        own float32 view, so a backend that adds the LOO shift in place must copy first."""
        case = make_case(self.fw, rng, (2, 3), 301, dtype, FEATURES[feature])
        inputs = {"logits": case["z"], "teacher_logits": case["u"]}  # ("all": differentiated)
        inputs = {name: a for name, a in inputs.items() if a is not None}
        before = [self.fw.numpy(a).copy() for a in inputs.values()]
        seen = []  # the arrays the call got (the harness passes fresh leaves)
        self.run_case(case, rng, seen=seen)
        assert len(seen) == len(before), (list(inputs), len(seen))
        for name, old, arg in zip(inputs, before, seen):
            new = self.fw.numpy(arg)
            changed = ~((new == old) | (np.isnan(new) & np.isnan(old)))
            assert not changed.any(), (f"{name} changed at {np.argwhere(changed)[:3].tolist()} "
                                       f"({changed.sum()} entries)")


class TorchInplaceChecks(TorchBufferChecks):
    """inplace_grad=True (backends that support it): d logits written over a logits buffer
    the loss owns are the oracle's, and the buffer holds exactly the gradient returned."""

    @pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
    def test_inplace_grad_matches_oracle(self, rng, dtype):
        import torch

        fw = self.fw
        case = make_case(fw, rng, (3, 4), 173, dtype, FEATURES["all"])
        logits = case["z"].clone().requires_grad_(True)
        teacher = case["u"].clone().requires_grad_(True)
        work = logits * 1.0  # a non-leaf the loss owns, as an LM head's output would be
        s = fw.api.token_stats(work, case["y"], case["w"], teacher_logits=teacher,
                               inplace_grad=True, chunk_size=32, backend=self.BACKEND,
                               **case["api_kw"])
        cots = [rng.normal(size=case["rows"]).astype(np.float32) for _ in range(4)]
        grads = torch.autograd.grad(list(s), (logits, teacher),
                                    [torch.tensor(c) for c in cots])
        self.compare(case, [fw.numpy(v) for v in s], [fw.numpy(g) for g in grads],
                     [c.reshape(case["n"]) for c in cots], dtype)
        assert torch.equal(work.detach(), grads[0]), "the logits buffer is not d logits"


class TorchCompileChecks:
    """torch.compile(fullgraph=True) traces a torch backend's forward and custom backward
    with no graph break, and the compiled call matches the eager one. ``COMPILE_CHUNK``:
    the chunk size of the token_stats case (several chunks put the vocabulary loop itself
    under tracing)."""

    COMPILE_CHUNK = None

    def check_compiled(self, loss, z, backend="aot_eager"):
        """loss(z) and its gradient agree eager and under torch.compile(fullgraph=True)."""
        import torch

        fw = self.fw
        torch._dynamo.reset()  # a fresh compile of this test's loss
        compiled = torch.compile(loss, backend=backend, fullgraph=True)
        z1, z2 = (z.detach().clone().requires_grad_(True) for _ in range(2))
        v1, v2 = loss(z1), compiled(z2)
        (g1,) = torch.autograd.grad(v1, z1)
        (g2,) = torch.autograd.grad(v2, z2)
        assert_close(fw.numpy(v2), fw.numpy(v1), "float32", "compiled value")
        assert_close(fw.numpy(g2), fw.numpy(g1), "float32", "compiled gradient")

    def test_torch_compile_fullgraph(self, rng):
        fw = self.fw
        case = make_case(fw, rng, (2, 3), 97, "float32", FEATURES["all"], poison=False)

        def loss(z):
            s = fw.api.token_stats(z, case["y"], case["w"], teacher_logits=case["u"],
                                   chunk_size=self.COMPILE_CHUNK, backend=self.BACKEND,
                                   **case["api_kw"])
            return s.logp.sum() + 0.5 * s.entropy.sum() + s.kl.sum()

        self.check_compiled(loss, case["z"])

    def test_torch_compile_fullgraph_objective(self, rng):
        """An objective's launch (no entropy, a separate T = 1 CE, a teacher) traces too."""
        fw = self.fw
        z64, u64 = rng.normal(size=(2, 3, 97)) * 3, rng.normal(size=(2, 3, 97)) * 3
        y = fw.array(rng.integers(0, 97, (2, 3)))
        w = fw.array((rng.uniform(size=(2, 3)) < 0.7).astype(np.float32))
        batch = fw.api.DiffusionDistillationBatch.create(
            student_batch=fw.api.DiffusionTokenBatch.create(model_inputs=y, target_ids=y,
                                                            loss_weights=w),
            teacher_logits=fw.array(u64, "float32"))

        def loss(z):
            total, _ = fw.api.opd_loss(z, batch, temperature=1.7, hard_loss_weight=0.4,
                                       backend=self.BACKEND)
            return total.compute()

        self.check_compiled(loss, fw.array(z64, "float32"))


    def test_torch_compile_fullgraph_contract_checks(self, rng):
        """The contract's checks trace too: an SFT LOO loss with vocab_size < K (ids remapped
        on the device) and a policy score of a dict-of-tensors batch with bool weights."""
        fw = self.fw
        z64 = rng.normal(size=(2, 3, 97)) * 3
        x0, xt = fw.array(rng.integers(0, 90, (2, 3))), fw.array(rng.integers(0, 90, (2, 3)))
        t = fw.array(np.array([0.2, 0.7], np.float32))
        mask = fw.array(np.array([[1, 0, 1], [1, 1, 1]], np.float32))
        batch = fw.api.DiffusionTokenBatch.create(
            model_inputs={"input_tokens": xt, "time": t}, target_ids=x0,
            loss_weights=fw.array(np.array([[True, True, False], [True, False, True]])))

        def loss(z):
            sft = fw.api.diffusion_sft_loss(z, x0, xt, t, mask, variant="reweighted-loo-ce",
                                            vocab_size=90, backend=self.BACKEND)
            logps = fw.api.per_token_logps(z, batch, stop_gradient=False, backend=self.BACKEND)
            return sft.sum() + logps.sum()

        self.check_compiled(loss, fw.array(z64, "float32"))
