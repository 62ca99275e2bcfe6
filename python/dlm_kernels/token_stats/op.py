"""The token-statistics op, framework-neutral, in one file: its result type
(``TokenStats``), ``prepare`` (the checks, the static config and the row bundle
``_rows.Rows`` every backend receives), the reference backend, vocabulary trimming, the
shard policy, and the front-end shell (``TokenStatsFrontEnd``) that each framework fills
with its ops adapter, registry and VJP adapter: the body of ``token_stats``, which lowers
the call once (``lowering.lower``) and hands it to the backend the registry resolves.
The protocol a backend follows is ``_dispatch.Backend``.

The framework supplies only what differs, as one binding (``_framework.Framework``): its ops
adapter (``xp``), its registry, and a *VJP adapter* (``_framework.VjpAdapter``:
``token_stats.torch_vjp.TorchVJP``, ``token_stats.jax_vjp.JaxVJP``).
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any, NamedTuple, Optional, TypeVar

from .. import _checks
from .._checks import flag
from .._config import PLAIN_CE, check_vocab_size, make_config
from .._framework import Framework
from .._dispatch import (BackendBase, FALLBACK, NATIVE_DTYPES, BackendUnavailableError,
                         Capabilities, logger)
from .._rows import Rows
from ..linear_head.head import as_logits, planned_total, resolve_softcap, weighting_term
from . import formulas as stats_math
from .lowering import lower

if TYPE_CHECKING:
    from .._ops import Array
    from ..linear_head.head import LogitsSource

#: the front end's array type (torch.Tensor, jax.Array): ``_ops.A``
A = TypeVar("A", bound="Array")


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


assert TokenStats._fields == stats_math.PUBLIC_STATS  # the kernels' returned statistics


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
    stats = TokenStats._make(o.reshape(lead_shape) for o in outs)
    return stats if cfg.entropy else stats._replace(entropy=None)


class ReferenceBackend(BackendBase):
    """The reference backend of one framework: full float32 materialisation, differentiated
    by the framework's own autodiff (no custom VJP), so it checks the kernels' VJP math."""

    name = "reference"
    custom_vjp = False
    capabilities = Capabilities(dtypes=NATIVE_DTYPES)

    def __init__(self, xp):
        self.xp = xp

    def unsupported_reason(self, platform: str) -> Optional[str]:
        return None

    def compute(self, rows, cfg):
        # rows: the bundle (logits, teacher [N, K]) -> 4 x [N] f32; a linear head arrives
        # materialised in float32 (``LogitsSource.reference_array``: the reference is the
        # oracle's twin, not a lean path: its gradients are the float32 autodiff of
        # hidden @ weight, rounded once). Run on rows padded as the framework's whole-row
        # arithmetic wants them (inactive zero rows; ``whole_row_rows``), so a row's bits do
        # not depend on N.
        xp, n = self.xp, rows.targets.shape[0]
        m = xp.whole_row_rows(n, rows.logits.shape[1])
        if m == n:
            return self.whole_rows(rows, cfg)
        padded = Rows(*(xp.pad_rows(f, m) for f in rows))
        return tuple(s[:n] for s in self.whole_rows(padded, cfg))

    def whole_rows(self, rows, cfg):
        """(lse, logp, entropy, kl) [N] of rows of ``whole_row_rows`` (a framework may run
        the same formulas otherwise: ``JaxReferenceBackend``)."""
        return stats_math.reference_stats(self.xp, rows, cfg)


def trim_vocab(logits: LogitsSource[A], teacher_logits: LogitsSource[A] | None,
               vocab_size: object) -> tuple[LogitsSource[A], LogitsSource[A] | None]:
    """Drop padding columns >= vocab_size of two ``LogitsSource``s (a view in torch;
    autodiff pads the gradient)."""
    vocab_size = check_vocab_size(vocab_size)
    k = logits.shape[-1]
    if vocab_size > k:
        raise ValueError(f"vocab_size must be <= logits.shape[-1] = {k}; got {vocab_size}")
    if vocab_size == k:
        return logits, teacher_logits
    return (logits.vocab_slice(vocab_size),
            None if teacher_logits is None else teacher_logits.vocab_slice(vocab_size))


def apply_vocab_parallel(shard: Any, context: tuple[Any, Any] | None, vocab_size: Any,
                         logits: LogitsSource[A], teacher_logits: LogitsSource[A] | None
                         ) -> tuple[Any, Any, LogitsSource[A], LogitsSource[A] | None]:
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
            entropy=True, vocab_size=None, ce=PLAIN_CE, smoothing_vocab=None):
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
        ce=ce,
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


class VocabParallel:
    """The active ``vocab_parallel`` setting of one front end: (shard, vocab_size) or None.
    A plain attribute (torch.compile traces and guards attribute reads, not ContextVar.get);
    process-wide, like a process group."""

    def __init__(self):
        self.current = None

    @contextlib.contextmanager
    def within(self, shard, vocab_size=None):
        previous, self.current = self.current, (shard, vocab_size)
        try:
            yield
        finally:
            self.current = previous


#: the range of a planned gradient's scale a 16-bit dZ holds with its full precision
PLANNED_SCALE_RANGE = (2.0 ** -14, 2.0 ** 14)
#: the scale a planned gradient outside that range is brought to: near its top, since a
#: d logit is the scale times |p - q| or |δ - p|, often far below 1 (p ~ 1/K), and float16
#: keeps its relative precision only from 6.1e-5 up (a subnormal dZ loses its digits)
PLANNED_SCALE_TARGET = 2.0 ** 10


def unit_coefficients(xp, coefficients, cfg):
    """(unit, coefficients / unit): a linear head forms its planned gradient Σ c·dstats in
    the head's dtype, where coefficients far from unit size (loss weights of 1e-30 or 1e30)
    would underflow or overflow a 16-bit dZ. Its scale g = max over fields of max|c| / T
    (each statistic's gradient carries 1 / T, ``ce_temperature`` for logp; ``cfg`` the
    lowered call) is taken out when
    it leaves PLANNED_SCALE_RANGE (unit = g, a constant; else 1, so terms of different
    scales, as distillation's T²-weighted KL beside its CE, keep theirs); the total times
    ``unit`` carries it in its cotangent instead."""
    if coefficients is None:
        return None, None
    scale = None
    inverse_temperatures = TokenStats(lse=cfg.inv_t, logp=cfg.inv_t_ce, entropy=cfg.inv_t,
                                      kl=cfg.inv_t)
    for c, inv_t in zip(coefficients, inverse_temperatures):
        if c is not None:
            top = (xp.rowmax(abs(c)) if c.shape[0] else xp.rowsum(c)) * inv_t  # []
            scale = top if scale is None else xp.maximum(scale, top)
    if scale is None:
        return None, coefficients
    low, high = PLANNED_SCALE_RANGE
    unit = xp.stop_gradient(xp.where((scale > 0) & ((scale < low) | (scale > high)),
                                     scale * (1.0 / PLANNED_SCALE_TARGET), 1.0))
    return unit, tuple(None if c is None else c / unit for c in coefficients)


class TokenStatsFrontEnd:
    """``token_stats``, ``vocab_extent`` and ``backend_for`` of one framework: the op's one
    entry point, ``token_stats_total``, for the public ``token_stats`` and every objective."""

    def __init__(self, framework: Framework[Any]):
        self.framework = framework
        self.xp, self.registry, self.vjp = framework.xp, framework.token_stats, framework.vjp
        self.vocab_parallel = VocabParallel()

    def vocab_extent(self, logits) -> int:
        """The full vocabulary the logits' last axis belongs to (K x shards inside
        ``vocab_parallel``)."""
        ctx = self.vocab_parallel.current
        if ctx is None:
            return logits.shape[-1]
        shard, vocab_size = ctx
        return self._extent(shard, vocab_size, logits.shape[-1])

    def _extent(self, shard, vocab_size, k_local) -> int:
        """The global vocabulary: the true ``vocab_size`` when given, else K_local x shards."""
        return vocab_size or k_local * self.vjp.shards(shard)

    def within(self, shard, vocab_size):
        """The ``vocab_parallel(shard, vocab_size)`` context, its arguments checked."""
        if shard is not None:
            self.vjp.check_shard(shard, bound=False)  # a JAX axis is bound only when traced
        if vocab_size is not None:
            vocab_size = check_vocab_size(vocab_size)
        return self.vocab_parallel.within(shard, vocab_size)

    def backend_for(self, logits, backend=None) -> str:
        array = as_logits(logits).on_device(self.xp, "logits")
        return self.registry.resolve(backend, self.xp.platform(array)).name

    def token_stats_total(self, logits, targets, weights, coefficients, *, temperature=1.0,
                          ce_temperature=None, softcap=None, shift_ids=None, shift=None,
                          teacher_logits=None, teacher_temperature=None, teacher_grad=False,
                          entropy=True, chunk_size=None, inplace_grad=False, vocab_size=None,
                          ce=PLAIN_CE, shard=None, backend=None):
        """(TokenStats, total): the statistics, and with ``coefficients`` (a TokenStats of
        [...] float32 arrays or None per field) also total = Σ_rows Σ_fields c·stat, the one
        scalar an objective reduces to (``linear_head.head.planned_total``). A linear head then
        forms its gradient in the forward (the module docstring of ``linear_head.head``)."""
        xp = self.xp
        inplace_grad = flag("inplace_grad", inplace_grad)
        if inplace_grad and not self.vjp.inplace_grad:
            raise ValueError("inplace_grad=True is torch-only: JAX arrays are immutable (donate "
                             "the logits buffer to jit to let XLA reuse it instead)")
        # the one place the kind of the logits is decided: arrays go to the backend as they
        # are, a LinearHead (student or teacher) to the framework's head path
        logits = as_logits(logits)
        # a student head's softcap is the call's (the kernels cap its chunks in float32); a
        # teacher head keeps its own, applied where its chunks are formed
        logits, softcap = resolve_softcap(logits, softcap)
        teacher_logits = None if teacher_logits is None else as_logits(teacher_logits)
        heads = any(x is not None and not x.materialized for x in (logits, teacher_logits))
        if inplace_grad and heads:
            raise ValueError("inplace_grad=True applies to a logits tensor; a LinearHead never "
                             "builds one (its chunks are always overwritten by their gradient)")
        shard, vocab_size, logits, teacher_logits = apply_vocab_parallel(
            shard, self.vocab_parallel.current, vocab_size, logits, teacher_logits)
        if shard is not None:
            self.vjp.check_shard(shard, bound=True)
        smoothing_vocab = None  # K of label smoothing's uniform term: the global vocabulary
        if ce.smooths:
            k_local = logits.shape[-1]
            smoothing_vocab = k_local if shard is None else self._extent(shard, vocab_size,
                                                                         k_local)
        cfg, lead, rows = prepare(
            xp, logits, targets, weights, temperature=temperature,
            ce_temperature=ce_temperature, softcap=softcap, shift_ids=shift_ids, shift=shift,
            teacher_logits=teacher_logits, teacher_temperature=teacher_temperature,
            teacher_grad=teacher_grad, entropy=entropy, chunk_size=chunk_size,
            vocab_size=vocab_size, ce=ce, smoothing_vocab=smoothing_vocab)
        low = lower(cfg, has_shift=rows.shift_ids is not None, heads=heads)  # every backend's
        n = rows.targets.shape[0]
        weighting = None  # the coefficients as given: differentiable (loss weights, times)
        if coefficients is not None:
            weighting = tuple(None if c is None else xp.f32(c).reshape(n) for c in coefficients)
            coefficients = tuple(None if c is None else xp.stop_gradient(c) for c in weighting)
        impl = self.registry.resolve(backend, xp.platform(logits.device_array))
        require_dtype(impl, logits)
        if rows.teacher is not None and not cfg.teacher_grad:
            rows = rows._replace(teacher=rows.teacher.map_arrays(xp.stop_gradient))
        if shard is not None:
            impl = shard_capable(self.registry, impl, backend)
        if inplace_grad and not impl.capabilities.inplace_grad:
            raise ValueError(f"inplace_grad=True is not supported by backend {impl.name!r}; "
                             "use 'chunked' or 'triton'")
        total = None
        if heads and impl.custom_vjp:  # rows of LogitsSources: token chunks of the heads
            unit, planned = unit_coefficients(xp, coefficients, low)
            *outs, total = self.vjp.apply_head(impl, low, rows, shard, planned)
            if unit is not None:
                total = total * unit
        elif impl.custom_vjp:  # rows of arrays: the backend as it is
            outs = self.vjp.apply(impl, low, rows.map_logits(lambda x: x.array), inplace_grad,
                                  shard)
        else:  # the reference: every logits array whole (a head's formed in float32)
            outs = impl.compute(rows.map_logits(lambda x: x.reference_array(xp)), low)
        if coefficients is not None and total is None:
            assert weighting is not None  # formed with the coefficients above
            total = planned_total(xp, outs, weighting)
        elif total is not None:  # a head's planned total: there were coefficients
            assert weighting is not None and coefficients is not None
            total = total + weighting_term(xp, outs, weighting, coefficients)
        extent = None
        if rows.shift_ids is not None:  # the full vocabulary the shift ids index
            extent = self._extent(shard, cfg.vocab_size, rows.logits.shape[1])
        return public_stats(xp, outs, lead, cfg, rows, extent), total
