"""The reference backend's sampler for jax (``dlm_kernels.sampling.core.ReferenceSampler``)."""

from .core import ReferenceSampler
from .._jax.ops import JaxOps

IMPLEMENTATION = ReferenceSampler(JaxOps)
