"""The sampler family's arguments and tracing, in both front ends: sample_tokens,
commit_tokens, add_gumbel_noise, get_num_transfer_tokens and get_transfer_index.

- The keyed noise is the same bits compiled (torch.compile with Inductor, which compiles
  integer arithmetic to C++, where a wrapping signed product is undefined behaviour) as eager.
- top_k wider than the vocabulary chunk draws as the whole row does, on every backend.
- Every number argument takes a 0-d array (torch, NumPy, JAX) or a NumPy scalar as the number
  it holds.
- Python-number arguments are checked on the host: every function traces under
  torch.compile(fullgraph=True) with them (jax.jit takes them as static values already).
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from harness import assert_close, framework


def _np(fw, x):
    return np.asarray(fw.numpy(x))


def _same(fw, got, want, where, exact=True):
    """Every array of two (nested) outputs equal, NaNs in the same places; with ``exact``
    False, floats to float32 accuracy (a compiler's fusions round them differently)."""
    if isinstance(want, (tuple, list)):
        assert len(got) == len(want), where
        for i, (g, w) in enumerate(zip(got, want)):
            _same(fw, g, w, f"{where}[{i}]", exact)
        return
    g, w = _np(fw, got), _np(fw, want)
    assert g.shape == w.shape, (where, g.shape, w.shape)
    if g.dtype.kind == "f" and not exact:
        assert_close(g, w, "float32", where)
    else:
        assert np.array_equal(g, w, equal_nan=g.dtype.kind == "f"), (where, g, w)


# -- the noise under Inductor -------------------------------------------------------------------

def test_compiled_noise_is_eager_noise_under_inductor(rng):
    """torch.compile (Inductor, the default, fullgraph) hashes as eager (which the suites
    check against the NumPy oracle), bit for bit: the uniforms u of the noise for one seed
    and for [B] seeds, distinct in every row. Through the public functions, against eager:
    add_gumbel_noise to float32 accuracy (Inductor's log is not eager's: g = -log(-log u)
    may differ by an ulp) and the tokens of sample_tokens ([B] seeds, top_k: the noise of
    per-row ids) exactly; and the rows of a uniform row of logits draw tokens spread as a
    uniform draw (chi-square) with the chunked backend. (Inductor compiles a wrapping int32
    product of row ids to C++, where signed overflow is undefined: it gave 2^31 - 1 for
    every row, the same noise in every row of a batch.)"""
    import torch

    from dlm_kernels._torch.ops import TorchOps as xp
    from dlm_kernels.sampling import core

    fw = framework("torch")
    api = fw.api
    b, l, k = 2, 3, 37
    seed, seeds = int(rng.integers(-2**31, 2**31)), rng.integers(-2**31, 2**31, b)
    z = fw.array(rng.normal(size=(b, l, k)) * 2, "float32")
    flat = fw.array(np.zeros((512, 8)), "float32")

    def uniforms(seed):  # [B·L, K] u of the noise, as sampling.core.gumbel forms it
        keys = core.row_keys(xp, seed, 2, b * l, z)
        cols = core.mix(xp, xp.u32(xp.arange(k, z)))
        return core.open_uniform(xp, core.mix(xp, keys[:, None] ^ cols[None, :]))

    def step(z, flat, seeds):
        return ([uniforms(seed), uniforms(seeds)],
                [api.sample_tokens(z, temperature=0.8, seed=seeds, step=2, top_k=4,
                                   backend="reference").token],
                api.add_gumbel_noise(z, 0.8, seed=seed, step=2),
                api.sample_tokens(flat, seed=seed, backend="chunked").token)

    torch._dynamo.reset()
    got = torch.compile(step, fullgraph=True)(z, flat, fw.array(seeds))
    want = step(z, flat, fw.array(seeds))
    _same(fw, got[0], want[0], "compiled vs eager uniforms")
    assert len(np.unique(_np(fw, got[0][0])[:, 0])) == b * l, "rows share their noise"
    _same(fw, got[1], want[1], "compiled vs eager tokens")
    assert_close(_np(fw, got[2]), _np(fw, want[2]), "float32", "compiled add_gumbel_noise")
    # (the uniform row's tokens are not compared with eager's: their keys tie to an ulp of
    # the noise, where Inductor's log may round the other way)
    counts = np.bincount(_np(fw, got[3]), minlength=8)
    chi2 = float(((counts - 64.0) ** 2 / 64.0).sum())  # 7 degrees of freedom; p = 1e-4: 29.9
    assert chi2 < 29.9, counts


# -- top_k wider than the chunk ------------------------------------------------------------

@pytest.mark.parametrize("fw_name,backend", [("torch", "chunked"), ("torch", "triton"),
                                             ("jax", "chunked"), ("jax", "pallas")])
def test_top_k_wider_than_the_chunk(rng, fw_name, backend):
    """top_k above the vocabulary chunk (chunk_size), and above K, draws what the whole row
    (the reference backend, which the suites check against the oracle) draws, tokens and
    argmax bit for bit, and scores them within float32 accuracy (the two backends sum a row
    in other orders: bitwise agreement is promised within one backend, docs/design.md §3):
    the JAX chunked stream's running top-k keeps min(top_k, K) slots through every chunk
    (its lax.fori_loop raised on a narrower chunk's slots)."""
    if backend == "triton" and os.environ.get("TRITON_INTERPRET") != "1":
        import torch

        if not torch.cuda.is_available():
            pytest.skip("the Triton kernel runs on a GPU or in its interpreter")
    fw = framework(fw_name)
    api = fw.api
    z = rng.normal(size=(5, 7)) * 2
    z[0, 3] = -np.inf  # fewer finite logits than slots
    z[0, 5] = -np.inf
    for top_k, chunk, t in ((5, 2, 0.7), (2, 1, 0.7), (9, 3, 1.3), (4, 2, 0.0)):
        where = f"top_k={top_k} chunk_size={chunk} T={t}"
        run = lambda backend, c: api.sample_tokens(  # noqa: E731
            fw.array(z, "float32"), temperature=t, seed=4, top_k=top_k, chunk_size=c,
            backend=backend)
        got, want = run(backend, chunk), run("reference", None)
        _same(fw, got, want, where, exact=False)
        assert np.all(_np(fw, got.token) >= 0), where


# -- 0-d numbers ------------------------------------------------------------------------------

def _zero_d(value):
    """value as a 0-d torch tensor, NumPy array, NumPy scalar and JAX array."""
    import jax.numpy as jnp
    import torch

    scalar = np.int64(value) if isinstance(value, int) else np.float64(value)
    return {"torch": torch.tensor(value), "numpy": np.array(value), "numpy scalar": scalar,
            "jax": jnp.asarray(value)}


def _calls(fw, rng):
    """{function: (call(**numbers), its Python-number arguments)} of every sampler-family
    function. Values exact in float32, so a float32 0-d array holds the same number."""
    api = fw.api
    z, zu = (fw.array(rng.normal(size=(2, 3, 20)) * 2, "float32") for _ in range(2))
    canvas, mask = fw.array(np.zeros((2, 3), np.int64)), fw.array(np.ones((2, 3), bool))
    sample = api.sample_tokens(z, seed=1, backend="reference")
    return {
        "sample_tokens": (lambda **kw: api.sample_tokens(z, uncond_logits=zu,
                                                         backend="reference", **kw),
                          dict(temperature=0.5, seed=5, step=2, top_k=3, cfg_scale=1.5,
                               chunk_size=8, stats_temperature=0.75, suppress_ids=4)),
        "commit_tokens topk": (lambda **kw: api.commit_tokens(canvas, sample, mask, **kw),
                               dict(k=2)),
        "commit_tokens threshold": (
            lambda **kw: api.commit_tokens(canvas, sample, mask, rule="threshold", **kw),
            dict(threshold=0.25)),
        "commit_tokens entropy_budget": (
            lambda **kw: api.commit_tokens(canvas, sample, mask, rule="entropy_budget", **kw),
            dict(budget=1.5)),
        "add_gumbel_noise": (lambda **kw: api.add_gumbel_noise(z, **kw),
                             dict(temperature=0.5, seed=5, step=2)),
        "get_num_transfer_tokens": (lambda **kw: api.get_num_transfer_tokens(mask, **kw),
                                    dict(steps=2)),
        "get_transfer_index": (
            lambda **kw: api.get_transfer_index(z, remasking="low_confidence", mask_index=mask,
                                                x=canvas, backend="reference", **kw),
            dict(temperature=0.5, num_transfer_tokens=2, seed=5, step=2)),
        "get_transfer_index threshold": (
            lambda **kw: api.get_transfer_index(z, 0.5, "random", mask, canvas, None,
                                                backend="reference", **kw),
            dict(threshold=0.25)),
    }


@pytest.mark.parametrize("fw_name", ["torch", "jax"])
def test_zero_d_numbers(rng, fw_name):
    """Every number argument of every sampler-family function takes a 0-d torch tensor,
    NumPy array, NumPy scalar or JAX array as the Python number it holds (the README's
    promise, kept by token_stats, which reads numbers with the same parser); a 0-d bool is
    not a number."""
    fw = framework(fw_name)
    for function, (call, numbers) in _calls(fw, rng).items():
        want = call(**numbers)
        forms = {name: _zero_d(value) for name, value in numbers.items()}
        for form in ("torch", "numpy", "numpy scalar", "jax"):  # every argument at once
            got = call(**{name: zero_d[form] for name, zero_d in forms.items()})
            _same(fw, got, want, f"{function}: {list(numbers)} as 0-d {form} values")
    call, numbers = _calls(fw, rng)["sample_tokens"]
    with pytest.raises(ValueError, match=r"temperature must be 0 \(greedy\) or in .*; got True"):
        call(temperature=np.array(True))


# -- Python numbers under tracing -------------------------------------------------------------

def test_python_numbers_trace_under_torch_compile(rng):
    """Every sampler-family function with Python-number arguments (and a list of suppressed
    ids) traces under torch.compile(fullgraph=True), as eager: the numbers are checked on the
    host while tracing, never as NumPy arrays, which Dynamo traces as tensors (a branch on
    their check was data-dependent). (Under jax.jit they are static: test_sampling's
    test_numpy_scalars_are_numbers.)"""
    import torch

    fw = framework("torch")
    api = fw.api
    z, zu = (fw.array(rng.normal(size=(2, 3, 20)) * 2, "float32") for _ in range(2))
    canvas = fw.array(np.zeros((2, 3), np.int64))

    def step(z, zu, mask):
        s = api.sample_tokens(z, temperature=0.5, seed=5, step=2, top_k=3, cfg_scale=1.5,
                              uncond_logits=zu, chunk_size=8, stats_temperature=0.75,
                              suppress_ids=[4, 7], backend="reference")
        s1 = api.sample_tokens(z, temperature=0.5, seed=5, suppress_ids=4, chunk_size=8,
                               backend="chunked")  # a narrower last chunk (K = 20)
        out = [tuple(s), tuple(s1), api.add_gumbel_noise(z, 0.5, seed=5, step=2),
               api.get_num_transfer_tokens(mask, 2)]
        out += [api.commit_tokens(canvas, s, mask, rule="topk", k=2),
                api.commit_tokens(canvas, s, mask, rule="threshold", threshold=0.25),
                api.commit_tokens(canvas, s, mask, rule="entropy_budget", budget=1.5)]
        out += [api.get_transfer_index(z, 0.5, "low_confidence", mask, canvas, 2, seed=5,
                                       backend="reference"),
                api.get_transfer_index(z, 0.9, "random", mask, canvas, None, 0.25, step=1,
                                       backend="reference"),
                api.get_transfer_index(z, 0.0, "low_confidence", mask, canvas, None,
                                       threshold=0.9, neg_entropy=True, backend="reference")]
        return out

    mask = fw.array(rng.uniform(size=(2, 3)) < 0.7)
    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    _same(fw, compiled(z, zu, mask), step(z, zu, mask), "compiled vs eager")
    # a bad number raises while tracing (torch.compile(fullgraph=True) reports the
    # ValueError inside its own Unsupported error)
    with pytest.raises(Exception, match=r"k must be >= 0 \(positions to commit per "
                                        r"sequence\); got -1"):
        torch.compile(lambda s, m: api.commit_tokens(canvas, s, m, k=-1), fullgraph=True,
                      backend="aot_eager")(api.sample_tokens(z), mask)
