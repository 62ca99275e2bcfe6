"""Every public function of ``dlm_kernels.torch`` that takes numbers traces under
``torch.compile(fullgraph=True)`` with those numbers as Python ints and floats (Dynamo
specialises on them: they are checked on the host while tracing, never by a data-dependent
branch), and gives what eager gives, values and gradients. One row of ``CASES`` per function;
``test_every_public_number_function_has_a_case`` keeps the table complete.

``aot_eager`` runs the traced graph with ATen's eager kernels, so this checks tracing and
the host checks, not Inductor's code generation (the sampler's noise under Inductor has its
own test in tests/sampling/test_sampler_arguments.py)."""

from __future__ import annotations

import inspect

import numpy as np
import pytest

from harness import assert_close, new_seed

torch = pytest.importorskip("torch")
import dlm_kernels.torch as dk  # noqa: E402

B, L, K = 2, 5, 37  # awkward sizes; K past one top-k and several sampler chunks below


def _inputs():
    """Fresh random inputs: logits [B, L, K] (differentiable), ids, masks, a teacher."""
    rng = np.random.default_rng(new_seed())
    t = lambda a, **kw: torch.tensor(a, **kw)  # noqa: E731
    z = t(rng.standard_normal((B, L, K)) * 3, dtype=torch.float32).requires_grad_(True)
    ids = t(rng.integers(0, K, (B, L)))
    masked = t(rng.random((B, L)) < 0.6)
    masked[:, 0] = True
    w = t(rng.random((B, L)) < 0.8, dtype=torch.float32)
    batch = dk.DiffusionTokenBatch.create(model_inputs=ids, target_ids=ids, loss_weights=w)
    teacher = t(rng.standard_normal((B, L, K)) * 3, dtype=torch.float32)
    logps = dk.per_token_logps(z.detach(), batch)
    noise = t(rng.standard_normal((B, L)) * 0.3, dtype=torch.float32)
    return dict(z=z, ids=ids, xt=t(rng.integers(0, K, (B, L))), masked=masked, w=w,
                batch=batch, teacher=teacher, old=logps + noise, ref=logps - noise,
                adv=t(rng.standard_normal(B), dtype=torch.float32))


def _sample(x):
    return dk.sample_tokens(x["z"], temperature=0.7, seed=3, step=1, top_k=5,
                            suppress_ids=[0, 4], cfg_scale=0.0, stats_temperature=1.0)


#: public function -> f(inputs) -> a tensor or a tuple of tensors, every number a Python
#: int or float (the keywords a user passes most)
CASES = {
    "token_stats": lambda x: tuple(v for v in dk.token_stats(
        x["z"], x["ids"], x["w"], temperature=0.7, softcap=20.0, shift_ids=x["xt"], shift=1.5,
        teacher_logits=x["teacher"], teacher_temperature=2.0, label_smoothing=0.1,
        z_loss_weight=1e-3, chunk_size=16, vocab_size=K) if v is not None),
    "weighted_cross_entropy": lambda x: dk.weighted_cross_entropy(
        x["z"], x["batch"], label_smoothing=0.1, z_loss_weight=1e-3).compute(),
    "diffusion_sft_loss": lambda x: dk.diffusion_sft_loss(
        x["z"], x["ids"], x["xt"], 0.4, x["w"], variant="reweighted-loo-ce", vocab_size=K,
        diffusion_weight_clip=10.0),
    "diffusion_sft_logps": lambda x: dk.diffusion_sft_logps(
        x["z"], x["ids"], x["xt"], 0.4, x["w"], variant="loo-ce", vocab_size=K),
    "opd_loss": lambda x: dk.opd_loss(
        x["z"], dk.DiffusionDistillationBatch.create(student_batch=x["batch"],
                                                     teacher_logits=x["teacher"]),
        temperature=2.0, soft_loss_weight=1.0, hard_loss_weight=0.5, label_smoothing=0.1,
        z_loss_weight=1e-3)[0].compute(),
    "per_token_logps": lambda x: dk.per_token_logps(
        x["z"], x["batch"], temperature=0.7, stop_gradient=False, return_entropy=True),
    "policy_loss": lambda x: (lambda r: (r.loss, r.clip_ratio_region, r.kl, r.entropy))(dk.policy_loss(
        x["z"], x["batch"], old_logps=x["old"], advantages=x["adv"], loss_type="dr_grpo",
        epsilon=0.2, epsilon_high=0.28, delta=1.5, beta=0.04, ref_logps=x["ref"],
        use_bias_correction_kl=True, temperature=0.9, max_completion_length=8,
        num_items_in_batch=7)),
    "loo_to_denoiser_logits": lambda x: dk.loo_to_denoiser_logits(x["z"], x["xt"], 0.3, K),
    "add_gumbel_noise": lambda x: dk.add_gumbel_noise(x["z"], 0.7, seed=3, step=1),
    "sample_tokens": lambda x: tuple(_sample(x)),
    "commit_tokens": lambda x: dk.commit_tokens(x["ids"], _sample(x), x["masked"],
                                                rule="entropy_budget", budget=0.5),
    "get_transfer_index": lambda x: dk.get_transfer_index(
        x["z"], 0.0, "low_confidence", x["masked"], x["ids"], 2, 0.9, seed=3, step=1),
    "get_num_transfer_tokens": lambda x: dk.get_num_transfer_tokens(x["masked"], 3),
}
#: public functions that take no number (or no tensor) to trace
NOT_NUMERIC = {"backend_for", "compute_diffusion_logits", "compute_diffusion_per_token_logps",
               "merge_diffusion_batches", "normalize_variant", "reweight", "rf_alpha",
               "rf_alpha_dot", "sync_checks", "validate_diffusion_logits", "vocab_parallel"}


def test_every_public_number_function_has_a_case():
    public = {name for name in dk.__all__ if inspect.isfunction(getattr(dk, name))}
    assert public - NOT_NUMERIC == set(CASES), (
        f"without a fullgraph case: {sorted(public - NOT_NUMERIC - set(CASES))}; "
        f"not public: {sorted(set(CASES) - public)}")


def _leaves(out):
    out = out if isinstance(out, tuple) else (out,)
    flat = []
    for o in out:
        flat.extend(o if isinstance(o, tuple) else (o,))
    return [o for o in flat if isinstance(o, torch.Tensor)]


@pytest.mark.parametrize("name", sorted(CASES))
def test_fullgraph_with_python_numbers(name):
    torch._dynamo.reset()
    x = _inputs()
    fn = CASES[name]
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    want, got = _leaves(fn(x)), _leaves(compiled(x))
    assert len(want) == len(got), name
    for i, (a, b) in enumerate(zip(want, got)):
        assert a.shape == b.shape and a.dtype == b.dtype, (name, i, a.shape, b.shape)
        if a.is_floating_point():
            assert_close(b.detach().double().numpy(), a.detach().double().numpy(), "float32",
                         f"{name} output {i}")
        else:
            assert torch.equal(a, b), f"{name} output {i}: compiled {b} vs eager {a}"
    scalars = [a for a in want if a.is_floating_point() and a.requires_grad]
    if scalars:  # the gradient in the logits of a sum of the differentiable outputs
        total = lambda outs: sum(o.float().sum() for o in outs  # noqa: E731
                                 if o.is_floating_point() and o.requires_grad)
        (g_want,) = torch.autograd.grad(total(want), x["z"])
        (g_got,) = torch.autograd.grad(total(got), x["z"])
        assert_close(g_got.double().numpy(), g_want.double().numpy(), "float32",
                     f"{name} d logits")
