"""The losses as ``torch.nn.Module`` s, in the manner of Liger-Kernel's
``LigerCrossEntropyLoss`` / ``LigerFusedLinearCrossEntropyLoss``: options are checked once at
construction, tensors come at call time, and the functional API of ``dlm_kernels.torch``
runs underneath (the same values and gradients).

    loss_fn = DiffusionSFTLoss(variant="reweighted-loo-ce", vocab_size=K)
    loss = loss_fn(logits, x0, xt, t, loss_mask)            # mean over sequences

    head_loss = FusedLinearDiffusionSFTLoss(variant="loo-ce", vocab_size=K)
    loss = head_loss(hidden, model.lm_head.weight, x0, xt, t, loss_mask)  # no [B, L, K] logits

Each module takes every keyword of its function at construction, with the same defaults
(``tests/test_modules.py`` compares the signatures). The modules hold no parameters or
buffers. ``reduction`` reduces the per-sequence [B] losses
of the SFT modules: "mean" (the default, as torch's and Liger's losses), "sum" or "none"
([B], Megatron-Bridge's ``diffusion_sft_loss`` as it is). The distillation modules return
the scalar ``opd_loss(...)[0].compute()``: Σ w·loss / Σ w over the batch (``opd_loss``
itself gives the WeightedSum and the soft and hard terms). The policy modules return
``policy_loss``'s ``PolicyLossResult``: ``.loss`` to differentiate, and TRL's metrics.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .._checks import flag as check_flag
from .._config import (check_distillation_scalars, check_label_smoothing, check_loss_weight,
                       check_positive_float, check_positive_int, check_vocab_size)
from ..linear_head.head import LAYOUTS, VOCAB_MAJOR
from .._policy import check_policy_options
from .._schedule import normalize_variant
from . import (DiffusionDistillationBatch, DiffusionTokenBatch, LinearHead, Logits,
               PolicyLossResult, diffusion_sft_loss, opd_loss, policy_loss, rf_alpha,
               rf_alpha_dot)

__all__ = ["DiffusionSFTLoss", "FusedLinearDiffusionSFTLoss", "OPDLoss", "FusedLinearOPDLoss",
           "PolicyLoss", "FusedLinearPolicyLoss"]

#: how the SFT modules reduce their [B] losses
REDUCTIONS = ("mean", "sum", "none")

Schedule = Callable[[torch.Tensor], torch.Tensor | float]
"""``alpha_fn`` / ``alpha_dot_fn``: t [B] float32 -> [B] (or [B, 1], [B, L]) or a number."""


def _check_backend(backend: str | None) -> str | None:
    if backend is not None and not isinstance(backend, str):
        raise TypeError(f"backend must be None or a backend name; got {type(backend).__name__}")
    return backend


def _ce_repr(label_smoothing: float, z_loss_weight: float) -> str:
    """The CE options for ``extra_repr``: those that are not 0."""
    return "".join(f", {name}={value}" for name, value in (
        ("label_smoothing", label_smoothing), ("z_loss_weight", z_loss_weight)) if value)


def _check_head(weight_layout: str, row_chunk: int | None,
                softcap: float | None) -> tuple[str, int | None, float | None]:
    if weight_layout not in LAYOUTS:
        raise ValueError(f"weight_layout must be one of {LAYOUTS} ('KD': weight [K, D], as "
                         f"lm_head.weight; 'DK': weight [D, K]); got {weight_layout!r}")
    return (weight_layout, check_positive_int("row_chunk", row_chunk, allow_none=True),
            check_positive_float("softcap", softcap, allow_none=True))


def _head_repr(module: torch.nn.Module) -> str:
    cap = "" if module.softcap is None else f", softcap={module.softcap}"
    return f", weight_layout={module.weight_layout!r}{cap}"


class _SFTLossBase(torch.nn.Module):
    """The options of the SFT modules and the functional call they make."""

    def __init__(self, *, variant: str, vocab_size: int,
                 diffusion_weight_clip: float | None = None, alpha_fn: Schedule = rf_alpha,
                 alpha_dot_fn: Schedule = rf_alpha_dot, label_smoothing: float = 0.0,
                 z_loss_weight: float = 0.0, reduction: str = "mean",
                 backend: str | None = None) -> None:
        super().__init__()
        if reduction not in REDUCTIONS:
            raise ValueError(f"reduction must be one of {REDUCTIONS}; got {reduction!r}")
        self.variant: str = normalize_variant(variant)
        self.vocab_size: int = check_vocab_size(vocab_size)
        self.diffusion_weight_clip: float | None = check_positive_float(
            "diffusion_weight_clip", diffusion_weight_clip, allow_none=True)
        self.alpha_fn: Schedule = alpha_fn
        self.alpha_dot_fn: Schedule = alpha_dot_fn
        self.label_smoothing: float = check_label_smoothing(label_smoothing)
        self.z_loss_weight: float = check_loss_weight("z_loss_weight", z_loss_weight)
        self.reduction: str = reduction
        self.backend: str | None = _check_backend(backend)

    def _loss(self, logits: Logits, x0: torch.Tensor, xt: torch.Tensor,
              t: torch.Tensor | float, loss_mask: torch.Tensor) -> torch.Tensor:
        loss = diffusion_sft_loss(  # [B]
            logits, x0, xt, t, loss_mask, variant=self.variant, vocab_size=self.vocab_size,
            diffusion_weight_clip=self.diffusion_weight_clip, alpha_fn=self.alpha_fn,
            alpha_dot_fn=self.alpha_dot_fn, label_smoothing=self.label_smoothing,
            z_loss_weight=self.z_loss_weight, backend=self.backend)
        if self.reduction == "mean":
            return loss.mean()
        return loss.sum() if self.reduction == "sum" else loss

    def extra_repr(self) -> str:
        clip = "" if self.diffusion_weight_clip is None else \
            f", diffusion_weight_clip={self.diffusion_weight_clip}"
        return (f"variant={self.variant!r}, vocab_size={self.vocab_size}{clip}"
                f"{_ce_repr(self.label_smoothing, self.z_loss_weight)}, "
                f"reduction={self.reduction!r}")


class DiffusionSFTLoss(_SFTLossBase):
    """Megatron-Bridge's DiffusionGemma SFT loss (``dlm_kernels.torch.diffusion_sft_loss``)
    as a module.

    Args (at construction, checked there):
      variant: one of ``VARIANTS`` (or the alias "loo-reweighted-ce").
      vocab_size: K of the LOO shift and the range of valid ids (<= the logits' K).
      diffusion_weight_clip: an upper bound of the time weight, or None.
      alpha_fn, alpha_dot_fn: the schedule (default: rectified flow, 1 - t and -1).
      label_smoothing: ε in [0, 1]; z_loss_weight: λ >= 0 (both default 0: the plain CE;
        ``diffusion_sft_loss`` says what they do).
      reduction: "mean" (over sequences), "sum" or "none" ([B]).
      backend: None (auto) or a backend name.

    ``forward(logits, x0, xt, t, loss_mask)``: logits [B, L, K] (or a ``LinearHead``), x0 and
    xt [B, L] int, t [B] or one number, loss_mask [B, L]; returns the reduced loss.
    """

    def forward(self, logits: Logits, x0: torch.Tensor, xt: torch.Tensor,
                t: torch.Tensor | float, loss_mask: torch.Tensor) -> torch.Tensor:
        """The SFT loss of one batch, reduced by ``reduction``."""
        return self._loss(logits, x0, xt, t, loss_mask)


class FusedLinearDiffusionSFTLoss(_SFTLossBase):
    """``DiffusionSFTLoss`` from the hidden states and the unembedding weight: the logits
    ``hidden @ weight.T (+ bias)`` are formed one token chunk at a time, never as [B, L, K]
    (a ``LinearHead``); gradients reach hidden, weight and bias.

    Args: those of ``DiffusionSFTLoss``, and
      weight_layout: "KD" (default: weight [K, D], ``lm_head.weight`` of an ``nn.Linear``, a
        tied ``nn.Embedding.weight``) or "DK" (weight [D, K]).
      row_chunk: rows per token chunk (default: a heuristic).
      softcap: c > 0 of the final-logit softcap, logits = c·tanh((hidden @ weight.T (+ bias))
        / c) (Gemma's ``final_logit_softcapping``), or None (default: no cap).

    ``forward(hidden, weight, x0, xt, t, loss_mask, bias=None)``: hidden [B, L, D].
    """

    def __init__(self, *, variant: str, vocab_size: int,
                 diffusion_weight_clip: float | None = None, alpha_fn: Schedule = rf_alpha,
                 alpha_dot_fn: Schedule = rf_alpha_dot, label_smoothing: float = 0.0,
                 z_loss_weight: float = 0.0, reduction: str = "mean",
                 weight_layout: str = VOCAB_MAJOR, row_chunk: int | None = None,
                 softcap: float | None = None, backend: str | None = None) -> None:
        super().__init__(variant=variant, vocab_size=vocab_size,
                         diffusion_weight_clip=diffusion_weight_clip, alpha_fn=alpha_fn,
                         alpha_dot_fn=alpha_dot_fn, label_smoothing=label_smoothing,
                         z_loss_weight=z_loss_weight, reduction=reduction, backend=backend)
        self.weight_layout: str
        self.row_chunk: int | None
        self.softcap: float | None
        self.weight_layout, self.row_chunk, self.softcap = _check_head(weight_layout,
                                                                       row_chunk, softcap)

    def forward(self, hidden: torch.Tensor, weight: torch.Tensor, x0: torch.Tensor,
                xt: torch.Tensor, t: torch.Tensor | float, loss_mask: torch.Tensor,
                bias: torch.Tensor | None = None) -> torch.Tensor:
        """The SFT loss of one batch from its hidden states, reduced by ``reduction``."""
        head = LinearHead(hidden, weight, bias, self.softcap, weight_layout=self.weight_layout,
                          row_chunk=self.row_chunk)
        return self._loss(head, x0, xt, t, loss_mask)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}{_head_repr(self)}"


class _OPDLossBase(torch.nn.Module):
    """The options of the distillation modules and the functional call they make."""

    def __init__(self, *, temperature: float = 1.0, soft_loss_weight: float = 1.0,
                 hard_loss_weight: float = 0.0, label_smoothing: float = 0.0,
                 z_loss_weight: float = 0.0, backend: str | None = None) -> None:
        super().__init__()
        self.temperature: float
        self.soft_loss_weight: float
        self.hard_loss_weight: float
        self.temperature, self.soft_loss_weight, self.hard_loss_weight = \
            check_distillation_scalars(temperature, soft_loss_weight, hard_loss_weight)
        self.label_smoothing: float = check_label_smoothing(label_smoothing)
        self.z_loss_weight: float = check_loss_weight("z_loss_weight", z_loss_weight)
        self.backend: str | None = _check_backend(backend)

    def _loss(self, student_logits: Logits, batch: DiffusionDistillationBatch) -> torch.Tensor:
        total, _ = opd_loss(student_logits, batch, temperature=self.temperature,
                            soft_loss_weight=self.soft_loss_weight,
                            hard_loss_weight=self.hard_loss_weight,
                            label_smoothing=self.label_smoothing,
                            z_loss_weight=self.z_loss_weight, backend=self.backend)
        return total.compute()  # []

    def extra_repr(self) -> str:
        return (f"temperature={self.temperature}, soft_loss_weight={self.soft_loss_weight}, "
                f"hard_loss_weight={self.hard_loss_weight}"
                f"{_ce_repr(self.label_smoothing, self.z_loss_weight)}")


class OPDLoss(_OPDLossBase):
    """On-policy distillation (``dlm_kernels.torch.opd_loss``, Tunix's diffusion OPD) as a
    module: soft_loss_weight · T²·KL(teacher ‖ student) at ``temperature`` plus
    hard_loss_weight · CE at T = 1, weighted by the batch's loss weights.

    Args (at construction, checked there in Tunix's words): temperature (> 0),
    soft_loss_weight, hard_loss_weight (>= 0, not both 0), label_smoothing (ε in [0, 1]) and
    z_loss_weight (λ >= 0) of the hard term (``opd_loss`` says what they do), backend.

    ``forward(student_logits, batch)``: student logits [B, L, K] (or a ``LinearHead``) and a
    ``DiffusionDistillationBatch``; returns the scalar Σ w·loss / Σ w (0 when Σ w = 0).
    """

    def forward(self, student_logits: Logits, batch: DiffusionDistillationBatch) -> torch.Tensor:
        """The distillation loss of one batch, a scalar."""
        return self._loss(student_logits, batch)


class FusedLinearOPDLoss(_OPDLossBase):
    """``OPDLoss`` from the student's hidden states and unembedding weight (a ``LinearHead``:
    no [B, L, K] student logits). The teacher is the batch's ``teacher_logits``, logits or a
    ``LinearHead`` of its own.

    Args: those of ``OPDLoss``, and ``weight_layout`` ("KD", the default: ``lm_head.weight``
    [K, D]; or "DK"), ``row_chunk`` and ``softcap`` as ``FusedLinearDiffusionSFTLoss``.

    ``forward(hidden, weight, batch, bias=None)``: hidden [B, L, D]; returns a scalar.
    """

    def __init__(self, *, temperature: float = 1.0, soft_loss_weight: float = 1.0,
                 hard_loss_weight: float = 0.0, label_smoothing: float = 0.0,
                 z_loss_weight: float = 0.0, weight_layout: str = VOCAB_MAJOR,
                 row_chunk: int | None = None, softcap: float | None = None,
                 backend: str | None = None) -> None:
        super().__init__(temperature=temperature, soft_loss_weight=soft_loss_weight,
                         hard_loss_weight=hard_loss_weight, label_smoothing=label_smoothing,
                         z_loss_weight=z_loss_weight, backend=backend)
        self.weight_layout: str
        self.row_chunk: int | None
        self.softcap: float | None
        self.weight_layout, self.row_chunk, self.softcap = _check_head(weight_layout,
                                                                       row_chunk, softcap)

    def forward(self, hidden: torch.Tensor, weight: torch.Tensor,
                batch: DiffusionDistillationBatch,
                bias: torch.Tensor | None = None) -> torch.Tensor:
        """The distillation loss of one batch from the student's hidden states, a scalar."""
        head = LinearHead(hidden, weight, bias, self.softcap, weight_layout=self.weight_layout,
                          row_chunk=self.row_chunk)
        return self._loss(head, batch)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}{_head_repr(self)}"


class _PolicyLossBase(torch.nn.Module):
    """The options of the policy modules and the functional call they make."""

    def __init__(self, *, loss_type: str, epsilon: float = 0.2,
                 epsilon_high: float | None = None, delta: float | None = None,
                 beta: float = 0.0, use_bias_correction_kl: bool = False,
                 importance_sampling_level: str = "token", temperature: float = 1.0,
                 max_completion_length: int | None = None, inplace_grad: bool = False,
                 backend: str | None = None) -> None:
        super().__init__()
        options = check_policy_options(
            loss_type=loss_type, epsilon=epsilon, epsilon_high=epsilon_high, delta=delta,
            beta=beta, use_bias_correction_kl=use_bias_correction_kl,
            importance_sampling_level=importance_sampling_level, temperature=temperature,
            max_completion_length=max_completion_length)
        self.loss_type: str = options.loss_type
        self.epsilon: float = options.epsilon
        self.epsilon_high: float = options.epsilon_high  # epsilon when not given
        self.delta: float | None = options.delta
        self.beta: float = options.beta
        self.use_bias_correction_kl: bool = options.use_bias_correction_kl
        self.importance_sampling_level: str = options.importance_sampling_level
        self.temperature: float = options.temperature
        self.max_completion_length: int | None = options.max_completion_length
        self.inplace_grad: bool = check_flag("inplace_grad", inplace_grad)
        self.backend: str | None = _check_backend(backend)

    def _loss(self, logits: Logits, batch: DiffusionTokenBatch, old_logps: torch.Tensor | None,
              advantages: torch.Tensor, ref_logps: torch.Tensor | None,
              num_items_in_batch: torch.Tensor | float | None) -> PolicyLossResult:
        return policy_loss(
            logits, batch, old_logps=old_logps, advantages=advantages,
            loss_type=self.loss_type, epsilon=self.epsilon, epsilon_high=self.epsilon_high,
            delta=self.delta, beta=self.beta, ref_logps=ref_logps,
            use_bias_correction_kl=self.use_bias_correction_kl,
            importance_sampling_level=self.importance_sampling_level,
            temperature=self.temperature, max_completion_length=self.max_completion_length,
            num_items_in_batch=num_items_in_batch, inplace_grad=self.inplace_grad,
            backend=self.backend)

    def extra_repr(self) -> str:
        optional = "".join(f", {name}={value!r}" for name, value in (
            ("delta", self.delta), ("max_completion_length", self.max_completion_length))
            if value is not None)
        kl = (f", beta={self.beta}, use_bias_correction_kl={self.use_bias_correction_kl}"
              if self.beta else "")
        return (f"loss_type={self.loss_type!r}, epsilon={self.epsilon}, "
                f"epsilon_high={self.epsilon_high}{optional}{kl}, "
                f"importance_sampling_level={self.importance_sampling_level!r}, "
                f"temperature={self.temperature}"
                + (", inplace_grad=True" if self.inplace_grad else ""))


class PolicyLoss(_PolicyLossBase):
    """TRL ``GRPOTrainer``'s policy losses (``dlm_kernels.torch.policy_loss``) as a module.

    Args (at construction, checked there): loss_type ("grpo", "bnpo", "dr_grpo", "dapo",
    "cispo"), epsilon, epsilon_high, delta, beta, use_bias_correction_kl,
    importance_sampling_level, temperature, max_completion_length, inplace_grad, backend: as
    ``policy_loss``.

    ``forward(logits, batch, *, old_logps, advantages, ref_logps=None,
    num_items_in_batch=None)``: logits [B, L, K] (or a ``LinearHead``), a
    ``DiffusionTokenBatch``, old_logps [B, L] or None (on-policy), advantages [B]; returns
    the ``PolicyLossResult`` (``.loss`` and TRL's metrics).
    """

    def forward(self, logits: Logits, batch: DiffusionTokenBatch, *,
                old_logps: torch.Tensor | None, advantages: torch.Tensor,
                ref_logps: torch.Tensor | None = None,
                num_items_in_batch: torch.Tensor | float | None = None) -> PolicyLossResult:
        """The policy loss of one batch and its metrics."""
        return self._loss(logits, batch, old_logps, advantages, ref_logps, num_items_in_batch)


class FusedLinearPolicyLoss(_PolicyLossBase):
    """``PolicyLoss`` from the hidden states and the unembedding weight (a ``LinearHead``: no
    [B, L, K] logits); gradients reach hidden, weight and bias.

    Args: those of ``PolicyLoss``, and ``weight_layout`` ("KD", the default: ``lm_head.weight``
    [K, D]; or "DK"), ``row_chunk`` and ``softcap`` as ``FusedLinearDiffusionSFTLoss``.

    ``forward(hidden, weight, batch, *, old_logps, advantages, ref_logps=None,
    num_items_in_batch=None, bias=None)``: hidden [B, L, D]; returns the
    ``PolicyLossResult``.
    """

    def __init__(self, *, loss_type: str, epsilon: float = 0.2,
                 epsilon_high: float | None = None, delta: float | None = None,
                 beta: float = 0.0, use_bias_correction_kl: bool = False,
                 importance_sampling_level: str = "token", temperature: float = 1.0,
                 max_completion_length: int | None = None, weight_layout: str = VOCAB_MAJOR,
                 row_chunk: int | None = None, softcap: float | None = None,
                 backend: str | None = None) -> None:
        super().__init__(loss_type=loss_type, epsilon=epsilon, epsilon_high=epsilon_high,
                         delta=delta, beta=beta, use_bias_correction_kl=use_bias_correction_kl,
                         importance_sampling_level=importance_sampling_level,
                         temperature=temperature, max_completion_length=max_completion_length,
                         backend=backend)
        self.weight_layout: str
        self.row_chunk: int | None
        self.softcap: float | None
        self.weight_layout, self.row_chunk, self.softcap = _check_head(weight_layout,
                                                                       row_chunk, softcap)

    def forward(self, hidden: torch.Tensor, weight: torch.Tensor, batch: DiffusionTokenBatch,
                *, old_logps: torch.Tensor | None, advantages: torch.Tensor,
                ref_logps: torch.Tensor | None = None,
                num_items_in_batch: torch.Tensor | float | None = None,
                bias: torch.Tensor | None = None) -> PolicyLossResult:
        """The policy loss of one batch from its hidden states, and its metrics."""
        head = LinearHead(hidden, weight, bias, self.softcap, weight_layout=self.weight_layout,
                          row_chunk=self.row_chunk)
        return self._loss(head, batch, old_logps, advantages, ref_logps, num_items_in_batch)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}{_head_repr(self)}"
