"""``jax.vmap`` for kernel calls: fold the mapped axis into the rows.

Kernel launches (``pallas_call`` with TPU dimension semantics, ``jax_triton.triton_call``)
either have no batching rule or one that adds a grid axis the kernel was not written for.
Every kernel argument and result of the token-statistics kernels has rows as its leading
axis, so a vmapped call is the same kernel over B·N rows.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def fold_vmap_into_rows(fn):
    """Wrap fn(*arrays) (every array [N, ...] in and out) so vmap reshapes [B, N, ...] to
    [B·N, ...] around one call instead of batching the kernel."""

    @jax.custom_batching.custom_vmap
    def wrapped(*arrays):
        return fn(*arrays)

    @wrapped.def_vmap
    def _rule(axis_size, in_batched, *arrays):
        full = [a if batched else jnp.broadcast_to(a, (axis_size,) + a.shape)
                for a, batched in zip(arrays, in_batched)]
        n = full[0].shape[1]
        out = wrapped(*(a.reshape((axis_size * a.shape[1],) + a.shape[2:]) for a in full))
        unfold = lambda o: o.reshape((axis_size, n) + o.shape[1:])
        return jax.tree_util.tree_map(unfold, out), jax.tree_util.tree_map(lambda _: True, out)

    return wrapped
