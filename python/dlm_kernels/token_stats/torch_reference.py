"""The reference backend for torch (see ``dlm_kernels.token_stats.primitive.ReferenceBackend``)."""

from .primitive import ReferenceBackend
from .._torch.ops import TorchOps

IMPLEMENTATION = ReferenceBackend(TorchOps)
