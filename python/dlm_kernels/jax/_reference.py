"""The reference backend for JAX (see ``dlm_kernels._token_stats.ReferenceBackend``)."""

from .._token_stats import ReferenceBackend
from ._ops import JaxOps

IMPLEMENTATION = ReferenceBackend(JaxOps)
