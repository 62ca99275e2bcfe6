"""The chunked backend on a CPU as compiled loops: the forward's ``stats_math.chunk_partial``
and the backward's ``stats_math.chunk_grads``, compiled once per configuration by Inductor
(``torch.compile``), for calls of at least ``COMPILE_MIN_VOCAB`` columns outside tracing.
The choice depends on K alone, never on the number of rows: the compiled loops sum a row's
terms in another order than the eager tiles, so a threshold on N·K would give the same row
other bits in a larger batch (docs/design.md §2, "One row, one answer"). A call of one row
runs as two copies of it (Dynamo specialises a size of 1).

Eager, each cached tile takes a few ATen calls, each a pass over the tile
(``torch_chunked._tile_partial``, ``_tile_grads_into``); compiled, the same formulas become
one C++ loop nest: the forward reads each [R, C] tile twice (its row max, then its sums) and
writes only the [R] state, which tiles merge as the chunk loop merges chunks; the backward
reads the logits (and the teacher) once and writes the gradient in its dtype, into the
buffer the backend allocated or, with ``inplace_grad``, over the logits themselves (the same
formulas in a graph of their own, with the same bits in the tests; each element's gradient
reads the logits at its own position alone). No [R, K] temporary (bench/NOTES.md, "Compiled
loops and huge pages").

The compile takes seconds, once per configuration and dtype in a process (with a LOO shift,
a second forward graph for the shifted rows), so only large calls use it; the first one in a
process says so in one log record (logger "dlm_kernels", level WARNING: a call of several
seconds that is not a hang). Inductor's caches on disk (its FX graph and AOTAutograd
caches, on by default) serve the generated code to later processes, which skip the C++
build; Dynamo still traces in each new process, so its first large call still takes
seconds. Work goes in blocks of
``BLOCK_BYTES`` float32 bytes, so that if a compiled function ever runs eagerly
(``torch.compiler.set_stance("force_eager")``, Dynamo disabled) its temporaries stay
blocks, never [N, K]. A compile that fails (no C++ compiler on the machine, Dynamo's
recompile limit of 8 graphs a function by default, ``torch._dynamo.config.recompile_limit``)
says so once and leaves the eager tiles in charge of that call.
"""

from __future__ import annotations

import logging
import threading
import warnings
from typing import Callable, Optional

import torch

from . import formulas as stats_math
from .lowering import Lowered
from .._rows import Rows
from .._torch.ops import TorchOps as xp

COMPILE_MIN_VOCAB = 8192  # K of the smallest call that takes the compiled loops
BLOCK_BYTES = 64 << 20  # float32 bytes of one block ([R, K] rows, or an [R, C] tile) at most
SUM_COLUMNS = 4096  # columns of one forward tile: 256 terms in each of a compiled sum's 16 lanes
MIN_SIDE = 2  # rows per block and columns at least: Dynamo specialises sizes 0 and 1
#: Inductor's options: a parallel loop nest whatever sizes the first call had. Inductor
#: decides a loop's threads once, from the sizes of the call that compiled it, and its cache
#: on disk serves that code to every later process: a first call of [6, 97] (a test) left
#: the float32 backward on one thread for calls of [128, 131072] (OPD: 55 against 19 ms a
#: block). Dynamic threads take the thread count at run time, from ``torch.get_num_threads()``.
_OPTIONS = {"cpp.dynamic_threads": True}
logger = logging.getLogger("dlm_kernels")


def _tile_state(z, u, shift_ids, shift, cols, cfg: Lowered) -> stats_math.State:
    # z, u: [R, C] a tile of rows and columns (u may be None); cols: [C] their global ids
    block = Rows(z, u, shift_ids=shift_ids, shift=shift)
    valid = stats_math.column_mask(xp, cols, cfg)
    return stats_math.chunk_partial(xp, block, cols, valid, cfg, pointwise_shift=True)


def _block_grads(dz, du, z, u, targets, active, shift_ids, shift, cols, stats, grads,
                 cfg: Lowered) -> None:
    # dz, du, z, u: [R, K] a block of whole rows (u, du may be None); the rest per row
    block = Rows(z, u, targets, active, shift_ids, shift)
    gz, gu = stats_math.chunk_grads(xp, block, cols, stats, grads, cfg, pointwise=True)
    dz.copy_(gz)  # written in dz's dtype by the same loop
    if du is not None:
        du.copy_(gu)


def _block_grads_over(z, du, u, targets, active, shift_ids, shift, cols, stats, grads,
                      cfg: Lowered) -> None:
    # ``_block_grads`` with the gradient written over z itself (``inplace_grad``): each
    # element of the gradient reads z at its own position alone, so one loop may read an
    # element and write its gradient there
    _block_grads(z, du, z, u, targets, active, shift_ids, shift, cols, stats, grads, cfg)


class _Compiled:
    """The compiled ``_block_state`` (made at its first use) and what its compiles did."""

    lock = threading.Lock()
    fn: Optional[Callable[..., stats_math.State]] = None
    grads: Optional[Callable[..., None]] = None
    grads_over: Optional[Callable[..., None]] = None  # the gradient over the logits
    failed = False  # no compile has worked and one failed: no compiler on this machine
    worked = False
    warned = False


def _compiled() -> Optional[Callable[..., stats_math.State]]:
    with _Compiled.lock:
        if _Compiled.fn is None and not _Compiled.failed:
            compile_ = lambda f: torch.compile(f, dynamic=True, fullgraph=True,  # noqa: E731
                                               options=_OPTIONS)
            _Compiled.fn, _Compiled.grads = compile_(_tile_state), compile_(_block_grads)
            _Compiled.grads_over = compile_(_block_grads_over)
            logger.warning(
                "dlm_kernels: compiling the chunked backend's CPU loops with Inductor for this "
                "first call of %d or more columns (several seconds, once per process and "
                "configuration; later processes reuse Inductor's cache on disk but trace "
                "again)", COMPILE_MIN_VOCAB)
        return None if _Compiled.failed else _Compiled.fn


def _fell_back(err: Exception) -> None:
    """A compile failed: before any worked, the compiled forward is off for the process (no
    C++ compiler, say); after, only this configuration runs eagerly (Dynamo's recompile
    limit, say). Said once."""
    _Compiled.failed = not _Compiled.worked
    if not _Compiled.warned:
        _Compiled.warned = True
        warnings.warn(f"dlm_kernels: the compiled CPU forward failed ({type(err).__name__}: {err}); "
                      "the eager tiles run instead", RuntimeWarning, stacklevel=3)


def use_compiled(k: int) -> bool:
    """Whether a CPU call of [N, K] logits (outside tracing) takes the compiled loops: by K
    alone."""
    return k >= max(COMPILE_MIN_VOCAB, MIN_SIDE) and not _Compiled.failed


def _two_rows(rows: Rows) -> Rows:
    """A lone row as two copies of it (no size that Dynamo specialises)."""
    return type(rows)(*(None if f is None else torch.cat([f, f]) for f in rows))


def _spans(n: int, size: int) -> list[tuple[int, int]]:
    """[(i0, i1)] cutting range(n) into spans of ``size``; a remainder of fewer than
    MIN_SIDE joins the span before it (no size that Dynamo specialises)."""
    starts = list(range(0, n, max(MIN_SIDE, size)))
    if len(starts) > 1 and n - starts[-1] < MIN_SIDE:
        starts.pop()
    return [(i0, starts[i + 1] if i + 1 < len(starts) else n) for i, i0 in enumerate(starts)]


def _ids32(ids, offset: int, k: int):
    """[R] int32 column ids, those outside [offset, offset + K) clamped just outside it (so
    none wraps onto a column): compiled, an int64 compare against the column ids left the
    forward's loops scalar (SFT forward at K 131072 2.8x the time of CE's)."""
    return None if ids is None else ids.clamp(offset - 1, offset + k).to(torch.int32)


def row_blocks(n: int, k: int) -> list[tuple[int, int]]:
    """[(r0, r1)]: blocks of BLOCK_BYTES of float32 rows of K columns."""
    return _spans(n, BLOCK_BYTES // (4 * k))


def compiled_partial(rows: Rows, cfg: Lowered, offset: int = 0) -> Optional[stats_math.State]:
    """The merged State of ``rows`` (CPU tensors, [N, K] logits, columns [offset, offset + K))
    from compiled tiles of SUM_COLUMNS columns, merged as the chunk loop merges its chunks
    (``stats_math.merge``); None when the compile is unavailable.

    Why tiles, not whole rows: a compiled row sum adds its terms lane by lane (16 lanes,
    Inductor's cascade sums need a static size), where ATen sums in a tree. Over a whole row
    of 131072 near-equal terms (a flat distribution, T = 100) the float32 lane sums were
    off by 6e-4 relative (tests/test_domain.py: the teacher's KL); a tile keeps each lane to
    256 terms (near-equal terms simulated in NumPy: 2e-7 relative off, where whole rows were
    4e-5; bench/NOTES.md).

    The LOO shift moves one column of each row. Every tile runs without it, and each row's
    state over the one tile that holds its shifted column is computed again with the shift,
    on those rows gathered (``_shifted_rows``): the compare and select of the shift over
    every column doubled a float32 tile's time (16.5 against 7.2 ms for [4096, 4096]),
    where the gathered rows are 1/32 of the tiles at K 131072 with random shifted ids.

    The tiles always take the entropy's Σ e^x·x, dropped at the end when it was not asked
    for: Inductor fuses a tile's sums into one loop nest and orders Σ e^x by what else that
    loop computes (bfloat16 rows gave another Σ e^x with the entropy than without), and a
    row's logp must not depend on whether its entropy was asked for (``per_token_logps``
    with and without ``return_entropy``). One graph per configuration either way."""
    fn = _compiled()
    if fn is None:
        return None
    if rows.logits.shape[0] == 1:
        state = compiled_partial(_two_rows(rows), cfg, offset)
        return None if state is None else stats_math.State(*(f[:1] for f in state))
    z, u = rows.logits, rows.teacher
    n, k = z.shape
    asked, cfg = cfg, cfg._replace(HAS_ENTROPY=True)  # the one loop nest (docstring)
    cols = torch.arange(offset, offset + k, dtype=torch.int32)  # [K] global column ids
    shift_ids = _ids32(rows.shift_ids, offset, k)
    col_spans = _spans(k, SUM_COLUMNS)
    width = max(c1 - c0 for c0, c1 in col_spans)
    blocks = []
    for r0, r1 in _spans(n, BLOCK_BYTES // (4 * width)):
        sl = slice(r0, r1)
        zb, ub = z[sl], None if u is None else u[sl]
        shifted = None if shift_ids is None else _shifted_rows(shift_ids[sl] - offset, col_spans)
        state = None
        for t, (c0, c1) in enumerate(col_spans):
            cs = slice(c0, c1)
            try:
                part = fn(zb[:, cs], None if ub is None else ub[:, cs], None, None, cols[cs], cfg)
                hit = None if shifted is None else shifted[t]
                if hit is not None:  # the rows whose shifted column is in this tile, again
                    take = lambda v: None if v is None else v[:, cs].index_select(0, hit)  # noqa: E731
                    again = fn(take(zb), take(ub), shift_ids[sl].index_select(0, hit),
                               rows.shift[sl].index_select(0, hit), cols[cs], cfg)
                    part = stats_math.State(*(f.index_put((hit,), g) for f, g in zip(part, again)))
            except Exception as err:  # noqa: BLE001 - no compiler here, or Dynamo's recompile limit
                _fell_back(err)  # at any tile: the eager tiles start again from the first
                return None
            _Compiled.worked = True
            state = part if state is None else stats_math.merge(xp, state, part, cfg)
        blocks.append(state)
    state = stats_math.State(*(torch.cat(f) if len(blocks) > 1 else f[0] for f in zip(*blocks)))
    return state if asked.HAS_ENTROPY else state._replace(b=torch.zeros_like(state.b))


def _shifted_rows(local_ids, col_spans) -> list:
    """For each column span: the [H] int64 rows of a block whose shifted column (local id,
    outside [0, K) for none) lies in it, at least MIN_SIDE of them (a lone row repeated: no
    size that Dynamo specialises), or None for no row."""
    starts = torch.tensor([c0 for c0, _ in col_spans] + [col_spans[-1][1]], dtype=torch.int32)
    tile = torch.bucketize(local_ids, starts, right=True) - 1  # [R] span of each row, or -1, T
    order = torch.argsort(tile, stable=True)
    counts = torch.bincount(tile.clamp(-1, len(col_spans)) + 1, minlength=len(col_spans) + 2)
    ends = counts.cumsum(0).tolist()
    out = []
    for t in range(len(col_spans)):
        hit = order[ends[t]:ends[t + 1]]
        out.append(None if len(hit) == 0 else hit.repeat(MIN_SIDE) if len(hit) < MIN_SIDE else hit)
    return out


def compiled_grads(dz, du, rows: Rows, stats, grads, cfg: Lowered, offset: int = 0) -> int:
    """Writes d(logits) (and d(teacher)) of ``rows`` into dz, du [N, K] (CPU; dz may be the
    logits themselves, ``inplace_grad``) with the compiled block loop: one pass that reads
    the logits (and the teacher) and writes the gradient (over the logits: a graph of its
    own, the same formulas, bitwise the same in the tests). Returns the rows written from
    row 0: N, or 0 when the compile is unavailable or fails (the eager tiles then write
    every row again), or, written over the logits, the first row of the block whose compile
    failed (the rows before it hold their gradient already; those from it on still hold
    logits, for the eager tiles)."""
    if _compiled() is None or _Compiled.grads is None or _Compiled.grads_over is None:
        return 0
    # torch rounds no product on its own (TorchOps.rounded is x): one graph for a head's rows
    # and an array's, not a second one by Dynamo's guard on the flag
    cfg = cfg._replace(ROUND_TILES=False)
    if rows.logits.shape[0] == 1:  # two copies of the row, the first one kept
        dz2 = torch.empty((2, *dz.shape[1:]), dtype=dz.dtype)
        du2 = None if du is None else torch.empty((2, *du.shape[1:]), dtype=du.dtype)
        two = lambda v: torch.cat([v, v])  # noqa: E731
        if compiled_grads(dz2, du2, _two_rows(rows), type(stats)(*(two(f) for f in stats)),
                          tuple(two(g) for g in grads), cfg, offset) < 2:
            return 0
        dz.copy_(dz2[:1])
        if du is not None:
            du.copy_(du2[:1])
        return 1
    z, u = rows.logits, rows.teacher
    n, k = z.shape
    cols = torch.arange(offset, offset + k, dtype=torch.int32)  # [K] global column ids
    ids = rows._replace(targets=_ids32(rows.targets, offset, k),
                        shift_ids=_ids32(rows.shift_ids, offset, k))
    for r0, r1 in row_blocks(n, k):
        sl = slice(r0, r1)
        part = lambda v: None if v is None else v[sl]  # noqa: E731
        block = (*(part(f) for f in ids[2:]), cols, type(stats)(*(f[sl] for f in stats)),
                 tuple(g[sl] for g in grads), cfg)
        try:
            if dz is z:  # one tensor passed once: the loop reads and writes it
                _Compiled.grads_over(z[sl], part(du), part(u), *block)
            else:
                _Compiled.grads(dz[sl], part(du), z[sl], part(u), *block)
        except Exception as err:  # noqa: BLE001 - as in compiled_partial
            _fell_back(err)  # a failed block writes nothing
            return r0 if dz is z else 0
    return n
