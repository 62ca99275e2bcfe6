"""Output buffers of the torch backends. ``empty`` is ``torch.empty``, except inside
``dlm_kernels.testing.poisoned_outputs()``, where it fills the buffer with NaN first (the
tests run inside it; integer buffers with their most negative value, never an id or a
count), so an element a backend leaves unwritten cannot pass for a value.
Off, it costs one attribute read."""

from __future__ import annotations

import torch


class Poison:
    """Whether ``empty`` fills its buffers with NaN (switched by ``poisoned_outputs``)."""

    enabled = False


def empty(shape, dtype, device):
    out = torch.empty(shape, dtype=dtype, device=device)
    if Poison.enabled:
        out.fill_(float("nan") if dtype.is_floating_point else torch.iinfo(dtype).min)
    return out
