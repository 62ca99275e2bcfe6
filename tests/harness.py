"""Shared test machinery: the tolerance table, a diagnostic assert and framework adapters.

Every test draws fresh inputs from a seed it prints (``DLM_TEST_SEED`` replays one), feeds
the oracle the exact values the framework sees (inputs are rounded to their dtype first),
and compares every element.
"""

from __future__ import annotations


import contextlib
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

from dlm_kernels.testing import (  # noqa: F401
    DTYPES, TOLERANCES, assert_close, assert_exact_zero, new_seed)


_MISSING = object()


@contextlib.contextmanager
def torch_configs_restored(module_names: tuple[str, ...]) -> Iterator[None]:
    """Every entry of torch's configuration modules ``module_names`` that are loaded on entry
    has its value from before on exit, whatever ran inside: set, patched or deleted.
    (``monkeypatch.setattr`` on such a module is unsafe: pytest 9.2's undo deletes an
    attribute the module serves through ``__getattr__``, torch then hides the entry, and every
    later ``torch.compile`` in the process fails.) A module loaded inside keeps its defaults;
    nothing here imports torch."""
    saved = {name: sys.modules[name].get_config_copy()
             for name in module_names if name in sys.modules}
    try:
        yield
    finally:
        for name, before in saved.items():
            module = sys.modules[name]
            for key, value in before.items():
                # a deleted entry is hidden: getattr raises, and setattr shows it again
                if getattr(module, key, _MISSING) is not value:
                    setattr(module, key, value)


class TorchFW:
    name = "torch"

    def __init__(self):
        import torch

        import dlm_kernels.torch as api
        from dlm_kernels._torch.framework import TORCH

        self.torch, self.api, self.registry = torch, api, TORCH.token_stats
        # DLM_TEST_DEVICE=cuda runs the same suites on a GPU (bench/gpu_check.sh does).
        self.device = os.environ.get("DLM_TEST_DEVICE", "cpu")
        self.dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16,
                       "float16": torch.float16}

    def array(self, a, dtype=None):
        t = self.torch.as_tensor(np.asarray(a), device=self.device)
        return t.to(self.dtypes[dtype]) if dtype else t

    def numpy(self, t):
        t = t.detach()
        return (t.double() if t.dtype.is_floating_point else t).cpu().numpy()

    def vjp(self, fn, primals, cotangents, args=()):
        """(outputs as float64 NumPy, d<Σ cot·out>/d primal for each primal) of
        ``fn(*primals, *args)``: ``args`` are further inputs, not differentiated."""
        torch = self.torch
        leaves = [p.detach().clone().requires_grad_(True) for p in primals]
        outs = fn(*leaves, *args)
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
        from dlm_kernels._jax.framework import JAX

        self.jax, self.jnp, self.api, self.registry = jax, jnp, api, JAX.token_stats
        self.dtypes = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}

    def array(self, a, dtype=None):
        a = self.jnp.asarray(np.asarray(a))
        return a.astype(self.dtypes[dtype]) if dtype else a

    def numpy(self, a):
        a = np.asarray(a)
        return a if np.issubdtype(a.dtype, np.integer) or a.dtype == bool else a.astype(np.float64)

    def vjp(self, fn, primals, cotangents, jit=True, args=()):
        """As TorchFW.vjp, the forward and its VJP traced into one ``jax.jit`` program (as
        training code runs them; ``jit=False``: op by op). One compilation per call costs a
        third of op-by-op dispatch, which compiles every primitive at every new shape.
        ``args`` (ids, weights, a teacher not differentiated) are the program's arguments, as
        in training: an array that ``fn`` closes over instead is a constant of the program,
        which XLA folds while compiling (its reductions evaluated by the compiler, not by the
        code under test, and seconds of compile time for a teacher of 2^17 columns)."""
        jax, jnp = self.jax, self.jnp

        def outputs_and_grads(primals, cotangents, args):
            outs, vjp_fn = jax.vjp(lambda *p: tuple(fn(*p, *args)), *primals)
            cots = tuple(c.astype(o.dtype) for o, c in zip(outs, cotangents))
            return outs, vjp_fn(cots)

        run = jax.jit(outputs_and_grads) if jit else outputs_and_grads
        outs, grads = run(tuple(primals), tuple(jnp.asarray(c) for c in cotangents),
                          tuple(args))
        return [self.numpy(o) for o in outs], [self.numpy(g) for g in grads]


_CACHE = {}


def framework(name):
    if name not in _CACHE:
        _CACHE[name] = {"torch": TorchFW, "jax": JaxFW}[name]()
    return _CACHE[name]


def case_id(case: Any) -> str:
    """A case's test id: a tuple's values joined with '-' (``(3, 5), 1271, 'bfloat16'``:
    ``(3, 5)-1271-bfloat16``), anything else as str()."""
    return "-".join(str(v) for v in case) if isinstance(case, tuple) else str(case)


def cases(*values: Any) -> Callable[..., Any]:
    """A suite class's parametrised argument: ``ce_dtype = cases("float32", "bfloat16")`` in
    the class body makes every test of the class that takes ``ce_dtype`` run once per value.
    A subclass runs other cases by assigning the name again (``ce_dtype = cases("bfloat16")``):
    it is a pytest fixture defined in the class body, overridden as a method is."""

    @pytest.fixture(params=list(values), ids=case_id)
    def case(self: object, request: pytest.FixtureRequest) -> Any:
        return request.param

    return case
