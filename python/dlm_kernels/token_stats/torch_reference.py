"""The reference backend for torch (see ``dlm_kernels.token_stats.op.ReferenceBackend``)."""

from .op import ReferenceBackend
from .._torch.ops import TorchOps

IMPLEMENTATION = ReferenceBackend(TorchOps)
