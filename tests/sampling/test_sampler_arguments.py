"""The sampler family's arguments and tracing, in both front ends: sample_tokens,
commit_tokens, add_gumbel_noise, get_num_transfer_tokens and get_transfer_index.

- Every number argument takes a 0-d array (torch, NumPy, JAX) or a NumPy scalar as the number
  it holds.
- Python-number arguments are checked on the host: every function traces under
  torch.compile(fullgraph=True) and jax.jit with them.
"""

from __future__ import annotations

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
        s1 = api.sample_tokens(z, temperature=0.5, seed=5, suppress_ids=4, backend="reference")
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
