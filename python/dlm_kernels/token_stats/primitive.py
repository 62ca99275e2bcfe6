"""Framework-neutral pieces of the public ``token_stats`` primitive: its documentation and
result type, ``prepare`` (the checks, the static config and the row bundle ``_rows.Rows``
every backend receives), the reference backend, vocabulary trimming and the shard policy.
The protocol a backend follows is ``_dispatch.Backend``.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from .. import _checks
from .._config import check_vocab_size, make_config
from .._dispatch import (BackendBase, FALLBACK, NATIVE_DTYPES, BackendUnavailableError,
                         Capabilities, logger)
from .._rows import Rows


class TokenStats(NamedTuple):
    """Per-row outputs of :func:`token_stats`, each float32 with the logits' leading shape.

    lse:     logsumexp of the (capped, shifted) logits divided by ``temperature``.
    logp:    minus the row's CE training term at ``ce_temperature`` (CE = -logp): the
             target's log-probability log p'_y, or with label smoothing ε and z-loss λ
             (1 - ε)·log p'_y + ε·Σ_k log p'_k / K - λ·lse_ce² (lse_ce the logsumexp at
             ``ce_temperature``; K the valid vocabulary).
    entropy: entropy of softmax(logits / temperature); None when called with entropy=False.
    kl:      KL(softmax(teacher / teacher_temperature) || softmax(logits / temperature));
             0 when no teacher is given.
    Inactive rows (weight 0) are exactly 0 in every field.
    """

    lse: Any  # a torch.Tensor in dlm_kernels.torch, a jax.Array in dlm_kernels.jax
    logp: Any
    entropy: Any
    kl: Any




def require_dtype(impl, logits):
    """The backend declares the logits' dtype among its capabilities, or an error says so."""
    name = str(logits.dtype).replace("torch.", "")
    if name not in impl.capabilities.dtypes:
        raise BackendUnavailableError(
            f"backend {impl.name!r} does not take {name} logits; it takes "
            f"{', '.join(impl.capabilities.dtypes)}")


def public_stats(xp, outs, lead_shape, cfg, rows, vocab_extent):
    """TokenStats of the flat [N] outputs reshaped to the rows' shape; entropy None when the
    call did not ask for it (what the backends hold there is not an entropy).

    An active row whose shift id lies outside [0, vocab_extent) (the full vocabulary: K, or
    K x shards when vocabulary-parallel) would silently go unshifted in every backend; its
    statistics are NaN instead (a [N] select; the where's gradient there is 0)."""
    if rows.shift_ids is not None:
        x = rows.shift_ids
        bad = rows.active & ((x < 0) | (x >= vocab_extent))  # [N]
        outs = [xp.where(bad, float("nan"), o) for o in outs]
    lse, logp, entropy, kl = (o.reshape(lead_shape) for o in outs)
    return TokenStats(lse, logp, entropy if cfg.entropy else None, kl)


class ReferenceBackend(BackendBase):
    """The reference backend of one framework: full float32 materialisation, differentiated
    by the framework's own autodiff (no custom VJP), so it checks the kernels' VJP math."""

    name = "reference"
    custom_vjp = False
    capabilities = Capabilities(dtypes=NATIVE_DTYPES)

    def __init__(self, xp):
        self.xp = xp

    @staticmethod
    def unsupported_reason(platform):
        return None

    def compute(self, rows, cfg):
        # rows: the bundle (logits, teacher [N, K]) -> 4 x [N] f32; a linear head arrives
        # materialised in float32 (``LogitsSource.reference_array``: the reference is the
        # oracle's twin, not a lean path: its gradients are the float32 autodiff of
        # hidden @ weight, rounded once)
        from .math import reference_stats

        return reference_stats(self.xp, rows, cfg)


def trim_vocab(logits, teacher_logits, vocab_size):
    """Drop padding columns >= vocab_size of two ``LogitsSource``s (a view in torch;
    autodiff pads the gradient)."""
    vocab_size = check_vocab_size(vocab_size)
    k = logits.shape[-1]
    if vocab_size > k:
        raise ValueError(f"vocab_size must be <= logits.shape[-1] = {k}; got {vocab_size}")
    if vocab_size == k:
        return logits, teacher_logits
    trim = lambda a: None if a is None else a.vocab_slice(vocab_size)
    return trim(logits), trim(teacher_logits)


def apply_vocab_parallel(shard, context, vocab_size, logits, teacher_logits):
    """Resolve the vocab-parallel setting of one call: an explicit ``shard`` (process group or
    mesh axis) wins over the ``vocab_parallel`` context (a (shard, vocab_size) pair or None);
    an unsharded call with ``vocab_size`` drops the padding columns instead.
    Returns (shard, vocab_size, logits, teacher_logits)."""
    if shard is None and context is not None:
        shard, context_vocab = context
        vocab_size = vocab_size if vocab_size is not None else context_vocab
    if shard is None and vocab_size is not None:
        logits, teacher_logits = trim_vocab(logits, teacher_logits, vocab_size)
        vocab_size = None
    return shard, vocab_size, logits, teacher_logits


def shard_capable(registry, impl, requested):
    """The implementation a vocabulary-parallel call uses: ``impl`` when it can merge partial
    states across shards, else the chunked one (auto only; an explicit request errors)."""
    if impl.capabilities.vocab_shards:
        return impl
    if requested is not None:
        raise ValueError(
            f"backend={requested!r} does not support vocabulary-parallel logits yet; "
            f"use backend='chunked' (or None)")
    logger.debug("vocab-parallel call: %s cannot merge shard states; using chunked", impl.name)
    return registry.IMPLEMENTATIONS[FALLBACK]


def prepare(xp, logits, targets, weights, *, temperature, ce_temperature, softcap, shift_ids,
            shift, teacher_logits, teacher_temperature, teacher_grad, chunk_size,
            entropy=True, vocab_size=None, label_smoothing=0.0, z_loss_weight=0.0,
            smoothing_vocab=None):
    """Validate, build the static config and flatten leading dims into rows.

    ``logits`` / ``teacher_logits``: ``LogitsSource``s (``linear_head.head.as_logits``).
    Returns (cfg, lead_shape, Rows) with the bundle's sources flattened to [N, K] rows and
    its arrays to [N].
    """
    _checks.check_stats_inputs(xp, logits, targets, weights, shift_ids, shift, teacher_logits)
    cfg = make_config(
        temperature=temperature,
        ce_temperature=ce_temperature,
        teacher_temperature=teacher_temperature,
        softcap=softcap,
        has_teacher=teacher_logits is not None,
        teacher_grad=teacher_grad,
        entropy=entropy,
        chunk_size=chunk_size,
        vocab_size=vocab_size,
        label_smoothing=label_smoothing,
        z_loss_weight=z_loss_weight,
        smoothing_vocab=smoothing_vocab,
    )
    lead = tuple(logits.shape[:-1])
    n = 1
    for dim in lead:
        n *= dim
    y = targets.reshape(n)
    rows = Rows(
        logits=logits.flat(n),
        teacher=None if teacher_logits is None else teacher_logits.flat(n),
        targets=y,
        active=y == y if weights is None else weights.reshape(n) != 0,  # None: all True, on
    )                                                                    # the targets' device
    if shift_ids is not None:
        if xp.is_array(shift):
            d = xp.broadcast_to(xp.f32(shift), lead).reshape(n)
        else:  # a Python or NumPy scalar: made on the rows' device
            d = xp.full((n,), _checks.number("shift", shift, "a float or a floating array"), y)
        rows = rows._replace(shift_ids=shift_ids.reshape(n), shift=d)
    return cfg, lead, rows
