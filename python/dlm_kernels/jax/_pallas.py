"""The pallas backend for JAX: the Mosaic TPU kernels of ``dlm_kernels.kernels.pallas``
under the front end's ``custom_vjp``.

Interpret mode (TPU semantics emulated on CPU) is on when ``DLM_KERNELS_PALLAS_INTERPRET=1``,
off when ``=0``, and by default on exactly when JAX's default backend is the CPU. With it off
on a CPU machine, the kernels still *lower* for TPU (``lowering_platforms=("tpu",)``), which
is how the block rules are checked without a TPU.
"""

from __future__ import annotations

import os
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from .. import _sampling as sampling
from .. import _stats_math as stats_math
from .._dispatch import BackendBase, Capabilities
from .._env import PALLAS_INTERPRET_ENV
from ..kernels.layout import ROW_STATS, SAMPLE_IDS, SAMPLE_STATE
from ..kernels.pallas import linear_head as head_kernels
from ..kernels.pallas import sampling as sampler
from ..kernels.pallas import token_stats as kernels
from ._batching import fold_vmap_into_rows
from ._ops import JaxOps


def interpret_mode() -> bool:
    value = os.environ.get(PALLAS_INTERPRET_ENV, "").strip()
    if value in ("0", "1"):
        return value == "1"
    if value:
        raise ValueError(f"{PALLAS_INTERPRET_ENV} must be 0 or 1; got {value!r}")
    return jax.default_backend() == "cpu"


class RaceDetection:
    """Whether interpret mode also detects races between grid steps (a test aid, switched by
    ``dlm_kernels.testing.pallas_race_detection``)."""

    enabled = False


def _statics(cfg):
    # the lowered call's statics, and how this process runs the kernels
    return dict(cfg.pallas_statics(), interpret=interpret_mode(),
                detect_races=RaceDetection.enabled)


def _ints(y, x, offset=0):  # [N, 3] int32: target, shift column, global id of column 0
    y = y.astype(jnp.int32)
    return jnp.stack([y, (y if x is None else x).astype(jnp.int32),
                      jnp.zeros_like(y) + jnp.asarray(offset, jnp.int32)], axis=1)


class _Teacher(NamedTuple):
    """A teacher as the fused head kernels take it."""

    operand: Any  # [N, K] logits, or a head's (hidden, weight, bias)
    statics: dict  # what the kernels' statics add for it
    kernel_dtype: bool  # whether the kernels take its dtypes


class _TeacherOperand:
    """The ``_Teacher`` of a teacher source, by its kind (``LogitsSource.accept``)."""

    @staticmethod
    def array(logits):  # read as it is
        return _Teacher(logits, {}, True)

    @staticmethod
    def head(head):  # its arrays in its layout
        return _Teacher(head.arrays(), {"teacher_layout": head.weight_layout},
                        FusedHead._kernel_dtype(head))


class FusedHead:
    """The linear head in Mosaic kernels (``kernels.pallas.linear_head``): statistics and the
    gradients of hidden, weight and bias with every logits tile made on the MXU and used in
    VMEM. It takes rows whose logits are a head of float32 or bfloat16 hidden states and a
    weight of the same dtype, whose teacher is absent, an array, or a head of its own (then
    without teacher_grad), outside a vocabulary-parallel map; other rows go through the
    token-chunked path (XLA matmuls feeding the logits kernels). Gradient schedule: always
    recompute (1 matmul forward, 4 backward)."""

    @staticmethod
    def _kernel_dtype(head):
        dt = jnp.dtype(head.hidden.dtype)
        return dt in (jnp.float32, jnp.bfloat16) and jnp.dtype(head.weight.dtype) == dt

    @classmethod
    def takes(cls, rows, axis, plan):
        """Whether the kernels take these rows: ``plan`` (``_linear_head.HeadPlan``) says
        whether the student is the one head needing a gradient; the dtypes are checked here."""
        if not plan.student_head_grad_only or axis is not None:
            return False
        teacher = rows.teacher  # a LogitsSource or None
        return cls._kernel_dtype(rows.logits) and (
            teacher is None or teacher.accept(_TeacherOperand).kernel_dtype)

    @staticmethod
    def _args(rows, cfg):
        head, teacher = rows.logits, rows.teacher
        statics = dict(_statics(cfg), layout=head.weight_layout, block_n=head.row_chunk)
        if teacher is not None:
            operand = teacher.accept(_TeacherOperand)
            teacher = operand.operand
            statics.update(operand.statics)
        return (head.hidden, head.weight, head.bias), teacher, statics

    @classmethod
    def forward(cls, rows, cfg):
        """-> Stats of [N] f32 (one kernel: 1 matmul)."""
        head, teacher, statics = cls._args(rows, cfg)
        out = head_kernels.head_forward(head, teacher, _ints(rows.targets, rows.shift_ids),
                                        _forward_floats(rows, rows.active), **statics)
        return _stats(out, rows.active, cfg)

    @classmethod
    def backward(cls, rows, stats, grads, cfg):
        """-> ((dH, dW, db or None) float32, the teacher's gradient or None): two kernels,
        2 matmuls each."""
        head, teacher, statics = cls._args(rows, cfg)
        dh, dw, db, du = head_kernels.head_backward(
            head, teacher, _ints(rows.targets, rows.shift_ids),
            _backward_floats(rows, stats, grads, cfg), teacher_grad=cfg.TEACHER_GRAD, **statics)
        return (dh, dw, db), du


class PallasJax(BackendBase):
    name = "pallas"
    custom_vjp = True
    capabilities = Capabilities(vocab_shards=True, sampling=True)

    @staticmethod
    def unsupported_reason(platform):
        forced = os.environ.get(PALLAS_INTERPRET_ENV, "").strip()
        if platform == "tpu" or forced == "0" or interpret_mode():
            return None  # "0" forces compiled Mosaic: lowering for TPU works anywhere
        return (f"the Pallas kernels target TPUs (arrays are on {platform!r}; set "
                f"{PALLAS_INTERPRET_ENV}=1 for interpret mode)")

    @staticmethod
    def _run_forward(rows, active, cfg, offset, partial):
        z, u, y, x = rows.logits, rows.teacher, rows.targets, rows.shift_ids
        if z.shape[0] == 0:  # no rows: no launch (a grid over zero row blocks reads out of bounds)
            return jnp.zeros((0, kernels.stats_width(cfg.SMOOTH)), jnp.float32)
        floats = _forward_floats(rows, active)  # [N, 2]
        statics = dict(_statics(cfg), partial=partial)
        call = fold_vmap_into_rows(
            lambda z, *rest: kernels.stats_forward(z, rest[0] if u is not None else None, *rest[-2:],
                                             **statics))
        return call(z, *([u] if u is not None else []), _ints(y, x, offset), floats)  # [N, F]

    @classmethod
    def forward(cls, rows, cfg):
        # rows: [N, K] logits / teacher, [N] per-row inputs -> Stats of [N] f32
        return _stats(cls._run_forward(rows, rows.active, cfg, 0, False), rows.active, cfg)

    @classmethod
    def forward_partial(cls, rows, cfg, offset=0):
        # one vocabulary shard starting at global column ``offset`` -> (State, r_y, found)
        active = jnp.ones(rows.targets.shape, jnp.bool_)
        out = cls._run_forward(rows, active, cfg, offset, True)
        state = _partial_state(out, cfg)
        return (state, *stats_math.target_logit(JaxOps, rows, cfg, offset))

    @staticmethod
    def backward(rows, stats, grads, cfg, offset=0):
        z, u, y, x = rows.logits, rows.teacher, rows.targets, rows.shift_ids
        if z.shape[0] == 0:  # no rows: nothing to launch
            empty = lambda a: jnp.zeros(a.shape, a.dtype)
            return empty(z), (empty(u) if u is not None and cfg.TEACHER_GRAD else None)
        floats = _backward_floats(rows, stats, grads, cfg)  # [N, 16]
        statics = _statics(cfg)
        call = fold_vmap_into_rows(
            lambda z, *rest: kernels.stats_backward(z, rest[0] if u is not None else None, *rest[-2:],
                                              teacher_grad=cfg.TEACHER_GRAD, **statics))
        return call(z, *([u] if u is not None else []), _ints(y, x, offset), floats)


    fused_head = FusedHead  # the fused linear head's entry points

    @staticmethod
    def sample(z, zu, keys, suppress, cfg):
        # z, zu: [N, K] -> Sample of [N] fields; the kernel's one split finalised here
        n, k = z.shape
        ints = [jax.lax.bitcast_convert_type(keys, jnp.int32)[:, None]]  # [N, 1 + S]
        if suppress is not None:
            ints.append(jnp.broadcast_to(suppress.astype(jnp.int32), (n,) + suppress.shape))
        low = cfg.lowered()
        statics = dict(temperature=low.temperature, stat_temperature=low.stats_temperature,
                       cfg_c=low.cfg_c, greedy=low.GREEDY, two_t=low.TWO_T, top_k=low.top_k,
                       block_k=low.block_k, interpret=interpret_mode(),
                       detect_races=RaceDetection.enabled)
        call = fold_vmap_into_rows(
            lambda z, *rest: sampler.sample_partial(z, rest[0] if zu is not None else None,
                                                    rest[-1], **statics))
        if n == 0:  # no rows: no launch (a grid over zero row blocks reads out of bounds)
            floats, ids = (jnp.zeros((0, len(f)), t) for f, t in
                           ((SAMPLE_STATE, jnp.float32), (SAMPLE_IDS, jnp.int32)))
            top_v, top_i = (jnp.zeros((0, low.top_k), t) for t in (jnp.float32, jnp.int32))
        else:
            floats, ids, top_v, top_i = call(z, *([zu] if zu is not None else []),
                                             jnp.concatenate(ints, axis=1))
        st = sampling.merge_splits(JaxOps, floats.T[:, None, :], ids.T[:, None, :], top_v,
                                   top_i, cfg, k)
        return sampling.finalize(JaxOps, st, keys, cfg)


def _shift(rows):  # [N] float32: the shift of each row (0 without one)
    d = rows.shift
    return jnp.zeros(rows.targets.shape, jnp.float32) if d is None else d.astype(jnp.float32)


def _forward_floats(rows, active):  # [N, 2]: shift, active (the forward kernels' F_* columns)
    return jnp.stack([_shift(rows), active.astype(jnp.float32)], axis=1)


def _partial_state(out, cfg):
    """The State of a shard's partial output [N, stats_width] (Σ r only with label
    smoothing)."""
    fields = [out[:, j] for j in range(kernels.scratch_rows(cfg.SMOOTH))]
    if not cfg.SMOOTH:
        fields.append(jnp.zeros_like(fields[0]))
    return stats_math.State(*fields)


def _stats(out, active, cfg):
    """The Stats of the forward's output [N, stats_width] (ROW_STATS, logp the target's
    log-probability, then Σ r with label smoothing), logp made the CE term (O(N)) with label
    smoothing or z-loss."""
    stats = stats_math.Stats(*(out[:, j] for j in range(len(ROW_STATS))))
    if not cfg.CE_TERMS:
        return stats
    sr = out[:, len(ROW_STATS)] if cfg.SMOOTH else None
    return stats._replace(logp=stats_math.ce_objective(JaxOps, stats.logp, sr, stats.m,
                                                       stats.la_ce, active, cfg))


def _backward_floats(rows, stats, grads, cfg):  # [N, 16]: the backward kernels' F_* columns
    n = rows.targets.shape[0]
    cols = [_shift(rows), rows.active.astype(jnp.float32), stats.m, stats.la, stats.entropy,
            stats.kl_shift, stats.la_ce, stats.mu, stats.la_u, *grads]
    if cfg.CE_TERMS:  # F_GY, F_GU, F_GP: the CE term's per-row coefficients
        g_y, g_u, g_p = stats_math.ce_coefficients(JaxOps, grads[1], stats, cfg)
        cols += [g_y, jnp.zeros_like(g_y) if g_u is None else g_u, g_p]
    return jnp.stack(cols + [jnp.zeros((n,), jnp.float32)] * (kernels.BWD_FLOATS - len(cols)),
                     axis=1)



IMPLEMENTATION = PallasJax()
