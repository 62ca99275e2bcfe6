"""The row bundle: every per-row input of one token-statistics call, as one value.

``token_stats.op.prepare`` builds it once at the API boundary (leading dimensions
flattened into N rows) and it travels whole through dispatch, the custom VJPs and the backends; it is taken
apart only where a framework wants flat arguments (the ``torch.library`` custom ops and
``autograd.Function``, ``jax_triton.triton_call``, ``pallas_call``), in one place per backend.
A new per-row input is a new field here, filled in ``prepare`` and read where it is used.
In JAX a NamedTuple is a pytree, so the bundle passes through ``jax.custom_vjp`` as one
argument (its cotangent is a bundle too, None for the fields with no gradient).
"""

from __future__ import annotations

from typing import Any, NamedTuple


class Rows(NamedTuple):
    # Every field is a framework's array (torch.Tensor, jax.Array: this module imports
    # neither), or None, typed Any: the bundle is one value of either front end, whose
    # logits are a LogitsSource in a head path, and a JAX pytree whose leaves a
    # transformation replaces (tracers, cotangents, None).
    # [N, K] student logits (float32, bfloat16 or float16); from ``prepare`` to the dispatch
    # and in a framework's head path a ``linear_head.head.LogitsSource`` (an array or a head)
    logits: Any
    teacher: Any = None  # [N, K] teacher logits (likewise), or None
    targets: Any = None  # [N] int target ids
    active: Any = None  # [N] bool: rows whose weight is non-zero
    shift_ids: Any = None  # [N] int column of the LOO shift, or None
    shift: Any = None  # [N] float32 LOO shift, or None

    def columns(self, logits, teacher) -> "Rows":
        """The same rows over a block of columns: ``logits`` / ``teacher`` are [N, C] slices."""
        return self._replace(logits=logits, teacher=teacher)

    def map_logits(self, fn) -> "Rows":
        """The same rows with ``fn`` applied to the logits and to the teacher (when given)."""
        return self._replace(logits=fn(self.logits),
                             teacher=None if self.teacher is None else fn(self.teacher))

    def gradients(self, d_logits, d_teacher, d_shift=None) -> "Rows":
        """The cotangent of a bundle: d(logits), d(teacher), d(shift) (None: no gradient),
        None for every other field (ids and masks get no gradient)."""
        return Rows(d_logits, d_teacher, shift=d_shift)
