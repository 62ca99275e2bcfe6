"""The reference backend for torch (see ``dlm_kernels._token_stats.ReferenceBackend``)."""

from .._token_stats import ReferenceBackend
from ._ops import TorchOps

IMPLEMENTATION = ReferenceBackend(TorchOps)
