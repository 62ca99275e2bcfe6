"""Every objective of docs/design.md §3, written once on top of the token-statistics primitive.

:class:`Objectives` binds the objectives to one framework's token-statistics op (its
``token_stats.op.TokenStatsFrontEnd``, which holds the framework's ops adapter) and its contract
classes (``Contract``); ``dlm_kernels.torch`` and ``dlm_kernels.jax`` each make one, privately,
and their typed public functions call its methods. Each objective does only cheap ``[B, L]``
arithmetic around one call of the op's one entry point, ``token_stats_total`` (never the
public ``token_stats`` again), so autodiff flows through the primitive's VJP.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, TypeVar, overload

from . import _checks as checks
from . import _guards as guards
from . import _policy
from ._checks import flag, number, shape_str
from .linear_head.head import as_logits
from ._config import (PLAIN_CE, CeTerm, check_distillation_scalars, check_positive_float,
                      check_vocab_size)
from ._schedule import EPS, LOO_VARIANTS, REWEIGHTED_VARIANTS, normalize_variant
from .token_stats.op import TokenStats, TokenStatsFrontEnd

if TYPE_CHECKING:
    from ._ops import Array

A = TypeVar("A", bound="Array")  # an array type: the schedules map t to its kind (or a float)


@overload
def rf_alpha(t: float) -> float: ...


@overload
def rf_alpha(t: A) -> A: ...


def rf_alpha(t: A | float) -> A | float:
    """Rectified-flow schedule alpha(t) = 1 - t."""
    return 1.0 - t


@overload
def rf_alpha_dot(t: float) -> float: ...


@overload
def rf_alpha_dot(t: A) -> A: ...


def rf_alpha_dot(t: A | float) -> A | float:
    """Rectified-flow schedule derivative alpha'(t) = -1 (same shape as t)."""
    return 0.0 * t - 1.0


#: Weights (an SFT row's loss mask) of which one reaches BIG_WEIGHT are summed times
#: WEIGHT_SCALE (docs/design.md §3): Σ w·CE stays finite wherever the mean is, up to
#: weights of float32's largest value, and the mean's gradient 1 / Σ w stays a normal number.
#: Two levels only, so that the sums of every batch whose weights stay below 2^64 (any
#: real training) are the plain sums and add up across batches.
BIG_WEIGHT = 2.0 ** 64
WEIGHT_SCALE = 2.0 ** -64


def _weight_scale(xp, w):
    """[...] float32: WEIGHT_SCALE where a weight of the last axis of w [..., L] reaches
    BIG_WEIGHT, else 1 (no gradient: a constant of each call)."""
    return xp.where(xp.any_last(w >= BIG_WEIGHT), WEIGHT_SCALE, 1.0)


@dataclasses.dataclass(frozen=True)
class Contract:
    """The result and batch classes of one front end (each framework's own dataclasses, as
    upstream's: the same fields, its array type)."""

    weighted_sum: Any
    token_batch: Any
    distillation_batch: Any
    policy_result: Any


class Objectives:
    """The public objectives of one front end (see the module docstring)."""

    def __init__(self, front: TokenStatsFrontEnd, contract: Contract):
        self.front = front  # token_stats_total, vocab_extent: the op, entered once per call
        self.xp = front.xp
        self.WeightedSum = contract.weighted_sum
        self.DiffusionTokenBatch = contract.token_batch
        self.DiffusionDistillationBatch = contract.distillation_batch
        self.PolicyLossResult = contract.policy_result

    # -- schedule -------------------------------------------------------------------------

    def _per_sequence(self, name, value, b, like, what, unit_interval=False):
        """A per-sequence value given as a [B] array or as one number for every sequence
        (a Python or NumPy scalar, a 0-d array): a [B] array, numbers as float32 on ``like``'s
        device. ``what`` says what a number must be (``unit_interval``: in [0, 1])."""
        xp = self.xp
        if not xp.is_array(value):
            if getattr(value, "shape", ()) != ():  # an array of another library: say which
                checks.require_array(xp, name, value)
            v = number(name, value, what)
            if unit_interval and not 0.0 <= v <= 1.0:
                raise ValueError(f"{name} must lie in [0, 1]; got {checks.plain(v)}")
            return xp.full((b,), v, like)
        if not (xp.is_int(value) or xp.is_float(value)):  # a bool too: 1 - t fails in torch
            raise TypeError(f"{name} must have an integer or floating dtype; got "
                            f"{checks.dtype_str(value)}")
        if tuple(value.shape) == ():
            return xp.broadcast_to(value, (b,))
        if tuple(value.shape) != (b,):
            raise ValueError(f"{name} must have shape [B] = {shape_str((b,))} or be a scalar; "
                             f"got {shape_str(value.shape)}")
        return value

    def _loo_delta(self, alpha, vocab_size, bl, like, name="alpha"):
        """delta = log1p(K·alpha / max(1 - alpha, EPS)) as [B, L] float32, from alpha of shape
        [B], [B, 1] or [B, L] (per-position signal retention: per-token diffusion times) or
        one number for every sequence; ``name`` is alpha's name in the errors."""
        xp = self.xp
        b, l = bl
        if not xp.is_array(alpha) or tuple(alpha.shape) == ():
            alpha = self._per_sequence(name, alpha, b, like, "a float or an array")
        alpha = xp.as_f32(alpha)
        if tuple(alpha.shape) == (b,):
            alpha = alpha[:, None]
        elif tuple(alpha.shape) not in ((b, 1), (b, l)):
            raise ValueError(f"{name} must have shape [B], [B, 1] or [B, L] with [B, L] = "
                             f"{shape_str(bl)}; got {shape_str(alpha.shape)}")
        delta = xp.log1p(vocab_size * alpha / xp.clamp_min(1.0 - alpha, EPS))
        return xp.broadcast_to(delta, bl)

    def _check_vocab_size(self, vocab_size, logits):
        """vocab_size: a positive int no larger than the logits' vocabulary (K, or K x shards
        inside ``vocab_parallel``). A smaller one marks the ids in [0, vocab_size) as valid and
        is the K of the LOO shift; every column still takes part in the softmax."""
        vocab_size = check_vocab_size(vocab_size)
        extent = self.front.vocab_extent(logits)
        if vocab_size > extent:
            raise ValueError(f"vocab_size must be <= the logits' vocabulary K = {extent} "
                             f"(logits.shape[-1]); got {vocab_size}")
        return vocab_size, extent

    def _schedule_value(self, name, value, shapes, layout):
        """What a schedule function returned: a number or an array of one of ``shapes``."""
        xp = self.xp
        if not xp.is_array(value):
            if getattr(value, "shape", ()) != ():
                checks.require_array(xp, name, value)
            number(name, value, f"an array of shape {layout} or a float")
        elif tuple(value.shape) not in shapes:
            raise ValueError(f"{name} must have shape {layout}; got {shape_str(value.shape)}")

    def reweight(self, variant, t, alpha, alpha_dot):
        """Time weight [B]: -alpha_dot / max(alpha, EPS) for reweighted variants, else 1."""
        xp = self.xp
        if normalize_variant(variant) in REWEIGHTED_VARIANTS:
            return -xp.as_f32(alpha_dot) / xp.clamp_min(xp.as_f32(alpha), EPS)
        return xp.as_f32(t) * 0.0 + 1.0

    def loo_to_denoiser_logits(self, logits, xt, alpha, vocab_size):
        """The public ``loo_to_denoiser_logits`` (documented in the front ends): the [B, L, K]
        float32 logits with delta added at column xt, NaN rows where xt is out of range."""
        xp = self.xp
        checks.require_rank(xp, "logits", as_logits(logits), 3, "[B, L, K]", logits=True)
        checks.require_float(xp, "logits", logits)
        logits = as_logits(logits).dense(xp)  # the output is the [B, L, K] array itself
        checks.require_array(xp, "xt", xt)
        checks.require_shape("xt", xt, logits.shape[:2], "logits.shape[:2] [B, L]")
        checks.require_int(xp, "xt", xt)
        vocab_size, _ = self._check_vocab_size(vocab_size, logits)
        delta = self._loo_delta(alpha, vocab_size, tuple(logits.shape[:2]), xt)
        checks.check_ids(xp, "xt", xt, vocab_size, error=checks.IdOutOfRangeError)
        cols = xp.arange(logits.shape[-1], logits)
        bump = xp.where(cols[None, None, :] == xt[:, :, None], delta[:, :, None], 0.0)
        bad = (xt < 0) | (xt >= vocab_size)  # [B, L]: never a silently unshifted row
        return xp.where(bad[:, :, None], float("nan"), xp.f32(logits) + bump)

    # -- Megatron-Bridge DiffusionGemma SFT ----------------------------------------------------

    def _sft_terms(self, logits, x0, xt, t, loss_mask, variant, vocab_size,
                   diffusion_weight_clip, alpha_fn, alpha_dot_fn, backend, ce):
        """(w [B], s·Σ_l M·CE [B], s·Σ_l M [B], s [B]) for one SFT batch, s each row's
        ``_weight_scale`` (``ce``: the CE term's options, a ``CeTerm``)."""
        xp = self.xp
        variant = normalize_variant(variant)
        clip = check_positive_float("diffusion_weight_clip", diffusion_weight_clip,
                                    allow_none=True)
        checks.require_rank(xp, "logits", as_logits(logits), 3, "[B, L, K]", logits=True)
        checks.require_float(xp, "logits", logits)
        vocab_size, extent = self._check_vocab_size(vocab_size, logits)
        bl = tuple(logits.shape[:2])
        for name, arr in (("x0", x0), ("xt", xt)):
            checks.require_array(xp, name, arr)
            checks.require_shape(name, arr, bl, "logits.shape[:2] [B, L]")
            checks.require_int(xp, name, arr)
        checks.require_array(xp, "loss_mask", loss_mask)
        checks.require_shape("loss_mask", loss_mask, bl, "logits.shape[:2] [B, L]")
        checks.require_real(xp, "loss_mask", loss_mask)
        t = self._per_sequence("t", t, bl[0], x0, "a float in [0, 1] or a [B] array",
                               unit_interval=True)
        loo = variant in LOO_VARIANTS
        # values, where they can be read without a device sync (see ``sync_checks``)
        mask_read = checks.check_nonnegative(xp, "loss_mask", loss_mask)
        checks.check_weight_sum(xp, "loss_mask", loss_mask, per_row=True)
        checks.check_unit_interval(xp, "t", t)
        # upstream's gather / one_hot raise RuntimeError here: ours is that and a ValueError
        checks.check_ids(xp, "x0", x0, vocab_size, where=loss_mask, at=" where loss_mask is set",
                         error=checks.IdOutOfRangeError)
        if loo:
            checks.check_ids(xp, "xt", xt, vocab_size, error=checks.IdOutOfRangeError)
        alpha = alpha_fn(t)
        if variant in REWEIGHTED_VARIANTS:  # w = -alpha'(t) / alpha(t): one per sequence
            alpha_dot = alpha_dot_fn(t)
            for name, value in (("alpha_fn(t)", alpha), ("alpha_dot_fn(t)", alpha_dot)):
                self._schedule_value(name, value, ((), bl[:1]), f"[B] = {shape_str(bl[:1])} "
                                     f"(like t; variant {variant!r} weights whole sequences)")
            w = self.reweight(variant, t, alpha, alpha_dot)
        else:
            w = self.reweight(variant, t, alpha, None)
        if tuple(w.shape) == ():  # numbers from both schedule functions: one w for all
            w = w + xp.full(bl[:1], 0.0, t)
        checks.require_shape("the time weight from alpha_fn(t) and alpha_dot_fn(t)", w, bl[:1], "[B]")
        if clip is not None:
            w = xp.clamp_max(w, clip)
        mask = xp.f32(loss_mask)
        t32 = xp.as_f32(t)
        # a t outside [0, 1] (NaN included) or a negative / non-finite mask: that sequence's
        # loss is NaN where the checks above could not read the values
        bad = ~((t32 >= 0.0) & (t32 <= 1.0)) | ~xp.isfinite(xp.rowsum(mask))
        if not mask_read:
            bad = bad | xp.any_last(guards.invalid_weights(xp, mask))
        w = guards.nan_where(xp, bad, w)
        if vocab_size < extent:  # ids in [vocab_size, K) are out of range too: NaN, not silent
            x0 = xp.where(x0 < vocab_size, x0, -1)
            xt = xp.where(xt < vocab_size, xt, -1) if loo else xt
        shift_ids = shift = None
        if loo:
            shift_ids, shift = xt, self._loo_delta(alpha, vocab_size, bl, t, "alpha_fn(t)")
        stats, _ = self.front.token_stats_total(logits, x0, mask, None, shift_ids=shift_ids,
                                                shift=shift, entropy=False, ce=ce,
                                                backend=backend)
        scale = _weight_scale(xp, mask)[:, None]  # [B, 1]
        ce_sum = -xp.rowsum((mask * scale) * stats.logp)
        return w, ce_sum, xp.rowsum(mask * scale), scale[:, 0]

    def diffusion_sft_loss(self, logits, x0, xt, t, loss_mask, *, variant, vocab_size,
                           diffusion_weight_clip=None, alpha_fn=rf_alpha,
                           alpha_dot_fn=rf_alpha_dot, ce: CeTerm = PLAIN_CE, backend=None):
        """The public ``diffusion_sft_loss`` (documented in the front ends): w_b times the
        masked mean of the row CEs, both sums taken times the row's weight scale
        (``_weight_scale``) so that w·Σ M·CE never overflows where the mean is finite."""
        w, ce_sum, count, scale = self._sft_terms(
            logits, x0, xt, t, loss_mask, variant, vocab_size, diffusion_weight_clip,
            alpha_fn, alpha_dot_fn, backend, ce)
        # Σ M·CE / max(Σ M, 1), both sums times the row's scale; no w·Σ M·CE overflow
        return w * (ce_sum / self.xp.maximum(count, scale))

    def diffusion_sft_logps(self, logits, x0, xt, t, loss_mask, *, variant, vocab_size,
                            diffusion_weight_clip=None, alpha_fn=rf_alpha,
                            alpha_dot_fn=rf_alpha_dot, ce: CeTerm = PLAIN_CE, backend=None):
        """Sequence log-probs -w_b · Σ_l M_bl·CE_bl, [B] float32 (arguments as the loss,
        ``ce`` included)."""
        w, ce_sum, _, scale = self._sft_terms(
            logits, x0, xt, t, loss_mask, variant, vocab_size, diffusion_weight_clip,
            alpha_fn, alpha_dot_fn, backend, ce)
        return -w * (ce_sum / scale)  # a sum: beyond float32's range, ±inf

    # -- Tunix batch contract --------------------------------------------------------------

    def validate_diffusion_logits(self, batch, logits, name="logits"):
        """Check logits [B, L, K] against a DiffusionTokenBatch and return ``logits``: rank,
        [B, L] alignment, a floating dtype and K >= 1 always; active targets in [0, K) when
        the arrays are concrete host arrays (no device sync, except inside ``sync_checks()``:
        elsewhere an out-of-range active target shows as a NaN log-prob)."""
        self._weights_read(batch, logits, name)
        return logits

    def _weights_read(self, batch, logits, name="logits") -> bool:
        """``validate_diffusion_logits``'s checks; whether they read the weights' values."""
        checks.require_instance("batch", batch, self.DiffusionTokenBatch)
        checks.check_logits_for_batch(self.xp, name, as_logits(logits), batch.target_ids.shape)
        return checks.check_token_batch_values(self.xp, batch.target_ids, batch.loss_weights,
                                               self.front.vocab_extent(logits),
                                               allow_sync=False)

    def per_token_logps(self, logits, batch, *, temperature=1.0, stop_gradient=True,
                        return_entropy=False, backend=None):
        """Target log-probs [B, L] at ``temperature`` (and the entropy [B, L] when
        ``return_entropy``); exactly 0 at inactive positions; detached when ``stop_gradient``.
        The entropy's sums are taken whether it is returned or not, as the denoising step and
        ``policy_loss`` take them: XLA sums a tile's Σ e^x in another order when the
        entropy's Σ e^x·x is reduced beside it, and a row's log-prob came out an ulp apart
        with and without ``return_entropy`` (JAX chunked, bfloat16)."""
        temperature = check_positive_float("temperature", temperature)
        stop_gradient = flag("stop_gradient", stop_gradient)
        return_entropy = flag("return_entropy", return_entropy)
        read = self._weights_read(batch, logits)
        stats, _ = self.front.token_stats_total(logits, batch.target_ids, batch.loss_weights,
                                                None, temperature=temperature, entropy=True,
                                                backend=backend)
        logps, entropy = stats.logp, stats.entropy if return_entropy else None
        if not read:  # weights the checks could not read: NaN where one is bad
            bad = guards.invalid_weights(self.xp, self.xp.f32(batch.loss_weights))
            logps = guards.nan_where(self.xp, bad, logps)
            entropy = None if entropy is None else guards.nan_where(self.xp, bad, entropy)
        if stop_gradient:
            logps = self.xp.stop_gradient(logps)
            entropy = None if entropy is None else self.xp.stop_gradient(entropy)
        if not return_entropy:
            return logps
        assert entropy is not None  # read above wherever it is returned
        return logps, entropy

    def compute_diffusion_logits(self, model, batch, logits_fn):
        """Tunix's entry point: ``batch.validate()``, then ``logits_fn(model,
        batch.model_inputs)``, checked by ``validate_diffusion_logits`` and returned."""
        checks.require_instance("batch", batch, self.DiffusionTokenBatch)
        batch.validate()
        logits = logits_fn(model, batch.model_inputs)
        return self.validate_diffusion_logits(batch, logits)

    def compute_diffusion_per_token_logps(self, model, batch, logits_fn, *, temperature=1.0,
                                          stop_gradient=True, return_entropy=False,
                                          backend=None):
        """``per_token_logps(logits_fn(model, batch.model_inputs), batch, ...)``."""
        check_positive_float("temperature", temperature)  # checked before the model runs
        flag("stop_gradient", stop_gradient)
        flag("return_entropy", return_entropy)
        checks.require_instance("batch", batch, self.DiffusionTokenBatch)
        logits = logits_fn(model, batch.model_inputs)
        return self.per_token_logps(logits, batch, temperature=temperature,
                                    stop_gradient=stop_gradient,
                                    return_entropy=return_entropy, backend=backend)

    def weighted_cross_entropy(self, logits, batch, *, ce: CeTerm = PLAIN_CE, backend=None):
        """The public ``weighted_cross_entropy`` (documented in the front ends):
        WeightedSum(Σ w·CE, Σ w), both times 2^-64 when a weight reaches 2^64 (``BIG_WEIGHT``);
        one planned scalar, so a linear head forms its gradient in the forward."""
        read = self._weights_read(batch, logits)
        xp = self.xp
        w = xp.f32(batch.loss_weights)
        ws = w * _weight_scale(xp, w.reshape(-1))  # [B, L]
        # one scalar: Σ (-w)·logp, so a linear head forms its gradient in the forward
        _, total = self.front.token_stats_total(logits, batch.target_ids, batch.loss_weights,
                                                TokenStats(lse=None, logp=-ws, entropy=None,
                                                           kl=None), entropy=False, ce=ce,
                                                backend=backend)
        total = guards.nan_where(xp, guards.bad_weighted_sum(xp, w, read), total)
        return self.WeightedSum(total, guards.total(xp, ws))

    def opd_loss(self, student_logits, batch, *, temperature=1.0, soft_loss_weight=1.0,
                 hard_loss_weight=0.0, ce: CeTerm = PLAIN_CE, backend=None):
        """The public ``opd_loss`` (documented in the front ends): one pass over the student
        logits serves the soft (T²·KL) and hard (CE at T = 1, with ``ce``) terms; the total is
        one planned scalar Σ c·stats."""
        xp = self.xp
        temperature, soft_w, hard_w = check_distillation_scalars(
            temperature, soft_loss_weight, hard_loss_weight)
        checks.require_instance("batch", batch, self.DiffusionDistillationBatch)
        student = batch.student_batch
        checks.check_logits_for_batch(xp, "student_logits", as_logits(student_logits),
                                      student.target_ids.shape)
        teacher = None
        if soft_w > 0.0:
            teacher = batch.teacher_logits
            if tuple(teacher.shape) != tuple(student_logits.shape):
                raise ValueError(
                    f"student and teacher logits must have identical shapes; got "
                    f"student_logits {shape_str(student_logits.shape)} and teacher_logits "
                    f"{shape_str(teacher.shape)}")
            checks.check_teacher_values(xp, as_logits(teacher), student.loss_weights)
        vocab = self.front.vocab_extent(student_logits) if hard_w > 0.0 else None
        read = checks.check_token_batch_values(xp, student.target_ids, student.loss_weights,
                                               vocab, allow_sync=False)
        # the hard term's T = 1 sums ride along in the same pass only when that term is on
        w_given = xp.f32(student.loss_weights)
        w = w_given * _weight_scale(xp, w_given.reshape(-1))  # [B, L] (``BIG_WEIGHT``)
        t2 = temperature * temperature
        # the total is one scalar Σ c·stats (c: the weights times each term's factor), so a
        # linear head forms its gradient in the forward; the aux terms stay differentiable
        coefficients = TokenStats(lse=None, logp=-hard_w * w if hard_w > 0.0 else None,
                                  entropy=None, kl=soft_w * t2 * w if soft_w > 0.0 else None)
        stats, total = self.front.token_stats_total(
            student_logits, student.target_ids, student.loss_weights, coefficients,
            temperature=temperature, ce_temperature=1.0 if hard_w > 0.0 else None,
            teacher_logits=teacher, entropy=False, ce=ce if hard_w > 0.0 else PLAIN_CE,
            backend=backend)
        denominator = guards.total(xp, w)
        zero = denominator * 0.0
        soft = guards.total(xp, w * stats.kl) * t2 if soft_w > 0.0 else zero
        hard = -guards.total(xp, w * stats.logp) if hard_w > 0.0 else zero
        # what the checks could not read: NaN
        bad = guards.bad_weighted_sum(xp, w_given, read)
        total, soft, hard = (guards.nan_where(xp, bad, v) for v in (total, soft, hard))
        aux = {
            "distill/soft_loss": self.WeightedSum(soft, denominator),
            "distill/hard_loss": self.WeightedSum(hard, denominator),
        }
        return self.WeightedSum(total, denominator), aux

    def policy_loss(self, logits, batch, *, old_logps, advantages, loss_type, epsilon=0.2,
                    epsilon_high=None, delta=None, beta=0.0, ref_logps=None,
                    use_bias_correction_kl=False, importance_sampling_level="token",
                    temperature=1.0, max_completion_length=None, num_items_in_batch=None,
                    inplace_grad=False, backend=None):
        """TRL GRPOTrainer's policy losses (the public ``policy_loss``): one token-statistics
        call for logp and the entropy at the temperature, the rest ``_policy``'s [B, L] math."""
        opts = _policy.check_policy_options(
            loss_type=loss_type, epsilon=epsilon, epsilon_high=epsilon_high, delta=delta,
            beta=beta, use_bias_correction_kl=use_bias_correction_kl,
            importance_sampling_level=importance_sampling_level, temperature=temperature,
            max_completion_length=max_completion_length)
        read = self._weights_read(batch, logits)
        inputs = _policy.policy_inputs(self.xp, opts, batch, old_logps, advantages, ref_logps,
                                       num_items_in_batch)
        stats, _ = self.front.token_stats_total(logits, batch.target_ids, batch.loss_weights,
                                                None, temperature=opts.temperature,
                                                entropy=True, inplace_grad=inplace_grad,
                                                backend=backend)
        terms = _policy.policy_terms(self.xp, opts, stats.logp, stats.entropy,
                                     self.xp.f32(batch.loss_weights), read, *inputs)
        return self.PolicyLossResult(**terms)

    def merge_diffusion_batches(self, batches):
        """Concatenate batches on the batch axis, every leaf of every field (model_inputs is a
        pytree). All must have one type, the same tree structure and the same trailing shapes
        and dtypes; everything is checked before anything is built. Host NumPy leaves stay
        NumPy, device arrays stay on their devices."""
        batches = list(batches)
        if not batches:
            raise ValueError("batches must be a non-empty sequence of batches; got an empty one")
        given = [b is not None for b in batches]  # Tunix's rollouts may omit their batch
        if not all(given):
            if not any(given):
                raise ValueError("batches must be a non-empty sequence of batches; got only "
                                 "None (every rollout omits its diffusion batch: nothing to "
                                 "merge)")
            i, j = given.index(True), given.index(False)
            raise ValueError(
                f"batches must either all provide diffusion_batch or all omit it; got a "
                f"{type(batches[i]).__name__} at batches[{i}] and None at batches[{j}]")
        kind = type(batches[0])
        kinds = (self.DiffusionTokenBatch, self.DiffusionDistillationBatch)
        if kind not in kinds:
            for cls in kinds:  # a batch of the other front end: say so
                if kind.__name__ == cls.__name__:
                    checks.require_instance("batches[0]", batches[0], cls)
            raise TypeError(
                f"batches[0] must be a DiffusionTokenBatch or DiffusionDistillationBatch; "
                f"got {kind.__name__}")
        for i, b in enumerate(batches):
            if type(b) is not kind:
                if type(b).__name__ == kind.__name__:
                    checks.require_instance(f"batches[{i}]", b, kind)
                raise TypeError(
                    f"batches[{i}] is a {type(b).__name__}, but batches[0] is a "
                    f"{kind.__name__}: all batches must have the same structure")
        if kind is self.DiffusionDistillationBatch:
            for i, b in enumerate(batches):
                as_logits(b.teacher_logits).check_mergeable(f"batches[{i}].teacher_logits")
            students = [b.student_batch for b in batches]
            fields = {"teacher_logits": [b.teacher_logits for b in batches]}
            plan = {f: self._merge_plan(f, trees) for f, trees in fields.items()}
            student = self.merge_diffusion_batches(students)  # checks its fields first
            return kind.create(student_batch=student, **self._merge_apply(plan))
        fields = {f: [getattr(b, f) for b in batches]
                  for f in ("model_inputs", "target_ids", "loss_weights")}
        plan = {f: self._merge_plan(f, trees) for f, trees in fields.items()}
        return kind.create(**self._merge_apply(plan))

    def _merge_plan(self, field, trees):
        """(treedef, [leaves of batch i]) after checking that every batch's ``field`` has the
        structure, trailing shapes and dtypes of batches[0]'s."""
        xp = self.xp
        flat = [xp.tree_flatten(tree) for tree in trees]
        treedef = flat[0][1]
        for i, (_, other) in enumerate(flat):
            if other != treedef:
                raise ValueError(f"batches[{i}].{field} must have the same pytree structure "
                                 f"as batches[0].{field}; got {other} and {treedef}")
        paths = xp.leaf_paths(trees[0])  # one per leaf of flat[i][0] (torch: None too)
        for j, path in enumerate(paths):
            column = [leaves[j] for leaves, _ in flat]
            present = [leaf is not None for leaf in column]
            if all(present):
                _same_trailing(field + path, column)
            elif any(present):  # torch's pytrees hold None as a leaf: None in some only
                i = present.index(not present[0])
                got = lambda leaf: ("None" if leaf is None else
                                    f"an array of shape {shape_str(leaf.shape)}")
                raise ValueError(
                    f"batches[{i}].{field}{path} is {got(column[i])}, but "
                    f"batches[0].{field}{path} is {got(column[0])}: a leaf must be None in "
                    f"every batch or in none")
        return treedef, [leaves for leaves, _ in flat]

    def _merge_apply(self, plan):
        xp = self.xp
        merged = {}
        for field, (treedef, per_batch) in plan.items():
            columns = zip(*per_batch)  # leaf j of every batch
            merged[field] = xp.tree_unflatten(treedef, [xp.concat_leaves(c) for c in columns])
        return merged


def _same_trailing(name, arrays):
    first = arrays[0]
    for i, a in enumerate(arrays):
        if tuple(a.shape[1:]) != tuple(first.shape[1:]) or a.dtype != first.dtype:
            raise ValueError(
                f"batches[{i}].{name} has shape {shape_str(a.shape)} and dtype "
                f"{checks.dtype_str(a)}; batches[0].{name} has {shape_str(first.shape)} and "
                f"{checks.dtype_str(first)}: "
                f"only the batch axis may differ")
