"""The real-size GPU check's own code (``test_gpu.py`` runs it at N·K > 2^31 on a CUDA GPU,
``test_triton.py`` at a small shape in the interpreter, so that it is exercised on CPU)."""

from __future__ import annotations

import numpy as np
import torch

import oracle
from harness import assert_close, new_seed


def check_with_oracle(stats, dz, z, y, active, grads, **kw):
    """Statistics (lse, logp, entropy, kl; float32 tolerance) and bf16 d logits, as float64
    host arrays, against the float64 oracle at z [N, K] (grads: the four [N] cotangents)."""
    for name, got, e in zip(("lse", "logp", "entropy", "kl"), stats, oracle.token_stats(z, y, active, **kw)):
        assert_close(got, e, "float32", name)
    dz_exp, _ = oracle.token_stats_vjp(z, y, active, grads, **kw)
    assert_close(dz, dz_exp, "bfloat16", "d logits")
    return dz_exp


def check_rows_at_both_ends(device, n, k, teacher, ends):
    """token_stats (temperature 1.3, 10 % inactive rows) of bf16 [N, K] logits through the
    triton backend: statistics and d logits of the first and last ``ends`` rows against the
    float64 oracle. test_triton runs it at a small shape in the interpreter."""
    import dlm_kernels.torch as D

    gen = torch.Generator(device).manual_seed(new_seed())
    z = (torch.randn(n, k, generator=gen, device=device) * 3).to(torch.bfloat16).requires_grad_(True)
    u = (torch.randn(n, k, generator=gen, device=device) * 3).to(torch.bfloat16) if teacher else None
    y = torch.randint(0, k, (n,), generator=gen, device=device)
    w = (torch.rand(n, generator=gen, device=device) > 0.1).float()
    s = D.token_stats(z, y, w, teacher_logits=u, temperature=1.3, backend="triton")
    g_lp, g_h, g_kl = (torch.randn(n, generator=gen, device=device) for _ in range(3))
    (dz,) = torch.autograd.grad([s.logp, s.entropy, s.kl], z, [g_lp, g_h, g_kl])
    rows = torch.cat([torch.arange(ends), torch.arange(n - ends, n)]).to(device)
    pick = lambda t: t[rows].detach().double().cpu().numpy()
    zeros = np.zeros(2 * ends)
    g = (zeros, pick(g_lp), pick(g_h), pick(g_kl) if teacher else zeros)
    check_with_oracle([pick(v) for v in s], pick(dz), pick(z), y[rows].cpu().numpy(),  # int64 targets
                      pick(w) != 0, g, T=1.3, u=pick(u) if teacher else None)
