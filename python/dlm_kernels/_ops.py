"""The ops adapter's contract: what framework-neutral code may call on ``xp``.

The shared code (``_objectives``, ``_policy``, ``_checks``, ``_contract``,
``token_stats.op`` and ``token_stats.formulas``, ``sampling.core`` and ``sampling.upstream``,
``linear_head.head``) never imports torch or jax: it takes a framework's ops adapter as ``xp``
and calls the handful of operations whose spelling differs between the two through it.
``Ops[A]`` declares those members, generic in the front end's array type ``A``
(``torch.Tensor``, ``jax.Array``), which is bound to ``Array``: what shared code does with
an array itself (shape, indexing, elementwise arithmetic). ``dlm_kernels._torch.ops.TorchOps``
and ``dlm_kernels._jax.ops.JaxOps`` implement it as classes of static methods and constants
(the class itself is the adapter, never an instance), and shared code annotates ``xp: Ops``
(``Ops[A]`` in a function generic in its arrays, ``Ops[Any]`` where the type is open).

A parameter is positional-only here where the two implementations name it differently (or
one cannot be introspected). Members one framework has alone (``JaxOps.varying_axes``,
``TorchOps.pad_cols``, ...) or that only framework-specific code calls stay out;
tests/test_ops_protocol.py holds both adapters and every ``xp.<name>`` of the shared code to
this protocol.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, Protocol, TypeVar, overload

if TYPE_CHECKING:
    from numpy.typing import NDArray
    from typing_extensions import Self


class Array(Protocol):
    """What framework-neutral code does with an array itself, beside ``xp``: read its shape
    and dtype, index, reshape and transpose it, and elementwise arithmetic and comparisons
    with another array of its type or a Python number (``torch.Tensor`` and ``jax.Array``
    both have these, each returning its own type). For type checkers only: nothing tests
    it at run time."""

    @property
    def shape(self) -> tuple[int, ...]: ...

    @property
    def dtype(self) -> Any: ...  # torch.dtype or a NumPy dtype: the framework's own

    @property
    def T(self) -> Self: ...

    @overload
    def reshape(self, shape: tuple[int, ...], /) -> Self: ...

    @overload
    def reshape(self, *shape: int) -> Self: ...

    def __getitem__(self, key: Any, /) -> Self: ...  # ints, slices, None, ..., index arrays

    def __add__(self, other: Self | float, /) -> Self: ...

    def __radd__(self, other: float, /) -> Self: ...

    def __sub__(self, other: Self | float, /) -> Self: ...

    def __rsub__(self, other: float, /) -> Self: ...

    def __mul__(self, other: Self | float, /) -> Self: ...

    def __rmul__(self, other: float, /) -> Self: ...

    def __truediv__(self, other: Self | float, /) -> Self: ...

    def __rtruediv__(self, other: float, /) -> Self: ...

    def __neg__(self) -> Self: ...

    def __abs__(self) -> Self: ...

    def __invert__(self) -> Self: ...

    def __and__(self, other: Self, /) -> Self: ...

    def __or__(self, other: Self, /) -> Self: ...

    def __lt__(self, other: Self | float, /) -> Self: ...

    def __le__(self, other: Self | float, /) -> Self: ...

    def __gt__(self, other: Self | float, /) -> Self: ...

    def __ge__(self, other: Self | float, /) -> Self: ...

    # elementwise: an array of bools, where object's __eq__ / __ne__ return a bool (torch and
    # jax declare theirs so too, over the same objection of the checker)
    def __eq__(self, other: Self | float, /) -> Self: ...  # pyright: ignore[reportIncompatibleMethodOverride]

    def __ne__(self, other: Self | float, /) -> Self: ...  # pyright: ignore[reportIncompatibleMethodOverride]


#: the front end's array type (torch.Tensor, jax.Array)
A = TypeVar("A", bound=Array)


class Typed(Protocol):
    """What the dtype tests (``Ops.is_real``, ``is_int``, ``is_float``) read: an array's
    ``dtype``, or that of a ``LogitsSource`` standing for one."""

    @property
    def dtype(self) -> Any: ...


class HeadArrays(Protocol[A]):
    """What ``Ops.head_logits`` reads of a ``linear_head.head.LinearHead`` (declared here, so
    that this module, which ``linear_head.head`` imports, imports nothing of the package)."""

    @property
    def hidden(self) -> A: ...

    @property
    def weight(self) -> A: ...

    @property
    def bias(self) -> A | None: ...

    @property
    def weight_layout(self) -> str: ...


class Ops(Protocol[A]):
    """The operations framework-neutral code calls on ``xp``, its adapter of one framework.

    Shapes: N rows, C (or K) columns, B sequences of L positions; ``[...]`` any leading
    dimensions."""

    #: the framework whose arrays this adapter takes: 'torch' or 'jax'
    framework: str
    #: whole-row arithmetic pads its row count to a multiple of this (1 in torch, 8 in JAX)
    row_group: int
    #: the head path's byte budget of one [R, K] token chunk of logits on a CPU
    head_chunk_bytes_cpu: int

    # -- elementwise ------------------------------------------------------------------------
    def exp(self, x: A, /) -> A:
        """e^x elementwise."""
        ...

    def log(self, x: A, /) -> A:
        """The natural logarithm elementwise."""
        ...

    def log1p(self, x: A, /) -> A:
        """log(1 + x) elementwise."""
        ...

    def isfinite(self, x: A, /) -> A:
        """bool [...]: x neither infinite nor NaN."""
        ...

    def where(self, condition: A, x: A | float, y: A | float, /) -> A:
        """x where ``condition`` holds, else y; the three broadcast together."""
        ...

    def maximum(self, x: A, y: A, /) -> A:
        """The elementwise maximum of two arrays (NaN propagates)."""
        ...

    def rounded(self, x: A) -> A:
        """x, a per-row product, rounded before a sum takes it (never fused into a multiply-add)."""
        ...

    def zero_where(self, dead: A, x: A) -> A:
        """x with exact zeros where the bool ``dead`` holds, in x's dtype."""
        ...

    def clamp_min(self, x: A, v: float) -> A:
        """max(x, v) elementwise."""
        ...

    def clamp_max(self, x: A, v: float) -> A:
        """min(x, v) elementwise."""
        ...

    def softcap(self, z: A, c: float) -> A:
        """c·tanh(z / c) of float32 z, the kernels' formula (``formulas.softcap``)."""
        ...

    def stop_gradient(self, x: A) -> A:
        """x cut from autodiff: no gradient flows through it."""
        ...

    # -- dtypes -----------------------------------------------------------------------------
    def f32(self, x: A) -> A:
        """x as float32."""
        ...

    def as_f32(self, x: A | float) -> A:
        """A Python number or an array as a float32 array."""
        ...

    def i32(self, x: A) -> A:
        """x as int32."""
        ...

    def index_ints(self, x: A) -> A:
        """x in the framework's index dtype (torch int64; JAX's default integer)."""
        ...

    def cast_like(self, x: A, like: A) -> A:
        """x in like's dtype."""
        ...

    def int_max(self, x: A) -> int:
        """The largest value x's integer dtype holds."""
        ...

    # -- reductions along the last axis --------------------------------------------------------
    def rowmax(self, x: A) -> A:
        """The maximum of each row: [N, C] -> [N]."""
        ...

    def rowmin(self, x: A) -> A:
        """The minimum of each row: [N, C] -> [N]."""
        ...

    def rowsum(self, x: A) -> A:
        """The sum along the last axis: [..., C] -> [...]."""
        ...

    def any_last(self, x: A) -> A:
        """Whether any along the last axis: bool [..., L] -> bool [...]."""
        ...

    def logsumexp(self, x: A) -> A:
        """log Σ e^x of each row: [N, K] -> [N]."""
        ...

    def cumsum(self, x: A) -> A:
        """The running sum along the last axis: [..., C] -> [..., C]."""
        ...

    def first_max(self, x: A) -> tuple[A, A]:
        """[N, C] -> ([N] maximum, [N] its first position), one pass."""
        ...

    def second_max(self, x: A) -> A:
        """[N, C >= 2] -> [N]: the second largest value of each row (a tie counts)."""
        ...

    def top_k(self, x: A, k: int) -> tuple[A, A]:
        """[N, C] -> ([N, k] largest values, [N, k] their positions), ties lowest first."""
        ...

    def merge_top_k(self, v1: A, i1: A, v2: A, i2: A, k: int) -> tuple[A, A]:
        """The top k ([N, k] values, ids) of two top lists, ids of (v1, i1) below (v2, i2)'s."""
        ...

    def argsort_desc(self, x: A) -> A:
        """[..., C] positions sorting each row descending, stable (ties: lower position first)."""
        ...

    def scatter_rank(self, order: A) -> A:
        """[B, L] -> [B, L]: the inverse permutation of each row of ``order``."""
        ...

    # -- construction -----------------------------------------------------------------------
    def full(self, shape: tuple[int, ...], value: float, like: A) -> A:
        """A float32 array of ``shape`` filled with ``value`` (torch: on like's device)."""
        ...

    def zeros_like(self, x: A) -> A:
        """Zeros of x's shape and dtype."""
        ...

    def arange(self, n: int, like: A) -> A:
        """[n] integers 0 .. n-1 (torch: int64 on like's device; JAX: int32)."""
        ...

    def broadcast_to(self, x: A, shape: tuple[int, ...]) -> A:
        """x broadcast to ``shape``."""
        ...

    def concat(self, xs: Iterable[A]) -> A:
        """The arrays joined along axis 0."""
        ...

    def from_host(self, a: NDArray[Any], like: A) -> A:
        """A NumPy array as one of the framework's arrays (torch: on like's device)."""
        ...

    def owned(self, x: A, source: A) -> A:
        """x, or a copy of it where it is the caller's ``source`` itself (to update in place)."""
        ...

    # -- rows and columns -------------------------------------------------------------------
    def whole_row_rows(self, n: int, columns: int) -> int:
        """The rows whole-row arithmetic over N rows of ``columns`` runs on (N, or N padded)."""
        ...

    @overload
    def pad_rows(self, x: A, n: int) -> A: ...

    @overload
    def pad_rows(self, x: None, n: int) -> None: ...

    def pad_rows(self, x: A | None, n: int) -> A | None:
        """x [N, ...] with zero rows appended up to n rows: [n, ...] (None stays None)."""
        ...

    def gather_cols(self, z: A, idx: A) -> A:
        """z [N, K], idx [N] -> [N]: z[n, idx[n]]."""
        ...

    def add_at_cols(self, x: A, idx: A, vals: A) -> A:
        """x [N, C] with vals[n] added at column idx[n] of row n (idx, vals [N]); may update x."""
        ...

    def take_cols(self, cols: A, idx: A) -> A:
        """cols [C], idx [N, k] -> [N, k]: cols[idx]."""
        ...

    def take_rows(self, x: A, idx: A) -> A:
        """x [B, L], idx [B, L] -> [B, L]: x[b, idx[b, j]]."""
        ...

    def isin(self, ids: A, values: A) -> A:
        """ids [...] -> bool [...]: ids equal to one of values [S]."""
        ...

    # -- 32-bit hashes (the denoising step) -----------------------------------------------------
    def u32(self, x: A | int) -> A:
        """The 32-bit pattern of an integer array or Python int, in the adapter's hash dtype."""
        ...

    def u32_mul(self, x: A, c: int) -> A:
        """The low 32 bits of x·c, x a ``u32`` array."""
        ...

    def shr(self, x: A, s: int) -> A:
        """The logical right shift by s of a ``u32`` array's 32-bit pattern."""
        ...

    # -- the linear head path ---------------------------------------------------------------
    def head_logits(self, head: HeadArrays[A]) -> A:
        """A LinearHead's [..., K] logits of its [..., D] hidden states, differentiable."""
        ...

    def head_token_chunks(self, n: int, r: int) -> list[tuple[int, int, int]]:
        """[(start, stop, first)]: the head path's token chunks of R rows over N rows."""
        ...

    def head_vocab_chunk(self, impl_name: str, on_cpu: bool, chunk_size: int | None, r: int,
                         vocab: int) -> int | None:
        """The chunk_size the head path asks a backend for over a token chunk of R rows."""
        ...

    # -- pytrees (the batch contract's model_inputs) -------------------------------------------
    def tree_flatten(self, tree: Any, is_leaf: Callable[[Any], bool] | None = None
                     ) -> tuple[list[Any], Any]:
        """(leaves, the tree's structure) of a pytree."""
        ...

    def tree_unflatten(self, spec: Any, leaves: Iterable[Any], /) -> Any:
        """The pytree of ``spec``'s structure (from ``tree_flatten``) over ``leaves``."""
        ...

    def leaves_with_paths(self, tree: Any) -> list[tuple[str, Any]]:
        """[(path such as "['input_tokens']", leaf)] of a pytree's leaves (None subtrees out)."""
        ...

    def leaf_paths(self, tree: Any) -> list[str]:
        """The path of every leaf ``tree_flatten`` gives, in its order."""
        ...

    def concat_leaves(self, xs: Iterable[Any]) -> Any:
        """Leaves joined along axis 0 (torch: None where all are None; JAX: NumPy stays NumPy)."""
        ...

    # -- validation -------------------------------------------------------------------------
    def is_array(self, x: object) -> bool:
        """Whether x is an array this front end takes."""
        ...

    def is_real(self, x: Typed) -> bool:
        """Whether x's dtype is bool, integer or floating (not complex)."""
        ...

    def is_int(self, x: Typed) -> bool:
        """Whether x's dtype is an integer one (not bool)."""
        ...

    def is_float(self, x: Typed) -> bool:
        """Whether x's dtype is a floating one."""
        ...

    def concrete(self, x: A, allow_sync: bool = True) -> NDArray[Any] | None:
        """x as a float64/int64 NumPy array; None traced, or on an accelerator unless allow_sync."""
        ...

    def platform(self, x: A) -> str:
        """The platform x is on ('cpu', 'cuda', 'gpu', 'tpu', ...)."""
        ...
