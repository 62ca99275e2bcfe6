"""Shared test machinery: the tolerance table, a diagnostic assert and framework adapters.

Every test draws fresh inputs from a seed it prints (``DLM_TEST_SEED`` replays one), feeds
the oracle the exact values the framework sees (inputs are rounded to their dtype first),
and compares every element.
"""

from __future__ import annotations

import os

import numpy as np

# (atol, rtol) per dtype of the *output* compared. All math is float32, so every row shares
# the float32 absolute floor (float32 eps x logit-scale statistics such as lse ~ 10); rtol
# adds the final rounding to the output dtype (bf16: 2^-9 relative, fp16: 2^-12). Row
# statistics are float32 whatever the input dtype (the oracle sees the same rounded
# inputs), so they use the float32 row; gradients use the row of the input dtype.
TOLERANCES = {
    "float32": (2e-6, 2e-5),
    "bfloat16": (2e-6, 8e-3),
    "float16": (2e-6, 1e-3),
}
DTYPES = tuple(TOLERANCES)


def new_seed():
    env = os.environ.get("DLM_TEST_SEED")
    seed = int(env) if env else int(np.random.SeedSequence().entropy % (2**31))
    print(f"DLM_TEST_SEED={seed}")
    return seed


def assert_close(actual, expected, dtype="float32", name="value"):
    """Every element within the dtype's (atol, rtol); NaN only where NaN is expected.

    On failure: how many elements differ, max abs/rel error, the first bad index and values.
    """
    atol, rtol = TOLERANCES[dtype]
    a = np.asarray(actual, dtype=np.float64)
    e = np.asarray(expected, dtype=np.float64)
    assert a.shape == e.shape, f"{name}: shape {a.shape} != expected {e.shape}"
    ok = np.isclose(a, e, atol=atol, rtol=rtol, equal_nan=True)
    if not ok.all():
        bad = np.argwhere(~ok)
        idx = tuple(int(i) for i in bad[0])
        with np.errstate(invalid="ignore", divide="ignore"):
            err = np.abs(a - e)
            rel = err / np.maximum(np.abs(e), 1e-30)
        finite = np.isfinite(err)
        raise AssertionError(
            f"{name} ({dtype}, atol={atol}, rtol={rtol}): {len(bad)} of {a.size} elements "
            f"differ; max abs err {np.max(err[finite], initial=0):.3e}, max rel err "
            f"{np.max(rel[finite], initial=0):.3e}; first bad index {idx}: got {a[idx]!r}, "
            f"expected {e[idx]!r}"
        )


def assert_exact_zero(actual, name="value"):
    a = np.asarray(actual, dtype=np.float64)
    nz = np.argwhere(a != 0)
    assert len(nz) == 0, f"{name}: {len(nz)} non-zero elements; first at {tuple(nz[0])}: {a[tuple(nz[0])]!r}"


class TorchFW:
    name = "torch"

    def __init__(self):
        import torch

        import dlm_kernels.torch as api

        self.torch, self.api = torch, api
        self.dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16,
                       "float16": torch.float16}

    def array(self, a, dtype=None):
        t = self.torch.as_tensor(np.asarray(a))
        return t.to(self.dtypes[dtype]) if dtype else t

    def numpy(self, t):
        t = t.detach()
        return (t.double() if t.dtype.is_floating_point else t).numpy()

    def vjp(self, fn, primals, cotangents):
        """(outputs as float64 NumPy, d<Σ cot·out>/d primal for each primal)."""
        torch = self.torch
        leaves = [p.detach().clone().requires_grad_(True) for p in primals]
        outs = fn(*leaves)
        pairs = [(o, self.array(c).to(o.dtype)) for o, c in zip(outs, cotangents)
                 if o.requires_grad]
        grads = [None] * len(leaves)
        if pairs:
            grads = torch.autograd.grad([o for o, _ in pairs], leaves, [c for _, c in pairs],
                                        allow_unused=True)
        grads = [np.zeros(p.shape) if g is None else self.numpy(g) for p, g in zip(leaves, grads)]
        return [self.numpy(o) for o in outs], grads


class JaxFW:
    name = "jax"

    def __init__(self):
        import jax
        import jax.numpy as jnp

        import dlm_kernels.jax as api

        self.jax, self.jnp, self.api = jax, jnp, api
        self.dtypes = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}

    def array(self, a, dtype=None):
        a = self.jnp.asarray(np.asarray(a))
        return a.astype(self.dtypes[dtype]) if dtype else a

    def numpy(self, a):
        a = np.asarray(a)
        return a if np.issubdtype(a.dtype, np.integer) or a.dtype == bool else a.astype(np.float64)

    def vjp(self, fn, primals, cotangents):
        outs, vjp_fn = self.jax.vjp(lambda *p: tuple(fn(*p)), *primals)
        cots = tuple(self.jnp.asarray(c).astype(o.dtype) for o, c in zip(outs, cotangents))
        grads = vjp_fn(cots)
        return [self.numpy(o) for o in outs], [self.numpy(g) for g in grads]


_CACHE = {}


def framework(name):
    if name not in _CACHE:
        _CACHE[name] = {"torch": TorchFW, "jax": JaxFW}[name]()
    return _CACHE[name]
