"""The token-statistics primitive (docs/design.md §2): its math over an array namespace,
its front-end shell, and per framework its custom VJP, registry and one module per backend.
Framework-neutral: importing this package imports neither torch nor jax."""
