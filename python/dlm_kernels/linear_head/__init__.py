"""The fused linear head (hidden @ weight as a logits source): the framework-neutral
protocol and schedules, and per framework the token-chunked sweep and its VJP. Importing
this package imports neither torch nor jax."""
