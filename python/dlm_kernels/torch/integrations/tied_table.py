"""One table-sized gradient for a tied embedding table.

A model whose output head is its input embedding table E ([V, D], tied: one Parameter) gets
E's gradient from the head (dW, dense [V, D]) and from each lookup of E (a prompt's and a
canvas's token rows). autograd forms each lookup's gradient as a zero-filled [V, D] table
(``embedding_dense_backward``) and adds it into the head's dW: at that moment two
table-sized buffers are alive, the peak of a fused-head training step (the logits are never
formed, so nothing else is that large).

Here the lookups' gradients never become tables. The head reads E through ``relay_table``,
an identity made before the lookups run (so autograd, which runs the most recently made
ready node first, reaches it after them), and each lookup runs through ``tied_lookup``,
whose backward hands its token ids and row gradients ([N], [N, D]) to the relay instead of
returning a table. The relay adds those rows into the head's dW in place and passes dW on
as E's gradient: E's ``.grad`` is the same sum, and the peak holds one table.

A lookup hands its rows over only while the relay will still run in the same backward
(``torch._C._will_engine_execute_node``, the test ``torch.autograd.graph``'s multi-grad hook
uses); otherwise (a backward that does not reach the head, the relay already run in this
pass, a backward traced by compiled autograd) it returns its dense gradient, as
``torch.nn.functional.embedding`` would: the gradient is always complete; only the memory
saving depends on the order.
"""

from __future__ import annotations

from typing import Any

import torch


class TableGradTape:
    """The rows the lookups of one forward hand to its relay, per backward pass (keyed by
    autograd's graph task id: a retained graph's second backward starts empty)."""

    def __init__(self) -> None:
        self.rows: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        self.done: set[int] = set()  # the backward passes whose relay has run

    def give(self, task: int, ids: torch.Tensor, rows: torch.Tensor) -> bool:
        """Hold ``ids`` [N] and their row gradients [N, D] for the relay of backward pass
        ``task``; False (nothing held) once that relay has run."""
        if task in self.done:
            return False
        self.rows.setdefault(task, []).append((ids, rows))
        return True

    def take(self, task: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The rows held for backward pass ``task``; later ``give`` calls for it are refused."""
        self.done.add(task)
        return self.rows.pop(task, [])


class _Relay(torch.autograd.Function):
    """E -> E (a view); backward: dW plus the rows the lookups handed over, in place."""

    @staticmethod
    def forward(ctx: Any, table: torch.Tensor, tape: TableGradTape) -> torch.Tensor:
        ctx.tape = tape
        return table.view_as(table)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor, None]:
        (d_table,) = grads  # [V, D]: the heads' dW (summed by autograd where several read it)
        if torch.compiler.is_compiling():  # compiled autograd: the lookups kept their gradients
            return d_table, None
        rows = ctx.tape.take(torch._C._current_graph_task_id())
        if not rows:
            return d_table, None
        ids = torch.cat([i for i, _ in rows])  # [N]
        d_rows = torch.cat([g for _, g in rows])  # [N, D]
        if not d_table.is_contiguous() or d_table._is_view():
            d_table = d_table.clone()  # a head's own new buffer is written in place; a view not
        return add_rows_(d_table, ids, d_rows), None


def add_rows_(table: torch.Tensor, ids: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``table[i] += Σ rows[ids == i]`` in place ([V, D], [N], [N, D]), each id's rows summed in
    float32 (float64 for a float64 table) and added to its table row in one rounding. On a
    GPU, torch's ``index_put_`` with accumulate sorts the ids and reduces each one's rows
    before adding them (its implementation; this path has not run on a GPU in this
    repository's tests yet, which cover it where one is present); on a CPU it would round at
    every addend, so the sums are formed here first."""
    if table.device.type != "cpu":
        return table.index_put_((ids,), rows.to(table.dtype), accumulate=True)
    acc = torch.float64 if table.dtype == torch.float64 else torch.float32
    unique, inverse = torch.unique(ids, return_inverse=True)  # [U], [N]
    sums = torch.zeros(unique.shape[0], rows.shape[1], dtype=acc)  # [U, D]
    sums.index_add_(0, inverse, rows.to(acc))
    return table.index_copy_(0, unique, (table.index_select(0, unique).to(acc) + sums)
                             .to(table.dtype))


class _Lookup(torch.autograd.Function):
    """``F.embedding(ids, table, padding_idx)``; backward: the rows to the relay when it will
    still run in this backward, else the dense [V, D] gradient."""

    @staticmethod
    def forward(ctx: Any, ids: torch.Tensor, table: torch.Tensor, padding_idx: int | None,
                tape: TableGradTape, relay: Any) -> torch.Tensor:
        ctx.save_for_backward(ids)
        ctx.padding_idx, ctx.tape, ctx.relay = padding_idx, tape, relay
        ctx.num_rows = table.shape[0]
        return torch.nn.functional.embedding(ids, table, padding_idx)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[None, torch.Tensor | None, None,
                                                          None, None]:
        (d_out,) = grads  # [*ids.shape, D]
        (ids,) = ctx.saved_tensors
        if not torch.compiler.is_compiling() and torch._C._will_engine_execute_node(ctx.relay):
            flat = ids.reshape(-1)  # [N]
            d_rows = d_out.reshape(flat.shape[0], -1)  # [N, D]
            if ctx.padding_idx is not None:  # the padding row gets no gradient
                d_rows = d_rows.masked_fill((flat == ctx.padding_idx)[:, None], 0)
            if ctx.tape.give(torch._C._current_graph_task_id(), flat, d_rows):
                return None, None, None, None, None
        pad = -1 if ctx.padding_idx is None else ctx.padding_idx
        d_table = torch.ops.aten.embedding_dense_backward(d_out, ids, ctx.num_rows, pad, False)
        return None, d_table, None, None, None


def relay_table(table: torch.Tensor, tape: TableGradTape) -> torch.Tensor:
    """``table`` for the head to read (the same values); make it before the lookups."""
    return _Relay.apply(table, tape)


def tied_lookup(ids: torch.Tensor, table: torch.Tensor, padding_idx: int | None,
                tape: TableGradTape, relay: torch.Tensor) -> torch.Tensor:
    """``F.embedding(ids, table, padding_idx)`` [*ids.shape, D] whose gradient for ``table``
    goes to ``relay`` (the tensor ``relay_table`` returned) as rows."""
    return _Lookup.apply(ids, table, padding_idx, tape, relay.grad_fn)
