"""``NewStorages``: which operations make new buffers of one shape (torch tests only)."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class NewStorages(TorchDispatchMode):
    """The new storages of the tensors of one shape (and dtype, when given) that operations
    return inside the mode (not an argument's: in-place operations and views make none), and
    the operations that returned them."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype | None = None):
        super().__init__()
        self.shape, self.dtype = tuple(shape), dtype
        self.storages: set[int] = set()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        given = {a.untyped_storage().data_ptr() for a in args if isinstance(a, torch.Tensor)}
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if (isinstance(t, torch.Tensor) and tuple(t.shape) == self.shape
                    and (self.dtype is None or t.dtype == self.dtype)
                    and t.untyped_storage().data_ptr() not in given):
                self.storages.add(t.untyped_storage().data_ptr())
                self.ops.append(str(func))
        return out
