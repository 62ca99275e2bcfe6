"""The reference backend for JAX (see ``dlm_kernels.token_stats.primitive.ReferenceBackend``)."""

from .primitive import ReferenceBackend
from .._jax.ops import JaxOps

IMPLEMENTATION = ReferenceBackend(JaxOps)
