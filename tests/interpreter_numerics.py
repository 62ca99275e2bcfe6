"""Triton's interpreter narrows float32 to bfloat16 by truncation (it drops the low 16 bits:
``cast_impl`` with no rounding mode), where a compiled kernel rounds to nearest even
(``arith.truncf``, ``cvt.rn.bf16.f32`` in the PTX, which ``aot_probe.py`` checks). Every
bfloat16 result the interpreted kernels store would then be up to one ulp (2^-7 relative)
off instead of half of one, and a test that checks rounding could not tell a kernel that
rounds from one that truncates. ``install`` makes the interpreter round as the GPU does; the
tests install it before any kernel runs (``conftest.py``)."""

from __future__ import annotations

import numpy as np


def bfloat16_bits(x):
    """float32 -> bfloat16 bit patterns (uint16), rounded to nearest, ties to even; NaN stays
    a (quiet) NaN of the same sign, overflow goes to infinity."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    bits = x.view(np.uint32).astype(np.uint64)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    nan = (bits >> 16) | 0x0040
    return np.where(np.isnan(x), nan, rounded).astype(np.uint16)


def install():
    """Patch the interpreter's float32 -> bfloat16 conversion (idempotent)."""
    import triton.language as tl
    from triton.runtime import interpreter

    cls = interpreter.InterpreterBuilder
    original = cls.cast_impl
    if getattr(original, "rounds_bfloat16", False):
        return

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            return interpreter.TensorHandle(bfloat16_bits(src.data), dst_type.scalar)
        return original(self, src, dst_type)

    cast_impl.rounds_bfloat16 = True
    cls.cast_impl = cast_impl
