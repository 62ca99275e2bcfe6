"""dlm-kernels: fused, vocabulary-chunked loss kernels for diffusion language models.

Import a front end: ``import dlm_kernels.torch`` or ``import dlm_kernels.jax``. This
package root imports neither framework.
"""

__version__ = "0.1.0"


def backend_for(logits, backend=None) -> str:
    """The backend name ``backend`` (None = auto) resolves to for this array or tensor."""
    array = getattr(logits, "hidden", logits)  # a LinearHead runs where its hidden states are
    kind = type(array).__module__.split(".")[0]
    if kind == "torch":
        from .torch import backend_for as impl
    elif kind in ("jax", "jaxlib", "numpy"):
        from .jax import backend_for as impl
    else:
        raise TypeError(f"logits must be a torch tensor or a JAX array; got {type(logits).__name__}")
    return impl(logits, backend)
