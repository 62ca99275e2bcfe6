"""Output buffers of the torch backends. ``empty`` is ``torch.empty``, except

- inside ``dlm_kernels.testing.poisoned_outputs()``, where it fills the buffer with NaN first
  (the tests run inside it; integer buffers with their most negative value, never an id or a
  count), so an element a backend leaves unwritten cannot pass for a value;
- for a large CPU buffer on Linux, whose pages are asked to be huge (2 MiB) before anything
  touches them (``madvise(MADV_HUGEPAGE)``). A fresh [N, K] gradient is fresh memory from
  the kernel, and faulting it in 4 KiB pages cost more than writing it: 512 MiB took 115 ms
  to fill fresh and 44 ms in huge pages on a 2-core Xeon (bench/NOTES.md,
  "Compiled loops and huge pages"). Where transparent huge pages are off the advice changes nothing.

Off, both cost an attribute read and a comparison.
"""

from __future__ import annotations

import ctypes
import mmap
import sys

import torch

LARGE_BYTES = 32 << 20  # a CPU buffer of at least this many bytes gets the huge-page advice
HUGE_PAGE = 2 << 20


class Poison:
    """Whether ``empty`` fills its buffers with NaN (switched by ``poisoned_outputs``)."""

    enabled = False


def _madvise():
    """libc's ``madvise`` on Linux, else None."""
    if sys.platform != "linux":
        return None
    fn = ctypes.CDLL(None, use_errno=True).madvise
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


_MADVISE = _madvise()


def advise_huge_pages(x: torch.Tensor) -> bool:
    """Ask for huge pages over the whole 2 MiB pages inside x's memory (CPU, untouched yet:
    pages already faulted in stay small). True when the kernel took the advice."""
    if _MADVISE is None or sys.platform != "linux":
        return False
    start = -(-x.data_ptr() // HUGE_PAGE) * HUGE_PAGE
    end = (x.data_ptr() + x.nbytes) // HUGE_PAGE * HUGE_PAGE
    return end > start and _MADVISE(start, end - start, mmap.MADV_HUGEPAGE) == 0


def empty(shape, dtype, device):
    out = torch.empty(shape, dtype=dtype, device=device)
    if out.nbytes >= LARGE_BYTES and out.device.type == "cpu":
        advise_huge_pages(out)
    if Poison.enabled:
        out.fill_(float("nan") if dtype.is_floating_point else torch.iinfo(dtype).min)
    return out
