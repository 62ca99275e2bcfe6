"""JAX plumbing every op shares: the ops adapter, vmap folding, the first-order guard.
Never imports torch."""
