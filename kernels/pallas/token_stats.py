"""Pallas (Mosaic TPU) kernels of the token-statistics primitive (docs/design.md §2).

Grid and order
--------------
Forward: grid (cdiv(N, BN), cdiv(K, BK)) with dimension semantics ("parallel", "arbitrary").
Row blocks are independent (sharded across TensorCores); the vocabulary axis is the
innermost, sequential one, so the running row statistics live in VMEM scratch across it,
are initialised at k == 0 and written out at k == last. Backward: the same grid with both
axes "parallel": every (BN, BK) gradient block depends only on its logits block and the
saved per-row statistics.

Blocks and VMEM budget
----------------------
Logits blocks are (BN, BK) with BN a multiple of 8 (sublanes) and BK a multiple of 128
(lanes). Per-row data travels packed, so each kernel has few DMAs: ints [N, 3] (target,
shift column, global id of the shard's first column), floats [N, F] (shift, active, saved
statistics, cotangents), and the forward writes stats [N, 10] (11 with label smoothing; a
vocabulary shard its 8 or 9 running sums in them); their blocks (BN, 3|F|10|11) use the
full last dimension, which Mosaic accepts. ``block_sizes`` picks BK = 2048 and the largest BN (<= 256, multiple of 8)
whose estimate fits ``VMEM_BUDGET`` = 12 MiB, under the 16 MiB default scoped VMEM limit of
TPU v4/v5e (32 MiB on v6e):

    per (row, column) element:  2·E per streamed input (double buffered)
                                + 2·E per streamed output (backward)
                                + 4·8 bytes of float32 temporaries in the kernel body
    per row:                    10 scratch rows of 128 lanes x 4 bytes (lane-padded)

For bf16 logits with a teacher that is BN = 64 at BK = 2048 (about 10 MiB); K = 262144
is 128 vocabulary steps. Only a block that can hold columns past the vocabulary pays for
column ids and masks: the last block of a ragged K (its columns >= K are masked to -inf
before any reduction, and Pallas drops out-of-bounds stores), and every block of a padded
vocabulary shard (global ids >= vocab_size). Whole blocks run the bare math.

Bytes per row (K columns, E bytes per logit): forward reads K·E (+ K·E of teacher logits)
and writes 40 (10 floats, 44 with label smoothing); backward reads K·E (+ K·E teacher) and writes K·E (+ K·E teacher gradient).
Inactive rows are not cleaned before the math (a select per element): every reduction runs
along a row, so NaN or inf there stays in that row's sums, and the row's outputs and
gradient are replaced by exact zeros at the end; a row block with no active row skips the
forward's arithmetic. The forward makes logp itself, as the Triton finalize does (one way
on every kernel backend): each block adds r at the target's column to a running r_y, one
compare of the lane ids with the target, a select and a sum per element (the only tile
operations beyond the online logsumexp in a whole block); a vocabulary shard leaves it to
the caller, which gathers one target logit per row on every backend (``forward_partial``),
to merge across shards. The gradient gathers its
per-row factors first (the form of ``chunk_grads`` in ``dlm_kernels.token_stats.formulas``). With
``entropy=False`` the entropy's running sum and its gradient term are left out (the entropy
column is then 0). Every exponent is a difference of logits scaled afterwards, (r - m)/T,
with m the running maximum of the logits themselves (docs/design.md §2): the forward keeps
m in logit units, and the backward forms p = e^{(r - m)/T}·e^{-la} from the saved m and
log-sum la, exact at any temperature down to 2^-102 (``FLOAT32_MIN_TEMPERATURE``).

Label smoothing and z-loss (docs/design.md §2): with ``smoothing`` the forward keeps one
more running sum, Σ r over the valid columns, and writes it after ROW_STATS (or, for a
shard, as PARTIAL_STATE's ``sr``); the caller forms the CE term from it
(``token_stats.formulas.ce_objective``). With ``ce_terms`` the backward reads the CE term's per-row
coefficients (g_y, g_u, g_p) from three more packed float columns (F_GY, F_GU, F_GP;
``token_stats.formulas.ce_coefficients``) in place of g_lp.

TPU notes: target and shift columns are compared against an ``iota`` (``one_hot`` has failed
to lower on TPU v4); per-row scalars are (BN, 1) slices of the packed blocks.
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from ..layout import PARTIAL_STATE, ROW_STATS
from ..series import PSI_COEFFS, PSI_SMALL
from ..softcap import TANH_SERIES, TANH_SERIES_BOUND

NEG_INF = float("-inf")
VMEM_BUDGET = 12 * 1024 * 1024
BLOCK_K = 2048
MAX_BLOCK_N = 256

# Column layout of the packed per-row float inputs (the saved statistics: ROW_STATS's
# residuals, kernels/layout.py).
(F_SHIFT, F_ACTIVE, F_M, F_LA, F_ENT, F_KL_SHIFT, F_LA_CE, F_MU, F_LA_U, F_GLSE, F_GLP, F_GH,
 F_GKL, F_GY, F_GU, F_GP) = range(16)
N_INTS = 3  # target, shift column, global id of the shard's column 0
FWD_FLOATS = 2  # shift, active
BWD_FLOATS = 16  # everything above, padded



def vmem_bytes(bn, bk, itemsize, has_teacher, backward):
    """VMEM of one grid step with (BN, BK) blocks (see the module docstring): the
    double-buffered logit blocks (and gradient blocks) plus float32 temporaries per element,
    and the lane-padded per-row scratch."""
    streams = 1 + int(has_teacher)
    per_elem = 2 * itemsize * streams + (2 * itemsize * streams if backward else 0) + 4 * 8
    return bn * bk * per_elem + bn * 10 * 128 * 4


def block_sizes(vocab, itemsize, has_teacher, backward, block_k=None):
    """(BN, BK): BK = ``block_k`` (default BLOCK_K) in multiples of 128, and the largest BN
    (a multiple of 8, at most MAX_BLOCK_N) whose ``vmem_bytes`` fit VMEM_BUDGET.

    A function of K, the dtype, the features and the block asked for, never of the number
    of rows: a row's sums are taken over its (BN, BK) tiles, and how a compiler orders a
    reduction can depend on the whole shape it reduces (XLA's CPU compiler, which runs
    interpret mode, does), so a BN sized from N could give a row other bits alone than in
    a batch (docs/design.md §2, "One row, one answer"). A call of fewer rows than BN runs
    one row block of BN: rows past N are padding, computed and dropped on store."""
    bk = block_k or BLOCK_K
    bk = max(128, (min(bk, -(-vocab // 128) * 128) // 128) * 128)
    bn = VMEM_BUDGET // vmem_bytes(1, bk, itemsize, has_teacher, backward)  # linear in BN
    bn = max(8, min(MAX_BLOCK_N, (bn // 8) * 8))
    return bn, bk


def _cap(z, softcap, has_softcap):
    """c·tanh(z/c), as the host computes it (``token_stats.formulas.softcap``, kernels/softcap.py):
    below the series bound z·(1 + u·Q(u)), u = (z/c)², so z itself where z/c underflows;
    z without a cap (``has_softcap`` False: ``softcap`` is the host's stand-in, unread)."""
    if not has_softcap:
        return z
    x = z * (1.0 / softcap)
    u = x * x
    q = TANH_SERIES[-1]
    for coef in TANH_SERIES[-2::-1]:
        q = q * u + coef
    e = jnp.exp(-2.0 * jnp.abs(x))
    th = (1.0 - e) / (1.0 + e)  # tanh(|x|) from one exp, as the host and Triton form it
    return jnp.where(u < TANH_SERIES_BOUND ** 2, z + z * (u * q),
                     jnp.where(x < 0, -th, th) * softcap)


def _cap_slope(z, softcap):
    """cap'(z) = 1 - tanh²(z/c) = 4e / (1 + e)², e = e^{-2|z/c|}: precise relative to itself
    (1 - th² from a rounded th is precise only to float32's absolute 6e-8)."""
    e = jnp.exp(-2.0 * jnp.abs(z / softcap))
    return 4.0 * e / ((1.0 + e) * (1.0 + e))


def _shifted(z, cols, x, d, softcap, has_softcap, has_shift):
    r = _cap(z, softcap, has_softcap)
    if has_shift:
        r = r + jnp.where(cols == x, d, 0.0)
    return r


def _max_update(m_ref, v):
    """Fold the row maxima of a block v (BN, BK) of logits into the (BN, 1) scratch m_ref;
    returns (d, shift): v - m_safe (BN, BK) and m_old - m_safe (BN, 1) (-inf for an empty
    old state), the logit differences every exponent is formed from."""
    m_old = m_ref[...]
    m_new = jnp.maximum(m_old, jnp.max(v, axis=1, keepdims=True))
    m_ref[...] = m_new
    m_safe = jnp.where(m_new == NEG_INF, 0.0, m_new)  # an all -inf prefix: no inf - inf
    return v - m_safe, m_old - m_safe


def _sum_update(a_ref, d, shift, inv_t):
    """a_ref = a_ref·e^{shift/T} + Σ e^{d/T} (BN, 1); returns (x = d/T, e = e^x, the old
    sum, its rescale e^{shift/T}, shift/T)."""
    x, delta = _scaled(d, inv_t), _scaled(shift, inv_t)
    e, f = jnp.exp(x), jnp.exp(delta)
    a_old = a_ref[...]
    a_ref[...] = a_old * f + jnp.sum(e, axis=1, keepdims=True)
    return x, e, a_old, f, delta


def _moved(f, delta, a, b):
    """f·(b + δ·a): a running Σ e^x·x moved to a new maximum (x + δ), and exactly 0 where
    the rescale f = e^δ is 0 (where δ·a may be -inf: columns masked with finfo.min)."""
    return jnp.where(f > 0, f * (b + delta * a), 0.0)


def fold_sums(m_ref, a_ref, b_ref, r, inv_t, entropy):
    """Fold a block r (BN, BK) of (capped, shifted) logits, masked columns at -inf, into the
    running (m, a, b) scratch rows (m in logit units, a = Σ e^x, b = Σ e^x·x relative to m,
    x = (r - m)/T; b untouched without ``entropy``). Returns (dr, shift, x, e^x, the old a,
    its rescale f, its move δ) for the other sums. The sampler's kernel
    (``kernels.pallas.sampling``) folds its blocks with this function too, so its
    statistics are these sums, bit for bit."""
    dr, shift = _max_update(m_ref, r)
    xs, e, a_old, f, delta = _sum_update(a_ref, dr, shift, inv_t)
    if entropy:  # b relative to the running max (stays 0 without entropy)
        b_ref[...] = _moved(f, delta, a_old, b_ref[...]) + jnp.sum(
            jnp.where(e > 0, e * xs, 0.0), axis=1, keepdims=True)
    return dr, shift, xs, e, a_old, f, delta


def row_entropy(la, a, b):
    """The entropy log a - b/a of a row's finished sums (la = log a)."""
    return la - b / a


def row_logp(r_y, m, la, inv_t, found=True):
    """logp = (r_y - m)/T - la of the target's logit r_y; NaN where not ``found``."""
    return jnp.where(found, _scaled(r_y - m, inv_t) - la, jnp.nan)


def _psi_series(y):
    """S(y) = psi(y) / y² for |y| < PSI_SMALL (kernels/series.py), by Horner's rule."""
    acc = PSI_COEFFS[-1]
    for c in reversed(PSI_COEFFS[:-1]):
        acc = acc * y + c
    return acc


def _teacher_terms(xu, xs, e, eu):
    """This block's (cu, fu) terms summed over its columns, (BN, 1) each: e^{x_u}·y and
    e^{x_u}·psi(y) with y = x_u - x (the series where |y| is small, where
    e^{x_u}·y - e^{x_u} + e^x cancels; dlm_kernels.token_stats.formulas.teacher_sums)."""
    y = xu - xs
    ct = jnp.where(eu > 0, eu * y, 0.0)  # (y may be ±inf or NaN where q = 0)
    fk = jnp.where(jnp.abs(y) < PSI_SMALL, ct * y * _psi_series(y), ct + (e - eu))
    return jnp.sum(ct, axis=1, keepdims=True), jnp.sum(fk, axis=1, keepdims=True)


def _teacher_at(a_old, au_old, cu, fu, f, g, h):
    """Running (cu, fu) at new maxima (dlm_kernels.token_stats.formulas.teacher_at): the
    student's exponents moved by δ (f = e^δ), the teacher's by δ_u (g = e^{δ_u}), and
    y = x_u - x by -h, h = δ - δ_u."""
    live = g > 0
    cu_new = jnp.where(live, g * (cu - h * au_old), 0.0)
    gap = cu - fu
    near = live & (jnp.abs(h) < PSI_SMALL) & jnp.isfinite(gap)
    fu_near = g * (fu - h * gap + a_old * h * h * _psi_series(-h))
    fu_far = jnp.where(live, g * (fu - h * au_old - a_old), 0.0) + f * a_old
    return cu_new, jnp.where(near, fu_near, fu_far)


def _psi(y):
    return jnp.where(jnp.abs(y) < PSI_SMALL, y * y * _psi_series(y), y - 1.0 + jnp.exp(-y))


def _kl(a, au, cu, fu):
    """KL(q || p) >= 0 from a row's sums (dlm_kernels.token_stats.formulas.kl_divergence)."""
    e_far = jnp.log(au) - jnp.log(a)
    v = (cu - fu) / a
    near = (jnp.abs(e_far) <= 1.0) & (jnp.abs(v) < 2.0)
    e = jnp.where(near, jnp.log1p(v), e_far)
    kl = jnp.where(near, fu / au - _psi(e), cu / au - e_far)
    return jnp.where(kl < 0, 0.0, kl)


def _scaled(x, inv_t):
    return x if inv_t == 1.0 else x * inv_t  # a multiply less at unit temperature


def _fwd_kernel(*refs, vocab, bk, inv_t, inv_t_ce, inv_t_kl, softcap, has_softcap, has_shift,
                has_teacher, separate_ce, entropy, vocab_limit, padded, partial, smoothing):
    z_ref, *refs = refs
    u_ref = refs.pop(0) if has_teacher else None
    fwd_body(_loader(z_ref), _loader(u_ref), *refs, kb=pl.program_id(1), vocab=vocab, bk=bk,
             inv_t=inv_t, inv_t_ce=inv_t_ce, inv_t_kl=inv_t_kl, softcap=softcap,
             has_softcap=has_softcap, has_shift=has_shift, separate_ce=separate_ce,
             entropy=entropy, vocab_limit=vocab_limit, padded=padded, partial=partial,
             smoothing=smoothing)


def _loader(ref):
    """A tile loader reading ``ref`` as float32 (None for no ref)."""
    return None if ref is None else (lambda: ref[...].astype(jnp.float32))


def fwd_body(load_z, load_u, ints_ref, floats_ref, out_ref, *scratch, kb, vocab, bk, inv_t,
             inv_t_ce, inv_t_kl, softcap, has_softcap, has_shift, separate_ce, entropy,
             vocab_limit, padded, partial, smoothing=False, ce_terms=False):
    """The forward of one (BN, BK) step at vocabulary block ``kb``: ``load_z()`` and
    ``load_u()`` (None: no teacher) give the float32 logits tiles (read from HBM here, made
    on the MXU by the linear head's kernels); the scratch rows hold the running state
    (PARTIAL_STATE: maxima in logit units; Σ r only with ``smoothing``, ``scratch_rows``),
    then, for whole rows (not ``partial``), the target's logit r_y. ``ce_terms`` is the
    backward's (taken here so one set of statics serves both)."""
    has_teacher = load_u is not None
    m_sc, a_sc, b_sc, a2_sc, mu_sc, au_sc, cu_sc, fu_sc = scratch[:8]
    sr_sc = scratch[8] if smoothing else None
    ry_sc = None if partial else scratch[-1]  # Σ over the block of r·[k == y]: r_y
    last = kb == pl.num_programs(1) - 1

    @pl.when(kb == 0)
    def _init():
        for ref in (m_sc, mu_sc):
            ref[...] = jnp.full(ref.shape, NEG_INF, jnp.float32)
        for ref in (a_sc, b_sc, a2_sc, au_sc, cu_sc, fu_sc, sr_sc, ry_sc):
            if ref is not None:
                ref[...] = jnp.zeros(ref.shape, jnp.float32)

    ints = ints_ref[...]  # (BN, 3) int32: target, shift column, global id of column 0
    floats = floats_ref[...]  # (BN, 2) f32: shift, active
    x = ints[:, 1:2]
    y_local = ints[:, 0:1] - ints[:, 2:3]  # (BN, 1): the target's column in this shard
    d, active = floats[:, F_SHIFT:F_SHIFT + 1], floats[:, F_ACTIVE:F_ACTIVE + 1] != 0
    bn = ints_ref.shape[0]

    def accumulate(masked):
        """Fold this (BN, BK) block into the running row sums. Only a block that can hold
        columns past the vocabulary (``masked``) pays for the column ids and the mask."""
        cols = valid = None
        if masked or has_shift:
            local = kb * bk + jax.lax.broadcasted_iota(jnp.int32, (bn, bk), 1)
            cols = local + ints[:, 2:3]  # global vocabulary ids (a shard starts at its offset)
        if masked:
            valid = (local < vocab) & (cols < vocab_limit)
        # Inactive rows are not cleaned: every reduction runs along a row, so what they hold
        # stays in their own sums, and their outputs are replaced by zeros at the end.
        r = _shifted(load_z(), cols, x, d, softcap, has_softcap, has_shift)
        if not partial:  # the target's logit: a compare, select and sum per element (the
            # lane ids (1, BK) are shared by every row; a target past the vocabulary is
            # picked up here but not found at the end)
            lanes = jax.lax.broadcasted_iota(jnp.int32, (1, bk), 1)
            ry_sc[...] += jnp.sum(jnp.where(lanes == y_local - kb * bk, r, 0.0), axis=1,
                                  keepdims=True)
        if smoothing:  # label smoothing: Σ r over the valid columns
            sr_sc[...] += jnp.sum(jnp.where(valid, r, 0.0) if masked else r, axis=1,
                                  keepdims=True)
        if masked:
            r = jnp.where(valid, r, NEG_INF)
        dr, shift, xs, e, a_old, f, delta = fold_sums(m_sc, a_sc, b_sc, r, inv_t, entropy)
        if separate_ce:  # the same maximum, exponents (r - m)/T_ce
            _sum_update(a2_sc, dr, shift, inv_t_ce)
        if has_teacher:
            u = load_u()
            if masked:
                u = jnp.where(valid, u, NEG_INF)
            du, shift_u = _max_update(mu_sc, u)
            xu, eu, au_old, g, delta_u = _sum_update(au_sc, du, shift_u, inv_t_kl)
            # the old (cu, fu) at the new maxima (y = x_u - x moves by δ_u - δ), then this
            # block's terms
            cu, fu = _teacher_at(a_old, au_old, cu_sc[...], fu_sc[...], f, g, delta - delta_u)
            cu_blk, fu_blk = _teacher_terms(xu, xs, e, eu)
            cu_sc[...] = cu + cu_blk
            fu_sc[...] = fu + fu_blk

    # Columns past the vocabulary: the ragged tail of the last block, or (a padded shard)
    # global ids >= vocab_limit, which any block may hold.
    if padded:
        pl.when(jnp.any(active))(lambda: accumulate(True))
    elif vocab % bk:
        pl.when(jnp.any(active) & ~last)(lambda: accumulate(False))
        pl.when(jnp.any(active) & last)(lambda: accumulate(True))
    else:
        pl.when(jnp.any(active))(lambda: accumulate(False))

    if partial:
        @pl.when(last)
        def _write_partial_state():  # a vocabulary shard: its running sums, merged across devices
            state = dict(m=m_sc, a=a_sc, b=b_sc, a2=a2_sc, mu=mu_sc, au=au_sc, cu=cu_sc,
                         fu=fu_sc, sr=sr_sc)
            for j, field in enumerate(PARTIAL_STATE[:scratch_rows(smoothing)]):
                out_ref[:, j:j + 1] = state[field][...]
        return

    @pl.when(last)
    def _finalize():
        m, la = m_sc[...], jnp.log(a_sc[...])
        lse = _scaled(m, inv_t) + la
        ent = row_entropy(la, a_sc[...], b_sc[...]) if entropy else jnp.zeros_like(lse)
        la_ce = jnp.log(a2_sc[...]) if separate_ce else la
        zero = jnp.zeros_like(lse)
        kl, mu, la_u, kl_shift = zero, zero, zero, zero
        if has_teacher:
            mu, la_u = mu_sc[...], jnp.log(au_sc[...])
            kl_shift = cu_sc[...] / au_sc[...]  # E_q[x_u - x]
            kl = _kl(a_sc[...], au_sc[...], cu_sc[...], fu_sc[...])
            kl = jnp.where(jnp.isfinite(lse), kl, jnp.nan)  # no distribution p: no KL
        # logp = (r_y - m)/T_ce - la_ce; NaN where the target is not a column of the
        # vocabulary (out of range, or padding: loud, never silently wrong)
        found = (y_local >= 0) & (y_local < vocab)
        if padded:
            found = found & (ints[:, 0:1] < vocab_limit)
        logp = row_logp(ry_sc[...], m, la_ce, inv_t_ce, found)
        stats = dict(lse=lse, logp=logp, entropy=ent, kl=kl, kl_shift=kl_shift, m=m, la=la,
                     la_ce=la_ce, mu=mu, la_u=la_u)
        values = [stats[field] for field in ROW_STATS] + ([sr_sc[...]] if smoothing else [])
        for j, v in enumerate(values):
            out_ref[:, j:j + 1] = jnp.where(active, v, 0.0)


def _bwd_kernel(*refs, vocab, bk, inv_t, inv_t_ce, inv_t_kl, softcap, has_softcap, has_shift,
                has_teacher, separate_ce, entropy, teacher_grad, vocab_limit, padded, ce_terms):
    if has_teacher:
        z_ref, u_ref, ints_ref, floats_ref, dz_ref, *rest = refs
    else:
        z_ref, ints_ref, floats_ref, dz_ref, *rest = refs
        u_ref = None
    du_ref = rest[0] if teacher_grad else None
    dz, du = grad_tile(z_ref[...].astype(jnp.float32), _loader(u_ref), ints_ref[...],
                       floats_ref[...], kb=pl.program_id(1), vocab=vocab, bk=bk, inv_t=inv_t,
                       inv_t_ce=inv_t_ce, inv_t_kl=inv_t_kl, softcap=softcap,
                       has_softcap=has_softcap, has_shift=has_shift, separate_ce=separate_ce,
                       entropy=entropy,
                       teacher_grad=teacher_grad, vocab_limit=vocab_limit, padded=padded,
                       mask_tail=False, ce_terms=ce_terms)
    dz_ref[...] = dz.astype(dz_ref.dtype)
    if teacher_grad:
        du_ref[...] = du.astype(du_ref.dtype)


def grad_tile(z, load_u, ints, f, *, kb, vocab, bk, inv_t, inv_t_ce, inv_t_kl, softcap,
              has_softcap, has_shift, separate_ce, entropy, teacher_grad, vocab_limit, padded,
              mask_tail, ce_terms=False, smoothing=False):
    """(dz, du or None), float32 (BN, BK) tiles of vocabulary block ``kb``: z the float32
    logits tile, ``load_u()`` the teacher's (None: no teacher), ints (BN, 3) and f (BN, 16)
    the packed per-row inputs. Inactive rows (and
    padding columns of a padded shard) get exact zeros; with ``mask_tail`` so do columns
    past the vocabulary (whose stores the logits kernels leave to Pallas to drop, but whose
    values a linear head's matmuls would sum). With ``ce_terms`` (label smoothing, z-loss)
    the CE term's gradient is g_y·[k == y] + g_u·[k valid] - g_p·p' from the F_GY, F_GU,
    F_GP columns (already over T_ce) instead of (g_lp / T_ce)·([k == y] - p');
    ``smoothing`` is the forward's (one set of statics serves both)."""
    y, x, offset = ints[:, 0:1], ints[:, 1:2], ints[:, 2:3]
    col = lambda j: f[:, j:j + 1]
    active = col(F_ACTIVE) != 0
    m, la, ent, la_ce = col(F_M), col(F_LA), col(F_ENT), col(F_LA_CE)
    mu, la_u, kl_shift = col(F_MU), col(F_LA_U), col(F_KL_SHIFT)
    g_lse, g_lp, g_h, g_kl = (jnp.where(active, col(j), 0.0) for j in (F_GLSE, F_GLP, F_GH, F_GKL))
    bn = z.shape[0]
    iota = jax.lax.broadcasted_iota(jnp.int32, (bn, bk), 1)
    cols = kb * bk + iota + offset if has_shift or padded else None
    # Per-row factors first, so each element costs as few vector operations as the math
    # allows (chunk_grads in token_stats.formulas has the same form):
    #   dr = p·coef + (g_kl/T)·(p - q) - (g_lp/T_ce)·p' + [k == y]·g_lp/T_ce
    # with p = e^x·e^{-la}, x = (r - m)/T: the row factor e^{-la} joins coef
    g_y = g_p = g_lp * inv_t_ce
    if ce_terms:  # label smoothing / z-loss: the CE term's per-row coefficients
        g_y, g_u, g_p = (jnp.where(active, col(j), 0.0) for j in (F_GY, F_GU, F_GP))
    coef = g_lse * inv_t if separate_ce else g_lse * inv_t - g_p  # (BN, 1)
    inv_a = jnp.exp(-la)  # (BN, 1): 1 / Σ e^x
    # Inactive rows are not cleaned first: their gradient is replaced by zeros at the end.
    r = _shifted(z, cols, x, col(F_SHIFT), softcap, has_softcap, has_shift)
    d = r - m  # logit differences
    xs = _scaled(d, inv_t)
    e = jnp.exp(xs)  # p·Σ e^x
    if entropy:  # (without it g_h is the cotangent of nothing)
        coef = coef - g_h * inv_t * jnp.where(e > 0, xs - la + ent, 0.0)
    dr = e * (coef * inv_a)
    keep = active  # and a padded shard's padding columns get exact zeros
    if padded:
        keep = keep & (cols < vocab_limit)
    if mask_tail:
        keep = keep & (kb * bk + iota < vocab)
    du = None
    if load_u is not None:
        xu = _scaled(load_u() - mu, inv_t_kl)
        q = jnp.exp(xu - la_u)
        dr = dr + g_kl * inv_t * (e * inv_a - q)  # float32 p - q
        if teacher_grad:
            # log q - log p - kl = (x_u - x) - E_q[x_u - x]: no cancellation of
            # log-normalisers
            du = g_kl * jnp.where(q > 0, q * ((xu - xs) - kl_shift), 0.0) * inv_t_kl
            du = jnp.where(keep, du, 0.0)
    if separate_ce:
        dr = dr - g_p * jnp.exp(_scaled(d, inv_t_ce) - la_ce)
    if ce_terms:  # the uniform term (padding and columns past K are masked by ``keep``)
        dr = dr + g_u
    # the target column (compared in block-local ids: one per-row subtraction, not one per element)
    dr = dr + jnp.where(iota == y - offset - kb * bk, g_y, 0.0)
    if has_softcap:
        dr = dr * _cap_slope(z, softcap)
    return jnp.where(keep, dr, 0.0), du


def _out_struct(shape, dtype, operands):
    """An output ShapeDtypeStruct that varies over the union of the operands' shard_map axes
    (needed inside ``jax.shard_map`` with check_vma; a no-op outside)."""
    types = [getattr(jax.typeof(a), "manual_axis_type", None) for a in operands]
    types = [t for t in types if t is not None and t.varying]
    if not types:
        return jax.ShapeDtypeStruct(shape, dtype)
    varying = frozenset().union(*(t.varying for t in types))
    mat = type(types[0])(varying=varying, unreduced=frozenset(), reduced=frozenset())
    return jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=mat)


def _interpret_arg(interpret, detect_races=False):
    """False (compiled Mosaic) or TPU interpret mode, whose outputs start as NaN (so an
    element a kernel leaves unwritten fails a test); race detection emulates two cores, so
    the "parallel" row axis is really split between them."""
    if not interpret:
        return False
    if detect_races:
        return pltpu.InterpretParams(detect_races=True, num_cores_or_threads=2,
                                     uninitialized_memory="nan")
    return pltpu.InterpretParams(uninitialized_memory="nan")


def _grid(z, has_teacher, backward, block_k):
    """(BN, grid, logits tile spec, per-row spec of width w) for z: [N, K]."""
    n, k = z.shape
    bn, bk = block_sizes(k, z.dtype.itemsize, has_teacher, backward, block_k)
    tile = pl.BlockSpec((bn, bk), lambda i, j: (i, j))
    per_row = lambda w: pl.BlockSpec((bn, w), lambda i, j: (i, 0))
    return bn, bk, (pl.cdiv(n, bn), pl.cdiv(k, bk)), tile, per_row


def scratch_rows(smoothing):
    """The forward's running sums: PARTIAL_STATE, its last (Σ r) only with label smoothing."""
    return len(PARTIAL_STATE) if smoothing else len(PARTIAL_STATE) - 1


def scratch_shapes(bn, smoothing, partial):
    """The forward's (BN, 1) float32 scratch rows: ``scratch_rows``, then, for whole rows,
    the target's logit."""
    return [pltpu.VMEM((bn, 1), jnp.float32)
            for _ in range(scratch_rows(smoothing) + (not partial))]


def stats_width(smoothing):
    """Columns of the forward's output: ROW_STATS, then Σ r with label smoothing; a
    vocabulary shard writes its first ``scratch_rows`` (PARTIAL_STATE)."""
    return len(ROW_STATS) + int(smoothing)


def stats_forward(z, u, ints, floats, *, inv_t, inv_t_ce, inv_t_kl, softcap, has_softcap,
                  has_shift, separate_ce, entropy, vocab_limit, padded, smoothing, ce_terms,
                  block_k=None, interpret=False, detect_races=False, partial=False):
    """z, u: [N, K]; ints [N, 3] int32; floats [N, 2] f32 -> stats [N, stats_width] f32
    (ROW_STATS, logp the target's log-probability at T_ce, then Σ r with ``smoothing``), or
    with ``partial`` the running state (PARTIAL_STATE) of this vocabulary shard in its first
    columns. ``ce_terms`` is the backward's (ignored here)."""
    n, k = z.shape
    has_teacher = u is not None
    bn, bk, grid, tile, per_row = _grid(z, has_teacher, False, block_k)
    kernel = functools.partial(
        _fwd_kernel, vocab=k, bk=bk, inv_t=inv_t, inv_t_ce=inv_t_ce, inv_t_kl=inv_t_kl,
        softcap=softcap, has_softcap=has_softcap, has_shift=has_shift, has_teacher=has_teacher,
        separate_ce=separate_ce, entropy=entropy, vocab_limit=vocab_limit, padded=padded,
        partial=partial, smoothing=smoothing)
    operands = [z] + ([u] if has_teacher else []) + [ints, floats]
    return pl.pallas_call(
        kernel,
        out_shape=_out_struct((n, stats_width(smoothing)), jnp.float32, operands),
        grid=grid,
        in_specs=[tile] * (1 + has_teacher) + [per_row(N_INTS), per_row(FWD_FLOATS)],
        out_specs=per_row(stats_width(smoothing)),
        scratch_shapes=scratch_shapes(bn, smoothing, partial),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
        interpret=_interpret_arg(interpret, detect_races),
        name="dlm_token_stats_fwd",
    )(*operands)


def stats_backward(z, u, ints, floats, *, inv_t, inv_t_ce, inv_t_kl, softcap, has_softcap,
                   has_shift, separate_ce, teacher_grad, entropy, vocab_limit, padded, smoothing,
                   ce_terms, block_k=None, interpret=False, detect_races=False):
    """-> (dz [N, K] in z's dtype, du [N, K] or None); floats [N, 16] packs the saved
    statistics and cotangents (F_* columns; the CE term's coefficients with ``ce_terms``).
    ``smoothing`` is the forward's (ignored here)."""
    n, k = z.shape
    has_teacher = u is not None
    _, bk, grid, tile, per_row = _grid(z, has_teacher, True, block_k)
    kernel = functools.partial(
        _bwd_kernel, vocab=k, bk=bk, inv_t=inv_t, inv_t_ce=inv_t_ce, inv_t_kl=inv_t_kl,
        softcap=softcap, has_softcap=has_softcap, has_shift=has_shift, has_teacher=has_teacher,
        separate_ce=separate_ce, entropy=entropy, teacher_grad=teacher_grad,
        vocab_limit=vocab_limit, padded=padded, ce_terms=ce_terms)
    operands = [z] + ([u] if has_teacher else []) + [ints, floats]
    out_shape = [_out_struct(z.shape, z.dtype, operands)]
    if teacher_grad:
        out_shape.append(_out_struct(u.shape, u.dtype, operands))
    outs = pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid=grid,
        in_specs=[tile] * (1 + has_teacher) + [per_row(N_INTS), per_row(BWD_FLOATS)],
        out_specs=[tile] * len(out_shape),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel")),
        interpret=_interpret_arg(interpret, detect_races),
        name="dlm_token_stats_bwd",
    )(*operands)
    return outs[0], (outs[1] if teacher_grad else None)
