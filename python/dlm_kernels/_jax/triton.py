"""The jax-triton host every op's JAX Triton backend shares: the guarded ``jax_triton`` import,
the launch wrapper and the vmap fold.

jax-triton refuses to import unless jaxlib has GPU support, so on CPU-only machines importing
this module raises ImportError, and so does importing each op's JAX Triton module; the
registries record why (``backend="triton"`` then says so). Install it where it can run:
``pip install jax-triton`` beside ``jax[cuda]``. On CPU the tests run it against
``tests/jax_triton_emulator.py`` (jax-triton's calling convention, kernels in the Triton
interpreter).

What jax-triton leaves to the caller, done here: ``vmap`` (triton_call has no batching rule:
the mapped axis is folded into the rows, ``rows_vmappable``) and ``shard_map`` typing (its
outputs are typed as the same on every device: ``launch`` casts them to vary like their
operands).
"""

from __future__ import annotations

import inspect
import os

from .._env import unmet_requirement

_CACHE_DIR = "TRITON_CACHE_DIR"


def _import_jax_triton():
    """``import jax_triton``, undoing the one process-wide change it makes on import.

    jax-triton (0.3.1, the H200 image's) sets TRITON_CACHE_DIR to "" when imported. Triton
    3.x reads an empty value as "no cache directory", so every later ``triton.compile`` in
    the process (the torch backend's kernels beside this one, Liger's, a benchmark's) would
    raise "Could not create or locate cache dir". jax-triton compiles without that cache, so
    the variable goes back to what it was (unset, Triton's default, when it was unset or
    already blank)."""
    before = os.environ.get(_CACHE_DIR)
    try:
        import jax_triton
    finally:
        if os.environ.get(_CACHE_DIR) == "":
            if before:
                os.environ[_CACHE_DIR] = before
            else:
                del os.environ[_CACHE_DIR]
    return jax_triton


try:
    jt = _import_jax_triton()
except Exception as err:  # noqa: BLE001 - jax-triton raises ImportError or RuntimeError
    raise ImportError(
        f"jax-triton is not importable here (it needs a GPU-enabled jaxlib): {err}") from err
_MISMATCH = unmet_requirement("jax-triton", "triton")
if _MISMATCH is not None:  # it would import, then fail at the first lowering
    raise ImportError(f"{_MISMATCH} (jax-triton 0.3.1 goes with Triton 3.6)")

import jax

from .batching import fold_vmap_into_rows
from .ops import JaxOps

# jax-triton renamed out_shape= to out_type= (the old name still works, with a warning)
_OUT_KW = ("out_type" if "out_type" in inspect.signature(jt.triton_call).parameters
           else "out_shape")


_varying = JaxOps.varying_axes
_to_varying = JaxOps.to_varying


def unsupported_reason(platform):
    """None where the Triton kernels take JAX arrays of ``platform``, else why not."""
    if platform in ("gpu", "cuda"):
        return None
    return f"the Triton kernels run on NVIDIA GPUs only (arrays are on {platform!r})"


def launch(kernel, arrays, scalars, out, grid, **options):
    """jt.triton_call(*arrays, *scalars) -> out (a ShapeDtypeStruct or a tuple of them).
    Inside ``jax.shard_map`` the outputs vary over every mesh axis their operands vary over
    (a type cast, no communication; left invariant, their cotangents would be summed over
    the devices)."""
    res = jt.triton_call(*arrays, *scalars, kernel=kernel, grid=grid, **{_OUT_KW: out},
                         **options)
    axes = frozenset().union(*map(_varying, arrays))
    cast = lambda o: _to_varying(o, tuple(sorted(axes - _varying(o)))) if axes - _varying(o) else o
    return jax.tree_util.tree_map(cast, res)


def rows_vmappable(fn, *arrays):
    """fn(*arrays) with None entries passed through; a vmapped call runs once on B·N rows."""
    present = [a is not None for a in arrays]

    def call(*given):
        given = iter(given)
        return fn(*(next(given) if p else None for p in present))

    return fold_vmap_into_rows(call)(*(a for a in arrays if a is not None))
