"""Benchmark cases: one objective x framework x backend at one shape, as timed closures.

Every case builds ``ROTATE`` independent random input sets (never zeros) so repeated calls
do not re-read a cached copy, and exposes ``fwd(i)``, ``bwd(i)`` and ``fwdbwd(i)`` on set i,
plus a way to measure peak memory beyond its inputs.
"""

from __future__ import annotations

import numpy as np

ROTATE = 2


def _np_inputs(rng, n, k):
    z = (rng.standard_normal((1, n, k), dtype=np.float32) * 3).astype(np.float32)
    u = (rng.standard_normal((1, n, k), dtype=np.float32) * 3).astype(np.float32)
    y = rng.integers(0, k, (1, n)).astype(np.int64)
    return z, u, y


# -- torch -----------------------------------------------------------------------------------

class TorchCase:
    """``variant``: a backend name, or "reference+compile" (torch.compile of the reference),
    or "liger" (Liger-Kernel's cross entropy; ce only)."""

    framework = "torch"

    def __init__(self, objective, variant, n, k, dtype, device, seed=0):
        import torch

        import dlm_kernels.torch as D

        self.torch, self.D = torch, D
        self.objective, self.variant = objective, variant
        self.device = torch.device(device)
        tdtype = getattr(torch, dtype)
        rng = np.random.default_rng(seed)
        self.sets = []
        for _ in range(ROTATE):
            z, u, y = _np_inputs(rng, n, k)
            z = torch.from_numpy(z).to(self.device, tdtype).requires_grad_(True)
            u = torch.from_numpy(u).to(self.device, tdtype) if objective == "opd" else None
            y = torch.from_numpy(y).to(self.device)
            w = torch.ones(y.shape, dtype=torch.float32, device=self.device)
            batch = D.DiffusionTokenBatch.create(model_inputs=y, target_ids=y, loss_weights=w)
            if u is not None:
                batch = D.DiffusionDistillationBatch.create(student_batch=batch, teacher_logits=u)
            self.sets.append((z, batch))
        self._loss = self._make_loss()
        self._graphs = {}

    def _make_loss(self):
        D, torch, obj = self.D, self.torch, self.objective
        backend = "reference" if self.variant == "reference+compile" else self.variant
        if self.variant == "liger":
            from liger_kernel.transformers import LigerCrossEntropyLoss

            ce = LigerCrossEntropyLoss(reduction="sum")
            return lambda z, b: ce(z.view(-1, z.shape[-1]), b.target_ids.view(-1))

        def loss(z, b):
            if obj == "ce":
                return D.weighted_cross_entropy(z, b, backend=backend).compute()
            if obj == "policy":
                lp, ent = D.per_token_logps(z, b, stop_gradient=False, return_entropy=True,
                                            backend=backend)
                return lp.sum() + 0.01 * ent.sum()
            total, _ = D.opd_loss(z, b, temperature=2.0, soft_loss_weight=1.0,
                                  hard_loss_weight=0.5, backend=backend)
            return total.compute()

        if self.variant == "reference+compile":
            return torch.compile(loss)
        return loss

    def fwd(self, i):
        z, b = self.sets[i % ROTATE]
        return self._loss(z, b)

    def fwdbwd(self, i):
        z, b = self.sets[i % ROTATE]
        return self.torch.autograd.grad(self._loss(z, b), z)

    def prepare_bwd(self):
        self._graphs = {i: self.fwd(i) for i in range(ROTATE)}

    def bwd(self, i):
        z, _ = self.sets[i % ROTATE]
        return self.torch.autograd.grad(self._graphs[i % ROTATE], z, retain_graph=True)

    def release(self):
        self._graphs = {}

    def cuda_peak_bytes(self):
        torch = self.torch
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        grads = self.fwdbwd(0)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
        del grads
        return peak


# -- JAX ---------------------------------------------------------------------------------------

class JaxCase:
    """``variant``: a backend name; every JAX case runs under ``jax.jit``. The backward time
    is derived as time(value_and_grad) - time(forward) and labelled so."""

    framework = "jax"

    def __init__(self, objective, variant, n, k, dtype, device=None, seed=0):
        import jax
        import jax.numpy as jnp

        import dlm_kernels.jax as D

        self.jax, self.objective, self.variant = jax, objective, variant
        rng = np.random.default_rng(seed)
        jdtype = getattr(jnp, dtype)
        self.sets = []
        for _ in range(ROTATE):
            z, u, y = _np_inputs(rng, n, k)
            y = jnp.asarray(y, jnp.int32)
            b = D.DiffusionTokenBatch.create(model_inputs=y, target_ids=y,
                                             loss_weights=jnp.ones(y.shape, jnp.float32))
            if objective == "opd":
                b = D.DiffusionDistillationBatch.create(student_batch=b,
                                                        teacher_logits=jnp.asarray(u, jdtype))
            self.sets.append((jnp.asarray(z, jdtype), b))

        def loss(z, b):
            if objective == "ce":
                return D.weighted_cross_entropy(z, b, backend=variant).compute()
            if objective == "policy":
                lp, ent = D.per_token_logps(z, b, stop_gradient=False, return_entropy=True,
                                            backend=variant)
                return lp.sum() + 0.01 * ent.sum()
            total, _ = D.opd_loss(z, b, temperature=2.0, soft_loss_weight=1.0,
                                  hard_loss_weight=0.5, backend=variant)
            return total.compute()

        self._fwd = jax.jit(loss)
        self._fb = jax.jit(jax.value_and_grad(loss))

    def fwd(self, i):
        z, b = self.sets[i % ROTATE]
        return self._fwd(z, b).block_until_ready()

    def fwdbwd(self, i):
        z, b = self.sets[i % ROTATE]
        return self.jax.block_until_ready(self._fb(z, b))

    def temp_bytes(self):
        z, b = self.sets[0]
        return int(self._fb.lower(z, b).compile().memory_analysis().temp_size_in_bytes)
