"""A complete masked-diffusion generation loop in JAX with a tiny random model.

Each step scores the whole canvas, draws a token per position in one pass over the
vocabulary (``sample_tokens``: Gumbel-max at temperature T, the mask token suppressed), and
commits every still-masked position of the current block whose drawn token's probability
exceeds a threshold, at least one per sequence (Fast-dLLM's rule). The step is jitted.

    python examples/generate_jax.py
"""

import jax
import jax.numpy as jnp

import dlm_kernels.jax as dk

B, L, V, D = 2, 32, 500, 64
MASK = V - 1
BLOCK = 8

k_embed, k_pos, k_out, k_prompt = jax.random.split(jax.random.key(0), 4)
params = dict(embed=jax.random.normal(k_embed, (V, D)) * 0.5,
              position=jax.random.normal(k_pos, (L, D)) * 0.5,
              unembed=jax.random.normal(k_out, (D, V)) * 0.3)


def model(params, canvas):  # [B, L] ids -> [B, L, V] logits (a stand-in for a denoiser)
    h = params["embed"][canvas] + params["position"][None]
    h = h + jnp.tanh(h.mean(axis=1, keepdims=True))
    return h @ params["unembed"]


@jax.jit
def denoise_step(params, canvas, in_block, step):
    masked = (canvas == MASK) & in_block
    sample = dk.sample_tokens(model(params, canvas), temperature=0.7, seed=7, step=step,
                              suppress_ids=jnp.array([MASK]))
    return dk.commit_tokens(canvas, sample, masked, rule="threshold", threshold=0.5)


canvas = jnp.full((B, L), MASK).at[:, :4].set(jax.random.randint(k_prompt, (B, 4), 0, V - 1))
step = 0
for start in range(4, L, BLOCK):
    in_block = jnp.zeros((B, L), bool).at[:, start:start + BLOCK].set(True)
    while bool(((canvas == MASK) & in_block).any()):
        canvas, committed = denoise_step(params, canvas, in_block, jnp.int32(step))
        step += 1
        print(f"step {step:2d}: committed {int(committed.sum())}")
print("canvas:", canvas.tolist())
print("masked left:", int((canvas == MASK).sum()))
