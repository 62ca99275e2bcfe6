"""Upstream's error wording and classes: each phrase that Tunix's diffusion
batch, logits validation, distillation loss, policy scorer and rollout merge and
Megatron-Bridge's DiffusionGemma losses put in their messages is contained in ours, raised
with upstream's class, while ours keeps its details (the argument, the value, the index).
One case per phrase, in both front ends; tiny arrays, the reference backend."""

from __future__ import annotations

import re

import numpy as np
import pytest

from harness import framework

FWS = ("torch", "jax")
B, L, K = 2, 3, 11


def batch_fields(fw, **change):
    fields = dict(model_inputs={"tokens": fw.array(np.zeros((B, L), np.int32))},
                  target_ids=fw.array(np.ones((B, L), np.int32)),
                  loss_weights=fw.array(np.ones((B, L), np.float32)))
    fields.update({name: fw.array(v) if isinstance(v, np.ndarray) else v
                   for name, v in change.items()})
    return fields


def create(fw, **change):
    return fw.api.DiffusionTokenBatch.create(**batch_fields(fw, **change))


def logits(fw, shape=(B, L, K), dtype=np.float32):
    return fw.array(np.zeros(shape, dtype))


def distill(fw, teacher):
    return fw.api.DiffusionDistillationBatch.create(student_batch=create(fw),
                                                    teacher_logits=fw.array(teacher))


def opd(fw, teacher=None, student_shape=(B, L, K), **kw):
    teacher = np.zeros((B, L, K), np.float32) if teacher is None else teacher
    return fw.api.opd_loss(logits(fw, student_shape), distill(fw, teacher), backend="reference", **kw)


def with_value(at, value, dtype=np.float32, fill=1):
    x = np.full((B, L), fill, dtype)
    x[at] = value
    return x


def nan_teacher():
    u = np.zeros((B, L, K), np.float32)
    u[0, 0, 4] = np.nan
    return u


def sft(fw, **change):
    args = dict(logits=logits(fw), x0=fw.array(np.ones((B, L), np.int32)),
                xt=fw.array(np.ones((B, L), np.int32)), t=fw.array(np.full(B, 0.5, np.float32)),
                loss_mask=fw.array(np.ones((B, L), np.float32)), variant="loo-ce", vocab_size=K,
                backend="reference")
    args.update({name: fw.array(v) if isinstance(v, np.ndarray) else v
                 for name, v in change.items()})
    return fw.api.diffusion_sft_loss(**args)


def merge_two(fw, second):
    return fw.api.merge_diffusion_batches([create(fw), second(fw)])


KINDS = {"torch": "a torch tensor", "jax": "a JAX/NumPy array or ShapeDtypeStruct"}

# (upstream, phrase upstream's message contains (escaped; "…" is any text), the classes the
# error must be, a detail of ours it must keep, the call that raises it)
CASES = [
    # Tunix DiffusionTokenBatch.validate
    ("batch", "target_ids must have shape [batch, length]", (ValueError,), "got [2, 3, 1]",
     lambda fw: create(fw, target_ids=np.zeros((B, L, 1), np.int32))),
    ("batch", "target_ids must have an integer dtype", (TypeError,), "got float32",
     lambda fw: create(fw, target_ids=np.zeros((B, L), np.float32))),
    ("batch", "loss_weights must match target_ids shape", (ValueError,), "[2, 3]; got [3, 3]",
     lambda fw: create(fw, loss_weights=np.ones((3, L), np.float32))),
    ("batch", "loss_weights must have a real numeric or boolean dtype", (TypeError,),
     "got complex64", lambda fw: create(fw, loss_weights=np.ones((B, L), np.complex64))),
    ("batch", "loss_weights must contain only finite values", (ValueError,),
     "got nan at index (0, 1)", lambda fw: create(fw, loss_weights=with_value((0, 1), np.nan))),
    ("batch", "loss_weights must be nonnegative", (ValueError,), "got -1.0 at index (1, 2)",
     lambda fw: create(fw, loss_weights=with_value((1, 2), -1.0))),
    ("batch", "active target_ids must be nonnegative", (ValueError,), "got -1 at index (0, 2)",
     lambda fw: create(fw, target_ids=with_value((0, 2), -1, np.int32))),
    ("batch", "model_inputs must contain at least one array", (ValueError,), "got dict",
     lambda fw: create(fw, model_inputs={})),
    ("batch", "must be batch-major, not scalar", (ValueError,), "model_inputs['time']",
     lambda fw: create(fw, model_inputs={"time": fw.array(np.float32(0.5))})),
    ("batch", "has batch size … expected", (ValueError,), "model_inputs['x'] has batch size 3",
     lambda fw: create(fw, model_inputs={"x": fw.array(np.zeros((3, L), np.int32))})),
    ("batch", "must be {kind}", (TypeError,), "target_ids must be",  # a kind per front end
     lambda fw: create(fw, target_ids=[[1] * L] * B)),
    # Tunix validate_diffusion_logits (and the distillation batch's teacher: the same words)
    ("logits", "logits must have shape [batch, length, vocab]", (ValueError,), "got [2, 3]",
     lambda fw: fw.api.validate_diffusion_logits(create(fw), logits(fw, (B, L)))),
    ("logits", "logits must align with target_ids on [batch, length]", (ValueError,),
     "got shape [2, 4, 11]",
     lambda fw: fw.api.validate_diffusion_logits(create(fw), logits(fw, (B, 4, K)))),
    ("logits", "logits must have a non-empty vocabulary dimension", (ValueError,),
     "got shape [2, 3, 0]",
     lambda fw: fw.api.validate_diffusion_logits(create(fw), logits(fw, (B, L, 0)))),
    ("logits", "logits must have a floating-point dtype", (TypeError,), "got int32",
     lambda fw: fw.api.validate_diffusion_logits(create(fw), logits(fw, dtype=np.int32))),
    ("logits", "active target_ids must be smaller than vocabulary size 1", (ValueError,),
     "got 1 at index (0, 0)",
     lambda fw: fw.api.validate_diffusion_logits(create(fw), logits(fw, (B, L, 1)))),
    ("teacher", "teacher_logits must have shape [batch, length, vocab]", (ValueError,),
     "got [2, 3]", lambda fw: distill(fw, np.zeros((B, L), np.float32))),
    ("teacher", "teacher_logits must align with target_ids on [batch, length]", (ValueError,),
     "got shape [2, 4, 11]", lambda fw: distill(fw, np.zeros((B, 4, K), np.float32))),
    ("teacher", "teacher_logits must have a non-empty vocabulary dimension", (ValueError,),
     "got shape [2, 3, 0]", lambda fw: distill(fw, np.zeros((B, L, 0), np.float32))),
    # Tunix diffusion OPD
    ("opd", "temperature must be positive", (ValueError,), "got 0.0",
     lambda fw: opd(fw, temperature=0.0)),
    ("opd", "soft_loss_weight and hard_loss_weight must be nonnegative", (ValueError,),
     "soft_loss_weight = -0.5", lambda fw: opd(fw, soft_loss_weight=-0.5)),
    ("opd", "at least one loss weight must be positive", (ValueError,),
     "soft_loss_weight = 0.0 and hard_loss_weight = 0.0",
     lambda fw: opd(fw, soft_loss_weight=0.0, hard_loss_weight=0.0)),
    ("opd", "active teacher_logits must contain only finite values", (ValueError,),
     "got nan at index (0, 0, 4)", lambda fw: opd(fw, nan_teacher())),
    ("opd", "student and teacher logits must have identical shapes", (ValueError,),
     "student_logits [2, 3, 12] and teacher_logits [2, 3, 11]",
     lambda fw: opd(fw, student_shape=(B, L, 12))),
    # Tunix policy scorer
    ("scorer", "temperature must be a finite positive real scalar", (ValueError,), "got -2.0",
     lambda fw: fw.api.compute_diffusion_per_token_logps(
         logits(fw), create(fw), lambda model, inputs: model, temperature=-2.0)),
    # Tunix rollout merge
    ("merge", "model_inputs must have the same pytree structure", (ValueError,), "batches[1]",
     lambda fw: merge_two(fw, lambda fw: create(fw, model_inputs={
         "other": fw.array(np.zeros((B, L), np.int32))}))),
    ("merge", "must either all provide diffusion_batch or all omit it", (ValueError,),
     "None at batches[1]", lambda fw: merge_two(fw, lambda fw: None)),
    # Megatron-Bridge DiffusionGemma
    ("megatron", "Unknown variant", (ValueError,), "'nope'",
     lambda fw: sft(fw, variant="nope")),
    # upstream's one_hot / gather raise RuntimeError for an id outside the vocabulary
    ("megatron", "xt must be in [0, 11)", (ValueError, RuntimeError), "got 11 at index (1, 0)",
     lambda fw: fw.api.loo_to_denoiser_logits(
         logits(fw), fw.array(with_value((1, 0), K, np.int32)), 0.5, K)),
    ("megatron", "xt must be in [0, 11)", (ValueError, RuntimeError), "got -1 at index (0, 1)",
     lambda fw: sft(fw, xt=with_value((0, 1), -1, np.int32))),
    ("megatron", "x0 where loss_mask is set must be in [0, 11)", (ValueError, RuntimeError),
     "got 11 at index (1, 1)", lambda fw: sft(fw, x0=with_value((1, 1), K, np.int32))),
]


def _ids(cases):
    return [f"{i}-{case[0]}-" + re.sub(r"[^A-Za-z0-9]+", "_", case[1])[:40].strip("_")
            for i, case in enumerate(cases)]


@pytest.mark.parametrize("fw_name", FWS)
@pytest.mark.parametrize("upstream,phrase,classes,detail,call", CASES, ids=_ids(CASES))
def test_upstream_phrase_and_class(fw_name, upstream, phrase, classes, detail, call):
    fw = framework(fw_name)
    with pytest.raises(classes[0]) as err:
        call(fw)
    message = str(err.value)
    pattern = ".*".join(re.escape(part) for part in phrase.format(kind=KINDS[fw_name]).split("…"))
    assert re.search(pattern, message), f"{upstream}: {phrase!r} not in {message!r}"
    assert detail in message, f"our detail {detail!r} lost: {message!r}"
    for cls in classes:
        assert isinstance(err.value, cls), f"{type(err.value).__mro__} is not a {cls.__name__}"
    assert "np." not in message, f"numbers in messages are plain: {message}"
