"""NaN guards over [B, L] values the host checks could not read, shared by every objective
and the policy losses (docs/design.md §3).

Values the checks cannot read (under ``jit`` / ``torch.compile``, or on an accelerator
outside ``sync_checks()``) are still never turned into a plausible number: what they touch
is NaN. Where the checks did read them (they raised on a bad one), the per-element guards are
left out: they could only select the value they guard.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, TypeVar

from ._checks import F32_TINY

if TYPE_CHECKING:
    from ._ops import Array, Ops

A = TypeVar("A", bound="Array")


def total(xp: Ops[A], x: A) -> A:
    """[B, L] or [B] -> []: the sum over every axis (the last first)."""
    return xp.rowsum(x) if len(x.shape) == 1 else xp.rowsum(xp.rowsum(x))


def anywhere(xp: Ops[A], bad: A) -> A:
    """[B, L] or [B] bool -> [] bool: any element set."""
    return xp.any_last(bad) if len(bad.shape) == 1 else xp.any_last(xp.any_last(bad))


def invalid_weights(xp: Ops[A], w: A) -> A:
    """[..., L] float32 -> [..., L] bool: a weight or mask that is negative or not finite."""
    return ~((w >= 0.0) & xp.isfinite(w))


def nan_where(xp: Ops[A], bad: A, x: A) -> A:
    """x, NaN where ``bad``."""
    return xp.where(bad, float("nan"), x)


def bad_weighted_sum(xp: Ops[A], w: A, read: bool) -> A:
    """[] bool: [B, L] weights a weighted sum cannot hold: one negative or non-finite, or a
    sum outside 0 and float32's normal range (``_checks.check_weight_sum``). ``read``: the
    checks read the weights (each one is finite and non-negative then; the float32 sum is
    still tested, as it may round past the largest float where the checks' float64 does not)."""
    den = total(xp, w)
    bad = ~xp.isfinite(den) | ((den > 0.0) & (den < F32_TINY))
    return bad if read else bad | anywhere(xp, invalid_weights(xp, w))
