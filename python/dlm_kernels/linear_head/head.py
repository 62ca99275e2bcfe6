"""The fused linear head: ``logits = cap(hidden @ weight (+ bias))`` (``cap`` the optional
final-logit softcap c·tanh(z / c)) as a value that every objective, ``token_stats`` and the
sampler accept in place of a logits array, without the [N, K] logits (or their gradient)
ever existing in full.

The softcap: a student head's becomes the token-statistics call's ``softcap``
(``resolve_softcap``, where the op is entered), so the kernels cap each chunk's logits in
float32 and chain cap' into dZ exactly as for a logits array; everywhere else a head's logits
are formed (a teacher head's chunks, the sampler's, ``dense``, ``column``) ``capped`` applies
it, in float32, with the kernels' formula; a capped teacher head's gradient takes cap' of its
chunk formed again (each framework's head gradients).

What an op sees of it (``LogitsSource``): a logits array (``DenseLogits``) and a head are
one protocol, the kind decided once where an op is entered (``as_logits``); the op's one
dispatch sends arrays to the backend as they are and rows with any head to the framework's
head path, whose sweeps read the schedule choices ``head_plan`` makes from the two kinds
once (``HeadPlan``), never the kinds themselves.

How it runs (``linear_head.torch_head`` and ``linear_head.jax_head``):
the N rows are cut into token chunks of R rows. For each chunk the logits ``Z_c = H_c W``
([R, K], a matmul in the inputs' dtype with float32 accumulation) feed the chosen backend's
streaming kernels exactly as a logits array would (softcap, temperatures, LOO shift and
teacher KL unchanged); the backward recomputes ``Z_c``, lets the backend write ``dZ_c`` over
it, then ``dH_c = dZ_c Wᵀ`` and ``dW += H_cᵀ dZ_c``. ``dW`` (and ``db``) are accumulated in
float32 across chunks and rounded once at the end. Memory beyond the inputs: one [R, K]
chunk (plus the backend's own vocabulary-chunk temporaries), the float32 ``dW``
accumulator [K, D] and O(N) row statistics; never [N, K].

Two gradient schedules (chosen by the objective, never by guessing from the cotangent):

* **recompute** (4 matmuls: Z in the forward; Z again, dH and dW in the backward): for
  outputs that are per row or per sequence (``token_stats``, ``per_token_logps``,
  ``diffusion_sft_loss``'s [B]): the cotangent of each row is unknown until the backward.
* **gradient in the forward** (3 matmuls: Z, dH, dW, all in the forward): for a call that
  reduces to one scalar inside itself (``weighted_cross_entropy``'s sum, ``opd_loss``'s
  total). The scalar is Σ_rows c·stats with row coefficients c known in the forward (the
  loss weights), so dZ = c·∂stats/∂Z is formed while Z_c is in hand; the backward only
  scales the saved float32 dH, dW, db by the scalar's cotangent and rounds once. The
  per-row statistics stay differentiable: a cotangent reaching them (e.g. differentiating
  an aux metric) takes the recompute path for that part, so no gradient is ever dropped.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Callable, Generic, Protocol, TypeVar, cast

from .._checks import require_array, require_finite_at_active, require_float, shape_str
from .._config import check_positive_float, check_positive_int

if TYPE_CHECKING:
    from .._ops import Array, Ops

#: weight layouts: [K, D] (torch nn.Linear.weight, a tied nn.Embedding / nnx.Embed table)
#: and [D, K] (a Flax linen/nnx Dense kernel)
VOCAB_MAJOR, HIDDEN_MAJOR = "KD", "DK"
LAYOUTS = (VOCAB_MAJOR, HIDDEN_MAJOR)
_LAYOUT_NAMES = {VOCAB_MAJOR: "[K, D]", HIDDEN_MAJOR: "[D, K]"}

# Bytes of one [R, K] logits chunk of a linear head, by where it runs. On a CPU, torch's
# 16 MiB (R = 128 rows at K = 32768 in float32) keeps the products near the BLAS rate of the
# whole matrix, and with the chunked backend's vocabulary chunks of a CPU head sized for
# 4 MiB buffers (HEAD_VOCAB_CHUNK_BYTES_CPU) the step's peak beyond inputs and gradients is
# about 55 MiB at N 4096, D 256 (bench/linear_head.py; 165 MiB with 32 and 8 MiB). JAX's
# loop body is one compiled program per chunk whose fixed cost wants more rows: at the same
# shape 128 / 256 / 512 rows ran 2.57 / 2.14 / 1.89 s with 48 / 64 / 128 MiB of XLA
# temporaries, so JAX takes 64 MiB (R = 512). On an accelerator the matmuls want R of
# several hundred rows (R = 1024 at K = 262144, bf16).
HEAD_CHUNK_BYTES_CPU = 16 * 1024 * 1024
HEAD_CHUNK_BYTES_CPU_JAX = 64 * 1024 * 1024
HEAD_CHUNK_BYTES_ACCELERATOR = 512 * 1024 * 1024
HEAD_VOCAB_CHUNK_BYTES_CPU = 4 * 1024 * 1024


# A 16-bit weight's gradient is accumulated in float32 across token chunks; past this many
# bytes of float32 accumulator (DiffusionGemma: K 262144 x D 2304 x 4 = 2.4 GB) the gradient
# pass runs over vocabulary blocks instead, each block's float32 dW finished across all token
# chunks and rounded before the next (``dw_blocks``). torch on a CPU takes a smaller budget:
# its products of 16-bit operands run in float32 copies of them (no mixed-precision GEMM),
# so the block also bounds the weight's float32 copy; at V 262144, D 256 (bf16) blocks of
# 16 MiB took DiffusionGemma's fused loss from 591 to 263 MiB beyond the weights, its 128 MiB
# gradient included (bench/NOTES.md).
HEAD_DW_ACC_BYTES = 256 * 1024 * 1024
HEAD_DW_ACC_BYTES_TORCH_CPU = 16 * 1024 * 1024


def dw_blocks(vocab: int, width: int, budget: int,
              acc_itemsize: int = 4) -> list[tuple[int, int]] | None:
    """[(b0, b1)] vocabulary blocks whose float32 dW fits ``budget`` bytes (a multiple of
    128 rows), or None when the whole accumulator does."""
    if vocab * width * acc_itemsize <= budget:
        return None
    kb = max(128, (budget // (width * acc_itemsize)) // 128 * 128)
    return [(b0, min(b0 + kb, vocab)) for b0 in range(0, vocab, kb)]


def head_vocab_chunk(r: int, vocab: int) -> int:
    """Columns of the chunked backend's vocabulary chunk inside a CPU head's [R, K] token
    chunk: one float32 [R, C] buffer within HEAD_VOCAB_CHUNK_BYTES_CPU, a multiple of 128."""
    c = HEAD_VOCAB_CHUNK_BYTES_CPU // (4 * max(r, 1))
    return max(1, min(vocab, max(128, (c // 128) * 128)))


#: Every matmul that forms a row's own values, a head's logits (H·W) and d hidden (dZ·Wᵀ),
#: takes a multiple of HEAD_ROW_GROUP rows, zero rows appended where a chunk (or a call)
#: has fewer (``head_rows``): a CPU's matmul rounds a row by the matmul's row count below
#: that (measured on a two-core EPYC: XLA's at 1 row, and at up to 48 rows against 1024 at
#: D 64; torch's at 1 and 2 rows) and alike at every multiple of 64 (D 8 to 2048, K 64 to
#: 32768; any position, memory offset and thread count), so a row's logits, statistics and
#: d hidden do not depend on the rows beside it (docs/design.md §2; held by
#: tests/token_stats/test_invariance.py::test_linear_head_rows_alone).
HEAD_ROW_GROUP = 64


def head_rows(n_rows: int) -> int:
    """The rows a matmul over N rows of a head runs on: N rounded up to HEAD_ROW_GROUP."""
    return -(-n_rows // HEAD_ROW_GROUP) * HEAD_ROW_GROUP


#: The fewest columns a torch matmul that forms rows' own values (a head's logits, d hidden)
#: writes: torch's CPU matmul rounded a row by its position among the rows at output widths
#: 5 to 11 (8 aside; measured on a two-core EPYC at D 64 and 256; 12 and up, and 1 to 4, not),
#: so a narrower product is formed over zero columns appended up to this width, then sliced
#: (tests/token_stats/test_invariance.py::test_linear_head_rows_alone, its narrow case).
MIN_PRODUCT_WIDTH = 16


def row_chunk_for(n_rows: int, vocab: int, itemsize: int, on_cpu: bool,
                  requested: int | None = None,
                  cpu_bytes: int = HEAD_CHUNK_BYTES_CPU) -> int:
    """Rows R of one token chunk: ``requested`` when given, else the most rows whose [R, K]
    logits fit the platform's budget (``cpu_bytes`` on a CPU), a multiple of HEAD_ROW_GROUP
    (its matmuls pad to one anyway), at least one group, and at most N."""
    if requested is not None:
        return max(1, min(requested, n_rows))
    budget = cpu_bytes if on_cpu else HEAD_CHUNK_BYTES_ACCELERATOR
    r = budget // (itemsize * max(vocab, 1))
    r = max(HEAD_ROW_GROUP, (r // HEAD_ROW_GROUP) * HEAD_ROW_GROUP)
    return max(1, min(r, n_rows))


def row_chunks(n_rows: int, r: int) -> list[tuple[int, int]]:
    """[(r0, r1)] token chunks of at most r rows covering [0, n_rows)."""
    return [(r0, min(r0 + r, n_rows)) for r0 in range(0, n_rows, r)]


#: the array type of a front end's LinearHead (torch.Tensor, jax.Array)
A = TypeVar("A", bound="Array")
#: what a ``LogitsKinds`` visitor returns
T = TypeVar("T")


class LogitsKinds(Protocol[A, T]):
    """What a framework's head path does with each kind of logits source, where the two
    differ in its own code (its gradient accumulators): ``LogitsSource.accept`` calls the
    one of its kind."""

    def array(self, logits: A) -> T: ...

    def head(self, head: LinearHead[A]) -> T: ...


class LogitsSource(Generic[A]):
    """What an op sees of a ``logits`` argument: a [..., K] array (``DenseLogits``) or a
    ``LinearHead`` standing for one, resolved once where the op is entered (``as_logits``).

    Shape checks read ``shape`` / ``dtype`` / ``ndim`` / ``vocab``; the row bundle is built
    with ``flat`` and ``vocab_slice``; a token chunk of logits comes from ``chunk`` and a
    chunk's gradient goes back through the accumulator ``accept`` picks; value checks
    (``check_finite``, ``check_mergeable``) and the rows of a token chunk
    (``rows_per_chunk``) are methods whose two implementations give the answer. The kind
    itself, ``materialized``, is read in two places only: the one dispatch at an op's entry
    (the backends as they are on ``array``, or the head path of each framework) and
    ``head_plan``, which turns the kinds of a call's two sources into the head path's
    schedule choices once."""

    #: whether the logits exist as one array (``array``); False: formed chunk by chunk.
    #: Read by the dispatch at an op's entry and by ``head_plan`` only.
    materialized: bool = True
    #: rows per token chunk the caller asked for (None: the platform's heuristic)
    row_chunk: int | None = None
    #: the final-logit softcap c the source's logits carry (a head's; an array's logits are
    #: as given: None)
    softcap: float | None = None

    @property
    def array(self) -> A | None:
        """The [..., K] logits array (None where they are formed chunk by chunk)."""
        raise NotImplementedError

    @property
    def device_array(self) -> A:
        """An array on the device the call runs on (the logits, or a head's hidden states)."""
        raise NotImplementedError

    @property
    def vocab(self) -> int:  # K
        raise NotImplementedError

    @property
    def shape(self) -> tuple[int, ...]:
        raise NotImplementedError

    @property
    def ndim(self) -> int:
        raise NotImplementedError

    @property
    def dtype(self) -> Any:
        raise NotImplementedError

    def on_device(self, xp: Ops[A], name: str) -> A:
        """``device_array``, checked to be one of ``xp``'s arrays (the error names ``name``'s
        part)."""
        raise NotImplementedError

    def check(self, xp: Ops[A], name: str) -> None:
        """Kinds, ranks and dtypes of the parts; the error names ``name``'s part."""
        raise NotImplementedError

    def map_arrays(self, fn: Callable[[A], A]) -> LogitsSource[A]:
        """fn applied to every array (e.g. a stop-gradient)."""
        raise NotImplementedError

    def without_softcap(self) -> LogitsSource[A]:
        """The source of the uncapped logits, for a source whose ``softcap`` is set (a head's:
        ``resolve_softcap``)."""
        raise NotImplementedError

    def arrays(self) -> tuple[A | None, ...]:
        """The arrays a gradient reaches, in a fixed order (``with_arrays`` inverts it)."""
        raise NotImplementedError

    def with_arrays(self, arrays: tuple[A | None, ...]) -> LogitsSource[A]:
        """The same kind of source over ``arrays`` (in ``arrays()``'s order), unchecked."""
        raise NotImplementedError

    def flat(self, n_rows: int) -> LogitsSource[A]:
        """The source over [N, K] rows (leading dimensions flattened)."""
        raise NotImplementedError

    def vocab_slice(self, stop: int) -> LogitsSource[A]:
        """The source of the first ``stop`` columns (the vocabulary without its padding)."""
        raise NotImplementedError

    def chunk(self, xp: Ops[A], take: Callable[[A], A], cols: tuple[int, int] | None = None) -> A:
        """[R, K] logits of the token chunk ``take`` cuts from [N, ...] arrays (the columns
        [b0, b1) = ``cols`` only, when given), in the logits' dtype."""
        raise NotImplementedError

    def dense(self, xp: Ops[A]) -> A:
        """The whole [..., K] logits array in the logits' dtype (a head's formed)."""
        raise NotImplementedError

    def reference_array(self, xp: Ops[A]) -> A:
        """The logits as the reference backend reads them: an array as it is, a head's
        formed in float32 (the oracle's twin: float32 autodiff of hidden @ weight)."""
        raise NotImplementedError

    def column(self, xp: Ops[A], idx: A) -> A:
        """[N] float32: the logit of column idx[n] of each of the [N, K] rows."""
        raise NotImplementedError

    def accept(self, kinds: LogitsKinds[A, T]) -> T:
        """``kinds.array(the array)`` or ``kinds.head(the head)``, by this source's kind."""
        raise NotImplementedError

    def check_finite(self, xp: Ops[A], name: str, weights: A) -> None:
        """Raise when the logits are not finite at a row of nonzero ``weights`` (an array on
        the host only, see ``require_finite_at_active``); a head's logits are never built,
        so there is nothing to read (a non-finite head gives a NaN result)."""
        raise NotImplementedError

    def check_mergeable(self, name: str) -> None:
        """Raise when batches cannot be merged along their rows with this source as it is
        (a head: its hidden states are merged instead, then one head built)."""
        raise NotImplementedError

    def rows_per_chunk(self, n_rows: int, on_cpu: bool,
                       beside: LogitsSource[A] | None = None,
                       cpu_bytes: int = HEAD_CHUNK_BYTES_CPU) -> int:
        """Rows R of one token chunk of these [N, K] logits and of ``beside`` (another source
        of the same rows, or None): a head's own ``row_chunk_for`` (``cpu_bytes``: the
        framework's head path's budget on a CPU); an array exists whole, so the R that
        ``beside`` wants (all N, at least 1, without one)."""
        raise NotImplementedError

    def vocab_chunk(self, xp: Ops[A], impl_name: str, on_cpu: bool, chunk_size: int | None,
                    r: int) -> int | None:
        """The vocabulary chunk a backend streams a token chunk of R rows of these logits in
        (its ``chunk_size``): an array's as asked; a head's as the framework's head path asks
        its backend (``xp.head_vocab_chunk``)."""
        raise NotImplementedError


class DenseLogits(LogitsSource[A]):
    """A [..., K] logits array as a ``LogitsSource`` (unchecked: ``check`` says what is
    wrong with it, in the words an array argument's checks use)."""

    __slots__ = ("_array",)

    def __init__(self, array: A) -> None:
        self._array = array

    @property
    def array(self) -> A:
        return self._array

    @property
    def device_array(self) -> A:
        return self._array

    @property
    def vocab(self) -> int:
        return self._array.shape[-1]

    @property
    def shape(self) -> tuple[int, ...]:
        return self._array.shape

    @property
    def ndim(self) -> int:
        return len(self._array.shape)

    @property
    def dtype(self) -> Any:
        return self._array.dtype

    def __repr__(self) -> str:
        return f"DenseLogits({self._array!r})"

    def on_device(self, xp: Ops[A], name: str) -> A:
        require_array(xp, name, self._array)
        return self._array

    def check(self, xp: Ops[A], name: str) -> None:
        require_array(xp, name, self._array)

    def map_arrays(self, fn: Callable[[A], A]) -> DenseLogits[A]:
        return DenseLogits(fn(self._array))

    def arrays(self) -> tuple[A]:
        return (self._array,)

    def with_arrays(self, arrays: tuple[A | None, ...]) -> DenseLogits[A]:
        # cast, not a check: a spec of the torch head path holds a source over None
        # placeholders (``torch_head._pack``), unchecked as documented
        return DenseLogits(cast(A, arrays[0]))

    def flat(self, n_rows: int) -> DenseLogits[A]:
        return DenseLogits(self._array.reshape(n_rows, self._array.shape[-1]))

    def vocab_slice(self, stop: int) -> DenseLogits[A]:
        return DenseLogits(self._array[..., :stop])

    def chunk(self, xp: Ops[A], take: Callable[[A], A], cols: tuple[int, int] | None = None) -> A:
        z = take(self._array)  # [R, K]
        return z if cols is None else z[:, cols[0]:cols[1]]

    def dense(self, xp: Ops[A]) -> A:
        return self._array

    def reference_array(self, xp: Ops[A]) -> A:
        return self._array

    def column(self, xp: Ops[A], idx: A) -> A:
        return xp.f32(xp.gather_cols(self._array, idx))

    def accept(self, kinds: LogitsKinds[A, T]) -> T:
        return kinds.array(self._array)

    def check_finite(self, xp: Ops[A], name: str, weights: A) -> None:
        require_finite_at_active(xp, name, self._array, weights)

    def check_mergeable(self, name: str) -> None:
        pass  # arrays concatenate along their rows

    def rows_per_chunk(self, n_rows: int, on_cpu: bool,
                       beside: LogitsSource[A] | None = None,
                       cpu_bytes: int = HEAD_CHUNK_BYTES_CPU) -> int:
        return (max(1, n_rows) if beside is None
                else beside.rows_per_chunk(n_rows, on_cpu, cpu_bytes=cpu_bytes))

    def vocab_chunk(self, xp: Ops[A], impl_name: str, on_cpu: bool, chunk_size: int | None,
                    r: int) -> int | None:
        return chunk_size


class LinearHead(LogitsSource[A]):
    """``logits = cap(hidden @ weight (+ bias))``, given in place of a logits array.

    hidden: [..., D] (``[B, L, D]`` for the objectives, ``[..., D]`` for ``token_stats``).
    weight: the unembedding in ``weight_layout``: "KD" = [K, D] (torch ``nn.Linear.weight``,
      a tied ``nn.Embedding`` / ``nnx.Embed`` table) or "DK" = [D, K] (a Flax ``Dense``
      kernel). Each front end's default is its own framework's usual layout (torch "KD",
      JAX "DK"); the other is always named explicitly, never inferred from the shape.
    bias: [K] or None.  hidden, weight and bias share one floating dtype.
    softcap: c > 0 (a finite Python or NumPy number) for the final-logit softcap
      cap(z) = c·tanh(z / c) (Gemma's ``final_logit_softcapping``), or None for cap(z) = z.
      It is part of the logits the head stands for, so every function that takes the head
      computes the capped model. Where the head is the student of ``token_stats`` (and so of
      every objective) the cap is the call's ``softcap``, computed by the kernels in float32
      on each chunk's logits; passing ``softcap=`` as well is an error unless the two are
      equal. Elsewhere (a teacher head, the sampler's chunks, ``dense``) the cap is applied
      to the logits as they are formed (``capped``).
    row_chunk: rows per token chunk (default: a heuristic per platform, ``row_chunk_for``, a
      multiple of 64); for JAX's fused Pallas head, the most rows per block. A chunk's
      matmuls run on its rows padded to a multiple of 64 (``head_rows``: one row, one
      answer), so a row_chunk below 64 does the matmul work of 64 rows per chunk.

    It behaves like the logits it stands for where shapes are concerned (``shape``,
    ``dtype``, ``ndim``), so every shape check of the API applies to it unchanged.
    Gradients flow to hidden, weight and bias. The reference backend materialises the
    logits in float32, as it computes logits arrays of any dtype (a float64 head too); the
    other backends form each token chunk's logits in the head's dtype, except JAX's pallas
    backend, whose fused kernels use each float32 MXU product tile as it is.
    """

    DEFAULT_LAYOUT: str = VOCAB_MAJOR  # each front end's subclass sets its own
    hidden: A
    weight: A
    bias: A | None
    weight_layout: str
    row_chunk: int | None
    softcap: float | None

    def __init__(self, hidden: A, weight: A, bias: A | None = None,
                 softcap: float | None = None, *, weight_layout: str | None = None,
                 row_chunk: int | None = None) -> None:
        layout = type(self).DEFAULT_LAYOUT if weight_layout is None else weight_layout
        if layout not in LAYOUTS:
            raise ValueError(f"weight_layout must be one of {LAYOUTS} ('KD': weight [K, D], "
                             f"'DK': weight [D, K]); got {weight_layout!r}")
        row_chunk = check_positive_int("row_chunk", row_chunk, allow_none=True)
        softcap = check_positive_float("softcap", softcap, allow_none=True)
        self.hidden, self.weight, self.bias = hidden, weight, bias
        self.weight_layout, self.row_chunk, self.softcap = layout, row_chunk, softcap

    # -- what it stands for ---------------------------------------------------------------
    @property
    def vocab(self) -> int:  # K
        return self.weight.shape[0 if self.weight_layout == VOCAB_MAJOR else 1]

    @property
    def width(self) -> int:  # D
        return self.hidden.shape[-1]

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.hidden.shape[:-1]) + (self.vocab,)

    @property
    def ndim(self) -> int:
        return len(self.hidden.shape)

    @property
    def dtype(self) -> Any:
        return self.hidden.dtype

    def __repr__(self) -> str:
        cap = "" if self.softcap is None else f", softcap {self.softcap:g}"
        return (f"{type(self).__name__}(hidden {shape_str(self.hidden.shape)}, weight "
                f"{shape_str(self.weight.shape)} ({self.weight_layout}), bias "
                f"{'None' if self.bias is None else shape_str(self.bias.shape)}{cap})")

    # -- rebuilt views ----------------------------------------------------------------------
    def _rebuilt(self, hidden: A, weight: A, bias: A | None,
                 softcap: float | None) -> LinearHead[A]:
        return type(self)(hidden, weight, bias, softcap, weight_layout=self.weight_layout,
                          row_chunk=self.row_chunk)

    def replace(self, hidden: A | None = None, weight: A | None = None,
                bias: A | None = None) -> LinearHead[A]:
        """The same head (its softcap too) with some arrays replaced (None: kept)."""
        return self._rebuilt(self.hidden if hidden is None else hidden,
                             self.weight if weight is None else weight,
                             self.bias if bias is None else bias, self.softcap)

    def without_softcap(self) -> LinearHead[A]:
        """The head of the uncapped logits ``hidden @ weight (+ bias)`` (where a call's
        kernels apply the cap themselves: ``resolve_softcap``)."""
        return self._rebuilt(self.hidden, self.weight, self.bias, None)

    def capped(self, xp: Ops[A], z: A) -> A:
        """cap(z) of logits z this head formed: float32 c·tanh(z / c) computed as every
        backend's kernels compute the softcap (``xp.softcap``: ``token_stats.formulas``'),
        so a sampler or teacher reading these logits sees the values the student's kernels
        cap to; z itself without a softcap."""
        if self.softcap is None:
            return z
        return xp.softcap(xp.f32(z), self.softcap)

    def map_arrays(self, fn: Callable[[A], A]) -> LinearHead[A]:
        """fn applied to hidden, weight and bias (e.g. a stop-gradient)."""
        return self.replace(fn(self.hidden), fn(self.weight),
                            None if self.bias is None else fn(self.bias))

    def flat(self, n_rows: int) -> LinearHead[A]:
        """The head over [N, D] rows (leading dimensions flattened, as logits become [N, K])."""
        return self.replace(hidden=self.hidden.reshape(n_rows, self.width))

    def vocab_slice(self, stop: int) -> LinearHead[A]:
        """The head of the first ``stop`` columns (the vocabulary without its padding)."""
        w = self.weight[:stop] if self.weight_layout == VOCAB_MAJOR else self.weight[:, :stop]
        return self.replace(weight=w, bias=None if self.bias is None else self.bias[:stop])

    def _columns(self, b0: int, b1: int) -> LinearHead[A]:
        """The head of the columns [b0, b1) (a vocabulary block)."""
        w = self.weight[b0:b1] if self.weight_layout == VOCAB_MAJOR else self.weight[:, b0:b1]
        return self.replace(weight=w, bias=None if self.bias is None else self.bias[b0:b1])

    # -- as a LogitsSource: its logits formed token chunk by token chunk --------------------
    materialized = False

    @property
    def array(self) -> None:
        return None

    @property
    def device_array(self) -> A:
        return self.hidden

    def on_device(self, xp: Ops[A], name: str) -> A:
        require_array(xp, f"{name}.hidden", self.hidden)
        return self.hidden

    def arrays(self) -> tuple[A, A, A | None]:
        return (self.hidden, self.weight, self.bias)

    def with_arrays(self, arrays: tuple[A | None, ...]) -> LinearHead[A]:
        hidden, weight, bias = arrays
        # cast, not a check: a spec of the torch head path holds a head over None
        # placeholders (``torch_head._pack``), unchecked as documented
        return self._rebuilt(cast(A, hidden), cast(A, weight), bias, self.softcap)

    def chunk(self, xp: Ops[A], take: Callable[[A], A], cols: tuple[int, int] | None = None) -> A:
        # with a softcap: float32 (capped, not rounded back), the logits as a student's
        # kernels see them after their own cap
        head = self.replace(hidden=take(self.hidden))  # [R, D]
        return self.capped(xp, xp.head_logits(head if cols is None else head._columns(*cols)))

    def dense(self, xp: Ops[A]) -> A:
        z = xp.head_logits(self)
        return z if self.softcap is None else xp.cast_like(self.capped(xp, z), z)

    def reference_array(self, xp: Ops[A]) -> A:
        return self.capped(xp, xp.head_logits(self.map_arrays(xp.f32)))

    def column(self, xp: Ops[A], idx: A) -> A:
        # one dot product of D per row with the gathered row of the weight: O(N·D), over
        # rows padded as whole-row arithmetic wants them (JAX: XLA sums a [1, D] product in
        # another order than the rows of a larger one; one row, one answer)
        w = self.weight if self.weight_layout == VOCAB_MAJOR else self.weight.T  # [K, D]
        n = idx.shape[0]
        rows = xp.whole_row_rows(n, self.width)
        h, i = xp.pad_rows(self.hidden, rows), xp.pad_rows(idx, rows)
        z = xp.rowsum(xp.f32(h) * xp.f32(w[i]))[:n]
        return self.capped(xp, z if self.bias is None else z + xp.f32(self.bias[idx]))

    def accept(self, kinds: LogitsKinds[A, T]) -> T:
        return kinds.head(self)

    def check_finite(self, xp: Ops[A], name: str, weights: A) -> None:
        pass  # its logits are never built: a non-finite one gives NaN

    def check_mergeable(self, name: str) -> None:
        raise TypeError(f"{name} is a LinearHead: merge its hidden states (and the batches' "
                        f"other fields), then build one head")

    def rows_per_chunk(self, n_rows: int, on_cpu: bool,
                       beside: LogitsSource[A] | None = None,
                       cpu_bytes: int = HEAD_CHUNK_BYTES_CPU) -> int:
        return row_chunk_for(n_rows, self.vocab, self.dtype.itemsize, on_cpu, self.row_chunk,
                             cpu_bytes)

    def vocab_chunk(self, xp: Ops[A], impl_name: str, on_cpu: bool, chunk_size: int | None,
                    r: int) -> int | None:
        return xp.head_vocab_chunk(impl_name, on_cpu, chunk_size, r, self.vocab)

    # -- checks ---------------------------------------------------------------------------
    def check(self, xp: Ops[A], name: str) -> None:
        """Kinds, ranks, dtypes and the shared width D; the error names ``name``'s part."""
        h, w, b = self.hidden, self.weight, self.bias
        require_array(xp, f"{name}.hidden", h)
        require_float(xp, f"{name}.hidden", h)
        if len(h.shape) < 1 or h.shape[-1] < 1:
            raise ValueError(f"{name}.hidden must have shape [..., D] with D >= 1; got "
                             f"{shape_str(h.shape)}")
        require_array(xp, f"{name}.weight", w)
        d = h.shape[-1]
        want = _LAYOUT_NAMES[self.weight_layout]
        d_axis = 1 if self.weight_layout == VOCAB_MAJOR else 0
        if len(w.shape) != 2 or w.shape[d_axis] != d:
            other = HIDDEN_MAJOR if self.weight_layout == VOCAB_MAJOR else VOCAB_MAJOR
            raise ValueError(
                f"{name}.weight must have shape {want} with D = {name}.hidden.shape[-1] = {d} "
                f"(weight_layout={self.weight_layout!r}); got {shape_str(w.shape)}. A weight "
                f"laid out as {_LAYOUT_NAMES[other]} needs weight_layout={other!r}")
        if self.vocab < 1:
            raise ValueError(f"{name}.weight must have a vocabulary axis K >= 1; got "
                             f"{shape_str(w.shape)}")
        parts = [("weight", w)]
        if b is not None:
            require_array(xp, f"{name}.bias", b)
            if tuple(b.shape) != (self.vocab,):
                raise ValueError(f"{name}.bias must have shape [K] = [{self.vocab}]; got "
                                 f"{shape_str(b.shape)}")
            parts.append(("bias", b))
        for part, arr in parts:
            if arr.dtype != h.dtype:
                raise TypeError(f"{name}.{part} must have {name}.hidden's dtype "
                                f"{str(h.dtype).replace('torch.', '')}; got "
                                f"{str(arr.dtype).replace('torch.', '')}")


def resolve_softcap(logits: LogitsSource[A], softcap: Any) -> tuple[LogitsSource[A], Any]:
    """(logits, softcap) of a call whose student ``logits`` may be a head with its own
    softcap: the head's cap becomes the call's ``softcap`` (applied by the kernels, in
    float32, exactly as for a logits array) and the head is passed on without it. A call's
    ``softcap`` beside a head's is an error unless the two are equal (the cap would otherwise
    be ambiguous: applied once, or twice)."""
    head_cap = logits.softcap
    if head_cap is None:
        return logits, softcap
    if softcap is not None:
        given = check_positive_float("softcap", softcap)
        if given != head_cap:
            raise ValueError(f"softcap={given!r} was given for logits that are a LinearHead "
                             f"with softcap={head_cap!r}: the head's softcap is already the "
                             f"logits' cap; pass one of them (or equal values)")
    return logits.without_softcap(), head_cap


def as_logits(x: Any) -> LogitsSource[Any]:
    """A ``logits`` argument as the source an op reads: a ``LinearHead`` (or a source
    already resolved) as it is, anything else as a ``DenseLogits`` array (its checks say
    what is wrong with it). The one place the kind of a logits argument is decided."""
    return x if isinstance(x, LogitsSource) else DenseLogits(x)


@dataclasses.dataclass(frozen=True)
class HeadPlan:
    """The head path's schedule choices that depend on which of a call's two sources are
    heads, made once (``head_plan``) where the path is entered (each framework's sweep) and
    read there and by a backend's fused head kernels, which never test the kinds again."""

    #: the student's [R, K] logits chunks are formed by the sweep (a student head), so a
    #: backend may overwrite each with its gradient
    overwrite_chunks: bool
    #: one head needs a gradient and it is the student's: the student is a head and no
    #: teacher head needs one. Required by the vocabulary-block gradient pass (``dw_blocks``)
    #: and by JAX's fused Pallas head kernels (which form no teacher head's gradient)
    student_head_grad_only: bool


def head_plan(logits: LogitsSource[A], teacher: LogitsSource[A] | None,
              teacher_grad: bool) -> HeadPlan:
    """The ``HeadPlan`` of rows of ``logits`` and ``teacher`` (None: no teacher), with
    ``teacher_grad`` the call's flag: the one place past an op's dispatch where the kinds of
    the sources are read."""
    student_head, teacher_head = (x is not None and not x.materialized
                                  for x in (logits, teacher))
    return HeadPlan(overwrite_chunks=student_head,
                    student_head_grad_only=student_head and not (teacher_head and teacher_grad))


def weighting_term(xp: Ops[A], stats: Sequence[A], weighting: Sequence[A | None],
                   detached: Sequence[A | None]) -> A | float:
    """Σ (c - sg(c))·sg(stat): exactly 0, with the gradient Σ stat·dc that a planned total
    (whose coefficients enter its custom VJP as constants) owes its coefficients: loss
    weights, time weights and whatever they were computed from. A non-finite statistic
    counts as 0 here (the total itself is then non-finite already)."""
    term = 0.0
    for c, c0, s in zip(weighting, detached, stats):
        if c is not None:
            assert c0 is not None  # ``detached`` is ``weighting`` under stop_gradient
            s = xp.stop_gradient(s)
            term = term + xp.rowsum((c - c0) * xp.where(xp.isfinite(s), s, 0.0))
    return term


def planned_total(xp: Ops[A], stats: Sequence[A],
                  coefficients: Sequence[A | None]) -> A | None:
    """Σ_rows Σ_fields c·stat over [N] rows, for the fields whose coefficient is given: the
    one scalar a gradient-in-forward call reduces to (the same expression on every path)."""
    total = None
    for c, s in zip(coefficients, stats):
        if c is not None:
            term = xp.rowsum(c * s)
            total = term if total is None else total + term
    return total
