"""Peak resident memory of one torch token_stats forward+backward, in its own process.

Usage: python mem_probe.py BACKEND N K, or python mem_probe.py head N K D (a bfloat16
``LinearHead`` [K, D] over N hidden states, the chunked backend, gradients of the hidden
states and the weight): prints the bytes of VmHWM growth beyond the inputs (VmHWM is reset
through /proc/self/clear_refs after the inputs exist; tracemalloc does not see torch's
allocations). python mem_probe.py vmflags N K prints the VmFlags of the mapping that holds
the chunked backend's [N, K] gradient instead.
"""

import gc
import os
import re
import sys

import torch

import dlm_kernels.torch as D

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # for bench
from bench.memory import proc_status_bytes, reset_peak_rss  # noqa: E402


def head(n, k, d):
    torch.manual_seed(0)
    h = torch.randn(n, d, dtype=torch.bfloat16)
    w = (torch.randn(k, d) * 0.05).to(torch.bfloat16)
    y = torch.randint(0, k, (n,))

    def grads(h, w, y):
        h, w = h.detach().requires_grad_(True), w.detach().requires_grad_(True)
        s = D.token_stats(D.LinearHead(h, w, softcap=30.0), y, backend="chunked")
        return torch.autograd.grad(s.logp.sum(), (h, w))

    grads(h, w, y)  # warm-up at full size: compilations (a cold cache) fall outside the window
    gc.collect()
    base = proc_status_bytes("VmRSS")
    reset_peak_rss()
    dh, dw = grads(h, w, y)
    print(proc_status_bytes("VmHWM") - base)


def vma_flags(addr):
    """The VmFlags of the mapping holding address ``addr`` in this process (/proc/self/smaps)."""
    current = None
    with open("/proc/self/smaps") as f:
        for line in f:
            head = re.match(r"^([0-9a-f]+)-([0-9a-f]+) ", line)
            if head:
                current = int(head[1], 16) <= addr < int(head[2], 16)
            elif current and line.startswith("VmFlags:"):
                return line.split()[1:]
    raise SystemExit(f"no mapping holds {addr:#x}")


def vmflags(n, k):
    z = torch.randn(n, k, requires_grad=True)
    y = torch.randint(0, k, (n,))
    (g,) = torch.autograd.grad(D.token_stats(z, y, backend="chunked").logp.sum(), z)
    inside = -(-g.data_ptr() // (2 << 20)) * (2 << 20)  # the first whole 2 MiB page of it
    print(" ".join(vma_flags(inside)))


def main():
    if sys.argv[1] == "vmflags":
        return vmflags(int(sys.argv[2]), int(sys.argv[3]))
    if sys.argv[1] == "head":
        return head(*(int(a) for a in sys.argv[2:5]))
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
