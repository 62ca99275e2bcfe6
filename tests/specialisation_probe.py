"""Compile the token-statistics kernels for sm_90 as launches of different row counts
specialise them, and print each compile's float32 arithmetic (one JSON line).

Usage: python specialisation_probe.py. Triton specialises every integer argument at launch:
1 becomes the constant 1 (jax-triton does the same), a multiple of 16 is marked divisible
by 16. The row count N is such an argument, so a lone row (N = 1), a batch of 23 rows and
one of 32 rows run three different compilations of each kernel. A row gets the same bits
in all three only if they do the same float32 operations; the layout the compiler picks
for a tile decides the order of any sum across threads, and a changed order shows as a
changed count of additions, FMAs and shuffles. Printed: {"kernel[N]": {op: count}} for
N in 1, 23, 32, each integer argument other than N typed and marked as the launch at
K = 262144 marks it (float32 logits, every feature on). Exit 3 without a Triton that
compiles for sm_90 (ptxas). A subprocess of the tests, since the interpreter is on there.
"""

import collections
import json
import os
import re
import sys

import triton
from triton._C.libtriton import native_specialize_impl
from triton.backends.compiler import BaseBackend, GPUTarget
from triton.compiler import ASTSource

from dlm_kernels.kernels.triton import token_stats as K

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from sm90_launch import (VOCAB, finalize_kernel, ptxas_or_exit, stats_arg_types,  # noqa: E402
                         stats_launch_ints, streaming_kernels)

ROW_COUNTS = (1, 23, 32)
# float32 arithmetic and the cross-thread shuffles a tl.sum / tl.max lowers to
FLOAT_OP = re.compile(r"^\s*((?:add|sub|mul|fma|div|ex2|lg2|max|min|rcp|neg|abs)(?:\.\w+)*\.f32"
                      r"|shfl\.sync\.\w+\.b32)", re.M)


def float_ops(ptx):
    return dict(collections.Counter(m.group(1) for m in FLOAT_OP.finditer(ptx)))


def main():
    ptxas_or_exit()
    plan = K.launch_config(VOCAB, 4, True)
    flags = dict(HAS_SOFTCAP=True, HAS_SHIFT=True, HAS_TEACHER=True, SEPARATE_CE=True,
                 HAS_ENTROPY=True)
    types = stats_arg_types("*fp32")
    kernels = streaming_kernels(plan, flags, True) + [finalize_kernel(flags)]
    report = {}
    for fn, constexprs, warps in kernels:
        for n in ROW_COUNTS:
            ints = stats_launch_ints(plan, n)
            cx, sig, attrs = dict(constexprs), {}, {}
            for i, name in enumerate(fn.arg_names):
                if name in cx:
                    sig[name] = "constexpr"
                elif types[name].startswith("*"):
                    sig[name] = types[name]
                    attrs[(i,)] = [["tt.divisibility", 16]]
                elif types[name].startswith("fp"):
                    sig[name] = types[name]
                else:  # an integer: as Triton's launch specialises its value
                    kind, key = native_specialize_impl(BaseBackend, ints[name], False, True,
                                                       True)
                    if kind == "constexpr":
                        cx[name], sig[name] = key, "constexpr"
                        continue
                    sig[name] = kind
                    if key == "D":
                        attrs[(i,)] = [["tt.divisibility", 16]]
            src = ASTSource(fn=fn, signature=sig, constexprs=cx, attrs=attrs)
            compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                                      options=dict(num_warps=warps, num_stages=2))
            report[f"{fn.__name__}[{n}]"] = float_ops(compiled.asm["ptx"])
    print(json.dumps(report))


if __name__ == "__main__":
    main()
