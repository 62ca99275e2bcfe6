"""The chunked backend's forward on a CPU as compiled loops: ``stats_math.chunk_partial`` over
blocks of whole rows, compiled once per configuration by Inductor (``torch.compile``).

Eager, the forward runs a few ATen calls per cached tile (``torch_chunked._tile_partial``),
each a pass over the tile; compiled, the same formulas become one C++ loop nest per row
that reads the logits (and the teacher) twice, for the row max and for the sums, and writes
nothing but the [R] state: no [R, K] temporary (bench/NOTES.md, "A compiled forward").

Used for CPU calls of at least ``COMPILE_MIN_LOGITS`` logits outside tracing, where the
compile (a few seconds, once per configuration and dtype in a process; Inductor's cache on
disk shortens it for later processes) pays for itself. Rows go in blocks of
``BLOCK_BYTES`` float32 bytes, so that if the compiled function ever runs eagerly
(``torch.compiler.set_stance("force_eager")``, Dynamo disabled, its recompile limit
reached) its temporaries stay [R, K] blocks, never [N, K]. The first compile that fails
(no C++ compiler on the machine) says so once and leaves the eager tiles in charge.
"""

from __future__ import annotations

import threading
import warnings
from typing import Callable, Optional

import torch

from . import math as stats_math
from .lowering import Lowered
from .._rows import Rows
from .._torch.ops import TorchOps as xp

COMPILE_MIN_LOGITS = 1 << 24  # N·K of the smallest call that compiles its forward
BLOCK_BYTES = 64 << 20  # float32 bytes of one block of rows ([R, K] values)
MIN_SIDE = 2  # rows per block and columns at least: Dynamo specialises sizes 0 and 1


class Float64Sums(xp):
    """The torch adapter with row sums accumulated in float64, for the teacher's sums. A
    compiled row sum runs lane by lane, up to 4096 terms in a lane before its partials
    combine (Inductor's cascade sums need a size it knows, and K is symbolic here), where
    ATen sums in a tree. The CE's sums only enter logarithms, but the KL takes differences
    of the teacher's (``stats_math.kl_divergence``): with float32 lane sums it came out
    4e-5 off at K 131072, T = 1000 and 6e-4 at T = 100 (tests/test_domain.py)."""

    @staticmethod
    def rowsum(x):  # [..., C] -> [...] float32
        return x.sum(dim=-1, dtype=torch.float64).float()


def _block_state(z, u, shift_ids, shift, cols, cfg: Lowered) -> stats_math.State:
    # z, u: [R, K] a block of whole rows (u may be None); cols: [K] their global ids
    ops = Float64Sums if cfg.HAS_TEACHER else xp
    block = Rows(z, u, shift_ids=shift_ids, shift=shift)
    valid = stats_math.column_mask(ops, cols, cfg)
    return stats_math.chunk_partial(ops, block, cols, valid, cfg, pointwise_shift=True)


class _Compiled:
    """The compiled ``_block_state`` (made at its first use) and what its compiles did."""

    lock = threading.Lock()
    fn: Optional[Callable[..., stats_math.State]] = None
    failed = False  # no compile has worked and one failed: no compiler on this machine
    worked = False
    warned = False


def _compiled() -> Optional[Callable[..., stats_math.State]]:
    with _Compiled.lock:
        if _Compiled.fn is None and not _Compiled.failed:
            _Compiled.fn = torch.compile(_block_state, dynamic=True, fullgraph=True)
        return _Compiled.fn


def _fell_back(err: Exception) -> None:
    """A compile failed: before any worked, the compiled forward is off for the process (no
    C++ compiler, say); after, only this configuration runs eagerly (Dynamo's recompile
    limit, say). Said once."""
    _Compiled.failed = not _Compiled.worked
    if not _Compiled.warned:
        _Compiled.warned = True
        warnings.warn(f"dlm_kernels: the compiled CPU forward failed ({type(err).__name__}: {err}); "
                      "the eager tiles run instead", RuntimeWarning, stacklevel=3)


def use_compiled(n: int, k: int) -> bool:
    """Whether a CPU call of [N, K] logits (outside tracing) takes the compiled forward."""
    return n * k >= COMPILE_MIN_LOGITS and n >= MIN_SIDE and k >= MIN_SIDE and not _Compiled.failed


def row_blocks(n: int, k: int) -> list[tuple[int, int]]:
    """[(r0, r1)]: blocks of BLOCK_BYTES of float32 rows; the last takes a remainder of
    fewer than MIN_SIDE rows (no size that Dynamo specialises)."""
    rows = max(MIN_SIDE, BLOCK_BYTES // (4 * k))
    starts = list(range(0, n, rows))
    if len(starts) > 1 and n - starts[-1] < MIN_SIDE:
        starts.pop()
    return [(r0, starts[i + 1] if i + 1 < len(starts) else n) for i, r0 in enumerate(starts)]


def compiled_partial(rows: Rows, cfg: Lowered, offset: int = 0) -> Optional[stats_math.State]:
    """The merged State of ``rows`` (CPU tensors, [N, K] logits, columns [offset, offset + K))
    from the compiled block loop; None when the compile is unavailable."""
    fn = _compiled()
    if fn is None:
        return None
    z, u = rows.logits, rows.teacher
    n, k = z.shape
    cols = torch.arange(offset, offset + k)  # [K] global column ids
    parts = []
    for r0, r1 in row_blocks(n, k):
        sl = slice(r0, r1)
        args = (z[sl], None if u is None else u[sl],
                None if rows.shift_ids is None else rows.shift_ids[sl],
                None if rows.shift is None else rows.shift[sl], cols, cfg)
        try:
            parts.append(fn(*args))
        except Exception as err:  # noqa: BLE001 - no compiler here, or Dynamo's recompile limit
            if parts:
                raise
            _fell_back(err)
            return None
        _Compiled.worked = True
    return stats_math.State(*(torch.cat(f) if len(parts) > 1 else f[0] for f in zip(*parts)))
