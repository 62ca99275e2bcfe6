"""The array-namespace adapter of the JAX front end (see ``dlm_kernels.token_stats.formulas``)."""

from __future__ import annotations

from typing import ClassVar, overload

import jax
import jax.core  # jax.core.Tracer below: loaded by ``import jax``, named here for a checker
import jax.numpy as jnp
import numpy as np

from .._config import ROW_GROUP, min_block_rows, padded_rows
from ..linear_head.head import HEAD_CHUNK_BYTES_CPU_JAX, VOCAB_MAJOR, head_rows
from ..token_stats import formulas


class JaxOps:
    """The few operations whose jax.numpy spelling differs from torch, as static methods."""

    framework: ClassVar[str] = 'jax'  # the arrays this front end takes (``_checks.require_array``)

    exp: ClassVar = staticmethod(jnp.exp)
    log: ClassVar = staticmethod(jnp.log)
    log1p: ClassVar = staticmethod(jnp.log1p)
    tanh: ClassVar = staticmethod(jnp.tanh)
    isfinite: ClassVar = staticmethod(jnp.isfinite)
    maximum: ClassVar = staticmethod(jnp.maximum)

    @staticmethod
    def where(condition, x, y, /):  # a def: the library's overloads read as where(condition)
        return jnp.where(condition, x, y)

    #: rows that whole-row arithmetic pads a call to a multiple of (``padded_rows``): XLA's
    #: CPU code computes exp and log of the last N mod 8 rows of a shape, and a [1, C] sum of
    #: a product, with other code than the rest (docs/design.md §2)
    row_group: ClassVar[int] = ROW_GROUP

    @staticmethod
    def whole_row_rows(n, columns):
        """The rows whole-row arithmetic over N rows of ``columns`` runs on: N padded to a
        multiple of ROW_GROUP and to at least ``_config.min_block_rows`` (XLA's CPU code for
        a smaller [N, C] shape rounds otherwise, docs/design.md §2)."""
        return max(padded_rows(n, ROW_GROUP), min_block_rows(columns)) if n else 0

    @staticmethod
    def rounded(x):
        """x, a product of per-row values, rounded to float32 before a sum takes it. XLA's CPU
        and GPU compilers contract a product and the sum that takes it into one fused
        multiply-add (one rounding instead of two) wherever both land in one fused loop, and
        whether they do depends on the whole program (a factor that a small call hoists out
        of its loop of row blocks, a larger one computes inside it): a row's gradient came
        out an ulp apart between a batch and the row alone (docs/design.md §2). The select
        on x's own NaN test stands between them; no compiler may remove it (it could change
        a NaN's payload), and a NaN stays NaN. (A select on a mask would not do: a mask
        known when compiling, all rows active, folds away.)"""
        return jnp.where(jnp.isnan(x), jnp.nan, x)

    @staticmethod
    def rows_matmul(a, b, acc):
        """a @ b accumulated and returned in ``acc``, for a product whose rows are rows' own
        values: over a's rows padded to ``head_rows`` (a CPU's matmul rounds a row by the
        row count below a multiple of 64: one row, one answer, docs/design.md §2)."""
        n = a.shape[0]
        return jnp.matmul(JaxOps.pad_rows(a, head_rows(n)), b, preferred_element_type=acc)[:n]

    @overload
    @staticmethod
    def pad_rows(x: jax.Array, n: int) -> jax.Array: ...

    @overload
    @staticmethod
    def pad_rows(x: None, n: int) -> None: ...

    @staticmethod
    def pad_rows(x: jax.Array | None, n: int) -> jax.Array | None:
        # x [N, ...] with zero rows appended up to n rows (None stays None)
        if x is None or x.shape[0] == n:
            return x
        return jnp.pad(x, [(0, n - x.shape[0])] + [(0, 0)] * (x.ndim - 1))

    @staticmethod
    def f32(x):
        return jnp.asarray(x).astype(jnp.float32)

    @staticmethod
    def rowmax(x):  # [N, C] -> [N]
        return jnp.max(x, axis=-1)

    @staticmethod
    def rowsum(x):  # [..., C] -> [...]
        return jnp.sum(x, axis=-1)

    @staticmethod
    def any_last(x):  # [..., L] bool -> [...] bool: any along the last axis
        return jnp.any(x, axis=-1)

    @staticmethod
    def zero_where(dead, x):  # x with exact zeros where ``dead``
        return jnp.where(dead, 0.0, x).astype(x.dtype)

    @staticmethod
    def logsumexp(x):  # [N, K] -> [N]
        return jax.nn.logsumexp(x, axis=-1)

    @staticmethod
    def full(shape, value, like):
        return jnp.full(shape, value, dtype=jnp.float32)

    @staticmethod
    def zeros_like(x):
        return jnp.zeros_like(x)

    @staticmethod
    def arange(n, like):
        return jnp.arange(n, dtype=jnp.int32)

    @staticmethod
    def gather_cols(z, idx):  # z [N, K], idx [N] -> [N]
        return jnp.take_along_axis(z, idx[:, None].astype(jnp.int32), axis=-1)[:, 0]

    @staticmethod
    def owned(x, source):  # arrays are immutable: nothing to protect
        return x

    @staticmethod
    def add_at_cols(x, idx, vals):  # x [N, C], idx, vals [N] -> x with vals added at idx
        # a compare-and-select XLA fuses with the elementwise work around it (a scatter would
        # materialise x as one more [N, C] temporary)
        hit = jnp.arange(x.shape[1], dtype=jnp.int32)[None, :] == idx.astype(jnp.int32)[:, None]
        return x + jnp.where(hit, vals.astype(x.dtype)[:, None], 0.0)

    @staticmethod
    def stop_gradient(x):
        return jax.lax.stop_gradient(x)

    # -- shard_map varying types -------------------------------------------------
    @staticmethod
    def varying_axes(a):
        """The shard_map mesh axes ``a`` varies over (jax >= 0.10: manual_axis_type.varying;
        earlier releases with check_vma: aval.vma)."""
        aval = jax.typeof(a)
        mat = getattr(aval, "manual_axis_type", None)
        return frozenset(mat.varying if mat is not None else getattr(aval, "vma", ()))

    @staticmethod
    def to_varying(x, axes):
        if hasattr(jax.lax, "pcast"):
            return jax.lax.pcast(x, axes, to="varying")
        # jax < 0.10, whose pvary the installed jax's stubs (0.10 on) no longer declare
        return jax.lax.pvary(x, axes)  # pyright: ignore[reportAttributeAccessIssue]

    @staticmethod
    def softcap(z, c):
        """cap(z) = c·tanh(z / c) of float32 z, the kernels' formula
        (``token_stats.formulas.softcap``): a LinearHead's softcap where its logits are formed
        (``LinearHead.capped``)."""
        return formulas.softcap(JaxOps, z, c)

    @staticmethod
    def head_logits(head):
        """The logits [..., K] of a LinearHead over [..., D] hidden states, in the head's
        dtype, differentiable; one matmul over the rows padded to ``head_rows`` (a row's
        bits do not depend on the row count)."""
        h = head.hidden
        lead, d = h.shape[:-1], h.shape[-1]
        h = h.reshape(-1, d)
        n = h.shape[0]
        h = JaxOps.pad_rows(h, head_rows(n))
        if head.weight_layout == VOCAB_MAJOR:
            z = jnp.einsum("nd,kd->nk", h, head.weight)
        else:
            z = jnp.einsum("nd,dk->nk", h, head.weight)
        z = z if head.bias is None else z + head.bias
        return z[:n].reshape(*lead, z.shape[-1])

    # the head path's schedule (``linear_head.jax_head``): its CPU budget of a token chunk,
    # its token chunks [(start, stop, first)] and the chunk_size it asks a backend for
    head_chunk_bytes_cpu: ClassVar[int] = HEAD_CHUNK_BYTES_CPU_JAX

    @staticmethod
    def head_token_chunks(n: int, r: int) -> list[tuple[int, int, int]]:
        """[(start, stop, first)]: the head path's token chunks of R rows over N rows
        (``_Sweep``), rows [start, stop) formed and [first, stop) not in an earlier chunk:
        every chunk R rows, the last starting at N - R. The denoising step takes a head's
        rows so too."""
        starts = [(i * r, min(i * r, n - r)) for i in range(-(-n // r))]
        return [(start, start + r, first) for first, start in starts]

    @staticmethod
    def head_vocab_chunk(impl_name: str, on_cpu: bool, chunk_size, r: int, vocab: int):
        """The chunk_size the head path asks a backend for: the call's."""
        return chunk_size

    # -- the denoising step (32-bit hashes as uint32; rows of ids) --------------
    @staticmethod
    def u32(x):
        if isinstance(x, int):
            return jnp.uint32(x & 0xFFFFFFFF)
        return jnp.asarray(x).astype(jnp.uint32)

    @staticmethod
    def u32_mul(x, c):  # uint32 products wrap: the low 32 bits
        return x * jnp.uint32(c)

    @staticmethod
    def isin(ids, values):  # ids [...] -> bool [...]: ids that equal one of values [S]
        return jnp.isin(ids, values)

    @staticmethod
    def i32(x):
        return x.astype(jnp.int32)

    @staticmethod
    def index_ints(x):  # int64 under jax_enable_x64, else int32 (JAX's default integer)
        return x.astype(jax.dtypes.canonicalize_dtype(jnp.int64))

    @staticmethod
    def rowmin(x):  # [N, C] -> [N]
        return jnp.min(x, axis=-1)

    @staticmethod
    def first_max(x):  # [N, C] -> (max, its first position)
        # the max a reduction's, not a gather at the position: XLA may recompute a gathered
        # z·(1/T) inside a consumer and contract it with a subtraction (sampling.core.exponents)
        return jnp.max(x, axis=-1), jnp.argmax(x, axis=-1).astype(jnp.int32)

    @staticmethod
    def shr(x, s):  # uint32: a logical shift
        return x >> s

    @staticmethod
    def top_k(x, k):  # [N, C] -> ([N, k] values, [N, k] positions), ties: lowest position
        return jax.lax.top_k(x, k)

    @staticmethod
    def second_max(x):  # [N, C>=2] -> [N]: the second largest value (a tie counts)
        return jax.lax.top_k(x, 2)[0][:, 1]

    @staticmethod
    def take_cols(cols, idx):  # cols [C], idx [N, k] -> [N, k]
        return cols[idx]

    @staticmethod
    def merge_top_k(v1, i1, v2, i2, k):  # ids of (v1, i1) all below those of (v2, i2)
        v, i = jnp.concatenate([v1, v2], axis=1), jnp.concatenate([i1, i2], axis=1)
        values, order = jax.lax.top_k(v, k)
        return values, jnp.take_along_axis(i, order, axis=1)

    @staticmethod
    def argsort_desc(x):  # stable along the last axis: ties keep the lower position first
        return jnp.argsort(-x, axis=-1, stable=True)

    @staticmethod
    def scatter_rank(order):  # the inverse permutation of each row of order [B, L]
        return jnp.argsort(order, axis=-1)

    @staticmethod
    def take_rows(x, idx):  # x [B, L], idx [B, L] -> x[b, idx[b, j]]
        return jnp.take_along_axis(x, idx, axis=1)

    @staticmethod
    def cast_like(x, like):
        return x.astype(like.dtype)

    @staticmethod
    def cumsum(x):
        return jnp.cumsum(x, axis=-1)

    @staticmethod
    def int_max(x):  # the largest value x's integer dtype holds
        return int(jnp.iinfo(x.dtype).max)

    @staticmethod
    def from_host(a, like):  # a NumPy array as a JAX array
        return jnp.asarray(a)

    # -- objectives -----------------------------------------------------------
    @staticmethod
    def clamp_min(x, v):
        return jnp.maximum(x, v)

    @staticmethod
    def clamp_max(x, v):
        return jnp.minimum(x, v)

    @staticmethod
    def as_f32(x):
        return jnp.asarray(x, dtype=jnp.float32)

    @staticmethod
    def broadcast_to(x, shape):
        return jnp.broadcast_to(x, shape)

    @staticmethod
    def concat(xs):
        return jnp.concatenate(list(xs), axis=0)

    # -- pytrees (the batch contract's model_inputs) ----------------------------
    @staticmethod
    def leaves_with_paths(tree):  # -> [(path such as "['input_tokens']", leaf)]
        flat, _ = jax.tree_util.tree_flatten_with_path(tree)
        return [(jax.tree_util.keystr(path), leaf) for path, leaf in flat]

    @staticmethod
    def leaf_paths(tree):  # the path of every leaf tree_flatten gives
        return [jax.tree_util.keystr(path)
                for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]

    tree_flatten: ClassVar = staticmethod(jax.tree_util.tree_flatten)  # -> (leaves, treedef)
    tree_unflatten: ClassVar = staticmethod(jax.tree_util.tree_unflatten)

    @staticmethod
    def concat_leaves(xs):
        """Concatenate on axis 0; host NumPy arrays stay NumPy (nothing moves to a device)."""
        xs = list(xs)
        if all(isinstance(x, np.ndarray) for x in xs):
            return np.concatenate(xs, axis=0)
        return jnp.concatenate(xs, axis=0)

    # -- validation -----------------------------------------------------------
    @staticmethod
    def is_array(x):
        # a ShapeDtypeStruct stands for an array (jax.eval_shape over batch construction)
        return isinstance(x, (jax.Array, np.ndarray, jax.ShapeDtypeStruct))

    @staticmethod
    def is_real(x):  # bool, integer or floating (not complex, string or object)
        dt = x.dtype
        return (dt == np.bool_ or jnp.issubdtype(dt, jnp.integer)
                or jnp.issubdtype(dt, jnp.floating))

    @staticmethod
    def is_int(x):
        return jnp.issubdtype(x.dtype, jnp.integer)

    @staticmethod
    def is_float(x):
        return jnp.issubdtype(x.dtype, jnp.floating)

    @staticmethod
    def concrete(x, allow_sync=True):
        """x as a float64/int64 NumPy array; None for a tracer, and None for arrays on an
        accelerator when ``allow_sync`` is False (no device sync in scoring calls)."""
        if isinstance(x, (jax.core.Tracer, jax.ShapeDtypeStruct)):
            return None
        if not allow_sync and isinstance(x, jax.Array) and any(
                dev.platform != "cpu" for dev in x.devices()):
            return None
        x = np.asarray(x)
        return x.astype(np.float64) if np.issubdtype(x.dtype, np.floating) else x

    @staticmethod
    def platform(x):
        if isinstance(x, jax.core.Tracer) or not isinstance(x, jax.Array):
            return jax.default_backend()
        try:
            return next(iter(x.devices())).platform
        except Exception:  # abstract arrays
            return jax.default_backend()
