"""``policy_loss`` (TRL GRPOTrainer's loss family) on every backend, both frameworks: the loss,
TRL's metrics and the gradients (of logits; of a linear head's hidden states and weight)
against a float64 NumPy oracle of the formulas written out below; the on-policy ratio is
exactly 1; inactive positions take no part; every error; NaN where values cannot be read."""

from __future__ import annotations

import importlib.util
import os

import numpy as np
import pytest

import oracle
from harness import assert_close, assert_exact_zero, cases, framework
from linear_head.suite import dyadic, matmul_slack

B, L, K = 3, 7, 41
T = 0.8
_TRITON = importlib.util.find_spec("triton") is not None
_INTERPRETED = _TRITON and os.environ.get("TRITON_INTERPRET") == "1"


# -- the oracle: TRL's formulas in float64 -----------------------------------------------------

def _policy(lp, lp_frozen, ent, w, old, adv, ref, o):
    """(loss, metrics) of TRL's ``_compute_loss`` in float64 NumPy. ``lp`` [B, L] is the
    variable log-prob, ``lp_frozen`` the same values where TRL detaches them (the on-policy
    old log-probs, CISPO's capped ratio); weights ``w`` [B, L]; ``o`` the options."""
    b, length = lp.shape
    act = w != 0
    old = lp_frozen if old is None else old
    eps, eh = o.get("epsilon", 0.2), o.get("epsilon_high", o.get("epsilon", 0.2))
    delta, beta = o.get("delta"), o.get("beta", 0.0)
    seq = o.get("importance_sampling_level", "token") == "sequence"
    n_b = w.sum(axis=1)

    def ratio(x):
        lr = np.where(act, x - old, 0.0)
        if seq:
            return np.exp((lr * w).sum(axis=1) / np.maximum(n_b, 1.0))[:, None]  # [B, 1]
        return np.exp(lr)

    r, r_frozen = ratio(lp), ratio(lp_frozen)
    a = adv[:, None]
    metrics = {}
    if o["loss_type"] == "cispo":
        pt = -np.minimum(r_frozen, eh) * a * lp
        high = ((r > eh) & (a > 0)).astype(np.float64)
        low = np.zeros_like(high)
    else:
        clipped = np.clip(r, 1 - eps, 1 + eh)
        r1 = np.minimum(r, delta) if delta is not None else r
        pt = -np.minimum(r1 * a, clipped * a)
        low = ((r1 < 1 - eps) & (a < 0)).astype(np.float64)
        high = ((r1 > 1 + eh) & (a > 0)).astype(np.float64)
    if beta:
        d = np.where(act, ref - lp, 0.0)
        kl = np.exp(d) - d - 1
        if o.get("use_bias_correction_kl"):
            kl = kl * r
        pt = pt + beta * kl
    pt = np.broadcast_to(pt, lp.shape)
    per_seq = np.where(act, pt * w, 0.0).sum(axis=1)
    n = w.sum()
    loss = {"grpo": lambda: (per_seq / np.maximum(n_b, 1.0)).mean(),
            "bnpo": lambda: per_seq.sum() / max(n, 1.0),
            "dr_grpo": lambda: per_seq.sum() / (b * o.get("max_completion_length", length)),
            "dapo": lambda: per_seq.sum() / max(o.get("num_items_in_batch", n), 1.0),
            "cispo": lambda: per_seq.sum() / max(o.get("num_items_in_batch", n), 1.0)}
    masked = lambda x: np.where(act, np.broadcast_to(x, lp.shape) * w, 0.0).sum() / max(n, 1.0)
    clip_mean = (lambda x: x.mean()) if seq else masked
    metrics = dict(clip_ratio_low=clip_mean(low), clip_ratio_high=clip_mean(high),
                   clip_ratio_region=clip_mean(np.maximum(low, high)), entropy=masked(ent))
    if beta:
        metrics["kl"] = masked(kl)
    return loss[o["loss_type"]](), metrics


def _loss_grad(lp, ent, w, old, adv, ref, o, h=1e-6, frozen_moves=False):
    """d loss / d logp [B, L]: central differences of the oracle, the detached values held
    (``frozen_moves``: moved with logp, the derivative of the loss's value itself)."""
    g = np.zeros_like(lp)
    for i in zip(*np.nonzero(w)):
        e = np.zeros_like(lp)
        e[i] = h
        up, down = (lp + e, lp - e) if frozen_moves else (lp, lp)
        g[i] = (_policy(lp + e, up, ent, w, old, adv, ref, o)[0]
                - _policy(lp - e, down, ent, w, old, adv, ref, o)[0]) / (2 * h)
    return g


class Problem:
    """One random problem: logits (NaN at inactive positions, or a dyadic linear head), float
    weights with a sequence of zeros, advantages of both signs, old and reference log-probs
    around the policy's (-inf and NaN at inactive positions)."""

    def __init__(self, rng, head=False, spread=0.5, softcap=None):
        self.softcap = softcap  # the head's final-logit cap (the oracle's logits capped)
        self.w = rng.uniform(0.5, 2.0, (B, L))
        self.w[rng.uniform(size=(B, L)) < 0.3] = 0.0
        self.w[0, 0], self.w[-1] = 1.0, 0.0  # the last sequence has no active token
        self.w = self.w.astype(np.float32).astype(np.float64)
        self.active = (self.w != 0).reshape(-1)
        self.y = np.where(self.w != 0, rng.integers(0, K, (B, L)), -1)
        if head:
            self.h, self.wt = dyadic(rng, (B, L, 11)), dyadic(rng, (K, 11))
            self.z = (self.h @ self.wt.T).reshape(B * L, K)
        else:
            z = rng.normal(size=(B * L, K)) * 3
            self.z = z.astype(np.float32).astype(np.float64)
            self.z[~self.active] = np.nan
        _, lp, ent, _ = oracle.token_stats(self.z, self.y.reshape(-1), self.active, T=T,
                                           softcap=softcap)
        self.lp, self.ent = lp.reshape(B, L), ent.reshape(B, L)
        act = self.w != 0
        noise = lambda s: rng.normal(size=(B, L)) * s
        self.old = np.where(act, self.lp + noise(spread), -np.inf).astype(np.float32)
        self.ref = np.where(act, self.lp + noise(0.3), np.nan).astype(np.float32)
        self.adv = np.array([1.3, -0.7, 0.4], np.float32)

    def _oracle_args(self, options, on_policy):
        """The oracle's arguments after logp: (ent, w, old, adv, ref, options) in float64."""
        old = None if on_policy else self.old.astype(np.float64)
        return (self.ent, self.w, old, self.adv.astype(np.float64), self.ref.astype(np.float64),
                options)

    def expected(self, options, on_policy=False):
        args = self._oracle_args(options, on_policy)
        loss, metrics = _policy(self.lp, self.lp, *args)
        return loss, metrics, _loss_grad(self.lp, *args)

    def loss_scale(self, options, on_policy=False):
        """The ``scale`` of the loss's float32 error (``assert_close``): Σ |d loss / d logp|
        x (|z_y / T| + |lse|) over active tokens. Each log-prob carries a float32 rounding of
        the size of its two terms, and the loss moves with it through every place it enters
        (the ratio included, so the frozen copy moves too): with |logp| near 18 and ratios
        near 1, an error of 1 ulp of |lse| reaches the loss amplified by |logp|."""
        z = self.z if self.softcap is None else self.softcap * np.tanh(self.z / self.softcap)
        y = np.maximum(self.y.reshape(-1), 0)
        zy = np.where(self.w != 0, np.take_along_axis(z, y[:, None], 1).reshape(B, L) / T, 0.0)
        size = np.abs(zy) + np.abs(zy - self.lp)  # |z_y / T| + |lse|, 0 where inactive
        d = _loss_grad(self.lp, *self._oracle_args(options, on_policy), frozen_moves=True)
        return float(np.sum(np.abs(d) * size))

    def d_logits(self, g):
        """(d logits [N, K], its slack) for d loss / d logp = g [B, L]."""
        zero = np.zeros(B * L)
        grads = (zero, g.reshape(-1), zero, zero)
        y = self.y.reshape(-1)
        kw = dict(T=T, softcap=self.softcap)
        return (oracle.token_stats_vjp(self.z, y, self.active, grads, **kw)[0],
                oracle.saved_lse_slack(self.z, y, self.active, grads, **kw))


METRICS = ("clip_ratio_low", "clip_ratio_high", "clip_ratio_region", "kl", "entropy")

#: (loss_type, options): every loss type, both importance-sampling levels, delta, the KL term
#: with and without the bias correction, the on-policy case, and each normaliser's argument
POLICY_CASES = [
    ("dapo", dict(epsilon=0.1, epsilon_high=0.3, beta=0.1)),
    ("grpo", dict(importance_sampling_level="sequence", beta=0.1, use_bias_correction_kl=True,
                  on_policy=True)),
    ("grpo", dict()),
    ("bnpo", dict(importance_sampling_level="sequence", delta=1.05, epsilon=0.05)),
    ("dr_grpo", dict(delta=1.5, max_completion_length=9, beta=0.05,
                     use_bias_correction_kl=True)),
    ("dapo", dict(importance_sampling_level="sequence", beta=0.05,
                  use_bias_correction_kl=True, delta=1.2, num_items_in_batch=17.5)),
    ("cispo", dict(epsilon_high=1.3, beta=0.05, use_bias_correction_kl=True)),
    ("cispo", dict(importance_sampling_level="sequence", epsilon_high=1.1,
                   num_items_in_batch=6)),
]


class PolicySuite:
    FW = None
    BACKEND = None
    #: the (loss_type, options) of test_loss_metrics_and_d_logits, and of the LinearHead test
    policy_case = cases(*POLICY_CASES)
    head_case = cases(POLICY_CASES[6])
    #: the kinds of logits of test_old_logps_of_the_same_policy_give_ratio_one
    ratio_case = cases("logits", "LinearHead")

    @property
    def fw(self):
        return framework(self.FW)

    def batch(self, p):
        fw = self.fw
        y = fw.array(p.y)
        return fw.api.DiffusionTokenBatch.create(model_inputs=y, target_ids=y,
                                                 loss_weights=fw.array(p.w.astype(np.float32)))

    def call(self, logits, batch, p, loss_type, options, on_policy=False, **kw):
        fw = self.fw
        options = {k: v for k, v in options.items() if k != "on_policy"}
        return fw.api.policy_loss(
            logits, batch, old_logps=None if on_policy else fw.array(p.old),
            advantages=fw.array(p.adv), loss_type=loss_type, ref_logps=fw.array(p.ref),
            temperature=T, backend=self.BACKEND, **options, **kw)

    def check_metrics(self, got, expected, beta, what):
        for name in METRICS:
            value = got[METRICS.index(name)]
            if name == "kl" and not beta:
                continue
            assert_close(value, expected[name], "float32", f"{what}: {name}")

    def outputs(self, result):
        return (result.loss, result.clip_ratio_low, result.clip_ratio_high,
                result.clip_ratio_region, result.kl, result.entropy)

    def test_loss_metrics_and_d_logits(self, rng, policy_case):
        loss_type, options = policy_case
        on_policy = options.get("on_policy", False)
        p = Problem(rng)
        fw = self.fw
        batch = self.batch(p)
        beta = options.get("beta", 0.0)

        def fn(z):
            result = self.call(z, batch, p, loss_type, options, on_policy)
            return tuple(v for v in self.outputs(result) if v is not None)

        outs, (grad,) = fw.vjp(fn, [fw.array(p.z.reshape(B, L, K), "float32")],
                               [np.float32(1.0)] + [np.float32(0.0)] * (5 if beta else 4))
        loss, metrics, g = p.expected(dict(options, loss_type=loss_type), on_policy)
        what = f"{loss_type} {options}"
        options = dict(options, loss_type=loss_type)
        assert_close(outs[0], loss, "float32", f"{what}: loss",
                     scale=p.loss_scale(options, on_policy))
        got = list(outs[1:4]) + ([outs[4]] if beta else [None]) + [outs[-1]]
        self.check_metrics(got, metrics, beta, what)
        dz, slack = p.d_logits(g)
        assert_close(grad.reshape(B * L, K), dz, "float32", f"{what}: d logits", slack=slack)
        assert_exact_zero(grad.reshape(B * L, K)[~p.active], "d logits at inactive positions")

    def test_linear_head_gradients(self, rng, head_case):
        """From a LinearHead(hidden, weight): the loss, d hidden and d weight against the
        float64 oracle of hidden @ weight.T (dyadic: the logits are exact in float32)."""
        loss_type, options = head_case
        fw = self.fw
        p = Problem(rng, head=True)
        batch = self.batch(p)

        def fn(h, wt):
            head = fw.api.LinearHead(h, wt, weight_layout="KD")
            return (self.call(head, batch, p, loss_type, options).loss,)

        (loss,), (dh, dw) = fw.vjp(fn, [fw.array(p.h, "float32"), fw.array(p.wt, "float32")],
                                   [np.float32(1.0)])
        options = dict(options, loss_type=loss_type)
        e_loss, _, g = p.expected(options)
        assert_close(loss, e_loss, "float32", "loss", scale=p.loss_scale(options))
        dz, slack = p.d_logits(g)
        h2 = p.h.reshape(B * L, -1)
        assert_close(dh.reshape(B * L, -1), dz @ p.wt, "float32", "d hidden",
                     slack=matmul_slack(dz, slack, p.wt, "float32"))
        assert_close(dw, dz.T @ h2, "float32", "d weight",
                     slack=matmul_slack(dz.T, slack.T, h2, "float32"))

    def test_capped_linear_head_gradients(self, rng, head_case):
        """From LinearHead(hidden, weight, softcap=1/4), |logits| up to several times the
        cap: the loss, TRL's metrics (the entropy of the capped model), d hidden and d weight
        against the float64 oracle of the capped logits c·tanh(hidden @ weight.T / c)."""
        loss_type, options = head_case
        fw = self.fw
        p = Problem(rng, head=True, softcap=0.25)
        assert np.abs(p.z).max() >= 0.75, "the cap would not be active"
        batch = self.batch(p)

        def fn(h, wt):
            head = fw.api.LinearHead(h, wt, softcap=0.25, weight_layout="KD")
            out = self.call(head, batch, p, loss_type, options)
            return out.loss, out.entropy

        (loss, entropy), (dh, dw) = fw.vjp(fn, [fw.array(p.h, "float32"),
                                               fw.array(p.wt, "float32")],
                                          [np.float32(1.0), np.float32(0.0)])
        options = dict(options, loss_type=loss_type)
        e_loss, e_metrics, g = p.expected(options)
        assert_close(loss, e_loss, "float32", "loss", scale=p.loss_scale(options))
        assert_close(entropy, e_metrics["entropy"], "float32", "entropy metric")
        dz, slack = p.d_logits(g)
        h2 = p.h.reshape(B * L, -1)
        assert_close(dh.reshape(B * L, -1), dz @ p.wt, "float32", "d hidden",
                     slack=matmul_slack(dz, slack, p.wt, "float32"))
        assert_close(dw, dz.T @ h2, "float32", "d weight",
                     slack=matmul_slack(dz.T, slack.T, h2, "float32"))

    # -- the on-policy ratio ---------------------------------------------------------------

    def jit(self, fn):
        """JAX: fn under jax.jit, as the loss runs in these tests (``harness.JaxFW.vjp``) and
        in training; torch: fn."""
        return self.fw.jax.jit(fn) if self.fw.name == "jax" else fn

    def test_old_logps_of_the_same_policy_give_ratio_one(self, rng, ratio_case):
        """old_logps from per_token_logps of the same logits at the same temperature give
        r = 1 exactly, also when they come from the rows in another order or from a
        sub-batch: at epsilon = epsilon_high = 0 no ratio is clipped and the loss equals the
        on-policy one (old_logps=None) bit for bit (so r = 1 at every active position whose
        advantage is not 0)."""
        fw = self.fw
        head = ratio_case == "LinearHead"
        p = Problem(rng, head=head)
        if head:
            leaves = [fw.array(p.h, "float32"), fw.array(p.wt, "float32")]
            make = lambda h_, w_: fw.api.LinearHead(h_, w_, weight_layout="KD")
        else:
            leaves = [fw.array(p.z.reshape(B, L, K), "float32")]
            make = lambda z_: z_

        def batch(y, w):
            return fw.api.DiffusionTokenBatch.create(model_inputs=y, target_ids=y, loss_weights=w)

        score = self.jit(lambda x, y, w: fw.api.per_token_logps(
            make(*x), batch(y, w), temperature=T, backend=self.BACKEND))

        def logps(rows):  # the sequences ``rows`` scored alone: [len(rows), L]
            x = [leaves[0][rows]] + leaves[1:]
            return fw.numpy(score(x, fw.array(p.y[rows]), fw.array(p.w[rows].astype(np.float32))))

        same = logps(np.arange(B))
        order = np.array([2, 0, 1])
        permuted = np.empty_like(same)
        permuted[order] = logps(order)
        for name, got, want in (("the rows permuted", permuted, same),
                                ("a sub-batch", logps(np.arange(1, B)), same[1:])):
            assert np.array_equal(got, want), (
                f"per_token_logps of {name} differ from the whole batch's at "
                f"{np.argwhere(got != want).tolist()}")

        def losses(x, old, y, w):
            result = lambda old_: fw.api.policy_loss(
                make(*x), batch(y, w), old_logps=old_, advantages=fw.array(p.adv),
                loss_type="dapo", epsilon=0.0, epsilon_high=0.0, temperature=T,
                backend=self.BACKEND)
            with_old, on_policy = result(old), result(None)
            return (with_old.loss, on_policy.loss, with_old.clip_ratio_low,
                    with_old.clip_ratio_high)

        got = self.jit(losses)(leaves, fw.array(same.astype(np.float32)), fw.array(p.y),
                               fw.array(p.w.astype(np.float32)))
        loss, loss0, low, high = (fw.numpy(v) for v in got)
        assert low == high == 0.0, (low, high)
        assert loss == loss0, (loss, loss0)


class KernelPolicySuite(PolicySuite):
    """A kernel backend runs one case of each test (seconds each in an interpreter): the
    formulas around the statistics are the framework-native classes' code."""

    policy_case = cases(POLICY_CASES[6])
    test_linear_head_gradients = None
    test_old_logps_of_the_same_policy_give_ratio_one = None


class TestTorchReference(PolicySuite):
    FW, BACKEND = "torch", "reference"


class TestTorchChunked(PolicySuite):
    FW, BACKEND = "torch", "chunked"
    head_case = cases(POLICY_CASES[5], POLICY_CASES[6])


class TestJaxReference(PolicySuite):
    FW, BACKEND = "jax", "reference"
    test_linear_head_gradients = None  # the reference materialises the head's logits
    policy_case = cases(*(POLICY_CASES[i] for i in (0, 3, 4, 7)))
    # (the ratio of one at T != 1 failed here, from logits, until the reference's values came
    # out of a loop buffer, token_stats/jax_reference.py: XLA had fused its log-softmax into
    # the losses, an ulp apart from the scorer's)


class TestJaxChunked(PolicySuite):
    FW, BACKEND = "jax", "chunked"
    policy_case = cases(POLICY_CASES[1], POLICY_CASES[6])  # with the reference's: every one


@pytest.mark.skipif(not _INTERPRETED, reason="needs triton and TRITON_INTERPRET=1")
class TestTorchTriton(KernelPolicySuite):
    FW, BACKEND = "torch", "triton"


@pytest.mark.skipif(not _INTERPRETED, reason="needs triton and TRITON_INTERPRET=1")
@pytest.mark.usefixtures("jax_triton_on_cpu")
class TestJaxTriton(KernelPolicySuite):
    FW, BACKEND = "jax", "triton"


class TestJaxPallas(KernelPolicySuite):
    FW, BACKEND = "jax", "pallas"

    @pytest.fixture(autouse=True)
    def _interpret(self, monkeypatch):
        pytest.importorskip("jax.experimental.pallas.tpu")
        monkeypatch.setenv("DLM_KERNELS_PALLAS_INTERPRET", "1")


# -- errors ----------------------------------------------------------------------------------

def _valid(fw, rng):
    """(logits, batch, keywords) of a valid call with beta > 0 (every input read)."""
    p = Problem(rng)
    y = fw.array(p.y)
    batch = fw.api.DiffusionTokenBatch.create(model_inputs=y, target_ids=y,
                                              loss_weights=fw.array(p.w.astype(np.float32)))
    kw = dict(old_logps=fw.array(p.old), advantages=fw.array(p.adv), loss_type="dapo",
              beta=0.1, ref_logps=fw.array(p.ref))
    return fw.array(np.nan_to_num(p.z).reshape(B, L, K), "float32"), batch, kw, p


def _bad_arguments(fw, p):
    """(keywords replaced, error class, message pattern) for each bad argument."""
    f32 = lambda a: fw.array(np.asarray(a, np.float32))
    valid = "'grpo', 'bnpo', 'dr_grpo', 'dapo', 'cispo'"
    return [
        (dict(old_logps=f32(p.old[:, :-1])), ValueError,
         r"old_logps must have shape target_ids.shape \[B, L\] = \[3, 7\]; got \[3, 6\]"),
        (dict(old_logps=fw.array(np.zeros((B, L), np.int32))), TypeError,
         "old_logps must have a floating-point dtype; got int32"),
        (dict(old_logps=p.old.tolist()), TypeError, "old_logps must be .*; got list"),
        (dict(ref_logps=f32(p.ref[0])), ValueError,
         r"ref_logps must have shape target_ids.shape \[B, L\] = \[3, 7\]; got \[7\]"),
        (dict(advantages=f32(p.adv[:, None])), ValueError,
         r"advantages must have shape \[B\] = \[3\]; got \[3, 1\]"),
        (dict(advantages=f32(p.adv[:2])), ValueError,
         r"advantages must have shape \[B\] = \[3\]; got \[2\]"),
        (dict(loss_type="ppo"), ValueError, rf"loss_type must be one of \({valid}\); got 'ppo'"),
        (dict(ref_logps=None), ValueError,
         r"ref_logps must be given when beta != 0 .*; got None with beta = 0.1"),
        (dict(epsilon=-0.1), ValueError, r"epsilon must be a float in \[0, 1\] .*; got -0.1"),
        (dict(epsilon=1.5), ValueError, r"epsilon must be a float in \[0, 1\] .*; got 1.5"),
        (dict(epsilon=float("nan")), ValueError, r"epsilon must be .*; got nan"),
        (dict(epsilon_high=-0.2), ValueError,
         "epsilon_high must be a finite float >= 0 or None; got -0.2"),
        (dict(epsilon_high=float("inf")), ValueError, "epsilon_high must be .*; got inf"),
        (dict(loss_type="cispo", epsilon_high=0.0), ValueError,
         "epsilon_high must be positive with loss_type 'cispo' .*; got 0.0"),
        (dict(delta=0.9), ValueError, "delta must be a finite float > 1 or None .*; got 0.9"),
        (dict(beta=-0.5), ValueError, "beta must be a finite non-negative float; got -0.5"),
        (dict(importance_sampling_level="seq"), ValueError,
         r"importance_sampling_level must be one of \('token', 'sequence'\); got 'seq'"),
        (dict(temperature=0.0), ValueError,
         "temperature must be a finite positive real scalar; got 0.0"),
        (dict(max_completion_length=0), ValueError,
         "max_completion_length must be a positive int or None; got 0"),
        (dict(num_items_in_batch=-1.0), ValueError,
         "num_items_in_batch must be a finite non-negative float; got -1.0"),
        (dict(num_items_in_batch=f32([3.0, 4.0])), ValueError,
         r"num_items_in_batch must be a number or a 0-d array; got shape \[2\]"),
        (dict(use_bias_correction_kl=1), TypeError,
         "use_bias_correction_kl must be True or False; got 1"),
    ]


def _bad_values(fw, p):
    """(name, keywords replaced, loss_weights or None, message pattern) for each bad value:
    an error where values are readable, NaN where they are not."""
    f32 = lambda a: fw.array(np.asarray(a, np.float32))
    adv, old, ref, w = p.adv.copy(), p.old.copy(), p.ref.copy(), p.w.astype(np.float32)
    adv[1] = np.nan
    old[0, 0] = np.inf
    ref[0, 0] = np.nan
    w_neg, w_nan = w.copy(), w.copy()
    w_neg[1, 2], w_nan[1, 2] = -1.0, np.nan
    return [
        ("advantages NaN", dict(advantages=f32(adv)), None,
         r"advantages must be finite; got nan at index \(1,\)"),
        ("old_logps inf", dict(old_logps=f32(old)), None,
         r"old_logps where loss_weights is set must be finite; got inf at index \(0, 0\)"),
        ("ref_logps NaN", dict(ref_logps=f32(ref)), None,
         r"ref_logps where loss_weights is set must be finite; got nan at index \(0, 0\)"),
        ("num_items_in_batch < 0", dict(num_items_in_batch=f32(-3.0)), None,
         "num_items_in_batch must be a finite non-negative number; got -3.0"),
        ("a negative weight", {}, w_neg, r"loss_weights must be nonnegative; got -1.0"),
        ("a NaN weight", {}, w_nan, "loss_weights must contain only finite values; got nan"),
    ]


@pytest.mark.parametrize("fw_name", ["torch", "jax"])
def test_bad_arguments_raise_naming_them(rng, fw_name):
    fw = framework(fw_name)
    z, batch, kw, p = _valid(fw, rng)
    valid = lambda z_: fw.api.policy_loss(z_, batch, **kw).loss
    assert np.isfinite(fw.numpy((fw.jax.jit(valid) if fw_name == "jax" else valid)(z)))
    for change, error, pattern in _bad_arguments(fw, p):
        with pytest.raises(error, match=pattern):
            fw.api.policy_loss(z, batch, **dict(kw, **change))
    for name, change, w, pattern in _bad_values(fw, p):
        bad = batch if w is None else batch.replace(loss_weights=fw.array(w))
        with pytest.raises(ValueError, match=pattern):
            fw.api.policy_loss(z, bad, **dict(kw, **change))


@pytest.mark.parametrize("fw_name", ["torch", "jax"])
def test_bad_values_give_nan_where_they_cannot_be_read(rng, fw_name, monkeypatch):
    """Where no check can read the values (JAX: under jax.jit; torch: simulated, as on a GPU
    or under torch.compile, by giving the checks no host values), each bad value makes the
    loss and every metric NaN, never a plausible number; the good call stays finite."""
    fw = framework(fw_name)
    z, batch, kw, p = _valid(fw, rng)
    cases = [("none", {}, None)] + [(n, c, w) for n, c, w, _ in _bad_values(fw, p)]
    if fw_name == "torch":
        from dlm_kernels import _checks

        monkeypatch.setattr(_checks, "host_values", lambda xp, x, allow_sync=False: None)
        results = [fw.api.policy_loss(z, batch if w is None else batch.replace(
            loss_weights=fw.array(w)), **dict(kw, **c)) for _, c, w in cases]
    else:
        def all_cases(z, arrays):
            out = []
            for (_, c, w), (c_arrays, w_array) in zip(cases, arrays):
                b = batch if w is None else batch.replace(loss_weights=w_array)
                out.append(fw.api.policy_loss(z, b, **dict(kw, **c_arrays)))
            return out

        arrays = [(c, None if w is None else fw.array(w)) for _, c, w in cases]
        results = fw.jax.jit(all_cases)(z, arrays)
    for (name, _, _), result in zip(cases, results):
        values = [fw.numpy(v) for v in (result.loss, result.clip_ratio_low,
                                        result.clip_ratio_high, result.clip_ratio_region,
                                        result.kl, result.entropy)]
        if name == "none":
            assert np.isfinite(values).all(), values
        else:
            assert np.isnan(values).all(), (name, values)


def test_jax_policy_loss_under_vocab_parallel(rng):
    """Logits sharded on K over a 4-device "vocab" axis (K = 41 padded to 44 with NaN):
    the loss, its metrics and d logits equal the unsharded reference's, and the padding's
    gradient is exact zeros."""
    import jax
    from jax.sharding import Mesh, PartitionSpec as P

    fw = framework("jax")
    D = fw.api
    z, batch, kw, p = _valid(fw, rng)
    kw = dict(kw, importance_sampling_level="sequence", use_bias_correction_kl=True,
              temperature=T)
    padded = np.concatenate([fw.numpy(z), np.full((B, L, 3), np.nan)], axis=-1)
    mesh = Mesh(np.array(jax.devices()[:4]), ("vocab",))

    def local(z_):
        with D.vocab_parallel("vocab", vocab_size=K):
            r = D.policy_loss(z_, batch, **kw)
        return r.loss, r.clip_ratio_region, r.kl, r.entropy

    f = jax.shard_map(local, mesh=mesh, in_specs=P(None, None, "vocab"),
                      out_specs=(P(), P(), P(), P()))
    (loss, metrics), grad = jax.jit(jax.value_and_grad(lambda z_: (lambda o: (o[0], o[1:]))(
        f(z_)), has_aux=True))(fw.array(padded, "float32"))
    ref = lambda z_: (lambda r: (r.loss, (r.clip_ratio_region, r.kl, r.entropy)))(
        D.policy_loss(z_, batch, backend="reference", **kw))
    (r_loss, r_metrics), r_grad = jax.jit(jax.value_and_grad(ref, has_aux=True))(z)
    assert_close(float(loss), float(r_loss), "float32", "loss")
    for name, got, want in zip(("clip_ratio_region", "kl", "entropy"), metrics, r_metrics):
        assert_close(float(got), float(want), "float32", name)
    assert_close(np.asarray(grad)[..., :K], np.asarray(r_grad), "float32", "d logits")
    assert_exact_zero(np.asarray(grad)[..., K:], "d logits of the padding")


# -- the gradient written over the logits (torch, opt-in) ----------------------------------------

_INPLACE_BACKENDS = ["chunked"] + (["triton"] if _INTERPRETED else [])


@pytest.mark.parametrize("backend", _INPLACE_BACKENDS)
def test_inplace_grad_writes_the_same_gradient_over_the_logits(rng, backend):
    """``inplace_grad=True``: the loss and metrics are bitwise those of the default call, and
    the backward returns the logits' own storage holding bitwise the default gradient (no
    second [B, L, K] buffer). Every entry of the buffer is overwritten, inactive rows with
    exact zeros."""
    import torch

    fw = framework("torch")
    z, batch, kw, p = _valid(fw, rng)
    kw = dict(kw, loss_type="cispo", epsilon_high=1.3, use_bias_correction_kl=True,
              temperature=T, backend=backend)
    fields = ("loss", "clip_ratio_low", "clip_ratio_high", "clip_ratio_region", "kl", "entropy")
    z0 = z.clone().requires_grad_(True)
    expected = fw.api.policy_loss(z0, batch, **kw)
    (d_expected,) = torch.autograd.grad(expected.loss, z0)
    z1 = z.clone().requires_grad_(True)
    got = fw.api.policy_loss(z1, batch, inplace_grad=True, **kw)
    for name in fields:
        assert torch.equal(getattr(got, name), getattr(expected, name)), name
    (d_got,) = torch.autograd.grad(got.loss, z1)
    assert d_got.data_ptr() == z1.data_ptr(), "the gradient is a new buffer, not the logits"
    assert torch.equal(d_got, d_expected), "the gradient written in place differs"
    assert_exact_zero(d_got.detach().reshape(B * L, K)[~p.active].numpy(),
                      "d logits at inactive rows")


def test_inplace_grad_rejections(rng):
    """In place needs a logits tensor on a backend that writes it: a LinearHead, the reference
    backend and JAX raise, naming the argument."""
    fw = framework("torch")
    z, batch, kw, p = _valid(fw, rng)
    with pytest.raises(ValueError, match="inplace_grad=True is not supported by backend "
                                         "'reference'"):
        fw.api.policy_loss(z, batch, inplace_grad=True, backend="reference", **kw)
    head = fw.api.LinearHead(fw.array(p.z[:, :5].reshape(B, L, 5), "float32"),
                             fw.array(np.ones((K, 5), np.float32)), weight_layout="KD")
    with pytest.raises(ValueError, match="inplace_grad=True applies to a logits tensor"):
        fw.api.policy_loss(head, batch, inplace_grad=True, **kw)
    jx = framework("jax")
    z, batch, kw, _ = _valid(jx, rng)
    with pytest.raises(ValueError, match="inplace_grad=True is torch-only"):
        jx.api.policy_loss(z, batch, inplace_grad=True, **kw)


def test_inplace_grad_under_torch_compile(rng):
    """Under ``torch.compile`` (fullgraph) ``inplace_grad=True`` gives the compiled default
    call's gradient bit for bit (the graph's functionalization returns it in a buffer of its
    own: documented, no memory saved there)."""
    import torch

    fw = framework("torch")
    z, batch, kw, _ = _valid(fw, rng)

    def loss(z_, inplace):
        return fw.api.policy_loss(z_, batch, inplace_grad=inplace, backend="chunked", **kw).loss

    torch._dynamo.reset()
    compiled = torch.compile(loss, fullgraph=True)
    grads = []
    for inplace in (False, True):
        z1 = z.clone().requires_grad_(True)
        (g,) = torch.autograd.grad(compiled(z1, inplace), z1)
        grads.append(g.detach())
    assert torch.equal(grads[0], grads[1])
