"""The pallas backend: the parity suites in TPU interpret mode on CPU (once with race
detection), and TPU lowering at real shapes, where the (8, 128) block rules are enforced."""

from __future__ import annotations


import numpy as np
import pytest

pytest.importorskip("jax.experimental.pallas.tpu")

from harness import framework  # noqa: E402
from test_objectives import ObjectivesSuite  # noqa: E402
from test_token_stats import FEATURES, TokenStatsSuite, check_jit_grad_vmap, make_case  # noqa: E402


@pytest.fixture(autouse=True)
def _interpret(monkeypatch):
    monkeypatch.setenv("DLM_KERNELS_PALLAS_INTERPRET", "1")


class TestJaxPallas(TokenStatsSuite):
    FW, BACKEND = "jax", "pallas"
    CHUNK_SIZES = (None, 128)  # the budgeted blocks, and many ragged vocabulary steps


class TestJaxPallasObjectives(ObjectivesSuite):
    FW, BACKEND = "jax", "pallas"


def test_race_detection_finds_no_races(rng, monkeypatch):
    interp = pytest.importorskip("jax._src.pallas.mosaic.interpret.interpret_pallas_call")
    monkeypatch.setenv("DLM_KERNELS_PALLAS_DETECT_RACES", "1")
    suite = TestJaxPallas()
    case = make_case(framework("jax"), rng, (9, 3), 300, "float32", FEATURES["all"])
    suite.check(case, rng, "float32", chunk_size=128)
    assert interp.races is not None, "race detection did not run"
    assert not interp.races.races_found


LOWERING = [(16384, 262144, "bfloat16", False, True), (16384, 262144, "bfloat16", True, True),
            (16384, 262144, "bfloat16", True, False), (16384, 50257, "bfloat16", True, True),
            (1000, 50257, "float32", True, True)]


@pytest.mark.parametrize("n,k,dtype,teacher,entropy", LOWERING, ids=str)
def test_tpu_lowering(monkeypatch, n, k, dtype, teacher, entropy):
    """Forward and gradient lower for TPU and emit the Mosaic custom call (also without
    the entropy's sums, as the CE and distillation objectives launch them)."""
    import jax
    import jax.numpy as jnp

    import dlm_kernels.jax as D

    monkeypatch.setenv("DLM_KERNELS_PALLAS_INTERPRET", "0")
    dt = getattr(jnp, dtype)

    def loss(z, u, y, x, w):
        s = D.token_stats(z, y, w, teacher_logits=u if teacher else None, teacher_grad=teacher,
                          temperature=0.9, ce_temperature=1.1, softcap=30.0, shift_ids=x,
                          shift=w * 2.0, entropy=entropy, backend="pallas")
        return jnp.sum(s.logp) + (jnp.sum(s.entropy) if entropy else 0.0) + jnp.sum(s.kl)

    args = (jax.ShapeDtypeStruct((n, k), dt), jax.ShapeDtypeStruct((n, k), dt),
            jax.ShapeDtypeStruct((n,), jnp.int32), jax.ShapeDtypeStruct((n,), jnp.int32),
            jax.ShapeDtypeStruct((n,), jnp.float32))
    argnums = (0, 1) if teacher else 0
    text = jax.jit(jax.value_and_grad(loss, argnums=argnums)).trace(*args).lower(
        lowering_platforms=("tpu",)).as_text()
    assert text.count("tpu_custom_call") >= 2, "forward and backward Mosaic kernels expected"


def test_vmem_budget_and_blocks():
    from dlm_kernels.kernels.pallas import token_stats as K

    for n, k, itemsize, teacher, backward in [(16384, 262144, 2, True, True), (16384, 262144, 4, True, True),
                                              (16384, 262144, 2, False, False), (7, 50257, 4, False, True)]:
        bn, bk = K.block_sizes(n, k, itemsize, teacher, backward)
        assert bn % 8 == 0 and bk % 128 == 0 and bn >= 8
        assert K.vmem_bytes(bn, bk, itemsize, teacher, backward) <= K.VMEM_BUDGET


def test_pallas_not_auto_on_cpu(monkeypatch):
    monkeypatch.delenv("DLM_KERNELS_PALLAS_INTERPRET", raising=False)
    fw = framework("jax")
    assert fw.api.backend_for(fw.array(np.zeros((2, 3), np.float32))) == "chunked"
    monkeypatch.setenv("DLM_KERNELS_PALLAS_INTERPRET", "maybe")
    with pytest.raises(ValueError, match="DLM_KERNELS_PALLAS_INTERPRET must be 0 or 1"):
        fw.api.token_stats(fw.array(np.zeros((2, 3), np.float32)), fw.array(np.zeros(2, np.int32)),
                           backend="pallas")


def test_pallas_jit_grad_vmap():
    check_jit_grad_vmap("pallas")
