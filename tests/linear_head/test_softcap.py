"""The final-logit softcap of a linear head, ``LinearHead(hidden, weight, bias, softcap=c)``:
logits = c·tanh((hidden @ weight (+ bias)) / c) on every path that takes a head (token_stats,
every objective, per_token_logps with the entropy, the sampler and the upstream step, the
torch modules), both frameworks and every backend, against the float64 oracle of the capped
logits (``oracle.token_stats(..., softcap=c)``), gradients of hidden, weight and bias
included; and against the same functions given the capped logits as an array.

The inputs are the suite's dyadic ones (``suite.HeadProblem``: the logits z are exact in
every dtype), with c = 1/2 so that |z| reaches several times c and the cap saturates: the
uncapped model's statistics are far off (``test_the_cap_is_active``)."""

from __future__ import annotations

import os

import numpy as np
import pytest

import oracle
from harness import assert_close, cases, framework
from dlm_kernels.testing import CANCELLATION_ULP, TOLERANCES, cancellation_scale
from sampling.draw_oracle import oracle as sampling_oracle

from .suite import UNIT_ROUNDOFF, HeadProblem, _from_kd, _weight, dyadic, matmul_slack

CAP = 0.5
TEACHER_CAP = 0.75


def capped64(z, c=CAP):
    return c * np.tanh(z / c)


def slope64(z, c=CAP):
    return np.cosh(z / c) ** -2.0


def _interpreted():
    return os.environ.get("TRITON_INTERPRET") == "1"


class SoftcapSuite:
    """One framework and backend (``FW``, ``BACKEND``); the kernel backends' classes run
    fewer cases (each of their tests costs seconds in an interpreter)."""

    FW = None
    BACKEND = None
    dtype = cases("float32", "bfloat16")
    #: whether the step's statistics equal token_stats' bit for bit: torch's framework-native
    #: backends cap with the very function, op by op, that the sampler's chunks use (XLA
    #: fuses the cap into different programs in the two calls: an ulp apart at times)
    NATIVE = False
    #: whether the sampler's tests run (a class of another gradient schedule: no)
    SAMPLER = True

    @property
    def fw(self):
        return framework(self.FW)

    @property
    def layout(self):
        return self.fw.api.LinearHead.DEFAULT_LAYOUT

    def problem(self, rng, **kw):
        p = HeadProblem(rng, **kw)
        assert np.abs(p.z()).max() >= 3 * CAP, "the cap would not be active"
        return p

    def batch(self, p):
        fw = self.fw
        y = fw.array(p.y)
        return fw.api.DiffusionTokenBatch.create(
            model_inputs={"input_tokens": y}, target_ids=y,
            loss_weights=fw.array(p.active.astype(np.float32)))

    def check_head_grads(self, p, grads, dz, dz_err, dtype, layout, extra=0.0):
        gh, gw, gb = grads
        h = p.h.reshape(p.n, -1)
        assert_close(gh.reshape(p.n, -1), dz @ p.w, dtype, "d hidden",
                     slack=matmul_slack(dz, dz_err, p.w, dtype) + extra)
        assert_close(gw, _from_kd(dz.T @ h, layout), dtype, "d weight",
                     slack=_from_kd(matmul_slack(dz.T, dz_err.T, np.abs(h), dtype), layout)
                     + extra)
        assert_close(gb, dz.sum(0), dtype, "d bias",
                     slack=matmul_slack(dz.T, dz_err.T, np.ones((p.n, 1)), dtype)[:, 0] + extra)

    # -- token_stats ----------------------------------------------------------------------
    def test_token_stats_from_a_capped_head(self, rng, dtype):
        """Every statistic with a LOO shift and two temperatures, and the gradients of
        hidden, weight and bias, from a capped head (token chunks of 8 over 21 rows: a ragged
        last one) against the oracle; a call's ``softcap=`` on the uncapped head is the same
        computation (bit for bit), and so is an equal ``softcap=`` beside the head's."""
        fw, p, layout = self.fw, self.problem(rng, rows=(3, 7), teacher=False), self.layout
        arr = fw.array
        y, act, x, d = arr(p.y), arr(p.active.astype(np.float32)), arr(p.x), arr(p.d, "float32")
        kw = dict(shift_ids=x, shift=d, temperature=0.7, ce_temperature=1.3,
                  backend=self.BACKEND)

        def run(head_cap, call_cap):
            def fn(h, w, b):
                head = fw.api.LinearHead(h, w, b, head_cap, weight_layout=layout, row_chunk=8)
                extra = {} if call_cap is None else {"softcap": call_cap}
                s = fw.api.token_stats(head, y, act, **kw, **extra)
                return s.lse, s.logp, s.entropy, s.kl

            primals = (arr(p.h, dtype), _weight(fw, p.w, layout, dtype), arr(p.b, dtype))
            return fw.vjp(fn, primals, p.cot)

        outs, grads = run(CAP, None)
        okw = dict(x=p.x.reshape(-1), d=p.d.reshape(-1), T=0.7, T_ce=1.3, softcap=CAP)
        active, ys = p.active.reshape(-1) != 0, p.y.reshape(-1)
        for name, got, exp in zip(("lse", "logp", "entropy", "kl"), outs,
                                  oracle.token_stats(p.z(), ys, active, **okw)):
            assert_close(got.reshape(-1), exp, "float32", name)
        cots = [c.reshape(-1) for c in p.cot]
        dz, _ = oracle.token_stats_vjp(p.z(), ys, active, cots, **okw)
        dz_err = oracle.saved_lse_slack(p.z(), ys, active, cots, **okw)
        self.check_head_grads(p, grads, dz, dz_err, dtype, layout)
        for head_cap, call_cap in ((None, CAP), (CAP, CAP)):
            outs2, grads2 = run(head_cap, call_cap)
            for name, a, b in zip(("lse", "logp", "entropy", "kl", "d hidden", "d weight",
                                   "d bias"), outs + grads, outs2 + grads2):
                assert np.array_equal(a, b, equal_nan=True), (
                    f"{name}: head softcap {head_cap}, call softcap {call_cap} differ")

    def test_the_cap_is_active(self, rng):
        """The capped head's statistics are the capped model's, not the uncapped one's (the
        old code, which took no softcap, computed the latter)."""
        fw, p = self.fw, self.problem(rng, rows=(3, 7), teacher=False)
        head = fw.api.LinearHead(fw.array(p.h, "float32"),
                                 _weight(fw, p.w, self.layout, "float32"),
                                 fw.array(p.b, "float32"), softcap=CAP)
        got = fw.numpy(fw.api.token_stats(head, fw.array(p.y), backend=self.BACKEND).logp)
        active, ys = np.ones(p.n, bool), p.y.reshape(-1)
        capped = oracle.token_stats(p.z(), ys, active, softcap=CAP)[1]
        plain = oracle.token_stats(p.z(), ys, active)[1]
        assert_close(got.reshape(-1), capped, "float32", "logp")
        # the draws make the cap move some logp by 0.03 to over 1 (far above the float32
        # tolerance): the check above tells the capped model from the uncapped one
        assert np.abs(capped - plain).max() > 0.01, "the cap changes nothing at these logits"

    def test_head_equals_its_capped_logits(self, rng):
        """A capped float32 head and its capped logits given as an array (c·tanh(z / c)
        rounded to float32) to the same functions: the statistics of
        token_stats and the objectives agree within the float32 tolerance."""
        fw, p = self.fw, self.problem(rng, rows=(3, 7), teacher=False)
        api = fw.api
        zc = fw.array(capped64(p.z()).reshape(3, 7, -1), "float32")
        head = api.LinearHead(fw.array(p.h, "float32"), _weight(fw, p.w, self.layout, "float32"),
                              fw.array(p.b, "float32"), softcap=CAP, row_chunk=8)
        batch = self.batch(p)
        for name, call in (
                ("token_stats", lambda z: api.token_stats(z, batch.target_ids, temperature=0.6,
                                                          backend=self.BACKEND)),
                ("per_token_logps", lambda z: api.per_token_logps(
                    z, batch, return_entropy=True, backend=self.BACKEND)),
                ("weighted_cross_entropy", lambda z: (api.weighted_cross_entropy(
                    z, batch, backend=self.BACKEND).compute(),))):
            for i, (a, b) in enumerate(zip(call(head), call(zc))):
                if a is not None:
                    assert_close(fw.numpy(a), fw.numpy(b), "float32", f"{name}[{i}]")

    # -- objectives -----------------------------------------------------------------------
    def test_objectives_from_a_capped_head(self, rng, dtype):
        """weighted_cross_entropy (its gradient formed in the forward), per_token_logps with
        the entropy and the LOO-reweighted SFT loss (recomputed in the backward) in one
        differentiated sum: values and d hidden, d weight, d bias against the oracle."""
        fw, p = self.fw, self.problem(rng, rows=(3, 7), teacher=False)
        api, layout, batch = fw.api, self.layout, self.batch(p)
        t = rng.uniform(0.1, 0.9, 3).astype(np.float32)
        xt = np.where(rng.uniform(size=(3, 7)) < 0.5, p.k - 1, p.y)
        mask = p.active.astype(np.float32)

        def fn(h, w, b):
            head = api.LinearHead(h, w, b, softcap=CAP, weight_layout=layout, row_chunk=8)
            ce = api.weighted_cross_entropy(head, batch, backend=self.BACKEND).compute()
            lp, ent = api.per_token_logps(head, batch, temperature=0.8, stop_gradient=False,
                                          return_entropy=True, backend=self.BACKEND)
            sft = api.diffusion_sft_loss(head, batch.target_ids, fw.array(xt), fw.array(t),
                                         fw.array(mask), variant="reweighted-loo-ce",
                                         vocab_size=p.k, backend=self.BACKEND)
            return ce, lp, ent, sft

        cots = [np.array(1.0), rng.normal(size=(3, 7)), rng.normal(size=(3, 7)),
                rng.normal(size=3)]
        primals = (fw.array(p.h, dtype), _weight(fw, p.w, layout, dtype), fw.array(p.b, dtype))
        (ce, lp, ent, sft), grads = fw.vjp(fn, primals, cots)
        active, ys, z = p.active.reshape(-1) != 0, p.y.reshape(-1), p.z()
        act = active.astype(float)
        _, logp1, _, _ = oracle.token_stats(z, ys, active, softcap=CAP)
        assert_close(ce, -np.sum(np.where(active, logp1, 0.0)) / act.sum(), "float32", "CE")
        _, e_lp, e_ent, _ = oracle.token_stats(z, ys, active, T=0.8, softcap=CAP)
        assert_close(lp.reshape(-1), e_lp, "float32", "logps")
        assert_close(ent.reshape(-1), e_ent, "float32", "entropy")
        args = (z.reshape(3, 7, p.k), p.y, xt, t, mask, "reweighted-loo-ce", p.k)
        assert_close(sft, oracle.sft_loss(*args, softcap=CAP), "float32", "sft loss")
        zeros = np.zeros(p.n)
        parts = [
            oracle.token_stats_vjp(z, ys, active, (zeros, -act / act.sum(), zeros, zeros),
                                   softcap=CAP)[0],
            oracle.token_stats_vjp(z, ys, active, (zeros, cots[1].reshape(-1),
                                                   cots[2].reshape(-1), zeros),
                                   T=0.8, softcap=CAP)[0],
            oracle.sft_loss_grad(*args, cots[3], softcap=CAP).reshape(p.n, -1)]
        # each call's d(logits) rounded on its own (the sum of their sizes), and each call's
        # dH, dW, db rounded to the dtype before autodiff sums the three calls' (u times the
        # size of each call's own gradient: they may cancel in the sum)
        size = sum(np.abs(d) for d in parts)
        dz = sum(parts)
        gh, gw, gb = grads
        h = p.h.reshape(p.n, -1)
        zero = np.zeros_like(dz)
        u = UNIT_ROUNDOFF[dtype]
        each = lambda f: u * sum(np.abs(f(d)) for d in parts)
        assert_close(gh.reshape(p.n, -1), dz @ p.w, dtype, "d hidden",
                     slack=matmul_slack(size, zero, p.w, dtype) + each(lambda d: d @ p.w)
                     + 2e-6)
        assert_close(gw, _from_kd(dz.T @ h, layout), dtype, "d weight",
                     slack=_from_kd(matmul_slack(size.T, zero.T, np.abs(h), dtype)
                                    + each(lambda d: d.T @ h), layout) + 2e-6)
        assert_close(gb, dz.sum(0), dtype, "d bias",
                     slack=matmul_slack(size.T, zero.T, np.ones((p.n, 1)), dtype)[:, 0]
                     + each(lambda d: d.sum(0)) + 2e-6)

    def test_opd_loss_capped_student_and_teacher(self, rng):
        """opd_loss from a capped student head and a teacher head with its own cap: the
        total against the oracle of both capped logits, the student's gradients, and exact
        zeros for the teacher (a constant)."""
        fw, p = self.fw, self.problem(rng, rows=(3, 7))
        api = fw.api

        def fn(h, w, b, ht, wt):
            teacher = api.LinearHead(ht, wt, softcap=TEACHER_CAP, weight_layout="KD")
            dbatch = api.DiffusionDistillationBatch.create(student_batch=self.batch(p),
                                                           teacher_logits=teacher)
            head = api.LinearHead(h, w, b, softcap=CAP, weight_layout="KD", row_chunk=8)
            total, _ = api.opd_loss(head, dbatch, temperature=2.0, soft_loss_weight=0.7,
                                    hard_loss_weight=0.4, backend=self.BACKEND)
            return (total.compute(),)

        primals = tuple(fw.array(a, "float32") for a in (p.h, p.w, p.b, p.ht, p.wt))
        (value,), (gh, gw, gb, ght, gwt) = fw.vjp(fn, primals, [1.0])
        active, ys, z = p.active.reshape(-1) != 0, p.y.reshape(-1), p.z()
        u = capped64(p.u(), TEACHER_CAP)
        wsum, act, zeros = active.sum(), active.astype(float), np.zeros(p.n)
        kl = oracle.token_stats(z, ys, active, u=u, T=2.0, softcap=CAP)[3]
        logp1 = oracle.token_stats(z, ys, active, softcap=CAP)[1]
        expected = 0.7 * 4.0 * kl.sum() / wsum - 0.4 * np.where(active, logp1, 0).sum() / wsum
        assert_close(value, expected, "float32", "opd total")
        dz = (oracle.token_stats_vjp(z, ys, active, (zeros, zeros, zeros, 2.8 * act / wsum),
                                     u=u, T=2.0, softcap=CAP)[0]
              + oracle.token_stats_vjp(z, ys, active, (zeros, -0.4 * act / wsum, zeros, zeros),
                                       softcap=CAP)[0])
        self.check_head_grads(p, (gh, gw, gb), dz, np.zeros_like(dz), "float32", "KD",
                              extra=2e-6)
        assert np.all(ght == 0) and np.all(gwt == 0), "the teacher head got a gradient"

    def test_teacher_head_gradient_through_its_cap(self, rng):
        """token_stats(teacher_grad=True) with a capped teacher head: the KL against the
        oracle of the capped teacher, and the teacher's d hidden and d weight carry cap'."""
        fw, p = self.fw, self.problem(rng, rows=(3, 5))
        api = fw.api
        z = p.z()
        y, act = fw.array(p.y), fw.array(p.active.astype(np.float32))

        def fn(ht, wt):
            teacher = api.LinearHead(ht, wt, softcap=CAP, weight_layout="KD", row_chunk=4)
            s = api.token_stats(fw.array(z.reshape(3, 5, -1), "float32"), y, act,
                                teacher_logits=teacher, teacher_grad=True, temperature=1.5,
                                backend=self.BACKEND)
            return (s.kl,)

        (kl,), (ght, gwt) = fw.vjp(fn, (fw.array(p.ht, "float32"), fw.array(p.wt, "float32")),
                                   [p.cot[3]])
        active, ys, u_raw = p.active.reshape(-1) != 0, p.y.reshape(-1), p.u()
        u = capped64(u_raw)
        assert_close(kl.reshape(-1), oracle.token_stats(z, ys, active, u=u, T=1.5)[3],
                     "float32", "kl")
        zeros = np.zeros(p.n)
        _, du = oracle.token_stats_vjp(z, ys, active, (zeros, zeros, zeros,
                                                       p.cot[3].reshape(-1)), u=u, T=1.5)
        du = du * slope64(u_raw)  # through the teacher's cap
        ht = p.ht.reshape(p.n, -1)
        # d(capped teacher) is a difference of terms of size |t - s| (the float32 floor
        # scaled as in the suite's teacher-head test), then times cap' <= 1
        scale = cancellation_scale(p.cot[3].reshape(-1), z / 1.5, u / 1.5, temperature=1.5)
        err = np.full(du.shape, TOLERANCES["float32"][0] + CANCELLATION_ULP * scale)
        assert_close(ght.reshape(p.n, -1), du @ p.wt, "float32", "d teacher hidden",
                     slack=matmul_slack(du, err, p.wt, "float32"))
        assert_close(gwt, du.T @ ht, "float32", "d teacher weight",
                     slack=matmul_slack(du.T, err.T, np.abs(ht), "float32"))

    # -- the sampler ----------------------------------------------------------------------
    def _sampler_problem(self, rng, dtype):
        fw = self.fw
        h = dyadic(rng, (3, 7, 19))
        w = dyadic(rng, (301, 19))  # [K, D]
        z = (h @ w.T).reshape(21, -1)
        assert np.abs(z).max() >= 3 * CAP
        wl = _weight(fw, w, self.layout, dtype)
        head = fw.api.LinearHead(fw.array(h, dtype), wl, softcap=CAP, row_chunk=4)
        # the capped logits as every backend's kernels see them: float32 c·tanh(z / c) of
        # the exact z, by the package's softcap (its documented float32 formula)
        from dlm_kernels.token_stats import formulas

        zc32 = fw.numpy(formulas.softcap(_xp(self.FW), fw.array(z, "float32"), CAP))
        return h, w, z, head, zc32

    @pytest.mark.parametrize("temperature,top_k", [(0.7, None), (0.0, None), (1.3, 5)])
    def test_sample_tokens_from_a_capped_head(self, rng, temperature, top_k):
        """sample_tokens(capped head) draws exactly what sample_tokens(its float32 capped
        logits) draws, every field bit for bit (token chunks of 4 rows, vocabulary chunks of
        64); the tokens and statistics are the sampling oracle's of those logits, the drawn
        token's logp and the entropy the float64 token-statistics oracle's of the capped
        model; and per_token_logps of the same head at the drawn tokens gives the same logp
        and entropy (rollout = trainer: bit for bit on the framework-native backends)."""
        if not self.SAMPLER:
            pytest.skip("the sampler has no gradient pass")
        fw = self.fw
        api = fw.api
        h, w, z, head, zc32 = self._sampler_problem(rng, "float32")
        kw = dict(temperature=temperature, seed=int(rng.integers(0, 2**31)), step=3,
                  top_k=top_k, chunk_size=64, backend=self.BACKEND)
        got = api.sample_tokens(head, **kw)
        want = api.sample_tokens(fw.array(zc32.reshape(3, 7, -1), "float32"), **kw)
        for name, g, e in zip(got._fields, got, want):
            assert np.array_equal(fw.numpy(g), fw.numpy(e), equal_nan=True), (
                f"{name} differs from the capped logits'")
        got_np = [np.asarray(fw.numpy(x)).reshape(-1) for x in got]
        ref = sampling_oracle(zc32, temperature=temperature, seed=kw["seed"], step=3,
                              top_k=top_k)
        for name, g, e in zip(("token", "logp", "argmax", "top1", "top2", "entropy"), got_np,
                              ref):
            if name in ("token", "argmax"):
                bad = np.flatnonzero(g != e)
                assert bad.size == 0, f"{name}: first bad row {bad[:1]}"
            else:
                assert_close(g, e, "float32", name)
        if top_k is not None:
            return
        t = temperature or 1.0
        token = got_np[0]
        _, logp, ent, _ = oracle.token_stats(z, token, np.ones(21, bool), T=t, softcap=CAP)
        assert_close(got_np[1], logp, "float32", "logp (capped model)")
        assert_close(got_np[5], ent, "float32", "entropy (capped model)")
        # the token statistics of the same head at the drawn tokens, with the step's
        # vocabulary chunk (the reduction order the rollout = trainer contract names)
        st = api.token_stats(head, fw.array(token.reshape(3, 7)), temperature=t,
                             chunk_size=64, backend=self.BACKEND)
        for name, a, b in (("logp", st.logp, got.logp), ("entropy", st.entropy, got.entropy)):
            a, b = fw.numpy(a), fw.numpy(b)
            if self.NATIVE:
                assert np.array_equal(a, b), f"per_token_logps {name} != the step's"
            else:
                assert_close(a, b, "float32", f"per_token_logps {name}")

    def test_upstream_step_from_a_capped_head(self, rng):
        """get_transfer_index (low confidence, negative entropy) and add_gumbel_noise at
        temperature 0 from a capped head: exactly as from its capped logits."""
        if not self.SAMPLER:
            pytest.skip("the sampler has no gradient pass")
        fw = self.fw
        api = fw.api
        h, w, z, head, zc32 = self._sampler_problem(rng, "float32")
        zc = fw.array(zc32.reshape(3, 7, -1), "float32")
        x = fw.array(np.where(rng.uniform(size=(3, 7)) < 0.6, 300, 5).astype(np.int64))
        mask = fw.array(np.asarray(fw.numpy(x)) == 300)
        for neg_entropy in (False, True):
            kw = dict(temperature=0.8, remasking="low_confidence", mask_index=mask, x=x,
                      num_transfer_tokens=2, neg_entropy=neg_entropy, seed=11, step=1,
                      backend=self.BACKEND)
            for a, b in zip(api.get_transfer_index(head, **kw), api.get_transfer_index(zc, **kw)):
                assert np.array_equal(fw.numpy(a), fw.numpy(b)), f"neg_entropy={neg_entropy}"
        dense = fw.numpy(api.add_gumbel_noise(head, 0.0))
        assert np.array_equal(dense, zc32.reshape(3, 7, -1)), "add_gumbel_noise(head, 0)"

    # -- the contract ---------------------------------------------------------------------
    def test_softcap_is_checked_and_two_caps_must_agree(self, rng):
        """LinearHead's softcap: a positive finite number (the error names softcap and the
        value); a call's softcap beside a head's differing one is an error naming both."""
        fw, p = self.fw, self.problem(rng, rows=(2, 3), teacher=False)
        api = fw.api
        h, w = fw.array(p.h, "float32"), _weight(fw, p.w, self.layout, "float32")
        for bad in (0.0, -1.0, float("inf"), float("nan")):
            with pytest.raises(ValueError, match=rf"softcap must be a finite positive real "
                                                 rf"scalar; got {bad}"):
                api.LinearHead(h, w, softcap=bad)
        for bad in ("30", True):
            with pytest.raises(ValueError, match=r"softcap must be a finite positive real"):
                api.LinearHead(h, w, None, bad)
        head = api.LinearHead(h, w, None, np.float32(CAP))
        assert head.softcap == CAP and isinstance(head.softcap, float)
        assert "softcap 0.5" in repr(head)
        with pytest.raises(ValueError, match=r"softcap=0\.7 was given for logits that are a "
                                             r"LinearHead with softcap=0\.5"):
            api.token_stats(head, fw.array(p.y), softcap=0.7, backend=self.BACKEND)
        batch = self.batch(p)
        with pytest.raises(ValueError, match=r"softcap=0\.7 .* softcap=0\.5"):
            api.token_stats(head, batch.target_ids, softcap=0.7)


def _xp(name):
    if name == "torch":
        from dlm_kernels._torch.ops import TorchOps

        return TorchOps
    from dlm_kernels._jax.ops import JaxOps

    return JaxOps


class TestTorchReference(SoftcapSuite):
    FW, BACKEND, NATIVE = "torch", "reference", True
    dtype = cases("float32")


class TestTorchChunked(SoftcapSuite):
    FW, BACKEND, NATIVE = "torch", "chunked", True


class TestTorchChunkedVocabBlocks(SoftcapSuite):
    """The gradient pass over vocabulary blocks (a bfloat16 weight whose float32 dW would
    pass HEAD_DW_ACC_BYTES, forced by a budget of 128 weight rows): the cap in each block."""

    FW, BACKEND, NATIVE, SAMPLER = "torch", "chunked", True, False
    dtype = cases("bfloat16")

    @pytest.fixture(autouse=True)
    def _small_budget(self, monkeypatch):
        from dlm_kernels.linear_head import head as _linear_head

        monkeypatch.setattr(_linear_head, "HEAD_DW_ACC_BYTES", 128 * 19 * 4)


@pytest.mark.skipif(not _interpreted(), reason="the Triton kernels run on CPU only under "
                    "TRITON_INTERPRET=1")
class TestTorchTriton(SoftcapSuite):
    FW, BACKEND = "torch", "triton"
    dtype = cases("bfloat16")


class TestJaxReference(SoftcapSuite):
    FW, BACKEND = "jax", "reference"
    dtype = cases("bfloat16")


class TestJaxChunked(SoftcapSuite):
    FW, BACKEND = "jax", "chunked"


@pytest.mark.skipif(not _interpreted(), reason="the Triton kernels run on CPU only under "
                    "TRITON_INTERPRET=1")
@pytest.mark.usefixtures("jax_triton_on_cpu")
class TestJaxTritonEmulated(SoftcapSuite):
    FW, BACKEND = "jax", "triton"
    dtype = cases("bfloat16")


class TestJaxPallas(SoftcapSuite):
    """The fused Mosaic head kernels (interpret mode) take a capped student head (the cap
    among their statics); a capped teacher head goes through the token-chunked path."""

    FW, BACKEND = "jax", "pallas"
    dtype = cases("float32", "bfloat16")


# -- transformations ------------------------------------------------------------------------

def test_jax_vmap_and_jit_over_a_capped_head(rng):
    """jax.vmap (and jit) over the hidden states of a capped head, the weight shared: each
    mapped element's statistics, CE and gradients equal the call on that element alone,
    and the oracle's."""
    import jax

    fw = framework("jax")
    api = fw.api
    p = HeadProblem(rng, rows=(3, 4), d=6, k=29, teacher=False)
    hs = dyadic(rng, (2,) + p.h.shape)
    y, act = fw.array(p.y), fw.array(p.active.astype(np.float32))
    batch = api.DiffusionTokenBatch.create(model_inputs=y, target_ids=y, loss_weights=act)

    def loss(h, w, b):
        head = api.LinearHead(h, w, b, CAP, row_chunk=8)
        st = api.token_stats(head, y, act, entropy=False, backend="chunked")
        return (st.logp * 0.3).sum() + api.weighted_cross_entropy(head, batch).compute()

    grad = jax.value_and_grad(loss, argnums=(0, 1, 2))
    w, b = _weight(fw, p.w, "DK", "float32"), fw.array(p.b, "float32")
    mapped = jax.jit(jax.vmap(grad, in_axes=(0, None, None)))(fw.array(hs, "float32"), w, b)
    active, ys = p.active.reshape(-1) != 0, p.y.reshape(-1)
    for e in range(2):
        value, grads = jax.jit(grad)(fw.array(hs[e], "float32"), w, b)
        for name, got, exp in zip(("loss", "d hidden", "d weight", "d bias"),
                                  (mapped[0],) + mapped[1], (value,) + grads):
            assert_close(fw.numpy(got[e]), fw.numpy(exp), "float32", f"{name} of element {e}")
        z = hs[e].reshape(p.n, -1) @ p.w.T + p.b
        logp = oracle.token_stats(z, ys, active, softcap=CAP)[1]
        want = 0.3 * logp.sum() - logp.sum() / active.sum()
        assert_close(fw.numpy(mapped[0][e]), want, "float32", f"loss of element {e} (oracle)")


def test_torch_compile_of_a_capped_head(rng):
    """torch.compile(fullgraph=True) of an objective from a capped head: the value and the
    gradients of the eager call."""
    import torch

    fw = framework("torch")
    api = fw.api
    p = HeadProblem(rng, rows=(2, 5), d=8, k=37, teacher=False)
    y = fw.array(p.y)
    batch = api.DiffusionTokenBatch.create(model_inputs=y, target_ids=y,
                                           loss_weights=fw.array(p.active.astype(np.float32)))

    def loss(h, w, b):
        head = api.LinearHead(h, w, b, softcap=CAP, row_chunk=4)
        lp = api.per_token_logps(head, batch, stop_gradient=False, backend="chunked")
        return api.weighted_cross_entropy(head, batch, backend="chunked").compute() + lp.sum()

    torch._dynamo.reset()
    compiled = torch.compile(loss, fullgraph=True, backend="aot_eager")
    leaves = lambda: [fw.array(a, "float32").requires_grad_(True) for a in (p.h, p.w, p.b)]
    a, b = leaves(), leaves()
    v1, v2 = loss(*a), compiled(*b)
    g1, g2 = torch.autograd.grad(v1, a), torch.autograd.grad(v2, b)
    assert_close(fw.numpy(v2), fw.numpy(v1), "float32", "compiled value")
    for name, x, x2 in zip(("hidden", "weight", "bias"), g1, g2):
        assert_close(fw.numpy(x2), fw.numpy(x), "float32", f"compiled d {name}")


# -- the torch modules ----------------------------------------------------------------------

def test_torch_fused_modules_take_a_softcap(rng):
    """FusedLinearDiffusionSFTLoss / OPDLoss / PolicyLoss(softcap=c): the functional call on
    LinearHead(..., softcap=c), bit for bit (values and gradients), the SFT loss against the
    oracle; DiffusionSFTLoss given a capped head; a bad softcap rejected at construction."""
    import torch

    import dlm_kernels.torch.nn as dn

    fw = framework("torch")
    api = fw.api
    p = HeadProblem(rng, rows=(3, 7))
    t = rng.uniform(0.1, 0.9, 3).astype(np.float32)
    xt = np.where(rng.uniform(size=(3, 7)) < 0.5, p.k - 1, p.y)
    mask = p.active.astype(np.float32)
    y, batch = fw.array(p.y), None
    batch = api.DiffusionTokenBatch.create(model_inputs=y, target_ids=y,
                                           loss_weights=fw.array(mask))
    teacher = api.LinearHead(fw.array(p.ht, "float32"), fw.array(p.wt, "float32"),
                             softcap=TEACHER_CAP)
    dbatch = api.DiffusionDistillationBatch.create(student_batch=batch, teacher_logits=teacher)
    old = fw.array(np.where(p.active != 0, -3.0, -np.inf).astype(np.float32))
    adv = fw.array(np.array([0.5, -1.0, 2.0], np.float32))
    sft_args = (y, fw.array(xt), fw.array(t), fw.array(mask))
    sft_kw = dict(variant="reweighted-loo-ce", vocab_size=p.k)
    cases_ = [
        (dn.FusedLinearDiffusionSFTLoss(**sft_kw, softcap=CAP, row_chunk=8),
         lambda m, h, w, b: m(h, w, *sft_args, bias=b),
         lambda head: api.diffusion_sft_loss(head, *sft_args, **sft_kw).mean()),
        (dn.FusedLinearOPDLoss(temperature=2.0, hard_loss_weight=0.3, softcap=CAP, row_chunk=8),
         lambda m, h, w, b: m(h, w, dbatch, bias=b),
         lambda head: api.opd_loss(head, dbatch, temperature=2.0,
                                   hard_loss_weight=0.3)[0].compute()),
        (dn.FusedLinearPolicyLoss(loss_type="dapo", beta=0.0, softcap=CAP, row_chunk=8),
         lambda m, h, w, b: m(h, w, batch, old_logps=old, advantages=adv, bias=b).loss,
         lambda head: api.policy_loss(head, batch, old_logps=old, advantages=adv,
                                      loss_type="dapo").loss),
    ]
    for module, call, functional in cases_:
        assert f"softcap={CAP}" in repr(module), repr(module)
        a = [fw.array(x, "float32").requires_grad_(True) for x in (p.h, p.w, p.b)]
        b = [fw.array(x, "float32").requires_grad_(True) for x in (p.h, p.w, p.b)]
        v1 = call(module, *a)
        v2 = functional(api.LinearHead(*b, softcap=CAP, row_chunk=8))
        g1, g2 = torch.autograd.grad(v1, a), torch.autograd.grad(v2, b)
        name = type(module).__name__
        assert torch.equal(v1, v2), f"{name}: {v1} vs {v2}"
        for part, x1, x2 in zip(("hidden", "weight", "bias"), g1, g2):
            assert torch.equal(x1, x2), f"{name}: d {part} differs"
    z3 = (p.z()).reshape(3, 7, p.k)
    want = oracle.sft_loss(z3, p.y, xt, t, mask, "reweighted-loo-ce", p.k, softcap=CAP).mean()
    head = api.LinearHead(*(fw.array(x, "float32") for x in (p.h, p.w, p.b)), softcap=CAP)
    got = dn.DiffusionSFTLoss(**sft_kw)(head, *sft_args)
    assert_close(fw.numpy(got), want, "float32", "DiffusionSFTLoss of a capped head")
    with pytest.raises(ValueError, match=r"softcap must be a finite positive real scalar; "
                                         r"got -1"):
        dn.FusedLinearDiffusionSFTLoss(**sft_kw, softcap=-1.0)


def test_torch_cap_outside_autograd_by_column_blocks(rng):
    """Outside autograd (a sampler's or a teacher's token chunk of the whole vocabulary) the
    torch cap is formed SOFTCAP_COLUMNS at a time into one output: the bits of the formula
    over the whole chunk (a ragged last block, finite and infinite logits, both signs), and
    no float32 temporary of the chunk's size but the output. Over the whole chunk its dozen
    temporaries held 512 MiB of DiffusionGemma's denoising step ([64, 262144] float32 each);
    the sampler from a capped head made 27 of them per token chunk. With autograd, the
    formula as it is (its graph)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from dlm_kernels._torch.ops import SOFTCAP_COLUMNS, TorchOps
    from dlm_kernels.token_stats import formulas

    rows, k = 8, 3 * SOFTCAP_COLUMNS + 5
    z = torch.tensor(rng.normal(size=(rows, k)) * 40, dtype=torch.float32)
    z[0, :3] = torch.tensor([float("inf"), -float("inf"), 0.0])

    class ChunkSized(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if isinstance(out, torch.Tensor) and out.dtype == torch.float32 \
                    and out.numel() >= rows * k:
                self.ops.append(str(func))
            return out

    with ChunkSized() as seen:
        got = TorchOps.softcap(z, CAP)
    assert seen.ops == ["aten.empty_like.default"], seen.ops
    want = formulas.softcap(TorchOps, z, CAP)
    bad = np.flatnonzero((got != want).numpy() & ~(got.isnan() & want.isnan()).numpy())
    assert bad.size == 0, f"first element off the whole chunk's formula: {bad[:1]}"
    zg = z.clone().requires_grad_(True)
    with ChunkSized() as seen:
        TorchOps.softcap(zg, CAP)
    assert len(seen.ops) > 1  # the formula's graph over the whole chunk
