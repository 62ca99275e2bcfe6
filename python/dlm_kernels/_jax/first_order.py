"""The custom VJPs' rules, guarded against a second differentiation.

``jax.grad`` of ``jax.grad`` (or ``jax.hessian``) differentiates a ``custom_vjp``'s forward
and backward rules themselves. Those run the backends' kernels (a Pallas or Triton call
has no derivative of its own) or chunk loops built for first derivatives only (docs/design.md
§2; a 16-bit gradient carried as its bits on a CPU has none). ``first_order`` runs a rule as
it is, and makes differentiating it raise one clear error instead.
"""

from __future__ import annotations

import jax
from jax.custom_derivatives import SymbolicZero

from .._dispatch import higher_order_error


def first_order(backend, rule, *args):
    """``rule(*args)``; differentiating it (any input with a non-zero tangent) raises. Only
    the JAX arrays among the leaves of ``args`` are the derivative's inputs (None, symbolic
    zeros and host constants pass as they are)."""
    leaves, tree = jax.tree_util.tree_flatten(args, is_leaf=lambda x: isinstance(x, SymbolicZero))
    live = [isinstance(x, jax.Array) for x in leaves]  # tracers too

    @jax.custom_jvp
    def call(*arrays):
        arrays = iter(arrays)
        full = [next(arrays) if is_live else x for is_live, x in zip(live, leaves)]
        return rule(*jax.tree_util.tree_unflatten(tree, full))

    def jvp(primals, tangents):
        raise higher_order_error("jax", backend)

    call.defjvp(jvp)
    return call(*(x for is_live, x in zip(live, leaves) if is_live))
