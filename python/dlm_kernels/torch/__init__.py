"""dlm-kernels for PyTorch: fused vocabulary-side losses for diffusion language models.

Every compute function takes ``backend=None`` (auto: triton for CUDA tensors when its
kernels import, else chunked), or one of "reference", "chunked", "triton". Tensors in,
tensors out; the batch contract holds tensors. Importing this module never imports JAX.

Each public name is declared here with its types; the logic underneath is written once for
both front ends (``dlm_kernels._objectives``, ``token_stats.op``, ``_contract``,
``sampling.core``).
"""

from __future__ import annotations

import dataclasses as _dataclasses
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any

import torch

from .. import _contract
from .._checks import sync_checks
from .._dispatch import BackendUnavailableError
from .._config import CeTerm as _CeTerm
from .._objectives import Contract as _Contract
from .._objectives import Objectives as _Objectives
from .._objectives import rf_alpha, rf_alpha_dot
from ..sampling.core import Sample
from ..sampling.core import Sampler as _Sampler
from ..sampling.upstream import StepFunctions as _StepFunctions
from .._schedule import EPS, VARIANTS, normalize_variant
from ..token_stats.op import TokenStats
from ..linear_head.torch_head import LinearHead
from .._torch.framework import TORCH as _TORCH
from ..token_stats.op import TokenStatsFrontEnd as _TokenStatsFrontEnd

__all__ = [
    "EPS", "VARIANTS", "normalize_variant", "rf_alpha", "rf_alpha_dot", "loo_to_denoiser_logits",
    "reweight", "diffusion_sft_loss", "diffusion_sft_logps", "DiffusionTokenBatch",
    "DiffusionDistillationBatch", "validate_diffusion_logits", "merge_diffusion_batches",
    "WeightedSum", "per_token_logps", "compute_diffusion_per_token_logps",
    "compute_diffusion_logits",
    "weighted_cross_entropy", "opd_loss", "policy_loss", "PolicyLossResult", "token_stats",
    "TokenStats", "backend_for",
    "BackendUnavailableError", "vocab_parallel", "sync_checks", "LinearHead", "Sample",
    "sample_tokens", "commit_tokens", "add_gumbel_noise", "get_num_transfer_tokens",
    "get_transfer_index",
]

#: the token-statistics op's front-end shell over torch's binding: token_stats' body,
#: vocab_parallel, backend_for, and the one entry point every objective calls
_FRONT = _TokenStatsFrontEnd(_TORCH)

Logits = torch.Tensor | LinearHead
"""What every ``logits`` argument takes: a [..., K] tensor, or a LinearHead standing for one."""


# -- the Tunix batch contract ------------------------------------------------------------------

@_dataclasses.dataclass(frozen=True)
class WeightedSum:
    """A loss kept as ``unreduced_sum`` over ``denominator`` (sums across micro-batches or
    devices add field by field); ``compute()`` is their ratio, 0 for a 0 denominator, NaN
    for a NaN or negative one. The objectives give Σ w·loss and Σ w, both times 2^-64 when
    a weight reaches 2^64 (so that Σ w·loss stays a float32 number up to weights of 3.4e38;
    docs/design.md §3)."""

    unreduced_sum: torch.Tensor  # [] float32
    denominator: torch.Tensor  # [] float32

    def compute(self) -> torch.Tensor:
        """unreduced_sum / denominator; exactly 0 (gradient too) for a 0 denominator, NaN
        for a NaN or negative one."""
        return _contract.weighted_mean(_TORCH, self.unreduced_sum, self.denominator)

    def replace(self, **fields: torch.Tensor) -> WeightedSum:
        """A copy with some fields replaced."""
        return _dataclasses.replace(self, **fields)


@_dataclasses.dataclass(frozen=True)
class DiffusionTokenBatch:
    """Target-aligned diffusion batch: position (b, l) predicts ``target_ids[b, l]`` from
    ``model_inputs`` (the noisy canvas); it is active when its weight is non-zero.

    model_inputs: a batch-major pytree of tensors (a dict such as {"input_tokens": [B, L]
      int, "positions": [B, L] int, "time": [B] float}, any nesting, or one bare tensor):
      every leaf non-scalar with leading dimension B and a bool or real numeric dtype.
    target_ids: [B, L] int.
    loss_weights: [B, L] bool, int or float, kept as given (objectives convert to float32).
    """

    model_inputs: Any
    target_ids: torch.Tensor
    loss_weights: torch.Tensor

    @classmethod
    def create(cls, *, model_inputs: Any, target_ids: torch.Tensor,
               loss_weights: torch.Tensor) -> DiffusionTokenBatch:
        """The batch, validated (``validate``)."""
        return cls(model_inputs=model_inputs, target_ids=target_ids,
                   loss_weights=loss_weights).validate()

    def validate(self) -> DiffusionTokenBatch:
        """Static checks always (TypeError for a wrong kind or dtype, ValueError for a
        shape); value checks (finite, non-negative weights; active targets >= 0) on every
        tensor that holds values (not a traced one; CUDA tensors too, one device sync
        each). Returns self."""
        _contract.validate_token_batch(_TORCH, self)
        return self

    def replace(self, **fields: Any) -> DiffusionTokenBatch:
        """A copy with some fields replaced (not validated)."""
        return _dataclasses.replace(self, **fields)


@_dataclasses.dataclass(frozen=True)
class DiffusionDistillationBatch:
    """A student batch plus the teacher's logits at the same positions.

    student_batch: DiffusionTokenBatch;  teacher_logits: [B, L, K] float (or a LinearHead).
    Active targets must lie in [0, K) of the teacher logits (checked where the student batch's
    value checks run). Teacher values (finite at active positions) are checked by
    ``opd_loss`` when its soft term is enabled, so a batch for a hard-only loss may carry
    any finite-shaped teacher.
    """

    student_batch: DiffusionTokenBatch
    teacher_logits: Logits

    @classmethod
    def create(cls, *, student_batch: DiffusionTokenBatch,
               teacher_logits: Logits) -> DiffusionDistillationBatch:
        """The batch, validated (``validate``)."""
        return cls(student_batch=student_batch, teacher_logits=teacher_logits).validate()

    def validate(self) -> DiffusionDistillationBatch:
        """The student batch's checks, the teacher's shape against it, and every active
        target inside the teacher's vocabulary (where the student batch's value checks
        run). Returns self."""
        _contract.validate_distillation_batch(_TORCH, self, DiffusionTokenBatch,
                                              _FRONT.vocab_extent)
        return self

    def replace(self, **fields: Any) -> DiffusionDistillationBatch:
        """A copy with some fields replaced (not validated)."""
        return _dataclasses.replace(self, **fields)


@_dataclasses.dataclass(frozen=True)
class PolicyLossResult:
    """What ``policy_loss`` returns: the loss to differentiate and the metrics TRL's
    ``GRPOTrainer`` logs, each a [] float32 tensor (the metrics are constants).

    loss: the normalised policy loss (``loss_type``'s normaliser).
    clip_ratio_low, clip_ratio_high, clip_ratio_region: the shares of clipped ratios (TRL's
      clip_ratio/low_mean, high_mean, region_mean; with "cispo" its cispo_clip_ratio).
    kl: the mean KL term, None when beta = 0.
    entropy: the mean entropy at the temperature.
    """

    loss: torch.Tensor
    clip_ratio_low: torch.Tensor
    clip_ratio_high: torch.Tensor
    clip_ratio_region: torch.Tensor
    kl: torch.Tensor | None
    entropy: torch.Tensor


# -- the primitive -----------------------------------------------------------------------------

def token_stats(
    logits: Logits,
    targets: torch.Tensor,
    weights: torch.Tensor | None = None,
    *,
    temperature: float = 1.0,
    ce_temperature: float | None = None,
    softcap: float | None = None,
    shift_ids: torch.Tensor | None = None,
    shift: torch.Tensor | float | None = None,
    teacher_logits: Logits | None = None,
    teacher_temperature: float | None = None,
    teacher_grad: bool = False,
    entropy: bool = True,
    chunk_size: int | None = None,
    inplace_grad: bool = False,
    vocab_size: int | None = None,
    label_smoothing: float = 0.0,
    z_loss_weight: float = 0.0,
    process_group: torch.distributed.ProcessGroup | None = None,
    backend: str | None = None,
) -> TokenStats:
    """Streaming token statistics of docs/design.md §2, differentiable (custom VJP).

    Args:
      logits: [..., K] student logits (float32, bfloat16 or float16), or a LinearHead.
      targets: [...] integer target ids; active targets must lie in [0, K) (a target outside
        gives logp = NaN rather than a silent wrong value; the primitive reads no values on
        the host, the objectives check them where that costs no device sync).
      weights: [...] optional; a row is active when its weight is non-zero (the weight's
        value is not applied here). Inactive rows read nothing that can leak: their outputs
        and gradients are exact zeros. None = every row active.
      temperature: T of p = softmax(s), s = (cap(z) + d·[k == x]) / T; at least
        ``FLOAT32_MIN_TEMPERATURE`` = 2^-102 (about 2e-31), below which it is a ValueError: every
        exponent is a logit difference (r - m) scaled by 1/T afterwards (docs/design.md §2),
        float32-exact at any T from there up. Results whose size passes the float32 range
        (|cap(z)| / T past 3.4e38) overflow to ±inf.
      ce_temperature: temperature of the ``logp`` term (default: ``temperature``; the same
        minimum); a different value costs one more running sum in the same pass.
      softcap: c > 0 for cap(z) = c·tanh(z / c), or None. Any c > 0: for |z / c| below 0.625
        cap(z) is z·(1 + u·Q(u)), u = (z / c)², with a fitted polynomial Q; beyond,
        c·tanh(z / c), saturating at ±c. A student ``LinearHead(..., softcap=c)`` carries
        its own cap, which is this one (a different ``softcap`` here is a ValueError); a
        teacher head's cap applies to the teacher.
      shift_ids, shift: LOO shift; ``shift`` ([...] per row, or a scalar; float) is added to
        the logit at column ``shift_ids`` ([...] int) before the temperature. An active row
        whose shift id lies outside [0, K) gets NaN in every statistic. The shift is
        differentiable.
      teacher_logits: [..., K] optional teacher logits u for ``kl`` (or a LinearHead).
      teacher_temperature: T_kl of q = softmax(u / T_kl) (default: ``temperature``).
      teacher_grad: also differentiate with respect to ``teacher_logits``.
      entropy: compute ``entropy`` (default True); False leaves its sums out of both passes
        and returns ``entropy=None``.
      chunk_size: vocabulary chunk of the chunked backend, block size of the kernel
        backends (default: a heuristic).
      inplace_grad: opt-in. Write d(logits) into the logits buffer itself instead of a new
        tensor (saves one [..., K] allocation); after backward the logits tensor
        holds the gradient, so nothing else may read those logits afterwards.
        Supported by the chunked and triton backends, for logits given as a tensor
        (with a LinearHead, student or teacher, it is a ValueError). The same bits
        as without it; under ``torch.compile`` the graph's functionalization
        returns the gradient in a buffer of its own (no saving there).
      vocab_size: the true vocabulary when the last axis is padded: columns >= vocab_size
        are excluded and get a zero gradient (with a ``process_group``: the global size).
      label_smoothing: ε in [0, 1] (default 0). ``logp`` becomes minus the smoothed CE,
        Σ_k q_k·log p'_k with q = (1 - ε)·onehot(y) + ε/K over the K valid columns (K =
        ``vocab_size`` when given, else the logits' last dim; the global K under vocabulary
        parallelism), as ``torch.nn.functional.cross_entropy(label_smoothing=ε)``. A column
        at -inf makes it -inf (finfo.min: huge), as in torch.
      z_loss_weight: λ >= 0, finite (default 0). ``logp`` also carries -λ·lse_ce², lse_ce
        the logsumexp of the logits at ``ce_temperature`` (PaLM's z-loss; Liger's
        ``lse_square_scale``). Both options change ``logp`` only; with ε = λ = 0 it is the
        target's log-probability.
      process_group: vocabulary parallelism. The logits are this rank's contiguous shard of
        the vocabulary.
        Targets and shift ids are global ids. Partial states merge with two all-reduces of
        per-row floats (40 bytes per row); the backward is local. ``vocab_parallel(...)``
        applies the same to every objective inside a ``with`` block.
      backend: None (auto), or one of "reference", "chunked", "triton".

    Non-finite student logits in an active row: an entry at -inf has probability 0 (a
    target at -inf has logp = -inf with a finite gradient). A NaN or +inf entry (after the
    softcap), or a row that is -inf everywhere, leaves no distribution: lse, logp, entropy
    and kl are NaN (lse is -inf for the all -inf row) and so is the row's gradient.

    Returns:
      TokenStats(lse, logp, entropy, kl), each float32 of shape [...] (entropy None when
      ``entropy=False``).
    """
    stats, _ = _FRONT.token_stats_total(
        logits, targets, weights, None, temperature=temperature, ce_temperature=ce_temperature,
        softcap=softcap, shift_ids=shift_ids, shift=shift, teacher_logits=teacher_logits,
        teacher_temperature=teacher_temperature, teacher_grad=teacher_grad, entropy=entropy,
        chunk_size=chunk_size, inplace_grad=inplace_grad, vocab_size=vocab_size,
        ce=_CeTerm(label_smoothing, z_loss_weight), shard=process_group, backend=backend)
    return stats


def backend_for(logits: Logits, backend: str | None = None) -> str:
    """The name of the backend ``backend`` (None = auto) resolves to for these logits."""
    return _FRONT.backend_for(logits, backend)


def vocab_parallel(process_group: torch.distributed.ProcessGroup,
                   vocab_size: int | None = None) -> AbstractContextManager[None]:
    """Within this block, every objective treats its logits as
    this rank's vocabulary shard of ``process_group``
    (as ``token_stats(..., process_group=..., vocab_size=...)`` does)."""
    return _FRONT.within(process_group, vocab_size)


# -- the objectives ----------------------------------------------------------------------------

_OBJECTIVES = _Objectives(_FRONT, _Contract(WeightedSum, DiffusionTokenBatch,
                                           DiffusionDistillationBatch, PolicyLossResult))


def reweight(variant: str, t: torch.Tensor, alpha: torch.Tensor,
             alpha_dot: torch.Tensor | None) -> torch.Tensor:
    """Time weight [B]: -alpha_dot / max(alpha, EPS) for reweighted variants, else 1."""
    return _OBJECTIVES.reweight(variant, t, alpha, alpha_dot)


def loo_to_denoiser_logits(logits: Logits, xt: torch.Tensor, alpha: torch.Tensor | float,
                           vocab_size: int) -> torch.Tensor:
    """LOO -> denoiser logits: logits [B, L, K] + delta at column xt [B, L]; float32.

    delta = log1p(vocab_size·alpha / max(1 - alpha, EPS)) with alpha [B], [B, 1] or
    [B, L], or one number for every sequence. An xt outside [0, vocab_size) raises
    ValueError where its values can be read without a device sync, else makes that
    position's logits NaN. Materialises a [B, L, K] tensor; the losses apply the same
    shift inside the fused primitive instead.
    """
    return _OBJECTIVES.loo_to_denoiser_logits(logits, xt, alpha, vocab_size)


def diffusion_sft_loss(
    logits: Logits,
    x0: torch.Tensor,
    xt: torch.Tensor,
    t: torch.Tensor | float,
    loss_mask: torch.Tensor,
    *,
    variant: str,
    vocab_size: int,
    diffusion_weight_clip: float | None = None,
    alpha_fn: Callable[[torch.Tensor], torch.Tensor | float] = rf_alpha,
    alpha_dot_fn: Callable[[torch.Tensor], torch.Tensor | float] = rf_alpha_dot,
    label_smoothing: float = 0.0,
    z_loss_weight: float = 0.0,
    backend: str | None = None,
) -> torch.Tensor:
    """Megatron-Bridge DiffusionGemma SFT loss, [B] float32.

    loss[b] = w_b · Σ_l M_bl·CE_bl / max(Σ_l M_bl, 1) with logits [B, L, K], clean tokens
    x0 [B, L], noisy tokens xt [B, L], times t [B] in [0, 1] (or one number for every
    sequence) and loss_mask M [B, L] (finite, non-negative). ``variant`` picks the time
    weight w and the LOO shift (``VARIANTS``); ``diffusion_weight_clip`` bounds w from
    above. ``vocab_size`` <= K. ``alpha_fn`` and ``alpha_dot_fn`` get t as [B] (a number
    broadcast, as float32); in a reweighted variant each returns [B] or a number, in a LOO
    variant alpha may also be [B, 1] or [B, L].
    ``label_smoothing`` ε in [0, 1] and ``z_loss_weight`` λ >= 0 (default 0: the plain
    CE) make CE_bl the label-smoothed CE plus λ·lse² (see ``token_stats``).

    Bad values raise ValueError where they can be read without a device sync
    (CPU tensors; CUDA tensors inside ``sync_checks()``): an x0 outside
    [0, vocab_size) where the mask is set, an xt outside it in a LOO variant, a negative or
    non-finite mask, a t outside [0, 1]. Elsewhere (CUDA tensors, ``torch.compile``) such a
    value makes that sequence's loss NaN, never a plausible number.
    """
    return _OBJECTIVES.diffusion_sft_loss(
        logits, x0, xt, t, loss_mask, variant=variant, vocab_size=vocab_size,
        diffusion_weight_clip=diffusion_weight_clip, alpha_fn=alpha_fn,
        alpha_dot_fn=alpha_dot_fn, ce=_CeTerm(label_smoothing, z_loss_weight), backend=backend)


def diffusion_sft_logps(
    logits: Logits,
    x0: torch.Tensor,
    xt: torch.Tensor,
    t: torch.Tensor | float,
    loss_mask: torch.Tensor,
    *,
    variant: str,
    vocab_size: int,
    diffusion_weight_clip: float | None = None,
    alpha_fn: Callable[[torch.Tensor], torch.Tensor | float] = rf_alpha,
    alpha_dot_fn: Callable[[torch.Tensor], torch.Tensor | float] = rf_alpha_dot,
    label_smoothing: float = 0.0,
    z_loss_weight: float = 0.0,
    backend: str | None = None,
) -> torch.Tensor:
    """Sequence log-probs -w_b · Σ_l M_bl·CE_bl, [B] float32 (arguments as
    ``diffusion_sft_loss``)."""
    return _OBJECTIVES.diffusion_sft_logps(
        logits, x0, xt, t, loss_mask, variant=variant, vocab_size=vocab_size,
        diffusion_weight_clip=diffusion_weight_clip, alpha_fn=alpha_fn,
        alpha_dot_fn=alpha_dot_fn, ce=_CeTerm(label_smoothing, z_loss_weight), backend=backend)


def validate_diffusion_logits(batch: DiffusionTokenBatch, logits: Logits,
                              name: str = "logits") -> Logits:
    """Check logits [B, L, K] against a DiffusionTokenBatch and return ``logits``: rank,
    [B, L] alignment, a floating dtype and K >= 1 always; active targets in [0, K) on
    CPU tensors (CUDA tensors inside ``sync_checks()``; elsewhere an out-of-range
    active target shows as a NaN log-prob). ``name`` is the logits' name in the errors."""
    return _OBJECTIVES.validate_diffusion_logits(batch, logits, name)


def merge_diffusion_batches(
    batches: Sequence[DiffusionTokenBatch] | Sequence[DiffusionDistillationBatch],
) -> DiffusionTokenBatch | DiffusionDistillationBatch:
    """Concatenate batches on the batch axis, every leaf of every field (model_inputs is a
    pytree). All must have one type, the same tree structure and the same trailing shapes
    and dtypes; everything is checked before anything is built."""
    return _OBJECTIVES.merge_diffusion_batches(batches)


def per_token_logps(
    logits: Logits,
    batch: DiffusionTokenBatch,
    *,
    temperature: float = 1.0,
    stop_gradient: bool = True,
    return_entropy: bool = False,
    backend: str | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Target log-probs [B, L] at ``temperature`` (and the entropy [B, L] when
    ``return_entropy``: a tuple); exactly 0 at inactive positions; constants (no gradient)
    when ``stop_gradient``."""
    return _OBJECTIVES.per_token_logps(logits, batch, temperature=temperature,
                                       stop_gradient=stop_gradient,
                                       return_entropy=return_entropy, backend=backend)


def compute_diffusion_per_token_logps(
    model: Any,
    batch: DiffusionTokenBatch,
    logits_fn: Callable[[Any, Any], Logits],
    *,
    temperature: float = 1.0,
    stop_gradient: bool = True,
    return_entropy: bool = False,
    backend: str | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``per_token_logps(logits_fn(model, batch.model_inputs), batch, ...)``; the arguments
    are checked before the model runs."""
    return _OBJECTIVES.compute_diffusion_per_token_logps(
        model, batch, logits_fn, temperature=temperature, stop_gradient=stop_gradient,
        return_entropy=return_entropy, backend=backend)



def compute_diffusion_logits(
    model: Any,
    batch: DiffusionTokenBatch,
    logits_fn: Callable[[Any, Any], Logits],
) -> Logits:
    """Tunix's ``compute_diffusion_logits``: validate ``batch`` (``batch.validate()``), call
    ``logits_fn(model, batch.model_inputs)``, check the result against the batch
    (``validate_diffusion_logits``: [B, L, K], a floating dtype, K >= 1, active targets
    below K where their values can be read without a device sync) and return it. A
    ``LinearHead`` returned by ``logits_fn`` is checked by its shape and passed through."""
    return _OBJECTIVES.compute_diffusion_logits(model, batch, logits_fn)


def weighted_cross_entropy(logits: Logits, batch: DiffusionTokenBatch, *,
                           label_smoothing: float = 0.0, z_loss_weight: float = 0.0,
                           backend: str | None = None) -> WeightedSum:
    """WeightedSum(Σ w·CE, Σ w) at T = 1 over the batch's active positions.

    ``label_smoothing`` ε in [0, 1]: CE against (1 - ε)·onehot(target) + ε/K over the K
    valid columns (torch's ``cross_entropy(label_smoothing=ε)``); ``z_loss_weight`` λ >= 0
    adds λ·lse² per active position (PaLM's z-loss). Both default to 0.
    """
    return _OBJECTIVES.weighted_cross_entropy(logits, batch, ce=_CeTerm(label_smoothing, z_loss_weight), backend=backend)


def opd_loss(
    student_logits: Logits,
    batch: DiffusionDistillationBatch,
    *,
    temperature: float = 1.0,
    soft_loss_weight: float = 1.0,
    hard_loss_weight: float = 0.0,
    label_smoothing: float = 0.0,
    z_loss_weight: float = 0.0,
    backend: str | None = None,
) -> tuple[WeightedSum, dict[str, WeightedSum]]:
    """On-policy distillation: (WeightedSum total, {"distill/soft_loss", "distill/hard_loss"}).

    soft = T²·KL(softmax(u/T) ‖ softmax(z/T)), hard = CE(z) at T = 1; one pass over the
    student logits serves both. The teacher is stop-gradient. A disabled term (weight 0)
    neither reads nor validates its inputs; its aux entry is WeightedSum(0, Σ w).
    ``label_smoothing`` and ``z_loss_weight`` apply to the hard term only (as in
    ``weighted_cross_entropy``); both default to 0.
    """
    return _OBJECTIVES.opd_loss(student_logits, batch, temperature=temperature,
                                soft_loss_weight=soft_loss_weight,
                                hard_loss_weight=hard_loss_weight,
                                ce=_CeTerm(label_smoothing, z_loss_weight),
                                backend=backend)


def policy_loss(
    logits: Logits,
    batch: DiffusionTokenBatch,
    *,
    old_logps: torch.Tensor | None,
    advantages: torch.Tensor,
    loss_type: str,
    epsilon: float = 0.2,
    epsilon_high: float | None = None,
    delta: float | None = None,
    beta: float = 0.0,
    ref_logps: torch.Tensor | None = None,
    use_bias_correction_kl: bool = False,
    importance_sampling_level: str = "token",
    temperature: float = 1.0,
    max_completion_length: int | None = None,
    num_items_in_batch: torch.Tensor | float | None = None,
    inplace_grad: bool = False,
    backend: str | None = None,
) -> PolicyLossResult:
    """TRL ``GRPOTrainer``'s policy losses on a diffusion batch: the scalar loss and the
    metrics TRL logs (``PolicyLossResult``), differentiable in the logits.

    logp is the log-probability of ``batch.target_ids`` at ``temperature``, taken with the
    entropy in one pass over the vocabulary (a LinearHead never forms its logits); the
    weights w = ``batch.loss_weights`` are the completion mask (a float weight scales its
    token's term). With r = exp(logp - old_logps) and A the sequence's advantage, the
    per-token loss ℓ is

      "grpo", "bnpo", "dr_grpo", "dapo": -min(r'·A, clip(r, 1 - epsilon, 1 + epsilon_high)·A),
        r' = min(r, delta) when ``delta`` is given (two-sided clipping), else r;
      "cispo": -min(r, epsilon_high)·A·logp, the capped ratio a constant;

    plus beta·(exp(ref - logp) - (ref - logp) - 1), ref = ``ref_logps``, when beta != 0
    (times r when ``use_bias_correction_kl``). The loss normalises Σ w·ℓ:

      grpo: the mean over the B sequences of Σ_l w·ℓ / max(Σ_l w, 1);
      bnpo: Σ w·ℓ / max(Σ w, 1);
      dr_grpo: Σ w·ℓ / (B·max_completion_length), max_completion_length L by default;
      dapo, cispo: Σ w·ℓ / max(num_items_in_batch, 1), Σ w by default.

    Args:
      logits: [B, L, K] logits, or a LinearHead standing for them.
      batch: the DiffusionTokenBatch the logits score.
      old_logps: [B, L] float, the sampling policy's log-probs (``per_token_logps`` of the
        same batch at the same temperature), or None: on-policy, logp itself as a constant
        (r = 1 exactly).
      advantages: [B], one per sequence.
      loss_type: one of "grpo", "bnpo", "dr_grpo", "dapo", "cispo".
      epsilon: in [0, 1]: the ratio's lower clip bound is 1 - epsilon.
      epsilon_high: >= 0 (None: epsilon): the upper clip bound is 1 + epsilon_high; with
        "cispo" (> 0) the cap of the ratio itself.
      delta: None, or > 1: the two-sided clipping bound of the unclipped term.
      beta: >= 0, the KL term's weight; ref_logps ([B, L] float) must be given when it is
        not 0 (otherwise they are not read).
      use_bias_correction_kl: multiply the KL term by r (importance-sampling correction).
      importance_sampling_level: "token" (a ratio per token) or "sequence" (GSPO: sequence
        b's ratio is exp of its weighted mean log-ratio, Σ_l w·(logp - old) / max(Σ_l w, 1),
        for every token of it).
      temperature: T > 0 of logp and the entropy (the sampling temperature).
      max_completion_length: dr_grpo's constant (a positive int; default L).
      num_items_in_batch: dapo's and cispo's count, a number or a 0-d tensor (default Σ w):
        across data-parallel ranks, the global token count. TRL's trainer passes that count
        divided by the number of processes, whose gradients DDP then averages.
      inplace_grad: opt-in. Write d(logits) into the logits buffer itself instead of a new
        tensor (saves one [..., K] allocation); after backward the logits tensor
        holds the gradient, so nothing else may read those logits afterwards.
        Supported by the chunked and triton backends, for logits given as a tensor
        (with a LinearHead, student or teacher, it is a ValueError). The same bits
        as without it; under ``torch.compile`` the graph's functionalization
        returns the gradient in a buffer of its own (no saving there).
      backend: None (auto), or one of "reference", "chunked", "triton".

    Returns:
      PolicyLossResult: ``loss`` ([] float32) and TRL's metrics as constants, each a
      weighted mean over tokens, Σ w·x / max(Σ w, 1): ``clip_ratio_low`` (r < 1 - epsilon
      with A < 0), ``clip_ratio_high`` (r > 1 + epsilon_high with A > 0; r after delta) and
      ``clip_ratio_region`` (either); with importance_sampling_level="sequence" these three
      are means over the B sequences, as TRL takes them. With "cispo", clip_ratio_high and
      clip_ratio_region are TRL's cispo_clip_ratio (r > epsilon_high with A > 0) and
      clip_ratio_low is 0. ``kl``: the KL term (times r with the bias correction), None when
      beta = 0. ``entropy``: the entropy at T.

    old_logps, ref_logps and advantages are constants (no gradient). Positions of weight 0
    take no part (a -inf or NaN there reaches nothing). Bad values raise ValueError where
    they can be read without a device sync (CPU tensors; CUDA tensors inside
    ``sync_checks()``): non-finite advantages, old_logps or ref_logps non-finite where the
    weight is set, a negative or non-finite num_items_in_batch, and the batch's own checks.
    Elsewhere (CUDA tensors, ``torch.compile``) they make the loss and every metric NaN, never a
    plausible number.
    """
    return _OBJECTIVES.policy_loss(
        logits, batch, old_logps=old_logps, advantages=advantages, loss_type=loss_type,
        epsilon=epsilon, epsilon_high=epsilon_high, delta=delta, beta=beta,
        ref_logps=ref_logps, use_bias_correction_kl=use_bias_correction_kl,
        importance_sampling_level=importance_sampling_level, temperature=temperature,
        max_completion_length=max_completion_length, num_items_in_batch=num_items_in_batch,
        inplace_grad=inplace_grad, backend=backend)


# -- the denoising step ------------------------------------------------------------------------

_SAMPLER = _Sampler(_TORCH)


def sample_tokens(
    logits: Logits,
    *,
    temperature: float = 1.0,
    seed: int | torch.Tensor = 0,
    step: int | torch.Tensor = 0,
    top_k: int | None = None,
    suppress_ids: torch.Tensor | Sequence[int] | int | None = None,
    uncond_logits: Logits | None = None,
    cfg_scale: float = 0.0,
    chunk_size: int | None = None,
    stats_temperature: float | None = None,
    backend: str | None = None,
) -> Sample:
    """One denoising step's draw, in one pass over each row's vocabulary (see ``Sample``).

    Args:
      logits: [..., K] float logits (e.g. [B, L, K]); the conditional ones with guidance. A
        ``LinearHead(hidden, weight)`` in their place is read in token chunks of its
        ``row_chunk`` rows (never [N, K]), a head's softcap applied to each chunk in
        float32; so may ``uncond_logits`` be.
      temperature: T of softmax(z / T): 0 is greedy (the argmax, ties to the lowest id; the
        statistics are then those of softmax(z)), else T in [1e-3, 3.4e38]: below 1e-3 the
        float32 rounding of z / T would swamp the noise, so a smaller T raises.
      seed, step: ints (or integer scalar tensors, traced ones too) keying the counter-based
        noise (docs/design.md §3): the same (seed, step) draws the same tokens on every
        backend; change ``step`` every denoising step. ``seed`` may also be a [B] integer
        tensor, one per sequence (B = logits.shape[0]): sequence b's noise is then keyed on
        (seed[b], step, its position inside the sequence, column), so it draws the same tokens
        alone or at any batch index, whatever its neighbours. One seed s keys the flattened
        row index instead: a batch of one with seed s equals seed [s].
      top_k: None or k in [1, 64]: draw among the k most likely tokens (renormalised; every
        statistic is taken under that distribution).
      suppress_ids: ids in [0, K) never drawn (e.g. the mask token): an [S] integer tensor,
        a list, or one int; their logits count as -inf. An id outside [0, K) raises where
        its value can be read; where it cannot, every row has no valid draw (below).
      uncond_logits, cfg_scale: classifier-free guidance, z = z_u + (s + 1)(z_c - z_u), both
        read in the same pass.
      chunk_size: the vocabulary chunk of the chunked backend (default: a heuristic).
      stats_temperature: T_s of the returned statistics (logp, top1_logp, top2_logp,
        entropy, hence of every confidence of ``commit_tokens``): None takes the draw's T
        (softmax(z) at T = 0); 1.0 gives LLaDA's, Fast-dLLM's and Megatron-Bridge's
        confidence softmax(z)[token] while drawing at T. The token is drawn at ``temperature``
        either way, in the same pass; at T = 0 only None or 1 is accepted. With top_k the
        statistics are those of the k kept tokens renormalised at T_s.
      backend: None (auto), or one of "reference", "chunked", "triton". Every
        backend draws the same tokens for the same (seed, step).

    Returns:
      Sample(token, logp, argmax, top1_logp, top2_logp, entropy) with the logits' leading
      shape; ``Sample.vocab_size`` = K. A row with no valid draw -- a NaN or +inf logit after
      guidance, suppression and the temperature, or no finite one -- has token -1, argmax
      -1 and NaN logp, top1_logp, top2_logp and entropy; ``commit_tokens`` never commits it.
      Without top_k, on logits without guidance or suppressed ids, logp and entropy are bit
      for bit those of the token statistics on the same backend and logits:
      ``per_token_logps(logits, batch with the tokens as targets, temperature=T_s,
      return_entropy=True)``, ``token_stats(..., chunk_size=chunk_size)`` with a chunk_size
      (docs/design.md §3, "Rollout = trainer"): an on-policy importance ratio is exactly 1.
      Not differentiable.
    """
    return _SAMPLER.sample_tokens(logits, temperature=temperature, seed=seed, step=step, top_k=top_k,
                          suppress_ids=suppress_ids, uncond_logits=uncond_logits,
                          cfg_scale=cfg_scale, chunk_size=chunk_size,
                          stats_temperature=stats_temperature, backend=backend)


def commit_tokens(
    canvas: torch.Tensor,
    sample: Sample,
    masked: torch.Tensor,
    *,
    rule: str = "topk",
    k: int | torch.Tensor | None = None,
    threshold: float | torch.Tensor | None = None,
    budget: float | torch.Tensor | None = None,
    confidence: str = "probability",
    inclusive: bool = False,
    exclusive: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Commit the surest masked positions of a canvas: ([B, L] new canvas, [B, L] bool
    committed).

    Args:
      canvas: [B, L] int tokens whose dtype holds every id of the vocabulary (else a
        ValueError, never a wrapped id).
      sample: the ``Sample`` of this step's logits.
      masked: [B, L] bool, the positions still masked (inside the current block for
        block-wise semi-autoregressive decoding: the caller passes the intersection).
      rule: "topk" (LLaDA: the ``k`` most confident masked positions per sequence),
        "threshold" (Fast-dLLM: every masked position with confidence > ``threshold``, at
        least the most confident one) or "entropy_budget" (lowest entropy first while the
        entropies sum to at most ``budget`` nats; at least one).
      k, threshold, budget: a number or a tensor of shape [] or [B] (per sequence); ``k`` an
        int >= 0, ``threshold`` and ``budget`` not NaN.
      confidence: "probability" (of the drawn token), "margin" (p1 - p2) or "neg_entropy".
        Ties go to the lower position.
      inclusive: rule="threshold" commits confidence >= ``threshold`` (as the
        ``get_transfer_index`` of Fast-dLLM and Megatron-Bridge do) rather than the default
        confidence > ``threshold``.
      exclusive: rule="entropy_budget" commits a position when the entropies ranked before
        it (not its own) sum to at most ``budget``: the k lowest entropies with
        H_1 + ... + H_(k-1) <= budget, one position more than the default where it fits.
        This is the acceptance of DiffusionGemma's ``EntropyBoundSampler`` in transformers
        (its running sum less each position's own entropy, formed the same way in float32),
        given the same entropies. Only with rule="entropy_budget" (else a ValueError).
    Defaults against upstream: rule="topk" with confidence="probability" is LLaDA's
    low-confidence remasking when the Sample's statistics are at temperature 1
    (``sample_tokens(..., stats_temperature=1.0)``, or temperature=0); Fast-dLLM's and
    Megatron-Bridge's threshold rule is rule="threshold", inclusive=True with the same
    statistics; confidence="neg_entropy" is Megatron-Bridge's ``neg_entropy=True``.
    ``get_transfer_index`` is that upstream step itself.
    A row with no valid draw (token -1) is never committed and never ranks above a valid one.
    """
    return _SAMPLER.commit_tokens(canvas, sample, masked, rule=rule, k=k, threshold=threshold,
                          budget=budget, confidence=confidence, inclusive=inclusive,
                          exclusive=exclusive)


# -- the upstream denoising step (LLaDA, Fast-dLLM, Megatron-Bridge) ---------------------------

_STEP = _StepFunctions(_SAMPLER)


def add_gumbel_noise(
    logits: Logits,
    temperature: float,
    *,
    seed: int | torch.Tensor = 0,
    step: int | torch.Tensor = 0,
) -> torch.Tensor:
    """Upstream's ``add_gumbel_noise``: scores whose argmax over the last axis is a draw from
    softmax(logits / temperature).

    At temperature 0 it returns ``logits`` as they are (a LinearHead's logits formed), as
    upstream does. Otherwise upstream returns exp(logits) / (-log u)^T in float64; this
    returns its log divided by T, logits / T + g with g our keyed Gumbel noise
    (``sample_tokens``'s, the same (seed, step) arguments), as a [..., K] float32 tensor:
    the same argmax (a monotone map of upstream's form), no overflow of exp(logits), half
    the bytes -- and its argmax is exactly ``sample_tokens(logits, temperature=T, seed=seed,
    step=step).token``. Equal to upstream's in distribution, not in bits. It materialises
    [..., K], as upstream's does; ``get_transfer_index`` and ``sample_tokens`` never do.
    temperature: 0 or in [1e-3, 3.4e38] (``sample_tokens``'s range).
    """
    return _STEP.add_gumbel_noise(logits, temperature, seed=seed, step=step)


def get_num_transfer_tokens(mask_index: torch.Tensor, steps: int) -> torch.Tensor:
    """Upstream's ``get_num_transfer_tokens``: [B, steps] tokens to commit per step for a
    linear schedule, int64. Row b gives mask_count_b // steps per step,
    and its first mask_count_b % steps steps one more, mask_count_b the number of True
    (non-zero) entries of mask_index [B, L]. ``steps`` is a positive int."""
    return _STEP.get_num_transfer_tokens(mask_index, steps)


def get_transfer_index(
    logits: Logits,
    temperature: float,
    remasking: str,
    mask_index: torch.Tensor,
    x: torch.Tensor,
    num_transfer_tokens: torch.Tensor | int | None,
    threshold: float | torch.Tensor | None = None,
    neg_entropy: bool = False,
    *,
    seed: int | torch.Tensor = 0,
    step: int | torch.Tensor = 0,
    backend: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Upstream's ``get_transfer_index``: ([B, L] x0, [B, L] bool transfer_index), from one
    read of the logits (``sample_tokens``; no [B, L, K] noise or softmax).

    Args:
      logits: [B, L, K] float logits, or a LinearHead standing for them.
      temperature: of the draw: x0 = argmax(add_gumbel_noise(logits, temperature)), greedy
        at 0 (ties to the lowest id); else in [1e-3, 3.4e38].
      remasking: "low_confidence" (confidence softmax(logits)[x0], at temperature 1 whatever
        the draw's) or "random" (a uniform per position, keyed like the noise); any other
        value raises NotImplementedError, as upstream.
      mask_index: [B, L] bool, the positions to fill; x: [B, L] int canvas whose dtype holds
        every id below K. x0 = where(mask_index, draw, x).
      num_transfer_tokens: per row k, an int or [B] or [B, 1] ints: without a threshold row b
        commits the k_b most confident positions, masked ones first (off the mask the
        confidence is -inf; past the masked count upstream's topk fills k with unmasked
        positions, where x0 = x, and so does this: the lowest ones). A k above L raises
        an error that is both a ValueError and upstream's RuntimeError (torch.topk's); where
        k cannot be read without a device sync (traced, or CUDA tensors outside
        ``sync_checks()``), every position is committed.
      threshold: a number (or [B]): every masked position whose confidence is >= threshold,
        and always the most confident one (num_transfer_tokens is then ignored).
      neg_entropy: with "low_confidence", the confidence is Σ_k p_k log p_k, p =
        softmax(logits) (upstream's Σ p log(p + 1e-10) is larger by less than K·1e-10).
      seed, step, backend: as ``sample_tokens`` (seed also [B], one per sequence).

    Exactly upstream's: greedy tokens, which positions are committed, the k past the masked
    count; ties at the k-th place go to the lower position (torch.topk leaves them
    unspecified). Not upstream's bits: the draws (equal in distribution: keyed noise), the
    confidences (float32 here, float64 upstream). x0 has x's dtype; a position whose logits
    have no valid draw (NaN, +inf, none finite) keeps x and is never ranked above a valid one.
    """
    return _STEP.get_transfer_index(logits, temperature, remasking, mask_index, x,
                               num_transfer_tokens, threshold, neg_entropy, seed=seed,
                               step=step, backend=backend)
