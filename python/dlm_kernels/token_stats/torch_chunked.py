"""The chunked backend: torch ops over vocabulary chunks, O(N) float32 residuals.

Forward keeps the streaming state of docs/design.md §2 per row and merges chunk partials; backward
recomputes p (and q) chunk by chunk and writes d(logits) slice by slice. Live float32
temporaries are a few [R, C] buffers (C from ``chunk_size_for``, a function of K alone; R
rows of a block, ``rows_per_block``), never [N, K]. Which path computes a call (the compiled
loops, the row-block tiles or the plain chunk loop) depends on the device, the vocabulary
size and the features asked for, never on the number of rows, so a row's results are the
same bits in any batch (docs/design.md §2, "One row, one answer"). With a
column ``offset`` the logits are one vocabulary shard (columns [offset, offset + K)); the
vocabulary-parallel path merges the partial states across shards.
"""

from __future__ import annotations

import torch

from . import formulas as stats_math
from ..kernels.series import PSI_COEFFS, PSI_SMALL
from .._config import CHUNK_BYTES_CPU, chunk_size_for, rows_per_block
from .._dispatch import BackendBase, NATIVE_DTYPES, Capabilities
from .._torch.buffers import empty
from .._torch.ops import TorchOps as xp
from .torch_compiled import compiled_grads, compiled_partial, use_compiled
from .torch_row_blocks import TILE_BYTES, run_blocks, scratch, use_row_blocks


def _chunks(k, cfg, device):
    """[(c0, c1)] vocabulary chunks of a row of K columns: their width depends on K (and the
    user's chunk size) alone."""
    c = chunk_size_for(k, cfg, on_cpu=device.type == "cpu")
    return [(c0, min(c0 + c, k)) for c0 in range(0, k, c)]


def forward_chunks(z, cfg):
    """The vocabulary chunks [(c0, c1)] in which ``forward_partial`` streams the rows of the
    logits z [N, K] in the plain chunk loop (on an accelerator, or under tracing), or None where it
    streams row blocks or compiled tiles instead (CPU tensors outside tracing). The chunked
    sampler streams these chunks too, so its statistics are the forward's."""
    return None if use_row_blocks(z) else _chunks(z.shape[1], cfg, z.device)


def _blocks(n, chunks, device, cpu_bytes=CHUNK_BYTES_CPU):
    """[(r0, r1)] row blocks whose [R, C] float32 chunk fits the device's budget."""
    r = rows_per_block(n, max(c1 - c0 for c0, c1 in chunks), device.type == "cpu", cpu_bytes)
    return [(r0, min(r0 + r, n)) for r0 in range(0, n, r)]


class ChunkedTorch(BackendBase):
    name = "chunked"
    custom_vjp = True
    capabilities = Capabilities(dtypes=NATIVE_DTYPES, vocab_shards=True, inplace_grad=True)

    @staticmethod
    def unsupported_reason(platform):
        return None

    @staticmethod
    @torch.no_grad()
    def forward_partial(rows, cfg, offset=0):
        # rows.logits, rows.teacher: [N, K] (one shard) -> (State, r_y, found) of [N] f32
        z = rows.logits
        n, k = z.shape
        state = None
        if use_row_blocks(z) and use_compiled(k):  # one compiled loop nest per row
            state = compiled_partial(rows, cfg, offset)
        if state is None and use_row_blocks(z) and n > 0:  # tiles on single-threaded workers
            parts = run_blocks(lambda r0, r1: _block_partial(_row_slice(rows, r0, r1), cfg,
                                                             offset), n, k)
            state = (parts[0] if len(parts) == 1 else
                     stats_math.State(*(torch.cat(f) for f in zip(*parts))))
        if state is None:
            state = _partial(rows, cfg, offset)
        return (state, *stats_math.target_logit(xp, rows, cfg, offset))

    @classmethod
    def forward(cls, rows, cfg):
        state, r_y, found = cls.forward_partial(rows, cfg)
        return stats_math.finalize(xp, state, r_y, found, rows.active, cfg)

    @staticmethod
    @torch.no_grad()
    def backward(rows, stats, grads, cfg, inplace=False, offset=0):
        # -> dz [N, K] in z's dtype (z itself when ``inplace``), du [N, K] or None
        z, u = rows.logits, rows.teacher
        n, k = z.shape
        dz = z if inplace else empty(z.shape, z.dtype, z.device)
        du = empty(u.shape, u.dtype, u.device) if cfg.TEACHER_GRAD else None
        if not use_row_blocks(z):
            _grads_into(dz, du, rows, stats, grads, cfg, offset)
            return dz, du
        done = compiled_grads(dz, du, rows, stats, grads, cfg, offset) if use_compiled(k) else 0
        if done == n:
            return dz, du
        if done == 0:
            _eager_grads_into(dz, du, rows, stats, grads, cfg, offset)
            return dz, du
        # written over the logits up to a block whose compile failed: the rest, still logits
        sl = slice(done, n)
        _eager_grads_into(dz[sl], None if du is None else du[sl],
                          *_rows_part(rows, stats, grads, done, n), cfg, offset)
        return dz, du


def _eager_grads_into(dz, du, rows, stats, grads, cfg, offset):
    """The row-block tiles' backward: d(logits) of ``rows`` into dz (and du) [N, K], the
    blocks shared out over the workers."""
    n, k = rows.logits.shape

    def block(r0, r1):
        sl = slice(r0, r1)
        part = _rows_part(rows, stats, grads, r0, r1)
        if _fast_grads(cfg):
            _tile_grads_into(dz[sl], *part, cfg, offset)
        else:
            _grads_into(dz[sl], None if du is None else du[sl], *part, cfg, offset, TILE_BYTES)

    run_blocks(block, n, k)


def _rows_part(rows, stats, grads, r0, r1):
    """(rows, stats, grads) of the rows [r0, r1): the arguments themselves when that is all
    of their rows."""
    if (r0, r1) == (0, rows.logits.shape[0]):
        return rows, stats, grads
    sl = slice(r0, r1)
    return (_row_slice(rows, r0, r1), stats_math.Stats(*(s[sl] for s in stats)),
            tuple(g[sl] for g in grads))


def _row_slice(rows, r0, r1):
    """The bundle's rows [r0, r1) (every field is per row, or None); the bundle itself when
    that is all of its rows (no views to make: a small call's host time)."""
    if r0 == 0 and r1 == rows.logits.shape[0]:
        return rows
    return type(rows)(*(None if f is None else f[r0:r1] for f in rows))


def _partial(rows, cfg, offset, cpu_bytes=CHUNK_BYTES_CPU):
    """The merged partial State of rows over all their chunks (the plain chunk loop), in row
    blocks whose chunks fit ``cpu_bytes`` on a CPU."""
    z = rows.logits
    n, k = z.shape
    chunks = _chunks(k, cfg, z.device)
    blocks = [_chunk_loop(_row_slice(rows, r0, r1), chunks, cfg, offset)
              for r0, r1 in _blocks(n, chunks, z.device, cpu_bytes) or [(0, n)]]
    if len(blocks) == 1:
        return blocks[0]
    return stats_math.State(*(torch.cat(f) for f in zip(*blocks)))


def _chunk_loop(rows, chunks, cfg, offset):
    # rows: [R, K] -> the State of each row, its chunks merged left to right
    z, u = rows.logits, rows.teacher
    state = None
    for c0, c1 in chunks:
        cols = torch.arange(offset + c0, offset + c1, device=z.device)  # [C] global ids
        chunk = rows.columns(z[:, c0:c1], None if u is None else u[:, c0:c1])
        part = stats_math.chunk_partial(xp, chunk, cols, stats_math.column_mask(xp, cols, cfg), cfg)
        state = part if state is None else stats_math.merge(xp, state, part, cfg)
    return state


def _block_partial(rows, cfg, offset):
    """The State of one row block: ``_tile_partial`` where it applies, else the chunk loop
    in cache-sized tiles."""
    state = _tile_partial(rows, cfg, offset) if _fast_partial(cfg) else None
    return _partial(rows, cfg, offset, TILE_BYTES) if state is None else state


def _fast_partial(cfg) -> bool:
    """Whether ``_tile_partial`` covers cfg: CE, the SFT loss and distillation (shift,
    temperatures, a stop-gradient teacher), with or without the entropy. Whether the entropy
    is asked for never changes the path: the two paths sum a row's Σ e^x in other orders, and
    a row's logp must not depend on it (``per_token_logps`` with and without
    ``return_entropy``). Nor does a softcap: the tiles cap their rows first
    (``_minus_row_max``), so the statistics of logits z with ``softcap`` c are those of the
    capped logits cap(z) without one, bit for bit (a capped LinearHead's ``per_token_logps``
    and the denoising step, which draws from its capped chunks, docs/design.md §3)."""
    return not cfg.TEACHER_GRAD and not cfg.SMOOTH and not cfg.PADDED


def _tile_partial(rows, cfg, offset):
    """The State of ``_partial`` in tiles of whole rows (``_minus_row_max``: the row max m of
    r, the shift included whatever its sign, and r - m in a float32 tile), then, while the
    tile is in cache, Σ e^x (and Σ e^{x'}, and the entropy's Σ e^x·x): no per-chunk maxima to
    merge. A row's sums run over its whole K in one reduction, whose order depends on K
    alone; Σ e^x is the same reduction of the same e^x with or without the entropy. With a
    teacher, its tile is made the same way and its sums (``stats_math.teacher_sums``, the
    same formulas) are taken relative to its row max mu in preallocated tiles."""
    z, u = rows.logits, rows.teacher
    n, k = z.shape
    row = lambda: torch.empty(n, dtype=torch.float32)  # noqa: E731  [N]
    m, a = row(), row()
    a2 = row() if cfg.SEPARATE_CE else a
    zero = torch.zeros(n, dtype=torch.float32)
    b = row() if cfg.HAS_ENTROPY else zero
    mu, au, cu, fu = m, zero, zero, zero
    height = min(n, max(1, TILE_BYTES // (4 * k)))  # rows per tile: whole rows, <= 1 MiB
    tiles = scratch(8 if cfg.HAS_TEACHER else 4 if cfg.HAS_ENTROPY else 2, height, k)
    t_b, t2_b = tiles[0], tiles[1]  # x, x' ([R, K] each, reused)
    zero_t = torch.zeros(())
    if cfg.HAS_TEACHER:
        mu, au, cu, fu = row(), row(), row(), row()
        e_b, y_b, eu_b, ct_b, s_b, f_b = tiles[2:]
    elif cfg.HAS_ENTROPY:
        e_b, f_b = tiles[2:]
    for r0 in range(0, n, height):
        r1 = min(r0 + height, n)
        rs = slice(r0, r1)
        t = _minus_row_max(z[rs], t_b[:r1 - r0], m[rs], rows, rs, cfg, offset)  # r - m
        if cfg.SEPARATE_CE:
            torch.sum(torch.mul(t, cfg.inv_t_ce, out=t2_b[:r1 - r0]).exp_(), dim=1, out=a2[rs])
        if cfg.inv_t != 1.0:
            t.mul_(cfg.inv_t)
        h = r1 - r0
        if not cfg.HAS_TEACHER and not cfg.HAS_ENTROPY:
            torch.sum(t.exp_(), dim=1, out=a[rs])
            continue
        e, f = e_b[:h], f_b[:h]
        torch.sum(torch.exp(t, out=e), dim=1, out=a[rs])  # e = e^x, t keeps x
        if cfg.HAS_ENTROPY:  # Σ e^x·x (a term with e^x = 0 adds nothing: chunk_partial's)
            torch.where(e > 0, torch.mul(e, t, out=f), zero_t, out=f)
            torch.sum(f, dim=1, out=b[rs])
        if not cfg.HAS_TEACHER:
            continue
        y, eu, ct, sr = (v[:h] for v in (y_b, eu_b, ct_b, s_b))
        _minus_row_max(u[rs], y, mu[rs])
        if cfg.inv_t_kl != 1.0:
            y.mul_(cfg.inv_t_kl)  # x_u
        torch.sum(torch.exp(y, out=eu), dim=1, out=au[rs])
        y.sub_(t)  # y = x_u - x
        torch.mul(eu, y, out=ct)
        torch.where(eu > 0, ct, zero_t, out=ct)  # (y may be ±inf or NaN where q = 0)
        torch.sum(ct, dim=1, out=cu[rs])
        torch.mul(y, PSI_COEFFS[-1], out=sr).add_(PSI_COEFFS[-2])  # S(y) by Horner's rule
        for coef in reversed(PSI_COEFFS[:-2]):
            sr.mul_(y).add_(coef)
        sr.mul_(y).mul_(ct)  # ct·y·S(y)
        torch.sub(e, eu, out=f).add_(ct)  # ct + (w - eu)
        torch.where(y.abs() < PSI_SMALL, sr, f, out=f)
        torch.sum(f, dim=1, out=fu[rs])
    return stats_math.State(m, a, b, a2, mu, au, cu, fu, zero)


def _minus_row_max(x, out, m, rows=None, rs=None, cfg=None, offset=0):
    """out [R, K] float32 = r - m for the rows x [R, K] (r = x, capped with ``cfg``'s softcap
    and plus the shift at its column when ``cfg`` has them), writing each row's max of r into
    m [R] (-inf rows shifted by 0).
    Float32 rows without a shift or cap: the max read from x, then one subtraction into out; else
    x is first copied into out (a vectorised conversion; a subtraction that converts as it
    reads costs about three times as much) and the rest is done there, in cache."""
    cap = cfg is not None and cfg.HAS_SOFTCAP
    if x.dtype == torch.float32 and (cfg is None or not cfg.HAS_SHIFT) and not cap:
        torch.amax(x, dim=1, out=m)
        return torch.sub(x, stats_math._safe(xp, m)[:, None], out=out)
    out.copy_(x)
    if cap:  # r = cap(z) in float32, as ``formulas.chunk_logits`` forms it
        out.copy_(stats_math.softcap(xp, out, cfg.softcap))
    if cfg is not None and cfg.HAS_SHIFT:
        stats_math._add_at(xp, out, rows.shift_ids[rs], offset, rows.shift[rs])
    torch.amax(out, dim=1, out=m)
    return out.sub_(stats_math._safe(xp, m)[:, None])


def _grads_into(dz, du, rows, stats, grads, cfg, offset, cpu_bytes=CHUNK_BYTES_CPU):
    """Writes d(logits) (and d(teacher)) of rows into dz, du [N, K], chunk by chunk
    (``stats_math.chunk_grads``: the general path, every feature)."""
    z, u = rows.logits, rows.teacher
    n, k = z.shape
    chunks = _chunks(k, cfg, z.device)
    for r0, r1 in _blocks(n, chunks, z.device, cpu_bytes):
        rs = slice(r0, r1)
        block = _row_slice(rows, r0, r1)
        block_stats = type(stats)(*(s[rs] for s in stats))
        block_grads = tuple(g[rs] for g in grads)
        for c0, c1 in chunks:
            cols = torch.arange(offset + c0, offset + c1, device=z.device)
            chunk = block.columns(block.logits[:, c0:c1],
                                  None if u is None else block.teacher[:, c0:c1])
            gz, gu = stats_math.chunk_grads(xp, chunk, cols, block_stats, block_grads, cfg)
            dz[rs, c0:c1] = gz
            if du is not None:
                du[rs, c0:c1] = gu


def _fast_grads(cfg) -> bool:
    """Whether ``_tile_grads_into`` covers cfg: CE, the SFT loss and distillation (shift,
    temperatures, a stop-gradient teacher, label smoothing, z-loss, padding columns); the
    entropy, softcap and teacher gradient take the general path."""
    return not cfg.HAS_ENTROPY and not cfg.HAS_SOFTCAP and not cfg.TEACHER_GRAD


def _tile_grads_into(dz, rows, stats, grads, cfg, offset):
    """The gradient of ``stats_math.chunk_grads`` (without entropy, softcap or teacher
    gradient) written tile by tile in place: with p = e^x·e^{-la}, q = e^{x_u}·e^{-la_u} and
    p' = e^{x'}·e^{-la_ce} (x = (r - m)/T, x_u = (u - mu)/T_kl, x' = (r - m)/T_ce; no
    difference of scaled logits, as there),

        dr = e^x·A + e^{x_u}·B + e^{x'}·C + g_u + g_y·[k == y]

    with the per-row A = (g_lse/T - g_p [p' = p] + g_kl/T)·e^{-la}, B = -g_kl/T·e^{-la_u},
    C = -g_p·e^{-la_ce}: a subtract, an exponential and a multiply per logit for CE (each
    an in-place pass over one cached [R, C] tile), one more exponential and fused
    multiply-add per extra distribution. Inactive rows and padding columns get exact zeros.
    The shifted column's r is fl(z + d), then r - m, as the forward forms it (docs/design.md
    §2, "Gradients"); tests/token_stats/test_chunked.py holds these formulas to
    ``chunk_grads`` where that matters (``test_tile_gradient_is_the_shared_math``).
    dz: [R, K] rows of the output (a float32 view is written directly)."""
    z, u = rows.logits, rows.teacher
    n, k = z.shape
    g_lse, g_lp, g_h, g_kl = grads
    inv_t = cfg.inv_t
    g_y, g_u, g_p = stats_math.ce_coefficients(xp, g_lp, stats, cfg)  # [N] each
    live = rows.active
    all_live = bool(live.all())  # a CPU tensor: no device sync
    zero = torch.zeros((), dtype=torch.float32)
    live_of = lambda v: torch.where(live, v, zero)[:, None]  # noqa: E731  [N, 1]
    coef = g_lse * inv_t
    if not cfg.SEPARATE_CE:
        coef = coef - g_p
    if cfg.HAS_TEACHER:
        coef = coef + g_kl * inv_t
        b = live_of(-(g_kl * inv_t) * torch.exp(-stats.la_u))
        mu = stats.mu[:, None]
    a = live_of(coef * torch.exp(-stats.la))
    c = live_of(-g_p * torch.exp(-stats.la_ce)) if cfg.SEPARATE_CE else None
    g_u = None if g_u is None else live_of(g_u)
    g_y = torch.where(live, g_y, zero)
    m = stats.m[:, None]
    direct = dz.dtype == torch.float32
    limit = max(0, min(k, cfg.vocab_limit - offset)) if cfg.PADDED else k
    chunks = _chunks(k, cfg, z.device)  # elementwise: any width gives the same bits
    # the float32 tiles, in the thread's reused buffer (``scratch``): r - m unless written
    # straight into float32 dz, e^{x'}, e^{x_u}
    width = chunks[0][1]
    t_b, e2_b, eu_b = scratch(3, n, width)  # [R, C] each
    for c0, c1 in chunks:
        out = dz[:, c0:c1]
        if c0 >= limit:  # padding columns only
            out.zero_()
            continue
        if direct and not cfg.HAS_SHIFT:
            t = torch.sub(z[:, c0:c1], m, out=out)  # r - m
        else:  # a vectorised copy converts, then r - m in float32 (3x a converting subtract)
            t = (out if direct else t_b[:, :c1 - c0]).copy_(z[:, c0:c1])
            if cfg.HAS_SHIFT:  # r = fl(z + d), then r - m: the forward's value (``chunk_logits``)
                stats_math._add_at(xp, t, rows.shift_ids, offset + c0, rows.shift)
            t.sub_(m)
        e2 = None
        if cfg.SEPARATE_CE:
            e2 = torch.mul(t, cfg.inv_t_ce, out=e2_b[:, :c1 - c0]).exp_()  # e^{x'}
        if cfg.inv_t != 1.0:
            t.mul_(inv_t)
        t.exp_()  # e^x
        t.mul_(a)
        if cfg.HAS_TEACHER:
            eu = eu_b[:, :c1 - c0].copy_(u[:, c0:c1]).sub_(mu)
            if cfg.inv_t_kl != 1.0:
                eu.mul_(cfg.inv_t_kl)
            t.addcmul_(eu.exp_(), b)
        if e2 is not None:
            t.addcmul_(e2, c)
        if g_u is not None:
            t.add_(g_u)
        stats_math._add_at(xp, t, rows.targets, offset + c0, g_y)
        if not all_live:  # e^x of a NaN or inf logit times 0 is NaN: exact zeros instead
            t.masked_fill_(~live[:, None], 0.0)
        if c1 > limit:
            t[:, limit - c0:] = 0.0
        if not direct:
            out.copy_(t)


IMPLEMENTATION = ChunkedTorch()
