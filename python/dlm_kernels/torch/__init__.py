"""dlm-kernels for PyTorch: fused vocabulary-side losses for diffusion language models.

Every compute function takes ``backend=None`` (auto: triton for CUDA tensors when its
kernels import, else chunked), or one of "reference", "chunked", "triton". Tensors in,
tensors out; the batch contract holds tensors. Importing this module never imports JAX.
"""

from __future__ import annotations

from .._checks import sync_checks
from .._schedule import EPS, VARIANTS, normalize_variant
from .._contract import make_contract
from .._dispatch import BackendUnavailableError
from .._frontend import PUBLIC_API
from .._objectives import Objectives, rf_alpha, rf_alpha_dot
from .._sampling import Sample, make_sampling_api
from .._token_stats import TokenStats
from ._linear_head import LinearHead
from ._ops import TorchOps
from ._primitive import (REGISTRY, backend_for, token_stats, token_stats_total, vocab_extent,
                         vocab_parallel)

WeightedSum, DiffusionTokenBatch, DiffusionDistillationBatch = make_contract(
    TorchOps, __name__, vocab_extent)

(reweight, loo_to_denoiser_logits, diffusion_sft_loss, diffusion_sft_logps,
 validate_diffusion_logits, merge_diffusion_batches, per_token_logps,
 compute_diffusion_per_token_logps, weighted_cross_entropy, opd_loss) = Objectives(
    TorchOps, token_stats, token_stats_total, WeightedSum, DiffusionTokenBatch, DiffusionDistillationBatch,
    vocab_extent).exports()

sample_tokens, commit_tokens = make_sampling_api(TorchOps, REGISTRY)

__all__ = list(PUBLIC_API)
