"""The linear head on the pallas backend: the suite in TPU interpret mode, the fused MXU
kernels run directly, and TPU lowering at real shapes with the kernels' VMEM budget."""

from __future__ import annotations

import numpy as np
import pytest

import oracle
from dlm_kernels.testing import cancellation_scale
from harness import assert_close, cases

from .suite import KW, HeadProblem, LinearHeadSuite, _from_kd, _weight, matmul_slack


def _pallas_tpu_missing() -> bool:
    try:
        import jax.experimental.pallas.tpu  # noqa: F401
    except ImportError:
        return True
    return False


# the TPU lowering tests below skipped with tests/test_pallas.py's importorskip before
needs_pallas_tpu = pytest.mark.skipif(_pallas_tpu_missing(),
                                      reason="could not import 'jax.experimental.pallas.tpu'")


class TestJaxPallas(LinearHeadSuite):
    FW, BACKEND = "jax", "pallas"
    head_case = cases(("DK", "bfloat16"))  # both layouts and dtypes: the chunked classes
    ce_dtype = cases("bfloat16")
    opd_term = cases(("total", "float32"))

    @pytest.fixture(autouse=True)
    def _interpret(self, monkeypatch):
        pytest.importorskip("jax.experimental.pallas.tpu")
        monkeypatch.setenv("DLM_KERNELS_PALLAS_INTERPRET", "1")

    @pytest.mark.parametrize("layout,dtype,teacher", [("DK", "bfloat16", "logits"),
                                                      ("KD", "float32", "logits"),
                                                      ("KD", "bfloat16", "head")])
    def test_fused_kernels(self, rng, layout, dtype, teacher):
        """A student head with the teacher as logits (and their gradient) or as a head of
        another width (constant) runs the three fused kernels (no logits kernel, no [N, K]
        logits): 45 rows in blocks of 16 and K = 301 in blocks of 128 (both ragged), bias,
        every feature on; values and gradients vs the float64 oracle."""
        self.check_fused(rng, layout, dtype, teacher, KW)

    @pytest.mark.parametrize("temperature,softcap", [
        (1e-8, 6.0),
        (1e-4, None),
        (0.7, 1e38), (0.7, 1e-3)], ids=str)
    def test_fused_kernels_temperature_and_softcap(self, rng, temperature, softcap):
        """The fused kernels at small temperatures (T_ce = 1.5 T, T_kl = 1.25 T; logits up to
        8 make the rows one-hot, or uniform over tied maxima, with lse near 8e8) and at both
        ends of the softcap (saturated; c past 2^126, where z / c is not a normal float32)."""
        kw = dict(temperature=temperature, ce_temperature=1.5 * temperature, softcap=softcap,
                  teacher_temperature=1.25 * temperature)
        self.check_fused(rng, "KD", "float32", "logits", kw)

    def check_fused(self, rng, layout, dtype, teacher, kw):
        import jax

        fw, p = self.fw, HeadProblem(rng, teacher=teacher == "head")
        arr = lambda a, dt=None: fw.array(a, dt)  # noqa: E731
        flat = lambda a: arr(a.reshape(-1))  # noqa: E731
        y, act, x, d = flat(p.y), flat(p.active.astype(np.float32)), flat(p.x), flat(p.d)
        u = rng.normal(size=(p.n, p.k)) * 2 if teacher == "logits" else p.u()
        u = fw.numpy(arr(u, "float32"))  # the oracle's teacher: the float32 values the API sees
        grad_u = teacher == "logits"

        def fn(h, w, b, t):
            if teacher == "head":
                t = self.head(arr(p.ht.reshape(p.n, -1), dtype), _weight(fw, p.wt, layout, dtype),
                              None, layout, 16)
            s = fw.api.token_stats(self.head(h, w, b, layout, 16), y, act, shift_ids=x,
                                   shift=d.astype(fw.jnp.float32), teacher_logits=t,
                                   teacher_grad=grad_u, backend=self.BACKEND, chunk_size=128,
                                   **kw)
            return s.lse, s.logp, s.entropy, s.kl

        primals = (arr(p.h.reshape(p.n, -1), dtype), _weight(fw, p.w, layout, dtype),
                   arr(p.b, dtype), arr(u, "float32"))
        cot = [c.reshape(-1) for c in p.cot]
        cots = tuple(fw.jnp.asarray(c, fw.jnp.float32) for c in cot)
        jaxpr = str(jax.make_jaxpr(lambda *a: jax.vjp(fn, *a)[1](cots))(*primals))
        for kernel in ("dlm_linear_head_fwd", "dlm_linear_head_dh", "dlm_linear_head_dw"):
            assert kernel in jaxpr, f"{kernel} not launched"
        assert "dlm_token_stats" not in jaxpr, "the head fell back to materialised logits"
        outs, (gh, gw, gb, gu) = fw.vjp(fn, primals, cot)
        okw = dict(x=p.x.reshape(-1), d=p.d.reshape(-1), u=u, T=kw["temperature"],
                   T_ce=kw["ce_temperature"], T_kl=kw["teacher_temperature"],
                   softcap=kw["softcap"])
        active, ys = p.active.reshape(-1) != 0, p.y.reshape(-1)
        for name, got, exp in zip(("lse", "logp", "entropy", "kl"), outs,
                                  oracle.token_stats(p.z(), ys, active, **okw)):
            assert_close(got.reshape(-1), exp, "float32", name)
        dz, du = oracle.token_stats_vjp(p.z(), ys, active, cot, **okw)
        dz_err = oracle.saved_lse_slack(p.z(), ys, active, cot, **okw)
        h = p.h.reshape(p.n, -1)
        assert_close(gh, dz @ p.w, dtype, "d hidden", slack=matmul_slack(dz, dz_err, p.w, dtype))
        assert_close(gw, _from_kd(dz.T @ h, layout), dtype, "d weight",
                     slack=_from_kd(matmul_slack(dz.T, dz_err.T, np.abs(h), dtype), layout))
        assert_close(gb, dz.sum(0), dtype, "d bias",
                     slack=matmul_slack(dz.T, dz_err.T, np.ones((p.n, 1)), dtype)[:, 0])
        if grad_u:  # (a teacher head's arrays are constants here: fn builds it inside)
            t_kl = kw["teacher_temperature"]
            scale = cancellation_scale(cot[3], p.z() / kw["temperature"], u / t_kl,
                                       temperature=t_kl)
            assert_close(gu, du, "float32", "d teacher logits", scale=scale)


@needs_pallas_tpu
@pytest.mark.parametrize("objective", ["ce", "policy"])
def test_tpu_lowering_linear_head(monkeypatch, objective):
    """A linear head at N = 8192, D = 2560, K = 262144, bf16 lowers for TPU as the three fused
    Mosaic kernels (statistics, dH, dW: every logits tile made on the MXU in VMEM), for
    weighted CE and for per-token log-probs with entropy; no [N, K] array in the program and
    no float32 copy of the weight's or the hidden states' gradient."""
    import jax
    import jax.numpy as jnp

    import dlm_kernels.jax as D

    monkeypatch.setenv("DLM_KERNELS_PALLAS_INTERPRET", "0")
    n, d, k = 8192, 2560, 262144

    def loss(h, w, y, m):
        batch = D.DiffusionTokenBatch.create(model_inputs=y, target_ids=y, loss_weights=m)
        head = D.LinearHead(h, w, row_chunk=1024)  # a TPU host's default at this shape
        if objective == "ce":
            return D.weighted_cross_entropy(head, batch, backend="pallas").unreduced_sum
        lp, ent = D.per_token_logps(head, batch, stop_gradient=False, return_entropy=True,
                                    backend="pallas")
        return jnp.sum(lp) + jnp.sum(ent)

    args = (jax.ShapeDtypeStruct((1, n, d), jnp.bfloat16),
            jax.ShapeDtypeStruct((d, k), jnp.bfloat16),
            jax.ShapeDtypeStruct((1, n), jnp.int32), jax.ShapeDtypeStruct((1, n), jnp.float32))
    text = jax.jit(jax.value_and_grad(loss, argnums=(0, 1))).trace(*args).lower(
        lowering_platforms=("tpu",)).as_text()
    for kernel in ("dlm_linear_head_fwd", "dlm_linear_head_dh", "dlm_linear_head_dw"):
        assert text.count(kernel) >= 1, f"{kernel} not in the program"
    assert text.count("tpu_custom_call") == 3, "exactly the three fused kernels expected"
    assert f"{n}x{k}x" not in text and f"{k}x{n}x" not in text, "an [N, K] array was built"
    # dW and dH leave the kernels in bf16, summed in float32 VMEM: no float32 copy of either
    assert f"{d}x{k}xf32" not in text and f"1x{n}x{d}xf32" not in text, "a float32 gradient"


@needs_pallas_tpu
def test_linear_head_blocks_fit_vmem():
    """Each fused head kernel's blocks at DiffusionGemma's width and vocabulary (and at a
    small ragged shape) keep to the tile rules and the VMEM budget; row_chunk caps BN."""
    from dlm_kernels.kernels.pallas import linear_head as H

    for kind in ("forward", "dh", "dw"):
        logits, head = H.Part(None, itemsize=2), H.Part("KD", 2560, True, 2)
        for n, k, d, itemsize, teacher, cap in [(8192, 262144, 2560, 2, None, None),
                                                (8192, 262144, 2560, 2, logits, None),
                                                (8192, 262144, 2560, 2, head, None),
                                                (8192, 262144, 2560, 4, logits, 1024),
                                                (45, 301, 19, 4, logits, 16)]:
            bn, bk = H.head_blocks(kind, k, d, itemsize, teacher, block_n=cap)
            assert bn % 16 == 0 and bk % 128 == 0 and (cap is None or bn <= cap), (kind, bn, bk)
            assert H.vmem_bytes(kind, bn, bk, d, itemsize, teacher) <= H.VMEM_BUDGET
            if n >= 256:
                assert bn >= 64 and bk >= 128, (kind, bn, bk)
