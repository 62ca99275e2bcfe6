"""One row, one answer on the kernels (docs/design.md §2): the Triton kernels (torch front
end, in the Triton interpreter; JAX through the emulated jax-triton) and the Pallas kernels
(JAX, in TPU interpret mode) give a row's statistics, gradients and sampler fields the same
bits alone as in any batch.

What could break it there is a launch plan chosen from the number of rows: the Triton
split-K ranges (a row's vocabulary cut into ranges whose partial sums the finalize kernel
merges) and the Pallas blocks. The shapes are small and awkward on purpose, since the
interpreters are slow: K = 128 in Triton blocks of 16 columns (``chunk_size``), 8 blocks a
row, which the plan cuts into 2 ranges; the Pallas kernels get 3 vocabulary blocks of 128,
the last ragged. ``plan_from_n_would_differ`` recreates the conditions under which a plan
made from N (as the Triton plan once was: split a row while the rows gave fewer than 4
programs per SM) cuts a lone row and a batch differently, here 4 ranges against 1.
"""
from __future__ import annotations

import os

import pytest

from .invariance import (SAMPLER_MODES, check_logp_ignores_entropy, check_one_row_one_answer,
                         check_sampler_one_row_one_answer)

TRITON_K, TRITON_BLOCK = 128, 16  # 8 blocks a row
PALLAS_K, PALLAS_BLOCK = 300, 128  # 3 vocabulary steps, the last ragged
ROWS = 9  # rows drawn (the interpreters take a while a row): batches of 6 to 12 rows


#: the Triton kernels on CPU tensors (torch) and CPU arrays (JAX, through the emulated
#: jax-triton): the interpreter only
needs_interpreter = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                       reason="the Triton interpreter (TRITON_INTERPRET=1)")


@pytest.fixture
def plan_from_n_would_differ(monkeypatch):
    """One SM for torch's launch plan, where a plan still asked for the SM count (its
    ``num_sms``): a plan from N aiming at 4 programs per SM would then split a lone row of 8
    blocks into 4 ranges and leave every batch here unsplit. A plan of K alone ignores
    it."""
    from dlm_kernels._torch import triton as torch_plan

    monkeypatch.setattr(torch_plan, "num_sms", lambda device: 1, raising=False)


@pytest.fixture
def pallas_interpret(monkeypatch):
    pytest.importorskip("jax.experimental.pallas.tpu")
    monkeypatch.setenv("DLM_KERNELS_PALLAS_INTERPRET", "1")


@needs_interpreter
@pytest.mark.parametrize("feature", ["general", "teacher"])  # (the shift is in "teacher")
def test_triton_one_row_one_answer(feature, plan_from_n_would_differ):
    check_one_row_one_answer("torch", "triton", TRITON_K, feature, ROWS,
                             chunk_size=TRITON_BLOCK)


@needs_interpreter
def test_jax_triton_one_row_one_answer(jax_triton_on_cpu, monkeypatch):
    """The JAX launch (its own plan call) through the emulated jax-triton, at one SM as in
    ``plan_from_n_would_differ`` (the JAX plan's SM count was its ``_num_sms``)."""
    monkeypatch.setattr(jax_triton_on_cpu, "_num_sms", lambda: 1, raising=False)
    check_one_row_one_answer("jax", "triton", TRITON_K, "general", ROWS,
                             chunk_size=TRITON_BLOCK)


@pytest.mark.parametrize("feature", ["general", "shift", "teacher"])
def test_pallas_one_row_one_answer(feature, pallas_interpret):
    check_one_row_one_answer("jax", "pallas", PALLAS_K, feature, ROWS,
                             chunk_size=PALLAS_BLOCK)


@needs_interpreter
def test_triton_logp_ignores_entropy():
    check_logp_ignores_entropy("torch", "triton", 300, "bfloat16", shape=(2, 5))


def test_pallas_logp_ignores_entropy(pallas_interpret):
    check_logp_ignores_entropy("jax", "pallas", PALLAS_K, "bfloat16", shape=(2, 5))


def test_triton_plan_depends_on_k_alone():
    """The Triton launch plan takes no row count at all; the shapes above split."""
    import inspect

    from dlm_kernels.kernels.triton import token_stats as kernels

    assert not {"n", "n_rows"} & set(inspect.signature(kernels.launch_config).parameters)
    plan = kernels.launch_config(TRITON_K, 4, False, TRITON_BLOCK)
    assert plan["splits"] > 1 and plan["cols_per_split"] % TRITON_BLOCK == 0


def test_pallas_blocks_depend_on_k_alone():
    """The Pallas blocks are chosen without the row count: ``block_sizes`` (token statistics,
    sampler) and ``head_blocks`` (the linear head) take none."""
    import inspect

    pytest.importorskip("jax.experimental.pallas.tpu")
    from dlm_kernels.kernels.pallas import linear_head, token_stats

    for fn in (token_stats.block_sizes, linear_head.head_blocks):
        assert not {"n", "n_rows"} & set(inspect.signature(fn).parameters), fn


# -- the step's sampler --------------------------------------------------------------------

@needs_interpreter
@pytest.mark.parametrize("mode", sorted(SAMPLER_MODES))
def test_triton_sampler_one_row_one_answer(mode, plan_from_n_would_differ):
    check_sampler_one_row_one_answer("torch", "triton", TRITON_K, TRITON_BLOCK, mode)


@needs_interpreter
def test_jax_triton_sampler_one_row_one_answer(jax_triton_on_cpu):
    check_sampler_one_row_one_answer("jax", "triton", TRITON_K, TRITON_BLOCK, "greedy")


@pytest.mark.parametrize("mode", sorted(SAMPLER_MODES))
def test_pallas_sampler_one_row_one_answer(mode, pallas_interpret):
    """With top_k the statistics are formed on the host from the k slots
    (``sampling.core.finalize``), on rows padded to a multiple of 8: XLA's CPU code gave a
    row's exp and log other bits alone than in a batch before."""
    check_sampler_one_row_one_answer("jax", "pallas", PALLAS_K, PALLAS_BLOCK, mode)


def test_triton_compilations_for_any_row_count_do_the_same_arithmetic():
    """A launch specialises the row count N (the constant 1 for a lone row, divisibility by
    16 for N = 32), so a row alone and in a batch runs other compilations of each kernel; on
    an H200 (2026-12-04) a lone row's entropy and KL differed from the same row's in a batch
    of 23 by an ulp, since the finalize kernel summed a [splits, rows] tile across threads
    in a layout the compiler chose per specialisation. Compiled for sm_90 at N = 1, 23 and
    32 (tests/specialisation_probe.py, a subprocess: the interpreter is on in this one),
    every kernel does the same float32 operations and cross-thread shuffles."""
    import json
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    probe = os.path.join(os.path.dirname(__file__), "..", "specialisation_probe.py")
    out = subprocess.run([sys.executable, probe], env=env, capture_output=True, text=True)
    if out.returncode == 3:
        pytest.skip(out.stdout.strip())
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    kernels = {name.split("[")[0] for name in report}
    assert kernels == {"stats_partial_kernel", "stats_finalize_kernel", "stats_grad_kernel"}
    for kernel in sorted(kernels):
        ops = {name: r for name, r in report.items() if name.startswith(kernel + "[")}
        assert len(ops) == 3 and all(ops.values()), ops
        first = next(iter(ops.values()))
        for name, r in ops.items():
            assert r == first, (f"{name} does other float32 arithmetic than "
                                f"{next(iter(ops))}: {r} vs {first}")
