"""The one lowering (``token_stats.lowering.lower``): a call's keywords become one ``Lowered`` object,
the only place a kernel flag, a scaled constant or a stand-in is derived, and every backend's
launch receives that object."""

from __future__ import annotations

import os
import re

import numpy as np
import pytest

from dlm_kernels._config import CeTerm, make_config
from dlm_kernels.token_stats.lowering import Lowered, lower
from dlm_kernels.kernels.layout import NO_VOCAB_LIMIT
from harness import assert_close, framework

FLAGS = ("HAS_TEACHER", "HAS_SHIFT", "HAS_SOFTCAP", "SEPARATE_CE", "HAS_ENTROPY", "SMOOTH",
         "Z_LOSS", "CE_TERMS", "TEACHER_GRAD", "PADDED", "ROUND_TILES")

# (config keywords, has_shift, heads) -> the lowered fields expected (flags not named are False)
CASES = {
    "plain": (dict(), False, False, dict(
        inv_t=1.0, inv_t_ce=1.0, inv_t_kl=1.0, softcap=0.0, vocab_limit=NO_VOCAB_LIMIT,
        chunk_size=None, smooth_mean=0.0, smooth_weight=0.0, HAS_ENTROPY=True)),
    "every feature": (dict(temperature=0.5, ce_temperature=2.0, teacher_temperature=4.0,
                           softcap=30.0, has_teacher=True, teacher_grad=True, entropy=False,
                           chunk_size=130, vocab_size=37,
                           ce=CeTerm(label_smoothing=0.1, z_loss_weight=0.01),
                           smoothing_vocab=40), True, False, dict(
        inv_t=2.0, inv_t_ce=0.5, inv_t_kl=0.25, softcap=30.0, vocab_limit=37, chunk_size=130,
        label_smoothing=0.1, z_loss_weight=0.01, smooth_mean=1.0 / 40, smooth_weight=0.1 / 40,
        HAS_TEACHER=True, HAS_SHIFT=True, HAS_SOFTCAP=True, SEPARATE_CE=True, SMOOTH=True,
        Z_LOSS=True, CE_TERMS=True, TEACHER_GRAD=True, PADDED=True)),
    "z-loss, T_ce given equal to T": (dict(temperature=3.0, ce_temperature=3.0,
                                           ce=CeTerm(z_loss_weight=1e-4)), False, False, dict(
        inv_t=1.0 / 3.0, inv_t_ce=1.0 / 3.0, inv_t_kl=1.0 / 3.0, z_loss_weight=1e-4,
        HAS_ENTROPY=True, Z_LOSS=True, CE_TERMS=True)),
}


@pytest.mark.parametrize("name", CASES)
def test_lower_gives_the_kernels_flags_and_constants(name):
    keywords, has_shift, heads, expected = CASES[name]
    low = lower(make_config(**keywords), has_shift=has_shift, heads=heads)
    want = dict({flag: False for flag in FLAGS}, label_smoothing=0.0, z_loss_weight=0.0)
    want.update(expected)
    got = {field: getattr(low, field) for field in want}
    assert got == want
    assert Lowered(*tuple(low)) == low  # what a torch custom op rebuilds from its arguments
    assert len(Lowered.schema().split(", ")) == len(low)
    assert low.triton_flags() == {flag: getattr(low, flag) for flag in (
        "HAS_SOFTCAP", "HAS_SHIFT", "HAS_TEACHER", "SEPARATE_CE", "HAS_ENTROPY")}


def _scan(root, pattern, exempt):
    """'path:line: text' of every line under root matching pattern (files named in exempt
    left out; the kernels/ and bench/ links of the package are not followed)."""
    hits = []
    for folder, _, files in os.walk(root):
        for name in files:
            path = os.path.join(folder, name)
            if not name.endswith(".py") or name in exempt:
                continue
            with open(path) as f:
                hits += [f"{os.path.relpath(path, root)}:{i}: {line.strip()}"
                         for i, line in enumerate(f, 1) if pattern.search(line)]
    return hits


# The stand-ins spelled out: a second choice of one, or a flag derived by comparing with it
# (PADDED is ``vocab_limit < NO_VOCAB_LIMIT``)
STAND_INS = r"NO_VOCAB_LIMIT|2 \*\* 31 - 1|softcap or 0"


def test_no_derivation_outside_the_lowering():
    """1/T, the stand-ins (softcap 0, vocabulary limit 2^31 - 1) and SEPARATE_CE are formed
    in ``token_stats.lowering`` only: no other host module spells them, and no kernel names a
    stand-in (each takes its flags, PADDED included, as statics or constexprs)."""
    here = os.path.dirname(__file__)
    host = re.compile(r"separate_ce|1\.0 / cfg\.|" + STAND_INS)
    hits = _scan(os.path.join(here, "..", "python", "dlm_kernels"), host, {"lowering.py"})
    hits += _scan(os.path.join(here, "..", "kernels"), re.compile(STAND_INS), {"layout.py"})
    assert not hits, "\n".join(hits)


def test_no_sampler_derivation_outside_its_lowering():
    """The sampler's kernel flags (GREEDY: T = 0, TWO_T), its stand-ins (T = 1 at T = 0,
    top_k 0) and guidance's s + 1 are formed in ``SampleConfig.lowered`` only: no kernel
    and no backend module spells them (aside: ``sampling/core.py``, the lowering's home and
    the reference math that reads the config; ``sampling/upstream.py``, upstream's own step
    functions; ``token_stats/lowering.py``, whose SEPARATE_CE compares temperatures)."""
    here = os.path.dirname(__file__)
    flags = re.compile(r"temperature\s*(==|!=|>|<)|cfg_scale \+ 1|top_k or 0|temperature or 1")
    hits = _scan(os.path.join(here, "..", "kernels"), flags, set())
    package = os.path.join(here, "..", "python", "dlm_kernels")
    exempt = {"sampling": {"core.py", "upstream.py"}, "token_stats": {"lowering.py"}}
    for folder in ("sampling", "token_stats", "linear_head", "_torch", "_jax", "jax", "torch"):
        hits += _scan(os.path.join(package, folder), flags, exempt.get(folder, set()))
    assert not hits, "\n".join(hits)


def _spy(monkeypatch, owner, name, seen, pick):
    """Wrap owner.name so that each call appends pick(args, kwargs) to seen."""
    original = getattr(owner, name)

    def spy(*args, **kwargs):
        seen.append(pick(args, kwargs))
        return original(*args, **kwargs)

    monkeypatch.setattr(owner, name, spy)


def _lowered_once(monkeypatch):
    """The objects ``lower`` returns to the front end, as a list that fills per call."""
    import dlm_kernels.token_stats.op as op

    made = []

    def record(*args, **kwargs):
        made.append(lower(*args, **kwargs))
        return made[-1]

    monkeypatch.setattr(op, "lower", record)
    return made


def _stats_math_spies(monkeypatch, seen):
    import dlm_kernels.token_stats.formulas as stats_math

    for name, at in (("reference_stats", 2), ("chunk_partial", 4), ("chunk_grads", 5),
                     ("finalize", 5)):
        _spy(monkeypatch, stats_math, name, seen, lambda a, kw, at=at: a[at])


KEYWORDS = dict(temperature=0.7, ce_temperature=1.3, softcap=3.0, label_smoothing=0.1,
                z_loss_weight=0.01, teacher_grad=True)


@pytest.mark.parametrize("backend", ["reference", "chunked", "triton"])
def test_torch_backends_receive_the_lowered_call(backend, monkeypatch, rng):
    import torch

    from dlm_kernels.token_stats import torch_triton as _triton

    fw = framework("torch")
    made, seen = _lowered_once(monkeypatch), []
    _stats_math_spies(monkeypatch, seen)
    _spy(monkeypatch, _triton, "launch_partial", seen, lambda a, kw: a[5])
    _spy(monkeypatch, _triton, "launch_grad", seen, lambda a, kw: a[10])
    n, k = 3, 37
    z = fw.array(rng.normal(size=(n, k)), "float32").requires_grad_(True)
    u = fw.array(rng.normal(size=(n, k)), "float32").requires_grad_(True)
    y = fw.array(rng.integers(0, k, n))
    s = fw.api.token_stats(z, y, teacher_logits=u, shift_ids=y, shift=0.5, backend=backend,
                           **KEYWORDS)
    torch.autograd.grad(sum(v.sum() for v in s), (z, u))
    (low,) = made
    assert low.HAS_SHIFT and low.TEACHER_GRAD and low.SEPARATE_CE and low.CE_TERMS
    assert seen and all(got == low for got in seen), seen  # a custom op rebuilds an equal one
    if backend != "triton":
        assert all(got is low for got in seen)


@pytest.mark.parametrize("backend", ["reference", "chunked", "pallas", "triton"])
def test_jax_backends_receive_the_lowered_call(backend, monkeypatch, rng, request):
    import jax
    import jax.numpy as jnp

    from dlm_kernels.kernels.pallas import token_stats as pallas_kernels

    fw = framework("jax")
    made, seen, launched = _lowered_once(monkeypatch), [], []
    _stats_math_spies(monkeypatch, seen)
    for name in ("stats_forward", "stats_backward"):
        _spy(monkeypatch, pallas_kernels, name, launched, lambda a, kw, name=name: (name, kw))
    if backend == "triton":
        module = request.getfixturevalue("jax_triton_on_cpu")
        _spy(monkeypatch, module, "_scalars", seen, lambda a, kw: a[0])
        _spy(monkeypatch, module, "launch", launched, lambda a, kw: ("triton", kw))
    n, k = 3, 37
    z = fw.array(rng.normal(size=(n, k)), "float32")
    u = fw.array(rng.normal(size=(n, k)), "float32")
    y = fw.array(rng.integers(0, k, n))

    def loss(z, u):
        s = fw.api.token_stats(z, y, teacher_logits=u, shift_ids=y, shift=0.5,
                               backend=backend, **KEYWORDS)
        return sum(jnp.sum(v) for v in s)

    # one program: the front end lowers once; the forward's kernels are traced twice (the
    # package's cached program is traced for its primal, then for its JVP under grad)
    jax.jit(jax.grad(loss, argnums=(0, 1)))(z, u)
    (low,) = made
    assert low.HAS_SHIFT and low.TEACHER_GRAD and low.SEPARATE_CE and low.CE_TERMS
    assert all(got is low for got in seen), seen
    kinds = [kind for kind, _ in launched]
    if backend == "pallas":
        assert kinds.count("stats_backward") == 1 and 1 <= kinds.count("stats_forward") <= 2
        statics = low.pallas_statics()
        assert all({key: kw[key] for key in statics} == statics for _, kw in launched)
    elif backend == "triton":
        assert seen and 3 <= len(launched) <= 5  # partial, finalize (once or twice), gradient
        assert all(kw.items() >= low.triton_flags().items() for _, kw in launched)
    else:
        assert seen and not launched


def _host_gathers(monkeypatch):
    """The calls of the host's target-logit gathers (``token_stats.formulas.target_logit``, and
    ``target_column``, which a gather of a head's weight rows starts from), as a list."""
    import dlm_kernels.token_stats.formulas as stats_math

    seen = []
    for name in ("target_logit", "target_column"):
        _spy(monkeypatch, stats_math, name, seen, lambda a, kw, name=name: name)
    return seen


@pytest.mark.parametrize("backend,head", [("pallas", False), ("pallas", True),
                                          ("triton", False)])
def test_jax_kernels_make_logp(backend, head, monkeypatch, rng, request):
    """logp comes one way on every kernel backend: the forward kernel forms the target's
    logit (docs/design.md §5), the host gathers none (a vocabulary shard's excepted), also
    for the fused linear head's Pallas kernels; and it matches the float64 oracle."""
    import oracle

    if backend == "triton":
        request.getfixturevalue("jax_triton_on_cpu")
    fw = framework("jax")
    n, k, d = 8, 130, 16
    y_np = rng.integers(0, k, n)
    if head:
        h_np, w_np = rng.normal(size=(n, d)), rng.normal(size=(k, d)) / 4
        z_np = h_np @ w_np.T
        logits = fw.api.LinearHead(fw.array(h_np, "float32"), fw.array(w_np, "float32"),
                                   weight_layout="KD")
    else:
        z_np = rng.normal(size=(n, k)) * 3
        logits = fw.array(z_np, "float32")
    seen, fused = _host_gathers(monkeypatch), []
    if head:  # the fused head's kernels, not logits chunks
        from dlm_kernels.kernels.pallas import linear_head

        _spy(monkeypatch, linear_head, "head_forward", fused, lambda a, kw: True)
    s = fw.api.token_stats(logits, fw.array(y_np), temperature=0.7, ce_temperature=1.3,
                           softcap=5.0, backend=backend)
    assert not seen, seen
    assert fused == ([True] if head else [])
    _, want, _, _ = oracle.token_stats(z_np, y_np, np.ones(n, bool), T=0.7, T_ce=1.3,
                                       softcap=5.0)
    assert_close(np.asarray(s.logp), want, "float32", "logp")


def test_torch_triton_makes_logp(monkeypatch, rng):
    """The torch Triton forward: logp from the finalize kernel, no host gather."""
    fw = framework("torch")
    n, k = 8, 130
    z = fw.array(rng.normal(size=(n, k)), "float32")
    seen = _host_gathers(monkeypatch)
    fw.api.token_stats(z, fw.array(rng.integers(0, k, n)), backend="triton")
    assert not seen, seen


@pytest.mark.parametrize("fw_name", ["torch", "jax"])
def test_the_front_end_flags_a_heads_rows(monkeypatch, fw_name):
    """``ROUND_TILES`` is set where the student's or the teacher's logits come from a
    LinearHead (its token chunks put the backward's tile code in other fused loops), and
    not for logits given as arrays."""
    fw = framework(fw_name)
    api = fw.api
    rng = np.random.default_rng(0)
    n, d, k = 5, 8, 40
    h = fw.array(rng.normal(size=(n, d)).astype(np.float32))
    w = fw.array(rng.normal(size=(k, d)).astype(np.float32))
    z = fw.array(rng.normal(size=(n, k)).astype(np.float32))
    y = fw.array(rng.integers(0, k, n))
    made = _lowered_once(monkeypatch)
    calls = {
        "arrays": dict(logits=z, teacher_logits=z),
        "a student head": dict(logits=api.LinearHead(h, w, weight_layout="KD"), teacher_logits=z),
        "a teacher head": dict(logits=z, teacher_logits=api.LinearHead(h, w, weight_layout="KD")),
    }
    flags = {}
    for name, given in calls.items():
        api.token_stats(given["logits"], y, teacher_logits=given["teacher_logits"],
                        backend="chunked")
        flags[name] = made[-1].ROUND_TILES
    assert flags == {"arrays": False, "a student head": True, "a teacher head": True}
