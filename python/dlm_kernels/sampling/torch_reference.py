"""The reference backend's sampler for torch (``dlm_kernels.sampling.core.ReferenceSampler``)."""

from .core import ReferenceSampler
from .._torch.ops import TorchOps

IMPLEMENTATION = ReferenceSampler(TorchOps)
