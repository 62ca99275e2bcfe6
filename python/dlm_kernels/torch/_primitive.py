"""``token_stats`` for torch: validation, dispatch and the autograd.Function (custom VJP)."""

from __future__ import annotations

import contextlib

import torch

from .._dispatch import Registry
from .. import _stats_math as M
from .._stats_api import (TOKEN_STATS_DOC, apply_vocab_parallel, prepare, public_stats,
                          require_dtype, shard_capable)
from .._rows import Rows
from .._stats_math import Stats
from ._ops import TorchOps

REGISTRY = Registry("torch")

REGISTRY.load()  # every row of the backend table (_dispatch.BACKENDS) with a torch module


def _vocab_parallel_stats(rows, impl, cfg, group):
    """Megatron-style vocabulary parallelism: rows.logits is rank r's shard of columns
    [r·K_local, (r+1)·K_local). Local partial state, then two all-reduces of per-row
    floats (MAX of 3, SUM of 7: 40 bytes per row). Returns (Stats, column offset)."""
    import torch.distributed as dist

    offset = dist.get_rank(group) * rows.logits.shape[1]

    def reduce(op):
        def run(values):
            packed = torch.stack(values)  # [F, N] f32: one all-reduce
            dist.all_reduce(packed, op=op, group=group)
            return list(packed.unbind(0))
        return run

    state, r_y, found = impl.forward_partial(rows, cfg, offset)
    state, (r_y, found) = M.merge_collective(TorchOps, state, reduce(dist.ReduceOp.MAX),
                                             reduce(dist.ReduceOp.SUM), cfg, [r_y, found])
    return M.finalize(TorchOps, state, r_y, found, rows.active, cfg), offset


_N_FIELDS = len(Rows._fields)


class _TokenStatsFunction(torch.autograd.Function):
    """Custom VJP: saves the row bundle plus O(N) float32 row statistics, never [N, K]. With
    a process group the logits are a vocabulary shard; the backward stays local either way.
    autograd wants tensors as direct arguments, so the bundle arrives as its fields."""

    @staticmethod
    def forward(ctx, impl, cfg, inplace, group, *fields):
        rows = Rows(*fields)
        ctx.backward_kw = {"inplace": True} if inplace else {}
        if group is None:
            stats = impl.forward(rows, cfg)
        else:
            stats, offset = _vocab_parallel_stats(rows, impl, cfg, group)
            ctx.backward_kw["offset"] = offset
        ctx.save_for_backward(*rows, *stats)
        ctx.impl, ctx.cfg = impl, cfg
        return stats.lse, stats.logp, stats.entropy, stats.kl

    @staticmethod
    def backward(ctx, g_lse, g_lp, g_h, g_kl):
        saved = ctx.saved_tensors
        rows, stats = Rows(*saved[:_N_FIELDS]), Stats(*saved[_N_FIELDS:])
        grads = tuple(g.float() for g in (g_lse, g_lp, g_h, g_kl))
        dz, du = ctx.impl.backward(rows, stats, grads, ctx.cfg, **ctx.backward_kw)
        return (None, None, None, None, *rows.gradients(dz, du))


class _VocabParallelState:
    """The active ``vocab_parallel`` setting: a plain attribute (torch.compile traces and
    guards attribute reads, not ContextVar.get). Process-wide, like a process group."""

    current = None


@contextlib.contextmanager
def vocab_parallel(process_group, vocab_size=None):
    """Within this block every objective treats its logits as this rank's vocabulary shard
    of ``process_group`` (as ``token_stats(..., process_group=..., vocab_size=...)`` does)."""
    previous = _VocabParallelState.current
    _VocabParallelState.current = (process_group, vocab_size)
    try:
        yield
    finally:
        _VocabParallelState.current = previous


def _shards(process_group) -> int:
    """How many vocabulary shards a process group splits the logits into (1 for None)."""
    if process_group is None:
        return 1
    import torch.distributed as dist

    return dist.get_world_size(process_group)


def vocab_extent(logits) -> int:
    """The full vocabulary the logits' last axis belongs to (K·world inside vocab_parallel)."""
    ctx = _VocabParallelState.current
    if ctx is None:
        return logits.shape[-1]
    group, vocab_size = ctx
    return vocab_size or logits.shape[-1] * _shards(group)


def token_stats(logits, targets, weights=None, *, temperature=1.0, ce_temperature=None,
                softcap=None, shift_ids=None, shift=None, teacher_logits=None,
                teacher_temperature=None, teacher_grad=False, entropy=True, chunk_size=None,
                inplace_grad=False,
                vocab_size=None, process_group=None, backend=None):
    process_group, vocab_size, logits, teacher_logits = apply_vocab_parallel(
        process_group, _VocabParallelState.current, vocab_size, logits, teacher_logits)
    cfg, lead, rows = prepare(
        TorchOps, logits, targets, weights, temperature=temperature,
        ce_temperature=ce_temperature, softcap=softcap, shift_ids=shift_ids, shift=shift,
        teacher_logits=teacher_logits, teacher_temperature=teacher_temperature,
        teacher_grad=teacher_grad, entropy=entropy, chunk_size=chunk_size,
        vocab_size=vocab_size)
    impl = REGISTRY.resolve(backend, logits.device.type)
    require_dtype(impl, logits)
    if rows.teacher is not None and not cfg.teacher_grad:
        rows = rows._replace(teacher=rows.teacher.detach())
    if process_group is not None:
        impl = shard_capable(REGISTRY, impl, backend)
    if inplace_grad and not impl.capabilities.inplace_grad:
        raise ValueError(f"inplace_grad=True is not supported by backend {impl.name!r}; "
                         "use 'chunked' or 'triton'")
    if impl.custom_vjp:
        outs = _TokenStatsFunction.apply(impl, cfg, bool(inplace_grad), process_group, *rows)
    else:
        outs = impl.compute(rows, cfg)
    extent = None
    if rows.shift_ids is not None:  # the full vocabulary the shift ids index
        extent = cfg.vocab_size or rows.logits.shape[1] * _shards(process_group)
    return public_stats(TorchOps, outs, lead, cfg, rows, extent)


token_stats.__doc__ = TOKEN_STATS_DOC


def backend_for(logits, backend=None) -> str:
    """The name of the backend ``backend`` (None = auto) resolves to for these logits."""
    return REGISTRY.resolve(backend, logits.device.type).name
