"""Every public objective x framework x backend against the float64 oracle, gradients too:
the shared suites and ``sft_inputs``; the classes that run them are in this folder's
test_<backend>.py files."""

from __future__ import annotations

import numpy as np
import pytest

import oracle
from dlm_kernels.testing import CANCELLATION_ULP
from harness import DTYPES, assert_close, assert_exact_zero, cases, framework

ALL_VARIANTS = ("base-sft", "reweighted-ce", "loo-ce", "reweighted-loo-ce", "loo-reweighted-ce")


def sft_inputs(rng, b=3, l=5, k=37, t=None, empty_row=True):
    logits = rng.normal(size=(b, l, k)) * 3
    x0 = rng.integers(0, k, (b, l))
    xt = np.where(rng.uniform(size=(b, l)) < 0.5, k - 1, x0)  # masked positions hold id K-1
    t = rng.uniform(0.05, 0.95, b) if t is None else np.asarray(t, np.float64)
    mask = (rng.uniform(size=(b, l)) < 0.7).astype(np.float32)
    mask[0, 0] = 1.0
    if empty_row and b > 1:
        mask[-1] = 0.0
    return logits, x0, xt, t.astype(np.float32), mask


class ObjectivesSuite:
    FW = None
    BACKEND = None
    #: (variant, dtype) of test_sft_loss_and_grad; (soft, hard weights, dtype) of
    #: test_opd_loss
    sft_case = cases(*((v, d) for v in ALL_VARIANTS for d in DTYPES))
    opd_case = cases(*((soft, hard, d) for soft, hard in ((1.0, 0.0), (0.0, 1.0), (0.7, 0.4))
                       for d in DTYPES))

    @property
    def fw(self):
        return framework(self.FW)

    def sft(self, fn_name, arrays, dtype, **kw):
        fw = self.fw
        logits, x0, xt, t, mask = arrays
        z = fw.array(logits, dtype)
        fn = getattr(fw.api, fn_name)
        return fw, z, lambda z_: (fn(z_, fw.array(x0), fw.array(xt), fw.array(t), fw.array(mask),
                                     backend=self.BACKEND, **kw),)

    # -- Megatron SFT ------------------------------------------------------------------

    def test_sft_loss_and_grad(self, rng, sft_case):
        variant, dtype = sft_case
        arrays = sft_inputs(rng)
        clip = 3.0 if variant.startswith("re") else None
        fw, z, fn = self.sft("diffusion_sft_loss", arrays, dtype, variant=variant, vocab_size=37,
                             diffusion_weight_clip=clip)
        cot = rng.normal(size=3).astype(np.float32)
        (loss,), (grad,) = fw.vjp(fn, [z], [cot])
        z64 = fw.numpy(z)
        _, x0, xt, t, mask = arrays
        t64 = t.astype(np.float64)
        assert_close(loss, oracle.sft_loss(z64, x0, xt, t64, mask, variant, 37, clip), "float32", "loss")
        assert_close(grad, oracle.sft_loss_grad(z64, x0, xt, t64, mask, variant, 37, cot, clip),
                     dtype, "d logits")
        assert loss[-1] == 0.0, "an empty mask row must give loss 0"
        assert_exact_zero(grad[-1], "d logits of the empty mask row")

    @pytest.mark.parametrize("variant", ALL_VARIANTS)
    def test_sft_time_gradient(self, rng, variant):
        """d loss / d t (the time weight and the LOO shift both depend on t) against central
        differences of the float64 oracle."""
        fw = self.fw
        logits, x0, xt, t, mask = sft_inputs(rng)
        z = fw.array(logits, "float32")
        cot = rng.normal(size=3)
        z64, t64, h = fw.numpy(z), t.astype(np.float64), 1e-6
        loss = lambda t_: cot @ oracle.sft_loss(z64, x0, xt, t_, mask, variant, 37)
        expected = [(loss(t64 + h * e) - loss(t64 - h * e)) / (2 * h) for e in np.eye(3)]
        # from logits, and from a linear head whose logits are the same (hidden = z, W = I)
        head = fw.api.LinearHead(z, fw.array(np.eye(37), "float32"), weight_layout="KD")
        for name, logits_ in (("logits", z), ("LinearHead", head)):
            fn = lambda t_: (fw.api.diffusion_sft_loss(logits_, fw.array(x0), fw.array(xt), t_,
                                                       fw.array(mask), variant=variant,
                                                       vocab_size=37, backend=self.BACKEND),)
            _, (dt,) = fw.vjp(fn, [fw.array(t)], [cot.astype(np.float32)])
            assert_close(dt, np.array(expected), "float32", f"d t ({variant}, {name})")

    @pytest.mark.parametrize("variant", ALL_VARIANTS)
    def test_sft_logps_is_minus_loss_times_count(self, rng, variant):
        arrays = sft_inputs(rng)
        fw, z, loss_fn = self.sft("diffusion_sft_loss", arrays, "float32", variant=variant, vocab_size=37)
        _, _, logps_fn = self.sft("diffusion_sft_logps", arrays, "float32", variant=variant, vocab_size=37)
        loss = fw.numpy(loss_fn(z)[0])
        logps = fw.numpy(logps_fn(z)[0])
        n = arrays[4].sum(axis=1)
        assert logps[-1] == 0.0
        assert_close(logps / np.maximum(n, 1), -loss, "float32", "logps / n vs -loss")

    @pytest.mark.parametrize("variant", ALL_VARIANTS)
    def test_sft_t_at_0_and_1_is_finite(self, rng, variant):
        arrays = sft_inputs(rng, b=2, t=[0.0, 1.0], empty_row=False)
        fw, z, fn = self.sft("diffusion_sft_loss", arrays, "float32", variant=variant, vocab_size=37)
        (loss,), (grad,) = fw.vjp(fn, [z], [np.ones(2, np.float32)])
        assert np.isfinite(loss).all() and np.isfinite(grad).all(), loss
        exp = oracle.sft_loss(fw.numpy(z), *arrays[1:3], arrays[3].astype(np.float64), arrays[4], variant, 37)
        assert_close(loss, exp, "float32", "loss at t in {0, 1}")

    def test_weight_clip_bounds_every_variant(self, rng):
        arrays = sft_inputs(rng, t=[0.999, 0.5, 0.1], empty_row=False)
        for variant in ALL_VARIANTS:
            fw, z, fn = self.sft("diffusion_sft_loss", arrays, "float32", variant=variant,
                                 vocab_size=37, diffusion_weight_clip=0.5)
            _, _, base = self.sft("diffusion_sft_loss", arrays, "float32", variant="loo-ce"
                                  if "loo" in variant else "base-sft", vocab_size=37)
            assert_close(fw.numpy(fn(z)[0]), 0.5 * fw.numpy(base(z)[0]), "float32", variant)

    def test_reweighted_is_twice_base_at_half_time(self, rng):
        arrays = sft_inputs(rng, t=[0.5, 0.5, 0.5])
        fw, z, re = self.sft("diffusion_sft_loss", arrays, "float32", variant="reweighted-ce", vocab_size=37)
        _, _, base = self.sft("diffusion_sft_loss", arrays, "float32", variant="base-sft", vocab_size=37)
        assert_close(fw.numpy(re(z)[0]), 2.0 * fw.numpy(base(z)[0]), "float32", "reweighted vs base")

    def test_loo_to_denoiser_logits_matches_fused_shift(self, rng):
        """The materialised helper + plain CE equals the fused LOO variant."""
        fw = self.fw
        logits, x0, xt, t, mask = sft_inputs(rng, empty_row=False)
        shifted = fw.api.loo_to_denoiser_logits(fw.array(logits, "float32"), fw.array(xt),
                                                fw.api.rf_alpha(fw.array(t)), 37)
        base = fw.api.diffusion_sft_loss(shifted, fw.array(x0), fw.array(xt), fw.array(t),
                                         fw.array(mask), variant="base-sft", vocab_size=37,
                                         backend=self.BACKEND)
        loo = fw.api.diffusion_sft_loss(fw.array(logits, "float32"), fw.array(x0), fw.array(xt),
                                        fw.array(t), fw.array(mask), variant="loo-ce",
                                        vocab_size=37, backend=self.BACKEND)
        assert_close(fw.numpy(base), fw.numpy(loo), "float32", "loo vs materialised shift")
        alpha = 1.0 - t.astype(np.float64)
        delta = np.log1p(37 * alpha / np.maximum(1 - alpha, 1e-12))
        exp = logits.astype(np.float32) + np.where(np.arange(37) == xt[..., None], delta[:, None, None], 0)
        assert_close(fw.numpy(shifted), exp, "float32", "loo_to_denoiser_logits")

    # -- ids out of range: an error where values are readable, NaN where they are not ------

    def sft_call(self, fn_name, arrays, variant, vocab_size=37):
        fw = self.fw
        logits, x0, xt, t, mask = arrays
        return getattr(fw.api, fn_name)(fw.array(logits, "float32"), fw.array(x0), fw.array(xt),
                                        fw.array(t), fw.array(mask), variant=variant,
                                        vocab_size=vocab_size, backend=self.BACKEND)

    def test_sft_ids_out_of_range_give_nan_where_values_cannot_be_read(self, rng, monkeypatch):
        """On an accelerator (no sync) or under tracing the checks cannot run: the sequence
        with a bad id at a scored position gets a NaN loss, the others their exact values. Simulated here by
        giving the checks no host values; inside sync_checks() an accelerator array is read."""
        from dlm_kernels import _checks

        fw = self.fw
        logits, x0, xt, t, mask = sft_inputs(rng, empty_row=False)
        x0, xt = x0 % 34, np.where(xt == 36, 34, xt % 34)  # valid ids of vocab_size 35 < K
        mask[1, 2] = mask[1, 0] = 1.0  # the bad ids below sit at scored positions
        cases = []
        for bad in (37, -2):
            x0_bad, xt_bad = x0.copy(), xt.copy()
            x0_bad[1, 2], xt_bad[1, 0] = bad, bad
            cases += [("loo-ce", (logits, x0_bad, xt, t, mask)),
                      ("reweighted-loo-ce", (logits, x0, xt_bad, t, mask))]
        x0_pad, xt_pad = x0.copy(), xt.copy()
        x0_pad[1, 2], xt_pad[1, 0] = 36, 35
        cases += [("base-sft", (logits, x0_pad, xt, t, mask)), ("loo-ce", (logits, x0, xt_pad, t, mask))]
        expected = {v: oracle.sft_loss(logits.astype(np.float32).astype(np.float64), x0, xt,
                                       t.astype(np.float64), mask, v, 35)
                    for v in ("base-sft", "loo-ce", "reweighted-loo-ce")}
        monkeypatch.setattr(_checks, "host_values", lambda xp, x, allow_sync=False: None)
        for variant, arrays in cases:
            got = fw.numpy(self.sft_call("diffusion_sft_loss", arrays, variant, vocab_size=35))
            assert np.isnan(got[1]), f"{variant}: the bad sequence must be NaN, got {got}"
            assert_close(got[[0, 2]], expected[variant][[0, 2]], "float32",
                         f"{variant}: the other sequences")

    def test_bad_values_give_nan_where_values_cannot_be_read(self, rng, monkeypatch):
        """A t outside [0, 1] or NaN, a negative or NaN loss_mask, negative or non-finite loss
        weights: an error where values are readable; where they are not (simulated by giving
        the checks no host values, as under jit or torch.compile), NaN in what they touch
        (that sequence's loss, the weighted sums, those positions' log-probs), never a
        plausible number; the other sequences keep their exact values."""
        from dlm_kernels import _checks

        fw = self.fw
        bad_values = {"t > 1": ("t", 1.5), "t < 0": ("t", -0.25), "t NaN": ("t", np.nan)}
        for value in (-1.0, np.nan, np.inf):
            bad_values[f"loss_mask {value}"] = ("loss_mask", value)
        # a sequence for each bad value (the odd ones) between good sequences
        logits, x0, xt, t, mask = sft_inputs(rng, b=2 * len(bad_values) + 1, empty_row=False)
        good = self.sft_call("diffusion_sft_loss", (logits, x0, xt, t, mask), "reweighted-loo-ce")
        good = fw.numpy(good)

        def with_bad(where):
            """(t, loss_mask) with the bad value ``where[seq]`` names in each sequence seq."""
            t_bad, m_bad = t.copy(), mask.copy()
            for seq, name in where.items():
                what, value = bad_values[name]
                if what == "t":
                    t_bad[seq] = value
                else:
                    m_bad[seq, 2] = value
            return t_bad, m_bad

        for name in bad_values:  # each alone
            t_bad, m_bad = with_bad({1: name})
            with pytest.raises(ValueError):
                self.sft_call("diffusion_sft_loss", (logits, x0, xt, t_bad, m_bad), "reweighted-loo-ce")
        monkeypatch.setattr(_checks, "host_values", lambda xp, x, allow_sync=False: None)
        # every bad value at once, each in its own sequence (a sequence's loss and log-probs
        # are its own): each bad sequence NaN, every good one its exact value
        bad_seqs = {2 * i + 1: name for i, name in enumerate(bad_values)}
        good_seqs = [seq for seq in range(len(t)) if seq not in bad_seqs]
        t_bad, m_bad = with_bad(bad_seqs)
        for fn in ("diffusion_sft_loss", "diffusion_sft_logps"):
            got = fw.numpy(self.sft_call(fn, (logits, x0, xt, t_bad, m_bad), "reweighted-loo-ce"))
            for seq, name in bad_seqs.items():
                assert np.isnan(got[seq]), f"{fn} with {name} in sequence {seq}: {got}"
            if fn == "diffusion_sft_loss":
                assert_close(got[good_seqs], good[good_seqs], "float32",
                             f"{fn}: the good sequences among the bad")
        batch, y, w = self.batch(rng)
        z = fw.array(rng.normal(size=(2, 6, 41)), "float32")
        u = fw.array(rng.normal(size=(2, 6, 41)), "float32")
        for value in (-0.5, np.nan, np.inf):
            w_bad = w.copy()
            w_bad[1, 3] = value
            b = batch.replace(loss_weights=fw.array(w_bad))
            db = fw.api.DiffusionDistillationBatch.create(student_batch=b, teacher_logits=u)
            ce = fw.api.weighted_cross_entropy(z, b, backend=self.BACKEND)
            total, aux = fw.api.opd_loss(z, db, soft_loss_weight=0.5, hard_loss_weight=0.5,
                                         backend=self.BACKEND)
            for name, v in (("weighted_cross_entropy", ce.unreduced_sum),
                            ("opd_loss", total.unreduced_sum),
                            ("opd soft", aux["distill/soft_loss"].unreduced_sum),
                            ("opd hard", aux["distill/hard_loss"].unreduced_sum)):
                assert np.isnan(fw.numpy(v)), f"{name} with a loss weight of {value}: {v}"
            logps = fw.numpy(fw.api.per_token_logps(z, b, backend=self.BACKEND))
            assert np.isnan(logps[1, 3]), f"per_token_logps with a loss weight of {value}"
            assert np.isfinite(np.delete(logps.reshape(-1), 9)).all(), logps

    def test_extreme_loss_weights(self, rng, monkeypatch):
        """Weights from denormal to 1e30: exact (vs the float64 oracle, gradients too) while
        their sum is a normal float32 number; a sum below it (1/Σw overflows) or above it
        raises naming loss_weights (the SFT loss_mask: a row sum that overflows), and is NaN
        where the checks cannot read the values."""
        from dlm_kernels import _checks

        fw = self.fw
        batch, y, w = self.batch(rng)
        z = fw.array(rng.normal(size=(2, 6, 41)) * 3, "float32")
        z64, active = fw.numpy(z).reshape(12, 41), (w != 0).reshape(-1)
        _, lp, _, _ = oracle.token_stats(z64, y.reshape(-1), active)
        for scale in (1e-30, 1e-20, 1e20, 1e30):
            ws = (w * np.float32(scale)).astype(np.float32)
            ws[0, 0] = np.float32(1e-45) * (w[0, 0] != 0)  # a denormal weight among them
            make = lambda ws_: fw.api.DiffusionTokenBatch.create(
                model_inputs=batch.model_inputs, target_ids=batch.target_ids, loss_weights=ws_)
            fn = lambda z_, ws_: (fw.api.weighted_cross_entropy(z_, make(ws_),
                                                                backend=self.BACKEND).compute(),)
            (loss,), (grad, d_ws) = fw.vjp(fn, [z, fw.array(ws)], [np.float32(1.0)])
            wf = ws.reshape(-1).astype(np.float64)
            expected = -(wf * lp).sum() / wf.sum()
            assert_close(loss, expected, "float32", f"loss at weights {scale}")
            # d/dw = (CE_i - loss) / Σw: 1e30 at weights of 1e-30 (autodiff's loss / (Σw)²
            # would underflow to an infinite gradient)
            # XLA on a CPU reads a denormal weight as 0: that position is inactive there
            read = active & ((np.abs(wf) >= np.finfo(np.float32).tiny) | (fw.name != "jax"))
            d_expected = (np.where(read, -lp, 0.0) - expected) / wf.sum()
            # (CE_i - loss) cancels terms of the size of each: float32 ulps of them, over Σw
            assert_close(d_ws.reshape(-1), d_expected, "float32", f"d weights at {scale}",
                         slack=CANCELLATION_ULP * (np.abs(lp) + abs(expected)) / wf.sum())
            zeros = np.zeros(12)
            g = (zeros, -wf / wf.sum(), zeros, zeros)
            dz, _ = oracle.token_stats_vjp(z64, y.reshape(-1), active, g)
            assert_close(grad.reshape(12, 41), dz, "float32", f"d logits at weights {scale}",
                         slack=oracle.saved_lse_slack(z64, y.reshape(-1), active, g))
        # a 16-bit linear head forms its planned gradient w·dstats in its own dtype: weights of
        # 1e-30 and 1e30 must give the gradient of weights of 1 (the loss is scale-free)
        h = fw.array(rng.integers(-2, 3, (2, 6, 8)) / 4, "float16")
        wt = fw.array(rng.integers(-2, 3, (41, 8)) / 4, "float16")

        def d_hidden(scale):
            ws = (w * np.float32(scale)).astype(np.float32)
            b = batch.replace(loss_weights=fw.array(ws))
            fn = lambda h_: (fw.api.weighted_cross_entropy(
                fw.api.LinearHead(h_, wt, weight_layout="KD"), b,
                backend=self.BACKEND).compute(),)
            return fw.vjp(fn, [h], [np.float32(1.0)])[1][0]

        unit = d_hidden(1.0)
        assert np.isfinite(unit).all() and np.abs(unit).max() > 0
        for scale in (1e-30, 1e30):
            # two float16 results, each a sum over K of float16 dZ·W terms, the second's dZ
            # from coefficients rescaled by a float32 constant: an ulp of the largest terms
            # (about the largest d hidden) each way
            assert_close(d_hidden(scale), unit, "float16",
                         f"float16 head's d hidden at weights x {scale}", slack=2 ** -10 *
                         np.abs(unit).max())
        for value in (1e-45, 1e-40, 2e38):  # sums below 1.18e-38 and (two or more) past 3.4e38
            ws = np.where(w != 0, np.float32(value), 0).astype(np.float32)
            with pytest.raises(ValueError, match="loss_weights must sum to 0 or to a normal float32"):
                fw.api.DiffusionTokenBatch.create(model_inputs=batch.model_inputs,
                                                  target_ids=batch.target_ids,
                                                  loss_weights=fw.array(ws))
        logits, x0, xt, t, mask = sft_inputs(rng, empty_row=False)
        # a mask of 1e30 with a time weight of 1e6: w·Σ M·CE would overflow before / Σ M
        t_late = np.array([1.0 - 1e-6, 0.5, 0.25], np.float32)
        m30 = (mask * np.float32(1e30)).astype(np.float32)
        got = fw.numpy(self.sft_call("diffusion_sft_loss", (logits, x0, xt, t_late, m30),
                                     "reweighted-ce"))
        z32 = logits.astype(np.float32).astype(np.float64)
        assert_close(got, oracle.sft_loss(z32, x0, xt, t_late.astype(np.float64), m30,
                                          "reweighted-ce", 37), "float32",
                     "SFT loss with a mask of 1e30 and t near 1")
        huge = mask.copy()
        huge[0, :2] = np.float32(3e38)  # row 0's sum overflows float32
        with pytest.raises(ValueError, match=r"loss_mask must sum to 0 or .* at row \(0,\)"):
            self.sft_call("diffusion_sft_loss", (logits, x0, xt, t, huge), "base-sft")
        monkeypatch.setattr(_checks, "host_values", lambda xp, x, allow_sync=False: None)
        got = fw.numpy(self.sft_call("diffusion_sft_loss", (logits, x0, xt, t, huge), "base-sft"))
        assert np.isnan(got[0]) and np.isfinite(got[1:]).all(), got
        for value in (1e-45, 2e38):
            ws = np.where(w != 0, np.float32(value), 0).astype(np.float32)
            b = batch.replace(loss_weights=fw.array(ws))
            loss = fw.numpy(fw.api.weighted_cross_entropy(z, b, backend=self.BACKEND).compute())
            if fw.name == "jax" and value < _checks.F32_TINY:
                # XLA on a CPU reads denormals as 0 (w != 0 is False): all weights are 0
                assert loss == 0.0, f"weights of {value} read as 0: {loss}"
            else:
                assert np.isnan(loss), f"weights of {value}: {loss}"

    def test_sync_checks_read_accelerator_arrays(self, rng, monkeypatch):
        """Outside sync_checks() an accelerator array's values are not read (NaN loss);
        inside, they are, and the bad id is an error. The accelerator is simulated by an ops
        adapter that refuses to read values unless a sync is allowed."""
        from dlm_kernels import _checks

        real = _checks.host_values.__globals__["_SyncChecks"]
        seen = []

        def as_if_on_gpu(xp, x, allow_sync=False):
            seen.append(allow_sync or real.enabled)
            return xp.concrete(x) if (allow_sync or real.enabled) else None

        monkeypatch.setattr(_checks, "host_values", as_if_on_gpu)
        fw = self.fw
        logits, x0, xt, t, mask = sft_inputs(rng, empty_row=False)
        x0[0, 0], mask[0, 0] = 99, 1.0
        got = fw.numpy(self.sft_call("diffusion_sft_loss", (logits, x0, xt, t, mask), "base-sft"))
        assert np.isnan(got[0]) and np.isfinite(got[1:]).all(), got
        assert seen and not any(seen), "a scoring call must not sync by default"
        with fw.api.sync_checks():
            with pytest.raises(ValueError, match=r"x0 where loss_mask is set must be in \[0, 37\); got 99"):
                self.sft_call("diffusion_sft_loss", (logits, x0, xt, t, mask), "base-sft")
        assert not real.enabled, "sync_checks() restores the default on exit"

    def test_targets_out_of_range_in_every_objective(self, rng, monkeypatch):
        """target_ids outside [0, K) at active positions: ValueError where readable, else a NaN
        log-prob (and so a NaN loss) at exactly that position."""
        from dlm_kernels import _checks

        fw = self.fw
        batch, y, w = self.batch(rng)
        y, w = y.copy(), w.copy()  # (torch tensors share memory with the arrays they came from)
        w[1, 3] = 1.0
        y[1, 3] = 41
        bad = batch.replace(target_ids=fw.array(y), loss_weights=fw.array(w))
        z = fw.array(rng.normal(size=(2, 6, 41)), "float32")
        teacher = fw.array(rng.normal(size=(2, 6, 41)), "float32")
        dbatch = fw.api.DiffusionDistillationBatch.create(student_batch=batch, teacher_logits=teacher)
        dbad = dbatch.replace(student_batch=bad)
        calls = {
            "per_token_logps": lambda: fw.api.per_token_logps(z, bad, backend=self.BACKEND),
            "weighted_cross_entropy": lambda: fw.api.weighted_cross_entropy(z, bad, backend=self.BACKEND).unreduced_sum,
            "opd_loss": lambda: fw.api.opd_loss(z, dbad, hard_loss_weight=0.5, backend=self.BACKEND)[0].unreduced_sum,
        }
        for name, call in calls.items():
            with pytest.raises(ValueError, match=r"active target_ids must be smaller than vocabulary size 41; "
                                                 r"got 41 at index \(1, 3\)$"):
                call()
        monkeypatch.setattr(_checks, "host_values", lambda xp, x, allow_sync=False: None)
        logps = fw.numpy(calls["per_token_logps"]())
        assert np.isnan(logps[1, 3]) and np.isfinite(np.delete(logps.reshape(-1), 9)).all(), logps
        for name in ("weighted_cross_entropy", "opd_loss"):
            assert np.isnan(fw.numpy(calls[name]())), name

    # -- Tunix batch contract ------------------------------------------------------------

    def batch(self, rng, b=2, l=6, k=41, zero_weights=False):
        fw = self.fw
        y = rng.integers(0, k, (b, l))
        w = rng.uniform(0.5, 2.0, (b, l)).astype(np.float32)
        w[rng.uniform(size=(b, l)) < 0.3] = 0.0
        if zero_weights:
            w[:] = 0.0
        y = np.where(w == 0, -1, y)  # sentinel targets at inactive positions
        batch = fw.api.DiffusionTokenBatch.create(model_inputs=fw.array(rng.integers(0, k, (b, l))),
                                                  target_ids=fw.array(y), loss_weights=fw.array(w))
        return batch, y, w

    @pytest.mark.parametrize("dtype", DTYPES)
    def test_per_token_logps_and_entropy(self, rng, dtype):
        fw = self.fw
        batch, y, w = self.batch(rng)
        z = fw.array(rng.normal(size=(2, 6, 41)) * 3, dtype)
        fn = lambda z_: fw.api.per_token_logps(z_, batch, temperature=0.8, stop_gradient=False,
                                               return_entropy=True, backend=self.BACKEND)
        cots = [rng.normal(size=(2, 6)).astype(np.float32) for _ in range(2)]
        (logps, ent), (grad,) = fw.vjp(fn, [z], cots)
        z64 = fw.numpy(z).reshape(12, 41)
        active = (w != 0).reshape(-1)
        _, e_lp, e_ent, _ = oracle.token_stats(z64, y.reshape(-1), active, T=0.8)
        assert_close(logps.reshape(-1), e_lp, "float32", "logps")
        assert_close(ent.reshape(-1), e_ent, "float32", "entropy")
        zeros = np.zeros(12)
        g = (zeros, cots[0].reshape(-1), cots[1].reshape(-1), zeros)
        dz, _ = oracle.token_stats_vjp(z64, y.reshape(-1), active, g, T=0.8)
        assert_close(grad.reshape(12, 41), dz, dtype, "d logits",
                     slack=oracle.saved_lse_slack(z64, y.reshape(-1), active, g, T=0.8))

    def test_per_token_logps_stop_gradient(self, rng):
        fw = self.fw
        batch, _, _ = self.batch(rng)
        z = fw.array(rng.normal(size=(2, 6, 41)), "float32")
        fn = lambda z_: fw.api.per_token_logps(z_, batch, return_entropy=True, backend=self.BACKEND)
        _, (grad,) = fw.vjp(fn, [z], [np.ones((2, 6), np.float32)] * 2)
        assert_exact_zero(grad, "gradient through stop_gradient=True")

    def test_compute_diffusion_per_token_logps_calls_logits_fn(self, rng):
        fw = self.fw
        batch, _, _ = self.batch(rng)
        table = fw.array(rng.normal(size=(41, 41)), "float32")  # a toy "model": embedding -> logits
        logits_fn = lambda model, tokens: model[tokens]
        got = fw.api.compute_diffusion_per_token_logps(table, batch, logits_fn, backend=self.BACKEND)
        exp = fw.api.per_token_logps(table[batch.model_inputs], batch, backend=self.BACKEND)
        assert_close(fw.numpy(got), fw.numpy(exp), "float32", "logps")

    @pytest.mark.parametrize("dtype", DTYPES)
    def test_weighted_cross_entropy(self, rng, dtype):
        fw = self.fw
        batch, y, w = self.batch(rng)
        z = fw.array(rng.normal(size=(2, 6, 41)) * 3, dtype)
        fn = lambda z_: (lambda ws: (ws.unreduced_sum, ws.denominator))(
            fw.api.weighted_cross_entropy(z_, batch, backend=self.BACKEND))
        (s, den), (grad,) = fw.vjp(fn, [z], [np.float32(1.7), np.float32(0.0)])
        z64 = fw.numpy(z).reshape(12, 41)
        active = (w != 0).reshape(-1)
        _, lp, _, _ = oracle.token_stats(z64, y.reshape(-1), active)
        assert_close(s, -(w.reshape(-1) * lp).sum(), "float32", "unreduced_sum")
        assert_close(den, w.sum(), "float32", "denominator")
        zeros = np.zeros(12)
        g = (zeros, -1.7 * w.reshape(-1), zeros, zeros)
        dz, _ = oracle.token_stats_vjp(z64, y.reshape(-1), active, g)
        assert_close(grad.reshape(12, 41), dz, dtype, "d logits",
                     slack=oracle.saved_lse_slack(z64, y.reshape(-1), active, g))

    def test_all_zero_weights_give_zero_loss_and_exact_zero_grads(self, rng):
        fw = self.fw
        batch, _, _ = self.batch(rng, zero_weights=True)
        z = fw.array(np.full((2, 6, 41), np.nan), "float32")  # never read
        fn = lambda z_: (fw.api.weighted_cross_entropy(z_, batch, backend=self.BACKEND).compute(),)
        (loss,), (grad,) = fw.vjp(fn, [z], [np.float32(1.0)])
        assert loss == 0.0
        assert_exact_zero(grad, "d logits with all weights 0")

    def test_opd_loss(self, rng, opd_case):
        fw = self.fw
        soft_w, hard_w, dtype = opd_case
        student, y, w = self.batch(rng)
        u64 = rng.normal(size=(2, 6, 41)) * 3
        teacher = fw.array(u64, dtype)
        batch = fw.api.DiffusionDistillationBatch.create(student_batch=student, teacher_logits=teacher)
        z = fw.array(rng.normal(size=(2, 6, 41)) * 3, dtype)
        T = 1.7

        def fn(z_):
            total, aux = fw.api.opd_loss(z_, batch, temperature=T, soft_loss_weight=soft_w,
                                         hard_loss_weight=hard_w, backend=self.BACKEND)
            return (total.unreduced_sum, total.denominator, aux["distill/soft_loss"].unreduced_sum,
                    aux["distill/hard_loss"].unreduced_sum)

        cot = np.float32(1.3)
        (tot, den, soft, hard), (grad,) = fw.vjp(fn, [z], [cot, 0.0, 0.0, 0.0])
        z64, u_np = fw.numpy(z).reshape(12, 41), fw.numpy(teacher).reshape(12, 41)
        active, wf = (w != 0).reshape(-1), w.reshape(-1).astype(np.float64)
        _, _, _, kl = oracle.token_stats(z64, y.reshape(-1), active, u=u_np, T=T)
        _, lp, _, _ = oracle.token_stats(z64, y.reshape(-1), active)
        e_soft = T * T * (wf * kl).sum() if soft_w else 0.0
        e_hard = -(wf * lp).sum() if hard_w else 0.0
        assert_close(soft, e_soft, "float32", "soft")
        assert_close(hard, e_hard, "float32", "hard")
        assert_close(tot, soft_w * e_soft + hard_w * e_hard, "float32", "total")
        assert_close(den, wf.sum(), "float32", "denominator")
        zeros = np.zeros(12)
        g_soft = (zeros, zeros, zeros, cot * soft_w * T * T * wf)
        g_hard = (zeros, -cot * hard_w * wf, zeros, zeros)
        dz_soft, _ = oracle.token_stats_vjp(z64, y.reshape(-1), active, g_soft, u=u_np, T=T)
        dz_hard, _ = oracle.token_stats_vjp(z64, y.reshape(-1), active, g_hard)
        slack = (oracle.saved_lse_slack(z64, y.reshape(-1), active, g_soft, u=u_np, T=T)
                 + oracle.saved_lse_slack(z64, y.reshape(-1), active, g_hard))
        assert_close(grad.reshape(12, 41), dz_soft + dz_hard, dtype, "d student logits",
                     slack=slack)

    def test_loss_weight_gradients(self, rng):
        """d loss / d loss_weights through ``compute()`` of weighted_cross_entropy and of
        opd_loss (both terms): (ℓ_i - loss) / Σw at active positions, where ℓ_i is the
        position's weighted term; -loss / Σw where the weight is 0 (ℓ_i counts as 0 there:
        those logits are never read)."""
        fw = self.fw
        batch, y, w = self.batch(rng)
        student_batch = lambda w_: fw.api.DiffusionTokenBatch.create(
            model_inputs=batch.model_inputs, target_ids=batch.target_ids, loss_weights=w_)
        z64 = rng.normal(size=(2, 6, 41)) * 3
        u64 = rng.normal(size=(2, 6, 41)) * 3
        z, u = fw.array(z64, "float32"), fw.array(u64, "float32")
        active, wf = (w != 0).reshape(-1), w.reshape(-1).astype(np.float64)
        _, lp, _, _ = oracle.token_stats(z64.reshape(12, 41), y.reshape(-1), active)
        _, _, _, kl = oracle.token_stats(z64.reshape(12, 41), y.reshape(-1), active,
                                         u=u64.reshape(12, 41), T=1.7)
        ce = fw.api.weighted_cross_entropy
        opd = lambda z_, b: fw.api.opd_loss(
            z_, fw.api.DiffusionDistillationBatch.create(student_batch=b, teacher_logits=u),
            temperature=1.7, soft_loss_weight=0.7, hard_loss_weight=0.4,
            backend=self.BACKEND)[0]
        cases = {"weighted_cross_entropy": (lambda z_, b: ce(z_, b, backend=self.BACKEND), -lp),
                 "opd_loss": (opd, 0.7 * 1.7 ** 2 * kl - 0.4 * lp)}
        # a linear head's total forms its gradient in the forward: the weights' share too
        eye = fw.array(np.eye(41), "float32")  # hidden = z, weight = I: the head's logits are z
        as_head = lambda z_: fw.api.LinearHead(z_, eye, weight_layout="KD")
        for (name, (fn, term)), head in [(c, h) for c in cases.items() for h in (False, True)]:
            call = (lambda z_, b, fn=fn: fn(as_head(z_), b)) if head else fn
            (loss,), (_, dw) = fw.vjp(lambda z_, w_: (call(z_, student_batch(w_)).compute(),),
                                      [z, fw.array(w)], [np.float32(1.0)])
            name += " (LinearHead)" if head else ""
            expected = ((wf * term).sum() / wf.sum())
            assert_close(loss, expected, "float32", f"{name} loss")
            assert_close(dw.reshape(-1), (np.where(active, term, 0.0) - expected) / wf.sum(),
                         "float32", f"{name} d loss_weights")

    def check_opd(self, z, u, y, w, T, soft_w, hard_w, name):
        """opd_loss of logits z and teacher u ([B, L, K] float32 arrays) against the oracle:
        the soft term (T²·Σ w·KL), the hard term, the total and d logits."""
        fw = self.fw
        b, l, k = z.shape
        student = fw.api.DiffusionTokenBatch.create(model_inputs=fw.array(y), target_ids=fw.array(y),
                                                    loss_weights=fw.array(w))
        batch = fw.api.DiffusionDistillationBatch.create(student_batch=student,
                                                         teacher_logits=fw.array(u, "float32"))

        def fn(z_):
            total, aux = fw.api.opd_loss(z_, batch, temperature=T, soft_loss_weight=soft_w,
                                         hard_loss_weight=hard_w, backend=self.BACKEND)
            return (total.unreduced_sum, aux["distill/soft_loss"].unreduced_sum,
                    aux["distill/hard_loss"].unreduced_sum)

        (tot, soft, hard), (grad,) = fw.vjp(fn, [fw.array(z, "float32")], [1.0, 0.0, 0.0])
        n = b * l
        z64, u64, y64 = z.reshape(n, k).astype(np.float64), u.reshape(n, k).astype(np.float64), y.reshape(-1)
        active, wf = (w != 0).reshape(-1), w.reshape(-1).astype(np.float64)
        _, _, _, kl = oracle.token_stats(z64, y64, active, u=u64, T=T)
        _, lp, _, _ = oracle.token_stats(z64, y64, active)
        e_soft, e_hard = T * T * (wf * kl).sum(), -(wf * lp).sum()
        assert_close(soft, e_soft, "float32", f"{name}: soft")
        assert_close(hard, e_hard, "float32", f"{name}: hard")
        assert_close(tot, soft_w * e_soft + hard_w * e_hard, "float32", f"{name}: total")
        zeros = np.zeros(n)
        g_soft = (zeros, zeros, zeros, soft_w * T * T * wf)
        g_hard = (zeros, -hard_w * wf, zeros, zeros)
        dz_soft, _ = oracle.token_stats_vjp(z64, y64, active, g_soft, u=u64, T=T)
        dz_hard, _ = oracle.token_stats_vjp(z64, y64, active, g_hard)
        slack = (oracle.saved_lse_slack(z64, y64, active, g_soft, u=u64, T=T)
                 + oracle.saved_lse_slack(z64, y64, active, g_hard))
        assert_close(grad.reshape(n, k), dz_soft + dz_hard, "float32", f"{name}: d logits",
                     slack=slack)

    @pytest.mark.parametrize("temperature", [1e3, 1e4])
    def test_opd_loss_at_a_large_temperature(self, rng, temperature):
        """The soft term T²·KL is O(1) at any T while the KL is O(1/T²): at T = 1e3 and 1e4
        it is the oracle's within the float32 tolerance (formed as E_q[t - s] - lse_u + lse it
        came out a percent off at 1e3 and negative at 1e4), and so is d logits."""
        _, y, w = self.batch(rng)
        z = (rng.normal(size=(2, 6, 41)) * 3).astype(np.float32)
        u = (rng.normal(size=(2, 6, 41)) * 3).astype(np.float32)
        self.check_opd(z, u, np.where(w == 0, 0, y), w, temperature, 1.0, 0.5, f"T={temperature}")

    #: [N, K] of test_opd_loss_with_a_masked_vocabulary_tail: the CPU chunk of the
    #: framework-native chunked backends is 4096 columns at any N (``_config.chunk_size_for``,
    #: a function of K alone), so the tail is the second chunk (and K = 8192 takes torch's
    #: compiled loops, COMPILE_MIN_VOCAB, whose forward tiles are 4096 columns too)
    MASKED_TAIL_SHAPE = (16, 8192)

    @pytest.mark.parametrize("masked", ["student and teacher", "teacher"])
    def test_opd_loss_with_a_masked_vocabulary_tail(self, rng, masked):
        """A padded vocabulary: the last 4096 columns hold finfo.min in the student's and
        the teacher's logits, or in the teacher's alone (a whole chunk, or whole blocks and
        vocabulary splits of the kernels). Every term and d logits are the oracle's at T = 2
        (the teacher-only case gave NaN on the chunked backend: a chunk whose teacher maximum
        is finfo.min merged as 0 · -inf)."""
        n, k = self.MASKED_TAIL_SHAPE
        w = rng.uniform(0.5, 2.0, (1, n)).astype(np.float32)
        w[rng.uniform(size=(1, n)) < 0.2] = 0.0
        y = rng.integers(0, k - 4096, (1, n))
        z = (rng.normal(size=(1, n, k)) * 3).astype(np.float32)
        u = (rng.normal(size=(1, n, k)) * 3).astype(np.float32)
        fmin = np.finfo(np.float32).min
        if masked != "teacher":
            z[..., k - 4096:] = fmin
        u[..., k - 4096:] = fmin
        self.check_opd(z, u, y, w, 2.0, 0.7, 0.4, masked)

    def test_opd_teacher_is_a_constant(self, rng):
        """opd_loss stops the teacher's gradient: differentiated with respect to the teacher
        logits, the total and both aux terms give exact zeros (and the student its own)."""
        fw = self.fw
        student, _, _ = self.batch(rng)
        z = fw.array(rng.normal(size=(2, 6, 41)) * 3, "float32")

        def fn(z_, u_):
            batch = fw.api.DiffusionDistillationBatch.create(student_batch=student,
                                                             teacher_logits=u_)
            total, aux = fw.api.opd_loss(z_, batch, temperature=1.5, soft_loss_weight=0.7,
                                         hard_loss_weight=0.4, backend=self.BACKEND)
            return (total.unreduced_sum, aux["distill/soft_loss"].unreduced_sum,
                    aux["distill/hard_loss"].unreduced_sum)

        u = fw.array(rng.normal(size=(2, 6, 41)) * 3, "float32")
        _, (g_z, g_u) = fw.vjp(fn, [z, u], [1.0, 0.5, -0.3])
        assert_exact_zero(g_u, "d teacher logits of opd_loss")
        assert np.abs(g_z).max() > 0, "the student got no gradient"

    def test_opd_disabled_terms_do_not_read_their_inputs(self, rng):
        fw = self.fw
        student, y, w = self.batch(rng, k=5)  # targets < 5, the bad teacher's K
        bad_teacher = fw.array(np.full((2, 6, 5), np.nan), "float32")  # wrong K and NaN
        batch = fw.api.DiffusionDistillationBatch.create(student_batch=student, teacher_logits=bad_teacher)
        z = fw.array(rng.normal(size=(2, 6, 41)), "float32")
        hard_only = lambda z: fw.api.opd_loss(z, batch, soft_loss_weight=0.0,
                                              hard_loss_weight=1.0, backend=self.BACKEND)
        _, aux = hard_only(z)
        assert fw.numpy(aux["distill/soft_loss"].unreduced_sum) == 0

        (value,), (grad,) = fw.vjp(lambda z: (hard_only(z)[0].unreduced_sum,), [z], [1.0])
        z64, active, wf = fw.numpy(z).reshape(12, 41), (w != 0).reshape(-1), w.reshape(-1)
        _, lp, _, _ = oracle.token_stats(z64, y.reshape(-1), active)
        assert_close(value, -(wf * lp).sum(), "float32", "hard-only total")
        # the NaN teacher reaches neither the value nor the gradient: d logits is the CE's
        zero = np.zeros(12)
        dz, _ = oracle.token_stats_vjp(z64, y.reshape(-1), active, (zero, -wf, zero, zero))
        assert_close(grad.reshape(12, 41), dz, "float32", "hard-only d logits",
                     slack=oracle.saved_lse_slack(z64, y.reshape(-1), active,
                                                  (zero, -wf, zero, zero)))
        # a disabled hard term does not check targets against K (replace() skips the batch's
        # own check, as a batch traced under jit would)
        y_bad = np.where(w != 0, 1000, -1)
        teacher = fw.array(rng.normal(size=(2, 6, 41)), "float32")
        batch2 = batch.replace(student_batch=student.replace(target_ids=fw.array(y_bad)),
                               teacher_logits=teacher)
        total2, aux2 = fw.api.opd_loss(z, batch2, temperature=1.5, soft_loss_weight=1.0,
                                       hard_loss_weight=0.0, backend=self.BACKEND)
        _, _, _, kl = oracle.token_stats(z64, y_bad.reshape(-1), active,
                                         u=fw.numpy(teacher).reshape(12, 41), T=1.5)
        assert_close(fw.numpy(total2.unreduced_sum), 2.25 * (wf * kl).sum(), "float32", "soft-only total")
        assert fw.numpy(aux2["distill/hard_loss"].unreduced_sum) == 0


class KernelObjectivesSuite(ObjectivesSuite):
    """A kernel backend (seconds a case in an interpreter) runs what its kernels can get
    wrong: each objective's launch (with and without the LOO shift, weights, a teacher,
    entropy off) in every dtype, bad ids read as NaN, disabled terms not read, exact zeros.
    The objectives' own arithmetic on the kernels' statistics (variant weights, clipping,
    t at 0 and 1, logits_fn, stop_gradient, host checks) is the same code on every backend:
    the framework-native classes test it."""

    sft_case = cases(("base-sft", "float32"), ("loo-ce", "bfloat16"), ("reweighted-ce", "float16"),
                     ("reweighted-loo-ce", "bfloat16"), ("loo-reweighted-ce", "float32"))
    opd_case = cases((0.7, 0.4, "float32"), (0.7, 0.4, "bfloat16"), (0.7, 0.4, "float16"),
                     (1.0, 0.0, "bfloat16"), (0.0, 1.0, "float32"))
    test_weight_clip_bounds_every_variant = None
    test_sft_logps_is_minus_loss_times_count = None
    test_sft_t_at_0_and_1_is_finite = None
    test_reweighted_is_twice_base_at_half_time = None
    test_compute_diffusion_per_token_logps_calls_logits_fn = None
    test_per_token_logps_stop_gradient = None
    test_sync_checks_read_accelerator_arrays = None
    # N rows of K: the kernels split K into blocks and vocabulary splits of their own (the
    # tail is whole Pallas blocks of 2048 and a whole Triton split of 4096 here)
    MASKED_TAIL_SHAPE = (12, 16384)
