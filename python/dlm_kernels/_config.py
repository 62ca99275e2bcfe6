"""The static configuration of one token-statistics call: scalar arguments checked into a
hashable ``StatsConfig``, and the chunk-size heuristic of the framework-native chunked
backends. Nothing here imports torch or jax."""

from __future__ import annotations

import dataclasses
import math
from typing import Literal, Optional, overload

from ._checks import flag, number, plain


# The smallest temperature of the token statistics and the objectives (temperature,
# ce_temperature, teacher_temperature), 2^-102 (about 2e-31): the floor float32 sets, not the
# sampler's (sampling.core.MIN_SAMPLING_TEMPERATURE). Every backend forms its exponents
# as differences of logits scaled afterwards, (r - m)·(1/T) (docs/design.md §2): 1/T must be
# a finite float32, and a difference of 2^-24·T (the float32 resolution of a scaled logit of
# unit size) must be a normal float32 number, 2^-126 or more, since GPUs, TPUs and XLA's CPU
# backend flush subnormal results to zero. Below it a temperature is a ValueError that names
# the argument.
FLOAT32_MIN_TEMPERATURE = 2.0 ** -102


@overload
def check_temperature(name: str, value: object, *,
                      allow_none: Literal[False] = False) -> float: ...


@overload
def check_temperature(name: str, value: object, *, allow_none: bool) -> Optional[float]: ...


def check_temperature(name: str, value: object, *, allow_none: bool = False) -> Optional[float]:
    """A temperature: a finite positive Python scalar of at least FLOAT32_MIN_TEMPERATURE."""
    value = check_positive_float(name, value, allow_none=allow_none)
    if value is not None and value < FLOAT32_MIN_TEMPERATURE:
        raise ValueError(f"{name} must be at least {FLOAT32_MIN_TEMPERATURE!r} (2^-102: smaller "
                         f"temperatures resolve logits closer than float32 keeps them); "
                         f"got {plain(value)}")
    return value


@overload
def check_positive_float(name: str, value: object, *,
                         allow_none: Literal[False] = False) -> float: ...


@overload
def check_positive_float(name: str, value: object, *, allow_none: bool) -> Optional[float]: ...


def check_positive_float(name: str, value: object, *,
                         allow_none: bool = False) -> Optional[float]:
    """A finite, strictly positive number (``_checks.number``: NumPy scalars too, not bools),
    in the words of Tunix's policy scorer ("must be a finite positive real scalar")."""
    if value is None and allow_none:
        return None
    value = number(name, value, "a finite positive real scalar")
    if not math.isfinite(value) or value <= 0.0:
        raise ValueError(f"{name} must be a finite positive real scalar; got {plain(value)}")
    return value


def check_distillation_scalars(temperature, soft_loss_weight, hard_loss_weight):
    """``opd_loss``'s (temperature, soft_loss_weight, hard_loss_weight) as floats, checked in
    the order and words of Tunix's distillation loss: each a finite real scalar, then a
    positive temperature, non-negative weights, and at least one weight positive."""
    values = {"temperature": temperature, "soft_loss_weight": soft_loss_weight,
              "hard_loss_weight": hard_loss_weight}
    for name, value in values.items():
        values[name] = number(name, value, "a finite real scalar")
        if not math.isfinite(values[name]):
            raise ValueError(f"{name} must be a finite real scalar; got {plain(values[name])}")
    temperature, soft, hard = values.values()
    if temperature <= 0.0:
        raise ValueError(f"temperature must be positive; got {plain(temperature)}")
    got = f"got soft_loss_weight = {plain(soft)} and hard_loss_weight = {plain(hard)}"
    if soft < 0.0 or hard < 0.0:
        raise ValueError(f"soft_loss_weight and hard_loss_weight must be nonnegative; {got}")
    if soft == 0.0 and hard == 0.0:
        raise ValueError(f"at least one loss weight must be positive (both terms are off: "
                         f"nothing to optimise); {got}")
    return temperature, soft, hard


def check_loss_weight(name: str, value) -> float:
    """A finite, non-negative number (``_checks.number``: NumPy scalars too, not bools)."""
    value = number(name, value, "a finite non-negative float")
    if not math.isfinite(value) or value < 0.0:
        raise ValueError(f"{name} must be a finite non-negative float; got {plain(value)}")
    return value


def check_label_smoothing(value) -> float:
    """Label smoothing ε: a number in [0, 1] (``_checks.number``: NumPy scalars too)."""
    value = number("label_smoothing", value, "a float in [0, 1]")
    if not 0.0 <= value <= 1.0:  # (False for NaN)
        raise ValueError(f"label_smoothing must be a float in [0, 1]; got {plain(value)}")
    return value


@dataclasses.dataclass(frozen=True)
class CeTerm:
    """The options of the CE term (``logp``), declared once: every objective and
    ``token_stats`` take them as keywords and pass this one object down to the lowering.

    label_smoothing: ε in [0, 1]: the CE term's target distribution is (1 - ε)·onehot(y) + ε/K
                     over the K valid columns (``logp`` = Σ_k target_k·log p'_k).
    z_loss_weight:   λ >= 0, finite: ``logp`` also carries -λ·lse_ce², lse_ce the logsumexp
                     of the logits at ``ce_temperature``.

    Constructed checked (an error names the keyword); the defaults are the plain CE.
    """

    label_smoothing: float = 0.0
    z_loss_weight: float = 0.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "label_smoothing", check_label_smoothing(self.label_smoothing))
        object.__setattr__(self, "z_loss_weight",
                           check_loss_weight("z_loss_weight", self.z_loss_weight))

    @property
    def smooths(self) -> bool:
        """Label smoothing is on: the uniform term needs the vocabulary's size."""
        return self.label_smoothing > 0.0


#: the plain CE: no label smoothing, no z-loss
PLAIN_CE = CeTerm()


@overload
def check_positive_int(name: str, value: object, *,
                       allow_none: Literal[False] = False) -> int: ...


@overload
def check_positive_int(name: str, value: object, *, allow_none: bool) -> Optional[int]: ...


def check_positive_int(name: str, value: object, *, allow_none: bool = False) -> Optional[int]:
    """A positive int (``_checks.number``: NumPy integers too, not bools or floats)."""
    if value is None and allow_none:
        return None
    what = "a positive int or None" if allow_none else "a positive int"
    value = number(name, value, what, integer=True)
    if value < 1:
        raise ValueError(f"{name} must be {what}; got {value}")
    return value


def check_vocab_size(vocab_size) -> int:
    return check_positive_int("vocab_size", vocab_size)


@dataclasses.dataclass(frozen=True)
class StatsConfig:
    """Static (hashable) configuration of one token-statistics call: the call as described
    by its keywords. What the kernels take (1/T, stand-ins, flags) is derived from it in one
    place, ``token_stats.lowering.lower``; the backends read that, never this.

    temperature:       T of the student distribution p = softmax(s), s = r / T (entropy, KL);
                       every temperature is at least FLOAT32_MIN_TEMPERATURE.
    ce_temperature:    temperature of the ``logp`` term; equal to ``temperature`` by default.
    teacher_temperature: T_kl of the teacher distribution q = softmax(u / T_kl).
    softcap:           c in cap(z) = c * tanh(z / c); None for no cap.
    has_teacher:       teacher logits are given (the ``kl`` output is 0 otherwise).
    teacher_grad:      the VJP also returns d(teacher logits).
    entropy:           compute the entropy; False drops its running sum from the forward
                       pass and its term from the backward pass (callers that only need
                       logp/kl: every objective but ``per_token_logps(return_entropy=True)``).
    chunk_size:        vocabulary chunk of the chunked backends (None = heuristic).
    vocab_size:        vocabulary-parallel calls only: the true vocabulary, so padding
                       columns >= vocab_size (global ids) are excluded and get 0 gradient.
    ce:                the CE term's options (``CeTerm``: label smoothing and z-loss).
    smoothing_vocab:   K of label smoothing's uniform term (the global, valid vocabulary);
                       None unless it smooths, so configurations without it compare and
                       hash as before.
    """

    temperature: float = 1.0
    ce_temperature: float = 1.0
    teacher_temperature: float = 1.0
    softcap: Optional[float] = None
    has_teacher: bool = False
    teacher_grad: bool = False
    entropy: bool = True
    chunk_size: Optional[int] = None
    vocab_size: Optional[int] = None
    ce: CeTerm = PLAIN_CE
    smoothing_vocab: Optional[int] = None


def make_config(
    *,
    temperature=1.0,
    ce_temperature=None,
    teacher_temperature=None,
    softcap=None,
    has_teacher=False,
    teacher_grad=False,
    entropy=True,
    chunk_size=None,
    vocab_size=None,
    ce: CeTerm = PLAIN_CE,
    smoothing_vocab: Optional[int] = None,
) -> StatsConfig:
    """The checked configuration; ``ce`` the CE term's options (checked when made),
    ``smoothing_vocab`` the K of label smoothing's uniform term (the caller's: the global
    vocabulary under vocabulary parallelism)."""
    temperature = check_temperature("temperature", temperature)
    ce_temperature = check_temperature("ce_temperature", ce_temperature, allow_none=True)
    teacher_temperature = check_temperature(
        "teacher_temperature", teacher_temperature, allow_none=True
    )
    softcap = check_positive_float("softcap", softcap, allow_none=True)
    chunk_size = check_positive_int("chunk_size", chunk_size, allow_none=True)
    if vocab_size is not None:
        vocab_size = check_vocab_size(vocab_size)
    if not isinstance(ce, CeTerm):
        raise TypeError(f"ce must be a CeTerm; got {type(ce).__name__}")
    teacher_grad, entropy = flag("teacher_grad", teacher_grad), flag("entropy", entropy)
    if teacher_grad and not has_teacher:
        raise ValueError("teacher_grad=True needs teacher_logits")
    smoothing = None
    if ce.smooths:
        assert smoothing_vocab is not None  # the caller's K wherever it smooths
        smoothing = int(smoothing_vocab)
    return StatsConfig(
        temperature=temperature,
        ce_temperature=temperature if ce_temperature is None else ce_temperature,
        teacher_temperature=temperature if teacher_temperature is None else teacher_temperature,
        softcap=softcap,
        has_teacher=bool(has_teacher),
        teacher_grad=teacher_grad,
        entropy=entropy,
        chunk_size=chunk_size,
        vocab_size=vocab_size,
        ce=ce,
        smoothing_vocab=smoothing,
    )


# Columns of one vocabulary chunk of the framework-native chunked backends, by where they
# run. A row's statistics are reduced chunk by chunk and the chunks' partial states merged
# left to right, so the chunk width fixes a row's reduction order: it depends on K (and a
# user's ``chunk_size``) alone, never on the number of rows, and a row gives the same bits
# in any batch (docs/design.md §2, "One row, one answer"). Memory is bounded by cutting the
# rows into blocks instead (``rows_per_block``). On an accelerator every elementwise pass
# over a chunk is a kernel launch of a few microseconds, so a chunk carries more columns.
CHUNK_COLUMNS_CPU = 4096
CHUNK_COLUMNS_ACCELERATOR = 32768
# Bytes one float32 [R, C] temporary of a row block may occupy, by where it runs. On a CPU
# the block stays small (a handful of such buffers is the whole extra memory); on an
# accelerator a pass must carry enough bytes for its launches not to dominate: at an HBM
# rate of ~4 TB/s, 128 MiB is ~30 us of traffic per pass.
CHUNK_BYTES_CPU = 8 * 1024 * 1024
CHUNK_BYTES_ACCELERATOR = 128 * 1024 * 1024
# The sampler's chunk on a CPU: it keeps about 20 [N, C] temporaries alive at once (the
# hash, the noise, the running state), so its buffers are a quarter of the statistics'
# ones: at N 1024, K 32768, float32 the step's peak beyond the logits fell from 168 to
# 38 MiB at the same time per step (bench/NOTES.md).
SAMPLE_CHUNK_BYTES_CPU = 2 * 1024 * 1024


def chunk_size_for(vocab: int, cfg, on_cpu: bool = True) -> int:
    """Columns C of one vocabulary chunk of the framework-native chunked backends: the
    user's ``cfg.chunk_size`` when given (``cfg``: the lowered call,
    ``token_stats.lowering.Lowered``, or a sampler's ``SampleConfig``), else
    ``CHUNK_COLUMNS_CPU`` on a CPU and ``CHUNK_COLUMNS_ACCELERATOR`` elsewhere; at most K.
    A function of K alone: it fixes the order in which a row's terms are summed."""
    if cfg.chunk_size is not None:
        return max(1, min(cfg.chunk_size, vocab))
    return max(1, min(CHUNK_COLUMNS_CPU if on_cpu else CHUNK_COLUMNS_ACCELERATOR, vocab))


def budget_chunk_for(n_rows: int, vocab: int, cfg, on_cpu: bool = True,
                     cpu_bytes: int = CHUNK_BYTES_CPU) -> int:
    """Columns C of a chunk sized so one float32 [N, C] buffer of all N rows stays under
    ``cpu_bytes`` on a CPU, ``CHUNK_BYTES_ACCELERATOR`` elsewhere (a multiple of 128, at least
    128, at most K; ``cfg.chunk_size`` overrides). For loops that take every row at once: the
    torch sampler's draw. Its chunk, so a row's reduction order, depends on N: that sampler's
    fields are not batch-invariant (docs/design.md §2)."""
    if cfg.chunk_size is not None:
        return max(1, min(cfg.chunk_size, vocab))
    budget = cpu_bytes if on_cpu else CHUNK_BYTES_ACCELERATOR
    c = budget // (4 * max(n_rows, 1))
    c = max(128, (c // 128) * 128)
    return max(1, min(c, vocab))


# The row count of every block the JAX chunked backend and sampler compute is a multiple of
# ROW_GROUP. XLA's CPU compiler vectorises elementwise work over [N] arrays in groups of 8
# float32 lanes and finishes a length that is not a multiple of 8 with other code, whose exp
# and log can round differently: at 11 rows the 11th row's exp differs from its value among
# 512 (docs/design.md §2). In blocks of a multiple of 8 rows every row takes the vector code.
ROW_GROUP = 8

# XLA's CPU compiler also emits other code for a block's fusions when its [R, C] tile holds
# fewer than about 4096 elements: a row's logp, entropy and gradient came out an ulp apart
# between a block of 96 rows and one of 128 at C = 37, 40 and 64 rows at C = 96 (the same
# either side of that size: 128 to 65536 rows at C = 37, 8 to 2048 at C = 4096). Every block
# holds at least MIN_BLOCK_ELEMENTS, four times that size (``min_block_rows``); a call of
# fewer rows runs padded to it.
MIN_BLOCK_ELEMENTS = 1 << 14


def min_block_rows(columns: int) -> int:
    """The fewest rows a block of ``columns`` columns has: a multiple of ROW_GROUP whose
    [R, C] tile holds at least MIN_BLOCK_ELEMENTS (ROW_GROUP from C = 2048 on)."""
    r = -(-MIN_BLOCK_ELEMENTS // max(columns, 1))
    return max(ROW_GROUP, -(-r // ROW_GROUP) * ROW_GROUP)


def padded_rows(n_rows: int, group: int) -> int:
    """The rows a call of N rows runs as where whole-row arithmetic wants groups of ``group``
    rows (an ops adapter's ``row_group``): N rounded up to a multiple of it, at least one
    group (N itself for a group of 1 or no rows)."""
    if group <= 1 or n_rows == 0:
        return n_rows
    return max(group, -(-n_rows // group) * group)


def group_rows_per_block(columns: int, on_cpu: bool = True,
                         cpu_bytes: int = CHUNK_BYTES_CPU) -> int:
    """Rows R of a full row block whose float32 [R, C] chunk stays under ``cpu_bytes`` on a
    CPU (``CHUNK_BYTES_ACCELERATOR`` elsewhere): a multiple of ``ROW_GROUP``, at least
    ``min_block_rows(C)``. A function of C alone (a call of fewer rows takes fewer, down to
    ``min_block_rows(C)``: ``row_blocks``; a call of fewer than that runs padded to it)."""
    budget = cpu_bytes if on_cpu else CHUNK_BYTES_ACCELERATOR
    r = budget // (4 * max(columns, 1))
    return max(min_block_rows(columns), r // ROW_GROUP * ROW_GROUP)


def row_blocks(n_rows: int, rows: int, least: int = ROW_GROUP) -> tuple[int, int, int]:
    """(R, full, tail): the row blocks of N >= ``least`` rows with at most ``rows`` each
    (``least`` <= ``rows``, both multiples of ROW_GROUP): ``full`` blocks of R rows from row 0,
    then, where R does not divide N, one block of ``tail`` rows ending at row N (a multiple of
    ROW_GROUP, at least ``least``, at most R: it overlaps the last full block, whose rows it
    computes again). No block reaches past N, so none needs the logits padded or copied."""
    if n_rows < least:
        raise ValueError(f"row_blocks needs at least {least} rows; got {n_rows}")
    r = min(rows, n_rows // ROW_GROUP * ROW_GROUP)
    full, rem = divmod(n_rows, r)
    tail = max(-(-rem // ROW_GROUP) * ROW_GROUP, least) if rem else 0
    return r, full, tail


def rows_per_block(n_rows: int, columns: int, on_cpu: bool = True,
                   cpu_bytes: int = CHUNK_BYTES_CPU) -> int:
    """Rows R of one block whose float32 [R, C] chunk stays under ``cpu_bytes`` (default
    ``CHUNK_BYTES_CPU``, 8 MiB) on a CPU, ``CHUNK_BYTES_ACCELERATOR`` (128 MiB) elsewhere: at
    least 1 and at most N. Peak extra memory is a handful of such buffers, whatever N and K.
    Rows are independent, so the block changes no row's result."""
    budget = cpu_bytes if on_cpu else CHUNK_BYTES_ACCELERATOR
    return max(1, min(n_rows, budget // (4 * max(columns, 1))))
