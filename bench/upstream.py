"""The losses a user would run instead of ours: each objective written materialised, as the
upstream trainers write it (plain framework ops over [N, K] float32 logits).

ce: ``F.cross_entropy`` / jitted ``jax.nn.log_softmax`` CE; policy: log-softmax, the
target's log-probability and the entropy; opd: the Tunix-style distillation loss,
T²·KL(softmax(u/T) ‖ softmax(z/T)) plus the weighted T = 1 CE. The benchmark's weights are
all 1, so each is the same loss as ``bench.cases.objective_loss``.
"""

from __future__ import annotations

T_OPD, HARD_OPD = 2.0, 0.5  # bench.cases.objective_loss's opd


def _targets(objective, batch):
    """[N] target ids (a distillation batch holds them in its student batch)."""
    student = batch.student_batch if objective == "opd" else batch
    return student.target_ids.reshape(-1)


def torch_loss(objective, z, batch):
    import torch.nn.functional as F

    k = z.shape[-1]
    y = _targets(objective, batch)
    zf = z.reshape(-1, k).float()  # [N, K]
    if objective == "ce":
        return F.cross_entropy(zf, y)
    if objective == "policy":
        logp = F.log_softmax(zf, -1)  # [N, K]
        entropy = -(logp.exp() * logp).sum(-1)
        return logp.gather(-1, y[:, None]).sum() + 0.01 * entropy.sum()
    u = batch.teacher_logits.reshape(-1, k).float()
    lp_s, lp_t = F.log_softmax(zf / T_OPD, -1), F.log_softmax(u / T_OPD, -1)
    kl = (lp_t.exp() * (lp_t - lp_s)).sum(-1)
    return (T_OPD * T_OPD * kl).mean() + HARD_OPD * F.cross_entropy(zf, y)


def jax_loss(objective, z, batch):
    import jax
    import jax.numpy as jnp

    k = z.shape[-1]
    y = _targets(objective, batch)
    zf = z.reshape(-1, k).astype(jnp.float32)  # [N, K]
    pick = lambda lp: jnp.take_along_axis(lp, y[:, None], -1)[:, 0]  # noqa: E731
    if objective == "ce":
        return -pick(jax.nn.log_softmax(zf, -1)).mean()
    if objective == "policy":
        logp = jax.nn.log_softmax(zf, -1)
        entropy = -(jnp.exp(logp) * logp).sum(-1)
        return pick(logp).sum() + 0.01 * entropy.sum()
    u = batch.teacher_logits.reshape(-1, k).astype(jnp.float32)
    lp_s = jax.nn.log_softmax(zf / T_OPD, -1)
    lp_t = jax.lax.stop_gradient(jax.nn.log_softmax(u / T_OPD, -1))
    kl = (jnp.exp(lp_t) * (lp_t - lp_s)).sum(-1)
    ce = -pick(jax.nn.log_softmax(zf, -1)).mean()
    return (T_OPD * T_OPD * kl).mean() + HARD_OPD * ce
