"""GPU-only checks at real sizes (skipped without CUDA; bench/gpu_check.sh runs them)."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

import oracle  # noqa: E402
from harness import assert_close, new_seed  # noqa: E402


def check_with_oracle(stats, dz, z, y, active, grads, **kw):
    """Statistics (lse, logp, entropy, kl; float32 tolerance) and bf16 d logits, as float64
    host arrays, against the float64 oracle at z [N, K] (grads: the four [N] cotangents)."""
    for name, got, e in zip(("lse", "logp", "entropy", "kl"), stats, oracle.token_stats(z, y, active, **kw)):
        assert_close(got, e, "float32", name)
    dz_exp, _ = oracle.token_stats_vjp(z, y, active, grads, **kw)
    assert_close(dz, dz_exp, "bfloat16", "d logits")
    return dz_exp


def check_rows_at_both_ends(device, n, k, teacher, ends):
    """token_stats (temperature 1.3, 10 % inactive rows) of bf16 [N, K] logits through the
    triton backend: statistics and d logits of the first and last ``ends`` rows against the
    float64 oracle. test_triton runs it at a small shape in the interpreter."""
    import dlm_kernels.torch as D

    gen = torch.Generator(device).manual_seed(new_seed())
    z = (torch.randn(n, k, generator=gen, device=device) * 3).to(torch.bfloat16).requires_grad_(True)
    u = (torch.randn(n, k, generator=gen, device=device) * 3).to(torch.bfloat16) if teacher else None
    y = torch.randint(0, k, (n,), generator=gen, device=device)
    w = (torch.rand(n, generator=gen, device=device) > 0.1).float()
    s = D.token_stats(z, y, w, teacher_logits=u, temperature=1.3, backend="triton")
    g_lp, g_h, g_kl = (torch.randn(n, generator=gen, device=device) for _ in range(3))
    (dz,) = torch.autograd.grad([s.logp, s.entropy, s.kl], z, [g_lp, g_h, g_kl])
    rows = torch.cat([torch.arange(ends), torch.arange(n - ends, n)]).to(device)
    pick = lambda t: t[rows].detach().double().cpu().numpy()
    zeros = np.zeros(2 * ends)
    g = (zeros, pick(g_lp), pick(g_h), pick(g_kl) if teacher else zeros)
    check_with_oracle([pick(v) for v in s], pick(dz), pick(z), y[rows].cpu().numpy(),  # int64 targets
                      pick(w) != 0, g, T=1.3, u=pick(u) if teacher else None)


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


# -- JAX through the real jax-triton ------------------------------------------------------

from test_token_stats import TokenStatsSuite  # noqa: E402


def _skip_without_jax_triton_on_gpu():
    jax = pytest.importorskip("jax")
    if jax.default_backend() != "gpu":
        pytest.skip("JAX has no GPU backend here")
    from dlm_kernels.token_stats import jax_vjp as _primitive

    if "triton" not in _primitive.REGISTRY.IMPLEMENTATIONS:
        pytest.skip(f"jax triton backend unavailable: {_primitive.REGISTRY._unavailable.get('triton')}")


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
    (_, s_r), g_r = jax.value_and_grad(lambda z: loss(z, "reference"), has_aux=True)(z)
    for a, b in zip(s_t, s_r):
        assert_close(np.asarray(a), np.asarray(b), "float32")
    assert_close(np.asarray(g_t, np.float64), np.asarray(g_r, np.float64), "bfloat16")
