"""The token-statistics math of docs/design.md §2, written once over an array namespace.

Every function takes ``xp``, a small adapter (``dlm_kernels._torch.ops.TorchOps`` or
``dlm_kernels._jax.ops.JaxOps``) that maps the handful of operations whose spelling
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

The streaming state of a row is ``(m, a, b, a2, mu, au, cu, fu, sr)``:
  m, a, b     running max of r, Σ e^x, Σ e^x·x  (b relative to m: no cancellation between lse
              and Σ p s in the entropy; b = 0 when cfg.HAS_ENTROPY is False)
  a2          Σ e^{x'} (only when T_ce != T; the max is m)
  mu, au      running max of u, Σ e^{x_u}   (teacher)
  cu, fu      Σ e^{x_u}·y and Σ e^{x_u}·psi(y) with y = x_u - x, the log-ratio log(q/p) up to
              a constant (t - s less mu / T_kl - m / T: no cancellation of sizes |u| / T_kl),
              and psi(y) = y - 1 + e^{-y} >= 0 (kernels/series.py): the KL without
              cancellation (docs/design.md §2, "The KL")
  sr          Σ r over the valid columns, in logit units (only with label smoothing, else 0):
              the mean log-probability Σ_k log p'_k / K = (sr / K - m) / T_ce - la_ce; parts
              merge by a plain sum
Parts are merged at the larger maxima; a part whose rescale factor e^{(m_i - m)/T} is 0 (its
logits all so far below the others that their probabilities are 0 in float32, such as
columns masked with finfo.min) adds exactly nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any, Generic, NamedTuple, TypeVar

from ..linear_head.head import as_logits
from .lowering import Lowered
from .._config import padded_rows
from .._rows import Rows
from ..kernels.layout import PARTIAL_STATE, ROW_STATS
from ..kernels.series import PSI_COEFFS, PSI_SMALL
from ..kernels.softcap import TANH_SERIES, TANH_SERIES_BOUND

if TYPE_CHECKING:
    from .._ops import Array, Ops
    from ..linear_head.head import LogitsSource

NEG_INF = float("-inf")

#: the front end's array type (torch.Tensor, jax.Array): ``_ops.A``
A = TypeVar("A", bound="Array")

# Field names and order come from the kernels' buffer layout (kernels/layout.py), so the
# host's tuples and the kernels' buffers cannot drift apart. A type checker reads the same
# fields spelled out, generic in the array type (a NamedTuple is generic from Python 3.11
# on); tests/test_internal_types.py holds the two equal.
if TYPE_CHECKING:
    class State(NamedTuple, Generic[A]):
        m: A
        a: A
        b: A
        a2: A
        mu: A
        au: A
        cu: A
        fu: A
        sr: A
else:
    State = NamedTuple("State", [(field, object) for field in PARTIAL_STATE])
State.__doc__ = "The streaming state of each row (module docstring), every field [N] float32."


def shifted_logits(xp: Ops[A], z: A, col_ids: A, shift_ids: A | None, shift: A | None,
                   cfg: Lowered) -> A:
    """r = cap(z) + d·[k == x].

    z: [N, C] any float dtype; col_ids: the column id of each entry, broadcastable to
    [N, C] ([1, C] for a chunk, [N, 1] for a gathered column) -> [N, C] float32.
    """
    r = _capped(xp, z, cfg)
    if shift_ids is not None:
        assert shift is not None  # given with shift_ids (``_checks.check_stats_inputs``)
        r = r + xp.where(col_ids == shift_ids[:, None], shift[:, None], 0.0)
    return r


def chunk_logits(xp: Ops[A], z: A, col0: A | int, shift_ids: A | None, shift: A | None,
                 cfg: Lowered) -> A:
    """r = cap(z) + d·[k == x] of a chunk of contiguous columns whose first global id is
    ``col0``: the same values as ``shifted_logits``, but the shift lands at one column per
    row instead of a compare and a select over [N, C] (in torch those took about half of a
    LOO CE forward at N 512, K 32768 on a CPU). z: [N, C] -> [N, C] float32."""
    r = _capped(xp, z, cfg)
    if shift_ids is not None:
        assert shift is not None  # given with shift_ids (``_checks.check_stats_inputs``)
        r = _add_at(xp, xp.owned(r, z), shift_ids, col0, shift)
    return r


def _capped(xp: Ops[A], z: A, cfg: Lowered) -> A:
    """cap(z) in float32 (z itself when it is float32 and there is no softcap)."""
    r = xp.f32(z)
    if cfg.HAS_SOFTCAP:
        r = softcap(xp, r, cfg.softcap)
    return r


def softcap(xp: Ops[A], z: A, c: float) -> A:
    """c·tanh(z / c) of float32 z, accurate for every c > 0 (kernels/softcap.py): below
    |z / c| = TANH_SERIES_BOUND as z·(1 + u·Q(u)), u = (z / c)², so z to float32 where z / c
    underflows; beyond, c·sign(x)·(1 - e)/(1 + e), e = e^{-2|x|}, x = z / c (saturating to
    ±c, also where x overflows), as the kernels compute it. Its autodiff derivative is
    4e/(1 + e)², precise relative to itself where tanh saturates (``softcap_slope``); a
    framework tanh's, 1 - tanh², is not."""
    x = z * (1.0 / c)
    small = x * x < TANH_SERIES_BOUND ** 2
    # the series only where it is used: its unused value at z = ±inf would be NaN, and
    # autodiff's where() carries a NaN of the unused branch into the gradient
    zs, xs = xp.where(small, z, 0.0), xp.where(small, x, 0.0)
    u = xs * xs
    q = TANH_SERIES[-1]
    for coef in TANH_SERIES[-2::-1]:
        q = q * u + coef
    e = xp.exp(xp.where(x < 0, 2.0 * x, -2.0 * x))
    th = (1.0 - e) / (1.0 + e)
    return xp.where(small, zs + zs * (u * q), xp.where(x < 0, -th, th) * c)


def softcap_slope(xp: Ops[A], z: A, c: float) -> A:
    """cap'(z) = 1 - tanh²(z / c) = 4e / (1 + e)², e = e^{-2|z / c|}, of float32 z: precise
    relative to itself for every z (0 at ±inf). 1 - th² from a rounded th is precise only
    to float32's absolute 6e-8: off by 10 % at |z / c| = 8, and 0 past 9."""
    x = z * (1.0 / c)
    e = xp.exp(xp.where(x < 0, 2.0 * x, -2.0 * x))
    return 4.0 * e / ((1.0 + e) * (1.0 + e))


def _add_at(xp: Ops[A], x: A, ids: A, col0: A | int, vals: A) -> A:
    """x [N, C] + vals [N] at column ``ids - col0`` of each row whose id is in this chunk of
    contiguous columns (x is a temporary: torch updates it in place)."""
    local = ids - col0
    hit = (local >= 0) & (local < x.shape[1])
    return xp.add_at_cols(x, xp.where(hit, local, 0), xp.where(hit, vals, 0.0))


def _scaled(xp: Ops[A], x: A, inv_t: float, summed: bool = True) -> A:
    """x / T as x·(1/T), ``inv_t`` = 1/T (x itself at T = 1: one [N, C] pass less in eager
    frameworks, same values), rounded before any sum takes it (``xp.rounded``: in one fused
    loop XLA contracts a product and its sum into one multiply-add, in some programs and not
    in others, docs/design.md §2). Every product in these formulas that a sum takes is
    rounded so, a tile's or a row's, but for the steps of a polynomial by Horner's rule
    (one fused loop always holds such a chain whole, so each step is always contracted),
    the backward's tiles of logits given as arrays (``chunk_grads``) and the reference's
    whole-row [N, K] products (``reference_stats``: rows in blocks of a height fixed by
    K). A select in between (``where``) rounds a product as well. ``summed=False``: for a
    product that no sum takes (an exponent), or one that need not be rounded, which the
    select would only slow down."""
    if inv_t == 1.0:
        return x
    return xp.rounded(x * inv_t) if summed else x * inv_t


def _safe(xp: Ops[A], m: A) -> A:
    """A running max with -inf (no finite entry yet) replaced by 0, so that no inf - inf forms."""
    return xp.where(m == NEG_INF, 0.0, m)


def _row_sums(xp: Ops[A], x: A, with_b: bool = True) -> tuple[A, A, A]:
    """(Σ e^x, (with_b) Σ e^x·x else 0, e^x) of x: [N, C] (x <= 0), the sums over the last
    axis."""
    e = xp.exp(x)
    a = xp.rowsum(e)
    if not with_b:
        return a, xp.zeros_like(a), e
    return a, xp.rowsum(xp.where(e > 0, e * x, 0.0)), e


def _safe_max(xp: Ops[A], v: A) -> tuple[A, A]:
    """The row max of v [N, C], and the same with an all -inf row's max at 0 (no inf - inf)."""
    m = xp.rowmax(v)
    return m, _safe(xp, m)


def _psi_series(y: A) -> A | float:
    """S(y) = psi(y) / y² for |y| < PSI_SMALL (kernels/series.py), by Horner's rule."""
    acc = PSI_COEFFS[-1]
    for c in reversed(PSI_COEFFS[:-1]):
        acc = acc * y + c
    return acc


def _psi(xp: Ops[A], y: A) -> A:
    """psi(y) = y - 1 + e^{-y} >= 0, without cancellation for small |y|."""
    return xp.where(abs(y) < PSI_SMALL, y * y * _psi_series(y), y - 1.0 + xp.exp(-y))


def teacher_sums(xp: Ops[A], u: A, x: A, w: A, cfg: Lowered) -> tuple[A, A, A, A]:
    """(mu, au, cu, fu) [N] of the teacher over a block of columns: u [N, C] the float32
    teacher logits, x = (r - m) / T and w = e^x [N, C] the student's (relative to its max m).

    With x_u = (u - mu) / T_kl and y = x_u - x: au = Σ e^{x_u}, cu = Σ e^{x_u}·y and
    fu = Σ e^{x_u}·psi(y) = Σ (e^{x_u}·y - e^{x_u} + e^x), the last by the series where |y| is
    small (there the three terms cancel to e^{x_u}·y²/2). A column with q = 0 (u at -inf, or
    so far below the teacher's max that e^{x_u} is 0) adds e^x to fu and nothing else; one
    with p = 0 where q > 0 makes cu and fu +inf (or of order |x|: an infinite KL)."""
    mu, mus = _safe_max(xp, u)
    xu = _scaled(xp, u - mus[:, None], cfg.inv_t_kl)
    eu = xp.exp(xu)
    y = xu - (x if cfg.inv_t == 1.0 else xp.rounded(x))  # (x a product: ``_scaled``)
    ct = xp.where(eu > 0, eu * y, 0.0)  # (y may be ±inf or NaN where q = 0)
    f = xp.where(abs(y) < PSI_SMALL, ct * y * _psi_series(y), ct + (w - eu))
    return mu, xp.rowsum(eu), xp.rowsum(ct), xp.rowsum(f)


def chunk_partial(xp: Ops[A], rows: Rows, cols: A, valid: A | None, cfg: Lowered,
                  pointwise_shift: bool = False) -> State[A]:
    """Partial state of one vocabulary chunk.

    rows: the bundle over the chunk's columns (logits, teacher: [N, C], the teacher may be
    None); cols: [C] global column ids; valid: [C] bool or None, columns that belong to this
    chunk (others count as -inf). ``pointwise_shift``: the shift by a compare and a select
    (``shifted_logits``) instead of an update at one column: for a compiler, which fuses the
    select into its loops but would write r out for the update.
    """
    z, u = rows.logits, rows.teacher
    if pointwise_shift:
        r = shifted_logits(xp, z, cols[None, :], rows.shift_ids, rows.shift, cfg)
    else:
        r = chunk_logits(xp, z, cols[0], rows.shift_ids, rows.shift, cfg)
    sr = None
    if cfg.SMOOTH:  # Σ r over the valid columns (masked ones count as 0, not -inf)
        sr = xp.rowsum(r if valid is None else xp.where(valid[None, :], r, 0.0))
    if valid is not None:
        r = xp.where(valid[None, :], r, NEG_INF)
    m, ms = _safe_max(xp, r)
    d = r - ms[:, None]  # [N, C] logit differences, shared by every sum below
    # exponents, which no sum takes (the teacher's y rounds x where it takes it)
    x = _scaled(xp, d, cfg.inv_t, summed=False)
    a, b, e = _row_sums(xp, x, cfg.HAS_ENTROPY)
    zero = xp.zeros_like(a)
    a2 = a
    if cfg.SEPARATE_CE:
        a2, _, _ = _row_sums(xp, _scaled(xp, d, cfg.inv_t_ce, summed=False), False)
    mu, au, cu, fu = m, zero, zero, zero
    if cfg.HAS_TEACHER:
        u = xp.f32(u)
        if valid is not None:
            u = xp.where(valid[None, :], u, NEG_INF)
        mu, au, cu, fu = teacher_sums(xp, u, x, e, cfg)
    return State(m, a, b, a2, mu, au, cu, fu, zero if sr is None else sr)


def _rescale(xp: Ops[A], m_part: A, m: A, inv_t: float) -> tuple[A, A]:
    """(e^δ, δ) with δ = (m_part - m) / T, the move of a part's exponents to the merged
    maximum m, an all -inf row guarded (e^δ = 0 for an empty part)."""
    delta = _scaled(xp, m_part - _safe(xp, m), inv_t)
    return xp.exp(delta), delta


def _moved(xp: Ops[A], f: A, delta: A, a: A, b: A) -> A:
    """f·(b + δ·a): a sum Σ e^x·x moved to another maximum (b_i relative to the part's
    maximum: Σ e^{x+δ}(x + δ) = e^δ·(b_i + δ·a_i)), and exactly 0 where the part's rescale
    f = e^δ is 0 (where δ·a may be -inf: a part masked with finfo.min)."""
    return xp.where(f > 0, f * (b + xp.rounded(delta * a)), 0.0)


def teacher_at(xp: Ops[A], st: State[A], f: A, delta: A, g: A, delta_u: A) -> tuple[A, A]:
    """(cu, fu) of a part's teacher sums re-expressed at the merged maxima (the student's
    exponents move by δ, f = e^δ; the teacher's by δ_u, g = e^{δ_u}). y = x_u - x moves by
    -h, h = δ - δ_u, and f = g·e^h:

        cu' = g·(cu - h·au),  fu' = g·(fu - h·au - a) + f·a
            = g·(fu - h·(cu - fu) + a·h²·S(-h))      (|h| small: no cancellation)

    A part with g = 0 adds no teacher mass (its g-terms are exactly 0); one with f = 0 adds
    the teacher's mass where the student's probability is 0 (fu and cu of order -h·au)."""
    r = xp.rounded  # every product a sum takes (``_scaled``)
    h = delta - delta_u
    live = g > 0
    cu = xp.where(live, g * (st.cu - r(h * st.au)), 0.0)
    gap = st.cu - st.fu  # Σ e^{x_u} - e^x, formed without cancellation
    near = live & (abs(h) < PSI_SMALL) & xp.isfinite(gap)
    fu_near = g * (st.fu - r(h * gap) + r(st.a * h * h * _psi_series(-h)))
    fu_far = xp.where(live, g * (st.fu - r(h * st.au) - st.a), 0.0) + r(f * st.a)
    return cu, xp.where(near, fu_near, fu_far)


def _moved_parts(xp: Ops[A], state: State[A], m: A, mu: A,
                 cfg: Lowered) -> tuple[A, A, A, A, A, A]:
    """The sums of ``state`` relative to the maxima m and mu: (a, b, a2, au, cu, fu)."""
    # each a product the merge's sum takes: rounded on its own (``_scaled``)
    f, delta = _rescale(xp, state.m, m, cfg.inv_t)
    a = xp.rounded(f * state.a)
    b, a2 = state.b, a  # b: 0 without entropy; a2 = a at T_ce = T
    if cfg.HAS_ENTROPY:
        b = _moved(xp, f, delta, state.a, state.b)
    if cfg.SEPARATE_CE:
        a2 = xp.rounded(_rescale(xp, state.m, m, cfg.inv_t_ce)[0] * state.a2)
    au, cu, fu = state.au, state.cu, state.fu  # 0 without a teacher
    if cfg.HAS_TEACHER:
        g, delta_u = _rescale(xp, state.mu, mu, cfg.inv_t_kl)
        au = xp.rounded(g * state.au)
        cu, fu = teacher_at(xp, state, f, delta, g, delta_u)
    return a, b, a2, au, cu, fu


def merge(xp: Ops[A], s1: State[A], s2: State[A], cfg: Lowered) -> State[A]:
    """Associative merge of two partial states (chunks, split-K blocks or vocab shards)."""
    m = xp.maximum(s1.m, s2.m)
    mu = xp.maximum(s1.mu, s2.mu) if cfg.HAS_TEACHER else m
    p1, p2 = _moved_parts(xp, s1, m, mu, cfg), _moved_parts(xp, s2, m, mu, cfg)
    a, b, a2, au, cu, fu = (v1 + v2 for v1, v2 in zip(p1, p2))
    return State(m, a, b, a2, mu, au, cu, fu, s1.sr + s2.sr)


def merge_collective(xp: Ops[A], state: State[A], pmax: Callable[[list[A]], Sequence[A]],
                     psum: Callable[[list[A]], Sequence[A]], cfg: Lowered,
                     extra_sums: Sequence[A] = ()) -> tuple[State[A], list[A]]:
    """Merge the partial states of vocabulary shards with two collectives of per-row floats:
    ``pmax`` of the two running maxima, then one ``psum`` of the sums re-expressed at those
    maxima and of ``extra_sums`` (docs/design.md §2): 2 + 6 + len(extra_sums) floats per row
    in all (one more, Σ r, with label smoothing). ``pmax``/``psum`` take and return lists of
    [N] arrays (one all-reduce each). Returns (merged State, summed extra_sums)."""
    m, mu = pmax([state.m, state.mu])
    smooth = [state.sr] if cfg.SMOOTH else []
    a, b, a2, au, cu, fu, *extra = psum([*_moved_parts(xp, state, m, mu, cfg), *smooth,
                                         *extra_sums])
    sr = extra.pop(0) if cfg.SMOOTH else state.sr
    return State(m, a, b, a2, mu, au, cu, fu, sr), extra


def shard_stats(xp: Ops[A], impl: Any, rows: Rows, cfg: Lowered, offset: A | int,
                pmax: Callable[[list[A]], Sequence[A]],
                psum: Callable[[list[A]], Sequence[A]]) -> Stats[A]:
    """Megatron-style vocabulary parallelism, the one merge every front end and the linear
    head use: ``rows.logits`` is one shard of columns [offset, offset + K_local); the
    backend's partial state, merged across the shards by the framework's collectives
    (``merge_collective``: ``pmax`` / ``psum`` of lists of [N] arrays), then finalised.
    The target's logit and whether a shard found it ride along in the sum. The merge and
    ``finalize`` (exp and log of [N] arrays) run on rows padded to the framework's row group
    (``xp.row_group``: 8 in JAX, whose CPU code rounds the last N mod 8 lanes otherwise), so
    a row's bits do not depend on N; O(N) numbers are copied."""
    state, r_y, found = impl.forward_partial(rows, cfg, offset)
    n = rows.targets.shape[0]
    m = padded_rows(n, xp.row_group)
    pad = lambda x: xp.pad_rows(x, m)  # noqa: E731
    state, (r_y, found) = merge_collective(xp, State(*map(pad, state)), pmax, psum, cfg,
                                           [pad(r_y), pad(found)])
    stats = finalize(xp, state, r_y, found, pad(rows.active), cfg)
    return stats if m == n else Stats(*(f[:n] for f in stats))


def merge_splits(xp: Ops[A], parts: Iterable[A], cfg: Lowered) -> State[A]:
    """Merge S partial states given as one [N, S] array per State field (the last, Σ r, may
    be absent without label smoothing) into one State of [N] arrays, with the same
    rescaling as ``merge_collective``."""
    parts = list(parts)
    if len(parts) < len(State._fields):  # no Σ r without label smoothing
        parts.append(xp.zeros_like(parts[0]))
    keep_max = lambda values: [xp.rowmax(v)[:, None] for v in values]
    state, _ = merge_collective(xp, State(*parts), keep_max, lambda vs: [xp.rowsum(v) for v in vs],
                                cfg)
    sr = state.sr if cfg.SMOOTH else xp.zeros_like(state.a)
    return state._replace(m=state.m[:, 0], mu=state.mu[:, 0], sr=sr)


if TYPE_CHECKING:  # ROW_STATS spelled out, as State's fields above
    class Stats(NamedTuple, Generic[A]):
        lse: A
        logp: A
        entropy: A
        kl: A
        kl_shift: A
        m: A
        la: A
        la_ce: A
        mu: A
        la_u: A
else:
    Stats = NamedTuple("Stats", [(field, object) for field in ROW_STATS])

#: the statistics a call returns (``token_stats.op.TokenStats``' fields), ROW_STATS' first
PUBLIC_STATS = ("lse", "logp", "entropy", "kl")
assert ROW_STATS[:len(PUBLIC_STATS)] == PUBLIC_STATS


def public_stats(stats: Stats[A]) -> tuple[A, ...]:
    """The returned statistics of a row-statistics tuple (``Stats``), by their names'
    count: a new returned statistic is a name in PUBLIC_STATS, not an index in each caller."""
    return tuple(stats[:len(PUBLIC_STATS)])
Stats.__doc__ = """Per-row outputs and residuals, all [N] float32: lse = logsumexp(s),
logp = s'_y - logsumexp(s'), entropy = -Σ p log p, kl = KL(q || p) (0 without a teacher);
the residuals: kl_shift = E_q[x_u - x] = cu / au (so d(teacher) needs no cancellation of
log-normalisers), m = max r, la = log Σ e^x (lse = m / T + la), la_ce = log Σ e^{x'}
(== la when T_ce == T), mu = max u and la_u = log Σ e^{x_u} (0 without a teacher)."""


def kl_divergence(xp: Ops[A], a: A, au: A, cu: A, fu: A) -> A:
    """KL(q || p) [N] from a row's merged sums (module docstring), >= 0 (docs/design.md §2,
    "The KL"). With v = (cu - fu) / a = au / a - 1 and e = log(au / a) = la_u - la:

        KL = fu / au - psi(e)      where |e| <= 1: a sum of terms >= 0 less a term of the
                                   size of (E_p[y])²/2, no first-order cancellation
        KL = cu / au - e           elsewhere (the teacher's mass and the student's far apart:
                                   a large KL, whose terms are first order anyway)
    """
    e_far = xp.log(au) - xp.log(a)
    v = (cu - fu) / a
    near = (abs(e_far) <= 1.0) & (abs(v) < 2.0)  # (False where v is NaN: inf - inf)
    e = xp.where(near, xp.log1p(v), e_far)
    kl = xp.where(near, fu / au - _psi(xp, e), cu / au - e_far)
    return xp.where(kl < 0, 0.0, kl)  # rounding can leave -ulps; NaN stays NaN


def target_logit(xp: Ops[A], rows: Rows, cfg: Lowered, offset: A | int = 0) -> tuple[A, A]:
    """(r_y, found), both [N] f32: the shifted logit at the target column when this block of
    columns [offset, offset + C) of ``rows.logits`` holds the target (else 0), and 1.0 / 0.0
    for whether it does. Summed over vocabulary shards, found == 1 exactly when the target is
    in range.
    """
    z = rows.logits
    found, idx = target_column(xp, rows.targets, z.shape[-1], offset, cfg)
    return shifted_target(xp, xp.gather_cols(z, idx), found, rows, cfg)


def target_column(xp: Ops[A], targets: A, c: int, offset: A | int,
                  cfg: Lowered) -> tuple[A, A]:
    """(found [N] bool, local column [N], 0 where not found) of each target in the block of
    columns [offset, offset + c)."""
    local = targets - offset
    found = (local >= 0) & (local < c)
    if cfg.PADDED:
        found = found & (targets < cfg.vocab_limit)
    return found, xp.where(found, local, 0)


def shifted_target(xp: Ops[A], z_y: A, found: A, rows: Rows, cfg: Lowered) -> tuple[A, A]:
    """(r_y, found) as ``target_logit`` returns them, from the raw target logits z_y [N]."""
    r = shifted_logits(xp, z_y[:, None], rows.targets[:, None], rows.shift_ids, rows.shift,
                       cfg)[:, 0]
    return xp.where(found, r, 0.0), xp.where(found, 1.0, 0.0)


def target_logp(xp: Ops[A], r_y: A, found: A, m: A, la_ce: A, cfg: Lowered) -> A:
    """logp = (r_y - m) / T_ce - la_ce, [N] f32 (m the row's largest logit, la_ce the log of
    the sum relative to it); NaN where the target was not found (out of range: loud, never
    silently wrong)."""
    return xp.where(found > 0, _scaled(xp, r_y - m, cfg.inv_t_ce) - la_ce, float("nan"))


def column_mask(xp: Ops[A], cols: A, cfg: Lowered, valid: A | None = None) -> A | None:
    """[C] bool: columns that count (below ``cfg.vocab_limit``, and ``valid`` when given)."""
    if cfg.PADDED:
        limit = cols < cfg.vocab_limit
        valid = limit if valid is None else valid & limit
    return valid


def ce_objective(xp: Ops[A], logp_y: A, sr: A | None, m: A, la_ce: A, active: A,
                 cfg: Lowered) -> A:
    """The CE term's ``logp`` [N]: minus the per-row CE training loss at ``ce_temperature``,

        logp = (1 - ε)·log p'_y + ε·Σ_k log p'_k / K - λ·lse_ce²

    from the target's log p'_y (``target_logp``), the row's Σ r over its K valid columns
    (``sr``, logit units; None without label smoothing), its max m and log-sum la_ce
    (lse_ce = m / T_ce + la_ce); logp_y itself when ε = λ = 0. Inactive rows give exact
    zeros. A column at -inf (or finfo.min) makes the smoothed term -inf (or huge): torch's
    cross_entropy(label_smoothing=ε) alike."""
    if not cfg.CE_TERMS:
        return logp_y
    logp = logp_y
    if cfg.SMOOTH:
        assert sr is not None  # kept wherever it smooths
        eps = cfg.label_smoothing
        # (each per-row product rounded on its own: _scaled)
        mean = _scaled(xp, xp.rounded(sr * cfg.smooth_mean) - m, cfg.inv_t_ce) - la_ce
        logp = xp.rounded((1.0 - eps) * logp) + xp.rounded(eps * mean)
    if cfg.Z_LOSS:
        lse_ce = _scaled(xp, m, cfg.inv_t_ce) + la_ce
        logp = logp - xp.rounded(cfg.z_loss_weight * (lse_ce * lse_ce))
    return xp.where(active, logp, 0.0)


def ce_coefficients(xp: Ops[A], g_lp: A, stats: Stats[A],
                    cfg: Lowered) -> tuple[A, A | None, A]:
    """(g_y, g_u, g_p), each [N] f32: the CE term's gradient with respect to the shifted
    logits r is g_y·[k == y] + g_u·[k valid] - g_p·p'_k (then the softcap's chain), from the
    cotangent g_lp of ``ce_objective``'s logp:

        g_y = (1 - ε)·g_lp / T_ce,   g_u = ε / K·g_lp / T_ce,   g_p = (1 + 2λ·lse_ce)·g_lp / T_ce

    (g_y = g_p = g_lp / T_ce and g_u = 0 when ε = λ = 0). Each is rounded on its own
    (``xp.rounded``): the sums that take them run in other fused loops in other programs."""
    g = _scaled(xp, g_lp, cfg.inv_t_ce)
    if not cfg.CE_TERMS:
        return g, None, g
    eps, lam = cfg.label_smoothing, cfg.z_loss_weight
    g_y = xp.rounded(g * (1.0 - eps)) if cfg.SMOOTH else g
    g_u = xp.rounded(g * cfg.smooth_weight) if cfg.SMOOTH else None
    g_p = g
    if cfg.Z_LOSS:
        lse_ce = _scaled(xp, stats.m, cfg.inv_t_ce) + stats.la_ce
        g_p = xp.rounded(g * (1.0 + xp.rounded(2.0 * lam * lse_ce)))
    return g_y, g_u, g_p


def finalize(xp: Ops[A], state: State[A], r_y: A, found: A, active: A,
             cfg: Lowered) -> Stats[A]:
    """Row statistics from a merged state; logp is NaN where the target was not found
    (out of range: loud, never silently wrong) and carries label smoothing and z-loss
    (``ce_objective``); inactive rows give exact zeros."""
    la = xp.log(state.a)
    lse = _scaled(xp, state.m, cfg.inv_t) + la
    entropy = la - state.b / state.a if cfg.HAS_ENTROPY else xp.zeros_like(lse)
    la_ce = xp.log(state.a2) if cfg.SEPARATE_CE else la
    logp = ce_objective(xp, target_logp(xp, r_y, found, state.m, la_ce, cfg), state.sr,
                        state.m, la_ce, active, cfg)
    zero = xp.zeros_like(lse)
    kl, la_u, kl_shift = zero, zero, zero
    if cfg.HAS_TEACHER:
        la_u = xp.log(state.au)
        kl_shift = state.cu / state.au  # E_q[x_u - x]
        kl = kl_divergence(xp, state.a, state.au, state.cu, state.fu)
        kl = xp.where(xp.isfinite(lse), kl, float("nan"))  # no distribution p: no KL
    mu = state.mu if cfg.HAS_TEACHER else zero
    stats = dict(lse=lse, logp=logp, entropy=entropy, kl=kl, kl_shift=kl_shift, m=state.m,
                 la=la, la_ce=la_ce, mu=mu, la_u=la_u)
    dead = ~active
    return Stats(*(xp.zero_where(dead, stats[field]) for field in ROW_STATS))


def chunk_grads(xp: Ops[A], rows: Rows, cols: A, stats: Stats[A], grads: Sequence[A],
                cfg: Lowered, pointwise: bool = False) -> tuple[A, A | None]:
    """d(student logits) and d(teacher logits) of one chunk, both [N, C] float32 (``rows``:
    the bundle over the chunk's columns, as in ``chunk_partial``).

    With p = softmax(r/T), p' = softmax(r/T_ce), q = softmax(u/T_kl):
      dr_k = [g_lse·p_k - g_H·p_k·(log p_k + H) + g_kl·(p_k - q_k)] / T
             + g_y·[k == y] + g_u·[k valid] - g_p·p'_k
    (``ce_coefficients``: g_y = g_p = g_lp / T_ce, g_u = 0 without label smoothing and
    z-loss)
      dz_k = dr_k·cap'(z_k);   du_k = g_kl·q_k·(log q_k - log p_k - kl) / T_kl
    with log p_k = (r_k - m)/T - la (the saved row max and log-sum: no difference of scaled
    logits) and log q_k - log p_k - kl computed as (x_u - x)_k - E_q[x_u - x]
    (stats.kl_shift).
    Terms with p_k = 0 (or q_k = 0) contribute exactly 0. Inactive rows give exact zeros.
    ``cols`` are contiguous global ids. Written as few [N, C] passes as the math allows (each
    is a pass over memory in an eager framework): the per-row factors of p are gathered into
    one [N, 1] coefficient, and the target's g_lp / T_ce is added at one column per row.
    ``pointwise``: the shift and the target's term by a compare and a select instead (as in
    ``chunk_partial``: for a compiler).
    Every per-row factor a product takes is rounded on its own (``_scaled``); the [N, C]
    products a sum takes (the scaled logits, p times its factor, the entropy's and the KL's
    terms) only where ``cfg.ROUND_TILES``: a LinearHead's token chunks put this tile code in
    other fused loops by their row count, and XLA contracted a product into its sum in some
    and not in others (a row's d hidden an ulp apart alone and in a batch). Logits given as
    arrays run it in row blocks inside loops whose trip count XLA cannot see: the blocks'
    heights vary with N, but one fused loop holds a tile's whole chain of products and sums
    at every height, contracted alike (the invariance tests hold this), and the select
    would cost that loop half its speed on a CPU (docs/design.md §2).
    """
    z, u, targets, active = rows.logits, rows.teacher, rows.targets, rows.active
    if pointwise:
        r = shifted_logits(xp, z, cols[None, :], rows.shift_ids, rows.shift, cfg)
    else:
        r = chunk_logits(xp, z, cols[0], rows.shift_ids, rows.shift, cfg)
    tiles = cfg.ROUND_TILES  # the [N, C] products a sum takes rounded on their own, or not
    tile = xp.rounded if tiles else _unrounded
    d = r - stats.m[:, None]  # [N, C] logit differences
    x = _scaled(xp, d, cfg.inv_t, summed=tiles)
    logp_k = x - stats.la[:, None]
    p = xp.exp(logp_k)
    g_lse, g_lp, g_h, g_kl = grads
    inv_t = cfg.inv_t
    g_y, g_u, g_p = ce_coefficients(xp, g_lp, stats, cfg)  # [N] each (g_u None: 0)
    # every product a sum takes: a row's factor rounded on its own (_scaled), a tile's by tile
    coef = _scaled(xp, g_lse, inv_t)  # [N]: the factor of p_k in dr
    if not cfg.SEPARATE_CE:
        coef = coef - g_p  # p' = p
    coef = coef[:, None]
    if cfg.HAS_ENTROPY:  # (without it g_h is the cotangent of nothing)
        coef = coef - tile(_scaled(xp, g_h, inv_t)[:, None] * xp.where(
            p > 0, logp_k + stats.entropy[:, None], 0.0))
    dr = tile(p * coef)
    du = None
    if cfg.HAS_TEACHER:
        xu = _scaled(xp, xp.f32(u) - stats.mu[:, None], cfg.inv_t_kl, summed=tiles)
        q = xp.exp(xu - stats.la_u[:, None])
        dr = dr + tile(_scaled(xp, g_kl, inv_t)[:, None] * (p - q))  # float32 p - q
        if cfg.TEACHER_GRAD:
            # log q - log p - kl = (x_u - x) - E_q[x_u - x]: no cancellation of log-normalisers
            du = g_kl[:, None] * xp.where(q > 0, q * ((xu - x) - stats.kl_shift[:, None]), 0.0)
            du = xp.where(active[:, None], du * cfg.inv_t_kl, 0.0)
    if cfg.SEPARATE_CE:
        dr = dr - tile(g_p[:, None] * xp.exp(_scaled(xp, d, cfg.inv_t_ce, summed=tiles)
                                             - stats.la_ce[:, None]))
    if g_u is not None:  # label smoothing's uniform term (padding columns are zeroed below)
        dr = dr + g_u[:, None]
    if pointwise:
        dr = dr + xp.where(cols[None, :] == targets[:, None], g_y[:, None], 0.0)
    else:
        dr = _add_at(xp, dr, targets, cols[0], g_y)  # the target's column, when in this chunk
    if cfg.HAS_SOFTCAP:
        dr = dr * softcap_slope(xp, xp.f32(z), cfg.softcap)
    dz = xp.where(active[:, None], dr, 0.0)
    if cfg.PADDED:  # padding columns get exact zeros
        keep = (cols < cfg.vocab_limit)[None, :]
        dz = xp.where(keep, dz, 0.0)
        du = None if du is None else xp.where(keep, du, 0.0)
    return dz, du


def _unrounded(x: A) -> A:
    return x


def shift_grad(xp: Ops[A], columns: tuple[A, A | None, A], rows: Rows, stats: Stats[A],
               grads: Sequence[A], cfg: Lowered) -> A:
    """d(Σ cotangent·stats) / d shift, [N] float32: the gradient dr of ``chunk_grads`` at
    each row's shifted column x (the shift is added after the cap, so no cap' factor):

      dr_x = [g_lse·p_x - g_H·p_x·(log p_x + H) + g_kl·(p_x - q_x)] / T
             + g_y·[x == y] + g_u - g_p·p'_x      (``ce_coefficients``)

    columns: (z_x, u_x, found) of ``shift_columns``: [N] student and teacher logits at
    column x (u_x None without a teacher), and [N] bool, x lies in these columns (a
    vocabulary shard holds it, or not). The terms are those of ``chunk_grads`` for one
    column per row; 0 where not found or inactive.
    """
    z_x, u_x, found = columns
    x, targets = rows.shift_ids, rows.targets
    r = shifted_logits(xp, z_x[:, None], x[:, None], x, rows.shift, cfg)  # [N, 1]
    d = r - stats.m[:, None]  # a logit difference, as in chunk_grads
    # every product a sum takes rounded on its own (_scaled)
    logp_k = _scaled(xp, d, cfg.inv_t) - stats.la[:, None]
    p = xp.exp(logp_k)
    g_lse, g_lp, g_h, g_kl = (g[:, None] for g in grads)
    inv_t = cfg.inv_t
    g_y, g_u, g_p = ce_coefficients(xp, grads[1], stats, cfg)  # [N] each (g_u None: 0)
    g_p = g_p[:, None]
    coef = _scaled(xp, g_lse, inv_t)
    if not cfg.SEPARATE_CE:
        coef = coef - g_p
    if cfg.HAS_ENTROPY:
        coef = coef - xp.rounded(_scaled(xp, g_h, inv_t)
                                 * xp.where(p > 0, logp_k + stats.entropy[:, None], 0.0))
    dr = xp.rounded(p * coef)
    if cfg.HAS_TEACHER:
        assert u_x is not None  # ``shift_columns`` reads it where there is a teacher
        q = xp.exp(_scaled(xp, xp.f32(u_x[:, None]) - stats.mu[:, None], cfg.inv_t_kl)
                   - stats.la_u[:, None])
        dr = dr + xp.rounded(_scaled(xp, g_kl, inv_t) * (p - q))
    if cfg.SEPARATE_CE:
        dr = dr - xp.rounded(g_p * xp.exp(_scaled(xp, d, cfg.inv_t_ce)
                                          - stats.la_ce[:, None]))
    dr = dr[:, 0] + xp.where(x == targets, g_y, 0.0)
    if g_u is not None:  # the shifted column is a valid one (``found``)
        dr = dr + g_u
    return xp.where(found & rows.active, dr, 0.0)


def shift_columns(xp: Ops[A], rows: Rows, cfg: Lowered,
                  offset: A | int = 0) -> tuple[A, A | None, A]:
    """(z_x, u_x, found) for ``shift_grad`` from rows whose logits (and teacher) are
    [N, K] arrays holding the columns [offset, offset + K): two gathers, O(N). Read them
    before a backward writes its gradient over the logits (``inplace_grad``)."""
    found, idx = target_column(xp, rows.shift_ids, rows.logits.shape[1], offset, cfg)
    z_x = _column(xp, rows.logits, idx)
    u_x = None if rows.teacher is None else _column(xp, rows.teacher, idx)
    return z_x, u_x, found


def _column(xp: Ops[A], x: A | LogitsSource[A], idx: A) -> A:
    """[N] float32: x[n, idx[n]] of [N, K] logits, or of a linear head's (one dot product
    of D per row with the gathered row of the weight: O(N·D), no logits)."""
    return as_logits(x).column(xp, idx)


def _finite_max(xp: Ops[A], v: A) -> A:
    """The row max of v [N, K] as a constant (no gradient), 0 where it is not finite."""
    m = xp.stop_gradient(xp.rowmax(v))
    return xp.where(xp.isfinite(m), m, 0.0)


def reference_stats(xp: Ops[A], rows: Rows, cfg: Lowered) -> tuple[A, ...]:
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
    # gradient NaN, as the streaming backends give (inf - inf); r·NaN makes both so. The
    # rows without a distribution are found by counting their NaN and +inf entries, and
    # their lse set to NaN explicitly: XLA on a CPU compiled the propagation (max(row) ==
    # inf, then NaN through max, exp and sum) so that a jitted forward-and-VJP program gave
    # such a row a finite lse (tests/token_stats/test_reference.py)
    r_seen = xp.stop_gradient(r)
    plus_inf = xp.rowsum(xp.where(r_seen == float("inf"), 1.0, 0.0)) > 0
    no_dist = plus_inf | (xp.rowsum(xp.where(r_seen != r_seen, 1.0, 0.0)) > 0)
    r = r * xp.where(plus_inf, float("nan"), 1.0)[:, None]
    # exponents as differences of logits scaled afterwards (module docstring): x = (r - m)/T
    # with m the row max, a constant to autodiff (lse's gradient does not depend on it)
    m = _finite_max(xp, r)
    d = r - m[:, None]
    x = d * cfg.inv_t
    no_inf = lambda v: xp.where(v == float("inf"), float("nan"), v)  # noqa: E731
    la = no_inf(xp.logsumexp(x))
    # every per-row product a sum takes rounded on its own (``_scaled``), as the streaming
    # backends' ``finalize`` and ``ce_objective`` do: XLA fused them into the sums otherwise,
    # in some batch sizes and not in others (tests/token_stats/test_invariance.py)
    lse = xp.where(no_dist, float("nan"), _scaled(xp, m, cfg.inv_t) + la)
    logp_all = x - la[:, None]
    p = xp.exp(logp_all)
    pos = p > 0
    entropy = -xp.rowsum(xp.where(pos, p * xp.where(pos, logp_all, 0.0), 0.0))
    # no distribution (NaN, +inf or an all -inf row): no entropy either, not the empty sum 0
    entropy = xp.where(xp.isfinite(lse), entropy, float("nan"))
    x_ce = d * cfg.inv_t_ce
    la_ce = no_inf(xp.logsumexp(x_ce)) if cfg.SEPARATE_CE else la
    in_range = (targets >= 0) & (targets < k)
    y = xp.where(in_range, targets, 0)
    logp = xp.where(in_range, xp.gather_cols(x_ce, y) - la_ce, float("nan"))
    if cfg.SMOOTH:  # Σ_k log p'_k / K over the row's K columns (the oracle's form)
        eps = cfg.label_smoothing
        mean = xp.rounded(xp.rowsum(x_ce) * (1.0 / k)) - la_ce
        logp = xp.rounded((1.0 - eps) * logp) + xp.rounded(eps * mean)
    if cfg.Z_LOSS:
        lse_ce = _scaled(xp, m, cfg.inv_t_ce) + la_ce
        logp = logp - xp.rounded(cfg.z_loss_weight * (lse_ce * lse_ce))
    kl = xp.zeros_like(lse)
    if cfg.HAS_TEACHER:
        u = xp.where(active[:, None], xp.f32(u), 0.0)
        if not cfg.TEACHER_GRAD:
            u = xp.stop_gradient(u)
        xu = (u - _finite_max(xp, u)[:, None]) * cfg.inv_t_kl
        la_u = xp.logsumexp(xu)
        q = xp.exp(xu - la_u[:, None])
        qpos = q > 0
        # KL = E_q[x_u - x] - la_u + la: the same value as Σ q (log q - log p), but its
        # autodiff gradient q·((x_u - x) - E_q[x_u - x]) avoids cancelling log-normalisers.
        # Its value cancels (E_q[x_u - x] and la_u - la agree to first order: the T² of
        # distillation at a large T magnifies that), so the value is the form every backend
        # computes.
        diff = xp.where(qpos, xu, 0.0) - xp.where(qpos, x, 0.0)
        kl_grad = xp.rowsum(xp.where(qpos, q * diff, 0.0)) - la_u + la
        kl = _row_kl(xp, xp.stop_gradient(x), xp.stop_gradient(u), lse, cfg)
        kl = xp.where(xp.isfinite(kl_grad), kl + (kl_grad - xp.stop_gradient(kl_grad)), kl_grad)
    return tuple(xp.where(active, v, 0.0) for v in (lse, logp, entropy, kl))


def _row_kl(xp: Ops[A], x: A, u: A, lse: A, cfg: Lowered) -> A:
    """KL(softmax(u / T_kl) || p) [N] of whole rows, x = (r - m) / T and u [N, K], as the
    streaming backends compute it (``teacher_sums`` over one chunk, ``kl_divergence``); NaN
    where lse is not finite (no distribution)."""
    a, _, e = _row_sums(xp, x, False)
    _, au, cu, fu = teacher_sums(xp, u, x, e, cfg)
    return xp.where(xp.isfinite(lse), kl_divergence(xp, a, au, cu, fu), float("nan"))
