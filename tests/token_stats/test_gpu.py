"""GPU-only checks at real sizes (skipped without CUDA; bench/gpu_check.sh runs them)."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

from harness import assert_close, new_seed  # noqa: E402

from .gpu_check import check_rows_at_both_ends  # noqa: E402
from .invariance import check_logp_ignores_entropy, check_one_row_one_answer  # noqa: E402


@needs_cuda
def test_triton_is_auto_on_cuda():
    import dlm_kernels.torch as D

    assert D.backend_for(torch.zeros(2, 3, device="cuda")) == "triton"


@needs_cuda
@pytest.mark.parametrize("teacher", [False, True])
def test_triton_beyond_int32_offsets(teacher):
    """N·K > 2^31 at K = 262144 (bf16): rows at both ends against the float64 oracle."""
    n, k = 8320, 262144
    assert n * k > 2**31
    check_rows_at_both_ends("cuda", n, k, teacher, ends=32)


@needs_cuda
@pytest.mark.parametrize("feature", ["general", "teacher"])
def test_triton_one_row_one_answer_at_real_size(feature):
    """One row, one answer on the compiled kernels at the target vocabulary (K = 262144, the
    heuristic's own blocks): a lone row, where a launch plan made from N would split the row
    across SMs, against the same row in batches of up to 552 rows, bitwise, every output and
    gradient (tests/token_stats/invariance.py)."""
    check_one_row_one_answer("torch", "triton", 262144, feature, device="cuda")


@needs_cuda
def test_triton_logp_ignores_entropy_at_real_size():
    """The policy log-prob of a token has the same bits with and without its entropy, on the
    compiled kernels at K = 262144 (bf16, 4 x 64 rows)."""
    check_logp_ignores_entropy("torch", "triton", 262144, "bfloat16", shape=(4, 64),
                               device="cuda")


# -- JAX through the real jax-triton ------------------------------------------------------

from .suite import TokenStatsSuite  # noqa: E402


def _skip_without_jax_triton_on_gpu():
    jax = pytest.importorskip("jax")
    if jax.default_backend() != "gpu":
        pytest.skip("JAX has no GPU backend here")
    from dlm_kernels._jax.framework import JAX

    if "triton" not in JAX.token_stats.IMPLEMENTATIONS:
        pytest.skip(f"jax triton backend unavailable: {JAX.token_stats._unavailable.get('triton')}")


@needs_cuda
class TestJaxTritonGpu(TokenStatsSuite):
    """The whole primitive suite through jax_triton.triton_call on the GPU."""

    FW, BACKEND = "jax", "triton"
    CHUNK_SIZES = (None, 128)

    @pytest.fixture(autouse=True)
    def _needs_jax_triton(self):
        _skip_without_jax_triton_on_gpu()


@needs_cuda
@pytest.mark.parametrize("vocab_shard", [False, True])
def test_jax_triton_parity(vocab_shard):
    """Every feature through the real jax-triton under jit; vocab_shard: the partial-state path
    (shard offset read from memory) inside shard_map over a one-GPU "vocab" axis."""
    _skip_without_jax_triton_on_gpu()
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, PartitionSpec as P

    import dlm_kernels.jax as D

    rng = np.random.default_rng(new_seed())
    n, k = 300, 5003
    z = jnp.asarray(rng.normal(size=(n, k)) * 3, jnp.bfloat16)
    u = jnp.asarray(rng.normal(size=(n, k)) * 3, jnp.bfloat16)
    y = jnp.asarray(rng.integers(0, k, n))
    w = jnp.asarray(rng.uniform(size=n) > 0.2, jnp.float32)
    x = jnp.asarray(rng.integers(0, k, n))
    d = jnp.asarray(rng.uniform(0, 4, n), jnp.float32)

    def loss(z, backend, axis=None):
        s = D.token_stats(z, y, w, teacher_logits=u, shift_ids=x, shift=d, temperature=0.9,
                          ce_temperature=1.1, softcap=30.0, vocab_axis=axis, backend=backend)
        return jnp.sum(s.logp) + jnp.sum(s.entropy) + jnp.sum(s.kl), s

    fn = lambda z: loss(z, "triton")
    if vocab_shard:
        fn = jax.shard_map(lambda z: loss(z, "triton", "vocab"),
                           mesh=Mesh(np.array(jax.devices()[:1]), ("vocab",)),
                           in_specs=P(None, "vocab"), out_specs=(P(), P()))
    (_, s_t), g_t = jax.jit(jax.value_and_grad(fn, has_aux=True))(z)
    # the reference from the same logits in float32, so its gradient is not rounded to
    # bfloat16: two roundings of nearly equal float32 gradients can sit a whole bfloat16 ulp
    # apart (6 of 1.5e6 elements did on an H200), one rounding is within the table's half ulp
    (_, s_r), g_r = jax.value_and_grad(lambda z: loss(z, "reference"), has_aux=True)(
        z.astype(jnp.float32))
    for a, b in zip(s_t, s_r):
        assert_close(np.asarray(a), np.asarray(b), "float32")
    assert_close(np.asarray(g_t, np.float64), np.asarray(g_r, np.float64), "bfloat16")
