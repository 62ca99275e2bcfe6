"""The reference backend for torch (see ``dlm_kernels._stats_api.ReferenceBackend``)."""

from .._stats_api import ReferenceBackend
from ._ops import TorchOps

IMPLEMENTATION = ReferenceBackend(TorchOps)
