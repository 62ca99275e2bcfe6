"""Batch contract: one test per validation rule (error type and the argument named),
merging, WeightedSum, and JAX pytree behaviour under jit and a leading-axis NamedSharding."""

from __future__ import annotations

import numpy as np
import pytest

from harness import framework

FWS = ("torch", "jax")


def good(fw, b=2, l=3, k=11):
    return dict(model_inputs=fw.array(np.zeros((b, l), np.int32)),
                target_ids=fw.array(np.ones((b, l), np.int32)),
                loss_weights=fw.array(np.ones((b, l), np.float32)))


BAD_BATCHES = [
    # (what to change, exception type, words the message must hold)
    (dict(model_inputs=np.zeros((2, 3, 1), np.int32)), ValueError, "model_inputs"),
    (dict(model_inputs=np.zeros((2, 3), np.float32)), TypeError, "model_inputs"),
    (dict(target_ids=np.zeros((2, 4), np.int32)), ValueError, "target_ids"),
    (dict(target_ids=np.zeros((2, 3), np.float32)), TypeError, "target_ids"),
    (dict(loss_weights=np.ones((3, 3), np.float32)), ValueError, "loss_weights"),
    (dict(loss_weights=np.ones((2, 3), np.int32)), TypeError, "loss_weights"),
    (dict(loss_weights=np.array([[1, -1, 1], [1, 1, 1]], np.float32)), ValueError, "loss_weights"),
    (dict(loss_weights=np.array([[1, np.nan, 1], [1, 1, 1]], np.float32)), ValueError, "loss_weights"),
    (dict(loss_weights=np.array([[1, np.inf, 1], [1, 1, 1]], np.float32)), ValueError, "loss_weights"),
    (dict(target_ids=np.array([[0, -1, 0], [0, 0, 0]], np.int32)), ValueError, "target_ids"),
]


@pytest.mark.parametrize("fw_name", FWS)
@pytest.mark.parametrize("change,exc,word", BAD_BATCHES, ids=lambda v: str(v)[:40])
def test_token_batch_validation(fw_name, change, exc, word):
    fw = framework(fw_name)
    fields = good(fw)
    fields.update({k: fw.array(v) for k, v in change.items()})
    with pytest.raises(exc, match=word):
        fw.api.DiffusionTokenBatch.create(**fields)


@pytest.mark.parametrize("fw_name", FWS)
def test_sentinel_targets_allowed_at_inactive_positions(fw_name):
    fw = framework(fw_name)
    fields = good(fw)
    fields["target_ids"] = fw.array(np.array([[0, -1, 0], [0, 0, 99]], np.int32))
    fields["loss_weights"] = fw.array(np.array([[1, 0, 1], [1, 1, 0]], np.float32))
    batch = fw.api.DiffusionTokenBatch.create(**fields)
    fw.api.validate_diffusion_logits(batch, fw.array(np.zeros((2, 3, 11), np.float32)))


@pytest.mark.parametrize("fw_name", FWS)
def test_logits_validation(fw_name):
    fw = framework(fw_name)
    batch = fw.api.DiffusionTokenBatch.create(**good(fw))
    cases = [
        (np.zeros((2, 3), np.float32), ValueError, r"logits must have shape \[B, L, K\]"),
        (np.zeros((2, 4, 11), np.float32), ValueError, r"logits .*\[2, 3\]"),
        (np.zeros((2, 3, 11), np.int32), TypeError, "logits must have a floating dtype"),
        (np.zeros((2, 3, 1), np.float32), ValueError, r"target_ids at active positions must be in \[0, 1\)"),
    ]
    for logits, exc, pattern in cases:
        with pytest.raises(exc, match=pattern):
            fw.api.validate_diffusion_logits(batch, fw.array(logits))
        with pytest.raises(exc, match=pattern):
            fw.api.per_token_logps(fw.array(logits), batch)
    with pytest.raises(TypeError, match="batch must be a DiffusionTokenBatch"):
        fw.api.per_token_logps(fw.array(np.zeros((2, 3, 11), np.float32)), "not a batch")


@pytest.mark.parametrize("fw_name", FWS)
def test_distillation_batch_validation(fw_name):
    fw = framework(fw_name)
    student = fw.api.DiffusionTokenBatch.create(**good(fw))
    with pytest.raises(TypeError, match="student_batch"):
        fw.api.DiffusionDistillationBatch.create(student_batch=None,
                                                 teacher_logits=fw.array(np.zeros((2, 3, 11), np.float32)))
    with pytest.raises(ValueError, match="teacher_logits"):
        fw.api.DiffusionDistillationBatch.create(student_batch=student,
                                                 teacher_logits=fw.array(np.zeros((2, 4, 11), np.float32)))
    with pytest.raises(TypeError, match="teacher_logits"):
        fw.api.DiffusionDistillationBatch.create(student_batch=student,
                                                 teacher_logits=fw.array(np.zeros((2, 3, 11), np.int32)))
    nan_teacher = np.zeros((2, 3, 11), np.float32)
    nan_teacher[0, 0, 4] = np.nan
    batch = fw.api.DiffusionDistillationBatch.create(student_batch=student,
                                                     teacher_logits=fw.array(nan_teacher))
    z = fw.array(np.zeros((2, 3, 11), np.float32))
    with pytest.raises(ValueError, match="teacher_logits must be finite at active positions"):
        fw.api.opd_loss(z, batch)
    with pytest.raises(ValueError, match="teacher_logits must have shape"):
        fw.api.opd_loss(fw.array(np.zeros((2, 3, 12), np.float32)), batch)


BAD_SCALARS = [
    (dict(temperature=0.0), "temperature"),
    (dict(temperature=-1.0), "temperature"),
    (dict(temperature=float("nan")), "temperature"),
    (dict(temperature=float("inf")), "temperature"),
    (dict(temperature=True), "temperature"),
    (dict(soft_loss_weight=-0.5), "soft_loss_weight"),
    (dict(hard_loss_weight=float("nan")), "hard_loss_weight"),
    (dict(soft_loss_weight=True), "soft_loss_weight"),
    (dict(soft_loss_weight=0.0, hard_loss_weight=0.0), "both 0"),
]


@pytest.mark.parametrize("fw_name", FWS)
@pytest.mark.parametrize("kw,word", BAD_SCALARS, ids=str)
def test_opd_scalar_validation(fw_name, kw, word):
    fw = framework(fw_name)
    student = fw.api.DiffusionTokenBatch.create(**good(fw))
    z = fw.array(np.zeros((2, 3, 11), np.float32))
    batch = fw.api.DiffusionDistillationBatch.create(student_batch=student, teacher_logits=z)
    with pytest.raises(ValueError, match=word):
        fw.api.opd_loss(z, batch, **kw)


@pytest.mark.parametrize("fw_name", FWS)
def test_per_token_logps_temperature_validation(fw_name):
    fw = framework(fw_name)
    batch = fw.api.DiffusionTokenBatch.create(**good(fw))
    z = fw.array(np.zeros((2, 3, 11), np.float32))
    for bad in (0.0, -2.0, float("nan"), False):
        with pytest.raises(ValueError, match="temperature"):
            fw.api.per_token_logps(z, batch, temperature=bad)


@pytest.mark.parametrize("fw_name", FWS)
def test_sft_argument_validation(fw_name):
    fw = framework(fw_name)
    z = fw.array(np.zeros((2, 3, 11), np.float32))
    ids = fw.array(np.zeros((2, 3), np.int32))
    t = fw.array(np.full(2, 0.5, np.float32))
    mask = fw.array(np.ones((2, 3), np.float32))
    call = lambda **kw: fw.api.diffusion_sft_loss(**{**dict(logits=z, x0=ids, xt=ids, t=t, loss_mask=mask,
                                                            variant="base-sft", vocab_size=11), **kw})
    with pytest.raises(ValueError, match="variant must be one of"):
        call(variant="nope")
    with pytest.raises(ValueError, match="vocab_size"):
        call(vocab_size=0)
    with pytest.raises(ValueError, match="diffusion_weight_clip"):
        call(diffusion_weight_clip=-1.0)
    with pytest.raises(ValueError, match=r"x0 must have shape .*\[2, 3\]; got \[2, 4\]"):
        call(x0=fw.array(np.zeros((2, 4), np.int32)))
    with pytest.raises(TypeError, match="xt must have an integer dtype"):
        call(xt=fw.array(np.zeros((2, 3), np.float32)))
    with pytest.raises(ValueError, match=r"t must have shape \[B\]"):
        call(t=fw.array(np.zeros((2, 1), np.float32)))
    with pytest.raises(ValueError, match="loss_mask"):
        call(loss_mask=fw.array(np.ones((3, 3), np.float32)))
    with pytest.raises(ValueError, match=r"logits must have shape \[B, L, K\]"):
        call(logits=fw.array(np.zeros((6, 11), np.float32)))
    assert fw.api.normalize_variant("loo-reweighted-ce") == "reweighted-loo-ce"


@pytest.mark.parametrize("fw_name", FWS)
def test_token_stats_argument_validation(fw_name):
    fw = framework(fw_name)
    z = fw.array(np.zeros((4, 9), np.float32))
    y = fw.array(np.zeros(4, np.int32))
    ts = fw.api.token_stats
    with pytest.raises(ValueError, match=r"targets must have shape .*\[4\]; got \[5\]"):
        ts(z, fw.array(np.zeros(5, np.int32)))
    with pytest.raises(TypeError, match="targets must have an integer dtype"):
        ts(z, fw.array(np.zeros(4, np.float32)))
    with pytest.raises(TypeError, match="logits must have a floating dtype"):
        ts(fw.array(np.zeros((4, 9), np.int32)), y)
    with pytest.raises(ValueError, match=r"weights must have shape"):
        ts(z, y, fw.array(np.ones(3, np.float32)))
    with pytest.raises(ValueError, match="shift_ids and shift must be given together"):
        ts(z, y, shift_ids=y)
    with pytest.raises(ValueError, match=r"teacher_logits must have shape"):
        ts(z, y, teacher_logits=fw.array(np.zeros((4, 8), np.float32)))
    with pytest.raises(ValueError, match="teacher_grad=True needs teacher_logits"):
        ts(z, y, teacher_grad=True)
    with pytest.raises(ValueError, match="softcap"):
        ts(z, y, softcap=0.0)
    with pytest.raises(ValueError, match="ce_temperature"):
        ts(z, y, ce_temperature=-1.0)
    with pytest.raises(ValueError, match="chunk_size"):
        ts(z, y, chunk_size=0)


@pytest.mark.parametrize("fw_name", FWS)
def test_merge_diffusion_batches(fw_name):
    fw = framework(fw_name)
    a = fw.api.DiffusionTokenBatch.create(**good(fw, b=2))
    b = fw.api.DiffusionTokenBatch.create(**good(fw, b=3))
    merged = fw.api.merge_diffusion_batches([a, b])
    assert tuple(merged.target_ids.shape) == (5, 3)
    za, zb = fw.array(np.zeros((2, 3, 11), np.float32)), fw.array(np.ones((3, 3, 11), np.float32))
    da = fw.api.DiffusionDistillationBatch.create(student_batch=a, teacher_logits=za)
    db = fw.api.DiffusionDistillationBatch.create(student_batch=b, teacher_logits=zb)
    md = fw.api.merge_diffusion_batches([da, db])
    assert tuple(md.teacher_logits.shape) == (5, 3, 11)
    np.testing.assert_array_equal(fw.numpy(md.teacher_logits)[2:], 1.0)
    with pytest.raises(ValueError, match="non-empty"):
        fw.api.merge_diffusion_batches([])
    with pytest.raises(TypeError, match=r"batches\[1\]"):
        fw.api.merge_diffusion_batches([a, da])
    c = fw.api.DiffusionTokenBatch.create(**good(fw, l=4))
    with pytest.raises(ValueError, match=r"batches\[1\]\.model_inputs"):
        fw.api.merge_diffusion_batches([a, c])


@pytest.mark.parametrize("fw_name", FWS)
def test_weighted_sum(fw_name):
    fw = framework(fw_name)
    ws = fw.api.WeightedSum(fw.array(np.float32(3.0)), fw.array(np.float32(4.0)))
    assert float(fw.numpy(ws.compute())) == 0.75
    zero = fw.api.WeightedSum(fw.array(np.float32(3.0)), fw.array(np.float32(0.0)))
    assert float(fw.numpy(zero.compute())) == 0.0


def test_jax_contract_is_a_pytree_under_jit_and_sharding():
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    import dlm_kernels.jax as D

    devices = jax.devices()
    assert len(devices) >= 2, "conftest asks XLA for several host devices"
    mesh = Mesh(np.array(devices[:2]), ("data",))
    rng = np.random.default_rng(0)
    batch = D.DiffusionTokenBatch.create(
        model_inputs=jnp.asarray(rng.integers(0, 13, (4, 5)), jnp.int32),
        target_ids=jnp.asarray(rng.integers(0, 13, (4, 5)), jnp.int32),
        loss_weights=jnp.asarray(rng.uniform(0, 1, (4, 5)), jnp.float32))
    teacher = jnp.asarray(rng.normal(size=(4, 5, 13)), jnp.float32)
    dbatch = D.DiffusionDistillationBatch.create(student_batch=batch, teacher_logits=teacher)
    leaves = jax.tree_util.tree_leaves(dbatch)
    assert len(leaves) == 4
    sharded = jax.device_put(dbatch, NamedSharding(mesh, P("data")))
    logits = jax.device_put(jnp.asarray(rng.normal(size=(4, 5, 13)), jnp.float32),
                            NamedSharding(mesh, P("data")))

    @jax.jit
    def step(z, b):
        b = b.replace(student_batch=b.student_batch.validate())  # static checks under tracing
        total, aux = D.opd_loss(z, b, soft_loss_weight=1.0, hard_loss_weight=0.5)
        return total.compute(), aux

    loss, aux = step(logits, sharded)
    ref, _ = D.opd_loss(logits, dbatch, soft_loss_weight=1.0, hard_loss_weight=0.5, backend="reference")
    np.testing.assert_allclose(float(loss), float(ref.compute()), rtol=2e-5)
    assert isinstance(aux["distill/soft_loss"], D.WeightedSum)
    out = jax.jit(lambda b: b)(sharded)
    assert isinstance(out, D.DiffusionDistillationBatch)
    assert out.teacher_logits.sharding.spec == P("data")
