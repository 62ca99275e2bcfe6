"""GRPO on a tiny masked-diffusion model in JAX with optax: rollouts with the denoising step,
scoring with ``per_token_logps``, and TRL's policy loss from a tied ``LinearHead`` (the
[B, L, K] logits never exist in the update). The rollout, the scoring and the update are
each jitted.

Each step draws G completions for each prompt by iterative unmasking (``sample_tokens`` on
the head, ``commit_tokens`` keeps the surest positions), rewards them (here: the share of
completion tokens in the lower quarter of the vocabulary), normalises the rewards within
each group into advantages, scores the completions once with the policy that sampled them
(``old_logps``) and with the frozen initial parameters (``ref_logps``), then takes
``num_iterations`` optax steps on ``policy_loss``. The scoring canvas is the prompt with
the whole completion masked (the one-step estimate diffusion GRPO variants use); the
completion mask is the batch's loss weights. The old log-probs are scored under ``jit`` as
the loss is: at a temperature other than 1, XLA on a CPU may round an eager call's
log-probs an ulp away from a jitted one's.

    pip install optax       # besides dlm-kernels[jax]
    python examples/grpo_step_jax.py
"""

from __future__ import annotations

import argparse
from functools import partial

import jax
import jax.numpy as jnp
import optax

import dlm_kernels.jax as dk

V, D = 64, 32  # vocabulary (the last id is the mask token), width
MASK = V - 1
PROMPT, COMPLETION = 4, 12
TEMPERATURE = 0.9  # of the rollouts, and so of every log-prob of the loss
STEPS_PER_ROLLOUT = 4
# a trained predictor never proposes the mask token: its logit is -inf
BIAS = jnp.zeros(V).at[MASK].set(-jnp.inf)


def init(key: jax.Array) -> dict[str, jax.Array]:
    k_embed, k_pos, k_1, k_2 = jax.random.split(key, 4)
    return dict(embed=jax.random.normal(k_embed, (V, D)) * 0.3,  # [V, D]: also the head
                position=jax.random.normal(k_pos, (PROMPT + COMPLETION, D)) * 0.3,
                w1=jax.random.normal(k_1, (D, 2 * D)) / D ** 0.5, b1=jnp.zeros(2 * D),
                w2=jax.random.normal(k_2, (2 * D, D)) / (2 * D) ** 0.5, b2=jnp.zeros(D))


def head(params: dict[str, jax.Array], tokens: jax.Array) -> dk.LinearHead:
    """[B, L] ids -> their logits as a tied LinearHead (never [B, L, V])."""
    h = params["embed"][tokens] + params["position"][None]
    mixed = h + h.mean(axis=1, keepdims=True)  # every position sees the canvas
    h = h + jax.nn.gelu(mixed @ params["w1"] + params["b1"]) @ params["w2"] + params["b2"]
    return dk.LinearHead(h, params["embed"], BIAS, weight_layout="KD")


@jax.jit
def rollout(params: dict[str, jax.Array], prompts: jax.Array, seeds: jax.Array) -> jax.Array:
    """Complete every prompt by unmasking COMPLETION // STEPS_PER_ROLLOUT positions a step."""
    canvas = jnp.concatenate([prompts, jnp.full((len(prompts), COMPLETION), MASK)], axis=1)
    for step in range(STEPS_PER_ROLLOUT):
        sample = dk.sample_tokens(head(params, canvas), temperature=TEMPERATURE, seed=seeds,
                                  step=step, suppress_ids=MASK)
        canvas, _ = dk.commit_tokens(canvas, sample, canvas == MASK,
                                     k=COMPLETION // STEPS_PER_ROLLOUT)
    return canvas


def scoring_batch(canvas: jax.Array) -> dk.DiffusionTokenBatch:
    """The completion masked in the model's input, its tokens the targets; the completion
    mask (1 on the completion, 0 on the prompt) the loss weights."""
    on_completion = jnp.arange(canvas.shape[1]) >= PROMPT  # [L]
    return dk.DiffusionTokenBatch.create(
        model_inputs=jnp.where(on_completion, MASK, canvas), target_ids=canvas,
        loss_weights=jnp.broadcast_to(on_completion, canvas.shape).astype(jnp.float32))


@jax.jit
def score(params: dict[str, jax.Array], batch: dk.DiffusionTokenBatch) -> jax.Array:
    return dk.per_token_logps(head(params, batch.model_inputs), batch, temperature=TEMPERATURE)


def advantages_of(rewards: jax.Array, group: int) -> jax.Array:
    """TRL's group-normalised advantages: (r - group mean) / (group std + 1e-4)."""
    r = rewards.reshape(-1, group)
    std = r.std(axis=1, ddof=1, keepdims=True)
    return ((r - r.mean(axis=1, keepdims=True)) / (std + 1e-4)).reshape(-1)


@partial(jax.jit, static_argnames=("optimizer", "beta"))
def update(params, opt_state, batch, old, ref, advantages, *, optimizer, beta):
    def loss_fn(params):
        result = dk.policy_loss(head(params, batch.model_inputs), batch, old_logps=old,
                                advantages=advantages, loss_type="dapo", beta=beta,
                                ref_logps=ref, temperature=TEMPERATURE, epsilon_high=0.28)
        return result.loss, result

    (_, result), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, result


def main(steps: int = 4, prompts: int = 2, group: int = 4, num_iterations: int = 2,
         beta: float = 0.04, seed: int = 0) -> list[dict[str, float]]:
    """Train for ``steps`` rollouts; return each update's loss and metrics."""
    k_model, k_prompt = jax.random.split(jax.random.key(seed))
    params = init(k_model)
    reference = params  # frozen: the initial parameters
    optimizer = optax.adamw(1e-2)
    opt_state = optimizer.init(params)
    prompt_ids = jnp.repeat(jax.random.randint(k_prompt, (prompts, PROMPT), 0, MASK), group,
                            axis=0)
    log = []
    for step in range(steps):
        seeds = jnp.arange(len(prompt_ids)) + 1000 * step  # one per sequence
        canvas = rollout(params, prompt_ids, seeds)
        rewards = (canvas[:, PROMPT:] < V // 4).mean(axis=1)
        batch = scoring_batch(canvas)
        old, ref = score(params, batch), score(reference, batch)
        advantages = advantages_of(rewards, group)
        for iteration in range(num_iterations):
            params, opt_state, result = update(params, opt_state, batch, old, ref, advantages,
                                               optimizer=optimizer, beta=beta)
            log.append(dict(step=step, iteration=iteration, reward=float(rewards.mean()),
                            loss=float(result.loss), kl=float(result.kl),
                            clip_ratio=float(result.clip_ratio_region),
                            entropy=float(result.entropy)))
            print("step {step} iteration {iteration}: reward {reward:.3f} loss {loss:+.4f} "
                  "kl {kl:.5f} clip {clip_ratio:.3f} entropy {entropy:.3f}".format(**log[-1]))
    return log


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=4)
    main(parser.parse_args().steps)
