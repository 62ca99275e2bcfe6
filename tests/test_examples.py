"""The framework-habit examples at tiny sizes: the Flax NNX + optax training step with a tied
``LinearHead`` (skipped without flax and optax: ``pip install -e ".[examples]"``), the GRPO
steps (torch; JAX with optax), the Megatron-Core layout example under torchrun with gloo
ranks, and transformers' DiffusionGemma trained and generating under the patch (skipped
without transformers)."""

from __future__ import annotations

import importlib.util
import os
import socket
import subprocess
import sys

import numpy as np
import pytest

import oracle
from harness import assert_close

ROOT = os.path.join(os.path.dirname(__file__), "..")


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _load(name):
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "examples", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_flax_nnx_training_step_with_a_tied_linear_head():
    """The example trains (its loss falls); and one step's loss and embedding gradient through
    the tied head equal those of the same model's materialised logits hidden @ E.T (the loss
    against the float64 oracle, the gradient against the reference backend's autodiff)."""
    pytest.importorskip("flax")
    pytest.importorskip("optax")
    import jax
    import jax.numpy as jnp
    from flax import nnx

    import dlm_kernels.jax as dk

    example = _load("train_flax_nnx")
    losses = example.main(steps=12, batch_size=4, length=8, vocab=37, dim=16, seed=1)
    assert np.isfinite(losses).all() and np.mean(losses[-3:]) < losses[0], losses

    model = example.TinyDenoiser(37, 16, 8, rngs=nnx.Rngs(2))
    x0 = jax.random.randint(jax.random.key(3), (4, 8), 0, 36)
    batch = example.corrupt(jax.random.key(4), x0, 36)

    def head_loss(model):
        head = dk.compute_diffusion_logits(model, batch, example.logits_fn)
        return dk.weighted_cross_entropy(head, batch).compute()

    def dense_loss(model):  # the [B, L, K] logits the head stands for
        head = example.logits_fn(model, batch.model_inputs)
        z = jnp.einsum("bld,kd->blk", head.hidden, head.weight)
        return dk.weighted_cross_entropy(z, batch, backend="reference").compute()

    loss, grads = nnx.jit(nnx.value_and_grad(head_loss))(model)  # eager autodiff: 10x slower
    _, dense_grads = nnx.jit(nnx.value_and_grad(dense_loss))(model)
    head = example.logits_fn(model, batch.model_inputs)
    z64 = np.einsum("bld,kd->blk", np.asarray(head.hidden, np.float64),
                    np.asarray(head.weight, np.float64)).reshape(32, 37)
    w = np.asarray(batch.loss_weights, np.float64).reshape(32)
    logp = oracle.token_stats(z64, np.asarray(x0).reshape(32), w != 0)[1]
    assert_close(float(loss), -(w * logp).sum() / w.sum(), "float32", "loss")
    got = np.asarray(grads.embed.embedding[...])
    assert np.abs(got).max() > 0, "the tied embedding gets a gradient"
    assert_close(got, np.asarray(dense_grads.embed.embedding[...]), "float32", "embedding")
    assert_close(np.asarray(grads.mix.kernel[...]), np.asarray(dense_grads.mix.kernel[...]),
                 "float32", "mix.kernel")


def test_megatron_layout_example_under_torchrun():
    """[s, b, v/tp] shards reach the loss as a transposed view inside vocab_parallel; each
    gloo rank checks its loss and gradient shard against the unsharded [b, s, v] loss."""
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                          "--master_port", str(_free_port()), "examples/megatron_layout_torch.py"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.count("matches") == 2, out.stdout


@pytest.mark.parametrize("name", ["grpo_step_torch", "grpo_step_jax"])
def test_grpo_step_examples(name):
    """Rollouts, scoring and policy_loss updates from a tied LinearHead: the first update
    scores the very policy that sampled and equals the reference, so its KL is exactly 0 and
    every first iteration of a rollout clips nothing; the reward rises over 3 steps."""
    if name.endswith("jax"):
        pytest.importorskip("optax")
    log = _load(name).main(steps=3)
    assert all(np.isfinite([e["loss"], e["kl"], e["entropy"]]).all() for e in log), log
    assert log[0]["kl"] == 0.0, log[0]
    assert all(e["clip_ratio"] == 0.0 for e in log if e["iteration"] == 0), log
    assert log[-1]["reward"] > log[0]["reward"], [e["reward"] for e in log]


def test_diffusion_gemma_train_example():
    """transformers' DiffusionGemma under apply_dlm_kernels_to_diffusion_gemma (skipped
    without transformers): the fused loss trains the tiny model (it falls over 8 steps), the
    logits are never formed in training, and generate runs the fused denoising step."""
    pytest.importorskip("transformers.models.diffusion_gemma")
    log = _load("diffusion_gemma_train").main(steps=8, batch=4)
    train, generated = log[:-1], log[-1]
    assert all(np.isfinite(e["loss"]) and not e["logits_formed"] for e in train), train
    assert train[-1]["loss"] < train[0]["loss"], [e["loss"] for e in train]
    assert generated["generated"].shape[1] >= 8 + 16, generated["generated"].shape


def test_diffusion_gemma_generate_example():
    """transformers' DiffusionGemma generating under the patch with fused self-conditioning
    (skipped without transformers): every denoising step of both patched runs reads the
    hidden states through the head, a seeded generation repeats, the tokens are ids of the
    vocabulary, and transformers' own generate runs beside it."""
    pytest.importorskip("transformers.models.diffusion_gemma")
    import torch

    out = _load("diffusion_gemma_generate").main(steps=4)
    assert out["head_steps"] == 2 * 4, out["head_steps"]
    assert torch.equal(out["ours"], out["again"])
    for seq in (out["ours"], out["theirs"]):
        assert seq.shape[1] >= 8 + 16 and ((seq >= 0) & (seq < 512)).all(), seq
