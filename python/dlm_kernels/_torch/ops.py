"""The array-namespace adapter of the torch front end (see ``dlm_kernels.token_stats.formulas``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar, overload

import torch
import torch.nn.functional as F
import torch.utils._pytree as pytree

from ..linear_head.head import (HEAD_CHUNK_BYTES_CPU, MIN_PRODUCT_WIDTH, VOCAB_MAJOR, head_rows, head_vocab_chunk,
                                row_chunks)
from ..token_stats import formulas

if TYPE_CHECKING:
    from .._ops import HeadArrays


def signed32(c: int) -> int:
    """The 32-bit pattern of the Python int c read as a signed 32-bit number."""
    c &= 0xFFFFFFFF
    return c - (1 << 32) if c >= 1 << 31 else c


#: columns of one block of a softcap formed outside autograd (``TorchOps.softcap``)
SOFTCAP_COLUMNS = 4096


class TorchOps:
    """The few operations whose torch spelling differs from jax.numpy, as static methods."""

    framework: ClassVar[str] = 'torch'  # the arrays this front end takes (``_checks.require_array``)

    exp: ClassVar = staticmethod(torch.exp)
    log: ClassVar = staticmethod(torch.log)
    log1p: ClassVar = staticmethod(torch.log1p)
    tanh: ClassVar = staticmethod(torch.tanh)
    isfinite: ClassVar = staticmethod(torch.isfinite)
    maximum: ClassVar = staticmethod(torch.maximum)

    @staticmethod
    def where(condition, x, y, /):  # a def: the library's overloads read as where(condition)
        return torch.where(condition, x, y)

    #: torch's CPU kernels give a row the same bits at any row count: no padding
    row_group: ClassVar[int] = 1

    @staticmethod
    def whole_row_rows(n, columns):  # torch's kernels round alike at any shape: N itself
        return n

    @staticmethod
    def rounded(x):
        """x itself: a per-row product a sum then takes (``JaxOps.rounded`` keeps XLA from
        fusing the two into a multiply-add). Eager torch never contracts, nor does Inductor's
        CPU code (compiled with -ffp-contract=off)."""
        return x

    @overload
    @staticmethod
    def pad_rows(x: torch.Tensor, n: int) -> torch.Tensor: ...

    @overload
    @staticmethod
    def pad_rows(x: None, n: int) -> None: ...

    @staticmethod
    def pad_rows(x: torch.Tensor | None, n: int) -> torch.Tensor | None:
        # x [N, ...] with zero rows appended up to n rows (None stays None)
        if x is None or x.shape[0] == n:
            return x
        return torch.cat([x, x.new_zeros((n - x.shape[0],) + tuple(x.shape[1:]))])

    @staticmethod
    def matmul(a, b, acc):
        """a @ b with the products summed in ``acc`` (float32 or float64), the result in acc:
        16-bit operands as one mixed-precision GEMM on a GPU, upcast on a CPU (which has none)."""
        if a.dtype == acc and b.dtype == acc:
            return a @ b
        if a.is_cuda and a.dtype == b.dtype and acc == torch.float32:
            return torch.mm(a, b, out_dtype=acc)  # 16-bit operands, float32 products and sums
        return a.to(acc) @ b.to(acc)

    @staticmethod
    def rows_matmul(a, b, acc):
        """``matmul`` of a product whose rows are rows' own values (logits, d hidden), as
        ``JaxOps.rows_matmul``: over a's rows padded to ``head_rows`` (a CPU's matmul rounds a
        row by the row count below a multiple of 64) and b's columns to ``MIN_PRODUCT_WIDTH``
        (torch's rounds a row by its position at narrow output widths): one row, one answer,
        docs/design.md §2."""
        n, width = a.shape[0], b.shape[1]
        return TorchOps.matmul(TorchOps.pad_rows(a, head_rows(n)),
                               TorchOps.pad_cols(b, MIN_PRODUCT_WIDTH), acc)[:n, :width]

    @overload
    @staticmethod
    def pad_cols(x: torch.Tensor, n: int) -> torch.Tensor: ...

    @overload
    @staticmethod
    def pad_cols(x: None, n: int) -> None: ...

    @staticmethod
    def pad_cols(x: torch.Tensor | None, n: int) -> torch.Tensor | None:
        # x [..., C] with zero columns appended up to n (None stays None)
        if x is None or x.shape[-1] >= n:
            return x
        return F.pad(x, (0, n - x.shape[-1]))

    @staticmethod
    def f32(x):
        return x.float()

    @staticmethod
    def rowmax(x):  # [N, C] -> [N]
        return x.amax(dim=-1)

    @staticmethod
    def rowsum(x):  # [..., C] -> [...]
        return x.sum(dim=-1)

    @staticmethod
    def any_last(x):  # [..., L] bool -> [...] bool: any along the last axis
        return x.any(dim=-1)

    @staticmethod
    def zero_where(dead, x):  # x with exact zeros where ``dead``: one op, no scalar tensor
        return x.masked_fill(dead, 0.0)

    @staticmethod
    def logsumexp(x):  # [N, K] -> [N]
        return torch.logsumexp(x, dim=-1)

    @staticmethod
    def full(shape, value, like):
        return torch.full(shape, value, dtype=torch.float32, device=like.device)

    @staticmethod
    def zeros_like(x):
        return torch.zeros_like(x)

    @staticmethod
    def arange(n, like):
        return torch.arange(n, device=like.device)

    @staticmethod
    def gather_cols(z, idx):  # z [N, K], idx [N] -> [N]
        return z.gather(-1, idx.long()[:, None])[:, 0]

    @staticmethod
    def owned(x, source):  # x, or a copy of it when it is the caller's ``source`` itself
        return x.clone() if x is source else x

    @staticmethod
    def add_at_cols(x, idx, vals):  # x [N, C] (a temporary: updated in place), idx, vals [N]
        return x.scatter_add_(-1, idx.long()[:, None], vals[:, None].to(x.dtype))

    @staticmethod
    def stop_gradient(x):
        return x.detach()

    @staticmethod
    def softcap(z, c):
        """cap(z) = c·tanh(z / c) of float32 z, the kernels' formula
        (``token_stats.formulas.softcap``): a LinearHead's softcap where its logits are formed
        (``LinearHead.capped``). Outside autograd (a sampler's or a teacher's token chunk, an
        [R, K] of the whole vocabulary) it is formed SOFTCAP_COLUMNS at a time into one
        output, so its dozen float32 temporaries are of a block, not of the chunk (eight
        [64, 262144] float32 temporaries held 512 MiB in the denoising step); elementwise,
        the same bits."""
        if (z.requires_grad and torch.is_grad_enabled()) or z.shape[-1] <= SOFTCAP_COLUMNS:
            return formulas.softcap(TorchOps, z, c)
        out = torch.empty_like(z)
        for c0 in range(0, z.shape[-1], SOFTCAP_COLUMNS):
            out[..., c0:c0 + SOFTCAP_COLUMNS] = formulas.softcap(
                TorchOps, z[..., c0:c0 + SOFTCAP_COLUMNS], c)
        return out

    @staticmethod
    def head_logits(head: HeadArrays[torch.Tensor]) -> torch.Tensor:
        """The logits [..., K] of a LinearHead over [..., D] hidden states, in the head's
        dtype (the matmul accumulates in float32), differentiable; one matmul over the rows
        padded to ``head_rows`` and, where K or D is narrower than ``MIN_PRODUCT_WIDTH``,
        over zero columns appended to both products a row's values come from (the logits
        and, in autograd's backward, d hidden): a row's bits depend on neither the row count
        nor its position."""
        h, w, b = head.hidden, head.weight, head.bias
        lead, d = h.shape[:-1], h.shape[-1]
        k = w.shape[0] if head.weight_layout == VOCAB_MAJOR else w.shape[1]
        h = h.reshape(-1, d)
        n = h.shape[0]
        h = TorchOps.pad_cols(TorchOps.pad_rows(h, head_rows(n)), MIN_PRODUCT_WIDTH)
        if head.weight_layout == VOCAB_MAJOR:  # w [K, D] -> [max(K, 16), max(D, 16)]
            w = TorchOps.pad_rows(TorchOps.pad_cols(w, MIN_PRODUCT_WIDTH),
                                  max(k, MIN_PRODUCT_WIDTH))
            z = F.linear(h, w, TorchOps.pad_cols(b, MIN_PRODUCT_WIDTH))  # [.., D] x [K, D]ᵀ
        else:  # w [D, K] -> [max(D, 16), max(K, 16)]
            w = TorchOps.pad_cols(TorchOps.pad_rows(w, max(d, MIN_PRODUCT_WIDTH)),
                                  MIN_PRODUCT_WIDTH)
            z = h @ w  # [.., D] x [D, K]
            z = z if b is None else z + TorchOps.pad_cols(b, MIN_PRODUCT_WIDTH)
        return z[:n, :k].reshape(*lead, k)

    # the head path's schedule (``linear_head.torch_head``): its CPU budget of a token chunk,
    # its token chunks [(start, stop, first)] and the chunk_size it asks a backend for
    head_chunk_bytes_cpu: ClassVar[int] = HEAD_CHUNK_BYTES_CPU

    @staticmethod
    def head_token_chunks(n: int, r: int) -> list[tuple[int, int, int]]:
        """[(start, stop, first)]: the head path's token chunks of R rows over N rows, rows
        [start, stop) formed and [first, stop) not in an earlier chunk (torch: a ragged last
        chunk, first = start). The denoising step takes a head's rows so too."""
        return [(r0, r1, r0) for r0, r1 in row_chunks(n, r)]

    @staticmethod
    def head_vocab_chunk(impl_name: str, on_cpu: bool, chunk_size, r: int, vocab: int):
        """The chunk_size the head path asks a backend for over a token chunk of R rows: on a
        CPU the chunked backend's vocabulary chunks sized for R rows (``head_vocab_chunk``)
        unless the call gives one. The denoising step asks its sampler so too."""
        if on_cpu and impl_name == "chunked" and chunk_size is None:
            return head_vocab_chunk(r, vocab)
        return chunk_size

    # -- the denoising step (32-bit hashes) ---------------------------------------
    # Eager: int32 bit patterns, whose products wrap modulo 2^32 in torch's kernels (a CPU
    # without AVX-512 has no vector int64 product: seven times the time of an int32 one).
    # Traced by torch.compile: int64 values in [0, 2^32) whose products are exact, since a
    # compiler may take a wrapping signed product as undefined (Inductor's C++ did, and gave
    # every row of a batch the same hash). The same bits either way.
    @staticmethod
    def u32(x):  # the 32-bit pattern of x (int32 eager, int64 in [0, 2^32) traced)
        exact = torch.compiler.is_compiling()
        if torch.is_tensor(x):
            return x.long() & 0xFFFFFFFF if exact else x.to(torch.int32)
        v = int(x) & 0xFFFFFFFF
        return torch.tensor(v if exact else signed32(v),
                            dtype=torch.int64 if exact else torch.int32)

    @staticmethod
    def u32_mul(x, c):  # the low 32 bits of x·c
        if x.dtype == torch.int64:  # exact: x < 2^32 and c as signed 32 bits, |x·c| < 2^63
            return (x * signed32(c)) & 0xFFFFFFFF
        return x * signed32(c)  # int32: wraps in torch's eager kernels

    @staticmethod
    def shr(x, s):  # the logical right shift of the 32-bit pattern
        return (x >> s) & ((1 << (32 - s)) - 1)

    @staticmethod
    def i32_bits(x):  # int32 holding the 32-bit pattern of an xp.u32 array (no wrapping cast)
        return x if x.dtype == torch.int32 else (x - ((x >> 31) << 32)).to(torch.int32)

    @staticmethod
    def i32(x):
        return x.to(torch.int32)

    @staticmethod
    def index_ints(x):  # the framework's index dtype (torch: int64, as torch.topk's)
        return x.long()

    @staticmethod
    def isin(ids, values):  # ids [...] -> bool [...]: ids that equal one of values [S]
        return torch.isin(ids, values)

    @staticmethod
    def rowmin(x):  # [N, C] -> [N]
        return x.amin(dim=-1)

    @staticmethod
    def first_max(x):  # [N, C] -> (max, its first position), one pass
        v, i = torch.max(x, dim=-1)
        return v, i

    @staticmethod
    def top_k(x, k):  # [N, C] -> ([N, k] values, [N, k] positions), ties: lowest position
        values, idx = torch.sort(x, dim=-1, descending=True, stable=True)
        return values[:, :k], idx[:, :k]

    @staticmethod
    def second_max(x):  # [N, C>=2] -> [N]: the second largest value (a tie counts)
        return torch.topk(x, 2, dim=-1).values[:, 1]

    @staticmethod
    def take_cols(cols, idx):  # cols [C], idx [N, k] -> [N, k]
        return cols[idx]

    @staticmethod
    def merge_top_k(v1, i1, v2, i2, k):  # ids of (v1, i1) all below those of (v2, i2)
        v, i = torch.cat([v1, v2], dim=1), torch.cat([i1, i2], dim=1)
        order = torch.sort(v, dim=-1, descending=True, stable=True).indices[:, :k]
        return v.gather(1, order), i.gather(1, order)

    @staticmethod
    def argsort_desc(x):  # stable along the last axis: ties keep the lower position first
        return torch.sort(x, dim=-1, descending=True, stable=True).indices

    @staticmethod
    def scatter_rank(order):  # the inverse permutation of each row of order [B, L]
        return torch.argsort(order, dim=-1)

    @staticmethod
    def take_rows(x, idx):  # x [B, L], idx [B, L] -> x[b, idx[b, j]]
        return x.gather(1, idx)

    @staticmethod
    def cast_like(x, like):
        return x.to(like.dtype)

    @staticmethod
    def cumsum(x):
        return torch.cumsum(x, dim=-1)

    @staticmethod
    def int_max(x):  # the largest value x's integer dtype holds
        return torch.iinfo(x.dtype).max

    @staticmethod
    def from_host(a, like):  # a NumPy array as a tensor on like's device
        return torch.as_tensor(a, device=like.device)

    # -- objectives -----------------------------------------------------------
    @staticmethod
    def clamp_min(x, v):
        return torch.clamp(x, min=v)

    @staticmethod
    def clamp_max(x, v):
        return torch.clamp(x, max=v)

    @staticmethod
    def as_f32(x):
        return torch.as_tensor(x, dtype=torch.float32) if not torch.is_tensor(x) else x.float()

    @staticmethod
    def broadcast_to(x, shape):
        return torch.broadcast_to(x, shape)

    @staticmethod
    def concat(xs):
        return torch.cat(list(xs), dim=0)

    # -- pytrees (the batch contract's model_inputs) ----------------------------
    @staticmethod
    def leaves_with_paths(tree):  # -> [(path such as "['input_tokens']", leaf)]
        # None is an empty subtree, as in JAX (torch's pytree counts it as a leaf)
        flat, _ = pytree.tree_flatten_with_path(tree)
        return [(pytree.keystr(path), leaf) for path, leaf in flat if leaf is not None]

    @staticmethod
    def leaf_paths(tree):  # the path of every leaf tree_flatten gives, None leaves too
        return [pytree.keystr(path) for path, _ in pytree.tree_flatten_with_path(tree)[0]]

    tree_flatten: ClassVar = staticmethod(pytree.tree_flatten)  # -> (leaves, TreeSpec)
    tree_unflatten: ClassVar = staticmethod(lambda spec, leaves: pytree.tree_unflatten(leaves, spec))

    @staticmethod
    def concat_leaves(xs):
        xs = list(xs)
        return None if all(x is None for x in xs) else torch.cat(xs, dim=0)

    # -- validation -----------------------------------------------------------
    @staticmethod
    def is_array(x):
        return torch.is_tensor(x)

    @staticmethod
    def is_real(x):  # bool, integer or floating (not complex)
        return not x.dtype.is_complex

    @staticmethod
    def is_int(x):
        return not x.dtype.is_floating_point and not x.dtype.is_complex and x.dtype != torch.bool

    @staticmethod
    def is_float(x):
        return x.dtype.is_floating_point

    @staticmethod
    def concrete(x, allow_sync=True):
        """x as a float64/int64 NumPy array; None under tracing (torch.compile), and None for
        accelerator tensors when ``allow_sync`` is False (no device sync in scoring calls)."""
        if torch.compiler.is_compiling() or x.device.type == "meta":
            return None
        if not allow_sync and x.device.type != "cpu":
            return None
        x = x.detach()
        if x.dtype.is_floating_point:
            x = x.double()
        return x.cpu().numpy()

    @staticmethod
    def platform(x):
        return x.device.type
