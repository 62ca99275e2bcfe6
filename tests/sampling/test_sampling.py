"""The denoising step: sample_tokens and commit_tokens on every backend (the Triton kernel in
its interpreter on CPU, torch and JAX through the jax-triton emulator; the Pallas kernel in
TPU interpret mode), against a float64 NumPy oracle that recomputes the documented noise
(lowbias32 of (seed, step, row, column)) on its own, so drawn tokens are compared exactly."""

from __future__ import annotations

import contextlib
import math
import os
import re

import numpy as np
import pytest

from harness import assert_close, cases, framework

from .draw_oracle import oracle


def interpret_mode():
    from dlm_kernels._jax.pallas import interpret_mode as pallas_interpret

    return pallas_interpret()


def _on_gpu():
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:  # pragma: no cover
        return False


class SamplingSuite:
    FW = None
    BACKEND = None
    #: the dtypes of the oracle comparison (``harness.cases``; the reference
    #: backends, which share the chunked ones' math, float32 only)
    dtype = cases("float32", "bfloat16")
    #: rows of the chi-square test (the interpreted kernels run one program per row)
    FREQUENCY_ROWS = 40000
    #: rows of the top-k / suppression test
    STREAM_ROWS = 500

    @property
    def fw(self):
        return framework(self.FW)

    def sample(self, z, dtype="float32", jit=True, **kw):
        """sample_tokens's outputs as NumPy; in JAX the call traced into one ``jax.jit``
        program of the logits (as a denoising loop runs it; op by op, ``jit=False``, every
        primitive is compiled anew at every shape, which costs the suite three times the
        time)."""
        fw = self.fw
        call = lambda z: fw.api.sample_tokens(z, backend=self.BACKEND, **kw)  # noqa: E731
        if fw.name == "jax" and jit:
            call = fw.jax.jit(call)
        return [np.asarray(fw.numpy(x)) for x in call(fw.array(z, dtype))]

    def check(self, got, want, dtype="float32", scale=None):
        """Tokens exactly, the statistics to float32 accuracy; ``scale``: the size of the
        scaled logits where it passes 1 (log-probabilities are differences s - lse of float32
        values that large, so their rounding grows with it)."""
        for name, g, w in zip(("token", "logp", "argmax", "top1", "top2", "entropy"), got, want):
            g = g.reshape(-1)
            if name in ("token", "argmax"):
                bad = np.flatnonzero(g != w)
                assert bad.size == 0, f"{name}: {bad.size} rows differ, first {bad[0]}: {g[bad[0]]} vs {w[bad[0]]}"
            else:
                assert_close(g, w, "float32", name, scale=scale)

    @pytest.mark.parametrize("temperature,top_k", [(0.0, None), (0.7, None), (1.3, 5), (0.0, 3)])
    def test_matches_oracle(self, rng, dtype, temperature, top_k):
        """Tokens exactly, statistics to float32 accuracy; K = 301 in chunks of 64 (a ragged
        last chunk), every option of the sampling distribution."""
        z = rng.normal(size=(4, 6, 301)) * 3
        zr = np.asarray(self.fw.numpy(self.fw.array(z, dtype)))  # the values the kernels see
        seed, step = int(rng.integers(0, 2**31)), int(rng.integers(0, 1000))
        got = self.sample(z, dtype, temperature=temperature, top_k=top_k, seed=seed, step=step,
                          chunk_size=64)
        self.check(got, oracle(zr.reshape(24, -1), temperature=temperature, seed=seed,
                               step=step, top_k=top_k))

    def test_per_sequence_seeds_are_batch_invariant(self, rng):
        """seed = [B] ints: a sequence draws the same tokens alone (seed [s] or the int s), at
        batch index 0 and at batch index 5, whatever its neighbours; the batch's tokens are
        the oracle's, whose noise is keyed on (seed_b, step, position, column)."""
        fw = self.fw
        l, k = 3, 130
        z = rng.normal(size=(6, l, k)) * 2
        z[:, 0, 7] = 30.0  # one greedy-looking position: still drawn at T, never suppressed
        seeds = rng.integers(0, 2**31, size=6)
        kw = dict(temperature=0.9, step=int(rng.integers(0, 1000)), chunk_size=64)
        mine = z[5]  # the sequence, with seed seeds[5]
        alone = self.sample(mine[None], seed=fw.array(seeds[5:6]), **kw)[0]
        alone_int = self.sample(mine[None], seed=int(seeds[5]), **kw)[0]
        first = np.concatenate([mine[None], z[1:]])
        first_seeds = np.concatenate([seeds[5:6], seeds[1:]])
        at0 = self.sample(first, seed=fw.array(first_seeds), **kw)[0]
        at5 = self.sample(z, seed=fw.array(seeds), **kw)[0]
        assert np.array_equal(alone, alone_int), "seed s and seed [s] must agree for B = 1"
        assert np.array_equal(at0[0], alone[0]) and np.array_equal(at5[5], alone[0]), (
            alone, at0[0], at5[5])
        want = oracle(np.asarray(fw.numpy(fw.array(z, "float32"))).reshape(6 * l, k),
                      temperature=0.9, seed=seeds, step=kw["step"])
        assert np.array_equal(at5.reshape(-1), want[0])
        with pytest.raises(ValueError, match=r"seed must be an int, an integer scalar or \[B\] "
                                             r"integers .*got shape \[5\]"):
            fw.api.sample_tokens(fw.array(z, "float32"), seed=fw.array(seeds[:5]),
                                 backend=self.BACKEND)

    @pytest.mark.parametrize("temperature,top_k", [(0.7, None), (1.3, 4)])
    def test_stats_temperature(self, rng, temperature, top_k):
        """stats_temperature=1: the token drawn at T (the same as without it), every
        statistic that of softmax(z) (with top_k: the k kept tokens renormalised at 1);
        stats_temperature=T changes nothing; at T = 0 only None or 1 is accepted."""
        z = rng.normal(size=(12, 130)) * 2
        zr = np.asarray(self.fw.numpy(self.fw.array(z, "float32")))
        seed = int(rng.integers(0, 2**31))
        kw = dict(temperature=temperature, top_k=top_k, seed=seed, chunk_size=64)
        at_t = self.sample(z, **kw)
        at_1 = self.sample(z, stats_temperature=1.0, **kw)
        same = self.sample(z, stats_temperature=temperature, **kw)
        assert np.array_equal(at_1[0], at_t[0]) and np.array_equal(at_1[2], at_t[2])
        for g, w in zip(same, at_t):
            assert np.array_equal(g, w)
        want = list(oracle(zr, temperature=1.0, top_k=top_k))  # statistics at T_s = 1
        token = at_t[0].reshape(-1)
        drawn = oracle(zr, temperature=temperature, seed=seed, top_k=top_k)[0]
        assert np.array_equal(token, drawn)
        s = zr.astype(np.float64)
        if top_k is not None:
            kth = np.sort(s, axis=1)[:, -top_k][:, None]
            s = np.where(s >= kth, s, -np.inf)
        logq = s - np.log(np.exp(s - s.max(1, keepdims=True)).sum(1, keepdims=True)) - s.max(
            1, keepdims=True)
        want[0], want[1] = token, logq[np.arange(len(token)), token]
        self.check(at_1, want)
        with pytest.raises(ValueError, match=r"stats_temperature must be None or 1 at "
                                             r"temperature=0"):
            self.fw.api.sample_tokens(self.fw.array(z, "float32"), temperature=0.0,
                                      stats_temperature=0.5, backend=self.BACKEND)

    def test_greedy_ties_go_to_the_lowest_id(self, rng):
        z = np.round(rng.normal(size=(50, 40)))  # integers: many exact ties
        z[:, [7, 23, 31]] = z.max() + 1.0  # three tied maxima in every row
        got = self.sample(z, temperature=0.0, chunk_size=16)
        assert np.all(got[0] == 7) and np.all(got[2] == 7)
        self.check(got, oracle(z, temperature=0.0))

    def test_frequencies_follow_softmax(self, rng):
        """One row of logits repeated over FREQUENCY_ROWS rows: the rows' noise is independent, so the
        token counts follow softmax(z / T) (chi-square at p = 1e-6, Wilson-Hilferty)."""
        k, n, temperature = 8, self.FREQUENCY_ROWS, 0.9
        z = rng.normal(size=k) * 1.5
        seed = int(rng.integers(0, 2**31))
        tokens = self.sample(np.tile(z, (n, 1)), temperature=temperature, seed=seed)[0]
        p = np.exp(z / temperature - np.log(np.exp(z / temperature).sum()))
        counts = np.bincount(tokens.reshape(-1), minlength=k)
        chi2 = float(((counts - n * p) ** 2 / (n * p)).sum())
        df, zq = k - 1, 4.753  # the normal quantile at 1 - 1e-6
        limit = df * (1 - 2 / (9 * df) + zq * math.sqrt(2 / (9 * df))) ** 3
        assert chi2 < limit, f"chi2 {chi2:.1f} >= {limit:.1f} (seed {seed}): counts {counts}"

    def test_top_k_and_suppressed_ids_are_never_drawn(self, rng):
        z = rng.normal(size=(self.STREAM_ROWS, 97)) * 0.3  # flat rows: every id is likely
        suppress = np.array([0, 5, 96])
        fw = self.fw
        got = self.sample(z, temperature=2.0, top_k=4, seed=1, suppress_ids=fw.array(suppress),
                          chunk_size=32)
        zs = z.copy()
        zs[:, suppress] = -np.inf
        top4 = np.argsort(-zs, axis=1, kind="stable")[:, :4]
        assert np.all((got[0][:, None] == top4).any(1)), "drew outside the top k"
        assert not np.isin(got[0], suppress).any(), "drew a suppressed id"
        self.check(got, oracle(z, temperature=2.0, seed=1, top_k=4, suppress=suppress))

    def test_guidance_reads_both_arrays(self, rng):
        z, zu = rng.normal(size=(20, 50)), rng.normal(size=(20, 50))
        fw = self.fw
        got = self.sample(z, temperature=0.5, seed=9, uncond_logits=fw.array(zu, "float32"),
                          cfg_scale=1.5, chunk_size=16)
        self.check(got, oracle(z.astype(np.float32), temperature=0.5, seed=9,
                               zu=zu.astype(np.float32), cfg_scale=1.5))

    def test_one_finite_logit_and_extremes(self, rng):
        z = np.full((4, 30), -np.inf)
        z[0, 11] = 2.0  # all -inf but one: that token, logp 0, entropy 0
        z[1] = rng.normal(size=30) * 1e4  # very large logits: a point mass in float32
        z[2, :] = rng.normal(size=30)
        z[2, 3] = 50.0  # one dominant logit
        got = self.sample(z[:3], temperature=1.0, seed=2, chunk_size=8)
        assert got[0][0] == 11 and got[1][0] == 0.0 and got[5][0] == 0.0
        assert got[4][0] == -np.inf
        # row 1's logits are about 1e4: float32 spacing there is 2^-10, and its log-probs are
        # differences of such values (one row in a few drew a 5e-4 rounding of lse)
        big = float(np.max(np.abs(z[:3][np.isfinite(z[:3])])))
        self.check(got, oracle(z[:3], temperature=1.0, seed=2), scale=big)
        empty = self.sample(z[3:], temperature=1.0)  # nothing finite: token -1, NaN statistics
        assert empty[0][0] == -1 and np.isnan(empty[1][0]) and np.isnan(empty[5][0])

    def test_no_rows(self):
        """[0, K] logits (and [2, 0, K]) give empty fields, with and without top-k."""
        fw = self.fw
        for shape in ((0, 7), (2, 0, 7)):
            for top_k in (None, 3):
                got = fw.api.sample_tokens(fw.array(np.zeros(shape), "float32"), top_k=top_k,
                                           backend=self.BACKEND)
                assert all(tuple(f.shape) == shape[:-1] for f in got), (shape, top_k, got)

    def test_bad_arguments_name_themselves(self):
        fw = self.fw
        z = fw.array(np.zeros((2, 5)), "float32")
        api = fw.api
        with pytest.raises(ValueError, match="top_k must be None or an int in"):
            api.sample_tokens(z, top_k=65, backend=self.BACKEND)
        with pytest.raises(ValueError, match=r"temperature must be 0 \(greedy\) or in"):
            api.sample_tokens(z, temperature=-1.0, backend=self.BACKEND)
        with pytest.raises(ValueError, match="cfg_scale needs uncond_logits"):
            api.sample_tokens(z, cfg_scale=1.0, backend=self.BACKEND)
        with pytest.raises(ValueError, match=r"uncond_logits must have shape logits.shape"):
            api.sample_tokens(z, uncond_logits=fw.array(np.zeros((2, 4)), "float32"),
                              cfg_scale=1.0, backend=self.BACKEND)
        with pytest.raises(TypeError, match="seed must be an int"):
            api.sample_tokens(z, seed=1.5, backend=self.BACKEND)


    def test_far_apart_peaks_and_a_suppressed_chunk(self, rng):
        """Two equal peaks 20 nats above the rest, in the first and the last block: the
        blocks between can be skipped by a kernel's noise bound, the winner lies in either
        end. Then rows whose logits are all near -300 but whose first chunk is suppressed
        (-inf): merging a part with no finite logit must not rescale the others to nothing
        (e^-120 underflows float32, so a merge taking the maximum 0 of the empty part found
        the row empty)."""
        z = rng.normal(size=(24, 300))
        z[:, 2] = z[:, 297] = 20.0
        seed = int(rng.integers(0, 2**31))
        got = self.sample(z, temperature=1.0, seed=seed, chunk_size=64)
        want = oracle(z, temperature=1.0, seed=seed)
        assert set(np.unique(want[0])) == {2, 297}, "the case must draw both peaks"
        self.check(got, want)
        low = (rng.normal(size=(8, 300)) - 120.0).astype(np.float32)
        low[:, :40] = -np.inf
        got = self.sample(low, temperature=1.0, seed=seed, chunk_size=32,
                          suppress_ids=self.fw.array(np.arange(40)))  # chunk 0: all -inf
        self.check(got, oracle(low, temperature=1.0, seed=seed))

    def test_rows_without_a_valid_draw(self, rng):
        """Rows with a NaN logit, a +inf logit, or no finite logit (all -inf), among valid
        rows, drawing with and without top-k and greedily: each gives token -1, argmax -1 and
        NaN statistics (so a NaN confidence), the valid rows draw what the oracle draws, and
        no commit rule ever commits such a row or ranks it above a valid one."""
        b, l, k = 3, 8, 301
        z = rng.normal(size=(b * l, k)) * 2
        bad = {1: "nan", 5: "inf", 9: "-inf", 14: "nan+inf", 20: "inf"}
        for row, what in bad.items():
            if what == "-inf":
                z[row] = -np.inf
            if "nan" in what:
                z[row, rng.integers(k)] = np.nan
            if "inf" in what and what != "-inf":
                z[row, rng.integers(k)] = np.inf
        invalid = np.isin(np.arange(b * l), list(bad))
        masked = np.ones((b, l), bool)
        masked[1] = False
        masked[1, [1, 6]] = True  # sequence 1: only rows without a draw are masked
        masked[2, ::2] = False
        seed = int(rng.integers(0, 2**31))
        for temperature, top_k in ((0.8, None), (0.8, 3), (0.0, None)):
            got = self.sample(z.reshape(b, l, k), temperature=temperature, top_k=top_k,
                              seed=seed, chunk_size=64)
            flat = [g.reshape(-1) for g in got]
            where = f"T={temperature}, top_k={top_k}"
            assert np.all(flat[0][invalid] == -1) and np.all(flat[2][invalid] == -1), where
            for name, g in zip(("logp", "top1", "top2", "entropy"), flat[1:2] + flat[3:]):
                assert np.all(np.isnan(g[invalid])), f"{where}: {name} {g[invalid]}"
            want = oracle(np.where(invalid[:, None], 0.0, z), temperature=temperature,
                          seed=seed, top_k=top_k)
            self.check([g[~invalid] for g in flat], [w[~invalid] for w in want])
            self.check_commits(got, masked, where)

    def check_commits(self, got, masked, where):
        """Every commit mode on this Sample against the oracle, which never commits a row
        whose token is -1."""
        fw = self.fw
        api = fw.api
        b, l = masked.shape
        sample = api.Sample(*(fw.array(g) for g in got))
        canvas = np.full((b, l), 300)
        conf = {"probability": np.exp(got[1]), "margin": np.exp(got[3]) - np.exp(got[4]),
                "neg_entropy": -got[5]}
        kk = np.array([1, 2, 4])
        modes = [("topk", dict(k=1), kind) for kind in conf]
        modes += [("topk", dict(k=3), "probability"), ("topk", dict(k=l), "margin"),
                  ("topk", dict(k=kk), "neg_entropy"),
                  ("threshold", dict(threshold=0.3), "probability"),
                  ("threshold", dict(threshold=2.0), "probability"),  # only the at-least-one
                  ("threshold", dict(threshold=-0.5), "neg_entropy"),
                  ("entropy_budget", dict(budget=1.5), "probability"),
                  ("entropy_budget", dict(budget=0.0), "probability")]
        for rule, arg, kind in modes:
            arr = {n: fw.array(v) if isinstance(v, np.ndarray) else v for n, v in arg.items()}
            new, committed = api.commit_tokens(fw.array(canvas), sample, fw.array(masked),
                                               rule=rule, confidence=kind, **arr)
            want = _commit_oracle(conf[kind], got[5], masked, rule, token=got[0], **arg)
            new, committed = np.asarray(fw.numpy(new)), np.asarray(fw.numpy(committed))
            case = f"{where}, {rule} {arg} {kind}"
            assert np.array_equal(committed, want), f"{case}: committed\n{committed}\nwant\n{want}"
            assert np.array_equal(new, np.where(want, got[0], canvas)), case
            assert not np.any(new == -1), f"{case}: -1 written into the canvas"

    def test_tiny_temperatures(self, rng):
        """Down to MIN_SAMPLING_TEMPERATURE the draw is right: the argmax where one logit leads (the
        T -> 0 limit), one of the tied ids where several share the maximum, and every
        statistic to float32 accuracy against the float64 oracle (tied rows: log-probability
        -log 2 or -log 3, which a normaliser m + log a rounded at m = z / T would lose).
        Below it, temperature raises; 0 is greedy."""
        from dlm_kernels.sampling.core import MIN_SAMPLING_TEMPERATURE

        z = rng.uniform(-3.0, 3.0, size=(16, 301)).astype(np.float32)
        z[:4, [3, 250]] = 4.5  # two tied maxima: s = 4.5 / T
        z[4:6, [0, 64, 300]] = 4.5  # three, one in each end block
        lead = rng.integers(0, 301, size=10)
        z[np.arange(6, 16), lead] = 4.0  # one leader, 1000 nats above the rest at T = 1e-3
        t = MIN_SAMPLING_TEMPERATURE
        seed = int(rng.integers(0, 2**31))
        # under jax.jit as well: XLA on CPU recomputes z / T inside each fusion and contracts
        # it with a subtraction, but every exponent is a logit difference (z - z_max) / T
        # (test_tied_maxima_under_jit)
        got = self.sample(z, temperature=t, seed=seed, chunk_size=64)
        want = oracle(z, temperature=t, seed=seed)
        assert np.array_equal(got[0][6:], lead), "a leading logit must be drawn as T -> 0"
        assert np.all(np.isin(got[0][:4], [3, 250])) and np.all(np.isin(got[0][4:6], [0, 64, 300]))
        assert np.all(got[2][:4] == 3) and np.all(got[2][4:6] == 0)
        assert np.all(np.isfinite(np.stack(got[1:2] + got[3:])))
        # each s = z / T is float32, 2^-24 of |s| ~ 4.5e3 off the oracle's: the differences
        # s - m of the statistics carry that (the check's scale); tied maxima are equal in
        # float32 too, so their log-probabilities, -log 2 and -log 3, are float32-exact (which
        # tied id a row draws rests on keys s + g rounded to 2^-11 here: not compared)
        self.check([g[6:] for g in got], [w[6:] for w in want], scale=4.5 / t)
        for name, i in (("logp", 1), ("top1", 3), ("top2", 4), ("entropy", 5)):
            assert_close(got[i][:6], want[i][:6], "float32", f"tied rows' {name}")
        greedy = self.sample(z, temperature=0.0, chunk_size=64)
        self.check(greedy, oracle(z, temperature=0.0))
        fw = self.fw
        for bad in (1e-6, 1e-8, t / 2, 1e-45, 1e39):
            with pytest.raises(ValueError, match=r"temperature must be 0 \(greedy\) or in "
                                                 r"\[0.001, .*\]; got " + re.escape(repr(bad))):
                fw.api.sample_tokens(fw.array(z[:2], "float32"), temperature=bad,
                                     backend=self.BACKEND)

    def test_suppress_ids_forms_and_range(self, rng):
        """suppress_ids as one int (Python or NumPy), a list or a tuple draws what the array
        does; ids outside [0, K) raise, naming the argument, the id and K; under jax.jit,
        where their values cannot be read, every row then has no valid draw."""
        fw = self.fw
        api = fw.api
        z = fw.array(rng.normal(size=(6, 50)), "float32")
        kw = dict(temperature=0.9, seed=int(rng.integers(0, 2**31)), chunk_size=16,
                  backend=self.BACKEND)
        forms = ((7, [7]), (np.int64(7), [7]), ([7, 49], [7, 49]), ((0, 7), [0, 7]),
                 (np.array([7, 0]), [7, 0]), ([], None))
        if self.BACKEND in ("triton", "pallas"):  # the front end turns every form into the
            forms = forms[2:3]  # one array a backend sees: the native classes check them all
        for ids, same in forms:
            want = api.sample_tokens(z, suppress_ids=None if same is None else
                                     fw.array(np.array(same)), **kw)
            got = api.sample_tokens(z, suppress_ids=ids, **kw)
            for name, g, w in zip(got._fields, got, want):
                assert np.array_equal(np.asarray(fw.numpy(g)), np.asarray(fw.numpy(w))), (ids, name)
        # a CUDA tensor's ids are read (one synchronisation) inside sync_checks() only;
        # outside it every row has no valid draw (below)
        on_device = self.FW == "torch" and fw.device != "cpu"
        for ids, bad, at in ((50, 50, 0), (-1, -1, 0), ([3, 50], 50, 1),
                             (fw.array(np.array([7, -3])), -3, 1)):
            read = api.sync_checks() if on_device else contextlib.nullcontext()
            with read, pytest.raises(ValueError, match=r"suppress_ids must be token ids in "
                                                       r"\[0, K\) = \[0, 50\) \(K: the "
                                                       rf"vocabulary size\); got {bad} at "
                                                       rf"index {at}$"):
                api.sample_tokens(z, suppress_ids=ids, **kw)
        if on_device:
            out = api.sample_tokens(z, suppress_ids=fw.array(np.array([7, 50])), **kw)
            assert np.all(fw.numpy(out.token) == -1) and np.all(fw.numpy(out.argmax) == -1)
            assert np.all(np.isnan(fw.numpy(out.logp)))
            assert np.all(np.isnan(fw.numpy(out.entropy)))
        with pytest.raises(TypeError, match="suppress_ids must be integer token ids"):
            api.sample_tokens(z, suppress_ids=[1.5], **kw)
        if self.FW == "jax":
            import jax

            step = jax.jit(lambda z, ids: api.sample_tokens(z, suppress_ids=ids, **kw))
            ok = step(z, fw.array(np.array([7, 0])))
            assert np.array_equal(np.asarray(ok.token), np.asarray(
                api.sample_tokens(z, suppress_ids=[7, 0], **kw).token))
            out = step(z, fw.array(np.array([7, 50])))
            assert np.all(np.asarray(out.token) == -1) and np.all(np.asarray(out.argmax) == -1)
            assert np.all(np.isnan(np.asarray(out.logp)))
            assert np.all(np.isnan(np.asarray(out.entropy)))

    def test_unread_suppress_ids_out_of_range_leave_no_valid_draw(self, rng, monkeypatch):
        """Where an id array's values are not read (a CUDA tensor outside sync_checks(),
        here simulated on CPU), an id outside [0, K) makes every row one without a valid
        draw (token and argmax -1, NaN logp and entropy), never a plausible draw that
        suppressed the wrong tokens; ids in range draw as when read."""
        if self.FW != "torch":
            pytest.skip("JAX: the same path under jit (test_suppress_ids_forms_and_range)")
        from dlm_kernels.sampling import core

        fw, api = self.fw, self.fw.api
        z = fw.array(rng.normal(size=(6, 50)), "float32")
        kw = dict(temperature=0.9, seed=int(rng.integers(0, 2**31)), chunk_size=16,
                  backend=self.BACKEND)
        want = api.sample_tokens(z, suppress_ids=fw.array(np.array([7, 0])), **kw)
        monkeypatch.setattr(core, "host_values", lambda xp, x, allow_sync=False: None)
        ok = api.sample_tokens(z, suppress_ids=fw.array(np.array([7, 0])), **kw)
        for name, g, w in zip(ok._fields, ok, want):
            assert np.array_equal(fw.numpy(g), fw.numpy(w), equal_nan=True), name
        for bad in ([7, 50], [-1, 3]):
            out = api.sample_tokens(z, suppress_ids=fw.array(np.array(bad)), **kw)
            assert np.all(fw.numpy(out.token) == -1) and np.all(fw.numpy(out.argmax) == -1), bad
            assert np.all(np.isnan(fw.numpy(out.logp))), bad
            assert np.all(np.isnan(fw.numpy(out.entropy))), bad


class HeadSampling:
    """sample_tokens(LinearHead): the front end feeds token chunks of logits to the backend's
    sampler like any logits, so the framework-native classes check it and the kernels'
    classes (whose sampler sees only [R, K] logits) do not repeat it."""

    def test_linear_head_samples_as_its_logits(self, rng):
        """sample_tokens(LinearHead(h, W)) draws exactly what sample_tokens(h @ W) draws, over
        token chunks of 4 rows (a ragged last one), with top-k, suppressed ids and guidance
        from an unconditional head (the logits' chunks lead: its own 3 rows are not used)
        or array, and from a head beside logits given as an array; then the oracle. Dyadic inputs make the
        logits exact, so every field matches bit for bit."""
        fw = self.fw
        api = fw.api
        layout = api.LinearHead.DEFAULT_LAYOUT
        h, hu = (rng.integers(-2, 3, (3, 7, 19)) / 4 for _ in range(2))
        w = rng.integers(-2, 3, (301, 19)) / 4  # [K, D]
        wl = fw.array(w if layout == "KD" else w.T, "float32")
        head = lambda a, r=4: api.LinearHead(fw.array(a, "float32"), wl, row_chunk=r)
        kw = dict(temperature=0.9, seed=int(rng.integers(0, 2**31)), step=2, top_k=5,
                  suppress_ids=fw.array(np.array([0, 1])), cfg_scale=1.5, chunk_size=64,
                  backend=self.BACKEND)
        z, zu = h @ w.T, hu @ w.T
        want = api.sample_tokens(fw.array(z, "float32"), uncond_logits=fw.array(zu, "float32"),
                                 **kw)
        for logits, uncond in ((head(h), head(hu, 3)), (head(h), fw.array(zu, "float32")),
                               (fw.array(z, "float32"), head(hu))):
            got = api.sample_tokens(logits, uncond_logits=uncond, **kw)
            for name, g, e in zip(got._fields, got, want):
                g, e = np.asarray(fw.numpy(g)), np.asarray(fw.numpy(e))
                assert np.array_equal(g, e, equal_nan=True), f"{name} differs from the logits'"
        self.check([np.asarray(fw.numpy(x)) for x in got],
                   oracle(z.reshape(21, -1), temperature=0.9, seed=kw["seed"], step=2, top_k=5,
                          suppress=np.array([0, 1]), zu=zu.reshape(21, -1), cfg_scale=1.5))
        with pytest.raises(ValueError, match=r"logits.weight must have shape"):
            api.sample_tokens(api.LinearHead(fw.array(h, "float32"), fw.array(w[:, :5], "float32"),
                                             weight_layout="KD"), backend=self.BACKEND)


needs_interpreter = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1" and not _on_gpu(),
    reason="the Triton kernels need a GPU or TRITON_INTERPRET=1")


class TestTorchReference(HeadSampling, SamplingSuite):
    FW, BACKEND = "torch", "reference"
    dtype = cases("float32")


class TestTorchChunked(HeadSampling, SamplingSuite):
    FW, BACKEND = "torch", "chunked"


@needs_interpreter
class TestTorchTriton(SamplingSuite):
    """The Triton kernel: K = 301 in blocks of 64 gives two vocabulary splits, each with
    whole blocks and a ragged tail (and the launch heuristic where no chunk_size is given)."""

    FW, BACKEND = "torch", "triton"
    STREAM_ROWS = 64  # the interpreter runs one program per row and split

    def test_frequencies_follow_softmax(self, rng):
        if os.environ.get("TRITON_INTERPRET") == "1":
            pytest.skip("40000 interpreted programs; the interpreted kernel's tokens equal the "
                        "oracle's exactly (test_matches_oracle), whose frequencies the chunked "
                        "classes check; compiled kernels run it")
        SamplingSuite.test_frequencies_follow_softmax(self, rng)


@needs_interpreter
@pytest.mark.usefixtures("jax_triton_on_cpu")
class TestJaxTritonEmulated:
    """The JAX launch wiring of the same kernel (argument order, the vmap fold, the buffers'
    axes, suppressed ids and guidance as arrays): the suite's tests that pass every input;
    the kernel's edge cases are TestTorchTriton's."""

    FW, BACKEND = "jax", "triton"
    dtype = cases("bfloat16")  # float32: TestTorchTriton
    STREAM_ROWS = 16
    fw, sample, check = SamplingSuite.fw, SamplingSuite.sample, SamplingSuite.check

    def test_greedy_matches_oracle(self, rng):
        """The greedy launch (drawing: the two tests below)."""
        SamplingSuite.test_matches_oracle(self, rng, "bfloat16", 0.0, None)

    test_top_k_and_suppressed_ids_are_never_drawn = (
        SamplingSuite.test_top_k_and_suppressed_ids_are_never_drawn)
    test_guidance_reads_both_arrays = SamplingSuite.test_guidance_reads_both_arrays
    test_no_rows = SamplingSuite.test_no_rows
    test_rows_without_a_valid_draw = SamplingSuite.test_rows_without_a_valid_draw
    check_commits = SamplingSuite.check_commits
    test_tiny_temperatures = SamplingSuite.test_tiny_temperatures
    test_suppress_ids_forms_and_range = SamplingSuite.test_suppress_ids_forms_and_range
    test_per_sequence_seeds_are_batch_invariant = (
        SamplingSuite.test_per_sequence_seeds_are_batch_invariant)
    test_stats_temperature = SamplingSuite.test_stats_temperature


class TestJaxPallas(SamplingSuite):
    """The Pallas kernel in TPU interpret mode (outputs start as NaN): K = 301 in blocks of
    128, a ragged last block."""

    FW, BACKEND = "jax", "pallas"

    def test_frequencies_follow_softmax(self, rng):
        if interpret_mode():
            pytest.skip("interpreted, its tokens equal the oracle's exactly "
                        "(test_matches_oracle), whose frequencies the chunked classes check")
        SamplingSuite.test_frequencies_follow_softmax(self, rng)


class TestJaxReference(HeadSampling, SamplingSuite):
    FW, BACKEND = "jax", "reference"
    dtype = cases("float32")


class TestJaxChunked(HeadSampling, SamplingSuite):
    FW, BACKEND = "jax", "chunked"


@pytest.mark.parametrize("fw_name", ["torch", "jax"])
def test_uniform_stays_inside_zero_one(fw_name):
    """The noise's uniform at the extreme hashes, 0 and 2^32 - 1, is strictly inside (0, 1)
    in float32, so the Gumbel noise is finite: with u = 1 one column of a row would be drawn
    whatever its probability (a 24-bit uniform rounded its largest value to 1.0)."""
    import importlib

    from dlm_kernels.sampling import core as _sampling

    fw = framework(fw_name)
    ops = importlib.import_module(f"dlm_kernels._{fw_name}.ops")
    xp = ops.TorchOps if fw_name == "torch" else ops.JaxOps
    # the 32-bit patterns 0, 2^31 - 1, 2^31 and 2^32 - 1
    h = xp.u32(fw.array(np.array([0, 2**31 - 1, -2**31, -1], np.int32)))
    u32 = _sampling.open_uniform(xp, h)
    assert "float32" in str(u32.dtype), u32.dtype
    u = np.asarray(fw.numpy(u32), np.float64)
    assert np.all((u > 0) & (u < 1)), u
    assert u[0] == 2.0 ** -24 and u[-1] == 1 - 2.0 ** -24, u
    assert np.all(np.isfinite(-np.log(-np.log(u.astype(np.float32))))), u


@pytest.mark.parametrize("top_k", [None, 8])
def test_pallas_sampler_lowers_for_tpu(monkeypatch, top_k):
    """One step at B·L = 16384, K = 262144, bf16, with guidance and suppressed ids, builds its
    Mosaic kernel for TPU on any machine (the TPU compiler's own passes run on a TPU)."""
    import jax
    import jax.numpy as jnp

    api = framework("jax").api
    monkeypatch.setenv("DLM_KERNELS_PALLAS_INTERPRET", "0")
    n, k = 16384, 262144

    def step(z, zu, suppress):
        return api.sample_tokens(z, temperature=0.8, seed=1, step=2, top_k=top_k,
                                 suppress_ids=suppress, uncond_logits=zu, cfg_scale=1.5,
                                 backend="pallas")

    args = (jax.ShapeDtypeStruct((n, k), jnp.bfloat16),
            jax.ShapeDtypeStruct((n, k), jnp.bfloat16), jax.ShapeDtypeStruct((2,), jnp.int32))
    text = jax.jit(step).trace(*args).lower(lowering_platforms=("tpu",)).as_text()
    assert text.count("tpu_custom_call") == 1, "one Mosaic kernel expected"


def test_same_seed_same_tokens_on_every_backend(rng):
    """The same (seed, step) draws the same tokens in both frameworks on every backend with a
    sampler here (the Triton kernel where it runs: a GPU or its interpreter)."""
    z = rng.normal(size=(24, 257)) * 2
    backends = {"torch": ["reference", "chunked"], "jax": ["reference", "chunked"]}
    if os.environ.get("TRITON_INTERPRET") == "1" or _on_gpu():
        backends["torch"].append("triton")
    if framework("jax").jax.default_backend() != "gpu":  # Pallas: TPU, or interpreted on CPU
        backends["jax"].append("pallas")
    tokens = {}
    for name, names in backends.items():
        fw = framework(name)
        for backend in names:
            s = fw.api.sample_tokens(fw.array(z, "float32"), temperature=0.8, seed=42, step=7,
                                     backend=backend, chunk_size=100)
            tokens[name, backend] = np.asarray(fw.numpy(s.token))
    first = tokens["torch", "reference"]
    for where, t in tokens.items():
        assert np.array_equal(t, first), f"{where}: {np.sum(t != first)} rows differ"
    torch_fw = framework("torch")  # arrays on the suite's device; fw.numpy brings them back
    other = torch_fw.api.sample_tokens(torch_fw.array(z, "float32"), seed=42, step=8)
    assert not np.array_equal(np.asarray(torch_fw.numpy(other.token)), first), (
        "step must change the draw")


@pytest.mark.parametrize("backend", ["reference", "chunked"])
@pytest.mark.parametrize("stats_temperature", [None, 2e-3])
def test_tied_maxima_under_jit(rng, backend, stats_temperature):
    """Two and three tied maxima at the smallest temperature keep their exact statistics
    under jit (log-probabilities -log n, entropy log n), with the statistics at the draw's
    temperature or their own, ties inside a chunk and across chunks. XLA on CPU recomputes
    s = z / T as z·(1/T) inside each fusion and contracts it with s - m into one fused
    multiply-add: a tie got s - m = 2e-4 (log-probability -0.69325 for -log 2) until the
    exponents were formed from logit differences (z - z_max) / T (docs/design.md §3)."""
    import jax

    api = framework("jax").api
    z = rng.uniform(-3.0, 3.0, size=(4, 301)).astype(np.float32)
    z[:, [3, 250]] = 4.5
    z[2:, 40] = 4.5  # rows 2 and 3: a three-way tie, two of it in one chunk
    draw = jax.jit(lambda z: api.sample_tokens(z, temperature=1e-3, seed=1, chunk_size=64,
                                               stats_temperature=stats_temperature,
                                               backend=backend))
    got = draw(framework("jax").array(z))
    log_n = np.log([2.0, 2.0, 3.0, 3.0])
    assert np.all(np.isin(np.asarray(got.token), [3, 40, 250]))
    for name in ("logp", "top1_logp", "top2_logp"):
        assert_close(np.asarray(getattr(got, name), np.float64), -log_n, "float32",
                     f"{name} of tied maxima")
    assert_close(np.asarray(got.entropy, np.float64), log_n, "float32", "entropy of ties")


def test_jax_sampler_under_jit_and_vmap(rng):
    import jax
    import jax.numpy as jnp

    api = framework("jax").api
    z = jnp.asarray(rng.normal(size=(3, 4, 50)), jnp.float32)
    eager = api.sample_tokens(z, seed=5, step=2)
    jitted = jax.jit(lambda z, step: api.sample_tokens(z, seed=5, step=step))(z, jnp.int32(2))
    assert np.array_equal(np.asarray(eager.token), np.asarray(jitted.token))
    mapped = jax.vmap(lambda zz: api.sample_tokens(zz, temperature=0.0).token)(z)
    assert np.array_equal(np.asarray(mapped), np.argmax(np.asarray(z), axis=-1))
    # a LinearHead (a pytree) through jit, in token chunks
    h = jnp.asarray(rng.integers(-2, 3, (3, 4, 8)) / 4, jnp.float32)
    w = jnp.asarray(rng.integers(-2, 3, (8, 50)) / 4, jnp.float32)  # [D, K]
    fn = lambda head: api.sample_tokens(head, seed=5, step=2).token
    jitted = jax.jit(fn)(api.LinearHead(h, w, row_chunk=5))
    assert np.array_equal(np.asarray(jitted), np.asarray(fn(api.LinearHead(h, w))))
    assert np.array_equal(np.asarray(jitted), np.asarray(api.sample_tokens(h @ w, seed=5,
                                                                          step=2).token))


# -- commit_tokens ----------------------------------------------------------------------------

def _commit_oracle(conf, entropy, masked, rule, k=None, threshold=None, budget=None,
                   token=None):
    """The positions a rule commits; a row whose token is -1 (no valid draw) never is."""
    b, l = conf.shape
    out = np.zeros((b, l), bool)
    eligible = masked if token is None else masked & (token >= 0)
    for i in range(b):
        idx = np.flatnonzero(eligible[i])
        if idx.size == 0:
            continue
        if rule == "topk":
            kk = k[i] if np.ndim(k) else k
            order = idx[np.argsort(-conf[i, idx], kind="stable")]
            out[i, order[:kk]] = True
        elif rule == "threshold":
            th = threshold[i] if np.ndim(threshold) else threshold
            hit = idx[conf[i, idx] > th]
            out[i, hit if hit.size else idx[np.argmax(conf[i, idx])]] = True
        else:
            order = idx[np.argsort(entropy[i, idx], kind="stable")]
            cum = np.cumsum(entropy[i, order])
            chosen = order[cum <= budget]
            out[i, chosen if chosen.size else order[:1]] = True
    return out


@pytest.mark.parametrize("name", ["torch", "jax"])
@pytest.mark.parametrize("rule,kind", [("topk", "probability"), ("topk", "margin"),
                                       ("threshold", "neg_entropy"), ("threshold", "probability"),
                                       ("entropy_budget", "probability")])
def test_commit_rules(rng, name, rule, kind):
    fw = framework(name)
    api = fw.api
    b, l, k = 4, 12, 30
    z = rng.normal(size=(b, l, k)) * 2
    s = api.sample_tokens(fw.array(z, "float32"), temperature=0.8, seed=3)
    masked = rng.uniform(size=(b, l)) < 0.6
    masked[-1] = False  # a finished sequence commits nothing
    canvas = np.full((b, l), k - 1)
    sample = [np.asarray(fw.numpy(x)) for x in s]
    conf = {"probability": np.exp(sample[1]), "margin": np.exp(sample[3]) - np.exp(sample[4]),
            "neg_entropy": -sample[5]}[kind]
    kk = np.array([1, 3, 0, 2])
    threshold = float(np.median(conf))
    new, committed = api.commit_tokens(fw.array(canvas), s, fw.array(masked), rule=rule,
                                       k=fw.array(kk) if rule == "topk" else None,
                                       threshold=threshold, budget=1.5, confidence=kind)
    want = _commit_oracle(conf, sample[5], masked, rule, k=kk, threshold=threshold, budget=1.5)
    assert np.array_equal(np.asarray(fw.numpy(committed)), want)
    assert np.array_equal(np.asarray(fw.numpy(new)), np.where(want, sample[0], canvas))


@pytest.mark.parametrize("name", ["torch", "jax"])
def test_inclusive_threshold(rng, name):
    """rule="threshold" with inclusive=True commits a confidence equal to the threshold (as
    Fast-dLLM's and Megatron-Bridge's get_transfer_index do), the default (>) does not;
    inclusive must be a bool."""
    fw = framework(name)
    api = fw.api
    s, masked, sample = _commit_case(rng, fw)
    masked[:, :2] = True
    # the confidences exactly as commit_tokens forms them: the framework's own exp (a host
    # np.exp can differ by an ulp, and the threshold sits on one of these values)
    exp = fw.torch.exp if name == "torch" else fw.jnp.exp
    conf = np.asarray(fw.numpy(exp(s.logp)))
    canvas, m = fw.array(np.zeros((4, 12), np.int32)), fw.array(masked)
    for row in range(4):  # the threshold at the row's second most confident masked position
        th = float(np.sort(conf[row][masked[row]])[-2])
        got = {inc: np.asarray(fw.numpy(api.commit_tokens(
            canvas, s, m, rule="threshold", threshold=th, inclusive=inc)[1]))[row]
            for inc in (False, True)}
        at = masked[row] & (conf[row] == th)
        assert got[True][at].all() and not got[False][at].any(), (row, th, got)
        assert np.array_equal(got[True], masked[row] & (conf[row] >= th)), row
    with pytest.raises(TypeError, match=r"inclusive must be True or False; got 1"):
        api.commit_tokens(canvas, s, m, rule="threshold", threshold=0.5, inclusive=1)


def _running_sum(e, name):
    """The float32 running sum of e as the framework's cumsum on a CPU forms it: torch
    accumulates in float64 and rounds each prefix to float32 (its CPU accumulation type for
    float32); JAX adds in float32, one rounding per step, in order."""
    if name == "torch":
        return np.cumsum(e.astype(np.float64)).astype(np.float32)
    run = np.zeros_like(e)
    acc = np.float32(0.0)
    for j, v in enumerate(e):
        acc = np.float32(acc + v)
        run[j] = acc
    return run


def _exclusive_budget_oracle(entropy, eligible, budget, name):
    """DiffusionGemma's acceptance (transformers' EntropyBoundSampler.accept_canvas) over the
    eligible positions: sort by entropy (ties: the lower position), the framework's float32
    running sum (``_running_sum``: transformers' torch.cumsum), less each position's own
    entropy, <= budget; at least the lowest entropy."""
    out = np.zeros(entropy.shape, bool)
    for i in range(entropy.shape[0]):
        idx = np.flatnonzero(eligible[i])
        if idx.size == 0:
            continue
        order = idx[np.argsort(entropy[i, idx], kind="stable")]
        e = entropy[i, order].astype(np.float32)
        run = _running_sum(e, name)
        before = (run - e).astype(np.float32)
        b = budget[i] if np.ndim(budget) else budget
        chosen = order[before <= np.float32(b)]
        out[i, chosen if chosen.size else order[:1]] = True
    return out


@pytest.mark.parametrize("name", ["torch", "jax"])
def test_exclusive_entropy_budget(rng, name):
    """rule="entropy_budget" with exclusive=True commits the k lowest entropies whose k - 1
    lowest sum to at most the budget (DiffusionGemma's sampler in transformers), the running
    sum less each one's own in float32: a budget sitting exactly on that value for the third
    commits three, the default (the whole sum, its own included) at most two. exclusive
    must be a bool and applies to rule="entropy_budget" only."""
    fw = framework(name)
    api = fw.api
    s, masked, sample = _commit_case(rng, fw)
    masked[:, :3] = True
    ent = sample[5].astype(np.float32)
    canvas, m = fw.array(np.zeros((4, 12), np.int32)), fw.array(masked)
    budgets = []
    for row in range(4):  # the budget on the exclusive sum of the row's third-lowest masked
        order = np.flatnonzero(masked[row])[np.argsort(ent[row][masked[row]], kind="stable")]
        e = ent[row, order]
        run = _running_sum(e, name)
        budgets.append(float(np.float32(run[2] - e[2])))
    budgets = np.array(budgets, np.float32)
    for budget in (budgets, float(budgets[0]), 1e-30, 1.5):
        arg = fw.array(budget) if np.ndim(budget) else budget
        got = np.asarray(fw.numpy(api.commit_tokens(canvas, s, m, rule="entropy_budget",
                                                    budget=arg, exclusive=True)[1]))
        want = _exclusive_budget_oracle(ent, masked, budget, name)
        assert np.array_equal(got, want), (budget, np.argwhere(got != want)[:1], got, want)
        default = np.asarray(fw.numpy(api.commit_tokens(canvas, s, m, rule="entropy_budget",
                                                        budget=arg)[1]))
        assert (got | default).sum() == got.sum(), "exclusive commits a superset"
        if budget is budgets:
            assert (got.sum(1) == 3).all(), got.sum(1)
            # the default's sum through the second, run[1], may round a hair above run[2] - e[2]
            assert ((default.sum(1) >= 1) & (default.sum(1) <= 2)).all(), default.sum(1)
    with pytest.raises(TypeError, match=r"exclusive must be True or False; got 1"):
        api.commit_tokens(canvas, s, m, rule="entropy_budget", budget=0.5, exclusive=1)
    with pytest.raises(ValueError, match=r"exclusive=True applies to rule='entropy_budget' "
                                         r"only; got rule='topk'"):
        api.commit_tokens(canvas, s, m, rule="topk", k=1, exclusive=True)


@pytest.mark.parametrize("name", ["torch", "jax"])
def test_numpy_scalars_are_numbers(rng, name):
    """Every number argument of sample_tokens and commit_tokens takes a NumPy scalar as it
    takes the Python number."""
    fw = framework(name)
    api = fw.api
    z, zu = (fw.array(rng.normal(size=(2, 5, 40)), "float32") for _ in range(2))
    py = dict(temperature=0.5, top_k=3, seed=5, step=2, cfg_scale=1.5, chunk_size=16)
    npy = dict(temperature=np.float32(0.5), top_k=np.int64(3), seed=np.int64(5),
               step=np.int32(2), cfg_scale=np.float64(1.5), chunk_size=np.int64(16))
    # JAX: each call traced into one program (the numbers are read as it is traced)
    run = (lambda f, *args: fw.jax.jit(f)(*args)) if name == "jax" else (lambda f, *args: f(*args))
    want = run(lambda z, zu: api.sample_tokens(z, uncond_logits=zu, **py), z, zu)
    got = run(lambda z, zu: api.sample_tokens(z, uncond_logits=zu, **npy), z, zu)
    for f, g, w in zip(got._fields, got, want):
        assert np.array_equal(np.asarray(fw.numpy(g)), np.asarray(fw.numpy(w))), f
    canvas, masked = fw.array(np.zeros((2, 5), np.int32)), fw.array(np.ones((2, 5), bool))
    for rule, a, b in (("topk", dict(k=2), dict(k=np.int64(2))),
                       ("threshold", dict(threshold=0.3), dict(threshold=np.float32(0.3))),
                       ("entropy_budget", dict(budget=1.0), dict(budget=np.float64(1.0)))):
        want = run(lambda s: api.commit_tokens(canvas, s, masked, rule=rule, **a)[1], got)
        have = run(lambda s: api.commit_tokens(canvas, s, masked, rule=rule, **b)[1], got)
        assert np.array_equal(np.asarray(fw.numpy(have)), np.asarray(fw.numpy(want))), rule


def _commit_case(rng, fw, b=4, l=12, k=30):
    s = fw.api.sample_tokens(fw.array(rng.normal(size=(b, l, k)) * 2, "float32"),
                             temperature=0.8, seed=3)
    masked = rng.uniform(size=(b, l)) < 0.7
    return s, masked, [np.asarray(fw.numpy(x)) for x in s]


@pytest.mark.parametrize("name", ["torch", "jax"])
def test_commit_arguments_name_themselves(rng, name):
    """Bad k, threshold and budget values raise, naming the argument and the value (and its
    index) or the shape seen; a [B] threshold or budget is one per sequence, a 0-d k is every
    sequence's."""
    fw = framework(name)
    api = fw.api
    s, masked, sample = _commit_case(rng, fw)
    canvas, m = fw.array(np.zeros((4, 12), np.int32)), fw.array(masked)
    commit = lambda **kw: api.commit_tokens(canvas, s, m, **kw)  # noqa: E731
    with pytest.raises(ValueError, match=r"k must be >= 0 \(positions to commit per sequence\); "
                                         r"got -1 at index \(1,\)$"):
        commit(rule="topk", k=fw.array(np.array([2, -1, 0, 3])))
    with pytest.raises(ValueError, match=r"k must be >= 0 .*; got -2$"):
        commit(rule="topk", k=np.int64(-2))
    with pytest.raises(TypeError, match=r"k must be an int or an array of shape \[\] or \[B\] = "
                                        r"\[4\]; got float"):
        commit(rule="topk", k=1.5)
    for arg, rule in (("threshold", "threshold"), ("budget", "entropy_budget")):
        for bad in (float("nan"), np.float32("nan")):
            with pytest.raises(ValueError, match=rf"{arg} must be a number \(not NaN\); got nan$"):
                commit(rule=rule, **{arg: bad})
        with pytest.raises(ValueError, match=rf"{arg} must be a number \(not NaN\); got nan at "
                                             rf"index \(2,\)$"):
            commit(rule=rule, **{arg: fw.array(np.array([0.5, 0.5, np.nan, 0.5]))})
        with pytest.raises(ValueError, match=rf"{arg} must be a number or have shape \[\] or \[B\] "
                                             rf"= \[4\] \(one per sequence\); got shape \[4, 12\]"):
            commit(rule=rule, **{arg: fw.array(np.full((4, 12), 0.5))})
    conf = np.exp(sample[1])
    thresholds = np.array([0.2, 0.5, 0.9, 2.0])
    budgets = np.array([0.5, 3.0, 0.0, 1.0])
    for rule, arg, want in (
            ("threshold", dict(threshold=fw.array(thresholds)),
             _commit_oracle(conf, sample[5], masked, "threshold", threshold=thresholds)),
            ("entropy_budget", dict(budget=fw.array(budgets)),
             np.stack([_commit_oracle(conf, sample[5], masked, "entropy_budget", budget=v)[i]
                       for i, v in enumerate(budgets)])),
            ("topk", dict(k=fw.array(np.array(3))),
             _commit_oracle(conf, sample[5], masked, "topk", k=3))):
        got = np.asarray(fw.numpy(commit(rule=rule, **arg)[1]))
        assert np.array_equal(got, want), rule


def _traced(name, fn):
    """fn under jax.jit, or torch.compile(fullgraph=True): its arguments' values unreadable."""
    if name == "jax":
        import jax

        return jax.jit(fn)
    import torch

    return torch.compile(fn, fullgraph=True, backend="aot_eager")


@pytest.mark.parametrize("name", ["torch", "jax"])
def test_unreadable_arguments_commit_nothing(rng, name):
    """Traced k, threshold and budget cannot be checked: a sequence whose k is negative or
    whose threshold or budget is NaN commits nothing; the others commit as the oracle does.
    A traced suppressed id outside [0, K) leaves every row without a valid draw (torch.compile
    here; jax.jit on every JAX backend in the suites)."""
    fw = framework(name)
    api = fw.api
    s, masked, sample = _commit_case(rng, fw)
    canvas = fw.array(np.zeros((4, 12), np.int32))
    conf = np.exp(sample[1])
    step = _traced(name, lambda s, m, k, t, b: tuple(
        api.commit_tokens(canvas, s, m, rule=rule, **arg)[1]
        for rule, arg in (("topk", dict(k=k)), ("threshold", dict(threshold=t)),
                          ("entropy_budget", dict(budget=b)))))
    k, t = np.array([2, -1, 3, 1]), np.array([0.3, np.nan, 0.6, 0.9])
    b = np.array([1.0, 2.0, np.nan, 0.5])
    got = [np.asarray(fw.numpy(x)) for x in step(s, fw.array(masked), fw.array(k), fw.array(t),
                                                  fw.array(b))]
    wants = [_commit_oracle(conf, sample[5], masked, "topk", k=np.maximum(k, 0)),
             _commit_oracle(conf, sample[5], masked, "threshold", threshold=np.nan_to_num(t)),
             np.stack([_commit_oracle(conf, sample[5], masked, "entropy_budget", budget=v)[i]
                       for i, v in enumerate(np.nan_to_num(b))])]
    for rule, g, w, bad in zip(("topk", "threshold", "entropy_budget"), got, wants, (1, 1, 2)):
        w[bad] = False
        assert np.array_equal(g, w), rule
        assert masked[bad].any() and not g[bad].any(), rule
    if name == "torch":
        draw = _traced(name, lambda z, ids: api.sample_tokens(z, suppress_ids=ids,
                                                              backend="reference"))
        z = fw.array(rng.normal(size=(3, 20)), "float32")
        ok, out = draw(z, fw.array(np.array([2, 5]))), draw(z, fw.array(np.array([2, 20])))
        assert np.all(np.asarray(fw.numpy(ok.token)) >= 0) and ok.vocab_size == 20
        assert np.all(np.asarray(fw.numpy(out.token)) == -1)
        assert np.all(np.isnan(np.asarray(fw.numpy(out.logp))))


@pytest.mark.parametrize("name", ["torch", "jax"])
def test_canvas_must_hold_the_vocabulary(rng, name):
    """A canvas whose dtype cannot hold ids up to K - 1 raises, naming canvas, its dtype and
    K (at trace time under jax.jit; the Sample keeps K through jit and pytree maps), where it
    would have wrapped an id (int8: 142 -> -114); a Sample built without vocab_size asks for
    a canvas that holds int32."""
    fw = framework(name)
    api = fw.api
    z = rng.normal(size=(2, 6, 300))
    z[:, :, 142] = 50.0  # every position draws 142
    s = api.sample_tokens(fw.array(z, "float32"), temperature=0.0)
    masked = fw.array(np.ones((2, 6), bool))
    canvas8 = fw.array(np.zeros((2, 6), np.int8))
    message = (r"canvas \(int8\) cannot hold the vocabulary's ids: K = 300 \(ids up to 299\) but "
               r"int8 holds at most 127")
    with pytest.raises(ValueError, match=message):
        api.commit_tokens(canvas8, s, masked, k=6)
    assert s.vocab_size == 300
    new, _ = api.commit_tokens(fw.array(np.zeros((2, 6), np.int16)), s, masked, k=6)
    assert np.all(np.asarray(fw.numpy(new)) == 142)
    small = api.sample_tokens(fw.array(z[:, :, :256], "float32"), temperature=0.0)
    new, _ = api.commit_tokens(fw.array(np.zeros((2, 6), np.uint8)), small, masked, k=6)
    assert np.all(np.asarray(fw.numpy(new)) == 142)
    bare = api.Sample(*s)
    assert bare.vocab_size is None and s._replace(token=s.argmax).vocab_size == 300
    with pytest.raises(ValueError, match=r"canvas \(int16\) may not hold sample.token's int32 ids"):
        api.commit_tokens(fw.array(np.zeros((2, 6), np.int16)), bare, masked, k=6)
    if name == "jax":
        import jax

        with pytest.raises(ValueError, match=message):
            jax.jit(lambda z, c: api.commit_tokens(c, api.sample_tokens(z), masked, k=2))(
                fw.array(z, "float32"), canvas8)
        out = jax.jit(lambda z: api.sample_tokens(z, temperature=0.0))(fw.array(z, "float32"))
        assert out.vocab_size == 300 and jax.tree.map(lambda x: x, out).vocab_size == 300
        with pytest.raises(ValueError, match=message):
            api.commit_tokens(canvas8, out, masked, k=6)


def test_examples_generate(tmp_path):
    """examples/generate_*.py: a full denoising loop with a tiny random model, both frameworks."""
    import os
    import subprocess
    import sys

    root = os.path.join(os.path.dirname(__file__), "..", "..")  # the repository, above tests/sampling/
    for script in ("generate_torch.py", "generate_jax.py"):
        out = subprocess.run([sys.executable, os.path.join(root, "examples", script)],
                             capture_output=True, text=True, check=True, cwd=tmp_path)
        assert "masked left: 0" in out.stdout, out.stdout
