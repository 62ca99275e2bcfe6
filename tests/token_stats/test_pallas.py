"""The pallas backend: the parity suites in TPU interpret mode on CPU (once with race
detection), and TPU lowering at real shapes, where the (8, 128) block rules are enforced."""

from __future__ import annotations


import numpy as np
import pytest

pytest.importorskip("jax.experimental.pallas.tpu")

from dlm_kernels.testing import pallas_race_detection  # noqa: E402
from harness import cases, framework  # noqa: E402

from .suite import (FEATURES, KERNEL_MASKED_SPANS, KERNEL_STUDENT_MASKS,  # noqa: E402
                    ROTATED_SHAPE_DTYPES, TokenStatsSuite, check_jit_grad_vmap, make_case)


@pytest.fixture(autouse=True)
def _interpret(monkeypatch):
    monkeypatch.setenv("DLM_KERNELS_PALLAS_INTERPRET", "1")


class TestJaxPallas(TokenStatsSuite):
    FW, BACKEND = "jax", "pallas"
    shape_dtype = cases(*ROTATED_SHAPE_DTYPES)
    masked_span, student_mask = cases(*KERNEL_MASKED_SPANS), cases(*KERNEL_STUDENT_MASKS)
    CHUNK_SIZES = (None, 128)  # the budgeted blocks, and many ragged vocabulary steps
    SHAPE_CHUNK_SIZES = (128,)  # the shape sweep: many steps (the budget: the features)


def test_race_detection_finds_no_races(rng, monkeypatch):
    """Inside ``pallas_race_detection`` the kernels run with race detection (its reads are
    checked: a spy counts them), also after a call of the same shapes outside the block (the
    package's programs are cached: the block traces its own, and drops it after), and it
    finds no race; outside the block nothing is checked."""
    interp = pytest.importorskip("jax._src.pallas.mosaic.interpret.interpret_pallas_call")
    checks = []
    check_read = interp.RaceDetectionState.check_read

    def spy(self, *args, **kwargs):
        checks.append(1)
        return check_read(self, *args, **kwargs)

    monkeypatch.setattr(interp.RaceDetectionState, "check_read", spy)
    suite = TestJaxPallas()
    case = make_case(framework("jax"), rng, (9, 3), 300, "float32", FEATURES["all"])
    suite.check(case, rng, "float32", chunk_size=128)
    assert not checks, "race detection ran outside pallas_race_detection()"
    with pallas_race_detection():
        suite.check(case, rng, "float32", chunk_size=128)
    assert checks, "race detection did not run inside pallas_race_detection()"
    assert interp.races is not None and not interp.races.races_found
    checks.clear()
    suite.check(case, rng, "float32", chunk_size=128)
    assert not checks, "race detection still ran after pallas_race_detection()"


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

    for k, itemsize, teacher, backward in [(262144, 2, True, True), (262144, 4, True, True),
                                           (262144, 2, False, False), (50257, 4, False, True)]:
        bn, bk = K.block_sizes(k, itemsize, teacher, backward)
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


# Vector operations per element of a kernel body: everything that computes on a full
# (BN, BK) tile, read off the kernel's jaxpr (loads, stores and broadcasts left out).
_LAYOUT = {"get", "swap", "broadcast_in_dim"}


def _tile_ops(jaxpr, tile, ops):
    for eqn in jaxpr.eqns:
        nested = False  # control flow (pl.when) and calls: count what they contain
        for value in eqn.params.values():
            for sub in value if isinstance(value, (list, tuple)) else [value]:
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    nested = True
                    _tile_ops(inner, tile, ops)
        if nested:
            continue
        on_tile = [v.aval.shape == tile for v in list(eqn.invars) + list(eqn.outvars)
                   if hasattr(getattr(v, "aval", None), "shape")]
        if any(on_tile) and eqn.primitive.name not in _LAYOUT:
            ops.append(eqn.primitive.name)
    return ops


def kernel_vector_ops(fn, *args):
    """{pallas_call name: [primitive names of its tile operations]} for fn(*args)."""
    import jax

    found = {}

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "pallas_call":
                tile = tuple(getattr(b, "block_size", b)
                             for b in eqn.params["grid_mapping"].block_mappings[0].block_shape)
                name = str(eqn.params.get("name_and_src_info") or eqn.params.get("name"))
                name = name.split()[0]
                found[name] = _tile_ops(eqn.params["jaxpr"], tile, [])
            for value in eqn.params.values():
                for sub in value if isinstance(value, (list, tuple)) else [value]:
                    inner = getattr(sub, "jaxpr", sub)
                    if hasattr(inner, "eqns"):
                        walk(inner)

    walk(jax.make_jaxpr(fn)(*args).jaxpr)
    return found


def test_full_blocks_pay_for_no_masks(monkeypatch):
    """As the CE objective launches them at a vocabulary that fills whole blocks, the kernel
    bodies do only the math of docs/design.md §2: no masks in the forward (an online
    logsumexp, and the target's logit by one compare of the lane ids with it, a select and a
    sum: logp comes from the kernel, as on Triton), and in the gradient one compare for the
    target column plus the two selects that zero inactive rows and place the target's
    term."""
    import jax
    import jax.numpy as jnp

    import dlm_kernels.jax as D

    monkeypatch.setenv("DLM_KERNELS_PALLAS_INTERPRET", "0")
    n, k = 1024, 32768

    def loss(z, y, w):
        batch = D.DiffusionTokenBatch.create(model_inputs=y, target_ids=y, loss_weights=w)
        return D.weighted_cross_entropy(z, batch, backend="pallas").compute()

    ops = kernel_vector_ops(jax.grad(loss), jax.ShapeDtypeStruct((1, n, k), jnp.bfloat16),
                            jax.ShapeDtypeStruct((1, n), jnp.int32),
                            jax.ShapeDtypeStruct((1, n), jnp.float32))
    fwd, bwd = ops["dlm_token_stats_fwd"], ops["dlm_token_stats_bwd"]
    assert sorted(fwd) == sorted(["convert_element_type", "reduce_max", "sub", "exp",
                                  "reduce_sum", "eq", "select_n", "reduce_sum"]), fwd
    assert bwd.count("eq") == 1 and bwd.count("select_n") == 2 and "lt" not in bwd, bwd
    assert len(bwd) <= 10, bwd
