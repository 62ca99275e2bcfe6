"""Reading optimised HLO text: what a compiled JAX program sends between devices."""

import numpy as np


def allreduce_bytes(hlo_text):
    """Bytes of every all-reduce in an optimised HLO module's text (result shapes), one entry
    per all-reduce op; used to check that sharded programs move O(N), not O(N·K)."""
    import re

    sizes = {"f32": 4, "s32": 4, "u32": 4, "f16": 2, "bf16": 2, "f64": 8, "s64": 8, "pred": 1}
    out = []
    for line in hlo_text.splitlines():
        if not re.search(r"\ball-reduce(-start)?\(", line) or "=" not in line:
            continue
        lhs = line.split("=", 1)[1].split("all-reduce", 1)[0]
        total = 0
        for dtype, dims in re.findall(r"\b(f32|s32|u32|f16|bf16|f64|s64|pred)\[([\d,]*)\]", lhs):
            elems = int(np.prod([int(v) for v in dims.split(",") if v])) if dims else 1
            total += elems * sizes[dtype]
        out.append(total)
    return out
