"""The fused denoising step, written once for both front ends: per row of logits, one pass
over the vocabulary draws a token and measures how sure the model is; cheap [B, L] rules
then choose which masked positions to commit.

Per row, with z the logits (after classifier-free guidance ``z_u + (s + 1)(z_c - z_u)``,
suppressed ids set to -inf) and s = z / T (s = z at T = 0), the stream keeps:

  (m, a, b)      the token statistics' own streaming state of the logits z at T_s (m the
                 largest z, a = Σ e^x, b = Σ e^x·x with x = (z - m)/T_s), formed and merged by
                 the token-statistics arithmetic (``token_stats.formulas``: ``chunk_partial``,
                 ``merge``) or by the very kernels of the backend's token statistics
  (v1, i1, v2)   the largest s with its id (ties: the lowest id) and the runner-up value
  (gv, gi, gz)   the largest sd + g with its id and its logit z, g the Gumbel noise of the
                 column, sd = z / T the draw's scores (s itself unless ``stats_temperature``
                 differs)
  or, with top_k, the k largest (sd, id), merged chunk by chunk (ties: lowest ids first)

and finalises: token = gi (i1 at T = 0: greedy), logp = log-probability of the token under
the sampling distribution (with ``stats_temperature`` T_s every statistic is taken over s =
z / T_s while the draw's key reads z / T: ``SampleConfig.two_temperatures``), argmax = i1,
top1_logp / top2_logp, entropy. With ``top_k`` the sampling distribution is the softmax over
the k largest (renormalised) and every statistic is taken under it. At T = 0 the statistics
are those of softmax(z) (T = 1). A row whose largest s plus log a is not finite (a NaN or
+inf s, or none finite) has no valid draw: token and argmax -1, NaN statistics (``Sample``);
the commit rules never pick it.

Rollout = trainer (docs/design.md §3): without top_k the drawn token's logp and the entropy
are the token statistics' ``finalize`` of that state with the token as the target (``Stats``
of ``stream_stats``, the backend's finalize kernel, or its forward itself), so on plain
logits (no guidance, no suppressed ids) they are, bit for bit, what ``per_token_logps(...,
temperature=T_s, return_entropy=True)`` (``token_stats`` with the same ``chunk_size``)
returns for the drawn tokens on the same backend.

Noise: g = -log(-log(u)), u = ((h >> 9) + 1/2)·2^-23 in (0, 1), h a 32-bit hash of
(seed, step, row, column) -- with [B] seeds, of (seed_b, step, position, column) --:
``row_keys(seed, step, ...)`` once per row, then
h = mix(row_key ^ mix(column)) per element, ``mix`` the lowbias32 integer finaliser (two
multiplies, three xor-shifts). Every backend computes the same integers, so the same seed
draws the same tokens everywhere; no noise tensor is ever an input or an output.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import numpy as np

from .._checks import (as_number, dtype_str, flag, host_values, plain, require_array,
                       require_float, require_int, require_logits, require_real, require_shape,
                       shape_str)
from .._config import make_config
from .._framework import Framework
from .._rows import Rows
from ..linear_head.head import as_logits
from ..kernels.layout import SAMPLE_IDS, SAMPLE_STATE
from ..token_stats import formulas as stats_math
from ..token_stats.lowering import Lowered, lower

MASK32 = 0xFFFFFFFF
# lowbias32, step by step: x ^= x >>> shift, then x *= multiplier (mod 2^32) where one is given
MIX_STEPS = ((16, 0x7FEB352D), (15, 0x846CA68B), (16, None))
_STEP_SALT, _ROW_SALT = 0x9E3779B9, 0x85EBCA6B
MAX_TOP_K = 64
_F32_MAX = 3.4028234663852886e38
# The sampler's smallest temperature above 0, for its temperature and stats_temperature
# (docs/design.md §3; the token statistics' own floor, 2^-102, is _config's
# FLOAT32_MIN_TEMPERATURE, far below it): s = z / T is float32, and every
# decision reads s + g rounded to an ulp of |s| (2^-23·|z| / T); at T >= 1e-3 that is below
# 2^-7 nats for logits |z| < 2^6, and below it T = 0 (greedy) is the limit to use.
MIN_SAMPLING_TEMPERATURE = 1e-3


class _SampleFields(NamedTuple):
    """The fields of ``Sample`` (a NamedTuple cannot carry ``vocab_size`` beside them)."""

    token: Any  # a torch.Tensor in dlm_kernels.torch, a jax.Array in dlm_kernels.jax
    logp: Any
    argmax: Any
    top1_logp: Any
    top2_logp: Any
    entropy: Any


class Sample(_SampleFields):
    """Per-row outputs of :func:`sample_tokens`, each with the logits' leading shape.

    token:     int32, the drawn token (greedy at temperature 0).
    logp:      float32, its log-probability under the sampling distribution (at
               ``stats_temperature`` where one is given, as every statistic here).
    argmax:    int32, the most likely token (ties: the lowest id).
    top1_logp, top2_logp: float32, the two largest log-probabilities (-inf when K = 1).
    entropy:   float32, the entropy of the sampling distribution.

    A row with no valid draw -- a NaN or +inf scaled logit anywhere in it (with or without
    top_k; an s = z / T that overflows float32 counts as +inf), or no finite one -- has
    token -1 and argmax -1, and NaN logp, top1_logp, top2_logp and entropy, so every
    confidence of ``commit_tokens`` is NaN there; ``commit_tokens`` never commits it.

    ``vocab_size`` (an attribute, not a field: static under ``jit``, where the JAX front end
    keeps it as pytree metadata) is K of the logits drawn from, or None when unknown (a Sample
    built by hand without it); ``commit_tokens`` checks the canvas's dtype against it.
    """

    vocab_size: int | None = None

    def __new__(cls, token: Any, logp: Any, argmax: Any, top1_logp: Any, top2_logp: Any,
                entropy: Any, vocab_size: int | None = None) -> Sample:
        self = super().__new__(cls, token, logp, argmax, top1_logp, top2_logp, entropy)
        if vocab_size is not None:
            self.vocab_size = int(vocab_size)
        return self

    # typeshed declares NamedTuple._replace final; this one keeps vocab_size, an attribute
    # beside the fields
    def _replace(self, **fields: Any) -> Sample:  # pyright: ignore[reportIncompatibleMethodOverride]
        return Sample(*_SampleFields._replace(self, **fields), vocab_size=self.vocab_size)


class SampleConfig(NamedTuple):
    temperature: float  # of the draw: 0 is greedy
    top_k: int | None  # None or an int in [1, MAX_TOP_K]
    cfg_scale: float
    has_uncond: bool
    chunk_size: int | None
    stats_temperature: float = 1.0  # of the statistics (the draw's T unless given; 1 at T = 0)

    @property
    def greedy(self):
        """T = 0: the draw is the argmax."""
        return self.temperature == 0.0

    @property
    def two_temperatures(self):
        """The draw's scores z / T differ from the statistics' z / T_s (both T > 0)."""
        return self.temperature > 0.0 and self.stats_temperature != self.temperature

    def lowered(self) -> SampleLowered:
        """The call as the sampler kernels take it: the one place their flags, scalars and
        stand-ins are derived (every backend's ``sample`` reads this)."""
        return SampleLowered(
            temperature=self.temperature or 1.0, stats_temperature=self.stats_temperature,
            cfg_c=self.cfg_scale + 1.0, top_k=self.top_k or 0, block_k=self.chunk_size,
            GREEDY=self.greedy, TWO_T=self.two_temperatures)


class SampleLowered(NamedTuple):
    """A sampling call as the kernels take it (``SampleConfig.lowered``).

    temperature:        T of the draw; 1.0, the stand-in (never read), at T = 0.
    stats_temperature:  T_s of the statistics (read with TWO_T only).
    cfg_c:              guidance's s + 1 (read with an unconditional row only).
    top_k:              k, 0 without top-k.
    block_k:            the vocabulary block asked for (the call's chunk_size); None: each
                        backend's plan.
    GREEDY, TWO_T:      T = 0 (the draw is the argmax); T_s differs from T (both > 0).
    """

    temperature: float
    stats_temperature: float
    cfg_c: float
    top_k: int
    block_k: Any
    GREEDY: bool
    TWO_T: bool


def stats_lowered(cfg: SampleConfig) -> Lowered:
    """The token-statistics call whose arithmetic the step's statistics are: ``token_stats``
    (``per_token_logps``) at temperature T_s with the entropy, no shift, teacher or softcap,
    and the step's ``chunk_size`` (docs/design.md §3, "Rollout = trainer")."""
    return _stats_lowered(cfg.stats_temperature, cfg.chunk_size)


@functools.lru_cache(maxsize=64)
def _stats_lowered(stats_temperature: float, chunk_size) -> Lowered:
    return lower(make_config(temperature=stats_temperature, entropy=True,
                             chunk_size=chunk_size), has_shift=False)


# -- the counter-based noise ----------------------------------------------------------------

def mix(xp, x):
    """lowbias32 of 32-bit integers held as xp.u32 arrays (logical shifts, products modulo
    2^32 that never rely on a wrapping signed product)."""
    for shift, multiplier in MIX_STEPS:
        x = x ^ xp.shr(x, shift)
        if multiplier is not None:
            x = xp.u32_mul(x, multiplier)
    return x


def row_keys(xp, seed, step, n, like):
    """[N] 32-bit keys of rows 0..N-1 for (seed, step): one seed (an int or a 0-d array) keys
    row r = the flattened row index; [B] seeds (one per sequence, N = B·P) key row b·P + p on
    (seed_b, p), its position inside its own sequence, so a sequence draws the same noise
    whatever its batch neighbours (docs/design.md §3, the noise)."""
    salt = mix(xp, xp.u32(step) ^ xp.u32(_STEP_SALT))
    if not xp.is_array(seed) or len(seed.shape) == 0:
        rows = xp.u32(xp.arange(n, like))
        return mix(xp, rows ^ xp.u32(_ROW_SALT) ^ mix(xp, xp.u32(seed) ^ salt))
    b = seed.shape[0]
    per = n // b if b else 0
    position = xp.u32(xp.arange(per, like))  # [P]
    base = mix(xp, xp.u32(seed) ^ salt)  # [B]
    return mix(xp, position[None, :] ^ xp.u32(_ROW_SALT) ^ base[:, None]).reshape(-1)


def position_uniform(xp, keys):
    """[N] float32 uniforms in (0, 1), one per row key: the noise's uniform at the column id
    2^32 - 1, which no vocabulary reaches (``remasking="random"``'s confidence)."""
    return open_uniform(xp, mix(xp, keys ^ mix(xp, xp.u32(MASK32))))


def gumbel(xp, keys, cols):
    """[N, C] float32 Gumbel noise for row keys [N] and global column ids: [C] shared by
    every row, or [N, C] per row (the top-k ids)."""
    col_keys = mix(xp, xp.u32(cols))
    h = mix(xp, keys[:, None] ^ (col_keys[None, :] if len(cols.shape) == 1 else col_keys))
    return -xp.log(-xp.log(open_uniform(xp, h)))


def open_uniform(xp, h):
    """float32 u strictly inside (0, 1) from 32-bit hashes: ((h >> 9) + 1/2)·2^-23, 2^23
    values from 2^-24 to 1 - 2^-24, each exact in float32. (With 24 bits the largest,
    (2^24 - 1/2)·2^-24, rounds to 1.0 in float32: g = +inf, and that column would be drawn
    whatever its probability, in about one row in 64 at K = 262144.)"""
    return (xp.f32(xp.shr(h, 9)) + 0.5) * (2.0 ** -23)


# -- the stream -----------------------------------------------------------------------------

def scaled_logits(xp, z, zu, cols, suppress, cfg):
    """(z, s, sd) [N, C] float32 of one chunk with global column ids cols ([C], or [N, C] per
    row): z the logits after guidance, suppressed ids at -inf; s = z / T_s (the statistics'
    scale) and sd = z / T (the draw's scores; the same array as s unless the temperatures
    differ; both z itself at T = 0). The statistics' exponents are differences of z, taken
    before scaling (``exponents``); s and sd make the decisions (maxima, the draw)."""
    z = xp.f32(z)
    if zu is not None:
        zu = xp.f32(zu)
        z = zu + (cfg.cfg_scale + 1.0) * (z - zu)
    if suppress is not None:
        z = xp.where(xp.isin(cols, suppress), float("-inf"), z)  # [C] or [N, C] hits
    if cfg.temperature == 0.0:
        return z, z, z
    s = _over(z, cfg.stats_temperature)
    return z, s, _over(z, cfg.temperature) if cfg.two_temperatures else s


def _over(x, t):
    """x / t, x itself at t = 1 (the same values: one [N, C] pass less in eager frameworks)."""
    return x if t == 1.0 else x / t


def exponents(xp, z, z1, cfg):
    """(z - z1) / T_s: the statistics' exponents of logits z [N, C] (or [N]) relative to the
    logit z1 [N, 1] (or [N]) at the largest s, from logit differences taken before scaling, as
    token_stats forms them (docs/design.md §2): a logit tied with z1 gets exactly 0 whatever
    a compiler fuses. (s - m, with s = z / T recomputed as z·(1/T) inside a fusion and
    contracted with the subtraction into one fused multiply-add, gives a tie the rounding
    error of m instead: 2e-4 at T = 1e-3 under jax.jit on CPU.) T_s is 1 at T = 0."""
    return _over(z - z1, cfg.stats_temperature)


class StreamState(NamedTuple):
    """One row's stream over the columns seen (the layout of the kernels' split buffers,
    ``kernels.layout.SAMPLE_STATE``). m, a, b are the token statistics' streaming state of
    the logits at T_s (``token_stats.formulas.State``; None where a backend's token-statistics
    kernels hold them instead); the draw's fields are in units of s. Where the framework code
    forms them, v1 is a maximum of s (a reduction, never a gather of a scaled chunk) and v2
    is the largest s plus a difference of logits (``exponents``), so a tie with the largest
    s is v1 itself, bit for bit."""

    m: object  # [N] running max of the logits z (-inf while none is finite)
    a: object  # [N] Σ e^x, x = (z - m)/T_s
    b: object  # [N] Σ e^x·x
    v1: object
    i1: object
    v2: object  # the second largest s (a tie with v1 counts: v2 == v1)
    gv: object  # [N] best s + g
    gi: object
    gz: object  # the logit z at gi
    topv: object  # [N, k] or None
    topi: object


def _safe(xp, v1, x):
    """x where the row has a finite or NaN largest s v1, 0 where every s is -inf (no inf - inf
    below)."""
    return xp.where(v1 == float("-inf"), 0.0, x)


def stats_partial(xp, z, cols, cfg):
    """The token-statistics State (``token_stats.formulas.State``: m, a, b and fields the step
    does not read) of one chunk z [N, C] (float32, guided, suppressed ids and columns of
    other chunks at -inf) of global column ids cols [C]: ``token_stats.formulas.chunk_partial``
    itself."""
    return stats_math.chunk_partial(xp, Rows(z), cols, None, stats_lowered(cfg))


def merge_stats(xp, x, y, cfg):
    """The token-statistics State of the columns of x followed by those of y (States):
    ``token_stats.formulas.merge`` itself, as the token statistics' chunk loops merge."""
    return stats_math.merge(xp, x, y, stats_lowered(cfg))


def _stats_state(xp, st):
    """A token-statistics State of a stream's (m, a, b) (the fields it does not keep: 0)."""
    zero = xp.zeros_like(st.a)
    return stats_math.State(st.m, st.a, st.b, st.a, st.m, zero, zero, zero, zero)


def stats_target(st, cfg):
    """[N] the id whose log-probability is the step's logp: the drawn token gi, or the
    largest s's id i1 at T = 0 and with top_k (whose logp comes from its k slots)."""
    return st.gi if cfg.temperature > 0.0 and cfg.top_k is None else st.i1


def stream_stats(xp, st, cfg):
    """The token statistics (``token_stats.formulas.Stats``) of a stream's merged (m, a, b), the
    target ``stats_target``: ``token_stats.formulas.finalize`` itself, with the target's logit
    the drawn token's gz (the largest logit m at T = 0, where the token is its argmax, and
    with top_k, whose logp is not read)."""
    one = xp.zeros_like(st.a) + 1.0
    r_y = st.gz if cfg.temperature > 0.0 and cfg.top_k is None else st.m
    return stats_math.finalize(xp, _stats_state(xp, st), r_y, one, one > 0,
                               stats_lowered(cfg))


def _first_max(xp, x, cols):
    """(max, lowest column id reaching it) along rows of x [N, C]; cols [C] contiguous ids."""
    v, i = xp.first_max(x)  # one pass; the first position of the maximum
    return v, i + cols[0]


def chunk_state(xp, z, s, sd, cols, keys, cfg):
    """The state of one chunk (``scaled_logits``' z, s, sd [N, C]) with global column ids
    cols [C]."""
    v1, i1 = _first_max(xp, s, cols)
    ms = _safe(xp, v1, v1)
    z1 = _safe(xp, v1, xp.gather_cols(z, i1 - cols[0]))  # [N] the logit at the largest s
    m, a, b = stats_partial(xp, z, cols, cfg)[:3]
    # the runner-up: the largest s plus the exponent of the second largest z (the same
    # order as s's)
    v2 = (ms + exponents(xp, xp.second_max(z), z1, cfg) if s.shape[1] > 1
          else v1 * 0.0 + float("-inf"))
    gv, gi, gz = v1 * 0.0, i1 * 0, v1 * 0.0  # unused at T = 0 and with top_k
    if cfg.temperature > 0.0 and cfg.top_k is None:
        key = sd + gumbel(xp, keys, cols)
        gv, gi = _first_max(xp, key, cols)
        gz = xp.gather_cols(z, gi - cols[0])
    topv = topi = None
    if cfg.top_k is not None:
        topv, idx = xp.top_k(sd, min(cfg.top_k, s.shape[1]))  # the draw's scores
        topi = xp.take_cols(cols, idx)
    return StreamState(m, a, b, v1, i1, v2, gv, gi, gz, topv, topi)


def noisy_scores(xp, keys):
    """(s [N, C], cols [C] or [N, C]) -> s + g, the scores whose maximum is the draw."""
    return lambda s, cols: s + gumbel(xp, keys, cols)


def chunk_values(xp, z, s, sd, cols, index, noisy, cfg):
    """The state of one chunk (``scaled_logits``' z, s, sd [N, C], global ids cols [C])
    without positions, for the two-pass stream (no top_k): the chunk's number ``index`` [N]
    int32 stands in for i1 and gi (None where the caller numbers the chunks itself, as
    ``merge_splits`` does), and v2 is -inf. Merged like any chunk state, the result says
    which chunk holds each row's largest s and which its largest s + g (the first on ties:
    the lowest ids), and its v2 is the largest s of the other chunks; ``settle`` then finds
    the positions inside those two chunks. Only maxima here, because finding a maximum's
    position costs a CPU many times the maximum itself (torch's argmax about 10x its amax;
    XLA's about 18x, and fused with the noise about 100x)."""
    v1 = xp.rowmax(s)
    m, a, b = stats_partial(xp, z, cols, cfg)[:3]
    none = xp.full(v1.shape, float("-inf"), v1)
    gv = none if cfg.temperature == 0.0 else xp.rowmax(noisy(sd, cols))
    return StreamState(m, a, b, v1, index, none, gv, index, xp.zeros_like(v1), None, None)


def settle(xp, st, reread, noisy, cfg):
    """The merged ``chunk_values`` state with its positions: ``reread(chunk [N])`` gives
    (z, s, sd, cols) [N, C] of one chunk per row (columns outside it at -inf), read once for
    the chunk holding the largest s (its first position, and the runner-up inside it) and,
    when drawing, once for the chunk holding the largest s + g. The runner-up and the drawn
    token's s are m plus their logits' difference from the largest s's (``exponents``)."""
    z, s, _, cols = reread(st.i1)
    _, pos = xp.first_max(s)
    z1 = _safe(xp, st.v1, xp.gather_cols(z, pos))  # [N] the logit at the largest s
    inside = xp.where(xp.arange(s.shape[1], s)[None, :] == pos[:, None], float("-inf"), z)
    st = st._replace(i1=xp.gather_cols(cols, pos), v2=xp.maximum(
        st.v2, _safe(xp, st.v1, st.v1) + exponents(xp, xp.rowmax(inside), z1, cfg)))
    if cfg.temperature > 0.0:
        z, _, sd, cols = reread(st.gi)
        _, pos = xp.first_max(noisy(sd, cols))
        st = st._replace(gi=xp.gather_cols(cols, pos), gz=xp.gather_cols(z, pos))
    return st


def _pick(xp, take_b, a, b):
    return xp.where(take_b, b, a)


def merge_state(xp, x, y, cfg):
    """Merge the state of columns seen (x) with a later chunk (y): every id in y is larger."""
    m, a, b = merge_stats(xp, _stats_state(xp, x), _stats_state(xp, y), cfg)[:3]
    take = y.v1 > x.v1  # a tie keeps x's (lower) id
    v1, i1 = _pick(xp, take, x.v1, y.v1), _pick(xp, take, x.i1, y.i1)
    # the runner-up: the larger of x's second and y's first when x leads, else of x's
    # first and y's second
    v2 = xp.maximum(_pick(xp, take, x.v2, x.v1), _pick(xp, take, y.v1, y.v2))
    tg = y.gv > x.gv
    gv, gi, gz = (_pick(xp, tg, x.gv, y.gv), _pick(xp, tg, x.gi, y.gi),
                  _pick(xp, tg, x.gz, y.gz))
    topv = topi = None
    if cfg.top_k is not None:
        topv, topi = xp.merge_top_k(x.topv, x.topi, y.topv, y.topi, cfg.top_k)
    return StreamState(m, a, b, v1, i1, v2, gv, gi, gz, topv, topi)


def merge_splits(xp, state, ids, top_v, top_i, cfg, k):
    """The StreamState [N] of S vocabulary splits at once (the Triton kernel's buffers):
    state [len(SAMPLE_STATE), S, N] float32 and ids [len(SAMPLE_IDS), S, N] int32
    (``kernels.layout``), split s holding lower ids than split s + 1; with top_k, top_v /
    top_i [N, S·k] the splits' unsorted slots (unused ones -inf). The draw's fields merge as
    in ``merge_state``, over the split axis; the statistics' (m, a, b) are left to the
    token statistics' own merge (None here: the Triton finalize kernel, or a stream's
    chunk by chunk ``merge_stats``)."""
    f = {name: state[i].T for i, name in enumerate(SAMPLE_STATE)}  # each [N, S]
    i1s, gis = (ids[i].T for i in range(len(SAMPLE_IDS)))
    neg_inf = float("-inf")
    v1, lead = xp.first_max(f["v1"])  # ties: the first split, which holds the lower ids
    splits = xp.arange(f["v1"].shape[1], v1)
    v2 = xp.maximum(xp.rowmax(f["v2"]),
                    xp.rowmax(xp.where(splits[None, :] == lead[:, None], neg_inf, f["v1"])))
    gv, gpos = xp.first_max(f["gv"])
    topv = topi = None
    if cfg.top_k is not None:  # (value desc, id asc): sort by id, then stably by value
        by_id = xp.argsort_desc(-top_i)
        top_v, top_i = xp.take_rows(top_v, by_id), xp.take_rows(top_i, by_id)
        order = xp.argsort_desc(top_v)[:, :min(cfg.top_k, k)]
        topv, topi = xp.take_rows(top_v, order), xp.take_rows(top_i, order)
    return StreamState(None, None, None, v1, xp.gather_cols(i1s, lead), v2, gv,
                       xp.gather_cols(gis, gpos), xp.gather_cols(f["gz"], gpos), topv, topi)


def finalize(xp, st, stats, keys, cfg):
    """Sample of [N] fields from the merged state and the token statistics ``stats`` (a
    ``token_stats.formulas.Stats`` of the rows with ``stats_target`` as the target: the
    backend's token-statistics arithmetic, so logp and entropy are that arithmetic's, bit
    for bit). Log-probabilities are taken relative to the row's largest logit m, (z - m)/T_s
    - la (la the log of the sum relative to m): at a small temperature a normaliser
    m/T_s + la of size |z|/T_s would round la away (a two-way tie would get log-probability
    0). A row has a valid draw where its largest s plus la is finite (a NaN logit makes la
    NaN, a +inf one makes m = +inf and la NaN, an s = z / T_s past the float32 range makes the
    largest s +inf, a row with no finite s has no finite largest s): on every backend, with
    or without top_k. With two temperatures the statistics are those of z / T_s and the
    draw's scores z / T must be finite as well (a z / T past the float32 range is +inf)."""
    nan = float("nan")
    la = stats.la
    valid = xp.isfinite(st.v1 + la)  # [N]
    if cfg.two_temperatures:
        valid = valid & ((st.gv if cfg.top_k is None else st.topv[:, 0]) < float("inf"))
    if cfg.top_k is None:
        entropy, logp = stats.entropy, stats.logp
        token = st.i1 if cfg.temperature == 0.0 else st.gi
        # top1: (m - m)/T_s - la, the form of every logp (+0 - la, never -0); v2 is the
        # largest s plus a logit difference (StreamState), so a tie is 0 exactly
        top1, top2 = 0.0 - la, (st.v2 - st.v1) - la
    else:
        v, ids = st.topv, st.topi  # [N, k'] largest first, the draw's scores z / T
        v = xp.where(valid[:, None], v, 0.0)  # a row without a valid draw: no NaN or inf below
        n = v.shape[0]
        # exp, log and the sums over the slots (and the noise's logs) on rows padded as
        # whole-row arithmetic wants them (JAX: a multiple of 8, and a [rows, k'] tile of at
        # least 16384 elements: ``whole_row_rows``), so a row's bits do not depend on N
        pad = lambda x: xp.pad_rows(x, xp.whole_row_rows(n, v.shape[1]))  # noqa: E731
        w = pad(v)
        d = w - w[:, 0][:, None]  # the largest slot is finite
        if cfg.two_temperatures:  # the statistics' z / T_s, to float32 accuracy
            d = d * (cfg.temperature / cfg.stats_temperature)
        e = xp.exp(d)
        a = xp.rowsum(e)
        logq = d - xp.log(a)[:, None]
        entropy = -xp.rowsum(xp.where(e > 0, e / a[:, None] * logq, 0.0))[:n]
        logq = logq[:n]
        top1 = logq[:, 0]
        top2 = logq[:, 1] if v.shape[1] > 1 else top1 * 0.0 + float("-inf")
        if cfg.temperature == 0.0:
            token, logp = ids[:, 0], logq[:, 0]
        else:
            g = gumbel(xp, pad(keys), pad(ids))[:n]  # [N, k'] noise of the k columns
            key = v + g
            best = xp.rowmax(key)
            # the first slot holding the best key (k', one past the last, is no slot)
            pos = xp.rowmin(xp.where(key == best[:, None], xp.arange(v.shape[1], v)[None, :],
                                     v.shape[1]))
            token, logp = xp.gather_cols(ids, pos), xp.gather_cols(logq, pos)
        st = st._replace(i1=ids[:, 0])
    fix = lambda x: xp.where(valid, x, nan)  # noqa: E731
    return Sample(xp.i32(xp.where(valid, token, -1)), fix(logp),
                  xp.i32(xp.where(valid, st.i1, -1)), fix(top1), fix(top2), fix(entropy))


def no_draw_where(xp, sample, bad):
    """sample with every row marked as having no valid draw where ``bad`` (a bool scalar)."""
    nan = float("nan")
    ints = lambda x: xp.where(bad, -1, x)  # noqa: E731
    floats = lambda x: xp.where(bad, nan, x)  # noqa: E731
    return Sample(ints(sample.token), floats(sample.logp), ints(sample.argmax),
                  floats(sample.top1_logp), floats(sample.top2_logp), floats(sample.entropy),
                  vocab_size=sample.vocab_size)


def reference_sample(xp, z, zu, keys, suppress, cfg):
    """The whole row as one chunk (the reference backend: [N, K] float32 materialised); the
    drawn token's logp and the entropy are those of the reference token statistics
    (``token_stats.formulas.reference_stats``, which the reference backend of ``token_stats``
    computes) of the same float32 logits, the rest the stream's."""
    cols = xp.arange(z.shape[1], z)
    zs, s, sd = scaled_logits(xp, z, zu, cols, suppress, cfg)
    st = chunk_state(xp, zs, s, sd, cols, keys, cfg)
    stats = stream_stats(xp, st, cfg)
    if cfg.top_k is None:
        active = xp.zeros_like(st.a) == 0.0
        _, logp, entropy, _ = stats_math.reference_stats(
            xp, Rows(zs, targets=stats_target(st, cfg), active=active), stats_lowered(cfg))
        stats = stats._replace(logp=logp, entropy=entropy)
    return finalize(xp, st, stats, keys, cfg)


class ReferenceSampler:
    """The reference backend's sampler of one framework (``reference_sample``): the whole
    row materialised in float32."""

    name = "reference"

    def __init__(self, xp):
        self.xp = xp

    @staticmethod
    def unsupported_reason(platform):
        return None

    def sample(self, z, zu, keys, suppress, cfg):
        # z, zu: [N, K] -> Sample of [N] fields
        return reference_sample(self.xp, z, zu, keys, suppress, cfg)


# -- checks -----------------------------------------------------------------------------------

def make_sample_config(xp, logits, temperature, top_k, uncond_logits, cfg_scale, chunk_size,
                       stats_temperature=None):
    require_logits(xp, "logits", as_logits(logits))
    require_float(xp, "logits", logits)
    if len(logits.shape) < 1 or logits.shape[-1] < 1:
        raise ValueError(f"logits must have shape [..., K] with K >= 1; got "
                         f"{shape_str(logits.shape)}")
    t = as_number(temperature)
    t_min = MIN_SAMPLING_TEMPERATURE
    if t is None or not (t == 0.0 or t_min <= t <= _F32_MAX):
        raise ValueError(
            f"temperature must be 0 (greedy) or in [{t_min}, {_F32_MAX:.7g}]; got "
            f"{plain(temperature)} (s = z / T is float32: below {t_min} its "
            f"rounding swamps the noise, and temperature=0 is the exact T -> 0 limit)")
    k = None if top_k is None else as_number(top_k, integer=True)
    if top_k is not None and (k is None or not 1 <= k <= MAX_TOP_K):
        raise ValueError(f"top_k must be None or an int in [1, {MAX_TOP_K}] (a running top-k "
                         f"per row is merged in the one pass); got {plain(top_k)}")
    if uncond_logits is not None:
        require_logits(xp, "uncond_logits", as_logits(uncond_logits))
        require_float(xp, "uncond_logits", uncond_logits)
        require_shape("uncond_logits", uncond_logits, logits.shape, "logits.shape")
    c = as_number(cfg_scale)
    if c is None or not abs(c) < float("inf"):
        raise ValueError(f"cfg_scale must be a finite number; got {plain(cfg_scale)}")
    if c != 0.0 and uncond_logits is None:
        raise ValueError("cfg_scale needs uncond_logits (the unconditional logits)")
    chunk = None if chunk_size is None else as_number(chunk_size, integer=True)
    if chunk_size is not None and (chunk is None or chunk < 1):
        raise ValueError(f"chunk_size must be a positive int or None; got {plain(chunk_size)}")
    ts = None if stats_temperature is None else as_number(stats_temperature)
    if stats_temperature is not None and (ts is None or not t_min <= ts <= _F32_MAX):
        raise ValueError(f"stats_temperature must be None (the draw's temperature) or in "
                         f"[{t_min}, {_F32_MAX:.7g}]; got {plain(stats_temperature)}")
    if t == 0.0 and ts not in (None, 1.0):
        raise ValueError(f"stats_temperature must be None or 1 at temperature=0 (a greedy draw "
                         f"takes the statistics of softmax(z)); got {plain(stats_temperature)}")
    ts = (t if t > 0.0 else 1.0) if ts is None else ts
    return SampleConfig(t, k, c, uncond_logits is not None, chunk, ts)


def _listed_ids(ids):
    """``suppress_ids`` given as Python numbers -- one int, or a flat list or tuple of them
    (NumPy integer scalars count) -- as a list of Python ints; None for anything else (an
    array, nested lists). A non-integer element is a TypeError."""
    if isinstance(ids, (list, tuple)):
        if any(isinstance(i, (list, tuple)) or getattr(i, "shape", ()) != () for i in ids):
            return None  # nested: the array path says which shape
        items = list(ids)
    elif isinstance(ids, (int, float, np.number, np.bool_)):
        items = [ids]
    else:
        return None
    out = [as_number(i, integer=True) for i in items]
    bad = [i for i, v in zip(items, out) if v is None]
    if bad:
        raise TypeError(f"suppress_ids must be integer token ids (an array, a list or an int); "
                        f"got {type(ids).__name__} holding {plain(bad[0])}")
    return out


def _raise_outside(vocab, values):
    """Raise for the first id of ``values`` (a list of ints) outside [0, K)."""
    for i, v in enumerate(values):
        if not 0 <= v < vocab:
            raise ValueError(f"suppress_ids must be token ids in [0, K) = [0, {vocab}) (K: the "
                             f"vocabulary size); got {plain(v)} at index {i}")


def suppressed_ids(xp, ids, vocab, like):
    """``suppress_ids`` (an integer array, a list, or one int; NumPy ones too) as (an [S]
    integer array on ``like``'s device or None, None or a bool scalar ``bad``). Ids outside
    [0, K) raise where their values can be read here: Python ints always (also while tracing),
    arrays where ``_checks.host_values`` reads them; where it cannot (traced, or on an
    accelerator outside ``sync_checks()``) ``bad`` says whether any is, and the caller marks
    every row as having no valid draw."""
    if ids is None:
        return None, None
    listed = None if xp.is_array(ids) else _listed_ids(ids)
    if listed is not None:  # Python ints: checked here, with no array
        _raise_outside(vocab, listed)
        return (xp.from_host(np.asarray(listed, np.int32), like) if listed else None), None
    if xp.is_array(ids):
        require_int(xp, "suppress_ids", ids)
        host = host_values(xp, ids)
        shape = ids.shape
    else:
        host = np.asarray(ids)
        if host.size == 0:
            host = host.astype(np.int64)
        if host.dtype == object or not np.issubdtype(host.dtype, np.integer):
            raise TypeError(f"suppress_ids must be integer token ids (an array, a list or an "
                            f"int); got {type(ids).__name__} of {host.dtype}")
        shape = host.shape
    if len(shape) > 1:
        raise ValueError(f"suppress_ids must have shape [S] (or be one id); got "
                         f"{shape_str(shape)}")
    if host is not None and ((host < 0) | (host >= vocab)).any():
        _raise_outside(vocab, host.reshape(-1).tolist())
    if not xp.is_array(ids):
        assert host is not None  # the ids' own values (np.asarray above)
        ids = xp.from_host(host.reshape(-1).astype(np.int32), like)
    ids = ids.reshape(-1)
    if ids.shape[0] == 0:
        return None, None
    if host is not None:
        return ids, None
    return ids, xp.rowsum(xp.f32((ids < 0) | (ids >= vocab))) > 0


def seed_argument(xp, name, value, lead):
    """seed or step: an int or a 0-d integer array; ``lead`` (the logits' leading shape,
    seed only): also [B] = [lead[0]] integers, one seed per sequence."""
    if xp.is_array(value):
        require_int(xp, name, value)
        if len(value.shape) == 0:
            return value
        if lead is None:
            raise ValueError(f"{name} must be an int or an integer scalar; got shape "
                             f"{shape_str(value.shape)}")
        if len(lead) == 0 or tuple(value.shape) != (lead[0],):
            raise ValueError(f"{name} must be an int, an integer scalar or [B] integers "
                             f"(one per sequence, B = logits.shape[0]); got shape "
                             f"{shape_str(value.shape)} for logits of leading shape "
                             f"{shape_str(lead)}")
        return value
    number = as_number(value, integer=True)
    if number is None:
        raise TypeError(f"{name} must be an int or an integer scalar; got "
                        f"{type(value).__name__}")
    return number


def _per_sequence_with_host(xp, name, value, b, integral):
    """A per-sequence argument of commit_tokens: a number (Python or NumPy, or a 0-d array of
    another framework), or an array of shape [] or [B]; (value ready to broadcast against
    [B, L], its values to check: the Python number itself, the array's host values, or None
    where they cannot be read)."""
    if not xp.is_array(value):
        number = as_number(value, integral)
        if number is None:
            kind = "an int" if integral else "a number"
            raise TypeError(f"{name} must be {kind} or an array of shape [] or [B] = [{b}]; got "
                            f"{type(value).__name__}")
        return number, number
    (require_int if integral else require_real)(xp, name, value)
    if tuple(value.shape) not in ((), (b,)):
        raise ValueError(f"{name} must be a number or have shape [] or [B] = [{b}] (one per "
                         f"sequence); got shape {shape_str(value.shape)}")
    return (value[:, None] if len(value.shape) == 1 else value), host_values(xp, value)


def _raise_at(name, bad, values, rule):
    """Raise naming the first bad value: ``values`` a Python number and ``bad`` a bool
    (checked in Python: under torch.compile a NumPy array of it would be traced, and a branch
    on it data-dependent), or host values [] or [B] and ``bad`` an array of their shape."""
    if isinstance(values, (int, float)):
        if bad:
            raise ValueError(f"{name} must be {rule}; got {plain(values)}")
        return
    if bad.any():
        idx = tuple(int(i) for i in np.argwhere(np.atleast_1d(bad))[0])
        where = f" at index {idx}" if values.ndim else ""
        raise ValueError(f"{name} must be {rule}; got {plain(np.atleast_1d(values)[idx])}{where}")


def commit_arguments(xp, canvas, sample, k, threshold, budget):
    """Checked (k, threshold, budget) of commit_tokens for a canvas [B, L] (each None when not
    given), after checking that the canvas's dtype holds every id of the vocabulary."""
    top = xp.int_max(canvas)
    vocab = sample.vocab_size
    if vocab is not None and vocab - 1 > top:
        raise ValueError(f"canvas ({dtype_str(canvas)}) cannot hold the vocabulary's ids: K = "
                         f"{vocab} (ids up to {vocab - 1}) but {dtype_str(canvas)} holds at most "
                         f"{top}; use a wider integer dtype")
    if vocab is None and top < 2**31 - 1:
        raise ValueError(f"canvas ({dtype_str(canvas)}) may not hold sample.token's int32 ids: "
                         f"the vocabulary size is not known (sample.vocab_size is None: a Sample "
                         f"not made by sample_tokens) and {dtype_str(canvas)} holds at most {top}; "
                         f"give Sample(..., vocab_size=K) or use an int32 canvas")
    b = canvas.shape[0]
    if k is not None:
        k, host = _per_sequence_with_host(xp, "k", k, b, integral=True)
        if host is not None:
            _raise_at("k", host < 0, host, ">= 0 (positions to commit per sequence)")
    out = [k]
    for name, value in (("threshold", threshold), ("budget", budget)):
        if value is not None:
            value, host = _per_sequence_with_host(xp, name, value, b, integral=False)
            if host is not None:
                _raise_at(name, host != host, host, "a number (not NaN)")
        out.append(value)
    return tuple(out)


# -- choosing what to commit ([B, L] math) -------------------------------------------------------

CONFIDENCES = ("probability", "margin", "neg_entropy")
RULES = ("topk", "threshold", "entropy_budget")


def confidence(xp, sample, kind):
    """[B, L] float32 confidence of each drawn token: its probability, the margin p1 - p2, or
    the negative entropy."""
    if kind == "probability":
        return xp.exp(sample.logp)
    if kind == "margin":
        return xp.exp(sample.top1_logp) - xp.exp(sample.top2_logp)
    if kind == "neg_entropy":
        return -sample.entropy
    raise ValueError(f"confidence must be one of {CONFIDENCES}; got {kind!r}")


def _commit_topk(xp, conf, eligible, k):
    """The k most confident eligible positions per sequence (ties: the lower position)."""
    neg = xp.where(eligible, conf, float("-inf"))
    rank = xp.scatter_rank(xp.argsort_desc(neg))  # [B, L]: 0 = most confident
    return eligible & (rank < k)


def _at_least_one(xp, commit, conf, eligible):
    """commit, plus each sequence's most confident eligible position where it commits none."""
    neg = xp.where(eligible, conf, float("-inf"))
    first = xp.scatter_rank(xp.argsort_desc(neg)) == 0
    none = xp.rowsum(xp.f32(commit)) == 0
    return commit | (first & eligible & none[:, None])


def _unless_nan(xp, commit, value):
    """commit, and nothing in a sequence whose (traced) threshold or budget is NaN."""
    return commit & (value == value) if xp.is_array(value) else commit


def commit_positions(xp, sample, masked, rule, k, threshold, budget, kind, inclusive=False,
                     exclusive=False):
    """[B, L] bool: the masked positions the rule commits (see ``commit_tokens``); a row with
    no valid draw (token -1) is never one of them, nor ranked above one that is."""
    eligible = masked & (sample.token >= 0)
    if rule == "topk":
        if k is None:
            raise ValueError("rule='topk' needs k (an int, or [B] ints from a schedule)")
        return _commit_topk(xp, confidence(xp, sample, kind), eligible, k)
    if rule == "threshold":
        if threshold is None:
            raise ValueError("rule='threshold' needs threshold")
        conf = confidence(xp, sample, kind)
        above = conf >= threshold if inclusive else conf > threshold
        commit = _at_least_one(xp, eligible & above, conf, eligible)
        return _unless_nan(xp, commit, threshold)
    if rule == "entropy_budget":
        if budget is None:
            raise ValueError("rule='entropy_budget' needs budget (nats per sequence)")
        ent = xp.where(eligible, sample.entropy, float("inf"))
        order = xp.argsort_desc(-ent)  # ascending entropy, ties: the lower position
        rank = xp.scatter_rank(order)
        sorted_ent = xp.where(xp.take_rows(ent, order) < float("inf"),
                              xp.take_rows(ent, order), 0.0)
        total = xp.cumsum(sorted_ent)
        if exclusive:  # the entropies ranked before each position: the running sum less its
            total = total - sorted_ent  # own, formed as DiffusionGemma's sampler forms it
        within = total <= budget
        keep = xp.take_rows(within, rank)  # back in position order
        commit = _at_least_one(xp, eligible & keep, -sample.entropy, eligible)
        return _unless_nan(xp, commit, budget)
    raise ValueError(f"rule must be one of {RULES}; got {rule!r}")


# -- the public functions of one front end ---------------------------------------------------

def _flat_rows(xp, x, n):
    """A ``LogitsSource`` over [N, K] rows; no gradient."""
    return x.map_arrays(xp.stop_gradient).flat(n)


def _rows(xp, x, r0, r1):
    """Rows [r0, r1) of an [N, K] ``LogitsSource``'s logits (a head's: formed here, in the
    head's dtype)."""
    return None if x is None else x.chunk(xp, lambda a: a[r0:r1])


def _kept(sample, skip):
    """sample without its first ``skip`` rows (a token chunk's rows an earlier one drew)."""
    return sample if skip == 0 else Sample(*(f[skip:] for f in sample))


class Sampler:
    """``sample_tokens`` and ``commit_tokens`` of one front end: the bodies of its typed public
    functions (their documentation is there), over the framework's binding: its ops adapter
    ``xp`` and its sampler registry."""

    def __init__(self, framework: Framework[Any]):
        self.framework = framework
        self.xp, self.registry = framework.xp, framework.sampling

    def sample_tokens(self, logits, *, temperature=1.0, seed: object = 0, step: object = 0,
                      top_k=None, suppress_ids=None, uncond_logits=None, cfg_scale=0.0,
                      chunk_size=None, stats_temperature=None, backend=None):
        xp, registry = self.xp, self.registry
        cfg = make_sample_config(xp, logits, temperature, top_k, uncond_logits, cfg_scale,
                                 chunk_size, stats_temperature)
        seed = seed_argument(xp, "seed", seed, logits.shape[:-1])
        step = seed_argument(xp, "step", step, None)
        # an array or a LinearHead (either of the two) as one protocol: nothing below tests
        # which; ``rows_per_chunk`` gives each kind's token chunk
        logits = as_logits(logits)
        uncond_logits = None if uncond_logits is None else as_logits(uncond_logits)
        like = logits.device_array  # an array on the device
        suppress_ids, unseen_bad = suppressed_ids(xp, suppress_ids, logits.shape[-1], like)
        impl = registry.resolve(backend, xp.platform(like))
        lead, k = tuple(logits.shape[:-1]), logits.shape[-1]
        n = 1
        for dim in lead:
            n *= dim
        z, zu = (None if x is None else _flat_rows(xp, x, n) for x in (logits, uncond_logits))
        if impl.name == "reference":  # whole float32 rows, as the token statistics' reference
            z, zu = (None if x is None else as_logits(x.reference_array(xp)) for x in (z, zu))
        keys = row_keys(xp, seed, step, n, like)
        # token chunks of R rows, each source's [R, K] logits chunk formed or sliced there:
        # arrays exist whole, so one chunk of all N rows (the backend's sampler on them as
        # they are); with a head, R rows at a time (the logits' R, else the guidance's),
        # never [N, K], in the token chunks and vocabulary chunks of the framework's head
        # path, so that the statistics stream the token statistics' own logits chunks
        on_cpu = xp.platform(like) == "cpu"
        assert z is not None  # the logits' own rows (None stands for absent guidance only)
        r = z.rows_per_chunk(n, on_cpu, zu, xp.head_chunk_bytes_cpu)
        cfg = cfg._replace(chunk_size=z.vocab_chunk(xp, impl.name, on_cpu, cfg.chunk_size, r))
        parts = [_kept(impl.sample(_rows(xp, z, r0, r1), _rows(xp, zu, r0, r1), keys[r0:r1],
                                   suppress_ids, cfg), first - r0)
                 for r0, r1, first in xp.head_token_chunks(n, r) or [(0, n, 0)]]
        out = parts[0] if len(parts) == 1 else Sample(*(xp.concat(list(f)) for f in zip(*parts)))
        out = Sample(*(f.reshape(lead) for f in out), vocab_size=k)
        return out if unseen_bad is None else no_draw_where(xp, out, unseen_bad)

    def commit_tokens(self, canvas, sample, masked, *, rule="topk", k=None, threshold=None,
                      budget=None, confidence="probability", inclusive=False,
                      exclusive=False):
        xp = self.xp
        require_array(xp, "canvas", canvas)
        require_int(xp, "canvas", canvas)
        if len(canvas.shape) != 2:
            raise ValueError(f"canvas must have shape [B, L]; got {shape_str(canvas.shape)}")
        if not isinstance(sample, Sample):
            raise TypeError(f"sample must be the Sample of sample_tokens; got "
                            f"{type(sample).__name__}")
        require_shape("sample.token", sample.token, canvas.shape, "canvas.shape [B, L]")
        require_array(xp, "masked", masked)
        require_shape("masked", masked, canvas.shape, "canvas.shape [B, L]")
        if confidence not in CONFIDENCES:
            raise ValueError(f"confidence must be one of {CONFIDENCES}; got {confidence!r}")
        inclusive = flag("inclusive", inclusive)
        exclusive = flag("exclusive", exclusive)
        if exclusive and rule != "entropy_budget":
            raise ValueError(f"exclusive=True applies to rule='entropy_budget' only; got "
                             f"rule={rule!r}")
        k, threshold, budget = commit_arguments(xp, canvas, sample, k, threshold, budget)
        masked = masked != 0
        commit = commit_positions(xp, sample, masked, rule, k, threshold, budget, confidence,
                                  inclusive, exclusive)
        return xp.where(commit, xp.cast_like(sample.token, canvas), canvas), commit
