"""The token-statistics math of docs/design.md §2, written once over an array namespace.

Every function takes ``xp``, a small adapter (``dlm_kernels.torch._ops.TorchOps`` or
``dlm_kernels.jax._ops.JaxOps``) that maps the handful of operations whose spelling
differs between torch and jax.numpy. The chunked backends of both frameworks loop over
vocabulary chunks with :func:`chunk_partial` / :func:`merge` / :func:`finalize` in the
forward pass and :func:`chunk_grads` in the backward pass; the reference backend uses
:func:`reference_stats` under the framework's own autodiff.

Notation (per row): ``z`` student logits, ``r = cap(z) + d·[k == x]`` the shifted logits,
``s = r / T``, ``p = softmax(s)``; ``s' = r / T_ce`` for the ``logp`` term;
``t = u / T_kl`` and ``q = softmax(t)`` for the teacher. All math is float32.

The streaming state of a row is ``(m, a, b, m2, a2, mu, au, cu, fu)``:
  m, a, b     running max of s, Σ e^{s-m}, Σ e^{s-m}(s-m)  (b relative to m: no cancellation
              between lse and Σ p s in the entropy; b = 0 when cfg.entropy is False)
  m2, a2      the same max and sum for s' (only when T_ce != T)
  mu, au      running max of t, Σ e^{t-mu}   (teacher)
  cu, fu      Σ e^{t-mu}·y and Σ e^{t-mu}·psi(y) with y = (t - mu) - (s - m), the log-ratio
              log(q/p) up to a constant, and psi(y) = y - 1 + e^{-y} >= 0 (kernels/series.py):
              the KL without cancellation (docs/design.md §2, "The KL")
Parts are merged at the larger maxima; a part whose rescale factor e^{m_i - m} is 0 (its
logits all so far below the others that their probabilities are 0 in float32, such as
columns masked with finfo.min) adds exactly nothing.
"""

from __future__ import annotations

from typing import NamedTuple

from ._config import StatsConfig
from ._linear_head import VOCAB_MAJOR, is_head
from ._rows import Rows
from .kernels.layout import PARTIAL_STATE, ROW_STATS
from .kernels.series import PSI_COEFFS, PSI_SMALL

NEG_INF = float("-inf")


# Field names and order come from the kernels' buffer layout (kernels/layout.py), so the
# host's tuples and the kernels' buffers cannot drift apart.
State = NamedTuple("State", [(field, object) for field in PARTIAL_STATE])
State.__doc__ = "The streaming state of each row (module docstring), every field [N] float32."


def shifted_logits(xp, z, col_ids, shift_ids, shift, cfg: StatsConfig):
    """r = cap(z) + d·[k == x].

    z: [N, C] any float dtype; col_ids: the column id of each entry, broadcastable to
    [N, C] ([1, C] for a chunk, [N, 1] for a gathered column) -> [N, C] float32.
    """
    r = _capped(xp, z, cfg)
    if shift_ids is not None:
        r = r + xp.where(col_ids == shift_ids[:, None], shift[:, None], 0.0)
    return r


def chunk_logits(xp, z, col0, shift_ids, shift, cfg: StatsConfig):
    """r = cap(z) + d·[k == x] of a chunk of contiguous columns whose first global id is
    ``col0``: the same values as ``shifted_logits``, but the shift lands at one column per
    row instead of a compare and a select over [N, C] (in torch those took about half of a
    LOO CE forward at N 512, K 32768 on a CPU). z: [N, C] -> [N, C] float32."""
    r = _capped(xp, z, cfg)
    if shift_ids is not None:
        r = _add_at(xp, xp.owned(r, z), shift_ids, col0, shift)
    return r


def _capped(xp, z, cfg: StatsConfig):
    """cap(z) in float32 (z itself when it is float32 and there is no softcap)."""
    r = xp.f32(z)
    if cfg.softcap is not None:
        r = xp.tanh(r * (1.0 / cfg.softcap)) * cfg.softcap
    return r


def _add_at(xp, x, ids, col0, vals):
    """x [N, C] + vals [N] at column ``ids - col0`` of each row whose id is in this chunk of
    contiguous columns (x is a temporary: torch updates it in place)."""
    local = ids - col0
    hit = (local >= 0) & (local < x.shape[1])
    return xp.add_at_cols(x, xp.where(hit, local, 0), xp.where(hit, vals, 0.0))


def _scaled(x, temperature):
    """x / T (x itself at T = 1: one [N, C] pass less in eager frameworks, same values)."""
    return x if temperature == 1.0 else x * (1.0 / temperature)


def _safe(xp, m):
    """A running max with -inf (no finite entry yet) replaced by 0, so that no inf - inf forms."""
    return xp.where(m == NEG_INF, 0.0, m)


def _row_lse_terms(xp, s, with_b=True):
    """(m, a, b, d, e) of s: [N, C]: the chunk max, Σ e^{s-m} and (with_b) Σ e^{s-m}(s-m),
    else 0, over the last axis, and the [N, C] d = s - m and e = e^d they came from."""
    m = xp.rowmax(s)
    d = s - _safe(xp, m)[:, None]  # [N, C], shared by e and b (one pass less in eager frameworks)
    e = xp.exp(d)
    a = xp.rowsum(e)
    if not with_b:
        return m, a, xp.zeros_like(a), d, e
    b = xp.rowsum(xp.where(e > 0, e * d, 0.0))
    return m, a, b, d, e


def _row_lse_parts(xp, s, with_b=True):
    """Chunk max, Σ e^{s-m} and (with_b) Σ e^{s-m}(s-m), else 0, over the last axis of
    s: [N, C]."""
    return _row_lse_terms(xp, s, with_b)[:3]


def _psi_series(y):
    """S(y) = psi(y) / y² for |y| < PSI_SMALL (kernels/series.py), by Horner's rule."""
    acc = PSI_COEFFS[-1]
    for c in reversed(PSI_COEFFS[:-1]):
        acc = acc * y + c
    return acc


def _psi(xp, y):
    """psi(y) = y - 1 + e^{-y} >= 0, without cancellation for small |y|."""
    return xp.where(abs(y) < PSI_SMALL, y * y * _psi_series(y), y - 1.0 + xp.exp(-y))


def teacher_sums(xp, t, ds, w):
    """(mu, au, cu, fu) [N] of the teacher over a block of columns: t [N, C] the scaled
    teacher logits, ds = s - m and w = e^{ds} [N, C] the student's (relative to its max m).

    With y = (t - mu) - (s - m): au = Σ e^{t-mu}, cu = Σ e^{t-mu}·y and
    fu = Σ e^{t-mu}·psi(y) = Σ (e^{t-mu}·y - e^{t-mu} + e^{s-m}), the last by the series where
    |y| is small (there the three terms cancel to e^{t-mu}·y²/2). A column with q = 0 (t at
    -inf, or so far below the teacher's max that e^{t-mu} is 0) adds e^{s-m} to fu and nothing
    else; one with p = 0 where q > 0 makes cu and fu +inf (or of order |s|: an infinite KL)."""
    mu = xp.rowmax(t)
    dt = t - _safe(xp, mu)[:, None]
    eu = xp.exp(dt)
    y = dt - ds
    ct = xp.where(eu > 0, eu * y, 0.0)  # (y may be ±inf or NaN where q = 0)
    f = xp.where(abs(y) < PSI_SMALL, ct * y * _psi_series(y), ct + (w - eu))
    return mu, xp.rowsum(eu), xp.rowsum(ct), xp.rowsum(f)


def chunk_partial(xp, rows: Rows, cols, valid, cfg: StatsConfig) -> State:
    """Partial state of one vocabulary chunk.

    rows: the bundle over the chunk's columns (logits, teacher: [N, C], the teacher may be
    None); cols: [C] global column ids; valid: [C] bool or None, columns that belong to this
    chunk (others count as -inf).
    """
    z, u = rows.logits, rows.teacher
    r = chunk_logits(xp, z, cols[0], rows.shift_ids, rows.shift, cfg)
    if valid is not None:
        r = xp.where(valid[None, :], r, NEG_INF)
    s = _scaled(r, cfg.temperature)
    m, a, b, ds, e = _row_lse_terms(xp, s, cfg.entropy)
    zero = xp.zeros_like(a)
    m2, a2 = m, a
    if cfg.separate_ce:
        m2, a2, _ = _row_lse_parts(xp, _scaled(r, cfg.ce_temperature), False)
    mu, au, cu, fu = m, zero, zero, zero
    if cfg.has_teacher:
        t = _scaled(xp.f32(u), cfg.teacher_temperature)
        if valid is not None:
            t = xp.where(valid[None, :], t, NEG_INF)
        mu, au, cu, fu = teacher_sums(xp, t, ds, e)
    return State(m, a, b, m2, a2, mu, au, cu, fu)


def _rescale(xp, m_part, m):
    """e^{m_part - m} with an all -inf row guarded (gives 0 for an empty part)."""
    return xp.exp(m_part - _safe(xp, m))


def _b_at(xp, st: State, f, m):
    """A part's entropy sum b relative to the merged max m: f·(b_i + (m_i - m)·a_i), and exactly
    0 where the part's rescale f = e^{m_i - m} is 0 (where (m_i - m)·a_i may be -inf)."""
    return xp.where(f > 0, f * (st.b + (st.m - m) * st.a), 0.0)


def teacher_at(xp, st: State, f, m, mu):
    """(au, cu, fu) of a part's teacher sums re-expressed at the merged maxima m and mu (the
    part's own are st.m, st.mu; f = e^{st.m - m}). The centre mu - m of y moves by
    h = (mu - st.mu) - (m - st.m), and with g = e^{st.mu - mu} = f·e^{-h}:

        au' = g·au,  cu' = g·(cu - h·au),  fu' = g·(fu - h·au - a) + f·a
            = g·(fu - h·(cu - fu) + a·h²·S(-h))      (|h| small: no cancellation)

    A part with g = 0 adds no teacher mass (its g-terms are exactly 0); one with f = 0 adds
    the teacher's mass where the student's probability is 0 (fu and cu of order -h·au)."""
    g = _rescale(xp, st.mu, mu)
    h = (_safe(xp, mu) - _safe(xp, st.mu)) - (_safe(xp, m) - _safe(xp, st.m))
    live = g > 0
    au = g * st.au
    cu = xp.where(live, g * (st.cu - h * st.au), 0.0)
    gap = st.cu - st.fu  # Σ e^{t-mu} - e^{s-m}, formed without cancellation
    near = live & (abs(h) < PSI_SMALL) & xp.isfinite(gap)
    fu_near = g * (st.fu - h * gap + st.a * h * h * _psi_series(-h))
    fu_far = xp.where(live, g * (st.fu - h * st.au - st.a), 0.0) + f * st.a
    return au, cu, xp.where(near, fu_near, fu_far)


def merge(xp, s1: State, s2: State, cfg: StatsConfig) -> State:
    """Associative merge of two partial states (chunks, split-K blocks or vocab shards)."""
    m = xp.maximum(s1.m, s2.m)
    f1, f2 = _rescale(xp, s1.m, m), _rescale(xp, s2.m, m)
    a = f1 * s1.a + f2 * s2.a
    b = xp.zeros_like(a)
    if cfg.entropy:
        # b is relative to the running max: Σ e^{s-m}(s-m) = f·(b_i + (m_i - m)·a_i).
        b = _b_at(xp, s1, f1, m) + _b_at(xp, s2, f2, m)
    m2, a2 = m, a
    if cfg.separate_ce:
        m2 = xp.maximum(s1.m2, s2.m2)
        a2 = _rescale(xp, s1.m2, m2) * s1.a2 + _rescale(xp, s2.m2, m2) * s2.a2
    mu, au, cu, fu = m, a * 0.0, a * 0.0, a * 0.0
    if cfg.has_teacher:
        mu = xp.maximum(s1.mu, s2.mu)
        (au1, cu1, fu1), (au2, cu2, fu2) = (teacher_at(xp, st, f, m, mu)
                                            for st, f in ((s1, f1), (s2, f2)))
        au, cu, fu = au1 + au2, cu1 + cu2, fu1 + fu2
    return State(m, a, b, m2, a2, mu, au, cu, fu)


def merge_collective(xp, state: State, pmax, psum, cfg: StatsConfig, extra_sums=()):
    """Merge the partial states of vocabulary shards with two collectives of per-row floats:
    ``pmax`` of the three running maxima, then one ``psum`` of the sums re-expressed at those
    maxima and of ``extra_sums`` (docs/design.md §2): 3 + 6 + len(extra_sums) floats per row
    in all. ``pmax``/``psum`` take and return lists of [N] arrays (one all-reduce each).
    Returns (merged State, summed extra_sums)."""
    m, m2, mu = pmax([state.m, state.m2, state.mu])
    f = _rescale(xp, state.m, m)
    a = f * state.a
    b = state.b  # 0 without entropy
    if cfg.entropy:
        b = _b_at(xp, state, f, m)
    a2 = _rescale(xp, state.m2, m2) * state.a2
    au, cu, fu = state.au, state.cu, state.fu  # zeros without a teacher
    if cfg.has_teacher:
        au, cu, fu = teacher_at(xp, state, f, m, mu)
    a, b, a2, au, cu, fu, *extra = psum([a, b, a2, au, cu, fu, *extra_sums])
    return State(m, a, b, m2, a2, mu, au, cu, fu), extra


def merge_splits(xp, parts, cfg: StatsConfig) -> State:
    """Merge S partial states given as one [N, S] array per State field into one
    State of [N] arrays, with the same rescaling as ``merge_collective``."""
    keep_max = lambda values: [xp.rowmax(v)[:, None] for v in values]
    state, _ = merge_collective(xp, State(*parts), keep_max, lambda vs: [xp.rowsum(v) for v in vs],
                                cfg)
    return state._replace(m=state.m[:, 0], m2=state.m2[:, 0], mu=state.mu[:, 0])


Stats = NamedTuple("Stats", [(field, object) for field in ROW_STATS])
Stats.__doc__ = """Per-row outputs and residuals, all [N] float32: lse = logsumexp(s),
logp = s'_y - lse_ce, entropy = -Σ p log p, kl = KL(q || p) (0 without a teacher),
lse_ce = logsumexp(s') (== lse when T_ce == T), lse_u = logsumexp(t) (0 without a teacher),
kl_shift = E_q[t - s] = (mu - m) + cu / au (so d(teacher) needs no lse cancellation)."""


def kl_divergence(xp, a, au, cu, fu):
    """KL(q || p) [N] from a row's merged sums (module docstring), >= 0 (docs/design.md §2,
    "The KL"). With x = (cu - fu) / a = au / a - 1 and e = log(au / a) = lse_u - lse - (mu - m):

        KL = fu / au - psi(e)      where |e| <= 1: a sum of terms >= 0 less a term of the
                                   size of (E_p[y])²/2, no first-order cancellation
        KL = cu / au - e           elsewhere (the teacher's mass and the student's far apart:
                                   a large KL, whose terms are first order anyway)
    """
    e_far = xp.log(au) - xp.log(a)
    x = (cu - fu) / a
    near = (abs(e_far) <= 1.0) & (abs(x) < 2.0)  # (False where x is NaN: inf - inf)
    e = xp.where(near, xp.log1p(x), e_far)
    kl = xp.where(near, fu / au - _psi(xp, e), cu / au - e_far)
    return xp.where(kl < 0, 0.0, kl)  # rounding can leave -ulps; NaN stays NaN


def target_logit(xp, rows: Rows, cfg: StatsConfig, offset=0):
    """(r_y, found), both [N] f32: the shifted logit at the target column when this block of
    columns [offset, offset + C) of ``rows.logits`` holds the target (else 0), and 1.0 / 0.0
    for whether it does. Summed over vocabulary shards, found == 1 exactly when the target is
    in range.
    """
    z = rows.logits
    found, idx = target_column(xp, rows.targets, z.shape[-1], offset, cfg)
    return shifted_target(xp, xp.gather_cols(z, idx), found, rows, cfg)


def target_column(xp, targets, c, offset, cfg: StatsConfig):
    """(found [N] bool, local column [N], 0 where not found) of each target in the block of
    columns [offset, offset + c)."""
    local = targets - offset
    found = (local >= 0) & (local < c)
    if cfg.vocab_size is not None:
        found = found & (targets < cfg.vocab_size)
    return found, xp.where(found, local, 0)


def shifted_target(xp, z_y, found, rows: Rows, cfg: StatsConfig):
    """(r_y, found) as ``target_logit`` returns them, from the raw target logits z_y [N]."""
    r = shifted_logits(xp, z_y[:, None], rows.targets[:, None], rows.shift_ids, rows.shift,
                       cfg)[:, 0]
    return xp.where(found, r, 0.0), xp.where(found, 1.0, 0.0)


def target_logp(xp, r_y, found, lse_ce, cfg: StatsConfig):
    """logp = r_y / T_ce - lse_ce, [N] f32; NaN where the target was not found (out of range:
    loud, never silently wrong)."""
    return xp.where(found > 0, r_y * (1.0 / cfg.ce_temperature) - lse_ce, float("nan"))


def column_mask(xp, cols, cfg: StatsConfig, valid=None):
    """[C] bool: columns that count (below ``cfg.vocab_size``, and ``valid`` when given)."""
    if cfg.vocab_size is not None:
        limit = cols < cfg.vocab_size
        valid = limit if valid is None else valid & limit
    return valid


def finalize(xp, state: State, r_y, found, active, cfg: StatsConfig) -> Stats:
    """Row statistics from a merged state; logp is NaN where the target was not found
    (out of range: loud, never silently wrong); inactive rows give exact zeros."""
    lse = state.m + xp.log(state.a)
    entropy = xp.log(state.a) - state.b / state.a if cfg.entropy else xp.zeros_like(lse)
    lse_ce = lse
    if cfg.separate_ce:
        lse_ce = state.m2 + xp.log(state.a2)
    logp = target_logp(xp, r_y, found, lse_ce, cfg)
    zero = xp.zeros_like(lse)
    kl, lse_u, kl_shift = zero, zero, zero
    if cfg.has_teacher:
        lse_u = state.mu + xp.log(state.au)
        kl_shift = (state.mu - state.m) + state.cu / state.au
        kl = kl_divergence(xp, state.a, state.au, state.cu, state.fu)
        kl = xp.where(xp.isfinite(lse), kl, float("nan"))  # no distribution p: no KL
    outs = [xp.where(active, v, 0.0) for v in (lse, logp, entropy, kl, lse_ce, lse_u, kl_shift)]
    return Stats(*outs)


def chunk_grads(xp, rows: Rows, cols, stats: Stats, grads, cfg: StatsConfig):
    """d(student logits) and d(teacher logits) of one chunk, both [N, C] float32 (``rows``:
    the bundle over the chunk's columns, as in ``chunk_partial``).

    With p = softmax(r/T), p' = softmax(r/T_ce), q = softmax(u/T_kl):
      dr_k = [g_lse·p_k - g_H·p_k·(log p_k + H) + g_kl·(p_k - q_k)] / T
             + g_lp·([k == y] - p'_k) / T_ce
      dz_k = dr_k·cap'(z_k);   du_k = g_kl·q_k·(log q_k - log p_k - kl) / T_kl
    with log q_k - log p_k - kl computed as (t_k - s_k) - E_q[t - s] (stats.kl_shift).
    Terms with p_k = 0 (or q_k = 0) contribute exactly 0. Inactive rows give exact zeros.
    ``cols`` are contiguous global ids. Written as few [N, C] passes as the math allows (each
    is a pass over memory in an eager framework): the per-row factors of p are gathered into
    one [N, 1] coefficient, and the target's g_lp / T_ce is added at one column per row.
    """
    z, u, targets, active = rows.logits, rows.teacher, rows.targets, rows.active
    r = chunk_logits(xp, z, cols[0], rows.shift_ids, rows.shift, cfg)
    s = _scaled(r, cfg.temperature)
    logp_k = s - stats.lse[:, None]
    p = xp.exp(logp_k)
    g_lse, g_lp, g_h, g_kl = grads
    inv_t = 1.0 / cfg.temperature
    g_ce = g_lp * (1.0 / cfg.ce_temperature)  # [N]: weight of [k == y] - p'_k in dr
    coef = g_lse * inv_t  # [N]: the factor of p_k in dr
    if not cfg.separate_ce:
        coef = coef - g_ce  # p' = p
    coef = coef[:, None]
    if cfg.entropy:  # (without it g_h is the cotangent of nothing)
        coef = coef - (g_h * inv_t)[:, None] * xp.where(p > 0, logp_k + stats.entropy[:, None],
                                                          0.0)
    dr = p * coef
    du = None
    if cfg.has_teacher:
        t = _scaled(xp.f32(u), cfg.teacher_temperature)
        q = xp.exp(t - stats.lse_u[:, None])
        dr = dr + (g_kl * inv_t)[:, None] * (p - q)  # float32 p - q: no cancellation trap
        if cfg.teacher_grad:
            # log q - log p - kl = (t - s) - E_q[t - s]: no cancellation between lse terms
            du = g_kl[:, None] * xp.where(q > 0, q * ((t - s) - stats.kl_shift[:, None]), 0.0)
            du = xp.where(active[:, None], du * (1.0 / cfg.teacher_temperature), 0.0)
    if cfg.separate_ce:
        dr = dr - g_ce[:, None] * xp.exp(_scaled(r, cfg.ce_temperature) - stats.lse_ce[:, None])
    dr = _add_at(xp, dr, targets, cols[0], g_ce)  # the target's column, when in this chunk
    if cfg.softcap is not None:
        th = xp.tanh(xp.f32(z) * (1.0 / cfg.softcap))
        dr = dr * (1.0 - th * th)
    dz = xp.where(active[:, None], dr, 0.0)
    if cfg.vocab_size is not None:  # padding columns get exact zeros
        keep = (cols < cfg.vocab_size)[None, :]
        dz = xp.where(keep, dz, 0.0)
        du = None if du is None else xp.where(keep, du, 0.0)
    return dz, du


def shift_grad(xp, columns, rows: Rows, stats: Stats, grads, cfg: StatsConfig):
    """d(Σ cotangent·stats) / d shift, [N] float32: the gradient dr of ``chunk_grads`` at
    each row's shifted column x (the shift is added after the cap, so no cap' factor):

      dr_x = [g_lse·p_x - g_H·p_x·(log p_x + H) + g_kl·(p_x - q_x)] / T
             + g_lp·([x == y] - p'_x) / T_ce

    columns: (z_x, u_x, found) of ``shift_columns``: [N] student and teacher logits at
    column x (u_x None without a teacher), and [N] bool, x lies in these columns (a
    vocabulary shard holds it, or not). The terms are those of ``chunk_grads`` for one
    column per row; 0 where not found or inactive.
    """
    z_x, u_x, found = columns
    x, targets = rows.shift_ids, rows.targets
    r = shifted_logits(xp, z_x[:, None], x[:, None], x, rows.shift, cfg)  # [N, 1]
    s = _scaled(r, cfg.temperature)
    logp_k = s - stats.lse[:, None]
    p = xp.exp(logp_k)
    g_lse, g_lp, g_h, g_kl = (g[:, None] for g in grads)
    inv_t = 1.0 / cfg.temperature
    g_ce = g_lp * (1.0 / cfg.ce_temperature)
    coef = g_lse * inv_t
    if not cfg.separate_ce:
        coef = coef - g_ce
    if cfg.entropy:
        coef = coef - g_h * inv_t * xp.where(p > 0, logp_k + stats.entropy[:, None], 0.0)
    dr = p * coef
    if cfg.has_teacher:
        q = xp.exp(_scaled(xp.f32(u_x[:, None]), cfg.teacher_temperature)
                   - stats.lse_u[:, None])
        dr = dr + g_kl * inv_t * (p - q)
    if cfg.separate_ce:
        dr = dr - g_ce * xp.exp(_scaled(r, cfg.ce_temperature) - stats.lse_ce[:, None])
    dr = dr[:, 0] + xp.where(x == targets, g_ce[:, 0], 0.0)
    return xp.where(found & rows.active, dr, 0.0)


def shift_columns(xp, rows: Rows, cfg: StatsConfig, offset=0):
    """(z_x, u_x, found) for ``shift_grad`` from rows whose logits (and teacher) are
    [N, K] arrays holding the columns [offset, offset + K): two gathers, O(N). Read them
    before a backward writes its gradient over the logits (``inplace_grad``)."""
    found, idx = target_column(xp, rows.shift_ids, rows.logits.shape[1], offset, cfg)
    z_x = _column(xp, rows.logits, idx)
    u_x = None if rows.teacher is None else _column(xp, rows.teacher, idx)
    return z_x, u_x, found


def _column(xp, x, idx):
    """[N] float32: x[n, idx[n]] of [N, K] logits, or of a linear head's (one dot product
    of D per row with the gathered row of the weight: O(N·D), no logits)."""
    if not is_head(x):
        return xp.f32(xp.gather_cols(x, idx))
    w = x.weight if x.weight_layout == VOCAB_MAJOR else x.weight.T  # [K, D]
    z = xp.rowsum(xp.f32(x.hidden) * xp.f32(w[idx]))
    return z if x.bias is None else z + xp.f32(x.bias[idx])


def reference_stats(xp, rows: Rows, cfg: StatsConfig):
    """Full-materialisation float32 statistics, differentiable by the framework's autodiff.

    rows.logits, rows.teacher: [N, K]; returns (lse, logp, entropy, kl) [N] f32. Inactive rows
    are replaced by zeros before any math, so NaN/inf there reach neither values nor gradients.
    """
    z, u, targets, active = rows.logits, rows.teacher, rows.targets, rows.active
    shift_ids, shift = rows.shift_ids, rows.shift
    k = z.shape[-1]
    cols = xp.arange(k, z)
    z = xp.where(active[:, None], xp.f32(z), 0.0)
    r = shifted_logits(xp, z, cols[None, :], shift_ids, shift, cfg)
    # a +inf logit leaves no distribution: every statistic of its row NaN and its whole
    # gradient NaN, as the streaming backends give (inf - inf); r·NaN makes both so
    plus_inf = xp.rowmax(xp.stop_gradient(r)) == float("inf")
    r = r * xp.where(plus_inf, float("nan"), 1.0)[:, None]
    s = r * (1.0 / cfg.temperature)
    lse = xp.logsumexp(s)
    logp_all = s - lse[:, None]
    p = xp.exp(logp_all)
    pos = p > 0
    entropy = -xp.rowsum(xp.where(pos, p * xp.where(pos, logp_all, 0.0), 0.0))
    # no distribution (NaN, +inf or an all -inf row): no entropy either, not the empty sum 0
    entropy = xp.where(xp.isfinite(lse), entropy, float("nan"))
    s_ce = r * (1.0 / cfg.ce_temperature)
    lse_ce = xp.logsumexp(s_ce) if cfg.separate_ce else lse
    in_range = (targets >= 0) & (targets < k)
    y = xp.where(in_range, targets, 0)
    logp = xp.where(in_range, xp.gather_cols(s_ce, y) - lse_ce, float("nan"))
    kl = xp.zeros_like(lse)
    if cfg.has_teacher:
        u = xp.where(active[:, None], xp.f32(u), 0.0)
        if not cfg.teacher_grad:
            u = xp.stop_gradient(u)
        t = u * (1.0 / cfg.teacher_temperature)
        lse_u = xp.logsumexp(t)
        q = xp.exp(t - lse_u[:, None])
        qpos = q > 0
        # KL = E_q[t - s] - lse_u + lse: the same value as Σ q (log q - log p), but its
        # autodiff gradient q·((t - s) - E_q[t - s]) avoids cancelling lse terms. Its value
        # cancels (E_q[t - s] and lse_u - lse agree to first order: the T² of distillation
        # at a large T magnifies that), so the value is the form every backend computes.
        diff = xp.where(qpos, t, 0.0) - xp.where(qpos, s, 0.0)
        kl_grad = xp.rowsum(xp.where(qpos, q * diff, 0.0)) - lse_u + lse
        kl = _row_kl(xp, xp.stop_gradient(s), xp.stop_gradient(t), lse)
        kl = xp.where(xp.isfinite(kl_grad), kl + (kl_grad - xp.stop_gradient(kl_grad)), kl_grad)
    return tuple(xp.where(active, v, 0.0) for v in (lse, logp, entropy, kl))


def _row_kl(xp, s, t, lse):
    """KL(softmax(t) || softmax(s)) [N] of whole rows s, t [N, K] as the streaming backends
    compute it (``teacher_sums`` over one chunk, ``kl_divergence``); NaN where lse is not
    finite (no distribution)."""
    m, a, _, ds, e = _row_lse_terms(xp, s, False)
    _, au, cu, fu = teacher_sums(xp, t, ds, e)
    return xp.where(xp.isfinite(lse), kl_divergence(xp, a, au, cu, fu), float("nan"))
