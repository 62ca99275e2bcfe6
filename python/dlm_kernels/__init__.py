"""dlm-kernels: fused, vocabulary-chunked loss kernels for diffusion language models.

Import a front end: ``import dlm_kernels.torch`` or ``import dlm_kernels.jax``. This
package root imports neither framework.
"""

__version__ = "0.1.0"


def backend_for(logits: object, backend: str | None = None) -> str:
    """The backend name ``backend`` (None = auto) resolves to for this array or tensor: a
    torch tensor's in ``dlm_kernels.torch``, a JAX or NumPy array's in ``dlm_kernels.jax``."""
    from .linear_head.head import as_logits

    array = as_logits(logits).device_array  # a head runs where its hidden states are
    kind = type(array).__module__.split(".")[0]
    if kind == "torch":
        from .torch import backend_for as impl
    elif kind in ("jax", "jaxlib"):
        from .jax import backend_for as impl
    elif kind == "numpy":  # only dlm_kernels.jax takes NumPy arrays (it runs them on JAX's device)
        try:
            from .jax import backend_for as impl
        except ImportError as err:
            raise TypeError(
                f"logits is a NumPy {type(array).__name__}, which only dlm_kernels.jax takes, "
                f"and it cannot be imported here ({err}); for dlm_kernels.torch convert it with "
                f"torch.as_tensor(logits)") from err
    else:
        raise TypeError(f"logits must be a torch tensor or a JAX array; got {type(logits).__name__}")
    return impl(logits, backend)
