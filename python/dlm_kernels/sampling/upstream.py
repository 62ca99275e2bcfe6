"""The denoising step as LLaDA's ``generate.py``, Fast-dLLM and Megatron-Bridge
(``megatron/bridge/diffusion/common/dllm.py``) write it -- ``add_gumbel_noise``,
``get_num_transfer_tokens``, ``get_transfer_index`` -- under the same names and arguments,
written once for both front ends over ``sample_tokens`` (one read of the logits, no
[B, L, K] noise or softmax).

What differs from upstream, on purpose: the noise is ours (the keyed noise of
``sampling.core``, float32), so the drawn tokens are equal to upstream's in distribution, not in
bits; the confidences are float32 (upstream: float64); ties at the k-th place go to the lower
position (torch.topk leaves them unspecified); see each function for the rest.
"""

from __future__ import annotations

import numpy as np

from .._checks import (OutOfRangeError, as_number, flag, plain, require_array, require_int,
                       require_real, require_shape, shape_str)
from ..linear_head.head import as_logits
from .core import (Sampler, _flat_rows, commit_arguments, confidence, gumbel, make_sample_config,
                   position_uniform, row_keys, scaled_logits, seed_argument, _at_least_one,
                   _commit_topk, _per_sequence_with_host, _unless_nan)

REMASKING = ("low_confidence", "random")


def _lead(logits):
    return tuple(logits.shape[:-1])


def _rows_of(lead):
    n = 1
    for dim in lead:
        n *= dim
    return n


def _at_most_length(host, length):
    """num_transfer_tokens' values (a Python int, checked in Python, also while tracing; host
    values [] or [B]; or None, unreadable) at most L, as upstream's torch.topk requires."""
    if isinstance(host, int):
        bad, i, got = host > length, None, host
    elif host is None:  # unreadable: nothing to check here
        bad, i, got = False, None, None
    else:
        bad = bool((np.atleast_1d(host) > length).any())
        i = int(np.argmax(np.atleast_1d(host) > length)) if bad else None
        got = None if i is None else int(np.atleast_1d(host)[i])
    if bad:
        raise OutOfRangeError(
            f"num_transfer_tokens must be at most L = {length} positions per sequence "
            f"(torch.topk: selected index k out of range); got {got}"
            + ("" if i is None else f" for sequence {i}"))


class StepFunctions:
    """``add_gumbel_noise``, ``get_num_transfer_tokens`` and ``get_transfer_index`` of one
    front end over its ``Sampler``: the bodies of its typed public functions (documented
    there)."""

    def __init__(self, sampler: Sampler):
        self.sampler = sampler
        self.xp = sampler.xp

    def add_gumbel_noise(self, logits, temperature, *, seed: object = 0, step: object = 0):
        xp = self.xp
        cfg = make_sample_config(xp, logits, temperature, None, None, 0.0, None)
        lead, k = _lead(logits), logits.shape[-1]
        if cfg.temperature == 0.0:  # upstream returns its logits as they are
            return as_logits(logits).dense(xp)
        seed = seed_argument(xp, "seed", seed, lead)
        step = seed_argument(xp, "step", step, None)
        n = _rows_of(lead)
        logits = as_logits(logits)
        like = logits.device_array
        z = _flat_rows(xp, logits, n).dense(xp)  # [N, K]
        cols = xp.arange(k, like)
        _, s, _ = scaled_logits(xp, z, None, cols, None, cfg)  # [N, K] z / T, float32
        keys = row_keys(xp, seed, step, n, like)
        return (s + gumbel(xp, keys, cols)).reshape(lead + (k,))

    def get_num_transfer_tokens(self, mask_index, steps):
        xp = self.xp
        require_array(xp, "mask_index", mask_index)
        require_real(xp, "mask_index", mask_index)
        if len(mask_index.shape) != 2:
            raise ValueError(f"mask_index must have shape [B, L]; got "
                             f"{shape_str(mask_index.shape)}")
        count = as_number(steps, integer=True)
        if count is None or count < 1:
            raise ValueError(f"steps must be a positive int; got {plain(steps)}")
        masked = xp.rowsum(xp.index_ints(mask_index != 0))  # [B]
        base, extra = masked // count, masked % count
        first = xp.arange(count, mask_index)[None, :] < extra[:, None]  # [B, steps]
        return base[:, None] + xp.index_ints(first)

    def get_transfer_index(self, logits, temperature, remasking, mask_index, x,
                           num_transfer_tokens, threshold=None, neg_entropy=False, *,
                           seed: object = 0, step: object = 0, backend=None):
        xp = self.xp
        if remasking not in REMASKING:
            raise NotImplementedError(remasking)  # upstream's class and text
        neg_entropy = flag("neg_entropy", neg_entropy)
        require_array(xp, "x", x)
        require_int(xp, "x", x)
        if len(x.shape) != 2:
            raise ValueError(f"x must have shape [B, L]; got {shape_str(x.shape)}")
        require_array(xp, "mask_index", mask_index)
        require_shape("mask_index", mask_index, x.shape, "x.shape [B, L]")
        if _lead(logits) != tuple(x.shape):
            raise ValueError(f"logits must have shape [B, L, K] with [B, L] = x.shape "
                             f"{shape_str(x.shape)}; got {shape_str(logits.shape)}")
        t = as_number(temperature)
        sample = self.sampler.sample_tokens(logits, temperature=temperature, seed=seed, step=step,
                               stats_temperature=None if t == 0.0 else 1.0, backend=backend)
        k = num_transfer_tokens
        if threshold is None:
            if k is None:
                raise ValueError("num_transfer_tokens must be given (an int, or [B] or [B, 1] "
                                 "ints) when threshold is None")
            if xp.is_array(k) and tuple(k.shape) == (x.shape[0], 1):
                k = k.reshape(-1)
            _, host = _per_sequence_with_host(xp, "num_transfer_tokens", k, x.shape[0],
                                              integral=True)
            _at_most_length(host, x.shape[1])
        else:
            k = None  # upstream commits every masked position at or above the threshold
        k, threshold, _ = commit_arguments(xp, x, sample, k, threshold, None)
        masked = mask_index != 0
        eligible = masked & (sample.token >= 0)  # a row without a valid draw keeps x
        x0 = xp.where(eligible, xp.cast_like(sample.token, x), x)
        if remasking == "random":
            lead = tuple(x.shape)
            keys = row_keys(xp, seed_argument(xp, "seed", seed, lead),
                            seed_argument(xp, "step", step, None), _rows_of(lead), x)
            conf = position_uniform(xp, keys).reshape(lead)
        elif neg_entropy:
            conf = confidence(xp, sample, "neg_entropy")  # Σ p log p at temperature 1
        else:
            conf = confidence(xp, sample, "probability")  # softmax(logits)[x0]
        conf = xp.where(eligible, conf, float("-inf"))
        if threshold is None:  # topk over every position: -inf ones fill k past the masked
            return x0, _commit_topk(xp, conf, masked | ~masked, k)
        commit = _at_least_one(xp, eligible & (conf >= threshold), conf, eligible)
        return x0, _unless_nan(xp, commit, threshold)

