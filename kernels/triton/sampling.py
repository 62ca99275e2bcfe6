"""Triton kernel of the denoising step's draw (``dlm_kernels.sampling.core``): one streaming read
of each row's logits, no host code.

  sample_partial_kernel  grid (N, S): row n, vocabulary split s. One pass over its columns in
                         BLOCK_K blocks, as R lanes of VEC contiguous columns (one 16-byte
                         load each), every lane keeping its own state; the lanes merge once
                         at the end and write the split's state to state[7, S, N] (float32)
                         and ids[2, S, N] (int32), with top_k also its k slots to
                         topv[S, N, k] / topi[S, N, k]. The host merges the S splits' draws
                         (``dlm_kernels.sampling.core.merge_splits``); the token statistics'
                         finalize kernel merges their statistics (state[:3], a partial
                         buffer: ``kernels.triton.token_stats.stats_finalize_kernel``) with
                         the drawn token as the target.

Bytes per row (K columns, E bytes per logit): reads K·E (guidance: 2·K·E) and writes
(7 + 2)·4·S (top_k: + 8·k·S). Nothing of size K is written.

Token parity with the other backends: the kernel computes the same float32 values the
framework code does for the decisions that pick a token, s = z / T (IEEE division,
``tl.div_rn``; Triton's ``/`` is an approximate one; with ``stats_temperature`` (TWO_T)
the statistics read z / T_s and the draw z / T, both so), guidance ``zu + c·(z - zu)`` (launched
without floating-point contraction, so this is a multiply and an add, not an FMA, as on the
host), the lowbias32 hash in uint32 and g = -log(-log(u)) with the precise float32 log
(``tl.log`` lowers to libdevice's logf). The statistics (log-sum-exp, entropy) are the token
statistics' running sums of the logits at T_s, folded and merged across lanes by that
kernel's own functions (``fold_sums``, ``merge_lanes``), so that the drawn token's logp and
the entropy are ``per_token_logps``'s bits (docs/design.md §3, "Rollout = trainer"): the
launch must then compile them as the statistics' kernels are compiled (floating-point
contraction on, as it is without guidance).

Two skips keep the arithmetic off the bytes' critical path without changing any result:
- The noise of a block is computed only when the block could hold the winning key: every g
  the noise can take is below G_BOUND (u <= 1 - 2^-24 gives g <= 16.64), so when
  fl(max s of the block + G_BOUND) < the best key so far, no column of the block can win
  (rounding is monotone). Peaked rows skip most blocks' two logs per logit.
- With top_k, a block updates the k slots only through the columns above the current worst
  slot, one at a time, best first: after the first blocks few columns qualify.
"""

import triton
import triton.language as tl

from ..layout import SAMPLE_IDS, SAMPLE_STATE
from .token_stats import _row_start, fold_sums, merge_lanes

NEG_INF = tl.constexpr(float("-inf"))
POS_INF = tl.constexpr(float("inf"))
LOG2E = tl.constexpr(1.4426950408889634)
G_BOUND = tl.constexpr(17.0)  # > the largest Gumbel noise, -log(-log(1 - 2^-24)) = 16.64
BIG_ID = tl.constexpr(2**31 - 1)
M1 = tl.constexpr(0x7FEB352D)  # lowbias32 multipliers (sampling.core.MIX_STEPS)
M2 = tl.constexpr(0x846CA68B)

F_M, F_A, F_B, F_V1, F_V2, F_GV, F_GZ = (tl.constexpr(SAMPLE_STATE.index(f))
                                        for f in ("m", "a", "b", "v1", "v2", "gv", "gz"))
I_I1, I_GI = (tl.constexpr(SAMPLE_IDS.index(f)) for f in ("i1", "gi"))


@triton.jit
def _mix(x):
    """lowbias32 of uint32 x (logical shifts, products modulo 2^32): sampling.core.mix."""
    x = x ^ (x >> 16)
    x = x * tl.full(x.shape, M1, tl.uint32)
    x = x ^ (x >> 15)
    x = x * tl.full(x.shape, M2, tl.uint32)
    return x ^ (x >> 16)


@triton.jit
def _gumbel(key, cols):
    """float32 Gumbel noise of global columns cols (int32) in the row keyed by key (uint32):
    sampling.core.gumbel, u = ((h >> 9) + 1/2)·2^-23."""
    h = _mix(key ^ _mix(cols.to(tl.uint32)))
    u = ((h >> 9).to(tl.float32) + 0.5) * 0.00000011920928955078125  # 2^-23
    return -tl.log(-tl.log(u))


@triton.jit
def _first_in_lane(x, lane_pos):
    """(max, first position) along the VEC axis of x [R, VEC] (in-thread), and x without that
    one element (for the runner-up)."""
    v = tl.max(x, axis=1)
    pos = tl.min(tl.where(x == v[:, None], lane_pos, BIG_ID), axis=1)
    rest = tl.where(lane_pos == pos[:, None], NEG_INF, x)
    return v, pos, rest


@triton.jit
def _worst_slot(tv, ti, slot):
    """The slot the next better column replaces: the smallest value, among equal ones the
    highest id (the lowest-ranked). Unused slots (beyond k) hold +inf and are never it."""
    wv = tl.min(tv, axis=0)
    wid = tl.max(tl.where(tv == wv, ti, -2), axis=0)
    ws = tl.min(tl.where((tv == wv) & (ti == wid), slot, BIG_ID), axis=0)
    return wv, ws


@triton.jit
def _fold_block(z_row, zu_row, sup_ptr, n_suppress, cols, k_valid, key, temperature,
                stat_temperature, cfg_c, c_t, lane_pos, v1, i1, v2, m, a, b, gv, gi, gz,
                g_best, tv, ti, slot, MASKED: tl.constexpr, GREEDY: tl.constexpr,
                TWO_T: tl.constexpr, HAS_UNCOND: tl.constexpr, HAS_SUPPRESS: tl.constexpr,
                TOP_K: tl.constexpr):
    """Fold the columns cols [R, VEC] of one row into the per-lane state [R] (and the top-k
    slots); returns the new state."""
    mask = cols < k_valid
    # read BLOCK_K·E bytes of logits (and BLOCK_K·E of unconditional logits)
    if MASKED:
        z = tl.load(z_row + cols, mask=mask, other=0.0).to(tl.float32)
    else:
        z = tl.load(z_row + cols).to(tl.float32)
    if HAS_UNCOND:
        if MASKED:
            zu = tl.load(zu_row + cols, mask=mask, other=0.0).to(tl.float32)
        else:
            zu = tl.load(zu_row + cols).to(tl.float32)
        z = zu + cfg_c * (z - zu)  # a multiply and an add (no contraction at launch)
    if HAS_SUPPRESS:
        for j in range(n_suppress):
            z = tl.where(cols == tl.load(sup_ptr + j), NEG_INF, z)
    if MASKED:
        z = tl.where(mask, z, NEG_INF)
    s = z  # the statistics' scale z / T_s
    sd = z  # the draw's scores z / T
    if not GREEDY:
        if TWO_T:
            s = tl.div_rn(z, stat_temperature)
            sd = tl.div_rn(z, temperature)
        else:
            s = tl.div_rn(z, temperature)
            sd = s

    # the lane's largest s (ties: the lowest id) and runner-up; the statistics' running
    # sums of the logits, as the token statistics' kernel folds them
    lane_first = tl.min(cols, axis=1)  # [R] the id of each lane's first column
    bv, bpos, rest = _first_in_lane(s, lane_pos)
    b2 = tl.max(rest, axis=1)
    take = bv > v1  # a tie keeps the earlier (lower) id
    v2 = tl.maximum(tl.where(take, v1, v2), tl.where(take, b2, bv))
    i1 = tl.where(take, lane_first + bpos, i1)
    v1 = tl.maximum(v1, bv)
    m, a, b, _, _, _, _, _, _ = fold_sums(z, m, a, b, c_t, True)

    if not GREEDY and TOP_K == 0:
        # the Gumbel key s + g, only where the block could beat the best key so far
        bd = tl.max(bv, axis=0)
        if TWO_T:
            bd = tl.max(tl.max(sd, axis=1), axis=0)
        if bd + G_BOUND >= g_best:
            kv, kpos, _others = _first_in_lane(sd + _gumbel(key, cols), lane_pos)
            kz = tl.sum(tl.where(lane_pos == kpos[:, None], z, 0.0), axis=1)  # its logit
            tk = kv > gv
            gv = tl.where(tk, kv, gv)
            gi = tl.where(tk, lane_first + kpos, gi)
            gz = tl.where(tk, kz, gz)
            g_best = tl.maximum(g_best, tl.max(kv, axis=0))

    if TOP_K > 0:
        # columns better than the worst slot enter one at a time, best (lowest id) first
        wv, ws = _worst_slot(tv, ti, slot)
        cand = sd  # the slots hold the draw's scores
        cv = tl.max(tl.max(cand, axis=1), axis=0)
        while cv > wv:
            cc = tl.min(tl.min(tl.where(cand == cv, cols, BIG_ID), axis=1), axis=0)
            tv = tl.where(slot == ws, cv, tv)
            ti = tl.where(slot == ws, cc, ti)
            cand = tl.where(cols == cc, NEG_INF, cand)
            cv = tl.max(tl.max(cand, axis=1), axis=0)
            wv, ws = _worst_slot(tv, ti, slot)
    return v1, i1, v2, m, a, b, gv, gi, gz, g_best, tv, ti


@triton.jit
def sample_partial_kernel(
    z_ptr,  # [N, K] logits (conditional ones with guidance), row stride stride_z
    zu_ptr,  # [N, K] unconditional logits, row stride stride_zu (HAS_UNCOND)
    keys_ptr,  # [N] int32: the row keys of the noise (their 32-bit patterns)
    sup_ptr,  # [n_suppress] int: ids never drawn (HAS_SUPPRESS)
    N, K, n_suppress, stride_z, stride_zu, cols_per_split,
    temperature,  # T > 0 (unused when GREEDY)
    stat_temperature,  # T_s of the statistics (TWO_T only)
    cfg_c,  # guidance's s + 1 (HAS_UNCOND)
    inv_t,  # 1/T_s of the statistics' sums (the token statistics' inv_t)
    state_ptr,  # [7, S, N] f32 out: SAMPLE_STATE
    ids_ptr,  # [2, S, N] i32 out: SAMPLE_IDS
    topv_ptr, topi_ptr,  # [S, N, TOP_K] f32 / i32 out: the split's k slots (TOP_K > 0)
    GREEDY: tl.constexpr, TWO_T: tl.constexpr, HAS_UNCOND: tl.constexpr,
    HAS_SUPPRESS: tl.constexpr, TOP_K: tl.constexpr, TOP_KP: tl.constexpr,
    BLOCK_K: tl.constexpr, VEC: tl.constexpr, ROWS_ALIGNED: tl.constexpr,
):
    row = tl.program_id(0)
    split = tl.program_id(1)
    n_splits = tl.num_programs(1)
    temperature, cfg_c = tl.cast(temperature, tl.float32), tl.cast(cfg_c, tl.float32)
    stat_temperature = tl.cast(stat_temperature, tl.float32)
    c_t = tl.cast(inv_t, tl.float32) * LOG2E  # as the token statistics' kernel forms it
    k_start = tl.multiple_of(split * cols_per_split, BLOCK_K)
    k_end = tl.minimum(k_start + cols_per_split, K)
    k_full = k_start + (k_end - k_start) // BLOCK_K * BLOCK_K
    z_row = z_ptr + _row_start(row, stride_z, ROWS_ALIGNED)
    zu_row = zu_ptr + _row_start(row, stride_zu, ROWS_ALIGNED)
    key = tl.load(keys_ptr + row).to(tl.uint32, bitcast=True)

    R: tl.constexpr = BLOCK_K // VEC
    lane_pos = tl.arange(0, VEC)[None, :]
    offs = tl.arange(0, R)[:, None] * VEC + lane_pos  # [R, VEC]
    v1 = tl.full([R], NEG_INF, tl.float32)  # the lane's largest s
    i1 = tl.zeros([R], tl.int32)  # its id
    v2 = tl.full([R], NEG_INF, tl.float32)  # the runner-up (a tie with v1 counts)
    m = tl.full([R], NEG_INF, tl.float32)  # the lane's largest logit
    a = tl.zeros([R], tl.float32)  # Σ 2^x, x = (z - m)·c_t (``fold_sums``)
    b = tl.zeros([R], tl.float32)  # Σ 2^x·x
    gv = tl.full([R], NEG_INF, tl.float32)  # the largest key s + g
    gi = tl.zeros([R], tl.int32)  # its id
    gz = tl.zeros([R], tl.float32)  # the logit at it
    g_best = tl.full([], NEG_INF, tl.float32)  # the best key of the program
    slot = tl.arange(0, TOP_KP)
    tv = tl.where(slot < TOP_K, NEG_INF, POS_INF)  # the top-k slots (TOP_K > 0)
    ti = tl.full([TOP_KP], -1, tl.int32)
    for k0 in range(k_start, k_full, BLOCK_K):  # whole blocks: no masks
        v1, i1, v2, m, a, b, gv, gi, gz, g_best, tv, ti = _fold_block(
            z_row, zu_row, sup_ptr, n_suppress, k0 + offs, k_end, key, temperature,
            stat_temperature, cfg_c, c_t, lane_pos, v1, i1, v2, m, a, b, gv, gi, gz, g_best,
            tv, ti, slot, False, GREEDY, TWO_T, HAS_UNCOND, HAS_SUPPRESS, TOP_K)
    for k0 in range(k_full, k_end, BLOCK_K):  # the ragged tail: at most one block
        v1, i1, v2, m, a, b, gv, gi, gz, g_best, tv, ti = _fold_block(
            z_row, zu_row, sup_ptr, n_suppress, k0 + offs, k_end, key, temperature,
            stat_temperature, cfg_c, c_t, lane_pos, v1, i1, v2, m, a, b, gv, gi, gz, g_best,
            tv, ti, slot, True, GREEDY, TWO_T, HAS_UNCOND, HAS_SUPPRESS, TOP_K)

    # merge the lanes (lane r holds lower ids than lane r + 1 within a block, but not across
    # blocks: ties go to the lowest id explicitly)
    v1_row = tl.max(v1, axis=0)
    i1_row = tl.min(tl.where(v1 == v1_row, i1, BIG_ID), axis=0)
    lead = tl.min(tl.where((v1 == v1_row) & (i1 == i1_row), tl.arange(0, R), R), axis=0)
    v2_row = tl.maximum(tl.max(v2, axis=0),
                        tl.max(tl.where(tl.arange(0, R) == lead, NEG_INF, v1), axis=0))
    m_row, a_row, b_row, _, _, _ = merge_lanes(m, a, b, c_t, True)  # b natural
    gv_row = tl.max(gv, axis=0)
    gi_row = tl.min(tl.where(gv == gv_row, gi, BIG_ID), axis=0)
    gz_row = tl.max(tl.where((gv == gv_row) & (gi == gi_row), gz, NEG_INF), axis=0)
    gi_row = tl.where(gv_row == NEG_INF, 0, gi_row)  # no key at all (greedy, top-k, empty)

    # write (7 + 2) x 4 bytes of state
    base = split * N + row
    stride = n_splits * N
    tl.store(state_ptr + F_M * stride + base, m_row)
    tl.store(state_ptr + F_A * stride + base, a_row)
    tl.store(state_ptr + F_B * stride + base, b_row)
    tl.store(state_ptr + F_V1 * stride + base, v1_row)
    tl.store(state_ptr + F_V2 * stride + base, v2_row)
    tl.store(state_ptr + F_GV * stride + base, gv_row)
    tl.store(state_ptr + F_GZ * stride + base, gz_row)
    tl.store(ids_ptr + I_I1 * stride + base, i1_row)
    tl.store(ids_ptr + I_GI * stride + base, gi_row)
    if TOP_K > 0:  # write 8 x k bytes of slots
        out = base.to(tl.int64) * TOP_K + slot
        tl.store(topv_ptr + out, tv, mask=slot < TOP_K)
        tl.store(topi_ptr + out, ti, mask=slot < TOP_K)


def slot_count(top_k):
    """TOP_KP: the power of two >= k holding the k slots (1 without top_k)."""
    return 1 << max(0, int(top_k) - 1).bit_length()
