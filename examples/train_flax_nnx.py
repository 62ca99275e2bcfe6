"""A Flax NNX training step with optax: a tiny masked-diffusion denoiser whose unembedding is
its own input embedding (tied), given to the loss as a ``LinearHead`` so the [B, L, K] logits
and their gradient never exist.

The batch is Tunix's contract (``DiffusionTokenBatch``: the noisy canvas and the time as
model inputs, the clean tokens as targets, the MDLM weight 1/t at masked positions), the
logits function returns ``LinearHead(hidden, embed.embedding, weight_layout="KD")`` (an
``nnx.Embed`` table is [K, D]), ``compute_diffusion_logits`` checks both, and
``weighted_cross_entropy`` is the loss. Gradients reach the embedding twice: through the
input lookup and through the head.

    pip install flax optax       # besides dlm-kernels[jax]
    python examples/train_flax_nnx.py --steps 30
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import optax
from flax import nnx

import dlm_kernels.jax as dk


class TinyDenoiser(nnx.Module):
    """[B, L] token ids and [B] times -> [B, L, D] hidden states (a stand-in for a
    bidirectional transformer: embeddings, positions, the time, one global mixing layer)."""

    def __init__(self, vocab: int, dim: int, length: int, *, rngs: nnx.Rngs):
        self.embed = nnx.Embed(vocab, dim, rngs=rngs)  # [K, D], also the unembedding
        self.position = nnx.Param(jax.random.normal(rngs.params(), (length, dim)) * 0.1)
        self.time = nnx.Linear(1, dim, rngs=rngs)
        self.mix = nnx.Linear(dim, dim, rngs=rngs)
        self.norm = nnx.RMSNorm(dim, rngs=rngs)

    def __call__(self, tokens: jax.Array, time: jax.Array) -> jax.Array:
        h = self.embed(tokens) + self.position[...][None] + self.time(time[:, None])[:, None]
        h = h + jax.nn.gelu(self.mix(h.mean(axis=1, keepdims=True)))  # [B, L, D]
        return self.norm(h)


def logits_fn(model: TinyDenoiser, inputs: dict[str, jax.Array]) -> dk.LinearHead:
    """Tunix's DiffusionLogitsFn, returning the tied head instead of [B, L, K] logits."""
    hidden = model(inputs["input_tokens"], inputs["time"])  # [B, L, D]
    return dk.LinearHead(hidden, model.embed.embedding[...], weight_layout="KD")


def corrupt(key: jax.Array, x0: jax.Array, mask_id: int) -> dk.DiffusionTokenBatch:
    """A masked-diffusion batch: t ~ U(0.1, 0.9) per sequence, each token masked with
    probability t, weight 1/t at the masked positions (the MDLM bound), 0 elsewhere."""
    k_t, k_mask = jax.random.split(key)
    t = jax.random.uniform(k_t, (x0.shape[0],), minval=0.1, maxval=0.9)  # [B]
    masked = jax.random.uniform(k_mask, x0.shape) < t[:, None]  # [B, L]
    xt = jnp.where(masked, mask_id, x0)
    return dk.DiffusionTokenBatch.create(
        model_inputs={"input_tokens": xt, "time": t}, target_ids=x0,
        loss_weights=jnp.where(masked, 1.0 / t[:, None], 0.0))


@nnx.jit
def train_step(model: TinyDenoiser, optimizer: nnx.Optimizer,
               batch: dk.DiffusionTokenBatch) -> jax.Array:
    def loss_fn(model: TinyDenoiser) -> jax.Array:
        head = dk.compute_diffusion_logits(model, batch, logits_fn)
        return dk.weighted_cross_entropy(head, batch).compute()

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return loss


def main(steps: int = 30, batch_size: int = 8, length: int = 16, vocab: int = 97,
         dim: int = 32, seed: int = 0) -> list[float]:
    """Train on a toy corpus (arithmetic progressions mod K - 1; id K - 1 is the mask) and
    return the loss of every step."""
    key = jax.random.key(seed)
    k_model, k_data, key = jax.random.split(key, 3)
    model = TinyDenoiser(vocab, dim, length, rngs=nnx.Rngs(k_model))
    optimizer = nnx.Optimizer(model, optax.adamw(3e-2), wrt=nnx.Param)
    start = jax.random.randint(k_data, (batch_size, 1), 0, vocab - 1)
    x0 = (start + 3 * jnp.arange(length)[None]) % (vocab - 1)  # [B, L], never the mask id
    losses = []
    for step in range(steps):
        key, k_step = jax.random.split(key)
        losses.append(float(train_step(model, optimizer, corrupt(k_step, x0, vocab - 1))))
        print(f"step {step:3d}  loss {losses[-1]:.4f}")
    return losses


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=30)
    main(parser.parse_args().steps)
