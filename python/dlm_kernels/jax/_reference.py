"""The reference backend for JAX (see ``dlm_kernels._stats_api.ReferenceBackend``)."""

from .._stats_api import ReferenceBackend
from ._ops import JaxOps

IMPLEMENTATION = ReferenceBackend(JaxOps)
