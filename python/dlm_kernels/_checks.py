"""Input validation shared by both front ends.

Static checks (rank, shape, dtype) read only ``.shape`` and ``.dtype`` and are safe under
tracing. Value checks run only on concrete arrays (``xp.concrete(x)`` returns None for a
tracer) and look at active positions only. Every error names the argument and what was seen.
"""

from __future__ import annotations

import numpy as np

from ._common import shape_str


def _dtype(x) -> str:
    return str(getattr(x, "dtype", type(x).__name__)).replace("torch.", "")


def require_array(xp, name, x):
    if not xp.is_array(x):
        raise TypeError(f"{name} must be an array/tensor; got {type(x).__name__}")


def require_rank(xp, name, x, rank, layout):
    require_array(xp, name, x)
    if len(x.shape) != rank:
        raise ValueError(f"{name} must have shape {layout}; got {shape_str(x.shape)}")


def require_int(xp, name, x):
    if not xp.is_int(x):
        raise TypeError(f"{name} must have an integer dtype; got {_dtype(x)}")


def require_float(xp, name, x):
    if not xp.is_float(x):
        raise TypeError(f"{name} must have a floating dtype; got {_dtype(x)}")


def require_shape(name, x, shape, layout):
    if tuple(x.shape) != tuple(shape):
        raise ValueError(
            f"{name} must have shape {layout} = {shape_str(shape)}; got {shape_str(x.shape)}"
        )


# -- the token-statistics primitive ------------------------------------------------

def check_stats_inputs(xp, logits, targets, weights, shift_ids, shift, teacher_logits):
    """Static checks of ``token_stats`` arguments (leading dims ``...`` = rows)."""
    require_array(xp, "logits", logits)
    if len(logits.shape) < 1 or logits.shape[-1] < 1:
        raise ValueError(f"logits must have shape [..., K] with K >= 1; got {shape_str(logits.shape)}")
    require_float(xp, "logits", logits)
    rows = tuple(logits.shape[:-1])
    require_array(xp, "targets", targets)
    require_int(xp, "targets", targets)
    require_shape("targets", targets, rows, "logits.shape[:-1]")
    if weights is not None:
        require_array(xp, "weights", weights)
        require_shape("weights", weights, rows, "logits.shape[:-1]")
    if (shift_ids is None) != (shift is None):
        raise ValueError("shift_ids and shift must be given together (LOO shift); got only one")
    if shift_ids is not None:
        require_array(xp, "shift_ids", shift_ids)
        require_int(xp, "shift_ids", shift_ids)
        require_shape("shift_ids", shift_ids, rows, "logits.shape[:-1]")
        if xp.is_array(shift):
            require_float(xp, "shift", shift)
            if tuple(shift.shape) not in ((), rows):
                raise ValueError(
                    f"shift must be a scalar or have shape logits.shape[:-1] = {shape_str(rows)}; "
                    f"got {shape_str(shift.shape)}"
                )
    if teacher_logits is not None:
        require_array(xp, "teacher_logits", teacher_logits)
        require_float(xp, "teacher_logits", teacher_logits)
        require_shape("teacher_logits", teacher_logits, logits.shape, "logits.shape")


# -- the Tunix batch contract --------------------------------------------------------

def check_token_batch_static(xp, model_inputs, target_ids, loss_weights):
    require_rank(xp, "model_inputs", model_inputs, 2, "[B, L]")
    require_int(xp, "model_inputs", model_inputs)
    require_array(xp, "target_ids", target_ids)
    require_shape("target_ids", target_ids, model_inputs.shape, "model_inputs.shape [B, L]")
    require_int(xp, "target_ids", target_ids)
    require_array(xp, "loss_weights", loss_weights)
    require_shape("loss_weights", loss_weights, model_inputs.shape, "model_inputs.shape [B, L]")
    require_float(xp, "loss_weights", loss_weights)


def check_token_batch_values(xp, target_ids, loss_weights, vocab_size=None, allow_sync=True):
    """Finite non-negative weights; active targets in [0, K) (K when known).

    Scoring calls pass ``allow_sync=False``: accelerator arrays are then not pulled to the
    host (an out-of-range active target still shows as a NaN log-prob, never silently).
    """
    w = xp.concrete(loss_weights, allow_sync)
    if w is None:
        return
    bad = ~np.isfinite(w) | (w < 0)
    if bad.any():
        idx = tuple(int(i) for i in np.argwhere(bad)[0])
        raise ValueError(
            f"loss_weights must be finite and non-negative; got {w[idx]!r} at index {idx}"
        )
    y = xp.concrete(target_ids, allow_sync)
    if y is None:
        return
    active = w != 0
    bad = active & ((y < 0) | ((y >= vocab_size) if vocab_size is not None else False))
    if bad.any():
        idx = tuple(int(i) for i in np.argwhere(bad)[0])
        bound = f"[0, {vocab_size})" if vocab_size is not None else ">= 0"
        raise ValueError(
            f"target_ids at active positions must be in {bound}; got {int(y[idx])} at index {idx}"
        )


def check_logits_for_batch(xp, name, logits, batch_shape):
    require_rank(xp, name, logits, 3, "[B, L, K]")
    require_float(xp, name, logits)
    if tuple(logits.shape[:2]) != tuple(batch_shape):
        raise ValueError(
            f"{name} must have shape [B, L, K] with [B, L] = {shape_str(batch_shape)} "
            f"(the batch's shape); got {shape_str(logits.shape)}"
        )
    if logits.shape[2] < 1:
        raise ValueError(f"{name} must have a vocabulary axis K >= 1; got {shape_str(logits.shape)}")


def check_teacher_values(xp, teacher_logits, loss_weights):
    """Teacher logits must be finite at active positions (concrete host arrays only: a scoring
    call never syncs an accelerator; a non-finite teacher there gives a NaN loss)."""
    u = xp.concrete(teacher_logits, allow_sync=False)
    w = xp.concrete(loss_weights, allow_sync=False)
    if u is None or w is None:
        return
    bad = ~np.isfinite(u) & (w != 0)[..., None]
    if bad.any():
        idx = tuple(int(i) for i in np.argwhere(bad)[0])
        raise ValueError(
            f"teacher_logits must be finite at active positions; got {u[idx]!r} at index {idx}"
        )
