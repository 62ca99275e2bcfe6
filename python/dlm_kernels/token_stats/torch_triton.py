"""The triton backend for torch: launchers (allocate, pick the config, launch) registered as
``torch.library`` custom ops, so ``torch.compile`` traces them without graph breaks.

Kernels live in ``dlm_kernels.kernels.triton.token_stats``; this module only allocates and
launches. Nothing here synchronises with the host. ``dlm_kernels.testing.poisoned_outputs()``
fills every output with NaN before the kernels write it (the tests do), so an element the
kernels leave unwritten cannot pass for a value.
"""

from __future__ import annotations

import typing
from typing import NamedTuple, Optional, Tuple

import torch
import triton

from . import formulas as stats_math
from .._dispatch import BackendBase, Capabilities
from .lowering import Lowered
from ..kernels.layout import PARTIAL_STATE, ROW_STATS
from ..kernels.triton import token_stats as kernels
from .formulas import Stats
from .._torch.buffers import empty as _empty
from .._torch.ops import TorchOps
from .._torch.triton import unit_col, plan, unsupported_reason

Tensor = torch.Tensor


def _vec(t: Optional[Tensor]) -> Optional[Tensor]:
    """[N] per-row inputs are indexed as row * 1: make them dense (cotangents of a sum()
    arrive expanded, with stride 0)."""
    return None if t is None else t.contiguous()


_ZERO_OFFSET = {}


def _offset(col_offset, device):
    """The kernels read a shard's global column offset from memory (one int32). Offset 0 (every
    call that is not a vocabulary shard) reuses one read-only zero per device, so plain calls
    launch no extra fill; a shard's offset is a one-element fill, no host synchronisation."""
    if col_offset != 0:
        return torch.full((1,), col_offset, dtype=torch.int32, device=device)
    if device not in _ZERO_OFFSET:
        zero = torch.zeros(1, dtype=torch.int32, device=device)
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            # made inside a CUDA graph capture, its fill runs only when the graph replays:
            # not a zero eager calls could rely on, so it is not kept
            return zero
        _ZERO_OFFSET[device] = zero
    return _ZERO_OFFSET[device]


# launch_partial and launch_grad (with ``_torch.triton``'s plan) are this module's
# launch surface: the custom ops below use them, and so does the benchmark's launch sweep
# (bench/launch_sweep.py).


def _state_rows(low: Lowered):
    """Rows of the partial buffer: PARTIAL_STATE, its last (Σ r) only with label smoothing."""
    return len(PARTIAL_STATE) if low.SMOOTH else len(PARTIAL_STATE) - 1


def launch_partial(z, u, x, d, active, low: Lowered, col_offset=0, launch=None):
    """Partial row states [PARTIAL_STATE, S, N] f32 of z: [N, K] (S vocabulary splits; the
    Σ r row only with label smoothing), the call lowered as ``low``; ``launch`` overrides
    the heuristic's plan (bench/launch_sweep.py)."""
    n, k = z.shape
    launch = launch or plan(z, u, low.chunk_size)
    part = _empty((_state_rows(low), launch["splits"], n), torch.float32, z.device)  # 32·S B/row
    if n > 0:
        dummy = z
        kernels.stats_partial_kernel[(n, launch["splits"])](
            z, dummy if u is None else u, dummy if x is None else x, dummy if d is None else d,
            active, _offset(col_offset, z.device), n, k, z.stride(0),
            0 if u is None else u.stride(0), launch["cols_per_split"], low.vocab_limit,
            low.inv_t, low.inv_t_ce, low.inv_t_kl, low.softcap,
            part, BLOCK_K=launch["block_k"], VEC=launch["vec"],
            ROWS_ALIGNED=kernels.rows_aligned(z.stride(0), 0 if u is None else u.stride(0)),
            num_warps=launch["num_warps"],
            num_stages=launch["num_stages"], **low.triton_flags(),
            **({"SMOOTH": True} if low.SMOOTH else {}))
    return part


# -- the custom ops ---------------------------------------------------------------------
# Each op takes its own arguments (one NamedTuple below), then the lowered call's fields
# flat (Lowered.schema(): written once, for every op); its body and its fake receive both
# rebuilt, (own arguments, Lowered).

_SCHEMA_TYPES = {Tensor: "Tensor", Optional[Tensor]: "Tensor?", int: "int"}


def _custom_op(name, own, returns, fake, mutates=()):
    """Registers the decorated ``body(args: own, low: Lowered)`` as the torch.library op
    ``name`` (and ``fake`` for it): schema own's fields, then Lowered's, -> ``returns``."""
    params = ", ".join(f"{_SCHEMA_TYPES[kind]}{'(a!)' if field in mutates else ''} {field}"
                       for field, kind in typing.get_type_hints(own).items())
    schema = f"({params}, {Lowered.schema()}) -> {returns}"
    n = len(own._fields)
    split = lambda args: (own(*args[:n]), Lowered(*args[n:]))  # noqa: E731

    def define(body):
        op = torch.library.custom_op(name, lambda *args: body(*split(args)),
                                     mutates_args=mutates, schema=schema)
        op.register_fake(lambda *args: fake(*split(args)))
        op.__doc__ = body.__doc__
        return op

    return define


class FwdArgs(NamedTuple):
    z: Tensor  # [N, K] logits
    u: Optional[Tensor]  # [N, K] teacher logits
    y: Tensor  # [N] targets
    active: Tensor  # [N] int8
    x: Optional[Tensor]  # [N] shift columns
    d: Optional[Tensor]  # [N] shifts


class PartialArgs(NamedTuple):
    z: Tensor
    u: Optional[Tensor]
    active: Tensor
    x: Optional[Tensor]
    d: Optional[Tensor]
    col_offset: int  # the shard's first global column


class GradArgs(NamedTuple):
    z: Tensor
    u: Optional[Tensor]
    y: Tensor
    active: Tensor
    x: Optional[Tensor]
    d: Optional[Tensor]
    stats: Tensor  # [ROW_STATS, N] f32
    g_lse: Tensor  # [N] cotangents; g_lp [3, N] with the CE terms
    g_lp: Tensor
    g_h: Tensor
    g_kl: Tensor
    col_offset: int


def _fwd_fake(a: FwdArgs, low: Lowered):
    return a.z.new_empty((len(ROW_STATS) + low.SMOOTH, a.z.shape[0]), dtype=torch.float32)


@_custom_op("dlm_kernels::token_stats_fwd", FwdArgs, "Tensor", _fwd_fake)
def token_stats_fwd(a: FwdArgs, low: Lowered) -> Tensor:
    """Row statistics [ROW_STATS, N] f32 (lse, logp, entropy, kl, then the backward's
    residuals kl_shift, m, la, la_ce, mu, la_u) of z: [N, K]; with label smoothing one more
    row, Σ r over the valid columns."""
    z, u = unit_col(a.z), unit_col(a.u)
    part = launch_partial(z, u, a.x, a.d, a.active, low)
    return launch_finalize(part, z, a.y, a.x, a.d, a.active, low)


def launch_finalize(part, z, y, x, d, active, low: Lowered):
    """Row statistics [ROW_STATS, N] f32 (with label smoothing one more row, Σ r merged over
    the splits) from the partial states part [>= 3, S, N] of z: [N, K] (unit column stride),
    the targets y [N] read from z. The Triton sampler finalises its own split states so
    too."""
    n, k = z.shape
    s = part.shape[1]
    out = _empty((len(ROW_STATS) + low.SMOOTH, n), torch.float32, z.device)  # 40 B/row
    if n > 0:
        dummy = z
        rows = kernels.FINALIZE_ROWS
        kernels.stats_finalize_kernel[(triton.cdiv(n, rows),)](
            part, z, y, dummy if x is None else x, dummy if d is None else d,
            active, n, k, s, z.stride(0), low.inv_t, low.inv_t_ce, low.inv_t_kl,
            low.softcap, out, BLOCK_N=rows, num_warps=kernels.FINALIZE_WARPS,
            **low.triton_flags(), **({"SMOOTH": True} if low.SMOOTH else {}))
    return out


class FinalizeArgs(NamedTuple):
    part: Tensor  # [>= 3, S, N] f32 partial states (PARTIAL_STATE's m, a, b first)
    z: Tensor  # [N, K] logits (the target column only is read)
    y: Tensor  # [N] targets
    active: Tensor  # [N] int8


def _finalize_fake(a: FinalizeArgs, low: Lowered):
    return a.z.new_empty((len(ROW_STATS), a.z.shape[0]), dtype=torch.float32)


@_custom_op("dlm_kernels::token_stats_finalize", FinalizeArgs, "Tensor", _finalize_fake)
def token_stats_finalize(a: FinalizeArgs, low: Lowered) -> Tensor:
    """Row statistics [ROW_STATS, N] f32 of given partial states (no shift, no teacher, no
    label smoothing): the finalize of ``token_stats_fwd`` alone."""
    return launch_finalize(a.part, unit_col(a.z), a.y, None, None, a.active, low)


def _partial_fake(a: PartialArgs, low: Lowered):
    splits = plan(a.z, a.u, low.chunk_size)["splits"]  # the same plan as the launch
    return a.z.new_empty((_state_rows(low), splits, a.z.shape[0]), dtype=torch.float32)


@_custom_op("dlm_kernels::token_stats_partial", PartialArgs, "Tensor", _partial_fake)
def token_stats_partial(a: PartialArgs, low: Lowered) -> Tensor:
    """Partial states [PARTIAL_STATE, S, N] of a vocabulary shard starting at global column
    col_offset (the Σ r row only with label smoothing)."""
    return launch_partial(unit_col(a.z), unit_col(a.u), a.x, a.d, a.active, low,
                          a.col_offset)


def launch_grad(z, u, y, active, x, d, stats, grads, dz, du, low: Lowered, col_offset=0,
                launch=None):
    n, k = z.shape
    if n == 0:
        return
    launch = launch or plan(z, u, low.chunk_size)
    dummy = z
    kernels.stats_grad_kernel[(n, launch["splits"])](
        z, dummy if u is None else u, y, dummy if x is None else x, dummy if d is None else d,
        active, stats, grads[0], grads[1], grads[2], grads[3], _offset(col_offset, z.device),
        n, k, z.stride(0), 0 if u is None else u.stride(0), dz.stride(0),
        0 if du is None else du.stride(0), launch["cols_per_split"], low.vocab_limit,
        low.inv_t, low.inv_t_ce, low.inv_t_kl, low.softcap, dz, dummy if du is None else du,
        TEACHER_GRAD=low.TEACHER_GRAD, BLOCK_K=launch["block_k"],
        ROWS_ALIGNED=kernels.rows_aligned(*(t.stride(0) for t in (z, u, dz, du) if t is not None)),
        num_warps=launch["num_warps"], num_stages=launch["num_stages"], **low.triton_flags(),
        **({"CE_TERMS": True} if low.CE_TERMS else {}))


def _teacher_grad_out(u, low: Lowered, like: Tensor):
    """du [N, K] in u's dtype with teacher_grad, else an empty tensor."""
    return _empty(u.shape, u.dtype, u.device) if low.TEACHER_GRAD else like.new_empty((0,))


def _grad(a: GradArgs, low: Lowered, dz: Tensor, u: Optional[Tensor]) -> Tensor:
    du = _teacher_grad_out(u, low, dz)
    launch_grad(a.z, u, a.y, a.active, a.x, a.d, a.stats, (a.g_lse, a.g_lp, a.g_h, a.g_kl),
                dz, du if low.TEACHER_GRAD else None, low, a.col_offset)
    return du


def _bwd_fake(a: GradArgs, low: Lowered):
    du = torch.empty_like(a.u) if low.TEACHER_GRAD else a.z.new_empty((0,))
    return torch.empty_like(a.z), du


@_custom_op("dlm_kernels::token_stats_bwd", GradArgs, "(Tensor, Tensor)", _bwd_fake)
def token_stats_bwd(a: GradArgs, low: Lowered) -> Tuple[Tensor, Tensor]:
    """(dz [N, K] in z's dtype, du [N, K] in u's dtype or an empty tensor). g_lp is [N], or
    with label smoothing / z-loss the CE term's coefficients [3, N] (g_y, g_u, g_p)."""
    a = a._replace(z=unit_col(a.z))
    dz = _empty(a.z.shape, a.z.dtype, a.z.device)
    return dz, _grad(a, low, dz, unit_col(a.u))


@_custom_op("dlm_kernels::token_stats_bwd_", GradArgs, "Tensor",
            lambda a, low: _bwd_fake(a, low)[1], mutates=("z",))
def token_stats_bwd_inplace(a: GradArgs, low: Lowered) -> Tensor:
    """Writes dz into z itself (z must have unit column stride); returns du or empty."""
    if a.z.stride(-1) != 1:
        raise ValueError("inplace_grad needs logits with unit stride on the vocabulary axis; "
                         f"got strides {tuple(a.z.stride())}")
    return _grad(a, low, a.z, unit_col(a.u))


def _op_rows(rows):
    """The bundle as the custom ops take it: (z, u, y, active, x, d), the [N] inputs dense
    and the active mask as int8 (what the kernels load)."""
    return (rows.logits, rows.teacher, _vec(rows.targets), _vec(rows.active.to(torch.int8)),
            _vec(rows.shift_ids), _vec(rows.shift))


class TritonTorch(BackendBase):
    name = "triton"
    custom_vjp = True
    capabilities = Capabilities(vocab_shards=True, inplace_grad=True)

    unsupported_reason = staticmethod(unsupported_reason)

    @staticmethod
    def forward(rows, cfg):
        # rows: [N, K] logits / teacher, [N] per-row inputs; cfg: the lowered call -> Stats
        # of [N] f32 (views of one [ROW_STATS, N] buffer)
        out = torch.ops.dlm_kernels.token_stats_fwd(*_op_rows(rows), *cfg)
        stats = Stats(*out.unbind(0)[:len(ROW_STATS)])
        if not cfg.CE_TERMS:
            return stats
        sr = out[len(ROW_STATS)] if cfg.SMOOTH else None  # the CE term on the host: O(N)
        return stats._replace(logp=stats_math.ce_objective(
            TorchOps, stats.logp, sr, stats.m, stats.la_ce, rows.active, cfg))

    @staticmethod
    def forward_partial(rows, cfg, offset=0):
        # one vocabulary shard starting at global column ``offset`` -> (State, r_y, found)
        z, u, _, _, x, d = _op_rows(rows)
        active = torch.ones(z.shape[0], dtype=torch.int8, device=z.device)
        part = torch.ops.dlm_kernels.token_stats_partial(z, u, active, x, d, int(offset),
                                                         *cfg)
        state = stats_math.merge_splits(TorchOps, [p.t() for p in part.unbind(0)], cfg)  # S splits
        return (state, *stats_math.target_logit(TorchOps, rows, cfg, offset))

    @staticmethod
    def backward(rows, stats, grads, cfg, inplace=False, offset=0):
        stacked = torch.stack(tuple(stats))  # [ROW_STATS, N] f32
        if cfg.CE_TERMS:  # the CE term's per-row coefficients [3, N] in place of g_lp
            g_y, g_u, g_p = stats_math.ce_coefficients(TorchOps, grads[1], stats, cfg)
            g_u = torch.zeros_like(g_y) if g_u is None else g_u
            grads = (grads[0], torch.stack((g_y, g_u, g_p)), grads[2], grads[3])
        args = (*_op_rows(rows), stacked, *(_vec(g) for g in grads), int(offset), *cfg)
        if inplace:
            du = torch.ops.dlm_kernels.token_stats_bwd_(*args)
            dz = rows.logits
        else:
            dz, du = torch.ops.dlm_kernels.token_stats_bwd(*args)
        return dz, (du if cfg.TEACHER_GRAD else None)


IMPLEMENTATION = TritonTorch()
