"""The losses a user would run instead of ours: each objective written materialised, as the
upstream trainers write it (plain framework ops over [N, K] float32 logits).

ce: ``F.cross_entropy`` / jitted ``jax.nn.log_softmax`` CE; policy: TRL GRPOTrainer's loss
as it writes it: a log-softmax, the target's log-probability, the clipped importance ratio
against the rollout's log-probs, and the DAPO normaliser (masked sum over the mask's sum);
it skips the entropy TRL logs, which ours returns from the same pass (the comparison
favours the upstream); opd: the Tunix-style distillation loss,
T²·KL(softmax(u/T) ‖ softmax(z/T)) plus the weighted T = 1 CE; sft: the Megatron-Bridge
DiffusionGemma SFT loss, variant reweighted-loo-ce, as it writes it: the LOO shift
delta = log1p(K·alpha / max(1 - alpha, EPS)) added through ``one_hot(xt, K) * delta`` to the
float32 logits, a per-token CE, the mask, the time weight w = -alpha'(t) / alpha(t) with
alpha = 1 - t. The benchmark's weights are all 1, so each is the same loss as
``bench.cases.objective_loss``.
"""

from __future__ import annotations

T_OPD, HARD_OPD = 2.0, 0.5  # bench.cases.objective_loss's opd
EPS_CLIP = 0.2  # bench.cases.POLICY_EPSILON
EPS = 1e-12  # the schedule's clamp (dlm_kernels._schedule.EPS)


def _targets(objective, batch):
    """[N] target ids (a distillation batch holds them in its student batch)."""
    student = {"opd": lambda: batch.student_batch, "policy": lambda: batch.batch}.get(
        objective, lambda: batch)()
    return student.target_ids.reshape(-1)


def torch_sft_loss(z, batch):
    """The reweighted LOO SFT loss summed over the batch, materialised, in torch."""
    import torch
    import torch.nn.functional as F

    b, l, k = z.shape
    alpha = 1.0 - batch.t  # [B]
    w = 1.0 / alpha.clamp_min(EPS)  # -alpha'(t) / alpha(t), alpha' = -1
    delta = torch.log1p(k * alpha / (1.0 - alpha).clamp_min(EPS))  # [B]
    shifted = z.float() + F.one_hot(batch.xt, k) * delta[:, None, None]  # [B, L, K]
    ce = F.cross_entropy(shifted.reshape(-1, k), batch.x0.reshape(-1),
                         reduction="none").reshape(b, l)  # [B, L]
    mask = batch.loss_mask.float()
    return (w * (mask * ce).sum(-1) / mask.sum(-1).clamp_min(1.0)).sum()


def jax_sft_loss(z, batch):
    """The same loss in JAX, materialised (``jax.nn.one_hot``, ``jax.nn.log_softmax``)."""
    import jax
    import jax.numpy as jnp

    b, l, k = z.shape
    alpha = 1.0 - batch.t  # [B]
    w = 1.0 / jnp.maximum(alpha, EPS)
    delta = jnp.log1p(k * alpha / jnp.maximum(1.0 - alpha, EPS))  # [B]
    shifted = z.astype(jnp.float32) + jax.nn.one_hot(batch.xt, k) * delta[:, None, None]
    logp = jax.nn.log_softmax(shifted, -1)  # [B, L, K]
    ce = -jnp.take_along_axis(logp, batch.x0[..., None], -1)[..., 0]  # [B, L]
    mask = batch.loss_mask.astype(jnp.float32)
    return (w * (mask * ce).sum(-1) / jnp.maximum(mask.sum(-1), 1.0)).sum()


def torch_loss(objective, z, batch):
    import torch.nn.functional as F

    if objective == "sft":
        return torch_sft_loss(z, batch)
    k = z.shape[-1]
    y = _targets(objective, batch)
    zf = z.reshape(-1, k).float()  # [N, K]
    if objective == "ce":
        return F.cross_entropy(zf, y)
    if objective == "policy":
        import torch

        logp = F.log_softmax(zf, -1).gather(-1, y[:, None])[:, 0]  # [N]
        mask = batch.batch.loss_weights.reshape(-1)
        adv = batch.advantages.reshape(-1, 1).expand(z.shape[:-1]).reshape(-1)  # [N]
        ratio = torch.exp(logp - batch.old_logps.reshape(-1))
        per_token = -torch.min(ratio * adv, ratio.clamp(1 - EPS_CLIP, 1 + EPS_CLIP) * adv)
        return (per_token * mask).sum() / mask.sum().clamp_min(1.0)
    u = batch.teacher_logits.reshape(-1, k).float()
    lp_s, lp_t = F.log_softmax(zf / T_OPD, -1), F.log_softmax(u / T_OPD, -1)
    kl = (lp_t.exp() * (lp_t - lp_s)).sum(-1)
    return (T_OPD * T_OPD * kl).mean() + HARD_OPD * F.cross_entropy(zf, y)


def jax_loss(objective, z, batch):
    import jax
    import jax.numpy as jnp

    if objective == "sft":
        return jax_sft_loss(z, batch)
    k = z.shape[-1]
    y = _targets(objective, batch)
    zf = z.reshape(-1, k).astype(jnp.float32)  # [N, K]
    pick = lambda lp: jnp.take_along_axis(lp, y[:, None], -1)[:, 0]  # noqa: E731
    if objective == "ce":
        return -pick(jax.nn.log_softmax(zf, -1)).mean()
    if objective == "policy":
        logp = pick(jax.nn.log_softmax(zf, -1))  # [N]
        mask = batch.batch.loss_weights.reshape(-1)
        adv = jnp.broadcast_to(batch.advantages[:, None], z.shape[:-1]).reshape(-1)  # [N]
        ratio = jnp.exp(logp - batch.old_logps.reshape(-1))
        per_token = -jnp.minimum(ratio * adv, jnp.clip(ratio, 1 - EPS_CLIP, 1 + EPS_CLIP) * adv)
        return (per_token * mask).sum() / jnp.maximum(mask.sum(), 1.0)
    u = batch.teacher_logits.reshape(-1, k).astype(jnp.float32)
    lp_s = jax.nn.log_softmax(zf / T_OPD, -1)
    lp_t = jax.lax.stop_gradient(jax.nn.log_softmax(u / T_OPD, -1))
    kl = (jnp.exp(lp_t) * (lp_t - lp_s)).sum(-1)
    ce = -pick(jax.nn.log_softmax(zf, -1)).mean()
    return (T_OPD * T_OPD * kl).mean() + HARD_OPD * ce
