"""torch plumbing every op shares: the ops adapter, output buffers, the first-order guard.
Never imports JAX."""
