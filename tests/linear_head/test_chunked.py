"""The linear head on the chunked backends, torch and JAX: the suite, the gradient pass over
vocabulary blocks, and the head's plan."""

from __future__ import annotations

import numpy as np
import pytest

import oracle
from harness import assert_close, cases, framework

from .suite import HeadProblem, LinearHeadSuite, matmul_slack


class TestTorchChunked(LinearHeadSuite):
    FW, BACKEND = "torch", "chunked"


def _force_vocab_blocks(monkeypatch, sweep_class):
    """A budget of 128 float32 weight rows of width 19 (``HEAD_DW_ACC_BYTES``, and torch's on
    a CPU), so K = 301 runs in blocks of 128, 128 and 45 columns; returns the list each
    blocked pass appends its blocks to."""
    from dlm_kernels.linear_head import head as _linear_head

    monkeypatch.setattr(_linear_head, "HEAD_DW_ACC_BYTES", 128 * 19 * 4)
    monkeypatch.setattr(_linear_head, "HEAD_DW_ACC_BYTES_TORCH_CPU", 128 * 19 * 4)
    passes = []
    run_blocked = sweep_class.run_blocked

    def spy(sweep, stats, grads, *rest):
        passes.append(rest[-1])
        return run_blocked(sweep, stats, grads, *rest)

    monkeypatch.setattr(sweep_class, "run_blocked", spy)
    return passes


class TestTorchChunkedVocabBlocks(LinearHeadSuite):
    """The gradient pass over vocabulary blocks (a 16-bit weight whose float32 dW would pass
    ``HEAD_DW_ACC_BYTES``), forced at K = 301 by a budget of 128 weight rows: blocks of 128,
    128 and 45 columns, each block's dW finished across the token chunks and rounded once."""

    FW, BACKEND = "torch", "chunked"
    head_case = cases(("KD", "bfloat16"), ("DK", "bfloat16"))
    ce_dtype = cases("bfloat16")
    opd_term = cases(("total", "bfloat16"), ("both", "bfloat16"))

    @pytest.fixture(autouse=True)
    def _small_budget(self, monkeypatch):
        from dlm_kernels.linear_head import torch_head

        self.blocked_passes = _force_vocab_blocks(monkeypatch, torch_head._Sweep)

    def test_weighted_cross_entropy(self, rng, ce_dtype):
        super().test_weighted_cross_entropy(rng, ce_dtype)
        assert self.blocked_passes == [[(0, 128), (128, 256), (256, 301)]], self.blocked_passes


class TestJaxChunked(LinearHeadSuite):
    FW, BACKEND = "jax", "chunked"


class TestJaxChunkedVocabBlocks(LinearHeadSuite):
    """JAX's gradient pass over vocabulary blocks, as ``TestTorchChunkedVocabBlocks``: a
    16-bit weight whose float32 dW would pass ``HEAD_DW_ACC_BYTES`` (forced at K = 301 by a
    budget of 128 weight rows), each block's dW finished and rounded once; the planned
    objectives' gradient is then recomputed in the backward, never held as a float32
    [K, D] residual."""

    FW, BACKEND = "jax", "chunked"
    head_case = cases(("KD", "bfloat16"), ("DK", "bfloat16"))
    ce_dtype = cases("bfloat16")
    opd_term = cases(("total", "bfloat16"), ("both", "bfloat16"))
    VMAP = False  # a float32 head: TestJaxChunked's case

    @pytest.fixture(autouse=True)
    def _small_budget(self, monkeypatch):
        from dlm_kernels.linear_head import jax_head

        self.blocked_passes = _force_vocab_blocks(monkeypatch, jax_head._Sweep)

    def test_weighted_cross_entropy(self, rng, ce_dtype):
        super().test_weighted_cross_entropy(rng, ce_dtype)
        assert [(0, 128), (128, 256), (256, 301)] in self.blocked_passes, self.blocked_passes


def test_torch_total_backward_twice(rng):
    """The gradient formed in the forward is handed out in place (a float32 head's
    gradients are its accumulators, no copy); a second backward through the retained graph
    recomputes it, with the same result."""
    import torch

    fw, p = framework("torch"), HeadProblem(rng, rows=(3, 7), teacher=False)
    api = fw.api
    y = fw.array(p.y)
    batch = api.DiffusionTokenBatch.create(model_inputs={"input_tokens": y}, target_ids=y,
                                           loss_weights=fw.array(p.active.astype(np.float32)))
    h, w, b = (fw.array(a, "float32").requires_grad_(True) for a in (p.h, p.w, p.b))
    loss = api.weighted_cross_entropy(api.LinearHead(h, w, b, row_chunk=8), batch,
                                      backend="chunked").compute()
    first = torch.autograd.grad(3.0 * loss, (h, w, b), retain_graph=True)
    second = torch.autograd.grad(3.0 * loss, (h, w, b), retain_graph=True)
    for name, g1, g2 in zip(("hidden", "weight", "bias"), first, second):
        assert_close(fw.numpy(g2), fw.numpy(g1), "float32", f"second d {name}")
    active, ys = p.active.reshape(-1) != 0, p.y.reshape(-1)
    zeros = np.zeros(p.n)
    dz, _ = oracle.token_stats_vjp(p.z(), ys, active,
                                   (zeros, -3.0 * active.astype(float) / active.sum(), zeros, zeros))
    assert_close(fw.numpy(first[1]), dz.T @ p.h.reshape(p.n, -1), "float32", "d weight",
                 slack=matmul_slack(np.abs(dz.T), np.zeros_like(dz.T), np.abs(p.h.reshape(p.n, -1)),
                                    "float32") + 2e-6)


@pytest.mark.parametrize("reads", ["total", "per row"])
def test_torch_head_under_non_reentrant_checkpointing(rng, reads):
    """A head inside ``torch.utils.checkpoint(use_reentrant=False)`` (a whole model call
    checkpointed): its backward reads its saved tensors once (each read recomputes under
    checkpointing, and a second raised CheckpointError), with the gradients of the call
    unchecked, bit for bit."""
    import torch
    from torch.utils.checkpoint import checkpoint

    fw, p = framework("torch"), HeadProblem(rng, rows=(3, 7), teacher=False)
    api = fw.api
    y = fw.array(p.y)
    batch = api.DiffusionTokenBatch.create(model_inputs={"input_tokens": y}, target_ids=y,
                                           loss_weights=fw.array(p.active.astype(np.float32)))

    def loss(h, w, b):
        head = api.LinearHead(h, w, b, row_chunk=8)
        if reads == "total":
            return api.weighted_cross_entropy(head, batch, backend="chunked").compute()
        return api.per_token_logps(head, batch, stop_gradient=False, backend="chunked").sum()

    grads = []
    for checkpointed in (False, True):
        h, w, b = (fw.array(a, "float32").requires_grad_(True) for a in (p.h, p.w, p.b))
        out = checkpoint(loss, h, w, b, use_reentrant=False) if checkpointed else loss(h, w, b)
        grads.append(torch.autograd.grad(out, (h, w, b)))
    for name, g1, g2 in zip(("hidden", "weight", "bias"), *grads):
        assert torch.equal(g1, g2), name


@pytest.mark.parametrize("fw_name", ["torch", "jax"])
def test_planned_gradient_of_a_float16_head_keeps_its_digits_at_any_weight_scale(rng, fw_name):
    """opd_loss's gradient is formed in the forward in the head's dtype, its scale taken out
    when far from 1 (``token_stats.op.unit_coefficients``). At T = 1e3 over K = 2^15
    columns each d logit is about |p - q| ~ 1e-6 of that scale: brought to 1, a float16 dZ was subnormal
    and lost its digits (loss weights of 1e30 or 1e-30: d weight off by 1e-5 where weights
    of 1 were exact). The loss is invariant to the weights' scale, so are its gradients."""
    fw = framework(fw_name)
    api = fw.api
    n, k, d = 6, 2 ** 15, 8
    h = rng.normal(size=(1, n, d)).astype(np.float32)
    w = (rng.normal(size=(k, d)) * 0.5).astype(np.float32)  # [K, D]
    teacher = rng.normal(size=(1, n, k)).astype(np.float32) * 3.0
    y = rng.integers(0, k, (1, n))
    layout = api.LinearHead.DEFAULT_LAYOUT

    def d_weight(scale):
        ids = fw.array(y)
        student = api.DiffusionTokenBatch.create(
            model_inputs={"input_tokens": ids}, target_ids=ids,
            loss_weights=fw.array(np.full((1, n), scale, np.float32)))
        batch = api.DiffusionDistillationBatch.create(student_batch=student,
                                                      teacher_logits=fw.array(teacher))
        hidden = fw.array(h, "float16")

        def loss(weight):
            head = api.LinearHead(hidden, weight)
            total, _ = api.opd_loss(head, batch, temperature=1e3, backend="chunked")
            return total.compute()

        weight = fw.array(w if layout == "KD" else w.T, "float16")
        if fw_name == "torch":
            weight.requires_grad_(True)
            (g,) = fw.torch.autograd.grad(loss(weight).float(), weight)
        else:
            g = fw.jax.grad(lambda v: loss(v).astype(fw.jnp.float32))(weight)
        return fw.numpy(g).astype(np.float64)

    unit = d_weight(1.0)
    assert np.abs(unit).max() > 0
    for scale in (1e30, 1e-30):
        assert_close(d_weight(scale), unit, "float16", f"d weight at loss weights {scale:g}")


def test_head_plan_decides_the_schedule_from_the_two_kinds():
    """``head_plan``: the student's chunks are overwritten only when it is a head; the
    vocabulary-block pass and the fused Pallas kernels only when the student is the one
    head needing a gradient (not beside a teacher head with teacher_grad)."""
    from dlm_kernels.linear_head.head import DenseLogits, LinearHead, head_plan

    array = DenseLogits(np.zeros((4, 7), np.float32))
    head = LinearHead(np.zeros((4, 3), np.float32), np.zeros((7, 3), np.float32))
    for student, teacher, teacher_grad, overwrite, one in [
            (head, None, False, True, True), (head, array, True, True, True),
            (head, head, False, True, True), (head, head, True, True, False),
            (array, head, False, False, False), (array, head, True, False, False)]:
        plan = head_plan(student, teacher, teacher_grad)
        case = (type(student).__name__, type(teacher).__name__, teacher_grad)
        assert plan.overwrite_chunks == overwrite, case
        assert plan.student_head_grad_only == one, case


@pytest.mark.parametrize("fw_name", ["torch", "jax"])
def test_no_rows(fw_name):
    """A LinearHead of no rows ([0, D] hidden) on the chunked backend: every statistic an
    empty [0] array, d hidden [0, D] and d weight exact zeros, as logits of no rows give (it
    raised in both frameworks: torch built its statistics from no chunks, JAX sliced a token
    chunk of one row out of none)."""
    fw = framework(fw_name)
    api = fw.api
    d, k = 6, 29
    w = np.random.default_rng(0).normal(size=(k, d)).astype(np.float32)

    def fn(hidden, weight, ids):
        st = api.token_stats(api.LinearHead(hidden, weight, weight_layout="KD"), ids,
                             temperature=0.7, backend="chunked")
        return st.lse, st.logp, st.entropy

    outs, (dh, dw) = fw.vjp(fn, [fw.array(np.zeros((0, d), np.float32)), fw.array(w)],
                            [np.zeros(0, np.float32)] * 3,
                            args=(fw.array(np.zeros(0, np.int64)),))
    assert [np.shape(o) for o in outs] == [(0,)] * 3
    assert np.shape(dh) == (0, d) and np.shape(dw) == (k, d)
    assert not np.any(dw), "d weight of no rows"
