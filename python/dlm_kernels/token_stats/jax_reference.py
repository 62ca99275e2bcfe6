"""The reference backend for JAX (see ``dlm_kernels.token_stats.op.ReferenceBackend``)."""

from .op import ReferenceBackend
from .._jax.ops import JaxOps

IMPLEMENTATION = ReferenceBackend(JaxOps)
