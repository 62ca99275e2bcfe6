"""The linear head: token_stats and every objective from ``LinearHead(hidden, weight, bias)``
on every backend, values and the gradients of hidden, weight, bias (and of a teacher head)
against the float64 oracle applied to ``hidden @ weight``.

Inputs are dyadic (hidden, weight in {-2..2}/4, bias in {-4..4}/8, D <= 19): every logit is
a multiple of 1/16 below 8, exact in float32, bfloat16 and float16 whatever the matmul's
accumulation order, so the oracle sees the very logits the kernels see and the statistics and
d(logits) obey the logits path's tolerances. The error model of dH = dZ·W and dW = Hᵀ·dZ:
d(logits) reaches the matmul rounded to the inputs' dtype (unit roundoff u: 2^-24 float32,
2^-8 bfloat16, 2^-11 float16; below the dtype's smallest normal number, half its subnormal
spacing s instead: 2^-25 in float16, under 6.1e-5) with its own error e (the saved-lse
slack, or the teacher's scaled floor); a float32 sum over J terms adds at most J·2^-24 of
Σ|terms|. So element (i, j) may differ by (u + J·2^-24)·Σ_k|dz_ik·w_kj| +
Σ_k (e_ik + s)·|w_kj| before the one final rounding (the dtype's rtol). That bound is the
``slack`` passed to ``assert_close``.
"""

from __future__ import annotations

import numpy as np
import pytest

import oracle
from harness import assert_close, cases, framework
from dlm_kernels.testing import CANCELLATION_ULP, TOLERANCES, cancellation_scale

UNIT_ROUNDOFF = {"float32": 2.0 ** -24, "bfloat16": 2.0 ** -8, "float16": 2.0 ** -11}
SUBNORMAL_ROUNDING = {"float32": 2.0 ** -150, "bfloat16": 2.0 ** -134, "float16": 2.0 ** -25}
F32_U = 2.0 ** -24


def dyadic(rng, shape, scale=4):
    return rng.integers(-2, 3, shape) / scale


def matmul_slack(dz, dz_err, w, dtype):
    """[I, J] allowance of dz [I, K] @ w [K, J] (the module docstring's error model)."""
    terms = np.abs(dz) @ np.abs(w)
    return ((UNIT_ROUNDOFF[dtype] + dz.shape[1] * F32_U) * terms
            + (dz_err + SUBNORMAL_ROUNDING[dtype]) @ np.abs(w))


class HeadProblem:
    """One random problem: a student head, optional teacher head, rows and cotangents."""

    def __init__(self, rng, rows=(5, 9), d=19, k=301, dt=7, bias=True, teacher=True):
        n = int(np.prod(rows))
        self.rows, self.n, self.k = rows, n, k
        self.h = dyadic(rng, rows + (d,))
        self.w = dyadic(rng, (k, d))  # [K, D]; the layouts transpose it
        self.b = rng.integers(-4, 5, k) / 8 if bias else None
        self.ht = dyadic(rng, rows + (dt,)) if teacher else None
        self.wt = dyadic(rng, (k, dt)) if teacher else None
        self.y = rng.integers(0, k, rows)
        self.active = (rng.uniform(size=rows) < 0.8).astype(np.float64)
        self.active.flat[0] = 1.0
        self.x = rng.integers(0, k, rows)
        # shifts on a grid of 2^-10: z + d is exact in float32, as the oracle computes it
        self.d = rng.integers(0, 2049, rows) / 1024
        self.cot = [rng.normal(size=rows) for _ in range(4)]

    def z(self):  # [N, K] float64 logits
        z = self.h.reshape(self.n, -1) @ self.w.T
        return z if self.b is None else z + self.b

    def u(self):
        return None if self.ht is None else self.ht.reshape(self.n, -1) @ self.wt.T


def _weight(fw, w_kd, layout, dtype):
    return fw.array(w_kd if layout == "KD" else w_kd.T, dtype)


def _from_kd(g_kd, layout):
    return g_kd if layout == "KD" else g_kd.T


KW = dict(temperature=0.7, ce_temperature=1.3, softcap=6.0, teacher_temperature=1.5)


class LinearHeadSuite:
    """Each backend class names the cases it runs (``harness.cases``): the
    kernel backends a subset, since each of their tests costs seconds in an interpreter;
    the chunked backends run every one."""

    FW = None
    BACKEND = None
    #: (weight_layout, dtype) of test_token_stats_from_heads
    head_case = cases(("KD", "float32"), ("DK", "float32"), ("KD", "bfloat16"), ("DK", "bfloat16"))
    ce_dtype = cases("float32", "bfloat16")
    #: (term differentiated, dtype) of test_opd_loss_with_teacher_head
    opd_term = cases(("total", "float32"), ("aux", "float32"), ("both", "bfloat16"))
    #: whether test_jax_vmap_over_a_head runs (its float32 head never takes vocabulary blocks)
    VMAP = True

    @property
    def fw(self):
        return framework(self.FW)

    def head(self, h, w, b, layout, row_chunk=4):
        return self.fw.api.LinearHead(h, w, b, weight_layout=layout, row_chunk=row_chunk)

    # -- token_stats ----------------------------------------------------------------------
    def test_token_stats_from_heads(self, rng, head_case):
        """Student and teacher heads (widths 19 and 7), every feature on, a ragged last
        token chunk (45 rows in chunks of 4): values and the gradients of all five arrays."""
        layout, dtype = head_case
        fw, p = self.fw, HeadProblem(rng)
        arr = lambda a, dt=None: fw.array(a, dt)
        y, act, x, d = arr(p.y), arr(p.active.astype(np.float32)), arr(p.x), arr(p.d, "float32")

        def fn(h, w, b, ht, wt):
            s = fw.api.token_stats(self.head(h, w, b, layout), y, act, shift_ids=x, shift=d,
                                   teacher_logits=self.head(ht, wt, None, layout, 8),
                                   teacher_grad=True, backend=self.BACKEND, **KW)
            return s.lse, s.logp, s.entropy, s.kl

        primals = (arr(p.h, dtype), _weight(fw, p.w, layout, dtype), arr(p.b, dtype),
                   arr(p.ht, dtype), _weight(fw, p.wt, layout, dtype))
        outs, (gh, gw, gb, ght, gwt) = fw.vjp(fn, primals, p.cot)
        okw = dict(x=p.x.reshape(-1), d=p.d.reshape(-1), u=p.u(), T=0.7, T_ce=1.3, T_kl=1.5,
                   softcap=6.0)
        active, ys = p.active.reshape(-1) != 0, p.y.reshape(-1)
        expected = oracle.token_stats(p.z(), ys, active, **okw)
        for name, got, exp in zip(("lse", "logp", "entropy", "kl"), outs, expected):
            assert_close(got.reshape(-1), exp, "float32", name)
        grads = [c.reshape(-1) for c in p.cot]
        dz, du = oracle.token_stats_vjp(p.z(), ys, active, grads, **okw)
        dz_err = oracle.saved_lse_slack(p.z(), ys, active, grads, **okw)
        h, ht = p.h.reshape(p.n, -1), p.ht.reshape(p.n, -1)
        assert_close(gh.reshape(p.n, -1), dz @ p.w, dtype, "d hidden",
                     slack=matmul_slack(dz, dz_err, p.w, dtype))
        assert_close(gw, _from_kd(dz.T @ h, layout), dtype, "d weight",
                     slack=_from_kd(matmul_slack(dz.T, dz_err.T, np.abs(h), dtype), layout))
        assert_close(gb, dz.sum(0), dtype, "d bias",
                     slack=matmul_slack(dz.T, dz_err.T, np.ones((p.n, 1)), dtype)[:, 0])
        # the teacher's d(logits) is a difference of terms of size |t - s| (float32 floor
        # scaled as in the logits path's tests), then the same matmul error
        scale = cancellation_scale(grads[3], p.z() / 0.7, p.u() / 1.5, temperature=1.5)
        du_err = np.full(du.shape, TOLERANCES["float32"][0] + CANCELLATION_ULP * scale)
        assert_close(ght.reshape(p.n, -1), du @ p.wt, dtype, "d teacher hidden",
                     slack=matmul_slack(du, du_err, p.wt, dtype))
        assert_close(gwt, _from_kd(du.T @ ht, layout), dtype, "d teacher weight",
                     slack=_from_kd(matmul_slack(du.T, du_err.T, np.abs(ht), dtype), layout))

    def test_one_row_and_mixed_inputs(self, rng):
        """N = 1 (one chunk smaller than the budget), a student head with a teacher given as
        logits, no bias: the teacher array gets its gradient, the head its own."""
        fw, p = self.fw, HeadProblem(rng, rows=(1,), k=127, bias=False)
        y, act = fw.array(p.y), fw.array(p.active.astype(np.float32))

        def fn(h, w, u):
            s = fw.api.token_stats(self.head(h, w, None, "KD", None), y, act, teacher_logits=u,
                                   teacher_grad=True, backend=self.BACKEND)
            return s.lse, s.logp, s.entropy, s.kl

        u = p.u()
        outs, (gh, gw, gu) = fw.vjp(fn, (fw.array(p.h, "float32"), fw.array(p.w, "float32"),
                                         fw.array(u, "float32")), p.cot)
        ys, active = p.y.reshape(-1), p.active.reshape(-1) != 0
        for name, got, exp in zip(("lse", "logp", "entropy", "kl"), outs,
                                  oracle.token_stats(p.z(), ys, active, u=u)):
            assert_close(got.reshape(-1), exp, "float32", name)
        grads = [c.reshape(-1) for c in p.cot]
        dz, du = oracle.token_stats_vjp(p.z(), ys, active, grads, u=u)
        dz_err = oracle.saved_lse_slack(p.z(), ys, active, grads, u=u)
        assert_close(gh.reshape(1, -1), dz @ p.w, "float32", "d hidden",
                     slack=matmul_slack(dz, dz_err, p.w, "float32"))
        assert_close(gw, dz.T @ p.h.reshape(1, -1), "float32", "d weight",
                     slack=matmul_slack(dz.T, dz_err.T, np.abs(p.h.reshape(1, -1)), "float32"))
        scale = cancellation_scale(grads[3], p.z(), u)
        assert_close(gu, du, "float32", "d teacher logits", scale=scale)

    # -- objectives -----------------------------------------------------------------------
    def _batch(self, p):
        api, fw = self.fw.api, self.fw
        y = fw.array(p.y)
        return api.DiffusionTokenBatch.create(
            model_inputs={"input_tokens": y}, target_ids=y,
            loss_weights=fw.array(p.active.astype(np.float32)))

    def _check_head_grads(self, p, got, dz, dtype, layout, dz_size=None):
        """``dz_size``: the size each d(logits) element is rounded at (default |dz|; two
        schedules' terms, each rounded to the dtype on its own: the sum of their sizes)."""
        gh, gw, gb = got
        h = p.h.reshape(p.n, -1)
        dz = dz.reshape(p.n, -1)
        size = np.abs(dz) if dz_size is None else dz_size.reshape(p.n, -1)
        zero = np.zeros_like(dz)
        assert_close(gh.reshape(p.n, -1), dz @ p.w, dtype, "d hidden",
                     slack=matmul_slack(size, zero, p.w, dtype) + 2e-6)
        assert_close(gw, _from_kd(dz.T @ h, layout), dtype, "d weight",
                     slack=_from_kd(matmul_slack(size.T, zero.T, np.abs(h), dtype), layout)
                     + 2e-6)
        assert_close(gb, dz.sum(0), dtype, "d bias",
                     slack=matmul_slack(size.T, zero.T, np.ones((p.n, 1)), dtype)[:, 0] + 2e-6)

    def test_weighted_cross_entropy(self, rng, ce_dtype):
        """A scalar objective: the gradient formed in the forward (3 matmuls)."""
        dtype = ce_dtype
        fw, p = self.fw, HeadProblem(rng, rows=(3, 7), teacher=False)
        layout = fw.api.LinearHead.DEFAULT_LAYOUT  # torch "KD", JAX "DK": the default
        batch = self._batch(p)

        def fn(h, w, b):
            head = fw.api.LinearHead(h, w, b, row_chunk=8)
            return (fw.api.weighted_cross_entropy(head, batch, backend=self.BACKEND).compute(),)

        primals = (fw.array(p.h, dtype), _weight(fw, p.w, layout, dtype), fw.array(p.b, dtype))
        (value,), grads = fw.vjp(fn, primals, [1.0])
        active, ys = p.active.reshape(-1) != 0, p.y.reshape(-1)
        _, logp, _, _ = oracle.token_stats(p.z(), ys, active)
        wsum = active.sum()
        assert_close(value, -np.sum(np.where(active, logp, 0.0)) / wsum, "float32", "loss")
        zeros = np.zeros(p.n)
        dz, _ = oracle.token_stats_vjp(p.z(), ys, active, (zeros, -active.astype(float) / wsum, zeros, zeros))
        self._check_head_grads(p, grads, dz, dtype, layout)

    def test_jax_vmap_over_a_head(self, rng):
        """jax.vmap over the hidden states of a head (a per-example loss, the weight and
        bias shared): each mapped element's statistics (with a LOO shift) and weighted CE
        (the gradient formed in the forward), and its own gradients of hidden, weight and
        bias, equal the calls one element at a time. (The fused Pallas kernels met pallas_call's batching rule,
        which adds a grid axis they were not written for, and raised.)"""
        if self.FW != "jax" or not self.VMAP:
            pytest.skip("jax.vmap: JAX only" if self.FW != "jax" else "run by another class")
        import jax

        fw, api = self.fw, self.fw.api
        p = HeadProblem(rng, rows=(3, 4), d=6, k=29, teacher=False)
        hs = fw.array(dyadic(rng, (2,) + p.h.shape), "float32")  # 2 mapped elements
        y, act = fw.array(p.y), fw.array(p.active.astype(np.float32))
        x, d = fw.array(p.x), fw.array(p.d, "float32")
        cots = [fw.array(c, "float32") for c in p.cot]
        batch = self._batch(p)

        def loss(h, w, b):
            head = api.LinearHead(h, w, b, row_chunk=8)
            st = api.token_stats(head, y, act, shift_ids=x, shift=d, entropy=False,
                                 backend=self.BACKEND)
            ce = api.weighted_cross_entropy(head, batch, backend=self.BACKEND).compute()
            return (cots[0] * st.lse + cots[1] * st.logp).sum() + ce

        grad = jax.value_and_grad(loss, argnums=(0, 1, 2))
        w, b = _weight(fw, p.w, "DK", "float32"), fw.array(p.b, "float32")
        mapped = jax.jit(jax.vmap(grad, in_axes=(0, None, None)))(hs, w, b)
        one = jax.jit(grad)
        for e in range(2):
            value, grads = one(hs[e], w, b)
            for name, got, exp in zip(("loss", "d hidden", "d weight", "d bias"),
                                      (mapped[0],) + mapped[1], (value,) + grads):
                assert_close(fw.numpy(got[e]), fw.numpy(exp), "float32",
                             f"{name} of element {e}")

    def test_opd_loss_with_teacher_head(self, rng, opd_term):
        """Student and teacher heads of different widths; the total's gradient comes from the
        forward, an aux term's (differentiated on purpose) from the recompute path, and
        "both" differentiates their sum: the two schedules' gradients summed in float32 and
        rounded once to the head's dtype."""
        term, dtype = opd_term
        fw, p = self.fw, HeadProblem(rng, rows=(3, 7))
        api = fw.api
        teacher = api.LinearHead(fw.array(p.ht, "float32"), fw.array(p.wt, "float32"),
                                 weight_layout="KD")
        dbatch = api.DiffusionDistillationBatch.create(student_batch=self._batch(p),
                                                       teacher_logits=teacher)

        def fn(h, w, b):
            head = api.LinearHead(h, w, b, weight_layout="KD", row_chunk=8)
            total, aux = api.opd_loss(head, dbatch, temperature=2.0, soft_loss_weight=0.7,
                                      hard_loss_weight=0.4, backend=self.BACKEND)
            soft = aux["distill/soft_loss"].compute()
            return ({"total": total.compute(), "aux": soft}.get(term, total.compute() + soft),)

        primals = tuple(fw.array(a, dtype) for a in (p.h, p.w, p.b))
        (value,), grads = fw.vjp(fn, primals, [1.0])
        active, ys, u = p.active.reshape(-1) != 0, p.y.reshape(-1), p.u()
        wsum = active.sum()
        _, _, _, kl = oracle.token_stats(p.z(), ys, active, u=u, T=2.0)
        _, logp1, _, _ = oracle.token_stats(p.z(), ys, active)
        soft, hard = 4.0 * kl.sum() / wsum, -np.where(active, logp1, 0).sum() / wsum
        expected = {"total": 0.7 * soft + 0.4 * hard, "aux": soft}.get(
            term, 1.7 * soft + 0.4 * hard)
        assert_close(value, expected, "float32", term)
        zeros, act = np.zeros(p.n), active.astype(float)
        soft_dz = lambda g: oracle.token_stats_vjp(p.z(), ys, active,
                                                   (zeros, zeros, zeros, g * 4.0 * act / wsum),
                                                   u=u, T=2.0)[0]
        hard_dz = oracle.token_stats_vjp(p.z(), ys, active,
                                         (zeros, -0.4 * act / wsum, zeros, zeros))[0]
        total_dz, aux_dz = soft_dz(0.7) + hard_dz, soft_dz(1.0)
        parts = {"total": (total_dz,), "aux": (aux_dz,)}.get(term, (total_dz, aux_dz))
        self._check_head_grads(p, grads, sum(parts), dtype, "KD",
                               dz_size=sum(np.abs(d) for d in parts))

    def test_teacher_head_gets_no_gradient(self, rng):
        """opd_loss treats the teacher as a constant: its hidden and weight get exact zeros."""
        fw, p = self.fw, HeadProblem(rng, rows=(2, 5))
        api = fw.api
        student = api.LinearHead(fw.array(p.h, "float32"), fw.array(p.w, "float32"),
                                 weight_layout="KD")

        def fn(ht, wt):
            dbatch = api.DiffusionDistillationBatch.create(
                student_batch=self._batch(p),
                teacher_logits=api.LinearHead(ht, wt, weight_layout="KD"))
            total, _ = api.opd_loss(student, dbatch, backend=self.BACKEND)
            return (total.compute(),)

        _, (ght, gwt) = fw.vjp(fn, (fw.array(p.ht, "float32"), fw.array(p.wt, "float32")),
                               [1.0])
        assert np.all(ght == 0) and np.all(gwt == 0), "the teacher head got a gradient"

    def test_per_token_logps_and_sft_loss(self, rng):
        """Per-row and per-sequence outputs (the recompute schedule), through
        compute_diffusion_per_token_logps with a logits_fn that returns a head, and the LOO
        SFT loss with its per-position shift."""
        fw, p = self.fw, HeadProblem(rng, rows=(3, 7), teacher=False)
        api, batch = fw.api, self._batch(p)
        t = rng.uniform(0.1, 0.9, 3).astype(np.float32)
        xt = np.where(rng.uniform(size=(3, 7)) < 0.5, p.k - 1, p.y)
        mask = p.active.astype(np.float32)

        def fn(h, w, b):
            head_fn = lambda model, inputs: api.LinearHead(h, w, b, weight_layout="KD",
                                                           row_chunk=8)
            lp, ent = api.compute_diffusion_per_token_logps(
                None, batch, head_fn, temperature=0.8, stop_gradient=False,
                return_entropy=True, backend=self.BACKEND)
            sft = api.diffusion_sft_loss(head_fn(None, None), batch.target_ids, fw.array(xt),
                                         fw.array(t), fw.array(mask), variant="reweighted-loo-ce",
                                         vocab_size=p.k, backend=self.BACKEND)
            return lp, ent, sft

        cots = [rng.normal(size=(3, 7)), rng.normal(size=(3, 7)), rng.normal(size=3)]
        primals = tuple(fw.array(a, "float32") for a in (p.h, p.w, p.b))
        (lp, ent, sft), grads = fw.vjp(fn, primals, cots)
        active, ys = p.active.reshape(-1) != 0, p.y.reshape(-1)
        _, e_lp, e_ent, _ = oracle.token_stats(p.z(), ys, active, T=0.8)
        assert_close(lp.reshape(-1), e_lp, "float32", "logps")
        assert_close(ent.reshape(-1), e_ent, "float32", "entropy")
        z3 = p.z().reshape(3, 7, p.k)
        args = (z3, p.y, xt, t, mask, "reweighted-loo-ce", p.k)
        assert_close(sft, oracle.sft_loss(*args), "float32", "sft loss")
        zeros = np.zeros(p.n)
        dz, _ = oracle.token_stats_vjp(p.z(), ys, active, (zeros, cots[0].reshape(-1),
                                                           cots[1].reshape(-1), zeros), T=0.8)
        dz = dz + oracle.sft_loss_grad(*args, cots[2]).reshape(p.n, -1)
        self._check_head_grads(p, grads, dz, "float32", "KD")

    # -- contract -------------------------------------------------------------------------
    def test_bad_heads_name_the_part(self, rng):
        fw, p = self.fw, HeadProblem(rng, rows=(2, 3), d=8, k=16, teacher=False)
        api = fw.api
        y = fw.array(p.y)
        h, w = fw.array(p.h, "float32"), fw.array(p.w, "float32")  # w: [K, D] = [16, 8]
        with pytest.raises(ValueError, match=r"weight must have shape \[D, K\].*weight_layout='KD'"):
            api.token_stats(api.LinearHead(h, w, weight_layout="DK"), y, backend=self.BACKEND)
        with pytest.raises(TypeError, match=r"logits.weight must have logits.hidden's dtype"):
            api.token_stats(api.LinearHead(h, fw.array(p.w, "bfloat16"), weight_layout="KD"), y,
                            backend=self.BACKEND)
        with pytest.raises(ValueError, match=r"bias must have shape \[K\] = \[16\]"):
            api.token_stats(api.LinearHead(h, w, fw.array(np.zeros(15), "float32"),
                                           weight_layout="KD"), y, backend=self.BACKEND)
        with pytest.raises(ValueError, match=r"weight_layout must be one of"):
            api.LinearHead(h, w, weight_layout="kd")
        with pytest.raises(ValueError, match=r"targets must have shape"):
            api.token_stats(api.LinearHead(h, w, weight_layout="KD"), y[:1], backend=self.BACKEND)

