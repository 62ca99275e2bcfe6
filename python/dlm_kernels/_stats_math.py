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

Every exponent is a difference of logits scaled afterwards: with ``m`` the row's largest r,
``x = (r - m) / T`` (and ``x' = (r - m) / T_ce``, ``x_u = (u - mu) / T_kl``). A difference of
two scaled logits, s - lse, would carry an absolute error of an ulp of |s| = |r| / T (64 at
|r| / T = 1e9: |r| = 10 at T = 1e-8), and a compiler that contracts r·(1/T) - lse into one
FMA rounds it differently in the forward and the backward; (r - m) is exact near the
maximum and its scaled value has a relative error of an ulp. So the residuals are m and the
log of the sum relative to it, ``la`` (lse = m / T + la), never lse itself.

The streaming state of a row is ``(m, a, b, a2, mu, au, cu)``:
  m, a, b     running max of r, Σ e^x, Σ e^x·x  (b relative to m: no cancellation between lse
              and Σ p s in the entropy; b = 0 when cfg.entropy is False)
  a2          Σ e^{x'} (only when T_ce != T; the max is m)
  mu, au, cu  running max of u, Σ e^{x_u}, Σ e^{x_u}·(x_u - x)   (teacher; x_u - x is
              t - s less the constant mu / T_kl - m / T: no cancellation of sizes |u| / T_kl)
"""

from __future__ import annotations

from typing import NamedTuple

from ._config import StatsConfig
from ._rows import Rows
from .kernels.layout import PARTIAL_STATE, ROW_STATS
from .kernels.softcap import TANH_SERIES, TANH_SERIES_BOUND

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
        r = softcap(xp, r, cfg.softcap)
    return r


def softcap(xp, z, c):
    """c·tanh(z / c) of float32 z, accurate for every c > 0 (kernels/softcap.py): below
    |z / c| = TANH_SERIES_BOUND as z·(1 + u·Q(u)), u = (z / c)², so z to float32 where z / c
    underflows; beyond, c·tanh(z / c) (saturating to ±c, also where z / c overflows)."""
    x = z * (1.0 / c)
    u = x * x
    q = TANH_SERIES[-1]
    for coef in TANH_SERIES[-2::-1]:
        q = q * u + coef
    return xp.where(u < TANH_SERIES_BOUND ** 2, z + z * (u * q), xp.tanh(x) * c)


def _add_at(xp, x, ids, col0, vals):
    """x [N, C] + vals [N] at column ``ids - col0`` of each row whose id is in this chunk of
    contiguous columns (x is a temporary: torch updates it in place)."""
    local = ids - col0
    hit = (local >= 0) & (local < x.shape[1])
    return xp.add_at_cols(x, xp.where(hit, local, 0), xp.where(hit, vals, 0.0))


def _scaled(x, temperature):
    """x / T (x itself at T = 1: one [N, C] pass less in eager frameworks, same values)."""
    return x if temperature == 1.0 else x * (1.0 / temperature)


def _row_sums(xp, x, with_b=True):
    """Σ e^x and (with_b) Σ e^x·x, else 0, over the last axis of x: [N, C] (x <= 0)."""
    e = xp.exp(x)
    a = xp.rowsum(e)
    if not with_b:
        return a, xp.zeros_like(a)
    return a, xp.rowsum(xp.where(e > 0, e * x, 0.0))


def _safe_max(xp, v):
    """The row max of v [N, C], and the same with an all -inf row's max at 0 (no inf - inf)."""
    m = xp.rowmax(v)
    return m, xp.where(m == NEG_INF, 0.0, m)


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
    m, ms = _safe_max(xp, r)
    d = r - ms[:, None]  # [N, C] logit differences, shared by every sum below
    x = _scaled(d, cfg.temperature)
    a, b = _row_sums(xp, x, cfg.entropy)
    zero = xp.zeros_like(a)
    a2 = a
    if cfg.separate_ce:
        a2, _ = _row_sums(xp, _scaled(d, cfg.ce_temperature), False)
    mu, au, cu = m, zero, zero
    if cfg.has_teacher:
        u = xp.f32(u)
        if valid is not None:
            u = xp.where(valid[None, :], u, NEG_INF)
        mu, mus = _safe_max(xp, u)
        xu = _scaled(u - mus[:, None], cfg.teacher_temperature)
        eu = xp.exp(xu)
        au = xp.rowsum(eu)
        cu = xp.rowsum(xp.where(eu > 0, eu * (xu - x), 0.0))
    return State(m, a, b, a2, mu, au, cu)


def _rescale(xp, m_part, m, temperature):
    """(e^δ, δ) with δ = (m_part - m) / T, the move of a part's exponents to the merged
    maximum m, an all -inf row guarded (e^δ = 0 for an empty part)."""
    ms = xp.where(m == NEG_INF, 0.0, m)
    delta = _scaled(m_part - ms, temperature)
    return xp.exp(delta), delta


def _moved(xp, f, delta, a, b):
    """f·(b + δ·a), 0 where a = 0: a sum Σ e^x·x moved to another maximum (b_i relative to
    the part's maximum: Σ e^{x+δ}(x + δ) = e^δ·(b_i + δ·a_i))."""
    return xp.where(a > 0, f * (b + delta * a), 0.0)


def _moved_parts(xp, state: State, m, mu, cfg: StatsConfig):
    """The sums of ``state`` relative to the maxima m and mu: (a, b, a2, au, cu)."""
    f, delta = _rescale(xp, state.m, m, cfg.temperature)
    a, b, a2 = f * state.a, state.b, f * state.a  # b: 0 without entropy; a2 = a at T_ce = T
    if cfg.entropy:
        b = _moved(xp, f, delta, state.a, state.b)
    if cfg.separate_ce:
        a2 = _rescale(xp, state.m, m, cfg.ce_temperature)[0] * state.a2
    au, cu = state.au, state.cu  # 0 without a teacher
    if cfg.has_teacher:
        fu, delta_u = _rescale(xp, state.mu, mu, cfg.teacher_temperature)
        au = fu * state.au
        cu = _moved(xp, fu, delta_u - delta, state.au, state.cu)  # x_u - x moves by δ_u - δ
    return a, b, a2, au, cu


def merge(xp, s1: State, s2: State, cfg: StatsConfig) -> State:
    """Associative merge of two partial states (chunks, split-K blocks or vocab shards)."""
    m = xp.maximum(s1.m, s2.m)
    mu = xp.maximum(s1.mu, s2.mu) if cfg.has_teacher else m
    p1, p2 = _moved_parts(xp, s1, m, mu, cfg), _moved_parts(xp, s2, m, mu, cfg)
    a, b, a2, au, cu = (v1 + v2 for v1, v2 in zip(p1, p2))
    return State(m, a, b, a2, mu, au, cu)


def merge_collective(xp, state: State, pmax, psum, cfg: StatsConfig, extra_sums=()):
    """Merge the partial states of vocabulary shards with two collectives of per-row floats:
    ``pmax`` of the two running maxima, then one ``psum`` of the rescaled sums and of
    ``extra_sums`` (docs/design.md §2): 2 + 5 + len(extra_sums) floats per row in all.
    ``pmax``/``psum`` take and return lists of [N] arrays (one all-reduce each).
    Returns (merged State, summed extra_sums)."""
    m, mu = pmax([state.m, state.mu])
    a, b, a2, au, cu, *extra = psum([*_moved_parts(xp, state, m, mu, cfg), *extra_sums])
    return State(m, a, b, a2, mu, au, cu), extra


def merge_splits(xp, parts, cfg: StatsConfig) -> State:
    """Merge S partial states given as one [N, S] array per State field into one
    State of [N] arrays, with the same rescaling as ``merge_collective``."""
    keep_max = lambda values: [xp.rowmax(v)[:, None] for v in values]
    state, _ = merge_collective(xp, State(*parts), keep_max, lambda vs: [xp.rowsum(v) for v in vs],
                                cfg)
    return state._replace(m=state.m[:, 0], mu=state.mu[:, 0])


Stats = NamedTuple("Stats", [(field, object) for field in ROW_STATS])
Stats.__doc__ = """Per-row outputs and residuals, all [N] float32: lse = logsumexp(s),
logp = s'_y - logsumexp(s'), entropy = -Σ p log p, kl = KL(q || p) (0 without a teacher);
the residuals: kl_shift = E_q[x_u - x] = cu / au (so d(teacher) needs no cancellation of
log-normalisers), m = max r, la = log Σ e^x (lse = m / T + la), la_ce = log Σ e^{x'}
(== la when T_ce == T), mu = max u and la_u = log Σ e^{x_u} (0 without a teacher)."""


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


def target_logp(xp, r_y, found, m, la_ce, cfg: StatsConfig):
    """logp = (r_y - m) / T_ce - la_ce, [N] f32 (m the row's largest logit, la_ce the log of
    the sum relative to it); NaN where the target was not found (out of range: loud, never
    silently wrong)."""
    return xp.where(found > 0, _scaled(r_y - m, cfg.ce_temperature) - la_ce, float("nan"))


def column_mask(xp, cols, cfg: StatsConfig, valid=None):
    """[C] bool: columns that count (below ``cfg.vocab_size``, and ``valid`` when given)."""
    if cfg.vocab_size is not None:
        limit = cols < cfg.vocab_size
        valid = limit if valid is None else valid & limit
    return valid


def finalize(xp, state: State, r_y, found, active, cfg: StatsConfig) -> Stats:
    """Row statistics from a merged state; logp is NaN where the target was not found
    (out of range: loud, never silently wrong); inactive rows give exact zeros."""
    la = xp.log(state.a)
    lse = _scaled(state.m, cfg.temperature) + la
    entropy = la - state.b / state.a if cfg.entropy else xp.zeros_like(lse)
    la_ce = xp.log(state.a2) if cfg.separate_ce else la
    logp = target_logp(xp, r_y, found, state.m, la_ce, cfg)
    zero = xp.zeros_like(lse)
    kl, la_u, kl_shift = zero, zero, zero
    if cfg.has_teacher:
        la_u = xp.log(state.au)
        kl_shift = state.cu / state.au  # E_q[x_u - x]
        kl = kl_shift - la_u + la
    mu = state.mu if cfg.has_teacher else zero
    stats = dict(lse=lse, logp=logp, entropy=entropy, kl=kl, kl_shift=kl_shift, m=state.m,
                 la=la, la_ce=la_ce, mu=mu, la_u=la_u)
    return Stats(*(xp.where(active, stats[field], 0.0) for field in ROW_STATS))


def chunk_grads(xp, rows: Rows, cols, stats: Stats, grads, cfg: StatsConfig):
    """d(student logits) and d(teacher logits) of one chunk, both [N, C] float32 (``rows``:
    the bundle over the chunk's columns, as in ``chunk_partial``).

    With p = softmax(r/T), p' = softmax(r/T_ce), q = softmax(u/T_kl):
      dr_k = [g_lse·p_k - g_H·p_k·(log p_k + H) + g_kl·(p_k - q_k)] / T
             + g_lp·([k == y] - p'_k) / T_ce
      dz_k = dr_k·cap'(z_k);   du_k = g_kl·q_k·(log q_k - log p_k - kl) / T_kl
    with log p_k = (r_k - m)/T - la (the saved row max and log-sum: no difference of scaled
    logits) and log q_k - log p_k - kl computed as (x_u - x)_k - E_q[x_u - x]
    (stats.kl_shift).
    Terms with p_k = 0 (or q_k = 0) contribute exactly 0. Inactive rows give exact zeros.
    ``cols`` are contiguous global ids. Written as few [N, C] passes as the math allows (each
    is a pass over memory in an eager framework): the per-row factors of p are gathered into
    one [N, 1] coefficient, and the target's g_lp / T_ce is added at one column per row.
    """
    z, u, targets, active = rows.logits, rows.teacher, rows.targets, rows.active
    r = chunk_logits(xp, z, cols[0], rows.shift_ids, rows.shift, cfg)
    d = r - stats.m[:, None]  # [N, C] logit differences
    x = _scaled(d, cfg.temperature)
    logp_k = x - stats.la[:, None]
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
        xu = _scaled(xp.f32(u) - stats.mu[:, None], cfg.teacher_temperature)
        q = xp.exp(xu - stats.la_u[:, None])
        dr = dr + (g_kl * inv_t)[:, None] * (p - q)  # float32 p - q: no cancellation trap
        if cfg.teacher_grad:
            # log q - log p - kl = (x_u - x) - E_q[x_u - x]: no cancellation of log-normalisers
            du = g_kl[:, None] * xp.where(q > 0, q * ((xu - x) - stats.kl_shift[:, None]), 0.0)
            du = xp.where(active[:, None], du * (1.0 / cfg.teacher_temperature), 0.0)
    if cfg.separate_ce:
        dr = dr - g_ce[:, None] * xp.exp(_scaled(d, cfg.ce_temperature) - stats.la_ce[:, None])
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


def _finite_max(xp, v):
    """The row max of v [N, K] as a constant (no gradient), 0 where it is not finite."""
    m = xp.stop_gradient(xp.rowmax(v))
    return xp.where(xp.isfinite(m), m, 0.0)


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
    # exponents as differences of logits scaled afterwards (module docstring): x = (r - m)/T
    # with m the row max, a constant to autodiff (lse's gradient does not depend on it)
    m = _finite_max(xp, r)
    d = r - m[:, None]
    x = d * (1.0 / cfg.temperature)
    # a +inf logit leaves no distribution: NaN, as the streaming backends give (inf - inf)
    no_inf = lambda v: xp.where(v == float("inf"), float("nan"), v)  # noqa: E731
    la = no_inf(xp.logsumexp(x))
    lse = m * (1.0 / cfg.temperature) + la
    logp_all = x - la[:, None]
    p = xp.exp(logp_all)
    pos = p > 0
    entropy = -xp.rowsum(xp.where(pos, p * xp.where(pos, logp_all, 0.0), 0.0))
    # no distribution (NaN, +inf or an all -inf row): no entropy either, not the empty sum 0
    entropy = xp.where(xp.isfinite(lse), entropy, float("nan"))
    x_ce = d * (1.0 / cfg.ce_temperature)
    la_ce = no_inf(xp.logsumexp(x_ce)) if cfg.separate_ce else la
    in_range = (targets >= 0) & (targets < k)
    y = xp.where(in_range, targets, 0)
    logp = xp.where(in_range, xp.gather_cols(x_ce, y) - la_ce, float("nan"))
    kl = xp.zeros_like(lse)
    if cfg.has_teacher:
        u = xp.where(active[:, None], xp.f32(u), 0.0)
        if not cfg.teacher_grad:
            u = xp.stop_gradient(u)
        xu = (u - _finite_max(xp, u)[:, None]) * (1.0 / cfg.teacher_temperature)
        la_u = xp.logsumexp(xu)
        q = xp.exp(xu - la_u[:, None])
        qpos = q > 0
        # KL = E_q[x_u - x] - la_u + la: the same value as Σ q (log q - log p), but its
        # autodiff gradient q·((x_u - x) - E_q[x_u - x]) avoids cancelling log-normalisers.
        diff = xp.where(qpos, xu, 0.0) - xp.where(qpos, x, 0.0)
        kl = xp.rowsum(xp.where(qpos, q * diff, 0.0)) - la_u + la
    return tuple(xp.where(active, v, 0.0) for v in (lse, logp, entropy, kl))
