"""A CPU stand-in for ``jax_triton.triton_call``, so the JAX triton backend's launches run
in tests without a GPU.

jax-triton imports only beside a GPU-enabled jaxlib. This module offers the one function the
backend uses, with jax-triton's calling convention: array arguments become pointers in the
order given, Python scalars are static, one output per leaf of ``out_type`` (formerly
``out_shape``) is appended after the inputs and the operand count must match the kernel's
non-constexpr parameters, ``grid`` is a tuple (or a callable of the metaparameters), and
constexprs come as keyword metaparameters. The launch runs the same kernel source in the
Triton interpreter (TRITON_INTERPRET=1, set in conftest) on torch CPU tensors inside
``jax.pure_callback``, so it works under ``jit``, ``grad`` and ``shard_map``; like
jax-triton it has no vmap rule and types its outputs as device-invariant.

What this checks: the argument wiring (order, count, dtypes, strides of row-major arrays),
output shapes, grids, traced values reaching the kernel only as arrays, and the numbers.
What it cannot check: jax-triton's own typing, specialisation and lowering (float64 float
scalars, no divisibility marks on integers: tests/jax_triton_probe.py lowers every launch
through the real jax-triton where it is installed, and the AOT test compiles the kernels
typed that way) and a real GPU launch (bench/gpu_check.sh).
Outputs start as NaN: jax-triton leaves them uninitialised, so an unwritten element fails.
"""

from __future__ import annotations

import inspect
import threading

import jax
import ml_dtypes
import numpy as np
import torch

_LOCK = threading.Lock()  # the Triton interpreter patches triton.language while it runs
_TORCH_DTYPES = {np.dtype(np.float32): torch.float32, np.dtype(np.float16): torch.float16,
                 np.dtype(ml_dtypes.bfloat16): torch.bfloat16, np.dtype(np.int8): torch.int8,
                 np.dtype(np.int32): torch.int32, np.dtype(np.int64): torch.int64}


def _is_array(a) -> bool:
    return hasattr(a, "shape") and hasattr(a, "dtype")


def _to_torch(a: np.ndarray) -> torch.Tensor:
    a = np.ascontiguousarray(a)
    if a.dtype == ml_dtypes.bfloat16:
        return torch.from_numpy(a.view(np.int16).copy()).view(torch.bfloat16)
    return torch.from_numpy(a.copy())


def _to_numpy(t: torch.Tensor) -> np.ndarray:
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()


def _operand_count(kernel) -> int:
    fn = getattr(kernel, "fn", kernel)
    return sum("constexpr" not in str(p.annotation)
               for p in inspect.signature(fn).parameters.values())


def triton_call(*args, kernel, out_type=None, grid, num_warps=4, num_stages=3, **metaparams):
    """Launch ``kernel`` on ``args`` (+ one output per leaf of ``out_type``) as jax-triton
    does; ``out_shape=`` is its older spelling. Like jax-triton, no vmap rule (fold the
    batch into the call) and no autodiff (wrap it in a custom_vjp)."""
    if "out_shape" in metaparams:
        if out_type is not None:
            raise TypeError("Cannot specify both out_type= and the deprecated out_shape=")
        out_type = metaparams.pop("out_shape")
    if out_type is None:
        raise TypeError("Either out_type= or the deprecated out_shape= must be provided")
    for i, a in enumerate(args):
        if not _is_array(a) and not isinstance(a, (bool, int, float)):
            raise TypeError(f"triton_call argument {i}: jax-triton passes arrays and static "
                            f"Python scalars only; got {type(a).__name__}")
    flat_out, tree = jax.tree_util.tree_flatten(out_type)
    missing = _operand_count(kernel) - len(args)
    if missing != len(flat_out):
        raise ValueError(f"out_type has {len(flat_out)} outputs, but {missing} kernel "
                         "parameters are missing an argument")
    is_array = [_is_array(a) for a in args]
    arrays = [a for a, isa in zip(args, is_array) if isa]
    launch_grid = grid(metaparams) if callable(grid) else grid
    launch_grid = (launch_grid,) if isinstance(launch_grid, int) else tuple(launch_grid)

    def host(*values):
        with _LOCK:
            values = iter(values)
            kernel_args = [_to_torch(np.asarray(next(values))) if isa else a
                           for a, isa in zip(args, is_array)]
            outs = [torch.full(o.shape, float("nan"), dtype=_TORCH_DTYPES[np.dtype(o.dtype)])
                    if np.issubdtype(o.dtype, np.floating) or o.dtype == ml_dtypes.bfloat16
                    else torch.zeros(o.shape, dtype=_TORCH_DTYPES[np.dtype(o.dtype)])
                    for o in flat_out]
            kernel[launch_grid](*kernel_args, *outs, num_warps=num_warps,
                                num_stages=num_stages, **metaparams)
            return tuple(_to_numpy(o) for o in outs)

    # vmap_method=None: vmapping this raises, as jax-triton's batching rule does
    results = jax.pure_callback(host, tuple(jax.ShapeDtypeStruct(o.shape, o.dtype)
                                            for o in flat_out), *arrays)
    return jax.tree_util.tree_unflatten(tree, list(results))
