"""The framework-neutral shell of a front end: ``token_stats``' body, the
vocabulary-parallel context and ``backend_for``, written once.

Each framework supplies only what differs: its ops adapter (``xp``), its registry, and a
*VJP adapter*, an object with

  apply(impl, cfg, rows, inplace, shard) -> (lse, logp, entropy, kl)
      (``cfg``: the call lowered once, ``_lowering.Lowered``; every backend reads it)
      the framework's custom-VJP mechanics around ``impl.forward`` / ``impl.backward``
      (with a vocabulary ``shard``, the partial states merged by its collectives)
  shards(shard) -> int
      how many vocabulary shards a process group / mesh axis splits the logits into
  apply_head(impl, cfg, rows, shard, coefficients) -> (lse, logp, entropy, kl, total)
      the same for rows of ``LogitsSource``s whose logits and/or teacher are a
      ``LinearHead`` (the choice made once, in ``token_stats_total``): token chunks of
      matmuls feeding ``impl``; ``total`` is None without ``coefficients``, else the planned
      scalar with its gradient formed in the forward (``linear_head.head``)
  inplace_grad: bool
      whether the framework can write a gradient into its logits (torch: yes; JAX: no)
  check_shard(shard, bound) -> None
      raises unless ``shard`` is a process group / mesh axis name (``bound``: also one the
      call can use here, e.g. a JAX axis of the enclosing ``shard_map``)
"""

from __future__ import annotations

import contextlib

from .._checks import flag
from .._config import check_vocab_size
from ..linear_head.head import as_logits, planned_total, weighting_term
from .._lowering import lower
from .primitive import apply_vocab_parallel, prepare, public_stats, require_dtype, shard_capable

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
    inverse_temperatures = (cfg.inv_t, cfg.inv_t_ce, cfg.inv_t, cfg.inv_t)
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
    """``token_stats``, ``vocab_extent`` and ``backend_for`` of one framework."""

    def __init__(self, xp, registry, vjp):
        self.xp, self.registry, self.vjp = xp, registry, vjp
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

    def token_stats(self, logits, targets, weights=None, **options):
        """The public ``token_stats`` (its shard keyword named ``shard``)."""
        stats, _ = self.token_stats_total(logits, targets, weights, None, **options)
        return stats

    def token_stats_total(self, logits, targets, weights, coefficients, *, temperature=1.0,
                          ce_temperature=None, softcap=None, shift_ids=None, shift=None,
                          teacher_logits=None, teacher_temperature=None, teacher_grad=False,
                          entropy=True, chunk_size=None, inplace_grad=False, vocab_size=None,
                          label_smoothing=0.0, z_loss_weight=0.0, shard=None, backend=None):
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
        if label_smoothing is not None and label_smoothing != 0:
            k_local = logits.shape[-1]
            smoothing_vocab = k_local if shard is None else self._extent(shard, vocab_size,
                                                                         k_local)
        cfg, lead, rows = prepare(
            xp, logits, targets, weights, temperature=temperature,
            ce_temperature=ce_temperature, softcap=softcap, shift_ids=shift_ids, shift=shift,
            teacher_logits=teacher_logits, teacher_temperature=teacher_temperature,
            teacher_grad=teacher_grad, entropy=entropy, chunk_size=chunk_size,
            vocab_size=vocab_size, label_smoothing=label_smoothing,
            z_loss_weight=z_loss_weight, smoothing_vocab=smoothing_vocab)
        low = lower(cfg, has_shift=rows.shift_ids is not None)  # what every backend reads
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
            total = planned_total(xp, outs, weighting)
        elif total is not None:
            total = total + weighting_term(xp, outs, weighting, coefficients)
        extent = None
        if rows.shift_ids is not None:  # the full vocabulary the shift ids index
            extent = self._extent(shard, cfg.vocab_size, rows.logits.shape[1])
        return public_stats(xp, outs, lead, cfg, rows, extent), total
