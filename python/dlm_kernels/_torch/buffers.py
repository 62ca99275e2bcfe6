"""Output buffers of the torch backends. ``empty`` is ``torch.empty``, except inside
``dlm_kernels.testing.poisoned_outputs()``, where it fills the buffer with NaN first (the
tests run inside it; integer buffers with their most negative value, never an id or a
count), so an element a backend leaves unwritten cannot pass for a value. Off, that costs an
attribute read.

A large CPU buffer is plain ``torch.empty`` memory, in the kernel's default pages. Asking
for 2 MiB pages (``madvise(MADV_HUGEPAGE)``) filled a fresh 2 GiB gradient in 180 ms
instead of 440 on a 2-core virtual machine when calls came back to back, but in 4-6 s when
the memory had been free a few seconds: a virtual machine that hands free 2 MiB blocks back
to its host (free page reporting) has each such page faulted in again by the host
(bench/NOTES.md, "Shifted tiles, dynamic threads, huge pages withdrawn").
"""

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
