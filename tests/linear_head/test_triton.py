"""The linear head on the triton backend: torch in Triton's interpreter, JAX through the
jax-triton emulator (``jax_triton_on_cpu`` in conftest)."""

from __future__ import annotations

import numpy as np
import pytest

from harness import assert_close, cases, framework

from .suite import HeadProblem, LinearHeadSuite


def _interpreted():
    import os

    return os.environ.get("TRITON_INTERPRET") == "1"


@pytest.mark.skipif(not _interpreted(), reason="the Triton kernels run on CPU only under "
                    "TRITON_INTERPRET=1")
class TestTorchTriton(LinearHeadSuite):
    FW, BACKEND = "torch", "triton"
    head_case = cases(("KD", "bfloat16"))  # both layouts and dtypes: the chunked classes
    ce_dtype = cases("bfloat16")
    opd_term = cases(("total", "float32"))


@pytest.mark.skipif(not _interpreted(), reason="the Triton kernels run on CPU only under "
                    "TRITON_INTERPRET=1")
@pytest.mark.usefixtures("jax_triton_on_cpu")
class TestJaxTritonEmulated(LinearHeadSuite):
    FW, BACKEND = "jax", "triton"
    head_case = cases(("DK", "bfloat16"))  # both layouts and dtypes: the chunked classes
    ce_dtype = cases("bfloat16")
    opd_term = cases(("total", "float32"))


@pytest.mark.skipif(not _interpreted(), reason="the Triton kernels run on CPU only under "
                    "TRITON_INTERPRET=1")
def test_triton_vocab_blocks_match_whole_vocabulary(rng, monkeypatch):
    """The Triton backend's gradient pass over vocabulary blocks (its backward at each
    block's column offset) gives the gradients of the pass over the whole vocabulary."""
    import torch

    from dlm_kernels.linear_head import head as _linear_head

    fw, p = framework("torch"), HeadProblem(rng, rows=(3, 7), teacher=False)
    api = fw.api
    y = fw.array(p.y)
    batch = api.DiffusionTokenBatch.create(model_inputs={"input_tokens": y}, target_ids=y,
                                           loss_weights=fw.array(p.active.astype(np.float32)))

    def grads():
        h, w, b = (fw.array(a, "bfloat16").requires_grad_(True) for a in (p.h, p.w, p.b))
        lp, ent = api.per_token_logps(api.LinearHead(h, w, b, row_chunk=8), batch,
                                      stop_gradient=False, return_entropy=True,
                                      backend="triton")
        return torch.autograd.grad((lp * 0.7).sum() + ent.sum(), (h, w, b))

    whole = grads()
    monkeypatch.setattr(_linear_head, "HEAD_DW_ACC_BYTES", 128 * 19 * 4)  # blocks of 128
    blocked = grads()
    for name, g1, g2 in zip(("hidden", "weight", "bias"), whole, blocked):
        assert_close(fw.numpy(g2.float()), fw.numpy(g1.float()), "bfloat16", f"d {name}")
