"""Batch contract: one test per validation rule (error type and the argument named),
merging, WeightedSum, and JAX pytree behaviour under jit and a leading-axis NamedSharding."""

from __future__ import annotations

import re

import numpy as np
import pytest

from dlm_kernels._checks import shape_str

import oracle
from harness import assert_close, framework, new_seed
from objectives.suite import sft_inputs

FWS = ("torch", "jax")


def good(fw, b=2, l=3, k=11):
    return dict(model_inputs=fw.array(np.zeros((b, l), np.int32)),
                target_ids=fw.array(np.ones((b, l), np.int32)),
                loss_weights=fw.array(np.ones((b, l), np.float32)))


def _case_ids(cases):
    """Stable test ids (the same in every pytest-xdist worker): the expected message of each
    case, numbered; never the repr of a lambda or an array."""
    return [f"{i}-" + re.sub(r"[^A-Za-z0-9_]+", "_", str(case[-1]))[:40].strip("_")
            for i, case in enumerate(cases)]


BAD_BATCHES = [
    # (what to change, exception type, pattern the message must match)
    (dict(model_inputs=np.zeros((3, 3), np.int32)), ValueError,
     r"model_inputs has batch size 3; expected 2 .*; got shape \[3, 3\]"),
    (dict(model_inputs=np.zeros((2, 3), np.complex64)), TypeError,
     r"model_inputs must have a real numeric or boolean dtype \(bool, integer or floating\); "
     "got complex64"),
    (dict(target_ids=np.zeros((2, 3, 1), np.int32)), ValueError,
     r"target_ids must have shape \[batch, length\]; got \[2, 3, 1\]"),
    (dict(target_ids=np.zeros((2, 4), np.int32)), ValueError,
     r"loss_weights must match target_ids shape \[2, 4\]; got \[2, 3\]"),
    (dict(target_ids=np.zeros((2, 3), np.float32)), TypeError,
     "target_ids must have an integer dtype; got float32"),
    (dict(loss_weights=np.ones((3, 3), np.float32)), ValueError,
     r"loss_weights must match target_ids shape \[2, 3\]; got \[3, 3\]"),
    (dict(loss_weights=np.ones((2, 3), np.complex64)), TypeError,
     r"loss_weights must have a real numeric or boolean dtype \(.*\); got complex64"),
    (dict(loss_weights=np.array([[1, -1, 1], [1, 1, 1]], np.float32)), ValueError,
     r"loss_weights must be nonnegative; got -1.0 at index \(0, 1\)$"),
    (dict(loss_weights=np.array([[1, 1, 1], [1, 1, -2]], np.int32)), ValueError,
     r"loss_weights must be nonnegative; got -2 at index \(1, 2\)$"),
    (dict(loss_weights=np.array([[1, np.nan, 1], [1, 1, 1]], np.float32)), ValueError,
     r"got nan at index \(0, 1\)$"),
    (dict(loss_weights=np.array([[1, np.inf, 1], [1, 1, 1]], np.float32)), ValueError,
     r"got inf at index \(0, 1\)$"),
    (dict(target_ids=np.array([[0, -1, 0], [0, 0, 0]], np.int32)), ValueError,
     r"active target_ids must be nonnegative; got -1 at index \(0, 1\)$"),
]


@pytest.mark.parametrize("fw_name", FWS)
@pytest.mark.parametrize("change,exc,word", BAD_BATCHES, ids=_case_ids(BAD_BATCHES))
def test_token_batch_validation(fw_name, change, exc, word):
    fw = framework(fw_name)
    fields = good(fw)
    fields.update({k: fw.array(v) for k, v in change.items()})
    with pytest.raises(exc, match=word) as err:
        fw.api.DiffusionTokenBatch.create(**fields)
    assert "np." not in str(err.value), f"numbers in messages are plain: {err.value}"


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
        (np.zeros((2, 3), np.float32), ValueError, r"logits must have shape \[batch, length, vocab\]"),
        (np.zeros((2, 4, 11), np.float32), ValueError, r"logits .*\[2, 3\]"),
        (np.zeros((2, 3, 11), np.int32), TypeError, "logits must have a floating-point dtype"),
        (np.zeros((2, 3, 1), np.float32), ValueError, r"active target_ids must be smaller than vocabulary size 1;"),
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
    with pytest.raises(ValueError, match="active teacher_logits must contain only finite values"):
        fw.api.opd_loss(z, batch)
    with pytest.raises(ValueError, match="student and teacher logits must have identical shapes"):
        fw.api.opd_loss(fw.array(np.zeros((2, 3, 12), np.float32)), batch)


@pytest.mark.parametrize("fw_name", FWS)
def test_teacher_check_reads_rows_not_a_float64_copy(fw_name, monkeypatch):
    """The teacher-value check of opd_loss screens each row by its sum: a finite teacher
    is never copied whole to the host as float64 (that copy doubled the teacher's memory and
    took most of a CPU distillation forward); a finite row whose sum overflows (3e38 twice)
    passes; an inf at an active position still raises, at an inactive one does not."""
    from dlm_kernels import _checks

    fw = framework(fw_name)
    seen = []
    real = _checks.host_values
    monkeypatch.setattr(_checks, "host_values",
                        lambda xp, x, *a: seen.append(tuple(x.shape)) or real(xp, x, *a))
    weights = np.ones((2, 3), np.float32)
    weights[1, 2] = 0.0
    student = fw.api.DiffusionTokenBatch.create(**dict(good(fw), loss_weights=fw.array(weights)))
    z = fw.array(np.zeros((2, 3, 11), np.float32))
    teacher = np.zeros((2, 3, 11), np.float32)
    teacher[1, 2, 5] = np.inf  # an inactive position

    def loss(u):
        batch = fw.api.DiffusionDistillationBatch.create(student_batch=student,
                                                         teacher_logits=fw.array(u))
        return fw.api.opd_loss(z, batch)

    loss(teacher)
    assert seen and (2, 3, 11) not in seen, seen  # the weights and the row sums only
    teacher[0, 1, :2] = 3e38  # finite, its row sum is inf: read in full, and it passes
    loss(teacher)
    teacher[0, 0, 4] = -np.inf
    with pytest.raises(ValueError, match="active teacher_logits must contain only finite values"):
        loss(teacher)


BAD_SCALARS = [
    (dict(temperature=0.0), "temperature"),
    (dict(temperature=-1.0), "temperature"),
    (dict(temperature=float("nan")), "temperature"),
    (dict(temperature=float("inf")), "temperature"),
    (dict(temperature=True), "temperature"),
    (dict(temperature=2.0 ** -103), "temperature must be at least"),  # FLOAT32_MIN_TEMPERATURE / 2
    (dict(soft_loss_weight=-0.5), "soft_loss_weight"),
    (dict(hard_loss_weight=float("nan")), "hard_loss_weight"),
    (dict(soft_loss_weight=True), "soft_loss_weight"),
    (dict(soft_loss_weight=0.0, hard_loss_weight=0.0), "at least one loss weight must be positive"),
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
    for bad in (0.0, -2.0, float("nan"), False, 1e-31):
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
    with pytest.raises(TypeError, match="logits must have a floating-point dtype"):
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
def test_a_teacher_head_is_read_through_the_protocol(fw_name):
    """A LinearHead teacher: batches holding one are not merged (the error names the
    batch's field and says what to merge instead), and its logits are never read for the
    finite check (a NaN hidden state gives a NaN loss, not an error)."""
    fw = framework(fw_name)
    api = fw.api
    student = api.DiffusionTokenBatch.create(**good(fw))
    h = np.zeros((2, 3, 5), np.float32)
    w = np.zeros((11, 5) if api.LinearHead.DEFAULT_LAYOUT == "KD" else (5, 11), np.float32)
    head = lambda h: api.LinearHead(fw.array(h), fw.array(w))
    arrays = api.DiffusionDistillationBatch.create(
        student_batch=student, teacher_logits=fw.array(np.zeros((2, 3, 11), np.float32)))
    heads = api.DiffusionDistillationBatch.create(student_batch=student, teacher_logits=head(h))
    with pytest.raises(TypeError, match=r"batches\[1\]\.teacher_logits is a LinearHead: "
                                        r"merge its hidden states"):
        api.merge_diffusion_batches([arrays, heads])
    h[0, 0, 1] = np.nan  # an active position
    nan_heads = api.DiffusionDistillationBatch.create(student_batch=student,
                                                      teacher_logits=head(h))
    loss, _ = api.opd_loss(fw.array(np.zeros((2, 3, 11), np.float32)), nan_heads)
    assert np.isnan(fw.numpy(loss.unreduced_sum))


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
    rng = np.random.default_rng(new_seed())
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


# -- the Tunix contract: model_inputs is a batch-major pytree ----------------------------------

def tunix_inputs(fw, rng, b=2, l=3, k=11):
    """A Tunix-style batch: a dict of model inputs of several ranks and dtypes."""
    return dict(
        model_inputs={"input_tokens": fw.array(rng.integers(0, k, (b, l)).astype(np.int32)),
                      "positions": fw.array(np.tile(np.arange(l, dtype=np.int32), (b, 1))),
                      "time": fw.array(rng.uniform(size=b).astype(np.float32))},
        target_ids=fw.array(rng.integers(0, k, (b, l)).astype(np.int32)),
        loss_weights=fw.array((rng.uniform(size=(b, l)) < 0.7).astype(np.float32)))


@pytest.mark.parametrize("fw_name", FWS)
@pytest.mark.parametrize("structure", ["dict", "tuple", "nested", "bare", "bool_and_3d"])
def test_model_inputs_pytrees_are_accepted_and_kept(fw_name, structure, rng):
    fw = framework(fw_name)
    fields = tunix_inputs(fw, rng)
    tokens, time = fields["model_inputs"]["input_tokens"], fields["model_inputs"]["time"]
    trees = {
        "dict": fields["model_inputs"],
        "tuple": (tokens, time),
        "nested": {"text": {"tokens": tokens, "extra": [time, tokens]}, "time": time},
        "bare": tokens,
        "bool_and_3d": {"keep": fw.array(np.ones((2, 3), bool)),
                        "embeds": fw.array(rng.normal(size=(2, 3, 4)).astype(np.float32))},
    }
    fields["model_inputs"] = trees[structure]
    batch = fw.api.DiffusionTokenBatch.create(**fields)
    assert batch.model_inputs is trees[structure], "the batch keeps model_inputs as given"
    z = fw.array(rng.normal(size=(2, 3, 11)), "float32")
    got = fw.numpy(fw.api.per_token_logps(z, batch))
    exp = oracle.token_stats(fw.numpy(z).reshape(6, 11), fw.numpy(batch.target_ids).reshape(6),
                             fw.numpy(batch.loss_weights).reshape(6) != 0)[1]
    assert_close(got.reshape(6), exp, "float32", f"logps with {structure} model_inputs")


BAD_MODEL_INPUTS = [
    # (model_inputs built from t = tokens [2, 3] int, exception, pattern)
    (lambda fw, t: {}, ValueError, r"model_inputs must contain at least one array \(.*\); got dict"),
    (lambda fw, t: {"input_tokens": t, "positions": fw.array(np.zeros((3, 3), np.int32))},
     ValueError, r"model_inputs\['positions'\] has batch size 3; expected 2 .*; got shape \[3, 3\]"),
    (lambda fw, t: {"input_tokens": t, "time": fw.array(np.float32(0.5))},
     ValueError, r"model_inputs\['time'\] must be batch-major, not scalar: .*got shape \[\]"),
    (lambda fw, t: {"input_tokens": t, "ids": [1, 2]},
     TypeError, r"model_inputs\['ids'\]\[0\] must be a (torch tensor|JAX/NumPy array or ShapeDtypeStruct); got int"),
    (lambda fw, t: {"input_tokens": t, "name": "abc"},
     TypeError, r"model_inputs\['name'\] must be a (torch tensor|JAX/NumPy array or ShapeDtypeStruct); got str"),
    (lambda fw, t: (t, {"phase": fw.array(np.zeros((2, 3), np.complex64))}),
     TypeError, r"model_inputs\[1\]\['phase'\] must have a real numeric or boolean dtype \(.*\); got complex64"),
]


@pytest.mark.parametrize("fw_name", FWS)
@pytest.mark.parametrize("make,exc,pattern", BAD_MODEL_INPUTS, ids=_case_ids(BAD_MODEL_INPUTS))
def test_model_inputs_leaves_are_checked_by_path(fw_name, make, exc, pattern, rng):
    fw = framework(fw_name)
    fields = tunix_inputs(fw, rng)
    fields["model_inputs"] = make(fw, fields["model_inputs"]["input_tokens"])
    with pytest.raises(exc, match=pattern):
        fw.api.DiffusionTokenBatch.create(**fields)


def test_jax_model_inputs_numpy_structs_and_tracers():
    """Leaves may be NumPy arrays, ShapeDtypeStructs (jax.eval_shape over batch construction)
    or tracers (a batch built inside jit)."""
    import jax
    import jax.numpy as jnp

    import dlm_kernels.jax as D

    rng = np.random.default_rng(new_seed())
    host = {"input_tokens": rng.integers(0, 11, (2, 3)).astype(np.int32),
            "time": rng.uniform(size=2).astype(np.float32)}
    y = rng.integers(0, 11, (2, 3)).astype(np.int32)
    w = np.ones((2, 3), np.float32)
    batch = D.DiffusionTokenBatch.create(model_inputs=host, target_ids=y, loss_weights=w)
    assert isinstance(batch.model_inputs["input_tokens"], np.ndarray)

    S = jax.ShapeDtypeStruct
    spec = D.DiffusionTokenBatch.create(
        model_inputs={"input_tokens": S((2, 3), jnp.int32), "time": S((2,), jnp.float32)},
        target_ids=S((2, 3), jnp.int32), loss_weights=S((2, 3), jnp.bool_))
    assert spec.loss_weights.dtype == jnp.bool_
    with pytest.raises(ValueError, match=r"model_inputs\['time'\] has batch size 3; expected 2"):
        D.DiffusionTokenBatch.create(model_inputs={"time": S((3,), jnp.float32)},
                                     target_ids=S((2, 3), jnp.int32), loss_weights=S((2, 3), jnp.float32))
    shapes = jax.eval_shape(lambda m, t, l: D.DiffusionTokenBatch.create(
        model_inputs=m, target_ids=t, loss_weights=l), host, y, w)
    assert shapes.model_inputs["time"].shape == (2,)

    @jax.jit
    def score(m, t, l, z):
        b = D.DiffusionTokenBatch.create(model_inputs=m, target_ids=t, loss_weights=l)
        return D.compute_diffusion_per_token_logps(z, b, lambda model, inputs: model + 0.0 * inputs["time"][:, None, None])

    z = jnp.asarray(rng.normal(size=(2, 3, 11)), jnp.float32)
    got = np.asarray(score(host, y, w, z))
    exp = oracle.token_stats(np.asarray(z, np.float64).reshape(6, 11), y.reshape(6), np.ones(6, bool))[1]
    assert_close(got.reshape(6), exp, "float32", "logps of a batch built under jit")


@pytest.mark.parametrize("fw_name", FWS)
@pytest.mark.parametrize("dtype", ["bool", "int32", "float32"])
def test_loss_weights_of_any_real_dtype_are_kept_and_converted_by_objectives(fw_name, dtype, rng):
    fw = framework(fw_name)
    fields = tunix_inputs(fw, rng)
    w = rng.integers(0, 3, (2, 3))
    w[0, 0] = 1
    w = w.astype(dtype)
    fields["loss_weights"] = fw.array(w)
    batch = fw.api.DiffusionTokenBatch.create(**fields)
    assert str(batch.loss_weights.dtype).endswith(dtype.replace("bool", "bool")), batch.loss_weights.dtype
    z = fw.array(rng.normal(size=(2, 3, 11)) * 2, "float32")
    ws = fw.api.weighted_cross_entropy(z, batch)
    wf = w.astype(np.float64).reshape(6)
    lp = oracle.token_stats(fw.numpy(z).reshape(6, 11), fw.numpy(batch.target_ids).reshape(6), wf != 0)[1]
    assert_close(fw.numpy(ws.unreduced_sum), -(wf * lp).sum(), "float32", "unreduced_sum")
    assert_close(fw.numpy(ws.denominator), wf.sum(), "float32", "denominator")
    teacher = fw.array(rng.normal(size=(2, 3, 11)), "float32")
    dbatch = fw.api.DiffusionDistillationBatch.create(student_batch=batch, teacher_logits=teacher)
    total, _ = fw.api.opd_loss(z, dbatch, soft_loss_weight=0.0, hard_loss_weight=1.0)
    assert_close(fw.numpy(total.unreduced_sum), -(wf * lp).sum(), "float32", "opd hard term")
    assert str(total.unreduced_sum.dtype).endswith("float32")


@pytest.mark.parametrize("fw_name", FWS)
def test_compute_diffusion_logits_validates_calls_and_returns(fw_name, rng):
    """Tunix's compute_diffusion_logits(model, batch, logits_fn): the batch is validated
    before the model runs, logits_fn gets (model, batch.model_inputs), and its result is
    checked against the batch and returned as it is."""
    fw = framework(fw_name)
    batch = fw.api.DiffusionTokenBatch.create(**tunix_inputs(fw, rng))
    z = fw.array(rng.normal(size=(2, 3, 11)), "float32")
    seen = []

    def logits_fn(model, inputs):
        seen.append((model, inputs))
        return model

    assert fw.api.compute_diffusion_logits(z, batch, logits_fn) is z
    assert seen == [(z, batch.model_inputs)]
    w = fw.numpy(batch.loss_weights).copy()
    w[0, 1] = -1.0
    unchecked = batch.replace(loss_weights=fw.array(w))  # replace() does not validate
    with pytest.raises(ValueError, match=r"loss_weights must be nonnegative; got -1.0"):
        fw.api.compute_diffusion_logits(z, unchecked, logits_fn)
    assert len(seen) == 1, "the model must not run on an invalid batch"
    with pytest.raises(ValueError, match=r"logits must align with target_ids on \[batch, "
                                         r"length\] = \[2, 3\]; got shape \[2, 4, 11\]"):
        fw.api.compute_diffusion_logits(fw.array(np.zeros((2, 4, 11), np.float32)), batch,
                                        logits_fn)
    with pytest.raises(TypeError, match="batch must be a DiffusionTokenBatch"):
        fw.api.compute_diffusion_logits(z, "not a batch", logits_fn)


@pytest.mark.parametrize("fw_name", FWS)
def test_validate_diffusion_logits_returns_its_argument(fw_name, rng):
    fw = framework(fw_name)
    batch = fw.api.DiffusionTokenBatch.create(**tunix_inputs(fw, rng))
    z = fw.array(rng.normal(size=(2, 3, 11)), "bfloat16")
    assert fw.api.validate_diffusion_logits(batch, z) is z
    with pytest.raises(ValueError, match=r"logits must have a non-empty vocabulary dimension; got shape \[2, 3, 0\]"):
        fw.api.validate_diffusion_logits(batch, fw.array(np.zeros((2, 3, 0), np.float32)))
    y = fw.numpy(batch.target_ids).astype(np.int32)
    y[1, 2], w = 11, np.ones((2, 3), np.float32)
    wide = batch.replace(target_ids=fw.array(y), loss_weights=fw.array(w))
    with pytest.raises(ValueError, match=r"active target_ids must be smaller than vocabulary size 11; "
                                         r"got 11 at index \(1, 2\)$"):
        fw.api.validate_diffusion_logits(wide, z)


@pytest.mark.parametrize("fw_name", FWS)
def test_distillation_batch_checks_targets_against_the_teacher_vocabulary(fw_name, rng):
    fw = framework(fw_name)
    fields = tunix_inputs(fw, rng)
    y = rng.integers(0, 11, (2, 3)).astype(np.int32)
    w = np.ones((2, 3), np.float32)
    y[0, 2], w[1, 1], y[1, 1] = 11, 0.0, 99  # 99 sits at an inactive position: allowed
    fields.update(target_ids=fw.array(y), loss_weights=fw.array(w))
    student = fw.api.DiffusionTokenBatch.create(**fields)  # no K known yet: accepted
    teacher = fw.array(rng.normal(size=(2, 3, 11)), "float32")
    with pytest.raises(ValueError, match=r"active target_ids must be smaller than vocabulary size 11; "
                                         r"got 11 at index \(0, 2\)$"):
        fw.api.DiffusionDistillationBatch.create(student_batch=student, teacher_logits=teacher)
    y[0, 2] = 10
    ok = student.replace(target_ids=fw.array(y))
    fw.api.DiffusionDistillationBatch.create(student_batch=ok, teacher_logits=teacher)


# -- merging: every leaf, all or nothing --------------------------------------------------------

@pytest.mark.parametrize("fw_name", FWS)
def test_merge_concatenates_every_leaf_of_a_pytree(fw_name, rng):
    fw = framework(fw_name)
    parts = [tunix_inputs(fw, rng, b=b) for b in (2, 3)]
    for p in parts:
        p["model_inputs"] = {"text": (p["model_inputs"]["input_tokens"], p["model_inputs"]["positions"]),
                             "time": p["model_inputs"]["time"]}
    batches = [fw.api.DiffusionTokenBatch.create(**p) for p in parts]
    merged = fw.api.merge_diffusion_batches(batches)
    leaves = lambda b: (b.model_inputs["text"][0], b.model_inputs["text"][1], b.model_inputs["time"],
                        b.target_ids, b.loss_weights)
    for got, a, b in zip(leaves(merged), leaves(batches[0]), leaves(batches[1])):
        np.testing.assert_array_equal(fw.numpy(got), np.concatenate([fw.numpy(a), fw.numpy(b)]))
        assert got.dtype == a.dtype


MERGE_MISMATCHES = [
    # (how batches[1].model_inputs differs from {"tokens": [B, 3] int32, "time": [B] float32})
    (lambda fw, m: {"tokens": m["tokens"]},
     r"batches\[1\]\.model_inputs must have the same pytree structure as batches\[0\]\.model_inputs"),
    (lambda fw, m: {**m, "time": fw.array(np.zeros((3, 2), np.float32))},
     r"batches\[1\]\.model_inputs\['time'\] has shape \[3, 2\] and dtype float32; "
     r"batches\[0\]\.model_inputs\['time'\] has \[2\]"),
    (lambda fw, m: {**m, "tokens": fw.array(np.zeros((3, 3), np.int16))},
     r"batches\[1\]\.model_inputs\['tokens'\] has shape \[3, 3\] and dtype int16; "),
]


@pytest.mark.parametrize("fw_name", FWS)
@pytest.mark.parametrize("change,pattern", MERGE_MISMATCHES, ids=_case_ids(MERGE_MISMATCHES))
def test_merge_rejects_mismatched_trees_naming_field_and_leaf(fw_name, change, pattern):
    fw = framework(fw_name)

    def batch(b, inputs=None):
        m = {"tokens": fw.array(np.zeros((b, 3), np.int32)), "time": fw.array(np.zeros(b, np.float32))}
        return fw.api.DiffusionTokenBatch.create(
            model_inputs=m if inputs is None else inputs(fw, m),
            target_ids=fw.array(np.zeros((b, 3), np.int32)),
            loss_weights=fw.array(np.ones((b, 3), np.float32)))

    with pytest.raises(ValueError, match=pattern):
        fw.api.merge_diffusion_batches([batch(2), batch(3, change)])


@pytest.mark.parametrize("fw_name", FWS)
def test_merge_names_a_leaf_that_is_none_in_some_batches(fw_name):
    """torch's pytrees hold None as a leaf, so {"b": None} and {"b": tensor} flatten alike
    (merging them was a raw torch.cat error); JAX's differ in structure. Either way the
    error names the field and leaf; a leaf None in every batch stays None."""
    fw = framework(fw_name)

    def batch(b, extra):
        ids = fw.array(np.zeros((b, 3), np.int32))
        return fw.api.DiffusionTokenBatch.create(
            model_inputs={"a": ids, "b": None if extra is None else fw.array(extra)},
            target_ids=ids, loss_weights=fw.array(np.ones((b, 3), np.float32)))

    with_b, without_b = batch(2, np.ones((2, 3), np.int32)), batch(2, None)
    pattern = {"torch": r"^batches\[1\]\.model_inputs\['b'\] is {}, but batches\[0\]\."
                        r"model_inputs\['b'\] is {}: a leaf must be None in every batch or "
                        r"in none$",
               "jax": r"^batches\[1\]\.model_inputs must have the same pytree structure as "
                      r"batches\[0\]\.model_inputs; got .* and "}[fw_name]
    shape = r"an array of shape \[2, 3\]"
    with pytest.raises(ValueError, match=pattern.format(shape, "None")):
        fw.api.merge_diffusion_batches([without_b, with_b])
    with pytest.raises(ValueError, match=pattern.format("None", shape)):
        fw.api.merge_diffusion_batches([with_b, without_b])
    merged = fw.api.merge_diffusion_batches([without_b, batch(1, None)])
    assert merged.model_inputs["b"] is None and tuple(merged.target_ids.shape) == (3, 3)


def test_jax_merge_keeps_host_numpy_on_the_host_and_device_arrays_on_device():
    import jax
    import jax.numpy as jnp

    import dlm_kernels.jax as D

    def batch(b, make):
        return D.DiffusionTokenBatch.create(
            model_inputs={"tokens": make(np.zeros((b, 3), np.int32))},
            target_ids=make(np.zeros((b, 3), np.int32)), loss_weights=make(np.ones((b, 3), np.float32)))

    host = D.merge_diffusion_batches([batch(2, np.asarray), batch(1, np.asarray)])
    for leaf in jax.tree_util.tree_leaves(host):
        assert type(leaf) is np.ndarray and leaf.shape[0] == 3
    dev = D.merge_diffusion_batches([batch(2, jnp.asarray), batch(1, jnp.asarray)])
    for leaf in jax.tree_util.tree_leaves(dev):
        assert isinstance(leaf, jax.Array) and leaf.shape[0] == 3


# -- Megatron-Bridge arguments: bad values -------------------------------------------------------

def sft_args(fw, b=2, l=3, k=11, variant="loo-ce"):
    return dict(logits=fw.array(np.zeros((b, l, k), np.float32)),
                x0=fw.array(np.ones((b, l), np.int64)), xt=fw.array(np.full((b, l), k - 1)),
                t=fw.array(np.array([0.25, 0.75], np.float32)),
                loss_mask=fw.array(np.ones((b, l), np.float32)), variant=variant, vocab_size=k)


BAD_SFT_VALUES = [
    (dict(loss_mask=np.array([[1, -1, 1], [1, 1, 1]], np.float32)),
     r"loss_mask must be nonnegative; got -1.0 at index \(0, 1\)$"),
    (dict(loss_mask=np.array([[1, 1, 1], [1, np.nan, 1]], np.float32)),
     r"loss_mask must contain only finite values; got nan at index \(1, 1\)$"),
    (dict(t=np.array([0.5, 1.5], np.float32)), r"t must lie in \[0, 1\]; got 1.5 at index \(1,\)$"),
    (dict(t=np.array([-0.25, 0.5], np.float32)), r"t must lie in \[0, 1\]; got -0.25 at index \(0,\)$"),
    (dict(t=np.array([0.5, np.nan], np.float32)), r"t must lie in \[0, 1\]; got nan at index \(1,\)$"),
    (dict(vocab_size=12), r"vocab_size must be <= the logits' vocabulary K = 11 .*; got 12$"),
]


@pytest.mark.parametrize("fw_name", FWS)
@pytest.mark.parametrize("fn", ["diffusion_sft_loss", "diffusion_sft_logps"])
@pytest.mark.parametrize("change,pattern", BAD_SFT_VALUES, ids=_case_ids(BAD_SFT_VALUES))
def test_sft_rejects_bad_mask_time_and_vocab_size(fw_name, fn, change, pattern):
    fw = framework(fw_name)
    args = sft_args(fw)
    args.update({k: fw.array(v) if isinstance(v, np.ndarray) else v for k, v in change.items()})
    with pytest.raises(ValueError, match=pattern):
        getattr(fw.api, fn)(**args)


@pytest.mark.parametrize("fw_name", FWS)
def test_weighted_sums_stay_finite_at_the_largest_weights(fw_name, rng):
    """Weights whose sum is a normal float32 number are in the domain up to 3.4e38, and
    Σ w·CE then passes float32's range (8e37 x 4 x CE 4.5): a call whose largest weight
    reaches 2^64 sums w·2^-64, so both fields hold that (exactly the scaled sums) and the
    mean, the SFT loss and their gradients are the float64 oracle's; weights below 2^64
    keep the plain sums. diffusion_sft_logps, a sum, is -inf past float32's range."""
    fw = framework(fw_name)
    k = 11
    logits = rng.normal(size=(1, 4, k)) * 2
    y = rng.integers(0, k, (1, 4))
    ce = -oracle.token_stats(fw.numpy(fw.array(logits, "float32")).reshape(4, k),
                             y.reshape(4), np.ones(4, bool))[1]  # [4] float64
    for value, scale in ((8e37, 2.0 ** -64), (2.0 ** 64, 2.0 ** -64), (1.8e19, 1.0),
                         (1.0, 1.0)):
        w = np.full((1, 4), value, np.float32)
        batch = fw.api.DiffusionTokenBatch.create(model_inputs=fw.array(y),
                                                  target_ids=fw.array(y),
                                                  loss_weights=fw.array(w))
        z = fw.array(logits, "float32")
        ws = fw.api.weighted_cross_entropy(z, batch)
        w64 = w.astype(np.float64) * scale
        assert_close(fw.numpy(ws.unreduced_sum), (w64 * ce).sum(), "float32", f"Σ w·CE at {value}")
        assert_close(fw.numpy(ws.denominator), w64.sum(), "float32", f"Σ w at {value}")
        (mean,), (dz,) = fw.vjp(lambda z_: (fw.api.weighted_cross_entropy(z_, batch).compute(),),
                                [z], [np.float32(1.0)])
        assert_close(mean, ce.mean(), "float32", f"weighted mean at {value}")
        share = np.full(4, 0.25)
        dz_exp, _ = oracle.token_stats_vjp(fw.numpy(z).reshape(4, k), y.reshape(4),
                                           np.ones(4, bool), (0 * share, -share, 0 * share,
                                                              0 * share))
        assert_close(dz.reshape(4, k), dz_exp, "float32", f"d logits at {value}")
        args = dict(x0=fw.array(y), xt=fw.array(y), t=0.5, loss_mask=fw.array(w),
                    variant="base-sft", vocab_size=k)
        (loss,), (dz,) = fw.vjp(lambda z_: (fw.api.diffusion_sft_loss(z_, **args),), [z],
                                [np.ones(1, np.float32)])
        assert_close(loss, [ce.mean()], "float32", f"SFT loss at {value}")
        assert_close(dz.reshape(4, k), dz_exp, "float32", f"SFT d logits at {value}")
        logps = fw.numpy(fw.api.diffusion_sft_logps(z, **args))
        assert_close(logps, [-(w.astype(np.float64) * ce).sum()], "float32",
                     f"SFT logps at {value}") if value < 1e30 else (
            np.testing.assert_array_equal(logps, [-np.inf]))


def _traced(fw_name, fn):
    """fn under jax.jit, or under torch.compile (aot_eager: the same tracing, no C++ build)."""
    if fw_name == "jax":
        import jax

        return jax.jit(fn)
    import torch

    return torch.compile(fn, backend="aot_eager", fullgraph=True)


@pytest.mark.parametrize("fw_name", FWS)
def test_weights_the_checks_read_are_not_guarded_again(fw_name, rng, monkeypatch):
    """Where the value checks read the weights (host arrays), each objective leaves out the
    per-element NaN guard (it could only keep the value: a bad weight has raised); where
    they cannot read them (simulated: no host values, as under jit or torch.compile), the
    guard is there, once per call. Each objective built it on every call before, a part of a
    small call's host time. ``policy_loss`` too (its guard also covers the advantages and
    the old and reference log-probs, which no check reads)."""
    from dlm_kernels import _checks, _guards

    fw = framework(fw_name)
    api = fw.api
    calls = []
    guard = _guards.invalid_weights
    monkeypatch.setattr(_guards, "invalid_weights",
                        lambda xp, w: calls.append(tuple(w.shape)) or guard(xp, w))
    b, l, k = 3, 7, 11
    z = fw.array(rng.normal(size=(b, l, k)), "float32")
    y = fw.array(rng.integers(0, k, (b, l)))
    w = fw.array(rng.random((b, l)), "float32")
    batch = api.DiffusionTokenBatch.create(model_inputs=y, target_ids=y, loss_weights=w)
    dbatch = api.DiffusionDistillationBatch.create(student_batch=batch, teacher_logits=z)
    objectives = {
        "weighted_cross_entropy": lambda: api.weighted_cross_entropy(z, batch),
        "per_token_logps": lambda: api.per_token_logps(z, batch),
        "diffusion_sft_loss": lambda: api.diffusion_sft_loss(z, y, y, 0.5, w, variant="loo-ce",
                                                             vocab_size=k),
        "opd_loss": lambda: api.opd_loss(z, dbatch, hard_loss_weight=0.5),
        "policy_loss": lambda: api.policy_loss(z, batch, old_logps=None,
                                               advantages=fw.array(rng.normal(size=b), "float32"),
                                               loss_type="dapo"),
    }
    for name, call in objectives.items():
        calls.clear()
        call()
        assert calls == [], (name, "guarded weights the checks read", calls)
    monkeypatch.setattr(_checks, "host_values", lambda xp, x, allow_sync=False: None)
    for name, call in objectives.items():
        calls.clear()
        call()
        assert calls == [(b, l)], (name, "left unread weights unguarded", calls)


@pytest.mark.parametrize("fw_name", FWS)
def test_unreadable_bad_weights_give_nan_weighted_sums(fw_name, rng, torch_config):
    """Traced weights have no values to check (the eager call raises naming loss_weights):
    a NaN, an infinite or a negative weight, or weights whose sum overflows, make both sums
    of the WeightedSum NaN, and so its mean: NaN, never the 0 of an empty batch. A
    WeightedSum of a NaN or negative denominator computes to NaN; of 0, to 0. (torch: one
    compiled graph, the weighted CE's; the objectives share their code, JAX runs them all.)"""
    fw = framework(fw_name)
    if fw_name == "torch":
        torch_config("torch._dynamo.config", recompile_limit=64)
    z = fw.array(rng.normal(size=(2, 3, 11)), "float32")
    u = fw.array(rng.normal(size=(2, 3, 11)), "float32")
    y = fw.array(np.ones((2, 3), np.int32))

    def means(w, unreduced_sum, denominator):
        batch = fw.api.DiffusionTokenBatch(model_inputs=y, target_ids=y, loss_weights=w)
        out = [fw.api.WeightedSum(unreduced_sum, denominator).compute(),
               fw.api.weighted_cross_entropy(z, batch).compute()]
        if fw_name == "jax":
            total, aux = fw.api.opd_loss(z, fw.api.DiffusionDistillationBatch(
                student_batch=batch, teacher_logits=u), hard_loss_weight=0.5)
            out += [total.compute(), aux["distill/soft_loss"].compute(),
                    aux["distill/hard_loss"].compute()]
        return out

    traced = _traced(fw_name, means)  # one trace for every case
    three, four = fw.array(np.float32(3.0)), fw.array(np.float32(4.0))
    for den, expected in ((np.nan, np.nan), (-2.0, np.nan), (0.0, 0.0), (4.0, 0.75)):
        got = traced(fw.array(np.ones((2, 3), np.float32)), three, fw.array(np.float32(den)))
        np.testing.assert_array_equal(float(fw.numpy(got[0])), expected,
                                      err_msg=f"WeightedSum(3, {den}).compute()")
        assert np.isfinite([float(fw.numpy(v)) for v in got[1:]]).all(), got
    for bad in (np.nan, np.inf, -1.0, 3e38):
        w = np.ones((2, 3), np.float32)
        w[1, 2] = bad
        w[0, 0] = 3e38 if bad == 3e38 else 1.0
        got = [float(fw.numpy(v)) for v in traced(fw.array(w), three, four)[1:]]
        assert np.isnan(got).all(), (bad, got)


@pytest.mark.parametrize("fw_name", FWS)
def test_sft_accepts_bool_mask_and_the_edges_of_time(fw_name, rng):
    fw = framework(fw_name)
    args = sft_args(fw, variant="reweighted-loo-ce")
    logits = rng.normal(size=(2, 3, 11)) * 2
    mask = np.array([[True, False, True], [True, True, False]])
    args.update(logits=fw.array(logits, "float32"), loss_mask=fw.array(mask),
                t=fw.array(np.array([0.0, 1.0], np.float32)))
    got = fw.numpy(fw.api.diffusion_sft_loss(**args))
    exp = oracle.sft_loss(fw.numpy(args["logits"]), np.ones((2, 3), np.int64), np.full((2, 3), 10),
                          np.array([0.0, 1.0]), mask.astype(np.float64), "reweighted-loo-ce", 11)
    assert_close(got, exp, "float32", "loss with a bool mask at t in {0, 1}")


def test_value_checks_are_skipped_under_jit_and_the_loss_is_nan():
    """Traced arguments have no values to check: the call traces, and a bad id or mask shows
    as a NaN loss (documented), never as a plausible number."""
    import jax

    import dlm_kernels.jax as D

    args = sft_args(framework("jax"))
    x0 = np.ones((2, 3), np.int64)
    x0[1, 0] = 11
    loss = jax.jit(lambda z, x0: D.diffusion_sft_loss(z, x0, args["xt"], args["t"], args["loss_mask"],
                                                        variant="loo-ce", vocab_size=11))(args["logits"], x0)
    loss = np.asarray(loss)
    assert np.isfinite(loss[0]) and np.isnan(loss[1]), loss


@pytest.mark.parametrize("fw_name", FWS)
def test_traced_or_odd_scalars_are_named_plainly(fw_name):
    fw = framework(fw_name)
    batch = fw.api.DiffusionTokenBatch.create(**good(fw))
    z = fw.array(np.zeros((2, 3, 11), np.float32))
    with pytest.raises(ValueError, match=r"temperature must be a finite positive real scalar; got -2.0$"):
        fw.api.per_token_logps(z, batch, temperature=np.float64(-2.0))
    with pytest.raises(ValueError, match=r"vocab_size must be a positive int; got 0$"):
        fw.api.diffusion_sft_loss(**{**sft_args(fw), "vocab_size": np.int64(0)})
    if fw_name == "jax":
        import jax

        for fn in (lambda T: fw.api.per_token_logps(z, batch, temperature=T),
                   lambda T: fw.api.token_stats(z, batch.target_ids, temperature=T)):
            with pytest.raises(ValueError, match="temperature must be a static Python number; got a "
                                                 "traced value .*static_argnums"):
                jax.jit(fn)(0.5)
        dbatch = fw.api.DiffusionDistillationBatch.create(student_batch=batch, teacher_logits=z)
        with pytest.raises(ValueError, match="soft_loss_weight must be a static Python number"):
            jax.jit(lambda s: fw.api.opd_loss(z, dbatch, soft_loss_weight=s))(1.0)


# -- numbers, flags and arrays as users pass them ------------------------------------------------

def _sft_oracle(fw, args, t, variant=None, clip=None):
    """oracle.sft_loss of an sft_args call (float64 NumPy, independent of the package)."""
    return oracle.sft_loss(fw.numpy(args["logits"]), fw.numpy(args["x0"]), fw.numpy(args["xt"]),
                           np.asarray(t, np.float64), fw.numpy(args["loss_mask"]),
                           variant or args["variant"], args["vocab_size"], clip)


@pytest.mark.parametrize("fw_name", FWS)
def test_numpy_scalars_are_accepted_as_numbers(fw_name, rng):
    """np.int64(13), np.float32(0.5) and 0-d arrays are the numbers they hold, wherever a
    Python number is accepted (not "must be a positive int; got 13")."""
    fw = framework(fw_name)
    args = sft_args(fw, variant="reweighted-loo-ce")
    args["logits"] = fw.array(rng.normal(size=(2, 3, 11)), "float32")
    exp = _sft_oracle(fw, args, [0.25, 0.75], clip=2.0)
    for vocab_size in (np.int64(11), np.int32(11), np.array(11)):
        for clip in (np.float32(2.0), np.array(2.0), np.int64(2)):
            got = fw.api.diffusion_sft_loss(**{**args, "vocab_size": vocab_size,
                                               "diffusion_weight_clip": clip})
            assert_close(fw.numpy(got), exp, "float32", f"vocab_size {vocab_size!r}, clip {clip!r}")
    z = fw.array(rng.normal(size=(5, 301)), "float32")
    u = fw.array(rng.normal(size=(5, 301)), "float32")
    y = fw.array(rng.integers(0, 290, 5))
    kw = dict(temperature=0.7, ce_temperature=1.3, teacher_temperature=0.9, softcap=20.0,
              chunk_size=128, vocab_size=290)
    ref = fw.api.token_stats(z, y, teacher_logits=u, **kw)
    as_numpy = {k: (np.int64(v) if isinstance(v, int) else np.float32(v)) for k, v in kw.items()}
    for got, exp in zip(fw.api.token_stats(z, y, teacher_logits=u, **as_numpy), ref):
        np.testing.assert_array_equal(fw.numpy(got), fw.numpy(exp))
    batch = fw.api.DiffusionDistillationBatch.create(
        student_batch=fw.api.DiffusionTokenBatch.create(**good(fw)), teacher_logits=args["logits"])
    for weights in ((np.float32(0.5), np.float64(0.25)), (np.array(0.5), np.int64(0))):
        total, _ = fw.api.opd_loss(args["logits"], batch, temperature=np.float32(2.0),
                                   soft_loss_weight=weights[0], hard_loss_weight=weights[1])
        plain, _ = fw.api.opd_loss(args["logits"], batch, temperature=2.0,
                                   soft_loss_weight=float(weights[0]),
                                   hard_loss_weight=float(weights[1]))
        np.testing.assert_array_equal(fw.numpy(total.compute()), fw.numpy(plain.compute()))
    head = fw.api.LinearHead(fw.array(np.zeros((2, 3), np.float32)),
                             fw.array(np.zeros((3, 5) if fw_name == "jax" else (5, 3), np.float32)),
                             row_chunk=np.int64(16))
    assert head.row_chunk == 16 and type(head.row_chunk) is int


BOOLS_FOR_NUMBERS = [
    # (call given an api, fw and batch, the argument named)
    (lambda api, fw, b: api.token_stats(*_stats_args(fw), shift_ids=_stats_args(fw)[1], shift=True),
     "shift"),
    (lambda api, fw, b: api.token_stats(*_stats_args(fw), chunk_size=True), "chunk_size"),
    (lambda api, fw, b: api.token_stats(*_stats_args(fw), vocab_size=np.bool_(True)), "vocab_size"),
    (lambda api, fw, b: api.token_stats(*_stats_args(fw), softcap=np.array(True)), "softcap"),
    (lambda api, fw, b: api.per_token_logps(_stats_args(fw)[0].reshape(2, 3, 11), b,
                                            temperature=True), "temperature"),
    (lambda api, fw, b: api.diffusion_sft_loss(**{**sft_args(fw), "vocab_size": True}),
     "vocab_size"),
    (lambda api, fw, b: api.diffusion_sft_loss(**sft_args(fw), diffusion_weight_clip=True),
     "diffusion_weight_clip"),
    (lambda api, fw, b: api.diffusion_sft_loss(**{**sft_args(fw), "t": True}), "t"),
    (lambda api, fw, b: api.LinearHead(_stats_args(fw)[0], _stats_args(fw)[0], row_chunk=True),
     "row_chunk"),
]


def _stats_args(fw):
    return fw.array(np.zeros((6, 11), np.float32)), fw.array(np.zeros(6, np.int64))


@pytest.mark.parametrize("fw_name", FWS)
@pytest.mark.parametrize("call,name", BOOLS_FOR_NUMBERS, ids=_case_ids(BOOLS_FOR_NUMBERS))
def test_a_bool_is_not_a_number(fw_name, call, name):
    """True is an int in Python; where a number is meant it is an error that says so (a
    shift of True was silently 1.0)."""
    fw = framework(fw_name)
    batch = fw.api.DiffusionTokenBatch.create(**good(fw))
    with pytest.raises(ValueError, match=rf"^{name} must be .*, not a bool; got True$"):
        call(fw.api, fw, batch)


@pytest.mark.parametrize("fw_name", FWS)
@pytest.mark.parametrize("fn", ["diffusion_sft_loss", "diffusion_sft_logps"])
def test_sft_takes_one_diffusion_time_for_every_sequence(fw_name, fn, rng):
    """t may be one number (Python, NumPy, a 0-d array) for the whole batch: broadcast to
    [B]; out of [0, 1] it is an error naming the value."""
    fw = framework(fw_name)
    args = sft_args(fw, variant="reweighted-loo-ce")
    args["logits"] = fw.array(rng.normal(size=(2, 3, 11)), "float32")
    exp = _sft_oracle(fw, args, [0.25, 0.25])
    if fn == "diffusion_sft_logps":
        w, logp, _ = oracle.sft_parts(fw.numpy(args["logits"]), fw.numpy(args["x0"]),
                                      fw.numpy(args["xt"]), np.full(2, 0.25),
                                      fw.numpy(args["loss_mask"]), args["variant"], 11)
        exp = w * np.sum(fw.numpy(args["loss_mask"]) * logp, axis=1)
    for t in (0.25, np.float32(0.25), np.array(0.25), fw.array(np.float32(0.25))):
        got = getattr(fw.api, fn)(**{**args, "t": t})
        assert_close(fw.numpy(got), exp, "float32", f"{fn} with t = {t!r}")
    for bad in (1.5, np.float64(-0.5), float("nan")):
        with pytest.raises(ValueError, match=rf"^t must lie in \[0, 1\]; got {bad}$"):
            getattr(fw.api, fn)(**{**args, "t": bad})
    with pytest.raises(ValueError,
                       match=r"^t must be a float in \[0, 1\] or a \[B\] array; got '0.5'$"):
        getattr(fw.api, fn)(**{**args, "t": "0.5"})
    # loo_to_denoiser_logits takes one alpha for every sequence alike
    z, xt = args["logits"], args["xt"]
    np.testing.assert_array_equal(
        fw.numpy(fw.api.loo_to_denoiser_logits(z, xt, 0.75, 11)),
        fw.numpy(fw.api.loo_to_denoiser_logits(z, xt, fw.array(np.full(2, 0.75, np.float32)), 11)))


@pytest.mark.parametrize("fw_name", FWS)
def test_bool_diffusion_times_are_rejected_naming_t(fw_name):
    """A bool t failed later in torch ("Subtraction ... with a bool tensor") and was taken as
    0/1 in JAX; it is an error naming t and its dtype."""
    fw = framework(fw_name)
    args = sft_args(fw)
    with pytest.raises(TypeError, match=r"^t must have an integer or floating dtype; got bool$"):
        fw.api.diffusion_sft_loss(**{**args, "t": fw.array(np.array([True, False]))})


FLAGS = [
    # (call given an api, fw, batch and the bad value; the argument named)
    (lambda api, fw, b, v: api.token_stats(*_stats_args(fw), inplace_grad=v), "inplace_grad"),
    (lambda api, fw, b, v: api.token_stats(*_stats_args(fw), teacher_logits=_stats_args(fw)[0],
                                           teacher_grad=v), "teacher_grad"),
    (lambda api, fw, b, v: api.token_stats(*_stats_args(fw), entropy=v), "entropy"),
    (lambda api, fw, b, v: api.per_token_logps(_stats_args(fw)[0].reshape(2, 3, 11), b,
                                               stop_gradient=v), "stop_gradient"),
    (lambda api, fw, b, v: api.per_token_logps(_stats_args(fw)[0].reshape(2, 3, 11), b,
                                               return_entropy=v), "return_entropy"),
    (lambda api, fw, b, v: api.compute_diffusion_per_token_logps(
        fw, b, _model, return_entropy=v), "return_entropy"),
    (lambda api, fw, b, v: api.policy_loss(
        _stats_args(fw)[0].reshape(2, 3, 11), b, old_logps=None,
        advantages=fw.array(np.zeros(2, np.float32)), loss_type="grpo", inplace_grad=v),
     "inplace_grad"),
]

_MODEL_RUNS = []


def _model(fw, inputs):  # zero logits [B, L, 11]
    _MODEL_RUNS.append(inputs)
    return fw.array(np.zeros(tuple(inputs.shape) + (11,), np.float32))


@pytest.mark.parametrize("fw_name", FWS)
@pytest.mark.parametrize("call,name", FLAGS, ids=_case_ids(FLAGS))
def test_flags_must_be_bools(fw_name, call, name):
    """An on/off argument given "no" or 1 was taken as True (inplace_grad="no" overwrote the
    logits with their gradient); it is a TypeError naming the argument and the value."""
    fw = framework(fw_name)
    batch = fw.api.DiffusionTokenBatch.create(**good(fw))
    _MODEL_RUNS.clear()
    for bad, shown in (("no", "'no'"), (1, "1"), (None, "None")):
        with pytest.raises(TypeError, match=rf"^{name} must be True or False; got {shown}$"):
            call(fw.api, fw, batch, bad)
    assert not _MODEL_RUNS, "the arguments are checked before the model runs"
    if name != "inplace_grad" or fw_name == "torch":
        call(fw.api, fw, batch, np.bool_(True))  # a NumPy bool is a bool


@pytest.mark.parametrize("fw_name", FWS)
def test_arrays_and_batches_of_the_other_framework_say_how_to_convert(fw_name):
    """A JAX array in dlm_kernels.torch, a torch tensor (or in torch a NumPy array) in the
    other, and a batch built by the other front end: the error names the argument, what was
    given and the conversion, never "got Tensor" or "got DiffusionTokenBatch" alone."""
    import jax.numpy as jnp
    import torch

    fw = framework(fw_name)
    other = framework("jax" if fw_name == "torch" else "torch")
    if fw_name == "torch":
        expected = [(jnp.zeros((6, 11)),
                     r"got a JAX Array: convert it with torch\.from_dlpack\(logits\)$"),
                    (np.zeros((6, 11), np.float32),
                     r"got a NumPy ndarray: convert it with torch\.as_tensor\(logits\)$")]
        prefix = r"^logits must be a torch tensor \(dlm_kernels\.torch takes torch tensors\); "
    else:
        expected = [(torch.zeros((6, 11)), r"got a torch Tensor: convert it with "
                     r"jnp\.from_dlpack\(logits\.detach\(\)\), or "
                     r"jnp\.asarray\(logits\.detach\(\)\.cpu\(\)\.numpy\(\)\)$")]
        prefix = (r"^logits must be a JAX/NumPy array or ShapeDtypeStruct \(dlm_kernels\.jax "
                  r"takes JAX arrays\); ")
    y = fw.array(np.zeros(6, np.int64))
    for logits, pattern in expected:
        with pytest.raises(TypeError, match=prefix + pattern):
            fw.api.token_stats(logits, y)
        with pytest.raises(TypeError, match=prefix + pattern):
            fw.api.backend_for(logits)
    with pytest.raises(TypeError, match=r"^target_ids must be a .*; got a "):
        fw.api.DiffusionTokenBatch.create(
            **{**good(fw), "target_ids": other.array(np.ones((2, 3), np.int32))})
    if fw_name == "torch":  # the conversion the message gives works
        got = fw.api.token_stats(torch.from_dlpack(jnp.zeros((6, 11))), y)
        np.testing.assert_array_equal(fw.numpy(got.lse), np.log(11.0).astype(np.float32))

    foreign = other.api.DiffusionTokenBatch.create(**good(other))
    own = fw.api.DiffusionTokenBatch.create(**good(fw))
    z = fw.array(np.zeros((2, 3, 11), np.float32))
    mine, theirs = fw.api.__name__, other.api.__name__
    said = (rf"must be a DiffusionTokenBatch of {mine}; got {theirs}\.DiffusionTokenBatch: "
            rf"build the batch with {mine}\.DiffusionTokenBatch\.create\(\.\.\.\)$")
    for call, name in ((lambda: fw.api.per_token_logps(z, foreign), "batch"),
                       (lambda: fw.api.weighted_cross_entropy(z, foreign), "batch"),
                       (lambda: fw.api.validate_diffusion_logits(foreign, z), "batch"),
                       (lambda: fw.api.DiffusionDistillationBatch.create(
                           student_batch=foreign, teacher_logits=z), "student_batch"),
                       (lambda: fw.api.merge_diffusion_batches([foreign, own]), r"batches\[0\]"),
                       (lambda: fw.api.merge_diffusion_batches([own, foreign]), r"batches\[1\]")):
        with pytest.raises(TypeError, match=rf"^{name} {said}"):
            call()
    with pytest.raises(TypeError, match=r"^batch must be a DiffusionDistillationBatch of .*; got "
                                        rf"{theirs}\.DiffusionDistillationBatch"):
        fw.api.opd_loss(z, other.api.DiffusionDistillationBatch.create(
            student_batch=foreign, teacher_logits=other.array(np.zeros((2, 3, 11), np.float32))))


@pytest.mark.parametrize("fw_name", FWS)
def test_schedule_functions_of_the_wrong_shape_are_named(fw_name, rng):
    """alpha_fn / alpha_dot_fn returning [B, L] where the variant needs one value per
    sequence was a raw broadcasting error; numbers from both give one weight for all."""
    fw = framework(fw_name)
    args = sft_args(fw, variant="reweighted-ce")
    per_token = lambda t: t[:, None] + fw.array(np.zeros((2, 3), np.float32))
    with pytest.raises(ValueError, match=r"^alpha_fn\(t\) must have shape \[B\] = \[2\] .*"
                                         r"'reweighted-ce'.*; got \[2, 3\]$"):
        fw.api.diffusion_sft_loss(**args, alpha_fn=lambda t: 1.0 - per_token(t))
    with pytest.raises(ValueError, match=r"^alpha_dot_fn\(t\) must have shape \[B\] = \[2\] "
                                         r".*; got \[2, 3\]$"):
        fw.api.diffusion_sft_loss(**args, alpha_dot_fn=lambda t: 0.0 * per_token(t) - 1.0)
    with pytest.raises(ValueError, match=r"^alpha_fn\(t\) must have shape \[B\], \[B, 1\] or "
                                         r"\[B, L\] with \[B, L\] = \[2, 3\]; got \[2, 2\]$"):
        fw.api.diffusion_sft_loss(**{**args, "variant": "loo-ce"},
                                  alpha_fn=lambda t: fw.array(np.full((2, 2), 0.5, np.float32)))
    args["logits"] = fw.array(rng.normal(size=(2, 3, 11)), "float32")
    got = fw.api.diffusion_sft_loss(**args, alpha_fn=lambda t: 0.5, alpha_dot_fn=lambda t: -1.0)
    assert_close(fw.numpy(got), _sft_oracle(fw, args, [0.5, 0.5]), "float32",
                 "constant schedule functions")


@pytest.mark.parametrize("fw_name", FWS)
@pytest.mark.parametrize("alpha_shape", [(2,), (2, 1), (2, 3)], ids=str)
def test_loo_to_denoiser_logits_takes_alpha_per_sequence_or_per_position(fw_name, alpha_shape, rng):
    fw = framework(fw_name)
    b, l, k = 2, 3, 13
    logits = rng.normal(size=(b, l, k)).astype(np.float32)
    xt = rng.integers(0, k, (b, l))
    alpha = rng.uniform(0.05, 0.95, alpha_shape).astype(np.float32)
    got = fw.numpy(fw.api.loo_to_denoiser_logits(fw.array(logits), fw.array(xt), fw.array(alpha), k))
    a = np.broadcast_to(alpha.astype(np.float64).reshape(b, -1), (b, l))
    delta = np.log1p(k * a / np.maximum(1.0 - a, 1e-12))
    exp = logits + np.where(np.arange(k) == xt[..., None], delta[..., None], 0.0)
    assert_close(got, exp, "float32", f"loo_to_denoiser_logits with alpha {alpha_shape}")


@pytest.mark.parametrize("fw_name", FWS)
def test_loo_to_denoiser_logits_rejects_bad_alpha_xt_and_vocab_size(fw_name, rng):
    fw = framework(fw_name)
    z = fw.array(rng.normal(size=(2, 3, 13)).astype(np.float32))
    xt = fw.array(rng.integers(0, 13, (2, 3)))
    alpha = fw.array(np.full((2, 3), 0.5, np.float32))
    call = fw.api.loo_to_denoiser_logits
    for shape in ((3,), (2, 2), (1, 3), (2, 3, 1)):
        with pytest.raises(ValueError, match=r"alpha must have shape \[B\], \[B, 1\] or \[B, L\] with "
                                             r"\[B, L\] = \[2, 3\]; got " + re.escape(shape_str(shape))):
            call(z, xt, fw.array(np.full(shape, 0.5, np.float32)), 13)
    bad = np.zeros((2, 3), np.int64)
    bad[1, 1] = 13
    with pytest.raises(ValueError, match=r"xt must be in \[0, 13\); got 13 at index \(1, 1\)$"):
        call(z, fw.array(bad), alpha, 13)
    with pytest.raises(ValueError, match=r"xt must be in \[0, 12\); got 12"):
        call(z, fw.array(np.full((2, 3), 12)), alpha, 12)
    with pytest.raises(ValueError, match=r"vocab_size must be <= the logits' vocabulary K = 13"):
        call(z, xt, alpha, 14)


def test_loo_to_denoiser_logits_marks_unreadable_bad_xt_as_nan():
    import jax

    import dlm_kernels.jax as D

    xt = np.zeros((2, 3), np.int32)
    xt[0, 2] = -1
    out = np.asarray(jax.jit(lambda x: D.loo_to_denoiser_logits(
        np.zeros((2, 3, 5), np.float32), x, np.full(2, 0.5, np.float32), 5))(xt))
    assert np.isnan(out[0, 2]).all() and np.isfinite(np.delete(out.reshape(6, 5), 2, axis=0)).all()


def test_jax_checks_are_trace_safe_under_vmap_and_jit(rng):
    """Under vmap and jit the value checks see tracers and stay out of the way; the results
    equal the per-slice eager calls."""
    import jax
    import jax.numpy as jnp

    import dlm_kernels.jax as D

    z = jnp.asarray(rng.normal(size=(3, 2, 4, 19)), jnp.float32)  # 3 micro-batches of [2, 4, 19]
    x0, xt = jnp.asarray(rng.integers(0, 19, (3, 2, 4))), jnp.asarray(rng.integers(0, 19, (3, 2, 4)))
    t = jnp.asarray(rng.uniform(size=(3, 2)), jnp.float32)
    mask = jnp.asarray(rng.uniform(size=(3, 2, 4)) < 0.7, jnp.float32)
    loss = lambda *a: D.diffusion_sft_loss(*a, variant="reweighted-loo-ce", vocab_size=19)
    got = jax.jit(jax.vmap(loss))(z, x0, xt, t, mask)
    for i in range(3):
        assert_close(np.asarray(got[i]), np.asarray(loss(z[i], x0[i], xt[i], t[i], mask[i])),
                     "float32", f"vmapped SFT loss, slice {i}")


@pytest.mark.parametrize("fw_name", FWS)
@pytest.mark.parametrize("fn_name", ["diffusion_sft_loss", "diffusion_sft_logps"])
def test_sft_ids_out_of_range_raise_naming_value_and_position(fw_name, fn_name, rng):
    """Scored ids outside [0, vocab_size) are errors where their values can be read (CPU
    tensors, host arrays); ids that no scored position uses are not checked."""
    fw = framework(fw_name)

    def call(fn_name, arrays, variant, vocab_size=37):
        logits, x0, xt, t, mask = arrays
        return getattr(fw.api, fn_name)(fw.array(logits, "float32"), fw.array(x0), fw.array(xt),
                                        fw.array(t), fw.array(mask), variant=variant,
                                        vocab_size=vocab_size)

    logits, x0, xt, t, mask = sft_inputs(rng, empty_row=False)
    mask[1, 2], mask[2, 3] = 1.0, 0.0
    for bad in (37, -1):
        x0_bad = x0.copy()
        x0_bad[1, 2] = bad
        with pytest.raises(ValueError, match=rf"x0 where loss_mask is set must be in \[0, 37\); "
                                             rf"got {bad} at index \(1, 2\)$"):
            call(fn_name, (logits, x0_bad, xt, t, mask), "base-sft")
        xt_bad = xt.copy()
        xt_bad[0, 4] = bad
        with pytest.raises(ValueError, match=rf"xt must be in \[0, 37\); got {bad} at index \(0, 4\)$"):
            call(fn_name, (logits, x0, xt_bad, t, mask), "reweighted-loo-ce")
        # where the id is not used, it is not checked: unmasked x0, xt outside a LOO variant
        x0_free = x0.copy()
        x0_free[2, 3] = bad
        np.testing.assert_array_equal(
            fw.numpy(call(fn_name, (logits, x0_free, xt, t, mask), "loo-ce")),
            fw.numpy(call(fn_name, (logits, x0, xt, t, mask), "loo-ce")))
        got = fw.numpy(call(fn_name, (logits, x0, xt_bad, t, mask), "base-sft"))
        assert np.isfinite(got).all(), got
    # with vocab_size < K, ids in [vocab_size, K) are out of range too
    x0_pad = x0 % 35
    x0_pad[1, 2] = 35
    with pytest.raises(ValueError, match=r"x0 where loss_mask is set must be in \[0, 35\); got 35"):
        call(fn_name, (logits, x0_pad, xt, t, mask), "base-sft", vocab_size=35)

