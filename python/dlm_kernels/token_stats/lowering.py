"""The one lowering of a token-statistics call: ``lower(cfg, has_shift=...)`` turns the
checked call description (``_config.StatsConfig``) into ``Lowered``, what the kernels and the
host math take: the scaled constants, the stand-ins for absent values, every flag the
kernels specialise on, the requested block size. Every backend reads that one object (the
front end lowers once per call and hands it down in place of the config); no backend forms
1/T, picks a stand-in or derives a flag itself. Nothing here imports torch or jax.
"""

from __future__ import annotations

import typing
from typing import NamedTuple, Optional

from .._config import StatsConfig
from ..kernels.layout import NO_VOCAB_LIMIT


class Lowered(NamedTuple):
    """One call as the kernels take it, immutable (a NamedTuple: built and unpacked at the
    cost of a tuple, once per call and in each torch custom op). Its fields, in order, are
    the scalar arguments the torch custom ops take flat (``*low``, ``schema``).

    inv_t, inv_t_ce, inv_t_kl: 1/T, 1/T_ce and 1/T_kl (student, CE term, teacher).
    softcap:       c of the softcap; 0.0, the one stand-in (never read), without one.
    vocab_limit:   the first padding column's global id; NO_VOCAB_LIMIT (int32 max), the one
                   stand-in, when every column is real.
    chunk_size:    the vocabulary chunk / kernel block asked for; None: each backend's
                   heuristic (a plan for the shape: ``_config.chunk_size_for``, the Triton
                   ``launch_config``, the Pallas ``block_sizes``).
    label_smoothing, z_loss_weight: ε and λ of the CE term.
    smooth_mean, smooth_weight: 1/K and ε/K of label smoothing's uniform term (K the valid
                   vocabulary); 0.0 without it.

    The flags, spelled as the Triton kernels' constexprs (a read names what it becomes):
    HAS_TEACHER, HAS_SHIFT (a LOO shift column per row), HAS_SOFTCAP, SEPARATE_CE (T_ce != T:
    the CE term keeps its own sums), HAS_ENTROPY, SMOOTH (ε > 0: the forward keeps Σ r),
    CE_TERMS (ε > 0 or λ > 0: the backward's CE gradient takes three per-row coefficients),
    TEACHER_GRAD, PADDED (columns >= vocab_limit are padding: the Pallas kernels mask them;
    the Triton ones clamp their spans to vocab_limit, which needs no flag); and two the host
    reads: Z_LOSS (λ > 0) and ROUND_TILES (the rows are a LinearHead's token chunks: the
    JAX backward rounds each [N, C] product a sum takes on its own, ``formulas.chunk_grads``).
    """

    inv_t: float
    inv_t_ce: float
    inv_t_kl: float
    softcap: float
    vocab_limit: int
    chunk_size: Optional[int]
    label_smoothing: float
    z_loss_weight: float
    smooth_mean: float
    smooth_weight: float
    HAS_TEACHER: bool
    HAS_SHIFT: bool
    HAS_SOFTCAP: bool
    SEPARATE_CE: bool
    HAS_ENTROPY: bool
    SMOOTH: bool
    Z_LOSS: bool
    CE_TERMS: bool
    TEACHER_GRAD: bool
    PADDED: bool
    ROUND_TILES: bool

    def triton_flags(self) -> dict[str, bool]:
        """The constexpr flags every Triton statistics kernel takes
        (``kernels.triton.token_stats``; SMOOTH, CE_TERMS and TEACHER_GRAD are one kernel's
        each, passed by its launch)."""
        return dict(HAS_SOFTCAP=self.HAS_SOFTCAP, HAS_SHIFT=self.HAS_SHIFT,
                    HAS_TEACHER=self.HAS_TEACHER, SEPARATE_CE=self.SEPARATE_CE,
                    HAS_ENTROPY=self.HAS_ENTROPY)

    def pallas_statics(self) -> dict[str, float | int | bool | None]:
        """The static arguments of the Pallas kernels (``kernels.pallas.token_stats``'s
        ``stats_forward`` / ``stats_backward``, ``kernels.pallas.linear_head``), in their
        spelling; has_teacher they take from the teacher operand, teacher_grad per call."""
        return dict(inv_t=self.inv_t, inv_t_ce=self.inv_t_ce, inv_t_kl=self.inv_t_kl,
                    softcap=self.softcap, has_softcap=self.HAS_SOFTCAP,
                    has_shift=self.HAS_SHIFT, separate_ce=self.SEPARATE_CE,
                    entropy=self.HAS_ENTROPY, block_k=self.chunk_size,
                    vocab_limit=self.vocab_limit, padded=self.PADDED,
                    smoothing=self.SMOOTH, ce_terms=self.CE_TERMS)

    @classmethod
    def schema(cls) -> str:
        """The fields as torch.library schema arguments ("float inv_t, ..., bool ROUND_TILES"):
        the one place the custom ops' scalar signature is written."""
        return ", ".join(f"{_SCHEMA_TYPES[kind]} {name}"
                         for name, kind in typing.get_type_hints(cls).items())


_SCHEMA_TYPES = {float: "float", int: "int", Optional[int]: "int?", bool: "bool"}


def lower(cfg: StatsConfig, *, has_shift: bool, heads: bool = False) -> Lowered:
    """The call ``cfg`` (with a LOO shift column per row when ``has_shift``; its logits, or
    its teacher's, formed from a ``LinearHead`` chunk by chunk when ``heads``) as the kernels
    take it. The only place a kernel flag, a scaled constant or a stand-in is derived."""
    ce = cfg.ce
    smoothing = ce.smooths
    z_loss = ce.z_loss_weight > 0.0
    smooth_mean = smooth_weight = 0.0
    if smoothing:
        k = cfg.smoothing_vocab
        assert k is not None  # K of the uniform term: given wherever it smooths (make_config)
        smooth_mean, smooth_weight = 1.0 / k, ce.label_smoothing / k
    return Lowered(
        inv_t=1.0 / cfg.temperature,
        inv_t_ce=1.0 / cfg.ce_temperature,
        inv_t_kl=1.0 / cfg.teacher_temperature,
        softcap=0.0 if cfg.softcap is None else cfg.softcap,
        vocab_limit=NO_VOCAB_LIMIT if cfg.vocab_size is None else cfg.vocab_size,
        chunk_size=cfg.chunk_size,
        label_smoothing=ce.label_smoothing,
        z_loss_weight=ce.z_loss_weight,
        smooth_mean=smooth_mean,
        smooth_weight=smooth_weight,
        HAS_TEACHER=cfg.has_teacher,
        HAS_SHIFT=bool(has_shift),
        HAS_SOFTCAP=cfg.softcap is not None,
        SEPARATE_CE=cfg.ce_temperature != cfg.temperature,
        HAS_ENTROPY=cfg.entropy,
        SMOOTH=smoothing,
        Z_LOSS=z_loss,
        CE_TERMS=smoothing or z_loss,
        TEACHER_GRAD=cfg.teacher_grad,
        PADDED=cfg.vocab_size is not None,
        ROUND_TILES=bool(heads),
    )
