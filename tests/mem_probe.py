"""Peak resident memory of one torch token_stats forward+backward, in its own process.

Usage: python mem_probe.py BACKEND N K. Prints the bytes of VmHWM growth beyond the inputs
(VmHWM is reset through /proc/self/clear_refs after the inputs exist; tracemalloc does not
see torch's allocations).
"""

import gc
import os
import sys

import torch

import dlm_kernels.torch as D

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # for bench
from bench.memory import proc_status_bytes, reset_peak_rss  # noqa: E402


def main():
    backend, n, k = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    torch.manual_seed(0)
    z = torch.randn(n, k) * 3  # [N, K] f32, random (never zero)
    y = torch.randint(0, k, (n,))
    rows = min(n, 4)  # a warm-up call on the same paths (they depend on K alone): it compiles
    warm = D.token_stats(z[:rows].requires_grad_(True), y[:rows], backend=backend)
    warm.logp.sum().backward()
    z.requires_grad_(True)
    gc.collect()
    base = proc_status_bytes("VmRSS")
    reset_peak_rss()
    s = D.token_stats(z, y, backend=backend)
    (g,) = torch.autograd.grad(s.logp.sum() + s.entropy.sum(), z)
    print(proc_status_bytes("VmHWM") - base)


if __name__ == "__main__":
    main()
