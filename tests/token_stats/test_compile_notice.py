"""The chunked backend's compiled CPU loops say when they compile: the first large call of a
process pauses for seconds, and a log record says why (once)."""

import logging

import pytest


def test_first_compile_is_logged_once(rng, monkeypatch, caplog):
    torch = pytest.importorskip("torch")
    import dlm_kernels.torch as dk
    from dlm_kernels.token_stats import torch_compiled as tc

    monkeypatch.setattr(tc, "COMPILE_MIN_VOCAB", 0)  # every call takes the compiled loops
    for field, value in (("fn", None), ("grads", None), ("grads_over", None), ("failed", False),
                         ("worked", False)):
        monkeypatch.setattr(tc._Compiled, field, value)
    compiled = []
    # the loops run as plain functions here: what is checked is the notice, not Inductor
    monkeypatch.setattr(torch, "compile", lambda f, **kw: compiled.append(f) or f)
    z = torch.tensor(rng.standard_normal((1, 4, 300)), dtype=torch.float32, requires_grad=True)
    y = torch.tensor(rng.integers(0, 300, (1, 4)))
    batch = dk.DiffusionTokenBatch.create(model_inputs=y, target_ids=y,
                                          loss_weights=torch.ones(1, 4))
    with caplog.at_level(logging.INFO, logger="dlm_kernels"):
        for _ in range(2):
            loss = dk.weighted_cross_entropy(z, batch, backend="chunked").compute()
            torch.autograd.grad(loss, z)
    notices = [r for r in caplog.records if "compiling" in r.getMessage()]
    assert len(compiled) == 3 and len(notices) == 1, [r.getMessage() for r in caplog.records]
    assert notices[0].name == "dlm_kernels" and notices[0].levelno == logging.WARNING
    assert "Inductor" in notices[0].getMessage() and "once per process" in notices[0].getMessage()
