"""transformers' DiffusionGemma (``DiffusionGemmaForBlockDiffusion``) on dlm-kernels.

transformers' forward returns the capped logits ``c·tanh(lm_head(h) / c)`` (float32, c =
``final_logit_softcapping``, 30) of every canvas position and no loss; its denoising step
softmaxes them, draws with ``torch.multinomial``, takes the argmax and the entropies
(``torch.distributions.Categorical``) as separate [B, L, V] passes. The patch replaces:

- the forward (``fused_linear_loss``): it takes ``labels`` (the clean canvas x0, [B, L];
  -100 = unsupervised; no shift: position l predicts ``labels[:, l]``) and returns ``loss``,
  the token-mean cross-entropy of the capped logits, computed from the final hidden states and
  the tied head in vocabulary chunks (``LinearHead``): the [B, L, V] logits are never formed
  when ``skip_logits`` (default: in training, when labels are given), and ``logits`` is None.
  ``variant`` / ``diffusion_t`` / ``loss_mask`` give the Megatron-Bridge SFT variants
  (``diffusion_sft_loss``), ``encoder_labels`` the encoder's next-token loss.
- the denoising step's draw, argmax and entropy-bound acceptance (``fused_sampling``): one
  ``sample_tokens`` pass over the processed logits, and ``commit_tokens(rule=
  "entropy_budget", exclusive=True)``, the sampler's own acceptance rule.
- the self-conditioning carry (``fused_self_conditioning``): the step hands the next one the
  decoder's signal softmax(logits)·E·sqrt(D) [B, L, D] (``soft_embedding``, streamed over the
  vocabulary) instead of the [B, L, V] logits, and the decoder takes it precomputed. Where
  nothing else reads the logits (no adaptive stopping; the logits processors none or
  transformers' temperature schedule alone, its default), the step reads the decoder's
  final hidden states through the capped tied head instead (``LinearHead``): no [B, L, V]
  buffer at all.

Everything the patched forward and decoder need arrives as an argument (the signal as
``self_conditioning_embeddings``, the request for the hidden states as
``return_last_hidden_state``), so ``generate``'s ``torch.compile`` of the forward (a static
cache: ``mode="reduce-overhead", fullgraph=True``) traces them whole; the sampling runs eagerly
in the step, between the compiled forward and transformers' compiled renoising.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import types
from typing import Any

import torch

from ... import torch as dk
from ..self_conditioning import soft_embedding
from .tied_table import TableGradTape, relay_table, tied_lookup

IGNORE_INDEX = -100
"""The label of an unsupervised position (transformers' and torch's ``ignore_index``)."""

HEAD_ROW_CHUNK: int | None = None
"""Rows (canvas positions) per token chunk of the fused head's logits, [R, V] at a time; None:
the package's default (``LinearHead``'s ``row_chunk``)."""

SIGNAL_CHUNK: int | None = None
"""Vocabulary columns per chunk of the self-conditioning signal's online softmax
(``soft_embedding``'s ``chunk_size``); None: its default."""

_ORIGINAL = "_dlm_kernels_original_"  # prefix of the attributes keeping the replaced methods


def _capped_head(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                 cap: float | None) -> tuple[dk.LinearHead, Any]:
    """(logits, objectives): the logits ``cap(hidden @ weight.T + bias)`` as a LinearHead with
    the model's softcap (never formed whole), and the objectives to read them with
    (``dlm_kernels.torch``'s ``weighted_cross_entropy`` and ``diffusion_sft_loss``)."""
    return dk.LinearHead(hidden, weight, bias, softcap=cap, row_chunk=HEAD_ROW_CHUNK), dk


@dataclasses.dataclass(frozen=True)
class _TokenMean:
    """One token-mean cross-entropy term: Σ w·CE / Σ w over the rows of ``hidden`` [B, n, D]
    whose label is not IGNORE_INDEX (w = 1, or ``weights`` [B, n]), or Σ w·CE /
    ``denominator`` when given; 0 (and a zero gradient) where nothing is supervised."""

    hidden: torch.Tensor
    labels: torch.Tensor
    weights: torch.Tensor | None = None
    denominator: torch.Tensor | int | float | None = None


def _token_means(self: Any, weight: torch.Tensor, terms: list[_TokenMean]) -> torch.Tensor:
    """The sum of the terms, their rows read through one capped head: one
    ``weighted_cross_entropy`` over all of them (so the table's gradient is formed once),
    each row weighted w · f / F, f = 1 / its term's denominator, F the largest f (so the
    weights are the caller's own for that term, whatever the denominators' scale), and the
    weighted mean scaled back by Σ (w · f / F) · F."""
    rows = torch.cat([t.hidden.reshape(-1, t.hidden.shape[-1]) for t in terms])  # [N, D]
    head, objectives = _capped_head(rows[None], weight, self.lm_head.bias,
                                    self.final_logit_softcapping)
    targets, weights, factors, bad = [], [], [], []
    for t in terms:
        labels = t.labels.reshape(-1)
        active = labels != IGNORE_INDEX
        targets.append(torch.where(active, labels, 0))
        w = active.to(torch.float32) if t.weights is None else torch.where(
            active, t.weights.reshape(-1).to(torch.float32), 0.0)
        den = w.sum() if t.denominator is None else torch.as_tensor(
            t.denominator, dtype=torch.float32, device=w.device)
        # 1 / den by the contract: 0 for a 0 denominator, NaN for a NaN or negative one (and
        # for one whose reciprocal overflows float32), which makes the loss and every
        # gradient NaN below; the weights stay finite
        inv = dk.WeightedSum(torch.ones_like(den), den).compute()
        weights.append(w)
        factors.append(torch.where(torch.isfinite(inv), inv, 1.0))
        bad.append(inv * 0.0)  # NaN where inv is not finite, else 0
    top = torch.stack(factors).max()
    top = torch.where(top > 0, top, 1.0)  # every factor 0: nothing to normalise
    v = torch.cat([w * (f / top) for w, f in zip(weights, factors)])  # [N]
    y = torch.cat(targets)[None]  # [1, N]
    batch = dk.DiffusionTokenBatch(model_inputs=y, target_ids=y, loss_weights=v[None])
    # Σ v·CE · F: the mean over the weights v (exactly 0 where all are 0) times their sum
    mean = objectives.weighted_cross_entropy(head, batch).compute()
    return mean * v.sum() * top * (1.0 + torch.stack(bad).sum())


def _check_labels(name: str, labels: torch.Tensor, shape: tuple[int, ...]) -> None:
    if not isinstance(labels, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor; got {type(labels).__name__}")
    if labels.dtype.is_floating_point or labels.dtype == torch.bool:
        raise TypeError(f"{name} must hold integer token ids; got {labels.dtype}")
    if tuple(labels.shape) != shape:
        raise ValueError(f"{name} must have shape {list(shape)} (the hidden states' [B, L]); "
                         f"got {list(labels.shape)}")


def _canvas_loss(self: Any, weight: torch.Tensor, hidden: torch.Tensor, labels: torch.Tensor,
                 decoder_input_ids: torch.Tensor | None, num_items_in_batch: Any,
                 variant: str | None, diffusion_t: Any, loss_mask: torch.Tensor | None,
                 diffusion_weight_clip: float | None) -> _TokenMean | torch.Tensor:
    """The canvas loss from the decoder's final hidden states (see ``_forward``): its
    token-mean term (variant None; read with the encoder's through one head), or the SFT
    variant's batch mean through the head's ``weight``."""
    _check_labels("labels", labels, tuple(hidden.shape[:2]))
    if variant is None:
        if diffusion_t is not None:
            raise ValueError("diffusion_t is given but variant is None: name the SFT variant "
                             f"(one of {dk.VARIANTS})")
        return _TokenMean(hidden, labels, loss_mask, num_items_in_batch)
    if diffusion_t is None:
        raise ValueError(f"variant={variant!r} needs diffusion_t (the diffusion time t, [B] "
                         "or one number in [0, 1])")
    if num_items_in_batch is not None:
        raise ValueError("num_items_in_batch applies to the token-mean loss (variant=None); "
                         "the SFT variants normalise each sequence by its own loss mask")
    if decoder_input_ids is None:
        raise ValueError(f"variant={variant!r} needs decoder_input_ids (the noisy canvas xt)")
    head, objectives = _capped_head(hidden, weight, self.lm_head.bias,
                                    self.final_logit_softcapping)
    active = labels != IGNORE_INDEX
    mask = active.to(torch.float32) if loss_mask is None else torch.where(
        active, loss_mask.to(torch.float32), 0.0)
    per_sequence = objectives.diffusion_sft_loss(
        head, torch.where(active, labels, 0), decoder_input_ids, diffusion_t, mask,
        variant=variant, vocab_size=self.config.text_config.vocab_size,
        diffusion_weight_clip=diffusion_weight_clip)
    return per_sequence.mean()


def _encoder_term(hidden: torch.Tensor | None, encoder_labels: torch.Tensor) -> _TokenMean:
    """Next-token CE of the encoder: position s predicts ``encoder_labels[:, s + 1]``, the
    token mean over the supervised ones (read through the same capped tied head)."""
    if hidden is None:
        raise ValueError("encoder_labels needs the encoder's hidden states: pass input_ids "
                         "(the prompt), not only past_key_values")
    _check_labels("encoder_labels", encoder_labels, tuple(hidden.shape[:2]))
    return _TokenMean(hidden[:, :-1], encoder_labels[:, 1:])


def _token_embeddings(model: Any) -> tuple[Any, Any]:
    """The model's token embeddings: the encoder's and the decoder's."""
    return model.model.encoder.language_model.embed_tokens, model.model.decoder.embed_tokens


def _tied_lookups(self: Any, wants_loss: bool) -> list[Any]:
    """The token embeddings whose gradients this forward's head takes as rows
    (``tied_table``): in an eager training forward with a loss, the encoder's and the
    decoder's lookups of the head's own table (tied, one Parameter), where every one is a
    plain lookup (no ``max_norm``, no frequency scaling, no sparse gradients); else none."""
    weight = self.lm_head.weight
    if not (wants_loss and torch.is_grad_enabled() and weight.requires_grad) or \
            torch.compiler.is_compiling():
        return []
    tied = [e for e in _token_embeddings(self) if e.weight is weight]
    # all or none: a lookup with max_norm renormalises rows of the table in place, which the
    # relay (a view of it made before) may not outlive
    plain = all(e.max_norm is None and not e.scale_grad_by_freq and not e.sparse for e in tied)
    return tied if plain else []


def _embedding_forward(self: Any, input_ids: torch.Tensor) -> torch.Tensor:
    """transformers' scaled token embedding, E[ids]·scale; while a patched training forward
    runs (``_dlm_kernels_lookup``: its tape and the head's relay), the lookup's gradient for
    E goes to the head's dW as rows (``tied_lookup``)."""
    route = self._dlm_kernels_lookup
    if route is None:
        return getattr(type(self), _ORIGINAL + "forward")(self, input_ids)
    rows = tied_lookup(input_ids, self.weight, self.padding_idx, *route)
    return rows * self.embed_scale.to(self.weight.dtype)


def _forward(
    self: Any,
    input_ids: torch.LongTensor | None = None,
    attention_mask: torch.Tensor | dict | None = None,
    past_key_values: Any = None,
    position_ids: torch.LongTensor | None = None,
    decoder_input_ids: torch.LongTensor | None = None,
    self_conditioning_logits: torch.Tensor | None = None,
    self_conditioning_mask: torch.BoolTensor | None = None,
    decoder_attention_mask: torch.Tensor | dict | None = None,
    decoder_position_ids: torch.LongTensor | None = None,
    mm_encoder_outputs: dict | None = None,
    labels: torch.LongTensor | None = None,
    encoder_labels: torch.LongTensor | None = None,
    skip_logits: bool | None = None,
    num_items_in_batch: torch.Tensor | int | None = None,
    variant: str | None = None,
    diffusion_t: torch.Tensor | float | None = None,
    loss_mask: torch.Tensor | None = None,
    diffusion_weight_clip: float | None = None,
    return_last_hidden_state: bool = False,
    return_dict: bool | None = None,
    **kwargs: Any,
) -> Any:
    """transformers' DiffusionGemmaForBlockDiffusion.forward with a fused loss.

    Beyond transformers' arguments:
      labels: [B, L] the clean canvas x0 for the decoder's canvas ([B, L] of
        decoder_input_ids); IGNORE_INDEX (-100) marks an unsupervised position. No shift.
        ``loss`` is the token mean of the cross-entropy of the capped float32 logits over the
        supervised positions (weighted by ``loss_mask`` when given), or with ``variant``
        the batch mean of ``diffusion_sft_loss`` (Megatron-Bridge's SFT variants, x0 =
        labels, xt = decoder_input_ids, t = diffusion_t, loss_mask: the positions with a
        label, times ``loss_mask`` when given).
      encoder_labels: [B, S] for the prompt (``input_ids``): adds the encoder's next-token
        cross-entropy (token mean, position s predicts encoder_labels[:, s + 1], -100
        unsupervised) to ``loss``, through the same capped tied head.
      skip_logits: leave ``logits`` None (never form them). Default: in training mode when
        labels or encoder_labels are given; True without either is a ValueError.
      num_items_in_batch: the token-mean loss's denominator instead of this batch's count of
        supervised canvas positions (transformers' Trainer passes it under gradient
        accumulation); it normalises the canvas term only. 0 gives 0 (and zero gradients);
        a NaN or negative one, or one below about 3e-39 (its reciprocal overflows float32),
        a NaN loss and NaN gradients.
      return_last_hidden_state: the output also holds the decoder's final hidden states
        [B, L, D] as ``last_hidden_state`` (what the head reads; the denoising step's head path
        takes them); skip_logits then defaults to True.
      self_conditioning_embeddings (with fused_self_conditioning): the decoder's
        self-conditioning signal [B, L, D] precomputed, in place of self_conditioning_logits.
    A batch with no supervised position has loss 0 and a zero gradient.
    """
    config = self.config
    return_dict = return_dict if return_dict is not None else getattr(config, "return_dict", True)
    wants_loss = labels is not None or encoder_labels is not None
    if skip_logits is None:
        skip_logits = (self.training and wants_loss) or return_last_hidden_state
    if skip_logits and not wants_loss and not return_last_hidden_state:
        raise ValueError("skip_logits=True needs labels or encoder_labels: without a loss "
                         "nothing would be returned")
    weight, lookups = self.lm_head.weight, _tied_lookups(self, wants_loss)
    if lookups:  # the lookups' gradients go to the head's dW as rows, not [V, D] tables
        tape = TableGradTape()
        weight = relay_table(weight, tape)  # made first: autograd reaches it after them
        for lookup in lookups:
            lookup._dlm_kernels_lookup = (tape, weight)
    try:
        model_outputs = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            past_key_values=past_key_values,
            position_ids=position_ids,
            decoder_input_ids=decoder_input_ids,
            self_conditioning_logits=self_conditioning_logits,
            self_conditioning_mask=self_conditioning_mask,
            decoder_attention_mask=decoder_attention_mask,
            decoder_position_ids=decoder_position_ids,
            mm_encoder_outputs=mm_encoder_outputs,
            **kwargs,
        )
    finally:
        for lookup in lookups:
            lookup._dlm_kernels_lookup = None
    hidden = model_outputs.last_hidden_state
    loss, terms = None, []
    if labels is not None:
        canvas = _canvas_loss(self, weight, hidden, labels, decoder_input_ids,
                              num_items_in_batch, variant, diffusion_t, loss_mask,
                              diffusion_weight_clip)
        if isinstance(canvas, _TokenMean):
            terms.append(canvas)
        else:
            loss = canvas
    elif any(v is not None for v in (variant, diffusion_t, loss_mask, num_items_in_batch)):
        raise ValueError("variant, diffusion_t, loss_mask and num_items_in_batch shape the "
                         "canvas loss: they need labels")
    if encoder_labels is not None:
        terms.append(_encoder_term(model_outputs.encoder_last_hidden_state, encoder_labels))
    if terms:  # the token means: one pass over the head
        means = _token_means(self, weight, terms)
        loss = means if loss is None else loss + means
    logits = None
    if not skip_logits:  # transformers' own logits, as its forward forms them
        logits = self.lm_head(hidden).to(torch.float32)
        cap = self.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
    output_class = type(self)._dlm_kernels_output_class
    fields = set(output_class.__dataclass_fields__)
    # everything the model returns that the output has a field for (hidden states,
    # attentions, the cache, the encoder's last hidden state, router outputs where recorded)
    passed = {k: v for k, v in model_outputs.items()
              if k in fields and k not in ("loss", "logits", "last_hidden_state")}
    if return_last_hidden_state:
        out = type(self)._dlm_kernels_hidden_output_class(
            loss=loss, logits=logits, last_hidden_state=hidden, **passed)
    else:
        out = output_class(loss=loss, logits=logits, **passed)
    return out if return_dict else out.to_tuple()


@functools.cache
def _with_last_hidden_state(output_class: type) -> type:
    """transformers' output class with a ``last_hidden_state`` field (the decoder's final
    hidden states), for ``return_last_hidden_state=True``."""

    @dataclasses.dataclass
    class OutputWithLastHiddenState(output_class):
        last_hidden_state: torch.Tensor | None = None

    return OutputWithLastHiddenState


def _denoising_step(self: Any, decoder_forward: Any, current_canvas: torch.Tensor,
                    argmax_canvas: torch.Tensor, input_ids: torch.LongTensor,
                    decoder_position_ids: torch.LongTensor,
                    self_conditioning_logits: torch.Tensor | None, mask_mapping: Any,
                    past_key_values: Any, finished_denoising: torch.Tensor, cur_step: int,
                    sampler: Any, logits_processor: Any, diffusion_stopping_criteria: Any,
                    **model_kwargs: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                  torch.Tensor]:
    """transformers' denoising step with one ``sample_tokens`` pass for the draw, the argmax
    and the entropies, and ``commit_tokens(rule="entropy_budget", exclusive=True)`` for the
    entropy-bound acceptance. The draw keys our counter-based noise on a seed taken from
    torch's global generator (so ``torch.manual_seed`` repeats a generation) and the step:
    equal to transformers' ``torch.multinomial`` draw in distribution, not in bits. A sampler
    other than transformers' EntropyBoundSampler runs transformers' own step."""
    modeling = type(self)._dlm_kernels_generation_module
    if type(sampler) is not modeling.EntropyBoundSampler:
        if getattr(self, "_dlm_kernels_fused_self_conditioning", False):
            raise NotImplementedError(
                f"fused_self_conditioning=True runs with transformers' EntropyBoundSampler "
                f"only; got a {type(sampler).__name__}: patch with "
                f"fused_self_conditioning=False")
        return getattr(type(self), _ORIGINAL + "_denoising_step")(
            self, decoder_forward=decoder_forward, current_canvas=current_canvas,
            argmax_canvas=argmax_canvas, input_ids=input_ids,
            decoder_position_ids=decoder_position_ids,
            self_conditioning_logits=self_conditioning_logits, mask_mapping=mask_mapping,
            past_key_values=past_key_values, finished_denoising=finished_denoising,
            cur_step=cur_step, sampler=sampler, logits_processor=logits_processor,
            diffusion_stopping_criteria=diffusion_stopping_criteria, **model_kwargs)
    step = int(cur_step)
    cur_step_t = torch.tensor(step, device=current_canvas.device, dtype=torch.int32)
    torch.compiler.cudagraph_mark_step_begin()  # as transformers' step (its compiled sampler)
    fused_sc = bool(getattr(self, "_dlm_kernels_fused_self_conditioning", False))
    carry = self_conditioning_logits  # logits [B, L, V], or (fused) soft embeddings [B, L, D]
    sc_kwargs: dict[str, Any] = {"self_conditioning_logits": carry}
    # decoder_forward: self.forward, or (a static cache) generate's torch.compile of it, which
    # traces the patched forward and decoder whole (everything reaches them as arguments)
    if fused_sc and carry is not None:
        if carry.shape[-1] == self.config.text_config.vocab_size:  # logits given to generate
            carry = _soft_signal(self, carry)
        sc_kwargs = {"self_conditioning_logits": None, "self_conditioning_embeddings": carry}
    decoder_kwargs = dict(decoder_input_ids=current_canvas, decoder_attention_mask=mask_mapping,
                          past_key_values=past_key_values,
                          decoder_position_ids=decoder_position_ids, **sc_kwargs, **model_kwargs)
    temperature = _scheduled_temperature(modeling, logits_processor, cur_step_t)
    # the head path reads the final hidden states, which the patched forward returns on request
    reads_hidden = getattr(inspect.unwrap(self.forward), "__func__", None) is _forward
    if fused_sc and diffusion_stopping_criteria is None and temperature is not None \
            and reads_hidden:
        return _head_step(self, decoder_forward, decoder_kwargs, current_canvas, temperature,
                          step, sampler, cur_step_t, finished_denoising)
    decoder_outputs = decoder_forward(**decoder_kwargs)
    processed_logits = logits_processor(input_ids, decoder_outputs.logits, cur_step=cur_step_t)
    sample, new_current_canvas = _draw_and_accept(processed_logits, 1.0, step, current_canvas,
                                                  sampler, cur_step_t)
    new_argmax_canvas = sample.argmax.to(current_canvas.dtype)
    embeddings_dtype = self.model.decoder.embed_tokens.weight.dtype
    # the next step's self-conditioning input: transformers' bf16 logits, or (fused) their
    # soft embeddings, [B, L, D] instead of [B, L, V]
    new_carry = _soft_signal(self, processed_logits) if fused_sc else None
    if diffusion_stopping_criteria is not None:  # as transformers' step
        if finished_denoising.any():
            new_argmax_canvas = torch.where(finished_denoising[:, None], argmax_canvas,
                                            new_argmax_canvas)
            new_current_canvas = torch.where(finished_denoising[:, None], current_canvas,
                                             new_current_canvas)
            if fused_sc:  # a finished row keeps its signal (a function of its logits alone)
                new_carry = torch.where(finished_denoising[:, None, None], carry, new_carry)
                # the criteria read this step's logits of the rows still denoising only
            else:
                processed_logits = torch.where(finished_denoising[:, None, None],
                                               self_conditioning_logits, processed_logits)
        finished_denoising |= diffusion_stopping_criteria(new_argmax_canvas, processed_logits)

    if not fused_sc:
        new_carry = processed_logits.to(embeddings_dtype)
    return new_current_canvas, new_argmax_canvas, new_carry, finished_denoising


def _scheduled_temperature(modeling: Any, logits_processor: Any,
                           cur_step: torch.Tensor) -> float | None:
    """The one temperature transformers' logits processors apply at this step, when they
    do nothing else: none (1.0) or a single ``LinearTemperatureScheduleLogitsProcessor``,
    its T computed as it computes it (float32, from the int32 step); None otherwise."""
    if not logits_processor:  # None or an empty LogitsProcessorList
        return 1.0
    if not isinstance(logits_processor, list):  # a LogitsProcessorList is a list
        return None
    schedule = modeling.LinearTemperatureScheduleLogitsProcessor
    if len(logits_processor) != 1 or type(logits_processor[0]) is not schedule:
        return None
    p = logits_processor[0]
    return float(p.t_min + ((p.t_max - p.t_min) * (cur_step / p.max_denoising_steps)))


def _draw_and_accept(logits: torch.Tensor | dk.LinearHead, temperature: float, step: int,
                     current_canvas: torch.Tensor, sampler: Any,
                     cur_step_t: torch.Tensor) -> tuple[Any, torch.Tensor]:
    """(Sample, the renoised canvas): one ``sample_tokens`` pass at ``temperature`` (the
    statistics too), keyed on a seed from torch's generator and the step, the entropy-bound
    acceptance (``commit_tokens(rule="entropy_budget", exclusive=True)``, recorded on the
    sampler as transformers' does), then transformers' renoising."""
    seed = int(torch.randint(0, 2**31 - 1, (1,)).item())
    sample = dk.sample_tokens(logits, temperature=temperature, seed=seed, step=step)
    everywhere = torch.ones_like(current_canvas, dtype=torch.bool)
    accepted_canvas, accepted = dk.commit_tokens(
        current_canvas, sample, everywhere, rule="entropy_budget",
        budget=float(sampler.entropy_bound), exclusive=True)
    sampler.accepted_token_mask = accepted
    renoise = sampler.renoise_canvas
    # with a static cache generate puts its torch.compile of renoise_canvas on the sampler,
    # compiled once per model: bound to the sampler of the model's first such generate, whose
    # mask it reads (transformers' compiled accept_canvas sets that one)
    bound = getattr(inspect.unwrap(renoise), "__self__", sampler)
    if bound is not sampler and type(bound) is type(sampler):
        bound.accepted_token_mask = accepted
    # ... under CUDA graphs (mode="reduce-overhead"), whose output the next call overwrites:
    # a copy, as transformers' step takes
    return sample, renoise(accepted_canvas, cur_step_t).clone()


def _head_step(self: Any, decoder_forward: Any, decoder_kwargs: dict[str, Any],
               current_canvas: torch.Tensor, temperature: float, step: int, sampler: Any,
               cur_step_t: torch.Tensor,
               finished_denoising: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor,
                                                          torch.Tensor, torch.Tensor]:
    """The fused step with no [B, L, V] buffer (fused self-conditioning, no adaptive stopping,
    the logits processors a temperature): the decoder's final hidden states and the tied
    capped head (``LinearHead``) give the draw, the argmax and the entropies at T in one
    streamed pass, and the next step's signal softmax(cap(h·W) / T)·E·sqrt(D) in another.
    Its probabilities are those of the float32 capped logits over T, where transformers
    rounds its processed logits to the table's dtype before the self-conditioning softmax."""
    hidden = decoder_forward(**decoder_kwargs, return_last_hidden_state=True).last_hidden_state
    head, _ = _capped_head(hidden, self.lm_head.weight, self.lm_head.bias,
                           self.final_logit_softcapping)
    sample, new_current_canvas = _draw_and_accept(head, temperature, step, current_canvas,
                                                  sampler, cur_step_t)
    embed = self.model.decoder.embed_tokens
    table = embed.weight
    signal = soft_embedding(head, table, temperature=temperature,
                            chunk_size=SIGNAL_CHUNK) * embed.embed_scale.to(
        table.dtype)
    return (new_current_canvas, sample.argmax.to(current_canvas.dtype), signal,
            finished_denoising)


def _soft_signal(self: Any, logits: torch.Tensor) -> torch.Tensor:
    """The decoder's self-conditioning signal of [B, L, V] logits, [B, L, D] in the table's
    dtype: ``soft_embedding`` of the logits as transformers carries them (rounded to the
    table's dtype) times the embedding scale, as transformers' decoder forms it from them
    except that the probabilities are never formed whole nor rounded to the table's dtype
    (float32 accumulation, one rounding of the sum; transformers rounds each probability to
    bfloat16 and the matmul's result)."""
    embed = self.model.decoder.embed_tokens
    table = embed.weight
    signal = soft_embedding(logits.to(table.dtype), table)
    return signal * embed.embed_scale.to(table.dtype)


def _decoder_forward(self: Any, *args: Any,
                     self_conditioning_embeddings: torch.Tensor | None = None,
                     **kwargs: Any) -> Any:
    """transformers' decoder forward, taking the self-conditioning signal precomputed
    (``self_conditioning_embeddings`` [B, L, D], what it forms from ``self_conditioning_logits``
    before its self-conditioning block) in place of the logits."""
    original = getattr(type(self), _ORIGINAL + "forward")
    signal = self_conditioning_embeddings
    if signal is not None:
        if kwargs.get("self_conditioning_logits") is not None:
            raise ValueError("pass self_conditioning_logits or self_conditioning_embeddings, "
                             "not both")
        mask = kwargs.get("self_conditioning_mask")
        if mask is not None:
            signal = signal * mask.to(signal.dtype)[:, None, None]
    # a plain attribute of the block, set here on every call (None: the block runs as
    # transformers' does) and cleared after: torch.compile (generate's, for a static cache)
    # traces it whole, the signal one of the compiled forward's inputs, and guards no value
    # left from an earlier call
    block = self.self_conditioning
    block._dlm_kernels_signal = signal
    try:
        return original(self, *args, **kwargs)  # no logits: it hands its block zeros ...
    finally:
        block._dlm_kernels_signal = None


def _self_conditioning_forward(self: Any, inputs_embeds: torch.Tensor,
                               self_conditioning_signal: torch.Tensor) -> torch.Tensor:
    """... which this block replaces by the precomputed signal, when one is pending."""
    pending = getattr(self, "_dlm_kernels_signal", None)
    if pending is not None:
        if tuple(pending.shape) != tuple(self_conditioning_signal.shape):
            raise ValueError(f"self_conditioning_embeddings must have shape "
                             f"{list(self_conditioning_signal.shape)} ([B, L, D] of the "
                             f"canvas); got {list(pending.shape)}")
        self_conditioning_signal = pending.to(self_conditioning_signal.dtype)
    return getattr(type(self), _ORIGINAL + "forward")(self, inputs_embeds,
                                                      self_conditioning_signal)


def _replace(cls: type, target: Any, name: str, fn: Any) -> None:
    """Set ``name`` to ``fn`` on the class ``cls`` (target None) or on the instance ``target``,
    keeping the class's own method once under ``_ORIGINAL + name``."""
    if not hasattr(cls, _ORIGINAL + name):
        setattr(cls, _ORIGINAL + name, getattr(cls, name))
    if target is None:
        setattr(cls, name, fn)
    else:
        setattr(target, name, types.MethodType(fn, target))


def apply_dlm_kernels_to_diffusion_gemma(
    model: Any = None,
    *,
    fused_linear_loss: bool = True,
    fused_sampling: bool = True,
    fused_self_conditioning: bool = False,
) -> None:
    """Put dlm-kernels under transformers' DiffusionGemma (``DiffusionGemmaForBlockDiffusion``).

    model: None patches the class (call it before the model is built, or for every model
      already built that has no instance patch); a DiffusionGemmaForBlockDiffusion patches
      that instance only.
    fused_linear_loss: the forward takes ``labels`` and returns the loss from the hidden
      states and the tied head without forming the logits (see ``_forward``'s docstring for
      the arguments: labels, encoder_labels, skip_logits, num_items_in_batch, variant,
      diffusion_t, loss_mask, diffusion_weight_clip).
    fused_sampling: ``generate``'s denoising step draws, takes the argmax and the entropies in
      one pass (``sample_tokens``) and accepts with ``commit_tokens(rule="entropy_budget",
      exclusive=True)``.
    fused_self_conditioning: (with fused_sampling) the denoising step carries the decoder's
      self-conditioning signal, the soft embeddings softmax(logits)·E·sqrt(D) [B, L, D]
      (``soft_embedding``, streamed over the vocabulary), to the next step instead of the
      [B, L, V] logits, and the decoder takes it as it is (``self_conditioning_embeddings``).
      transformers' logits rounded to the table's dtype are its input, as transformers carries
      them; the probabilities are never rounded to the table's dtype (transformers rounds them
      to bfloat16 before its matmul), so a bfloat16 signal differs from transformers' by those
      roundings (about 2^-8 of Σ p·|E|). Without adaptive stopping and with no logits
      processor but transformers' temperature schedule, the step forms no logits (with
      fused_linear_loss, whose forward hands it the hidden states): the draw, the argmax,
      the entropies and the signal come from the hidden states through the capped head
      (``_head_step``), the signal from the float32 capped logits over T (transformers'
      carried logits are rounded to the table's dtype first). Logits given to ``generate``
      as ``self_conditioning_logits`` are turned into the signal at the first step. With a
      static cache ``generate`` compiles the decoder (``torch.compile(self.forward,
      fullgraph=True)``): the patched forward and decoder trace whole, the signal reaching
      them as an argument (transformers' experts must then be a compilable implementation,
      not its eager loop over the experts hit); a streamer that
      takes logits receives the signal instead.
    """
    for name, value in (("fused_linear_loss", fused_linear_loss),
                        ("fused_sampling", fused_sampling),
                        ("fused_self_conditioning", fused_self_conditioning)):
        if not isinstance(value, bool):
            raise TypeError(f"{name} must be True or False; got {value!r}")
    if fused_self_conditioning and not fused_sampling:
        raise ValueError("fused_self_conditioning=True runs in the fused denoising step: it "
                         "needs fused_sampling=True")
    from transformers.models.diffusion_gemma import generation_diffusion_gemma as generation
    from transformers.models.diffusion_gemma import modeling_diffusion_gemma as modeling

    cls = modeling.DiffusionGemmaForBlockDiffusion
    if model is not None and not isinstance(model, cls):
        raise TypeError(f"model must be a DiffusionGemmaForBlockDiffusion (or None to patch the "
                        f"class); got {type(model).__name__}")
    cls._dlm_kernels_output_class = modeling.DiffusionGemmaBlockDiffusionOutputWithPast
    cls._dlm_kernels_hidden_output_class = _with_last_hidden_state(
        modeling.DiffusionGemmaBlockDiffusionOutputWithPast)
    cls._dlm_kernels_generation_module = generation
    if fused_linear_loss:
        _replace(cls, model, "forward", _forward)
        embedding = modeling.DiffusionGemmaTextScaledWordEmbedding
        embedding._dlm_kernels_lookup = None
        for lookup in [None] if model is None else _token_embeddings(model):
            _replace(embedding, lookup, "forward", _embedding_forward)
    if fused_sampling:
        _replace(cls, model, "_denoising_step", _denoising_step)
    if fused_self_conditioning:
        text = (model.config if model is not None else None)
        if text is not None and text.text_config.vocab_size == text.text_config.hidden_size:
            raise ValueError("fused_self_conditioning=True tells the carried soft embeddings "
                             "[B, L, D] from logits [B, L, V] by their last dimension: it needs "
                             f"vocab_size != hidden_size; both are {text.text_config.vocab_size}")
        decoder = None if model is None else model.model.decoder
        _replace(modeling.DiffusionGemmaDecoderModel, decoder, "forward", _decoder_forward)
        _replace(modeling.DiffusionGemmaSelfConditioning,
                 None if decoder is None else decoder.self_conditioning, "forward",
                 _self_conditioning_forward)
    (cls if model is None else model)._dlm_kernels_fused_self_conditioning = \
        fused_self_conditioning
