"""``token_stats`` for torch: the autograd.Function (custom VJP), the process-group merge, and
the torch side of the front-end shell."""

from __future__ import annotations

import torch

from . import formulas as stats_math
from .._rows import Rows
from .formulas import Stats
from .._torch.first_order import first_order_only
from ..linear_head.torch_head import apply_head
from .._torch.ops import TorchOps
from .._torch.vocab_parallel import vocab_parallel_stats

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
            stats, offset = vocab_parallel_stats(rows, impl, cfg, group)
            ctx.backward_kw["offset"] = offset
        ctx.save_for_backward(*rows, *stats)
        ctx.impl, ctx.cfg, ctx.group = impl, cfg, group
        return stats_math.public_stats(stats)

    @staticmethod
    def backward(ctx, *cotangents):  # one [N] cotangent per returned statistic (PUBLIC_STATS)
        saved = ctx.saved_tensors
        rows, stats = Rows(*saved[:_N_FIELDS]), Stats(*saved[_N_FIELDS:])
        grads = tuple(g.float() for g in cotangents)
        columns = None
        if ctx.cfg.HAS_SHIFT and ctx.needs_input_grad[4 + Rows._fields.index("shift")]:
            # the shifted column, read before an in-place backward overwrites the logits
            columns = stats_math.shift_columns(TorchOps, rows, ctx.cfg,
                                               ctx.backward_kw.get("offset", 0))
        d_shift = None
        with torch.no_grad():  # first derivatives, never recorded (see ``_first_order``)
            dz, du = ctx.impl.backward(rows, stats, grads, ctx.cfg, **ctx.backward_kw)
            if columns is not None:
                d_shift = stats_math.shift_grad(TorchOps, columns, rows, stats, grads, ctx.cfg)
                if ctx.group is not None:  # one shard holds the column; the shift is replicated
                    import torch.distributed as dist

                    dist.all_reduce(d_shift, group=ctx.group)
        dz, du, d_shift = first_order_only(
            ctx.impl.name, (dz, du, d_shift),
            (rows.logits, rows.teacher, rows.shift, *cotangents))
        return (None, None, None, None, *rows.gradients(dz, du, d_shift))


class TorchVJP:
    """The torch side of the front-end shell (``dlm_kernels.token_stats.op``)."""

    inplace_grad = True

    @staticmethod
    def apply(impl, cfg, rows, inplace, group):
        return _TokenStatsFunction.apply(impl, cfg, inplace, group, *rows)

    apply_head = staticmethod(apply_head)

    @staticmethod
    def check_shard(process_group, bound=True):
        import torch.distributed as dist

        group = getattr(dist, "ProcessGroup", None) if dist.is_available() else None
        if group is None or not isinstance(process_group, group):
            raise TypeError(
                f"process_group must be a torch.distributed ProcessGroup (dist.group.WORLD, "
                f"dist.new_group(...)) or None; got {type(process_group).__name__}")

    @staticmethod
    def shards(process_group) -> int:
        if process_group is None:
            return 1
        import torch.distributed as dist

        return dist.get_world_size(process_group)
