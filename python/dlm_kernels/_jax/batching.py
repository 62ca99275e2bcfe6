"""``jax.vmap`` for kernel calls: fold the mapped axis into the rows, or map the call.

Kernel launches (``pallas_call`` with TPU dimension semantics, ``jax_triton.triton_call``)
either have no batching rule or one that adds a grid axis the kernel was not written for.
Every kernel argument and result of the token-statistics kernels has rows as its leading
axis, so a vmapped call is the same kernel over B·N rows (``fold_vmap_into_rows``). The
fused linear head's are not all rows (a weight shared by the rows, and its gradient, which
each mapped element needs for itself): there vmap runs the kernels once per element
(``map_vmap``).
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


def map_vmap(fn):
    """Wrap fn(*args) (pytrees of arrays, None leaves allowed) so that vmap runs the
    unbatched fn once per mapped element (``lax.map``) instead of batching the kernel: for
    kernels whose arguments or results are not all rows, where folding the mapped axis
    into the rows would mix the elements (a weight's gradient summed over them)."""

    def call(*args):
        leaves, tree = jax.tree_util.tree_flatten(args)

        @jax.custom_batching.custom_vmap
        def wrapped(*leaves):
            return fn(*jax.tree_util.tree_unflatten(tree, leaves))

        @wrapped.def_vmap
        def _rule(axis_size, in_batched, *leaves):
            if not any(in_batched):  # nothing mapped reaches the kernel
                out = wrapped(*leaves)
                return out, jax.tree_util.tree_map(lambda _: False, out)

            def one(mapped):
                it = iter(mapped)
                return wrapped(*(next(it) if b else x for x, b in zip(leaves, in_batched)))

            out = jax.lax.map(one, [x for x, b in zip(leaves, in_batched) if b])
            return out, jax.tree_util.tree_map(lambda _: True, out)

        return wrapped(*leaves)

    return call
