"""Benchmark cases: one objective x framework x backend at one shape, as timed closures.

Every case builds ``ROTATE`` independent random input sets (never zeros) so repeated calls
do not re-read a cached copy, and exposes ``fwd(i)``, ``bwd(i)`` and ``fwdbwd(i)`` on set i,
plus a way to measure peak memory beyond its inputs.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from .upstream import jax_loss, torch_loss

ROTATE = 2
#: float32 [N, K] tensors beside its inputs that the eager upstream loss (the hungriest
#: variant timed) holds at its peak, per objective: autograd's saved tensors and the
#: temporaries alive with them (sft's int64 ``one_hot`` counts twice)
UPSTREAM_PEAK_TENSORS = {"ce": 3, "policy": 4, "sft": 5, "opd": 6}
SFT_VARIANT = "reweighted-loo-ce"  # the Megatron-Bridge DiffusionGemma SFT loss timed as "sft"


class SftInputs(NamedTuple):
    """One SFT batch beside the logits [B, L, K] (a pytree under ``jax.jit``)."""

    x0: Any  # [B, L] clean token ids
    xt: Any  # [B, L] noisy token ids (the LOO shift's column)
    t: Any  # [B] float32 diffusion times in (0.05, 0.95)
    loss_mask: Any  # [B, L] float32 ones


class PolicyInputs(NamedTuple):
    """One RL batch beside the logits [B, L, K]: the scored tokens and what the rollout saw
    (a pytree under ``jax.jit``)."""

    batch: Any  # DiffusionTokenBatch: target ids [B, L], the completion mask as loss weights
    old_logps: Any  # [B, L] float32 log-probs of the targets under the rollout policy
    advantages: Any  # [B] float32


#: the GRPO loss timed as "policy": TRL GRPOTrainer's default loss type, its default clip
POLICY_LOSS_TYPE, POLICY_EPSILON = "dapo", 0.2


def policy_inputs(batch, logps, noise, advantages):
    """``PolicyInputs`` whose old log-probs are the current ones moved by ``noise`` (so some
    ratios fall outside the clip range, as after a few optimizer steps)."""
    return PolicyInputs(batch=batch, old_logps=logps + noise, advantages=advantages)


def case_bytes(objective, n, k, dtype, rotate, own_sets=0):
    """Estimated peak bytes of one case with ``rotate`` input sets: each set's logits (and
    teacher), the gradient, and per set the graph the separate backward timing holds, at the
    upstream loss's peak (``UPSTREAM_PEAK_TENSORS``); ``own_sets``: how many variants draw
    input sets of their own (``writes_inputs``), each ``rotate`` more sets of inputs."""
    logits = n * k * (2 if dtype in ("bfloat16", "float16") else 4)
    inputs = logits * (2 if objective == "opd" else 1)
    return (rotate * (inputs * (1 + own_sets) + UPSTREAM_PEAK_TENSORS[objective] * n * k * 4)
            + logits)


#: float32 [N, K] tensors alive at once in the eager / jitted upstream losses' forward and
#: backward, one input set (jitted OPD at N 4096, K 131072 float32 passed 24 GB: 11 of them)
UPSTREAM_EAGER_TENSORS = {"ce": 4, "policy": 5, "sft": 6, "opd": 11}


def upstream_bytes(objective, n, k, dtype):
    """Estimated peak bytes of the eager or jitted upstream loss on one input set: its
    inputs and ``UPSTREAM_EAGER_TENSORS`` float32 [N, K] temporaries."""
    logits = n * k * (2 if dtype in ("bfloat16", "float16") else 4)
    inputs = logits * (2 if objective == "opd" else 1)
    return inputs + UPSTREAM_EAGER_TENSORS[objective] * n * k * 4


def rotate_sets(objective, n, k, dtype, budget_bytes, own_sets=0):
    """``ROTATE`` input sets, or 1 where that many would not fit in ``budget_bytes``
    (``case_bytes``). One set loses nothing at such sizes: its logits are far past any
    cache, so each call reads them from memory again."""
    fits = case_bytes(objective, n, k, dtype, ROTATE, own_sets) <= budget_bytes
    return ROTATE if fits else 1


#: the suffix of a variant of ours that writes the logits' gradient over the logits
#: (``inplace_grad=True``; torch, the policy objective): "chunked+inplace"
INPLACE = "+inplace"


def ours_backend(variant):
    """(backend, inplace_grad) of a variant of ours: "chunked+inplace" -> ("chunked", True)."""
    if variant.endswith(INPLACE):
        return variant[:-len(INPLACE)], True
    return variant, False


def writes_inputs(variant):
    """Whether a variant writes its gradient into its input logits (Liger; ours in place):
    it needs input sets of its own, and after its first call they hold gradients (the pass
    structure, and so the timing, is the same; the values are not meaningful)."""
    return variant == "liger" or variant.endswith(INPLACE)


def objective_loss(dk, objective, z, batch, backend, inplace_grad=False):
    """The scalar loss of one benchmarked objective through front end dk (torch or JAX):
    ce = weighted CE; policy = TRL's GRPO loss (``policy_loss``, loss type dapo, off-policy
    ratios, the entropy metric from the same pass);
    opd = on-policy distillation, T = 2 soft KL plus a 0.5-weighted hard CE;
    sft = the Megatron-Bridge SFT loss, variant reweighted-loo-ce, summed over the batch.
    ``inplace_grad``: policy only (the objective that takes it)."""
    if inplace_grad and objective != "policy":
        raise ValueError(f"an in-place variant is benchmarked for the policy objective only; "
                         f"got objective {objective!r}")
    if objective == "sft":
        return dk.diffusion_sft_loss(z, batch.x0, batch.xt, batch.t, batch.loss_mask,
                                     variant=SFT_VARIANT, vocab_size=z.shape[-1],
                                     backend=backend).sum()
    if objective == "ce":
        return dk.weighted_cross_entropy(z, batch, backend=backend).compute()
    if objective == "policy":
        return dk.policy_loss(z, batch.batch, old_logps=batch.old_logps,
                              advantages=batch.advantages, loss_type=POLICY_LOSS_TYPE,
                              epsilon=POLICY_EPSILON, inplace_grad=inplace_grad,
                              backend=backend).loss
    total, _ = dk.opd_loss(z, batch, temperature=2.0, soft_loss_weight=1.0, hard_loss_weight=0.5,
                          backend=backend)
    return total.compute()




# -- torch -----------------------------------------------------------------------------------

class TorchCase:
    """``variant``: a backend name, or "reference+compile" (torch.compile of the reference),
    "upstream" / "upstream+compile" (the materialised loss users write, bench/upstream.py,
    eager or under torch.compile), or "liger" (Liger-Kernel's cross entropy; ce only), or a
    backend with "+inplace" (ours with ``inplace_grad=True``; policy only). Liger writes its
    gradient into the logits during the forward pass, ours in place during the backward, so
    after the first call their inputs hold gradients: the pass structure (and so the timing)
    is the same, the values are not meaningful. ``rotate``: how many input sets the calls
    cycle through (``ROTATE``; 1 where two would not fit in memory, ``rotate_sets``).
    ``sets``: another case's input sets to use instead of drawing new ones (the variants of
    one shape timed side by side read the same tensors; never those of a variant that writes
    into them, ``writes_inputs``)."""

    framework = "torch"

    def __init__(self, objective, variant, n, k, dtype, device, seed=0, rotate=ROTATE, sets=None):
        import torch

        import dlm_kernels.torch as dk

        self.torch, self.dk = torch, dk
        self.objective, self.variant = objective, variant
        self.device = torch.device(device)
        self._loss = self._make_loss()
        self._graphs = {}
        # compiled backwards donate their buffers, and an in-place backward overwrites the
        # logits its graph saved (a second backward of one graph raises): no retain_graph,
        # so bwd is derived there
        self.separate_bwd = not (variant.endswith("+compile") or variant.endswith(INPLACE))
        if sets is not None:  # another case's inputs (``sets``): the same draw, no copy
            self.rotate, self.sets = len(sets), sets
            return
        tdtype = getattr(torch, dtype)
        gen = torch.Generator(self.device).manual_seed(seed)  # inputs drawn on the device

        def normal():  # [1, N, K] logits of scale 3, never zero
            return (torch.randn((1, n, k), generator=gen, device=self.device) * 3).to(tdtype)

        def ids():  # [1, N]
            return torch.randint(0, k, (1, n), generator=gen, device=self.device)

        self.rotate, self.sets = rotate, []
        for _ in range(rotate):
            z = normal().requires_grad_(True)
            u = normal() if objective == "opd" else None
            y = ids()
            w = torch.ones(y.shape, dtype=torch.float32, device=self.device)
            batch = dk.DiffusionTokenBatch.create(model_inputs=y, target_ids=y, loss_weights=w)
            if objective == "sft":
                t = 0.05 + 0.9 * torch.rand((1,), generator=gen, device=self.device)  # [B]
                batch = SftInputs(x0=y, xt=ids(), t=t, loss_mask=w)
            if u is not None:
                batch = dk.DiffusionDistillationBatch.create(student_batch=batch, teacher_logits=u)
            if objective == "policy":
                logps = dk.per_token_logps(z.detach(), batch)  # [1, N]
                noise = 0.3 * torch.randn(logps.shape, generator=gen, device=self.device)
                adv = torch.randn((1,), generator=gen, device=self.device)  # [B]
                batch = policy_inputs(batch, logps, noise, adv)
            self.sets.append((z, batch))

    def _make_loss(self):
        dk, torch, obj = self.dk, self.torch, self.objective
        backend, inplace = ours_backend(
            "reference" if self.variant == "reference+compile" else self.variant)
        if self.variant.startswith("upstream"):
            if self.variant == "upstream":
                return lambda z, b: torch_loss(obj, z, b)
            torch._dynamo.reset()  # a static graph per case (see reference+compile below)
            return torch.compile(lambda z, b: torch_loss(obj, z, b), dynamic=False)
        if self.variant == "liger":
            from liger_kernel.transformers import LigerCrossEntropyLoss

            # the mean over tokens: the benchmark's weights are all 1, so this is the same
            # loss as ours (weighted_cross_entropy's sum over the sum of the weights)
            ce = LigerCrossEntropyLoss(reduction="mean")
            return lambda z, b: ce(z.view(-1, z.shape[-1]), b.target_ids.view(-1))

        def loss(z, b):
            return objective_loss(dk, obj, z, b, backend, inplace)

        if self.variant == "reference+compile":
            # Each case compiles afresh at its static shape. Dynamo keys its cache on the code
            # object of `loss`, which every case shares: without the reset, the second shape
            # recompiles with symbolic sizes, and after 8 (objective, shape) pairs it hits its
            # recompile limit and runs the reference eagerly under this variant's name.
            torch._dynamo.reset()
            return torch.compile(loss, dynamic=False)
        return loss

    def fwd(self, i):
        z, b = self.sets[i % self.rotate]
        return self._loss(z, b)

    def fwdbwd(self, i):
        z, b = self.sets[i % self.rotate]
        return self.torch.autograd.grad(self._loss(z, b), z)

    def prepare_bwd(self):
        self._graphs = {i: self.fwd(i) for i in range(self.rotate)}

    def bwd(self, i):
        z, _ = self.sets[i % self.rotate]
        return self.torch.autograd.grad(self._graphs[i % self.rotate], z, retain_graph=True)

    def release(self):
        self._graphs = {}


# -- JAX ---------------------------------------------------------------------------------------

class JaxCase:
    """``variant``: a backend name, or "upstream" (bench/upstream.py: the materialised loss,
    jitted ``jax.nn.log_softmax``); every JAX case runs under ``jax.jit``. The backward time
    is derived as time(value_and_grad) - time(forward) and labelled so. ``sets``: another
    case's input sets, as for ``TorchCase``."""

    framework = "jax"

    def __init__(self, objective, variant, n, k, dtype, device=None, seed=0, rotate=ROTATE,
                 sets=None):
        import jax
        import jax.numpy as jnp

        import dlm_kernels.jax as dk

        self.jax, self.objective, self.variant = jax, objective, variant
        jdtype = getattr(jnp, dtype)
        keys = iter(jax.random.split(jax.random.key(seed), 6 * rotate))  # drawn on the device
        normal = lambda: (jax.random.normal(next(keys), (1, n, k), jnp.float32) * 3).astype(jdtype)
        ids = lambda: jax.random.randint(next(keys), (1, n), 0, k, jnp.int32)  # [1, N]
        self.rotate, self.sets = (rotate, []) if sets is None else (len(sets), sets)
        for _ in range(rotate if sets is None else 0):
            z = normal()
            y = ids()
            b = dk.DiffusionTokenBatch.create(model_inputs=y, target_ids=y,
                                             loss_weights=jnp.ones(y.shape, jnp.float32))
            if objective == "sft":
                t = jax.random.uniform(next(keys), (1,), jnp.float32, 0.05, 0.95)  # [B]
                b = SftInputs(x0=y, xt=ids(), t=t, loss_mask=b.loss_weights)
            if objective == "opd":
                b = dk.DiffusionDistillationBatch.create(student_batch=b, teacher_logits=normal())
            if objective == "policy":
                logps = dk.per_token_logps(z, b)  # [1, N]
                noise = 0.3 * jax.random.normal(next(keys), logps.shape, jnp.float32)
                b = policy_inputs(b, logps, noise, jax.random.normal(next(keys), (1,), jnp.float32))
            self.sets.append((z, b))

        def loss(z, b):
            if variant == "upstream":
                return jax_loss(objective, z, b)
            return objective_loss(dk, objective, z, b, variant)

        self._fwd = jax.jit(loss)
        self._fb = jax.jit(jax.value_and_grad(loss))

    def fwd(self, i):
        z, b = self.sets[i % self.rotate]
        return self._fwd(z, b).block_until_ready()

    def fwdbwd(self, i):
        z, b = self.sets[i % self.rotate]
        return self.jax.block_until_ready(self._fb(z, b))

    def temp_bytes(self):
        z, b = self.sets[0]
        return int(self._fb.lower(z, b).compile().memory_analysis().temp_size_in_bytes)
