"""The upstream denoising step (add_gumbel_noise, get_num_transfer_tokens, get_transfer_index)
against upstream's own code, written here as the issue states it (float64, torch.topk per
row), on every backend at tiny shapes, in both front ends.

Upstream's draws use torch.rand, ours a keyed noise: tokens are compared exactly where they
are deterministic (greedy) and by a chi-square against softmax(logits / T) where they are
drawn; at T > 0 upstream's commit rule is run on our draw. torch.topk leaves the order of
ties unspecified: a tie at the k-th place is compared as the multiset of chosen
confidences (ours take the lowest positions)."""

from __future__ import annotations

import math
import os

import numpy as np
import pytest

from harness import framework

# -- upstream, as written (float64) ---------------------------------------------------------


def upstream_add_gumbel_noise(logits, temperature, u):
    import torch

    if temperature == 0:
        return logits
    logits = logits.to(torch.float64)
    return logits.exp() / (-torch.log(u)) ** temperature


def upstream_get_num_transfer_tokens(mask_index, steps):
    import torch

    mask_num = mask_index.sum(dim=1, keepdim=True)
    base, remainder = mask_num // steps, mask_num % steps
    out = torch.zeros(mask_num.size(0), steps, dtype=torch.int64) + base
    for i in range(mask_num.size(0)):
        out[i, :remainder[i]] += 1
    return out


def upstream_get_transfer_index(logits, temperature, remasking, mask_index, x,
                                num_transfer_tokens, threshold=None, neg_entropy=False, *,
                                x0=None, rand=None):
    """Upstream's step; ``x0`` (the draw) and ``rand`` (remasking="random"'s uniforms) may be
    given, the noise being the one thing that is not compared bit for bit. Also returns the
    confidence."""
    import torch

    if x0 is None:
        u = torch.rand(logits.shape, dtype=torch.float64)
        x0 = torch.argmax(upstream_add_gumbel_noise(logits, temperature, u), dim=-1)
    if remasking == "low_confidence":
        p = torch.softmax(logits.to(torch.float64), dim=-1)
        if neg_entropy:
            x0_p = torch.sum(p * torch.log(p + 1e-10), dim=-1)
        else:
            x0_p = torch.gather(p, -1, x0[..., None])[..., 0]
    elif remasking == "random":
        x0_p = rand if rand is not None else torch.rand(x0.shape, dtype=torch.float64)
    else:
        raise NotImplementedError(remasking)
    x0 = torch.where(mask_index, x0, x)
    confidence = torch.where(mask_index, x0_p, -np.inf)
    transfer_index = torch.zeros_like(x0, dtype=torch.bool)
    if threshold is not None:
        num_transfer_tokens = mask_index.sum(dim=1, keepdim=True)
    for j in range(confidence.shape[0]):
        _, select_index = torch.topk(confidence[j], k=int(num_transfer_tokens[j]))
        transfer_index[j, select_index] = True
        if threshold is not None:
            for k in range(1, int(num_transfer_tokens[j])):
                if confidence[j, select_index[k]] < threshold:
                    transfer_index[j, select_index[k]] = False
    return x0, transfer_index, confidence


# -- helpers --------------------------------------------------------------------------------

BACKENDS = [("torch", "reference"), ("torch", "chunked"), ("torch", "triton"),
            ("jax", "reference"), ("jax", "chunked"), ("jax", "pallas")]


def _skip_unrunnable(fw_name, backend):
    if backend == "triton" and os.environ.get("TRITON_INTERPRET") != "1":
        import torch

        if not torch.cuda.is_available():
            pytest.skip("the Triton kernels need a GPU or TRITON_INTERPRET=1")


def _np(fw, a):
    return np.asarray(fw.numpy(a))


def _case(rng, b=3, l=10, k=37):
    """Logits with exact confidence ties and known values: rows 0-1 of sequence 0 are equal
    (a tie), (0, 4) has two equal maxima and nothing else finite (greedy confidence exactly
    1/2); sequence 2 has two masked positions only (k past the masked count)."""
    z = rng.normal(size=(b, l, k)) * 2
    z[0, 1] = z[0, 0]
    z[0, 6] = z[0, 0]
    z[0, 4] = -np.inf
    z[0, 4, [3, 9]] = 1.5
    mask = rng.uniform(size=(b, l)) < 0.7
    mask[0, [0, 1, 4, 6]] = True
    mask[2] = False
    mask[2, [3, 8]] = True
    x = np.where(mask, k, rng.integers(0, k, size=(b, l)))  # k: the mask id, outside [0, K)
    return z.astype(np.float32).astype(np.float64), mask, x


def _compare_commits(ours, want, conf, mask, where):
    """ours == upstream's transfer_index, ties at the k-th place compared as multisets (ours:
    the lowest positions of the tie); past the masked count only the count of unmasked picks
    (upstream's topk picks among -inf ties), ours the lowest unmasked positions."""
    for j in range(ours.shape[0]):
        o, w, c, m = ours[j], want[j], conf[j], mask[j]
        assert np.array_equal(o & m, w & m) or np.array_equal(
            np.sort(c[o & m]), np.sort(c[w & m])), f"{where}, row {j}: {o} vs {w}"
        assert o.sum() == w.sum(), f"{where}, row {j}: {o.sum()} vs {w.sum()} committed"
        extra = np.flatnonzero(o & ~m)
        assert np.array_equal(extra, np.flatnonzero(~m)[:extra.size]), (where, j, extra)
        for v in np.unique(c[o & m]):  # within a tie, the lowest positions
            tie = np.flatnonzero(m & (c == v))
            assert np.array_equal(np.flatnonzero(o & m & (c == v)), tie[:np.sum(o & m & (c == v))])


# -- the tests ------------------------------------------------------------------------------

@pytest.mark.parametrize("fw_name,backend", BACKENDS)
def test_get_transfer_index_matches_upstream(rng, fw_name, backend):
    """Greedy tokens exactly, committed positions exactly (ties, k past the masked count,
    [B] and [B, 1] k, an inclusive threshold, neg_entropy, "random"), and at T > 0 upstream's
    rule on our draw; every backend at tiny shapes (the kernels' a greedy and a drawn case:
    the commit rules are the same [B, L] code on every backend)."""
    import torch

    _skip_unrunnable(fw_name, backend)
    fw = framework(fw_name)
    api = fw.api
    z, mask, x = _case(rng)
    zt, mt, xt = torch.tensor(z), torch.tensor(mask), torch.tensor(x)
    seed = int(rng.integers(0, 2**31))
    kk = np.array([3, 1, 5])  # sequence 2: 5 > its 2 masked positions
    run = lambda t, remasking, k, **kw: api.get_transfer_index(  # noqa: E731
        fw.array(z, "float32"), t, remasking, fw.array(mask), fw.array(x), k, seed=seed,
        step=3, backend=backend, **kw)
    cases = (
            (0.0, "low_confidence", fw.array(kk), {}),
            (0.0, "low_confidence", fw.array(kk[:, None]), {}),
            (0.0, "low_confidence", 2, dict(neg_entropy=True)),
            (0.0, "low_confidence", None, dict(threshold=0.5)),  # (0, 4) at exactly 1/2
            (0.8, "low_confidence", fw.array(kk), {}),
            (0.8, "low_confidence", None, dict(threshold=0.3, neg_entropy=False)),
            (0.8, "random", fw.array(kk), {}))
    if backend in ("triton", "pallas"):  # the kernels draw; the [B, L] rules are shared
        cases = cases[:1] + cases[4:5]
    for t, remasking, k, kw in cases:
        where = f"T={t} {remasking} k={k if isinstance(k, int) or k is None else 'array'} {kw}"
        x0, transfer = (_np(fw, a) for a in run(t, remasking, k, **kw))
        assert transfer.dtype == bool and x0.dtype == _np(fw, fw.array(x)).dtype, where
        drawn = np.where(mask, x0, -1)
        if t == 0.0:  # greedy: upstream's own draw
            want_x0 = torch.argmax(zt, dim=-1)
        else:
            want_x0 = torch.tensor(np.where(mask, x0, 0))
        assert np.all(x0[~mask] == x[~mask]), where
        rand = None
        if remasking == "random":  # our keyed uniforms, read back from the row keys
            from dlm_kernels.sampling import core as _sampling
            from dlm_kernels._torch.ops import TorchOps

            keys = _sampling.row_keys(TorchOps, seed, 3, x.size, torch.zeros(1))
            rand = _sampling.position_uniform(TorchOps, keys).double().reshape(x.shape)
        kt = torch.tensor(kk) if k is not None and not isinstance(k, int) else (
            torch.full((3,), k) if k is not None else None)
        up_x0, up_transfer, conf = upstream_get_transfer_index(
            zt, t, remasking, mt, xt, kt, x0=want_x0, rand=rand, **kw)
        assert np.array_equal(np.where(mask, x0, -1), np.where(mask, up_x0.numpy(), -1)), (
            where, drawn)
        _compare_commits(transfer, up_transfer.numpy(), conf.numpy(), mask, where)


@pytest.mark.parametrize("fw_name", ["torch", "jax"])
def test_step_functions_upstream_details(rng, fw_name):
    """get_num_transfer_tokens equals upstream's (shape, dtype, values); add_gumbel_noise
    returns the logits at T = 0 and otherwise scores whose argmax is sample_tokens' token;
    a LinearHead gives what its logits give; the tie at the threshold; the bad arguments."""
    import torch

    fw = framework(fw_name)
    api = fw.api
    mask = rng.uniform(size=(4, 13)) < 0.6
    mask[3] = False
    for steps in (1, 4, 20):
        got = _np(fw, api.get_num_transfer_tokens(fw.array(mask), steps))
        want = upstream_get_num_transfer_tokens(torch.tensor(mask), steps).numpy()
        assert np.array_equal(got, want) and got.shape == (4, steps), (steps, got, want)
    if fw_name == "torch":
        assert api.get_num_transfer_tokens(fw.array(mask), 3).dtype == torch.int64
    with pytest.raises(ValueError, match=r"steps must be a positive int; got 0"):
        api.get_num_transfer_tokens(fw.array(mask), 0)
    z = rng.normal(size=(2, 5, 37)).astype(np.float32)
    za = fw.array(z)
    assert api.add_gumbel_noise(za, 0.0) is za
    noisy = api.add_gumbel_noise(za, 0.7, seed=9, step=2)
    token = api.sample_tokens(za, temperature=0.7, seed=9, step=2, backend="reference").token
    assert np.array_equal(_np(fw, noisy).argmax(-1), _np(fw, token))
    # a LinearHead: dyadic inputs make its logits exact
    h = rng.integers(-2, 3, (2, 5, 8)) / 4
    w = rng.integers(-2, 3, (37, 8)) / 4  # [K, D]
    layout = api.LinearHead.DEFAULT_LAYOUT
    head = api.LinearHead(fw.array(h, "float32"), fw.array(w if layout == "KD" else w.T,
                                                           "float32"), row_chunk=5)
    logits = fw.array(h @ w.T, "float32")
    m, x = fw.array(np.ones((2, 5), bool)), fw.array(np.zeros((2, 5), np.int64))
    for kw in (dict(num_transfer_tokens=2), dict(num_transfer_tokens=None, threshold=0.2)):
        a = api.get_transfer_index(head, 0.9, "low_confidence", m, x, seed=4,
                                   backend="reference", **kw)
        b = api.get_transfer_index(logits, 0.9, "low_confidence", m, x, seed=4,
                                   backend="reference", **kw)
        for f, g in zip(a, b):
            assert np.array_equal(_np(fw, f), _np(fw, g)), kw
    assert np.array_equal(_np(fw, api.add_gumbel_noise(head, 0.9, seed=1)),
                          _np(fw, api.add_gumbel_noise(logits, 0.9, seed=1)))
    with pytest.raises(NotImplementedError, match="^top_p$"):
        api.get_transfer_index(logits, 0.0, "top_p", m, x, 2)
    with pytest.raises(ValueError, match=r"num_transfer_tokens must be given"):
        api.get_transfer_index(logits, 0.0, "low_confidence", m, x, None)
    with pytest.raises(ValueError, match=r"logits must have shape \[B, L, K\] with \[B, L\] = "
                                         r"x.shape \[2, 4\]"):
        api.get_transfer_index(logits, 0.0, "low_confidence", fw.array(np.ones((2, 4), bool)),
                               fw.array(np.zeros((2, 4), np.int64)), 2)
    with pytest.raises(ValueError, match=r"k must be >= 0"):
        api.get_transfer_index(logits, 0.0, "low_confidence", m, x, -1, backend="reference")
    # k above L: upstream's torch.topk raises a RuntimeError; ours is that and a ValueError
    for error in (ValueError, RuntimeError):
        with pytest.raises(error, match=r"num_transfer_tokens must be at most L = 5 .*selected "
                                        r"index k out of range.*got 6 for sequence 1"):
            api.get_transfer_index(logits, 0.0, "low_confidence", m, x, fw.array([5, 6]),
                                   backend="reference")


def _chi2_limit(df, zq=3.719):  # the normal quantile at 1 - 1e-4, Wilson-Hilferty
    return df * (1 - 2 / (9 * df) + zq * math.sqrt(2 / (9 * df))) ** 3


@pytest.mark.parametrize("fw_name", ["torch", "jax"])
def test_draws_follow_softmax(rng, fw_name):
    """The tokens of get_transfer_index and the argmax of add_gumbel_noise are draws from
    softmax(logits / T): one row of logits repeated over 6000 positions (independent noise
    per position), chi-square at p = 1e-4."""
    fw = framework(fw_name)
    api = fw.api
    k, b, l, t = 6, 60, 100, 0.8
    zrow = rng.normal(size=k) * 1.2
    z = fw.array(np.tile(zrow, (b, l, 1)), "float32")
    p = np.exp(zrow / t - np.log(np.exp(zrow / t).sum()))
    seed = int(rng.integers(0, 2**31))
    mask = fw.array(np.ones((b, l), bool))
    x = fw.array(np.zeros((b, l), np.int64))
    draws = {
        "get_transfer_index": api.get_transfer_index(z, t, "low_confidence", mask, x, 1,
                                                     seed=seed, backend="chunked")[0],
        "add_gumbel_noise": api.add_gumbel_noise(z, t, seed=seed + 1).argmax(-1)}
    for name, tokens in draws.items():
        counts = np.bincount(_np(fw, tokens).reshape(-1), minlength=k)
        chi2 = float(((counts - b * l * p) ** 2 / (b * l * p)).sum())
        assert chi2 < _chi2_limit(k - 1), f"{name}: chi2 {chi2:.1f} (seed {seed}): {counts}"


def test_step_under_jit(rng):
    """get_transfer_index traces under jax.jit (traced step and threshold), as eager."""
    import jax

    fw = framework("jax")
    api = fw.api
    z, mask, x = _case(rng)
    args = (fw.array(z, "float32"), fw.array(mask), fw.array(x))
    step = jax.jit(lambda z, m, x, i, th: api.get_transfer_index(
        z, 0.8, "low_confidence", m, x, None, th, seed=5, step=i))
    got = step(*args, fw.array(np.int32(2)), fw.array(np.float32(0.3)))
    want = api.get_transfer_index(*args[:1], 0.8, "low_confidence", *args[1:], None, 0.3,
                                  seed=5, step=2)
    for g, w in zip(got, want):
        assert np.array_equal(_np(fw, g), _np(fw, w))


def test_example_llada_loops(tmp_path):
    """examples/llada_step_*.py: LLaDA's semi-autoregressive loop (blocks, steps,
    get_num_transfer_tokens, get_transfer_index) with a tiny random model, both frameworks."""
    import subprocess
    import sys

    root = os.path.join(os.path.dirname(__file__), "..")
    for script in ("llada_step_torch.py", "llada_step_jax.py"):
        out = subprocess.run([sys.executable, os.path.join(root, "examples", script)],
                             capture_output=True, text=True, check=True, cwd=tmp_path)
        assert "masked left: 0" in out.stdout, out.stdout
