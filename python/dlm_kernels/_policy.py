"""The policy losses of TRL's ``GRPOTrainer`` (docs/design.md §3), written once over a
framework's ops adapter (``xp``).

``Objectives.policy_loss`` takes the target's log-probability and entropy at the sampling
temperature from one token-statistics call, then does only ``[B, L]`` arithmetic here, so
autodiff reaches the logits (or a linear head's hidden states and weight) through the
primitive's VJP. ``check_policy_options`` checks the scalar options once (the torch modules
call it at construction).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

from . import _checks as checks
from . import _guards as guards
from ._checks import flag, number, plain, shape_str
from ._config import check_loss_weight, check_positive_float, check_positive_int

#: every ``loss_type``: the clipped surrogates first, then CISPO
LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo")
CLIPPED_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")
IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")


@dataclasses.dataclass(frozen=True)
class PolicyOptions:
    """The checked scalar options of one policy loss (``check_policy_options``)."""

    loss_type: str
    epsilon: float
    epsilon_high: float  # epsilon when not given
    delta: Optional[float]
    beta: float
    use_bias_correction_kl: bool
    importance_sampling_level: str
    temperature: float
    max_completion_length: Optional[int]


def _choice(name, value, choices):
    if not isinstance(value, str) or value not in choices:
        raise ValueError(f"{name} must be one of {choices}; got {value!r}")
    return value


def check_policy_options(*, loss_type, epsilon=0.2, epsilon_high=None, delta=None, beta=0.0,
                         use_bias_correction_kl=False, importance_sampling_level="token",
                         temperature=1.0, max_completion_length=None) -> PolicyOptions:
    """The options as plain Python values, each checked (errors name the argument and the
    value seen): epsilon in [0, 1] (the ratio's lower clip bound 1 - epsilon stays >= 0);
    epsilon_high finite and >= 0 (CISPO: > 0, it caps the ratio itself); delta None or
    finite and > 1; beta finite and >= 0; temperature finite and > 0; max_completion_length
    None or a positive int. Options a loss type does not read are checked all the same."""
    loss_type = _choice("loss_type", loss_type, LOSS_TYPES)
    level = _choice("importance_sampling_level", importance_sampling_level,
                    IMPORTANCE_SAMPLING_LEVELS)
    epsilon = number("epsilon", epsilon, "a float in [0, 1]")
    if not 0.0 <= epsilon <= 1.0:  # (False for NaN)
        raise ValueError(f"epsilon must be a float in [0, 1] (the ratio's lower clip bound is "
                         f"1 - epsilon); got {plain(epsilon)}")
    if epsilon_high is None:
        epsilon_high = epsilon
    else:
        epsilon_high = number("epsilon_high", epsilon_high, "a finite float >= 0 or None")
        if not (math.isfinite(epsilon_high) and epsilon_high >= 0.0):
            raise ValueError(f"epsilon_high must be a finite float >= 0 or None; got "
                             f"{plain(epsilon_high)}")
    if loss_type == "cispo" and epsilon_high <= 0.0:
        raise ValueError(f"epsilon_high must be positive with loss_type 'cispo' (it caps the "
                         f"importance ratio); got {plain(epsilon_high)}")
    if delta is not None:
        delta = number("delta", delta, "a finite float > 1 or None")
        if not (math.isfinite(delta) and delta > 1.0):
            raise ValueError(f"delta must be a finite float > 1 or None (an upper bound of the "
                             f"importance ratio); got {plain(delta)}")
    return PolicyOptions(
        loss_type=loss_type, epsilon=epsilon, epsilon_high=epsilon_high, delta=delta,
        beta=check_loss_weight("beta", beta),
        use_bias_correction_kl=flag("use_bias_correction_kl", use_bias_correction_kl),
        importance_sampling_level=level,
        temperature=check_positive_float("temperature", temperature),
        max_completion_length=check_positive_int("max_completion_length",
                                                 max_completion_length, allow_none=True))


# -- the array arguments -----------------------------------------------------------------

def _logps_like(xp, name, value, bl, weights):
    """[B, L] float log-probs, checked: finite where the weights are set (read where that
    costs no device sync); a constant."""
    checks.require_array(xp, name, value)
    checks.require_float(xp, name, value)
    checks.require_shape(name, value, bl, "target_ids.shape [B, L]")
    checks.check_finite(xp, name, value, where=weights, at=" where loss_weights is set")
    return xp.stop_gradient(xp.f32(value))


def _advantages(xp, value, b):
    checks.require_array(xp, "advantages", value)
    if not (xp.is_int(value) or xp.is_float(value)):
        raise TypeError(f"advantages must have an integer or floating dtype; got "
                        f"{checks.dtype_str(value)}")
    checks.require_shape("advantages", value, (b,), "[B]")
    checks.check_finite(xp, "advantages", value)
    return xp.stop_gradient(xp.f32(value))


def _num_items(xp, value, like):
    """num_items_in_batch as a [] float32 array, or None: a number or a 0-d array, finite and
    >= 0 (an array's value read where that costs no device sync)."""
    if value is None:
        return None
    if not xp.is_array(value):
        if getattr(value, "shape", ()) != ():  # an array of another library: say which
            checks.require_array(xp, "num_items_in_batch", value)
        return xp.full((), check_loss_weight("num_items_in_batch", value), like)
    if tuple(value.shape) != ():
        raise ValueError(f"num_items_in_batch must be a number or a 0-d array; got shape "
                         f"{shape_str(value.shape)}")
    if not (xp.is_int(value) or xp.is_float(value)):
        raise TypeError(f"num_items_in_batch must have an integer or floating dtype; got "
                        f"{checks.dtype_str(value)}")
    v = checks.host_values(xp, value)
    if v is not None and not (math.isfinite(float(v)) and float(v) >= 0.0):
        raise ValueError(f"num_items_in_batch must be a finite non-negative number; got "
                         f"{plain(float(v))}")
    return xp.stop_gradient(xp.f32(value))


def policy_inputs(xp, opts, batch, old_logps, advantages, ref_logps, num_items_in_batch):
    """(old, advantages, ref, num_items) checked and as float32 constants; old and ref None
    when not given (ref is not read when beta = 0)."""
    bl = tuple(batch.target_ids.shape)
    w = batch.loss_weights
    old = None if old_logps is None else _logps_like(xp, "old_logps", old_logps, bl, w)
    adv = _advantages(xp, advantages, bl[0])
    ref = None
    if opts.beta != 0.0:
        if ref_logps is None:
            raise ValueError(f"ref_logps must be given when beta != 0 (the KL term reads the "
                             f"reference model's log-probs); got None with beta = "
                             f"{plain(opts.beta)}")
        ref = _logps_like(xp, "ref_logps", ref_logps, bl, w)
    return old, adv, ref, _num_items(xp, num_items_in_batch, adv)


# -- the loss ------------------------------------------------------------------------------

def _indicator(xp, condition):
    return xp.where(condition, 1.0, 0.0)


def policy_terms(xp, opts, logp, entropy, weights, weights_read, old, adv, ref, num_items):
    """The loss and TRL's metrics (a dict of [] float32 arrays; ``kl`` None when beta = 0)
    from logp, entropy [B, L] at the temperature, the weights [B, L] (float32), whether the
    host checks read the weights (``weights_read``) and the checked constants of
    ``policy_inputs``.

    Inactive positions (weight 0) take no part: their log-ratio and KL argument are 0 before
    any exponential, so a -inf there reaches neither the loss nor a gradient. Values no check
    could read (traced, or on an accelerator) are never turned into a plausible number: a
    negative or non-finite weight, a non-finite advantage, old or reference log-prob at an
    active position, or a bad num_items_in_batch make the loss and every metric NaN."""
    b = logp.shape[0]
    active = weights != 0.0  # [B, L]
    adv_col = adv[:, None]  # [B, 1]
    old_logp = xp.stop_gradient(logp) if old is None else old  # None: on-policy, ratio 1
    log_ratio = xp.where(active, logp - old_logp, 0.0)  # [B, L]
    count = xp.rowsum(weights)  # [B]
    sequence = opts.importance_sampling_level == "sequence"
    if sequence:  # GSPO: one ratio per sequence, the weighted mean log-ratio
        log_ratio = (xp.rowsum(log_ratio * weights) / xp.clamp_min(count, 1.0))[:, None]
    coef_1 = xp.exp(log_ratio)  # [B, L], or [B, 1] per sequence
    kl = None
    if opts.beta != 0.0:
        diff = xp.where(active, ref - logp, 0.0)
        kl = xp.exp(diff) - diff - 1.0  # [B, L]
        if opts.use_bias_correction_kl:
            kl = kl * coef_1
    if opts.loss_type == "cispo":
        cap = xp.stop_gradient(xp.clamp_max(coef_1, opts.epsilon_high))
        per_token = -cap * adv_col * logp
        high = xp.stop_gradient(coef_1) > opts.epsilon_high  # TRL's cispo_clip_ratio
        high = _indicator(xp, high & (adv_col > 0.0))
        low = high * 0.0  # the cap is an upper bound only
    else:
        lo, hi = 1.0 - opts.epsilon, 1.0 + opts.epsilon_high
        # the clamps as selects: the gradient is 1 on [lo, hi] (bounds included), as torch's
        # clamp gives it, in both frameworks
        coef_2 = xp.where(coef_1 < lo, lo, xp.where(coef_1 > hi, hi, coef_1))
        if opts.delta is not None:  # two-sided clipping
            coef_1 = xp.where(coef_1 > opts.delta, opts.delta, coef_1)
        unclipped, clipped_term = coef_1 * adv_col, coef_2 * adv_col
        # the minimum as a select: a tie (inside the clip range) differentiates the ratio
        per_token = -xp.where(clipped_term < unclipped, clipped_term, unclipped)
        ratio = xp.stop_gradient(coef_1)  # after delta, as TRL counts the clipped ratios
        low = _indicator(xp, (ratio < lo) & (adv_col < 0.0))
        high = _indicator(xp, (ratio > hi) & (adv_col > 0.0))
    if kl is not None:
        per_token = per_token + opts.beta * kl
    per_seq = xp.rowsum(xp.where(active, per_token * weights, 0.0))  # [B]
    total, n = guards.total(xp, per_seq), guards.total(xp, count)
    if opts.loss_type == "grpo":
        loss = guards.total(xp, per_seq / xp.clamp_min(count, 1.0)) / max(b, 1)
    elif opts.loss_type == "bnpo":
        loss = total / xp.clamp_min(n, 1.0)
    elif opts.loss_type == "dr_grpo":
        length = opts.max_completion_length or logp.shape[1]
        loss = total / float(max(b, 1) * length)
    else:  # dapo, cispo
        loss = total / xp.clamp_min(n if num_items is None else num_items, 1.0)

    def mean(x):  # [B, L] -> []: TRL's masked mean, Σ w·x / max(Σ w, 1)
        return guards.total(xp, xp.where(active, xp.stop_gradient(x) * weights, 0.0)) / \
            xp.clamp_min(n, 1.0)

    # the clip indicators are per token, or per sequence ([B, 1]), where TRL averages them
    # over the B sequences, each counting once (an empty one too)
    clip_mean = (lambda x: guards.total(xp, x[:, 0]) / float(max(b, 1))) if sequence else mean
    region = xp.where(low + high > 0.0, 1.0, 0.0)
    terms = dict(loss=loss, clip_ratio_low=clip_mean(low), clip_ratio_high=clip_mean(high),
                 clip_ratio_region=clip_mean(region), kl=None if kl is None else mean(kl),
                 entropy=mean(entropy))
    bad = _bad_inputs(xp, weights, weights_read, active, old, adv, ref, num_items)
    return {k: None if v is None else xp.where(bad, float("nan"), v) for k, v in terms.items()}


def _bad_inputs(xp, weights, weights_read, active, old, adv, ref, num_items):
    """[] bool: a value the checks reject, where they could not read it (the weights'
    elements not again where the checks read them: ``guards.bad_weighted_sum``)."""
    bad = (guards.bad_weighted_sum(xp, weights, weights_read)
           | guards.anywhere(xp, ~xp.isfinite(adv)))
    for logps in (old, ref):
        if logps is not None:
            bad = bad | guards.anywhere(xp, active & ~xp.isfinite(logps))
    if num_items is not None:
        bad = bad | ~(xp.isfinite(num_items) & (num_items >= 0.0))
    return bad
