"""LLaDA's semi-autoregressive generation loop in JAX, written against the upstream step
functions (``get_num_transfer_tokens``, ``get_transfer_index``) with a tiny random model.

The loop follows LLaDA's ``generate.py`` (blocks, steps per block, the linear schedule,
low-confidence remasking); the step is jitted, ``get_transfer_index`` reads the logits once
and per-sequence seeds make each sequence's draws independent of its batch neighbours.

    python examples/llada_step_jax.py
"""

import jax
import jax.numpy as jnp

import dlm_kernels.jax as dk

B, PROMPT, GEN, V, D = 2, 4, 16, 300, 32
MASK = V - 1
BLOCK, STEPS = 8, 8

k_embed, k_pos, k_out, k_prompt = jax.random.split(jax.random.key(0), 4)
params = dict(embed=jax.random.normal(k_embed, (V, D)) * 0.5,
              position=jax.random.normal(k_pos, (PROMPT + GEN, D)) * 0.5,
              unembed=jax.random.normal(k_out, (D, V)) * 0.3)


def model(params, x):  # [B, L] ids -> [B, L, V] logits (a stand-in for a mask predictor)
    h = params["embed"][x] + params["position"][None, :x.shape[1]]
    h = h + jnp.tanh(h.mean(axis=1, keepdims=True))
    return (h @ params["unembed"]).at[..., MASK].set(-jnp.inf)  # never the mask itself


@jax.jit
def denoise_step(params, x, block_end, k, seeds, step):
    mask_index = (x == MASK) & (jnp.arange(x.shape[1])[None, :] < block_end)
    x0, transfer_index = dk.get_transfer_index(model(params, x), 0.7, "low_confidence",
                                               mask_index, x, k, seed=seeds, step=step)
    return jnp.where(transfer_index, x0, x), transfer_index


def generate(prompt, seeds, steps=STEPS, gen_length=GEN, block_length=BLOCK):
    x = jnp.full((prompt.shape[0], prompt.shape[1] + gen_length), MASK, jnp.int32)
    x = x.at[:, :prompt.shape[1]].set(prompt)
    num_blocks = gen_length // block_length
    steps_per_block = steps // num_blocks
    step = 0
    for nb in range(num_blocks):
        start = prompt.shape[1] + nb * block_length
        num_transfer_tokens = dk.get_num_transfer_tokens(
            x[:, start:start + block_length] == MASK, steps_per_block)
        for i in range(steps_per_block):
            x, transfer_index = denoise_step(params, x, start + block_length,
                                             num_transfer_tokens[:, i], seeds, step)
            step += 1
            print(f"block {nb} step {i}: committed {int(transfer_index.sum())}")
    return x


prompt = jax.random.randint(k_prompt, (B, PROMPT), 0, V - 1)
seeds = jnp.array([11, 22])
out = generate(prompt, seeds)  # sequence b's draws keyed on seeds[b]: batch-invariant
print("canvas:", out.tolist())
print("masked left:", int((out == MASK).sum()))
