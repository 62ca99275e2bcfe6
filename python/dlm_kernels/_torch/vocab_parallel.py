"""The vocabulary-parallel merge of the token statistics over a torch process group: shared
by the token statistics' custom VJP (``token_stats.torch_vjp``) and the linear head's path
(``linear_head.torch_head``), so neither imports the other for it."""

from __future__ import annotations

import torch

from ..token_stats import formulas as stats_math
from .ops import TorchOps


def vocab_parallel_stats(rows, impl, cfg, group):
    """``stats_math.shard_stats`` over a process group: rows.logits is rank r's shard of
    columns [r·K_local, (r+1)·K_local); two all-reduces of per-row floats (MAX of 2, SUM of
    8: 40 bytes per row). Returns (Stats, column offset)."""
    import torch.distributed as dist

    def reduce(op):
        def run(values):
            packed = torch.stack(values)  # [F, N] f32: one all-reduce
            dist.all_reduce(packed, op=op, group=group)
            return list(packed.unbind(0))
        return run

    offset = dist.get_rank(group) * rows.logits.shape[1]
    stats = stats_math.shard_stats(TorchOps, impl, rows, cfg, offset,
                                   reduce(dist.ReduceOp.MAX), reduce(dist.ReduceOp.SUM))
    return stats, offset
