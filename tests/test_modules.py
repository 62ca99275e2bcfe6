"""The torch modules (``dlm_kernels.torch.nn``): the values and gradients of the functional
API they wrap, bit for bit (the same calls), every reduction, the fused linear-head variants
against the float64 oracle of the logits they stand for, and options checked at
construction."""

from __future__ import annotations

import inspect

import numpy as np
import pytest
import torch

import dlm_kernels.torch as dk
from dlm_kernels.torch import nn as dn

import oracle
from harness import assert_close, new_seed
from objectives.suite import sft_inputs

B, L, D, K = 3, 5, 16, 37

#: Every module and its functional twin (a new module: one line). A module takes every
#: keyword-only argument of its function at construction, keyword-only with the same
#: default, and the function's positional arguments in ``forward``; a FusedLinear module
#: takes ``hidden`` and ``weight`` (and a ``bias`` keyword) there in place of the logits,
#: the function's first argument.
TWINS = {
    dn.DiffusionSFTLoss: dk.diffusion_sft_loss,
    dn.FusedLinearDiffusionSFTLoss: dk.diffusion_sft_loss,
    dn.OPDLoss: dk.opd_loss,
    dn.FusedLinearOPDLoss: dk.opd_loss,
    dn.PolicyLoss: dk.policy_loss,
    dn.FusedLinearPolicyLoss: dk.policy_loss,
}


def run(fn, leaves, cot):
    """(fn(*leaves), the gradient of Σ cot·fn(*leaves) for each leaf) on fresh leaf copies."""
    leaves = [x.detach().clone().requires_grad_(True) for x in leaves]
    out = fn(*leaves)
    (out * cot).sum().backward()
    return out.detach(), [x.grad for x in leaves]


def assert_same(got, exp, what):
    (out, grads), (ref, ref_grads) = got, exp
    assert torch.equal(out, ref), (what, out, ref)
    for i, (g, r) in enumerate(zip(grads, ref_grads)):
        assert g is not None and torch.equal(g, r), (what, f"gradient {i}")


REDUCE = {"mean": torch.mean, "sum": torch.sum, "none": lambda x: x}


@pytest.mark.parametrize("variant", ["reweighted-loo-ce", "base-sft"])
def test_sft_module_matches_the_function(variant):
    rng = np.random.default_rng(new_seed())
    logits, x0, xt, t, mask = (torch.as_tensor(a) for a in sft_inputs(rng, B, L, K))
    z = logits.float()
    kw = dict(variant=variant, vocab_size=K, diffusion_weight_clip=4.0, label_smoothing=0.1,
              z_loss_weight=1e-3)
    for reduction, reduce in REDUCE.items():
        cot = torch.as_tensor(rng.normal(size=B) if reduction == "none" else 1.0).float()
        module = dn.DiffusionSFTLoss(**kw, reduction=reduction)
        got = run(lambda z: module(z, x0, xt, t, mask), [z], cot)
        exp = run(lambda z: reduce(dk.diffusion_sft_loss(z, x0, xt, t, mask, **kw)), [z], cot)
        assert_same(got, exp, reduction)
    assert list(module.parameters()) == [] and module.state_dict() == {}


def test_fused_linear_sft_module_matches_the_function_and_the_oracle():
    rng = np.random.default_rng(new_seed())
    _, x0, xt, t, mask = (torch.as_tensor(a) for a in sft_inputs(rng, B, L, K))
    lm_head = torch.nn.Linear(D, K)  # weight [K, D]: the default layout
    hidden = torch.as_tensor(rng.normal(size=(B, L, D))).float()
    weight, bias = lm_head.weight.detach(), lm_head.bias.detach()
    cot = torch.as_tensor(rng.normal(size=B)).float()
    kw = dict(variant="reweighted-loo-ce", vocab_size=K)
    ce = dict(label_smoothing=0.2, z_loss_weight=1e-2)
    module = dn.FusedLinearDiffusionSFTLoss(**kw, **ce, reduction="none", row_chunk=4)
    got = run(lambda h, w, b: module(h, w, x0, xt, t, mask, bias=b), [hidden, weight, bias], cot)
    exp = run(lambda h, w, b: dk.diffusion_sft_loss(dk.LinearHead(h, w, b, row_chunk=4), x0, xt,
                                                    t, mask, **kw, **ce),
              [hidden, weight, bias], cot)
    assert_same(got, exp, "fused linear SFT")
    # what the head stands for: logits = hidden @ weight.T + bias, in float64
    h64, w64, b64 = (x.double().numpy() for x in (hidden, weight, bias))
    z64 = h64 @ w64.T + b64
    args = (z64, x0.numpy(), xt.numpy(), t.numpy(), mask.numpy(), kw["variant"], K)
    assert_close(got[0].numpy(), oracle.sft_loss(*args, **ce), "float32", "loss")
    dz = oracle.sft_loss_grad(*args, cot.double().numpy(), **ce)  # [B, L, K]
    dh, dw, db = got[1]
    assert_close(dh.numpy(), dz @ w64, "float32", "d hidden")
    assert_close(dw.numpy(), np.einsum("blk,bld->kd", dz, h64), "float32", "d weight")
    assert_close(db.numpy(), dz.sum(axis=(0, 1)), "float32", "d bias")


def distillation_batch(rng, teacher):
    y = torch.as_tensor(rng.integers(0, K, (B, L)))
    w = torch.as_tensor((rng.uniform(size=(B, L)) < 0.7).astype(np.float32))
    student = dk.DiffusionTokenBatch.create(model_inputs=y, target_ids=y, loss_weights=w)
    return dk.DiffusionDistillationBatch.create(student_batch=student, teacher_logits=teacher)


OPD = dict(temperature=2.0, soft_loss_weight=1.0, hard_loss_weight=0.3, label_smoothing=0.1,
           z_loss_weight=1e-3)


def opd_total(student, batch):
    return dk.opd_loss(student, batch, **OPD)[0].compute()


def test_opd_module_matches_the_function():
    rng = np.random.default_rng(new_seed())
    batch = distillation_batch(rng, torch.as_tensor(rng.normal(size=(B, L, K))).float())
    z = torch.as_tensor(rng.normal(size=(B, L, K))).float()
    module = dn.OPDLoss(**OPD)
    assert_same(run(lambda z: module(z, batch), [z], 1.0),
                run(lambda z: opd_total(z, batch), [z], 1.0), "OPD")


def test_fused_linear_opd_module_matches_the_function():
    """The student as a head, the teacher as a head of its own ([K, D_t] tied embedding)."""
    rng = np.random.default_rng(new_seed())
    teacher = dk.LinearHead(torch.as_tensor(rng.normal(size=(B, L, 8))).float(),
                            torch.as_tensor(rng.normal(size=(K, 8))).float())
    batch = distillation_batch(rng, teacher)
    hidden = torch.as_tensor(rng.normal(size=(B, L, D))).float()
    kernel = torch.as_tensor(rng.normal(size=(D, K)) / D ** 0.5).float()  # [D, K]
    module = dn.FusedLinearOPDLoss(**OPD, weight_layout="DK")
    got = run(lambda h, w: module(h, w, batch), [hidden, kernel], 1.0)
    exp = run(lambda h, w: opd_total(dk.LinearHead(h, w, weight_layout="DK"), batch),
              [hidden, kernel], 1.0)
    assert_same(got, exp, "fused linear OPD")


POLICY = dict(loss_type="dapo", epsilon=0.1, epsilon_high=0.28, delta=1.5, beta=0.04,
              use_bias_correction_kl=True, importance_sampling_level="sequence",
              temperature=0.7, max_completion_length=9)


def policy_inputs(rng):
    batch = distillation_batch(rng, torch.zeros(B, L, K)).student_batch
    logps = lambda: torch.as_tensor(rng.normal(size=(B, L)) - 3.0).float()
    return batch, dict(old_logps=logps(), advantages=torch.as_tensor(rng.normal(size=B)).float(),
                       ref_logps=logps(), num_items_in_batch=torch.tensor(11.0))


#: (keyword, module) pairs a module leaves out: a fused module has no logits tensor to write
#: its gradient over (``inplace_grad`` with a LinearHead is a ValueError in the function)
NO_LOGITS_TENSOR = {("inplace_grad", dn.FusedLinearPolicyLoss)}


def test_policy_modules_take_every_keyword_of_the_function():
    """Every keyword of policy_loss is a constructor option or a forward argument of both
    modules (with the function's default)."""
    import inspect

    function = inspect.signature(dk.policy_loss).parameters
    for module in (dn.PolicyLoss, dn.FusedLinearPolicyLoss):
        taken = {**inspect.signature(module.__init__).parameters,
                 **inspect.signature(module.forward).parameters}
        for name, param in function.items():
            if name in ("logits", "batch") or (name, module) in NO_LOGITS_TENSOR:
                continue
            assert name in taken, (module.__name__, name)
            assert taken[name].default == param.default, (module.__name__, name)


def test_policy_module_matches_the_function():
    rng = np.random.default_rng(new_seed())
    batch, kw = policy_inputs(rng)
    z = torch.as_tensor(rng.normal(size=(B, L, K))).float()
    module = dn.PolicyLoss(**POLICY)
    got = run(lambda z: module(z, batch, **kw).loss, [z], 1.0)
    assert_same(got, run(lambda z: dk.policy_loss(z, batch, **POLICY, **kw).loss, [z], 1.0),
                "policy")
    assert module(z, batch, **kw) == dk.policy_loss(z, batch, **POLICY, **kw)
    assert list(module.parameters()) == [] and module.state_dict() == {}


def test_policy_module_writes_its_gradient_in_place():
    """PolicyLoss(inplace_grad=True): the function's loss, and its gradient written over the
    logits (bitwise the default's); a non-bool option is a TypeError at construction."""
    rng = np.random.default_rng(new_seed())
    batch, kw = policy_inputs(rng)
    z = torch.as_tensor(rng.normal(size=(B, L, K))).float()
    (_, (expected,)) = run(lambda z: dk.policy_loss(z, batch, **POLICY, **kw).loss, [z], 1.0)
    module = dn.PolicyLoss(**POLICY, inplace_grad=True, backend="chunked")
    z1 = z.clone().requires_grad_(True)
    (grad,) = torch.autograd.grad(module(z1, batch, **kw).loss, z1)
    assert grad.data_ptr() == z1.data_ptr() and torch.equal(grad, expected)
    assert "inplace_grad=True" in repr(module) and "inplace_grad" not in repr(
        dn.PolicyLoss(**POLICY))
    with pytest.raises(TypeError, match="inplace_grad must be True or False; got 'yes'"):
        dn.PolicyLoss(**POLICY, inplace_grad="yes")


def test_fused_linear_policy_module_matches_the_function():
    rng = np.random.default_rng(new_seed())
    batch, kw = policy_inputs(rng)
    hidden = torch.as_tensor(rng.normal(size=(B, L, D))).float()
    kernel = torch.as_tensor(rng.normal(size=(D, K)) / D ** 0.5).float()  # [D, K]
    bias = torch.as_tensor(rng.normal(size=K)).float()
    module = dn.FusedLinearPolicyLoss(**POLICY, weight_layout="DK", row_chunk=4)
    got = run(lambda h, w, b: module(h, w, batch, **kw, bias=b).loss, [hidden, kernel, bias], 1.0)
    exp = run(lambda h, w, b: dk.policy_loss(dk.LinearHead(h, w, b, weight_layout="DK",
                                                           row_chunk=4), batch, **POLICY,
                                             **kw).loss, [hidden, kernel, bias], 1.0)
    assert_same(got, exp, "fused linear policy")


BAD_OPTIONS = [
    (lambda: dn.DiffusionSFTLoss(variant="nope", vocab_size=K), "Unknown variant 'nope'"),
    (lambda: dn.DiffusionSFTLoss(variant="loo-ce", vocab_size=0),
     "vocab_size must be a positive int; got 0"),
    (lambda: dn.DiffusionSFTLoss(variant="loo-ce", vocab_size=K, reduction="avg"),
     r"reduction must be one of \('mean', 'sum', 'none'\); got 'avg'"),
    (lambda: dn.FusedLinearDiffusionSFTLoss(variant="loo-ce", vocab_size=K, weight_layout="kd"),
     r"weight_layout must be one of .*; got 'kd'"),
    (lambda: dn.OPDLoss(temperature=0.0), "temperature must be positive; got 0.0"),
    (lambda: dn.FusedLinearOPDLoss(soft_loss_weight=0.0),
     "at least one loss weight must be positive"),
    (lambda: dn.FusedLinearDiffusionSFTLoss(variant="loo-ce", vocab_size=K, label_smoothing=1.5),
     r"label_smoothing must be a float in \[0, 1\]; got 1.5"),
    (lambda: dn.OPDLoss(z_loss_weight=-1.0),
     "z_loss_weight must be a finite non-negative float; got -1.0"),
    (lambda: dn.PolicyLoss(loss_type="ppo"), r"loss_type must be one of \('grpo', .*; got 'ppo'"),
    (lambda: dn.FusedLinearPolicyLoss(loss_type="grpo", epsilon=2.0),
     r"epsilon must be a float in \[0, 1\]"),
]


@pytest.mark.parametrize("make,pattern", BAD_OPTIONS, ids=[p[:24] for _, p in BAD_OPTIONS])
def test_options_are_checked_at_construction(make, pattern):
    with pytest.raises(ValueError, match=pattern):
        make()


def test_modules_say_their_options():
    assert repr(dn.DiffusionSFTLoss(variant="loo-reweighted-ce", vocab_size=K)) == \
        "DiffusionSFTLoss(variant='reweighted-loo-ce', vocab_size=37, reduction='mean')"
    assert repr(dn.FusedLinearOPDLoss(temperature=2.0)) == (
        "FusedLinearOPDLoss(temperature=2.0, soft_loss_weight=1.0, hard_loss_weight=0.0, "
        "weight_layout='KD')")
    assert repr(dn.DiffusionSFTLoss(variant="loo-ce", vocab_size=K, label_smoothing=0.1)) == (
        "DiffusionSFTLoss(variant='loo-ce', vocab_size=37, label_smoothing=0.1, "
        "reduction='mean')")
    assert repr(dn.PolicyLoss(loss_type="cispo", epsilon_high=5.0)) == (
        "PolicyLoss(loss_type='cispo', epsilon=0.2, epsilon_high=5.0, "
        "importance_sampling_level='token', temperature=1.0)")



def test_every_module_has_a_functional_twin():
    assert set(TWINS) == {getattr(dn, name) for name in dn.__all__}, "add the module to TWINS"


@pytest.mark.parametrize("module", list(TWINS), ids=lambda m: m.__name__)
def test_modules_take_every_keyword_of_their_function(module):
    """The signatures of each module's __init__ and forward against its function's
    (``TWINS``): no keyword of the function may be missing from the module (an option in
    __init__ with the function's default, or a per-batch tensor in forward)."""
    fn = TWINS[module]
    init = inspect.signature(module.__init__).parameters
    forward = inspect.signature(module.forward).parameters
    fused = module.__name__.startswith("FusedLinear")
    wrong = []
    for i, p in enumerate(inspect.signature(fn).parameters.values()):
        if p.kind is p.KEYWORD_ONLY and p.name in forward:  # per-batch tensors (policy)
            continue
        if (p.name, module) in NO_LOGITS_TENSOR:
            continue
        if p.kind is p.KEYWORD_ONLY:
            q = init.get(p.name)
            if q is None or q.kind is not p.KEYWORD_ONLY or q.default != p.default:
                wrong.append(f"__init__ lacks keyword-only {p} of {fn.__name__} (has {q})")
        elif fused and i == 0:  # the logits: a LinearHead of hidden, weight (, bias)
            for name in ("hidden", "weight", "bias"):
                if name not in forward:
                    wrong.append(f"forward lacks {name!r} (for {fn.__name__}'s {p.name})")
        elif p.name not in forward:
            wrong.append(f"forward lacks {p.name!r} of {fn.__name__}")
    assert not wrong, f"{module.__name__}: " + "; ".join(wrong)
