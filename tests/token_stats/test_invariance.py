"""One row, one answer (docs/design.md §2): every per-row statistic and gradient of the
token-statistics primitive is a function of that row's inputs alone, bitwise, whatever the
batch around it — the number of rows, the row's position, a [B, L] or flat layout, padding
rows — and whichever internal path a backend takes (torch chunked: the compiled CPU loops,
the row-block tiles and the plain chunk loop; JAX chunked: its row blocks, a call of fewer
than 8 rows, a full block and the block that ends the rows). The Triton and
Pallas kernels have their own file (``test_invariance_kernels.py``)."""

from __future__ import annotations

import pytest

from .invariance import (FEATURES, SAMPLER_MODES, check_logp_ignores_entropy,
                         check_one_row_one_answer, check_sampler_one_row_one_answer)


@pytest.mark.parametrize("feature", sorted(FEATURES))
@pytest.mark.parametrize("fw_name,backend", [("torch", "chunked"), ("torch", "reference"),
                                             ("jax", "chunked"), ("jax", "reference")])
def test_one_row_one_answer(fw_name, backend, feature, monkeypatch):
    """K 12000: three vocabulary chunks of the CPU's 4096 columns, the last ragged; torch
    chunked on its eager paths (the compiled loops' threshold raised past K; they have their
    own test below)."""
    from dlm_kernels.token_stats import torch_compiled as tc

    monkeypatch.setattr(tc, "COMPILE_MIN_VOCAB", 1 << 30, raising=False)
    check_one_row_one_answer(fw_name, backend, 12000, feature)


def test_one_row_one_answer_compiled_loops(compiled_loops):
    """The torch chunked backend's compiled CPU loops (every K here: ``compiled_loops``) give
    a row the same bits alone (run as two copies of it) and in any batch, whatever block
    their rows fall in and however many threads share a block."""
    check_one_row_one_answer("torch", "chunked", 4500, "teacher")


def test_the_torch_path_depends_on_k_alone():
    """Which torch chunked path runs is a function of K (and the features), never of N: a
    row-count threshold would move a row between paths that sum in different orders."""
    from dlm_kernels.token_stats import torch_compiled as tc

    k = tc.COMPILE_MIN_VOCAB
    assert tc.use_compiled(k) and not tc.use_compiled(k - 1)


# -- a row's logp does not depend on whether its entropy was asked for -----------------------

@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("fw_name,backend", [("torch", "chunked"), ("torch", "reference"),
                                             ("jax", "chunked"), ("jax", "reference")])
def test_logp_ignores_entropy(fw_name, backend, dtype, monkeypatch):
    """K 5000: torch chunked on its eager paths (two vocabulary chunks; the compiled loops
    have their own test below)."""
    from dlm_kernels.token_stats import torch_compiled as tc

    monkeypatch.setattr(tc, "COMPILE_MIN_VOCAB", 1 << 30, raising=False)
    check_logp_ignores_entropy(fw_name, backend, 5000, dtype)


def test_logp_ignores_entropy_compiled_loops(compiled_loops):
    """The torch chunked backend's compiled CPU loops (bfloat16: where Inductor's loop nest
    with the entropy's sum once summed Σ e^x in another order)."""
    check_logp_ignores_entropy("torch", "chunked", 4500, "bfloat16")


@pytest.mark.parametrize("mode", sorted(SAMPLER_MODES))
@pytest.mark.parametrize("fw_name,backend", [("torch", "chunked"), ("torch", "reference"),
                                             ("jax", "chunked"), ("jax", "reference")])
def test_sampler_one_row_one_answer(fw_name, backend, mode):
    """The denoising step's Sample fields (greedy, drawn, top-k) of each sequence alone and in
    a batch, bitwise: K 300 in vocabulary chunks of 128, the last ragged."""
    check_sampler_one_row_one_answer(fw_name, backend, 300, 128, mode)
