"""Pallas (Mosaic TPU) kernel of the denoising step's draw (``dlm_kernels.sampling.core``): one
streaming read of each row's logits.

Grid (cdiv(N, BN), cdiv(K, BK)) with dimension semantics ("parallel", "arbitrary"), blocks
as in ``token_stats`` (``block_sizes``): row blocks are independent, the vocabulary axis is
the sequential inner one, so each row's state lives in VMEM scratch across it, starts at
k == 0 and is written at k == last: floats [N, 10] (``SAMPLE_STATE``, then
``SAMPLE_ROW_STATS``), ints [N, 2] (``SAMPLE_IDS``) and, with top_k, the k slots [N, k] of
values and ids (unsorted). The host sorts the slots and finalises (``merge_splits`` with one
split, then ``finalize``).

The statistics are the token statistics' forward's own: its running sums of the logits at
T_s (``token_stats.fold_sums``) and, at the last block, its finish (``row_entropy``,
``row_logp``) with the drawn token's logit as the target's, so the drawn token's logp and the
entropy are ``per_token_logps``'s bits (docs/design.md §3, "Rollout = trainer").

Per-row inputs travel packed in one int32 block [N, 1 + S]: the row's noise key (its 32-bit
pattern), then the S suppressed ids (the same in every row).

Bytes per row (K columns, E bytes per logit): reads K·E (guidance: 2·K·E) and 4·(1 + S);
writes 48 (top_k: + 8·k).

With ``stat_temperature`` (T_s) the statistics read z / T_s and the draw (its key, its top-k
slots) z / T. The noise is computed in int32 with logical shifts (products wrap modulo 2^32, as
uint32 ones do), so its bits equal every other backend's; a block whose largest s plus G_BOUND
(above every Gumbel value the noise can take) is below the best key of every row of the
block skips the noise, which cannot change the draw. With top_k the k slots take the block's
columns above their worst one at a time, best first, in a loop that ends when no row of the
block has a column above its worst slot.
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from ..layout import SAMPLE_IDS, SAMPLE_ROW_STATS, SAMPLE_STATE
from .token_stats import (_interpret_arg, _out_struct, block_sizes, fold_sums, row_entropy,
                          row_logp)

NEG_INF = float("-inf")
G_BOUND = 17.0  # > the largest Gumbel noise, -log(-log(1 - 2^-24)) = 16.64
BIG_ID = 2**31 - 1
SLOTS = 128  # lanes of the top-k scratch (slots beyond k hold +inf and are never the worst)
_M1, _M2 = 0x7FEB352D, 0x846CA68B - 2**32  # lowbias32 multipliers as int32


def _shr(x, s):
    return jax.lax.shift_right_logical(x, jnp.int32(s))


def _mix(x):
    """lowbias32 of int32-held 32-bit patterns (sampling.core.mix)."""
    x = x ^ _shr(x, 16)
    x = x * jnp.int32(_M1)
    x = x ^ _shr(x, 15)
    x = x * jnp.int32(_M2)
    return x ^ _shr(x, 16)


def _gumbel(key, cols):
    """float32 Gumbel noise of global columns cols (BN, BK) for row keys key (BN, 1)."""
    h = _mix(key ^ _mix(cols))
    u = (_shr(h, 9).astype(jnp.float32) + 0.5) * (2.0 ** -23)
    return -jnp.log(-jnp.log(u))


def _first_max(x, cols):
    """(max, lowest column reaching it) along rows of x (BN, BK); each (BN, 1)."""
    v = jnp.max(x, axis=1, keepdims=True)
    return v, jnp.min(jnp.where(x == v, cols, BIG_ID), axis=1, keepdims=True)


def _worst_slot(tv, ti, slot):
    """(value, slot) of each row's lowest-ranked slot: the smallest value, among equal ones
    the highest id."""
    wv = jnp.min(tv, axis=1, keepdims=True)
    wid = jnp.max(jnp.where(tv == wv, ti, -2), axis=1, keepdims=True)
    return wv, jnp.min(jnp.where((tv == wv) & (ti == wid), slot, BIG_ID), axis=1, keepdims=True)


def _sample_kernel(*refs, vocab, bk, temperature, stat_temperature, cfg_c, greedy, two_t,
                   has_uncond, n_suppress, top_k, inv_t):
    if has_uncond:
        z_ref, zu_ref, ints_ref, f_out, i_out, *rest = refs
    else:
        z_ref, ints_ref, f_out, i_out, *rest = refs
    if top_k:
        topv_out, topi_out, *scratch = rest
        tv_sc, ti_sc = scratch[-2:]
        scratch = scratch[:-2]
    else:
        scratch = rest
    v1_sc, v2_sc, m_sc, a_sc, b_sc, gv_sc, gz_sc, i1_sc, gi_sc = scratch
    kb = pl.program_id(1)
    last = kb == pl.num_programs(1) - 1
    sample = not greedy and not top_k
    bn = z_ref.shape[0]

    @pl.when(kb == 0)
    def _init():
        for ref in (v1_sc, v2_sc, m_sc, gv_sc):
            ref[...] = jnp.full(ref.shape, NEG_INF, jnp.float32)
        for ref in (a_sc, b_sc, gz_sc):
            ref[...] = jnp.zeros(ref.shape, jnp.float32)
        for ref in (i1_sc, gi_sc):
            ref[...] = jnp.zeros(ref.shape, jnp.int32)
        if top_k:
            slot = jax.lax.broadcasted_iota(jnp.int32, tv_sc.shape, 1)
            tv_sc[...] = jnp.where(slot < top_k, NEG_INF, float("inf"))
            ti_sc[...] = jnp.full(ti_sc.shape, -1, jnp.int32)

    ints = ints_ref[...]  # (BN, 1 + S) int32: the row key, the suppressed ids
    cols = kb * bk + jax.lax.broadcasted_iota(jnp.int32, (bn, bk), 1)  # global column ids
    z = z_ref[...].astype(jnp.float32)
    if has_uncond:
        zu = zu_ref[...].astype(jnp.float32)
        z = zu + cfg_c * (z - zu)
    for j in range(n_suppress):
        z = jnp.where(cols == ints[:, 1 + j:2 + j], NEG_INF, z)
    if vocab % bk:  # the ragged last block: columns past K
        z = jnp.where(cols < vocab, z, NEG_INF)
    s = z if greedy else z / (stat_temperature if two_t else temperature)  # the statistics'
    sd = z / temperature if two_t else s  # the draw's scores

    # the largest s (ties: the lowest id), the runner-up, and the statistics' running sums
    # of the logits, as the token statistics' forward folds them
    bv, bpos = _first_max(s, cols)
    b2 = jnp.max(jnp.where(cols == bpos, NEG_INF, s), axis=1, keepdims=True)
    v1_old = v1_sc[...]
    take = bv > v1_old  # a tie keeps the earlier (lower) id
    v2_sc[...] = jnp.maximum(jnp.where(take, v1_old, v2_sc[...]), jnp.where(take, b2, bv))
    i1_sc[...] = jnp.where(take, bpos, i1_sc[...])
    v1_sc[...] = jnp.maximum(v1_old, bv)
    fold_sums(m_sc, a_sc, b_sc, z, inv_t, True)

    if sample:
        bd = jnp.max(sd, axis=1, keepdims=True) if two_t else bv

        @pl.when(jnp.any(bd + G_BOUND >= gv_sc[...]))  # else no column here can win
        def _draw():
            kv, kpos = _first_max(sd + _gumbel(ints[:, 0:1], cols), cols)
            kz = jnp.sum(jnp.where(cols == kpos, z, 0.0), axis=1, keepdims=True)  # its logit
            tk = kv > gv_sc[...]
            gv_sc[...] = jnp.where(tk, kv, gv_sc[...])
            gi_sc[...] = jnp.where(tk, kpos, gi_sc[...])
            gz_sc[...] = jnp.where(tk, kz, gz_sc[...])

    if top_k:
        slot = jax.lax.broadcasted_iota(jnp.int32, tv_sc.shape, 1)

        def better(carry):  # some row has a column above its worst slot
            cand, tv, ti = carry
            return jnp.any(jnp.max(cand, axis=1, keepdims=True) > _worst_slot(tv, ti, slot)[0])

        def enter(carry):  # each such row: its best column replaces its worst slot
            cand, tv, ti = carry
            cv, cc = _first_max(cand, cols)
            wv, ws = _worst_slot(tv, ti, slot)
            into = (cv > wv) & (slot == ws)
            return (jnp.where((cv > wv) & (cols == cc), NEG_INF, cand), jnp.where(into, cv, tv),
                    jnp.where(into, cc, ti))

        _, tv, ti = jax.lax.while_loop(better, enter, (sd, tv_sc[...], ti_sc[...]))
        tv_sc[...], ti_sc[...] = tv, ti

    @pl.when(last)
    def _write():  # 12 x 4 bytes per row (and 8 x k of slots)
        gv = gv_sc[...]
        m, a, b = m_sc[...], a_sc[...], b_sc[...]
        state = dict(m=m, a=a, b=b, v1=v1_sc[...], v2=v2_sc[...], gv=gv, gz=gz_sc[...])
        # the token statistics' finish, the drawn token's logit as the target's (the largest
        # logit at T = 0, where the token is its argmax, and with top_k, whose logp the host
        # takes from the slots)
        la = jnp.log(a)
        state.update(la=la, entropy=row_entropy(la, a, b),
                     logp=row_logp(state["gz"] if sample else m, m, la, inv_t))
        for j, field in enumerate(SAMPLE_STATE + SAMPLE_ROW_STATS):
            f_out[:, j:j + 1] = state[field]
        ids = dict(i1=i1_sc[...], gi=jnp.where(gv == NEG_INF, 0, gi_sc[...]))
        for j, field in enumerate(SAMPLE_IDS):
            i_out[:, j:j + 1] = ids[field]
        if top_k:
            topv_out[...] = tv_sc[:, :top_k]
            topi_out[...] = ti_sc[:, :top_k]


def sample_partial(z, zu, ints, *, temperature, stat_temperature, cfg_c, greedy, two_t, top_k,
                   inv_t, block_k=None, interpret=False, detect_races=False):
    """z, zu: [N, K]; ints [N, 1 + S] int32 (row key, suppressed ids) -> (floats [N, 10] f32
    (SAMPLE_STATE, SAMPLE_ROW_STATS), ids [N, 2] int32, top-k values [N, k] f32 and ids
    [N, k] int32, or None without top_k); the scalars and flags as
    ``sampling.core.SampleLowered`` gives them (``greedy``: the temperatures are not read;
    ``two_t``: the statistics read z / stat_temperature), and ``inv_t`` the token statistics'
    1/T_s (``sampling.core.stats_lowered``)."""
    n, k = z.shape
    has_uncond = zu is not None
    bn, bk = block_sizes(k, z.dtype.itemsize, has_uncond, False, block_k)
    tile = pl.BlockSpec((bn, bk), lambda i, j: (i, j))
    per_row = lambda w: pl.BlockSpec((bn, w), lambda i, j: (i, 0))
    operands = [z] + ([zu] if has_uncond else []) + [ints]
    n_floats = len(SAMPLE_STATE) + len(SAMPLE_ROW_STATS)
    out_shape = [_out_struct((n, n_floats), jnp.float32, operands),
                 _out_struct((n, len(SAMPLE_IDS)), jnp.int32, operands)]
    out_specs = [per_row(n_floats), per_row(len(SAMPLE_IDS))]
    scratch = ([pltpu.VMEM((bn, 1), jnp.float32) for _ in range(7)]
               + [pltpu.VMEM((bn, 1), jnp.int32) for _ in range(2)])
    if top_k:
        out_shape += [_out_struct((n, top_k), jnp.float32, operands),
                      _out_struct((n, top_k), jnp.int32, operands)]
        out_specs += [per_row(top_k), per_row(top_k)]
        scratch += [pltpu.VMEM((bn, SLOTS), jnp.float32), pltpu.VMEM((bn, SLOTS), jnp.int32)]
    kernel = functools.partial(_sample_kernel, vocab=k, bk=bk, temperature=temperature,
                               stat_temperature=stat_temperature, cfg_c=cfg_c, greedy=greedy,
                               two_t=two_t, has_uncond=has_uncond,
                               n_suppress=ints.shape[1] - 1, top_k=top_k, inv_t=inv_t)
    outs = pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid=(pl.cdiv(n, bn), pl.cdiv(k, bk)),
        in_specs=[tile] * (1 + has_uncond) + [per_row(ints.shape[1])],
        out_specs=out_specs,
        scratch_shapes=scratch,
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
        interpret=_interpret_arg(interpret, detect_races),
        name="dlm_sample",
    )(*operands)
    return (outs[0], outs[1], *(outs[2:] if top_k else (None, None)))
