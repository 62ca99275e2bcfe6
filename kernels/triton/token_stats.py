"""Triton kernels of the token-statistics primitive (docs/design.md §2).

Three kernels, no host code:

  stats_partial_kernel   grid (N, S): row n, vocabulary split s. One streaming pass over
                         its columns in BLOCK_K blocks (online softmax, float32, running sums
                         per 16-byte lane, merged at the end), writing the 8 running sums of
                         the split to part[8, S, N] (with SMOOTH, label smoothing's Σ r over
                         the valid columns as a 9th: part[9, S, N]).
  stats_finalize_kernel  grid (cdiv(N, BLOCK_N),): merges the S partial states of each row,
                         loads the target logit and writes out[10, N] = (lse, logp, entropy,
                         kl, kl_shift, m, la, la_ce, mu, la_u) (with SMOOTH out[11, N], the
                         merged Σ r last). One row a thread, its S states merged split by
                         split: an order fixed by S, which K alone fixes, and no sum across
                         threads, whose order the compiler's layout would choose.
  stats_grad_kernel      grid (N, S): recomputes p (and q) block by block from the saved row
                         statistics and writes d(logits) (and d(teacher)) in the input dtype.
                         With CE_TERMS (label smoothing or z-loss) the logp cotangent arrives
                         as three per-row coefficients (g_y, g_u, g_p) = g_lp_ptr[3, N] of the
                         CE gradient g_y·[k == y] + g_u·[k valid] - g_p·p'_k
                         (``dlm_kernels.token_stats.formulas.ce_coefficients``).

The finalize kernel's logp is the target's log-probability; label smoothing and z-loss turn
it into the CE training term on the host, from the row statistics and the merged Σ r (O(N),
``token_stats.formulas.ce_objective``), as every backend does.

Bytes per row (K columns, E bytes per logit): the partial pass reads K·E (plus K·E of teacher
logits); the finalize pass reads 8·S·4 + E and writes 40; the gradient pass reads K·E and
writes K·E (teacher: + 2·K·E with teacher gradients, + K·E without). Inactive rows (active
== 0) read no logits at all: their loops run zero times and their gradient stores write
zeros without a load.

Parameter order: input pointers, then scalars, then output pointers, then constexprs, so
that ``jax_triton.triton_call`` (inputs positionally, outputs appended) and the torch
launcher call the same source. The vocabulary offset of a shard is an input pointer, not a
scalar: under ``jax.shard_map`` it is ``axis_index · K_local``, a traced value, and
jax-triton passes only static Python scalars.

Conventions: float32 math throughout, int64 row offsets (N·K passes 2^31), unit column
stride (the launcher makes it so), row strides passed in. Each streaming loop is split in
two: whole blocks of real vocabulary with no masks (so Triton can prove 16-byte alignment
and contiguity and vectorise the accesses; a mask against an unaligned bound such as the
vocabulary limit would force 2-byte scalar loads), then the ragged tail and any padding
columns with masks (``_row_span`` gives the bounds). Softcap c (HAS_SOFTCAP) maps z to
c·tanh(z/c) (``_cap``); the LOO shift adds d at column x (HAS_SHIFT) before the temperature.
Without HAS_ENTROPY the entropy's running sum and its gradient term are compiled out (the
entropy row of ``out`` is then 0; the caller asked for no entropy).

Temperatures: every exponent is a difference of logits scaled afterwards, (r - m)·(1/T) with
m the running maximum of the logits r themselves (docs/design.md §2), never r·(1/T) minus a
maximum or lse of size |r|/T; the kernels keep m in logit units and store it so, with the
log of the sum relative to it, and the gradient pass forms log p = (r - m)/T - la from them.
So the base-2 scale log2(e)/T multiplies a difference, exact at any T down to 2^-102
(``FLOAT32_MIN_TEMPERATURE``; a maximum or lse of size |r|/T would carry an absolute error of an
ulp of it, about 60 at |r| = 10, T = 1e-8).
"""

import triton
import triton.language as tl

from ..layout import PARTIAL_STATE, ROW_STATS
from ..series import PSI_COEFFS, PSI_COEFFS_BASE2, PSI_SMALL
from ..softcap import TANH_SERIES, TANH_SERIES_BOUND

NEG_INF = tl.constexpr(float("-inf"))
LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)

# Buffer rows (kernels/layout.py, which the host reads too): part[8, S, N] =
# (m, a, b, a2, mu, au, cu, fu) per split; out[10, N] = (lse, logp, entropy, kl, kl_shift, m,
# la, la_ce, mu, la_u).
P_M, P_A, P_B, P_A2, P_MU, P_AU, P_CU, P_FU, P_SR = (
    tl.constexpr(PARTIAL_STATE.index(f))
    for f in ("m", "a", "b", "a2", "mu", "au", "cu", "fu", "sr"))
N_ROW_STATS = tl.constexpr(len(ROW_STATS))
S_LSE, S_LOGP, S_ENTROPY, S_KL, S_KL_SHIFT, S_M, S_LA, S_LA_CE, S_MU, S_LA_U = (
    tl.constexpr(ROW_STATS.index(f))
    for f in ("lse", "logp", "entropy", "kl", "kl_shift", "m", "la", "la_ce", "mu", "la_u"))
# tanh(x) = x + x·u·Q(u), u = x², below |x| = TANH_BOUND (kernels/softcap.py)
TANH_BOUND2 = tl.constexpr(TANH_SERIES_BOUND * TANH_SERIES_BOUND)
Q0, Q1, Q2, Q3, Q4 = (tl.constexpr(c) for c in TANH_SERIES)
# psi(y) = y - 1 + e^{-y} = y²·S(y) for |y| < PSI_SMALL (kernels/series.py): S's coefficients
# in natural units (per-lane and per-row terms) and in base 2 (per-logit terms, y2 = y·log2 e)
PSI_SMALL_ = tl.constexpr(PSI_SMALL)
PSI_SMALL2 = tl.constexpr(PSI_SMALL * 1.4426950408889634)
S0, S1, S2, S3, S4 = (tl.constexpr(c) for c in PSI_COEFFS)
B0, B1, B2, B3, B4 = (tl.constexpr(c) for c in PSI_COEFFS_BASE2)


@triton.jit
def _exp(x):
    """e^x as 2^(x·log2 e). tl.exp2 compiles to one ex2.approx.ftz, so this is 2 SASS
    instructions (FMUL, MUFU.EX2) where tl.exp takes 5 (it wraps ex2 in a subnormal fix-up:
    a compare and two predicated multiplies). The streaming loops go further: they keep their
    exponents in base 2 (s = log2 e · r / T) and call tl.exp2 directly, one instruction per
    exponential. Results under 2^-126 flush to 0, far below the float32 resolution of every
    sum or gradient they enter."""
    return tl.exp2(x * LOG2E)


@triton.jit
def _f32(x):
    """A float scalar argument in float32, however the launcher typed it: torch's launcher
    passes a Python float as fp32, jax-triton 0.3 as fp64 (which would turn every product
    with it, and the loop-carried sums, into float64), and jax-triton specialises a value
    equal to 1 into a constexpr. A no-op for fp32."""
    return tl.cast(x, tl.float32)


@triton.jit
def _tanh_series(u):
    """Q(u) of tanh(x) = x + x·u·Q(u), u = x² below TANH_BOUND2 (kernels/softcap.py)."""
    return (((Q4 * u + Q3) * u + Q2) * u + Q1) * u + Q0


@triton.jit
def _tanh_exp(x):
    """tanh(x) from one exp, for |x| >= TANH_SERIES_BOUND (it cancels below; 1 at ±inf):
    sign(x)·(1 - e)/(1 + e), e = e^{-2|x|}."""
    e = _exp(-2.0 * tl.abs(x))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0, -t, t)


@triton.jit
def _sech2(x):
    """1 - tanh²(x) = 4e / (1 + e)², e = e^{-2|x|}: precise relative to itself for every x
    (0 at ±inf); 1 - th² from a rounded th is precise only to float32's absolute 6e-8."""
    e = _exp(-2.0 * tl.abs(x))
    return 4.0 * e / ((1.0 + e) * (1.0 + e))


@triton.jit
def _cap(z, softcap, inv_c):
    """c·tanh(z/c) (inv_c = 1/c), as the host computes it (``token_stats.formulas.softcap``): below
    the series bound z·(1 + u·Q(u)), so z itself to float32 where z/c underflows."""
    x = z * inv_c
    u = x * x
    return tl.where(u < TANH_BOUND2, z + z * (u * _tanh_series(u)), softcap * _tanh_exp(x))


@triton.jit
def _series(y):
    """S(y) = psi(y) / y² for |y| < PSI_SMALL, natural units (Horner's rule)."""
    return (((S4 * y + S3) * y + S2) * y + S1) * y + S0


@triton.jit
def _psi(y):
    """psi(y) = y - 1 + e^{-y} >= 0 in natural units, without cancellation for small |y|."""
    return tl.where(tl.abs(y) < PSI_SMALL_, y * y * _series(y), y - 1.0 + _exp(-y))


@triton.jit
def _teacher_at(a, au, cu, fu, f, g, h):
    """Teacher sums (cu, fu) of parts (lanes, splits) re-expressed at new maxima, natural
    units (dlm_kernels.token_stats.formulas.teacher_at): the student's exponents moved by δ
    (f = e^δ), the teacher's by δ_u (g = e^{δ_u}), and y = x_u - x by -h, h = δ - δ_u. A
    part with g = 0 adds no teacher mass, one with f = 0 its teacher's mass where the
    student's probability is 0."""
    live = g > 0
    cu_new = tl.where(live, g * (cu - h * au), 0.0)
    gap = cu - fu  # Σ e^{x_u} - e^x without cancellation (NaN for an infinite KL)
    near = live & (tl.abs(h) < PSI_SMALL_) & (gap - gap == 0)
    fu_near = g * (fu - h * gap + a * (h * h) * _series(-h))
    fu_far = tl.where(live, g * (fu - h * au - a), 0.0) + f * a
    return cu_new, tl.where(near, fu_near, fu_far)


@triton.jit
def _log1p(x):
    """log(1 + x) accurate for small |x| (Goldberg's correction of the rounded 1 + x)."""
    u = 1.0 + x
    return tl.where(u == 1.0, x, tl.log(u) * (x / tl.where(u == 1.0, 1.0, u - 1.0)))


@triton.jit
def _kl(a, au, cu, fu):
    """KL(q || p) >= 0 from a row's merged sums (dlm_kernels.token_stats.formulas.kl_divergence)."""
    e_far = tl.log(au) - tl.log(a)
    v = (cu - fu) / a
    near = (tl.abs(e_far) <= 1.0) & (tl.abs(v) < 2.0)
    e = tl.where(near, _log1p(v), e_far)
    kl = tl.where(near, fu / au - _psi(e), cu / au - e_far)
    return tl.where(kl < 0, 0.0, kl)


@triton.jit
def _shifted(z, cols, x, d, softcap, HAS_SOFTCAP: tl.constexpr, HAS_SHIFT: tl.constexpr):
    # r = cap(z) + d·[col == x]   (float32)
    r = z
    if HAS_SOFTCAP:
        r = _cap(z, softcap, 1.0 / softcap)
    if HAS_SHIFT:
        r = r + tl.where(cols == x, d, 0.0)
    return r


@triton.jit
def _row_span(active_ptr, x_ptr, d_ptr, col_offset_ptr, cols_per_split, K, vocab_limit,
              HAS_SHIFT: tl.constexpr, BLOCK_K: tl.constexpr):
    """This program's row and vocabulary split, as column bounds:

        k_start <= k_full <= k_valid <= k_end
        [k_start, k_full)   whole BLOCK_K blocks of real vocabulary: unmasked (vector) loads
        [k_full, k_valid)   the ragged rest of the real vocabulary: masked loads
        [k_valid, k_end)    padding columns (global id >= vocab_limit): never read

    k_valid = k_full = k_start for an inactive row, so its loops read nothing."""
    row = tl.program_id(0)
    is_active = tl.load(active_ptr + row) != 0
    col_offset = tl.load(col_offset_ptr)
    # cols_per_split is a multiple of BLOCK_K (launch_config); said here because jax-triton,
    # unlike torch's launcher, marks no integer argument as divisible by 16, and without it
    # no block would be known to start on a 16-byte boundary (no vector loads)
    k_start = tl.multiple_of(tl.program_id(1) * cols_per_split, BLOCK_K)
    k_end = tl.minimum(k_start + cols_per_split, K)
    k_valid = tl.maximum(tl.minimum(k_end, vocab_limit - col_offset), k_start)
    k_valid = tl.where(is_active, k_valid, k_start)
    k_full = k_start + (k_valid - k_start) // BLOCK_K * BLOCK_K
    x = 0
    d = 0.0
    if HAS_SHIFT:
        x = tl.load(x_ptr + row).to(tl.int32)
        d = tl.load(d_ptr + row).to(tl.float32)
    return row, is_active, col_offset, k_start, k_full, k_valid, k_end, x, d


@triton.jit
def _row_start(row, stride, ROWS_ALIGNED: tl.constexpr):
    """Offset (int64, elements) of a row's first element. ROWS_ALIGNED: the launcher found the
    stride a multiple of 16 elements (``rows_aligned``), which torch's launcher would also
    tell Triton by specialising the argument, but jax-triton does not; with the row start
    and the block start both known aligned, the unmasked loops load 16 bytes at a time."""
    start = row.to(tl.int64) * stride
    if ROWS_ALIGNED:
        start = tl.multiple_of(start, 16)
    return start


@triton.jit
def _online(m, v):
    """The per-lane running max of a block v [R, VEC] of logits folded into m [R]: (m_new,
    m_safe, d, shift) with d = v - m_safe [R, VEC] and shift = m - m_safe [R] (-inf for an
    empty old state), the logit differences every exponent of the block and the rescale of
    the old sums are formed from. Each lane is VEC contiguous columns held by one thread, so
    the reductions here never leave the thread."""
    m_new = tl.maximum(m, tl.max(v, axis=1))
    m_safe = tl.where(m_new == NEG_INF, 0.0, m_new)  # an all -inf prefix: no inf - inf
    return m_new, m_safe, v - m_safe[:, None], m - m_safe


@triton.jit
def _moved(f, delta, a, b):
    """f·(b + δ·a): a running Σ 2^x·x moved to a new maximum (x + δ), and exactly 0 where
    the rescale f = 2^δ is 0 (where δ·a may be -inf: columns masked with finfo.min)."""
    return tl.where(f > 0, f * (b + delta * a), 0.0)


@triton.jit
def _lane_shift(m):
    """(m_row, dm): the row's maximum of the per-lane maxima m [R] and each lane's difference
    to it (-inf for an empty lane), which moves the lane's exponents by dm·c (the one
    cross-thread reduction of a program)."""
    m_row = tl.max(m, axis=0)
    return m_row, m - tl.where(m_row == NEG_INF, 0.0, m_row)


@triton.jit
def fold_sums(r, m, a, b, c_t, HAS_ENTROPY: tl.constexpr):
    """Fold a block r [R, VEC] of (capped, shifted) logits, masked columns at -inf, into the
    per-lane running (m, a, b) [R]: m in logit units, a = Σ 2^x and b = Σ 2^x·x (base 2,
    x = (r - m)·c_t, c_t = log2 e / T; b stays 0 without HAS_ENTROPY). Returns (m, a, b)
    and what the other sums of ``_fold_block`` reuse: the differences dr = r - m_safe
    [R, VEC], the exponents xs and 2^xs, the old sums' rescale f and their move shift·c_t,
    the old a and the move of the maximum, shift [R]. The sampler's kernel
    (``kernels.triton.sampling``) folds its blocks with this function too, so its
    statistics are these sums, bit for bit."""
    m, m_safe, dr, shift = _online(m, r)
    xs = dr * c_t  # log2 e · (r - m) / T
    e = tl.exp2(xs)
    f = tl.exp2(shift * c_t)  # the old sums' rescale
    a_old = a
    a = a * f + tl.sum(e, axis=1)
    if HAS_ENTROPY:  # about a third of the CE loop's instructions (bench/NOTES.md)
        # b is kept relative to the running max: rescale the old sum, then add this block.
        b = _moved(f, shift * c_t, a_old, b) + tl.sum(tl.where(e > 0, e * xs, 0.0), axis=1)
    return m, a, b, dr, xs, e, f, a_old, shift


@triton.jit
def merge_lanes(m, a, b, c_t, HAS_ENTROPY: tl.constexpr):
    """The per-lane (m, a, b) [R] of ``fold_sums`` merged into the row's (docs/design.md
    §2's merge, within the row), b converted to natural units (· ln 2) as the partial buffer
    stores it; also returns each lane's move dm·c_t and rescale f for the other sums."""
    m_row, dm = _lane_shift(m)
    delta = dm * c_t
    f = tl.exp2(delta)
    a_row = tl.sum(f * a, axis=0)
    b_row = 0.0
    if HAS_ENTROPY:
        b_row = tl.sum(_moved(f, delta, a, b), axis=0)
    return m_row, a_row, b_row * LN2, dm, delta, f


@triton.jit
def _fold_block(z_row, u_row, cols, k_valid, col_offset, x, d, c_t, c_ce, c_kl,
                softcap, m, a, b, a2, mu, au, cu, fu, sr, MASKED: tl.constexpr,
                HAS_SOFTCAP: tl.constexpr, HAS_SHIFT: tl.constexpr, HAS_TEACHER: tl.constexpr,
                SEPARATE_CE: tl.constexpr, HAS_ENTROPY: tl.constexpr, SMOOTH: tl.constexpr):
    """Fold the columns ``cols`` [R, VEC] of one row into the 9 running per-lane sums [R]:
    maxima m, mu in logit units, sums in base-2 units (exponents (r - m)·c_t, c_* =
    log2 e / T_*; b stays 0 without HAS_ENTROPY) but for the KL's cu and fu, natural, and
    Σ r in logit units (stays 0 without SMOOTH) (PARTIAL_STATE)."""
    mask = cols < k_valid
    gcols = cols + col_offset  # global vocabulary ids (a shard starts at col_offset)
    # read BLOCK_K·E bytes of student logits
    if MASKED:
        z = tl.load(z_row + cols, mask=mask, other=0.0).to(tl.float32)
    else:
        z = tl.load(z_row + cols).to(tl.float32)
    r = _shifted(z, gcols, x, d, softcap, HAS_SOFTCAP, HAS_SHIFT)
    if SMOOTH:  # label smoothing: Σ r over the valid columns
        if MASKED:
            sr += tl.sum(tl.where(mask, r, 0.0), axis=1)
        else:
            sr += tl.sum(r, axis=1)
    if MASKED:
        r = tl.where(mask, r, NEG_INF)
    m, a, b, dr, xs, e, f, a_old, shift = fold_sums(r, m, a, b, c_t, HAS_ENTROPY)
    if SEPARATE_CE:  # the same maximum, exponents (r - m)·c_ce
        a2 = a2 * tl.exp2(shift * c_ce) + tl.sum(tl.exp2(dr * c_ce), axis=1)
    if HAS_TEACHER:
        # read BLOCK_K·E bytes of teacher logits
        if MASKED:
            u = tl.load(u_row + cols, mask=mask, other=0.0).to(tl.float32)
            u = tl.where(mask, u, NEG_INF)
        else:
            u = tl.load(u_row + cols).to(tl.float32)
        mu, mu_safe, du, shift_u = _online(mu, u)
        xu = du * c_kl
        eu = tl.exp2(xu)
        g = tl.exp2(shift_u * c_kl)
        # the old (cu, fu) at the new maxima (y = x_u - x moves by δ_u - δ, natural units),
        # then this block's terms (token_stats.formulas.teacher_sums): y2 = xu - xs in base 2;
        # e^{x_u}·psi(y) by its series where |y| is small
        h = (shift * c_t - shift_u * c_kl) * LN2
        cu, fu = _teacher_at(a_old, au, cu, fu, f, g, h)
        y2 = xu - xs
        ct = tl.where(eu > 0, eu * y2, 0.0)  # (y2 may be ±inf or NaN where q = 0)
        series = ct * y2 * ((((B4 * y2 + B3) * y2 + B2) * y2 + B1) * y2 + B0)
        fk = tl.where(tl.abs(y2) < PSI_SMALL2, series, ct * LN2 + (e - eu))
        cu += tl.sum(ct, axis=1) * LN2
        fu += tl.sum(fk, axis=1)
        au = au * g + tl.sum(eu, axis=1)
    return m, a, b, a2, mu, au, cu, fu, sr


@triton.jit
def stats_partial_kernel(
    z_ptr,  # [N, K] student logits, row stride stride_z
    u_ptr,  # [N, K] teacher logits, row stride stride_u (unused without HAS_TEACHER)
    x_ptr,  # [N] int shift column (HAS_SHIFT)
    d_ptr,  # [N] f32 shift value (HAS_SHIFT)
    active_ptr,  # [N] int8, row is active when != 0
    col_offset_ptr,  # int32, element 0: global id of column 0 (memory: traced under shard_map)
    N, K, stride_z, stride_u, cols_per_split,
    vocab_limit,  # global ids >= vocab_limit are padding
    inv_t, inv_t_ce, inv_t_kl, softcap,
    part_ptr,  # [8, S, N] f32 out ([9, S, N] with SMOOTH)
    HAS_SOFTCAP: tl.constexpr, HAS_SHIFT: tl.constexpr, HAS_TEACHER: tl.constexpr,
    SEPARATE_CE: tl.constexpr, HAS_ENTROPY: tl.constexpr, BLOCK_K: tl.constexpr,
    VEC: tl.constexpr, ROWS_ALIGNED: tl.constexpr, SMOOTH: tl.constexpr = False,
):
    row, is_active, col_offset, k_start, k_full, k_valid, k_end, x, d = _row_span(
        active_ptr, x_ptr, d_ptr, col_offset_ptr, cols_per_split, K, vocab_limit, HAS_SHIFT,
        BLOCK_K)
    inv_t, inv_t_ce, inv_t_kl = _f32(inv_t), _f32(inv_t_ce), _f32(inv_t_kl)
    softcap = _f32(softcap)
    split = tl.program_id(1)
    n_splits = tl.num_programs(1)
    z_row = z_ptr + _row_start(row, stride_z, ROWS_ALIGNED)
    u_row = u_ptr + _row_start(row, stride_u, ROWS_ALIGNED)

    # A block is R lanes of VEC contiguous columns (one 16-byte load each); every lane keeps
    # its own running sums, so the loops carry no cross-thread reduction; the lanes merge once
    # at the end.
    # The sums are in base 2: exponents (r - m)·c_t with c_t = log2 e / T, so every
    # exponential is one exp2 (the scale rides on the one multiply by 1/T every difference
    # needs anyway). Sums of 2^x equal the natural Σ e^{·}; the b sum (linear in x) converts
    # to natural units once per program, by a factor ln 2, before it is stored (the KL's cu
    # and fu are kept in natural units).
    c_t, c_ce, c_kl = inv_t * LOG2E, inv_t_ce * LOG2E, inv_t_kl * LOG2E
    R: tl.constexpr = BLOCK_K // VEC
    offs = tl.arange(0, R)[:, None] * VEC + tl.arange(0, VEC)[None, :]  # [R, VEC]
    m = tl.full([R], NEG_INF, tl.float32)  # running max of r (logit units)
    a = tl.zeros([R], tl.float32)  # Σ 2^x, x = (r - m)·c_t
    b = tl.zeros([R], tl.float32)  # Σ 2^x·x   (HAS_ENTROPY)
    a2 = tl.zeros([R], tl.float32)  # Σ 2^{(r - m)·c_ce}   (SEPARATE_CE)
    mu = tl.full([R], NEG_INF, tl.float32)  # running max of u (HAS_TEACHER)
    au = tl.zeros([R], tl.float32)  # Σ 2^xu, xu = (u - mu)·c_kl
    cu = tl.zeros([R], tl.float32)  # Σ 2^xu·y, y = (xu - x)·ln 2 (natural units)
    fu = tl.zeros([R], tl.float32)  # Σ 2^xu·psi(y)
    sr = tl.zeros([R], tl.float32)  # Σ r, logit units   (SMOOTH)
    for k0 in range(k_start, k_full, BLOCK_K):  # whole blocks: no masks
        m, a, b, a2, mu, au, cu, fu, sr = _fold_block(
            z_row, u_row, k0 + offs, k_valid, col_offset, x, d, c_t, c_ce, c_kl, softcap,
            m, a, b, a2, mu, au, cu, fu, sr, False, HAS_SOFTCAP, HAS_SHIFT, HAS_TEACHER,
            SEPARATE_CE, HAS_ENTROPY, SMOOTH)
    for k0 in range(k_full, k_valid, BLOCK_K):  # the ragged tail: at most one block
        m, a, b, a2, mu, au, cu, fu, sr = _fold_block(
            z_row, u_row, k0 + offs, k_valid, col_offset, x, d, c_t, c_ce, c_kl, softcap,
            m, a, b, a2, mu, au, cu, fu, sr, True, HAS_SOFTCAP, HAS_SHIFT, HAS_TEACHER,
            SEPARATE_CE, HAS_ENTROPY, SMOOTH)

    # merge the lanes (docs/design.md §2's merge, within the row)
    m_row, a_row, b_row, dm, delta, f = merge_lanes(m, a, b, c_t, HAS_ENTROPY)
    a2_row = a_row
    if SEPARATE_CE:
        a2_row = tl.sum(tl.exp2(dm * c_ce) * a2, axis=0)
    mu_row, dmu = _lane_shift(mu)
    delta_u = dmu * c_kl
    g = tl.exp2(delta_u)
    au_row = tl.sum(g * au, axis=0)
    cu_row = 0.0
    fu_row = 0.0
    if HAS_TEACHER:
        cu, fu = _teacher_at(a, au, cu, fu, f, g, (delta - delta_u) * LN2)
        cu_row = tl.sum(cu, axis=0)
        fu_row = tl.sum(fu, axis=0)

    # write 8 x 4 bytes of partial state: maxima in logit units, sums in natural units
    base = part_ptr + split * N + row
    stride_p = n_splits * N
    tl.store(base + P_M * stride_p, m_row)
    tl.store(base + P_A * stride_p, a_row)
    tl.store(base + P_B * stride_p, b_row)
    tl.store(base + P_A2 * stride_p, a2_row)
    tl.store(base + P_MU * stride_p, mu_row)
    tl.store(base + P_AU * stride_p, au_row)
    tl.store(base + P_CU * stride_p, cu_row)
    tl.store(base + P_FU * stride_p, fu_row)
    if SMOOTH:
        tl.store(base + P_SR * stride_p, tl.sum(sr, axis=0))


@triton.jit
def _merged_max(plane_ptr, rows, rmask, N, S, BLOCK_N: tl.constexpr):
    """The maximum [BLOCK_N] over the S splits of a plane [S, N] of partial maxima (logit
    units; -inf for a row with no columns). A maximum is exact in any order."""
    m = tl.full([BLOCK_N], NEG_INF, tl.float32)
    for s in range(0, S):
        m = tl.maximum(m, tl.load(plane_ptr + s * N + rows, mask=rmask, other=NEG_INF))
    return m


@triton.jit
def stats_finalize_kernel(
    part_ptr,  # [8, S, N] f32 partial states (PARTIAL_STATE)
    z_ptr,  # [N, K] student logits (the target column only is read)
    y_ptr,  # [N] int targets
    x_ptr, d_ptr,  # [N] shift column / value (HAS_SHIFT)
    active_ptr,  # [N] int8
    N, K, S, stride_z, inv_t, inv_t_ce, inv_t_kl, softcap,
    out_ptr,  # [10, N] f32 out: lse, logp, entropy (0 without HAS_ENTROPY), kl, kl_shift,
              # m, la, la_ce, mu, la_u; with SMOOTH [11, N], Σ r last
    HAS_SOFTCAP: tl.constexpr, HAS_SHIFT: tl.constexpr, HAS_TEACHER: tl.constexpr,
    SEPARATE_CE: tl.constexpr, HAS_ENTROPY: tl.constexpr, BLOCK_N: tl.constexpr,
    SMOOTH: tl.constexpr = False,
):
    """One row a thread: the S partial states merged split by split, s = 0, 1, ..., in
    plain per-row float32 arithmetic. No sum here crosses threads, so a row's bits depend
    neither on the rows beside it nor on how the compiler lays out a tile: Triton
    specialises N (a constexpr 1 for a lone row, divisibility by 16), and a [splits, rows]
    tile summed with tl.sum along the splits was laid out, and so summed in another order,
    for N = 1, N = 23 and N = 32 (docs/design.md §2, "One row, one answer")."""
    inv_t, inv_t_ce, inv_t_kl = _f32(inv_t), _f32(inv_t_ce), _f32(inv_t_kl)
    softcap = _f32(softcap)
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < N
    stride_p = S * N  # one plane of partial state: [S, N]

    # pass 1: the merged maxima (read 4·S bytes per row, 8·S with a teacher)
    m = _merged_max(part_ptr + P_M * stride_p, rows, rmask, N, S, BLOCK_N)
    m_safe = tl.where(m == NEG_INF, 0.0, m)
    mu = tl.zeros([BLOCK_N], dtype=tl.float32)
    mu_safe = mu
    if HAS_TEACHER:
        mu = _merged_max(part_ptr + P_MU * stride_p, rows, rmask, N, S, BLOCK_N)
        mu_safe = tl.where(mu == NEG_INF, 0.0, mu)

    # pass 2: the sums, moved to the merged maxima and added in split order (read the other
    # 4·S·4 bytes per row: m, a, b, a2 and with a teacher 4 more planes)
    a = tl.zeros([BLOCK_N], dtype=tl.float32)  # Σ e^x
    b = tl.zeros([BLOCK_N], dtype=tl.float32)  # Σ e^x·x (HAS_ENTROPY)
    a2 = tl.zeros([BLOCK_N], dtype=tl.float32)  # Σ e^{x_ce} (SEPARATE_CE)
    au = tl.zeros([BLOCK_N], dtype=tl.float32)  # Σ e^{x_u}
    cu = tl.zeros([BLOCK_N], dtype=tl.float32)
    fu = tl.zeros([BLOCK_N], dtype=tl.float32)
    sr = tl.zeros([BLOCK_N], dtype=tl.float32)  # Σ r (SMOOTH)
    for s in range(0, S):
        at = part_ptr + s * N + rows
        m_s = tl.load(at + P_M * stride_p, mask=rmask, other=NEG_INF)
        a_s = tl.load(at + P_A * stride_p, mask=rmask, other=0.0)
        dm = m_s - m_safe  # -inf for an empty split
        delta = dm * inv_t  # the split's exponents move by delta
        f = _exp(delta)  # 0 for an empty split, or one whose logits are all far below m
        a += f * a_s
        if HAS_ENTROPY:
            b += _moved(f, delta, a_s, tl.load(at + P_B * stride_p, mask=rmask, other=0.0))
        if SEPARATE_CE:
            a2 += _exp(dm * inv_t_ce) * tl.load(at + P_A2 * stride_p, mask=rmask, other=0.0)
        if HAS_TEACHER:
            mu_s = tl.load(at + P_MU * stride_p, mask=rmask, other=NEG_INF)
            au_s = tl.load(at + P_AU * stride_p, mask=rmask, other=0.0)
            cu_s = tl.load(at + P_CU * stride_p, mask=rmask, other=0.0)
            fu_s = tl.load(at + P_FU * stride_p, mask=rmask, other=0.0)
            delta_u = (mu_s - mu_safe) * inv_t_kl
            g = _exp(delta_u)
            au += g * au_s
            # the split's (cu, fu) at the merged maxima: y = x_u - x moves by delta_u - delta
            cu_s, fu_s = _teacher_at(a_s, au_s, cu_s, fu_s, f, g, delta - delta_u)
            cu += cu_s
            fu += fu_s
        if SMOOTH:  # label smoothing's Σ r: a plain sum over the splits
            sr += tl.load(at + P_SR * stride_p, mask=rmask, other=0.0)
    la = tl.log(a)
    lse = m * inv_t + la
    entropy = tl.zeros([BLOCK_N], dtype=tl.float32)
    if HAS_ENTROPY:
        entropy = la - b / a
    la_ce = la
    if SEPARATE_CE:
        la_ce = tl.log(a2)
    kl = tl.zeros([BLOCK_N], dtype=tl.float32)
    la_u = tl.zeros([BLOCK_N], dtype=tl.float32)
    kl_shift = tl.zeros([BLOCK_N], dtype=tl.float32)
    if HAS_TEACHER:
        la_u = tl.log(au)
        kl_shift = cu / au  # E_q[x_u - x]
        kl = _kl(a, au, cu, fu)
        kl = tl.where(lse - lse == 0, kl, float("nan"))  # no distribution p: no KL

    # the target logit: read E bytes per active row
    is_active = (tl.load(active_ptr + rows, mask=rmask, other=0) != 0) & rmask
    y = tl.load(y_ptr + rows, mask=rmask, other=0).to(tl.int64)
    y_ok = (y >= 0) & (y < K)
    zy = tl.load(z_ptr + rows.to(tl.int64) * stride_z + y, mask=is_active & y_ok, other=0.0)
    x = tl.zeros([BLOCK_N], dtype=tl.int64)
    d = tl.zeros([BLOCK_N], dtype=tl.float32)
    if HAS_SHIFT:
        x = tl.load(x_ptr + rows, mask=rmask, other=0).to(tl.int64)
        d = tl.load(d_ptr + rows, mask=rmask, other=0.0).to(tl.float32)
    r_y = _shifted(zy.to(tl.float32), y, x, d, softcap, HAS_SOFTCAP, HAS_SHIFT)
    logp = tl.where(y_ok, (r_y - m) * inv_t_ce - la_ce, float("nan"))

    # write 10 x 4 bytes per row; inactive rows are exact zeros
    tl.store(out_ptr + S_LSE * N + rows, tl.where(is_active, lse, 0.0), mask=rmask)
    tl.store(out_ptr + S_LOGP * N + rows, tl.where(is_active, logp, 0.0), mask=rmask)
    tl.store(out_ptr + S_ENTROPY * N + rows, tl.where(is_active, entropy, 0.0), mask=rmask)
    tl.store(out_ptr + S_KL * N + rows, tl.where(is_active, kl, 0.0), mask=rmask)
    tl.store(out_ptr + S_KL_SHIFT * N + rows, tl.where(is_active, kl_shift, 0.0), mask=rmask)
    tl.store(out_ptr + S_M * N + rows, tl.where(is_active, m, 0.0), mask=rmask)
    tl.store(out_ptr + S_LA * N + rows, tl.where(is_active, la, 0.0), mask=rmask)
    tl.store(out_ptr + S_LA_CE * N + rows, tl.where(is_active, la_ce, 0.0), mask=rmask)
    tl.store(out_ptr + S_MU * N + rows, tl.where(is_active, mu, 0.0), mask=rmask)
    tl.store(out_ptr + S_LA_U * N + rows, tl.where(is_active, la_u, 0.0), mask=rmask)
    if SMOOTH:
        tl.store(out_ptr + N_ROW_STATS * N + rows, sr, mask=rmask)


@triton.jit
def _grad_block(rows, cols, k_valid, k_end, col_offset, x, d, y, row_stats, g_lse, g_lp, g_h,
                g_kl, ce, inv_t, inv_t_ce, inv_t_kl, softcap, MASKED: tl.constexpr,
                HAS_SOFTCAP: tl.constexpr, HAS_SHIFT: tl.constexpr, HAS_TEACHER: tl.constexpr,
                SEPARATE_CE: tl.constexpr, TEACHER_GRAD: tl.constexpr,
                HAS_ENTROPY: tl.constexpr, CE_TERMS: tl.constexpr):
    """d(logits) (and d(teacher)) of the columns ``cols`` [BLOCK_K] of one row. Masked:
    columns in [k_valid, k_end) (padding; every column of an inactive row) are not read and
    get exact zeros; columns >= k_end belong to the next split. With CE_TERMS the CE term's
    gradient is ce = (g_y, g_u, g_p) (already over T_ce) instead of g_lp·(onehot - p')/T_ce."""
    z_row, u_row, dz_row, du_row = rows
    m, la2, entropy, la2_ce, mu, la2_u, kl_shift = row_stats  # la* in base 2 (· log2 e)
    keep = cols < k_valid
    in_split = cols < k_end
    gcols = cols + col_offset  # global vocabulary ids
    # read BLOCK_K·E bytes of student logits
    if MASKED:
        z = tl.load(z_row + cols, mask=keep, other=0.0).to(tl.float32)
    else:
        z = tl.load(z_row + cols).to(tl.float32)
    r = _shifted(z, gcols, x, d, softcap, HAS_SOFTCAP, HAS_SHIFT)
    dr = r - m  # logit differences: log2 p = (r - m)·log2 e / T - la2, one exp2
    xs = dr * (inv_t * LOG2E)
    log2p = xs - la2
    p = tl.exp2(log2p)
    coef = g_lse
    if HAS_ENTROPY:  # (without it g_h is the cotangent of nothing)
        coef = g_lse - g_h * tl.where(p > 0, log2p * LN2 + entropy, 0.0)
    ds = coef * p
    if HAS_TEACHER:
        # read BLOCK_K·E bytes of teacher logits
        if MASKED:
            u = tl.load(u_row + cols, mask=keep, other=0.0).to(tl.float32)
        else:
            u = tl.load(u_row + cols).to(tl.float32)
        xu = (u - mu) * (inv_t_kl * LOG2E)
        q = tl.exp2(xu - la2_u)
        ds += g_kl * (p - q)  # float32 p - q: no bf16 cancellation
        if TEACHER_GRAD:
            # log q - log p - kl = (xu - xs)·ln 2 - E_q[x_u - x]: no cancellation of
            # log-normalisers
            du = g_kl * tl.where(q > 0, q * ((xu - xs) * LN2 - kl_shift), 0.0) * inv_t_kl
            # write BLOCK_K·E bytes of teacher gradient
            if MASKED:
                du = tl.where(keep, du, 0.0)
                tl.store(du_row + cols, du.to(du_row.dtype.element_ty), mask=in_split)
            else:
                tl.store(du_row + cols, du.to(du_row.dtype.element_ty))
    p_ce = p
    if SEPARATE_CE:
        p_ce = tl.exp2(dr * (inv_t_ce * LOG2E) - la2_ce)
    onehot = tl.where(gcols == y, 1.0, 0.0)
    if CE_TERMS:  # label smoothing / z-loss: g_y·onehot + g_u (valid columns) - g_p·p'
        g_y, g_u, g_p = ce
        g = ds * inv_t + (g_y * onehot + g_u - g_p * p_ce)
    else:
        g = ds * inv_t + g_lp * (onehot - p_ce) * inv_t_ce
    if HAS_SOFTCAP:
        g = g * _sech2(z * (1.0 / softcap))
    # write BLOCK_K·E bytes of gradient
    if MASKED:
        dz = tl.where(keep, g, 0.0)
        tl.store(dz_row + cols, dz.to(dz_row.dtype.element_ty), mask=in_split)
    else:
        tl.store(dz_row + cols, g.to(dz_row.dtype.element_ty))


@triton.jit
def stats_grad_kernel(
    z_ptr,  # [N, K] student logits
    u_ptr,  # [N, K] teacher logits (HAS_TEACHER)
    y_ptr,  # [N] int targets
    x_ptr, d_ptr,  # [N] shift column / value (HAS_SHIFT)
    active_ptr,  # [N] int8
    stats_ptr,  # [10, N] f32 saved statistics (ROW_STATS: lse, ..., m, la, la_ce, mu, la_u)
    g_lse_ptr, g_lp_ptr, g_h_ptr, g_kl_ptr,  # [N] f32 cotangents (g_lp: [3, N], CE_TERMS)
    col_offset_ptr,  # int32, element 0: global id of column 0
    N, K, stride_z, stride_u, stride_dz, stride_du, cols_per_split,
    vocab_limit,  # global ids >= vocab_limit get 0
    inv_t, inv_t_ce, inv_t_kl, softcap,
    dz_ptr,  # [N, K] out, z's dtype (may alias z_ptr: every element is read before written)
    du_ptr,  # [N, K] out, u's dtype (TEACHER_GRAD)
    HAS_SOFTCAP: tl.constexpr, HAS_SHIFT: tl.constexpr, HAS_TEACHER: tl.constexpr,
    SEPARATE_CE: tl.constexpr, TEACHER_GRAD: tl.constexpr, HAS_ENTROPY: tl.constexpr,
    BLOCK_K: tl.constexpr, ROWS_ALIGNED: tl.constexpr, CE_TERMS: tl.constexpr = False,
):
    row, is_active, col_offset, k_start, k_full, k_valid, k_end, x, d = _row_span(
        active_ptr, x_ptr, d_ptr, col_offset_ptr, cols_per_split, K, vocab_limit, HAS_SHIFT,
        BLOCK_K)
    inv_t, inv_t_ce, inv_t_kl = _f32(inv_t), _f32(inv_t_ce), _f32(inv_t_kl)
    softcap = _f32(softcap)
    # cotangents are zeroed for inactive rows, so their gradient is exactly 0
    g_lse = tl.where(is_active, tl.load(g_lse_ptr + row), 0.0)
    g_lp = tl.where(is_active, tl.load(g_lp_ptr + row), 0.0)
    g_h = tl.where(is_active, tl.load(g_h_ptr + row), 0.0)
    g_kl = tl.where(is_active, tl.load(g_kl_ptr + row), 0.0)
    ce = (0.0, 0.0, 0.0)
    if CE_TERMS:  # the CE term's per-row coefficients (g_y, g_u, g_p): g_lp_ptr is [3, N]
        ce = (g_lp, tl.where(is_active, tl.load(g_lp_ptr + N + row), 0.0),
              tl.where(is_active, tl.load(g_lp_ptr + 2 * N + row), 0.0))
    # saved statistics this launch uses: the maxima m, mu (logit units) and the log-sums la,
    # la_ce, la_u in base 2 (· log2 e; of size log K at most, so exact enough in any base)
    m = tl.load(stats_ptr + S_M * N + row)
    la2 = tl.load(stats_ptr + S_LA * N + row) * LOG2E
    entropy = 0.0
    if HAS_ENTROPY:
        entropy = tl.load(stats_ptr + S_ENTROPY * N + row)
    la2_ce = la2
    if SEPARATE_CE:
        la2_ce = tl.load(stats_ptr + S_LA_CE * N + row) * LOG2E
    mu = 0.0
    la2_u = 0.0
    kl_shift = 0.0
    if HAS_TEACHER:
        mu = tl.load(stats_ptr + S_MU * N + row)
        la2_u = tl.load(stats_ptr + S_LA_U * N + row) * LOG2E
        kl_shift = tl.load(stats_ptr + S_KL_SHIFT * N + row)
    row_stats = (m, la2, entropy, la2_ce, mu, la2_u, kl_shift)
    y = tl.load(y_ptr + row).to(tl.int32)
    rows = (z_ptr + _row_start(row, stride_z, ROWS_ALIGNED),
            u_ptr + _row_start(row, stride_u, ROWS_ALIGNED),
            dz_ptr + _row_start(row, stride_dz, ROWS_ALIGNED),
            du_ptr + _row_start(row, stride_du, ROWS_ALIGNED))

    offs = tl.arange(0, BLOCK_K)
    for k0 in range(k_start, k_full, BLOCK_K):  # whole blocks of real vocabulary: no masks
        _grad_block(rows, k0 + offs, k_valid, k_end, col_offset, x, d, y, row_stats,
                    g_lse, g_lp, g_h, g_kl, ce, inv_t, inv_t_ce, inv_t_kl, softcap, False,
                    HAS_SOFTCAP, HAS_SHIFT, HAS_TEACHER, SEPARATE_CE, TEACHER_GRAD, HAS_ENTROPY,
                    CE_TERMS)
    for k0 in range(k_full, k_end, BLOCK_K):  # ragged tail, padding, inactive rows' zeros
        _grad_block(rows, k0 + offs, k_valid, k_end, col_offset, x, d, y, row_stats,
                    g_lse, g_lp, g_h, g_kl, ce, inv_t, inv_t_ce, inv_t_kl, softcap, True,
                    HAS_SOFTCAP, HAS_SHIFT, HAS_TEACHER, SEPARATE_CE, TEACHER_GRAD, HAS_ENTROPY,
                    CE_TERMS)


# -- launch configuration ---------------------------------------------------------------

def _next_pow2(v):
    return 1 << max(0, int(v) - 1).bit_length()


#: Blocks of BLOCK_K columns in one vocabulary split (the split-K ranges of the partial and
#: gradient kernels), and the most splits a row is cut into (8·64·4 bytes of partial state a
#: row, 0.1 % of its logits at K = 262144): past 64·4 blocks a split takes more blocks.
BLOCKS_PER_SPLIT = 4
MAX_SPLITS = 64


def launch_config(vocab, elem_bytes, has_teacher, block_k=None):
    """Block size, warps, stages and split-K plan for rows of ``vocab`` columns (no
    autotuning). A function of K, the logits' dtype, the features and the block asked for
    alone, never of the number of rows: the split ranges decide in which order a row's terms
    are summed (each split streams its own running sums, which the finalize kernel merges
    split by split), so a plan chosen from N would give a row other bits alone than in a
    batch (docs/design.md §2, "One row, one answer").

    BLOCK_K: 8 KiB of logits per block iteration per program (4096 bf16/fp16 or 2048 f32
    columns), never above next_pow2(K), as lanes of VEC = 16 bytes: one vector load each in
    the unmasked whole-block loops. num_warps: each thread holds 32 bytes of a block (8 warps
    at 8 KiB; two lanes per thread). The partial kernel keeps running sums per lane, so its
    loop has no cross-thread reduction and its cost per logit does not depend on the warps;
    more lanes per thread only add registers (bench/NOTES.md has the sm_90 numbers). With
    every feature on, ptxas reports no spills (tests/aot_probe.py).

    Split-K: each row's vocabulary is cut into S contiguous ranges of BLOCKS_PER_SPLIT whole
    blocks (more where K would need over MAX_SPLITS), the grid is (N, S), and the finalize
    kernel merges the S partial states (docs/design.md §2). So a lone row still spreads over
    S programs (K = 262144 in bf16: 64 blocks, S = 16), and a large batch gets N·S programs
    of 32 KiB of logits each. Bytes of the partial states per row: 8·S·4 written by the
    partial kernel and read by the finalize kernel (9·S·4 with label smoothing), 512 B each
    way at S = 16 (1 KiB for float32 logits at S = 32), against the K·E = 512 KiB (1 MiB) of
    logits the row reads: 0.1 %; at N = 16384 that is 8 MiB each way, beside 8.6 GB of
    logits. The sampler's top-k slots grow with S too: 8·k·S bytes a row. The gradient
    kernel takes the same ranges (its values do not depend on them: it has no sum across
    columns).
    Returns dict(block_k, vec, num_warps, num_stages, splits, cols_per_split).
    """
    if block_k is None:
        block_k = 8192 // elem_bytes
    block_k = max(16, min(_next_pow2(block_k) if block_k & (block_k - 1) else block_k,
                          _next_pow2(vocab)))
    num_warps = max(1, min(16, block_k * elem_bytes // 1024))  # 32 bytes per thread
    blocks = max(1, -(-vocab // block_k))
    per_split = max(BLOCKS_PER_SPLIT, -(-blocks // MAX_SPLITS))
    cols_per_split = per_split * block_k
    splits = max(1, -(-vocab // cols_per_split))
    return dict(block_k=block_k, vec=max(1, min(16 // elem_bytes, block_k)),
                num_warps=num_warps, num_stages=2, splits=splits, cols_per_split=cols_per_split)


def rows_aligned(*strides):
    """ROWS_ALIGNED of the streaming kernels: every row stride (elements) is a multiple of 16,
    so with 16-byte aligned buffers every row starts on a 16-byte boundary."""
    return all(s % 16 == 0 for s in strides)


#: Rows of one finalize program: one row a thread at FINALIZE_WARPS warps (the kernel
#: holds a row's running sums, not its S states, so any split count fits in registers).
FINALIZE_WARPS = 4
FINALIZE_ROWS = 32 * FINALIZE_WARPS
