"""dlm-kernels for JAX: fused vocabulary-side losses for diffusion language models.

Every compute function takes ``backend=None`` (auto: triton on GPU through jax-triton,
pallas on TPU, chunked otherwise), or one of "reference", "chunked", "triton", "pallas".
The contract objects are registered pytrees (jit- and sharding-friendly). Importing this
module never imports torch.
"""

from __future__ import annotations

import jax as _jax

from .._checks import sync_checks
from .._schedule import EPS, VARIANTS, normalize_variant
from .._contract import make_contract
from .._dispatch import BackendUnavailableError
from .._frontend import PUBLIC_API
from .._objectives import Objectives, rf_alpha, rf_alpha_dot
from .._sampling import Sample, make_sampling_api
from .._token_stats import TokenStats
from ._linear_head import LinearHead
from ._ops import JaxOps
from ._primitive import (REGISTRY, backend_for, token_stats, token_stats_total, vocab_extent,
                         vocab_parallel)

WeightedSum, DiffusionTokenBatch, DiffusionDistillationBatch = make_contract(
    JaxOps, __name__, vocab_extent)
for _cls in (WeightedSum, DiffusionTokenBatch, DiffusionDistillationBatch):
    _jax.tree_util.register_dataclass(
        _cls, data_fields=list(_cls.__dataclass_fields__), meta_fields=[])

(reweight, loo_to_denoiser_logits, diffusion_sft_loss, diffusion_sft_logps,
 validate_diffusion_logits, merge_diffusion_batches, per_token_logps,
 compute_diffusion_per_token_logps, weighted_cross_entropy, opd_loss) = Objectives(
    JaxOps, token_stats, token_stats_total, WeightedSum, DiffusionTokenBatch, DiffusionDistillationBatch,
    vocab_extent).exports()

# a Sample's fields are its leaves and its vocab_size static metadata (kept through jit, vmap)
_jax.tree_util.register_pytree_with_keys(
    Sample,
    lambda s: (tuple((_jax.tree_util.GetAttrKey(f), x) for f, x in zip(Sample._fields, s)),
               s.vocab_size),
    lambda vocab_size, fields: Sample(*fields, vocab_size=vocab_size),
    flatten_func=lambda s: (tuple(s), s.vocab_size))

sample_tokens, commit_tokens = make_sampling_api(JaxOps, REGISTRY)

__all__ = list(PUBLIC_API)
