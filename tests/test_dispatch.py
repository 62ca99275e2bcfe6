"""Backend registry, auto selection, DLM_KERNELS_BACKEND, errors, and import isolation."""

from __future__ import annotations

import dataclasses
import logging
import re
import subprocess
import sys

import numpy as np
import pytest

import dlm_kernels
from harness import framework, new_seed

FWS = ("torch", "jax")


@pytest.mark.parametrize("fw_name", FWS)
def test_registry_and_auto_choice_on_cpu(fw_name, monkeypatch):
    monkeypatch.delenv("DLM_KERNELS_BACKEND", raising=False)
    fw = framework(fw_name)
    assert {"reference", "chunked"} <= set(fw.registry.available())
    z = fw.array(np.zeros((2, 5), np.float32))
    assert fw.api.backend_for(z) == "chunked"
    assert dlm_kernels.backend_for(z) == "chunked"
    assert fw.api.backend_for(z, "reference") == "reference"


@pytest.mark.parametrize("fw_name", FWS)
def test_env_override(fw_name, monkeypatch):
    fw = framework(fw_name)
    z = fw.array(np.zeros((2, 5), np.float32))
    monkeypatch.setenv("DLM_KERNELS_BACKEND", "reference")
    assert fw.api.backend_for(z) == "reference"
    monkeypatch.setenv("DLM_KERNELS_BACKEND", "bogus")
    with pytest.raises(fw.api.BackendUnavailableError, match="DLM_KERNELS_BACKEND='bogus'"):
        fw.api.token_stats(z, fw.array(np.zeros(2, np.int32)))


@pytest.mark.parametrize("fw_name", FWS)
def test_explicit_backend_errors(fw_name):
    fw = framework(fw_name)
    z = fw.array(np.zeros((2, 5), np.float32))
    y = fw.array(np.zeros(2, np.int32))
    with pytest.raises(ValueError, match="backend must be None or one of"):
        fw.api.token_stats(z, y, backend="cuda")
    if fw_name == "torch":
        with pytest.raises(fw.api.BackendUnavailableError, match="backend='pallas' is not available for torch"):
            fw.api.token_stats(z, y, backend="pallas")
        with pytest.raises(fw.api.BackendUnavailableError,
                           match="backend='pallas' is not available for torch: it is not "
                                 "implemented for this framework"):
            fw.api.sample_tokens(z, backend="pallas")  # the sampler's registry: no pallas


def test_auto_fallback_is_logged(caplog):
    from dlm_kernels._dispatch import TOKEN_STATS, BackendBase, Capabilities, Registry

    class Fake(BackendBase):  # a backend of the protocol that only says where it runs
        custom_vjp, capabilities = False, Capabilities()

        def __init__(self, name, why=None):
            self.name, self.why = name, why

        def unsupported_reason(self, platform):
            return self.why

        def compute(self, rows, cfg):
            raise AssertionError("resolving a backend runs nothing")

    reg = Registry("fake", TOKEN_STATS)
    reg.register(Fake("chunked"))
    reg.mark_unavailable("triton", "no GPU triton here")
    with caplog.at_level(logging.DEBUG, logger="dlm_kernels"):
        assert reg.resolve(None, "cuda").name == "chunked"
    # the accelerator's own kernels missing: one WARNING that says why and how to silence it
    (first,) = caplog.records
    assert first.levelno == logging.WARNING, first
    assert "'triton' is unavailable (no GPU triton here)" in first.getMessage()
    assert "DLM_KERNELS_BACKEND=chunked" in first.getMessage()
    caplog.clear()
    with caplog.at_level(logging.DEBUG, logger="dlm_kernels"):
        assert reg.resolve(None, "cuda").name == "chunked"
        assert reg.resolve(None, "cpu").name == "chunked"
    (again,) = caplog.records  # then DEBUG; a CPU (chunked is its own backend) logs nothing
    assert again.levelno == logging.DEBUG and "triton unavailable" in again.getMessage()
    with pytest.raises(dlm_kernels._dispatch.BackendUnavailableError, match="no GPU triton here"):
        reg.resolve("triton", "cuda")


@pytest.mark.parametrize("mod,other", [("dlm_kernels.torch", "jax"), ("dlm_kernels.jax", "torch")])
def test_front_end_does_not_import_the_other_framework(mod, other):
    code = f"import sys, {mod}; assert {other!r} not in sys.modules, sorted(m for m in sys.modules if m.startswith({other!r}))"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_op_packages_import_no_framework():
    """token_stats/, linear_head/, sampling/ (and the package root) are framework-neutral: a
    framework comes in only with a module of it (torch_*.py, jax_*.py) or a front end."""
    code = ("import sys, dlm_kernels.token_stats, dlm_kernels.linear_head, dlm_kernels.sampling, "
            "dlm_kernels.linear_head.head, dlm_kernels.sampling.core, dlm_kernels.token_stats.formulas; "
            "seen = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'jax')); "
            "assert not seen, seen")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_no_host_module_imports_a_front_end():
    """Imports go one way: the front ends (dlm_kernels.torch, dlm_kernels.jax) import the ops,
    never the reverse, so any op or backend module can be imported first (the registry does,
    and tests do) without running a front end's __init__ halfway through its own import. Only
    torch/nn.py (a front end itself), the root's lazy ``backend_for`` and the model
    integrations (torch/integrations/: users of the front end, which it never imports) may."""
    import ast
    import pathlib

    root = pathlib.Path(__file__).resolve().parents[1] / "python" / "dlm_kernels"
    allowed = {"__init__.py", "torch/__init__.py", "torch/nn.py", "jax/__init__.py"}
    hits = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if (rel.split("/")[0] in ("kernels", "bench") or rel in allowed
                or rel.startswith("torch/integrations/")):
            continue
        package = ["dlm_kernels", *rel.split("/")[:-1]]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = package[:len(package) - node.level + 1] if node.level else []
                name = ".".join(base + ([node.module] if node.module else []))
                names = [f"{name}.{a.name}" for a in node.names] + [name]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            if any(n.split(".")[:2] in (["dlm_kernels", "torch"], ["dlm_kernels", "jax"])
                   for n in names):
                hits.append(f"{rel}:{node.lineno}")
    assert not hits, hits


def test_jax_transforms_jit_grad_vmap():
    import jax
    import jax.numpy as jnp

    import dlm_kernels.jax as D

    rng = np.random.default_rng(new_seed())
    z = jnp.asarray(rng.normal(size=(3, 4, 37)), jnp.float32)
    u = jnp.asarray(rng.normal(size=(3, 4, 37)), jnp.float32)
    y = jnp.asarray(rng.integers(0, 37, (3, 4)))
    w = jnp.asarray(rng.uniform(0, 1, (3, 4)) > 0.3, jnp.float32)

    def loss(z, backend):
        s = D.token_stats(z, y, w, teacher_logits=u, temperature=0.9, chunk_size=10, backend=backend)
        return jnp.sum(s.logp) + 0.3 * jnp.sum(s.entropy) + 0.5 * jnp.sum(s.kl)

    ref_v, ref_g = jax.value_and_grad(loss)(z, "reference")
    v, g = jax.jit(jax.value_and_grad(loss), static_argnums=1)(z, "chunked")
    np.testing.assert_allclose(v, ref_v, rtol=2e-5)
    np.testing.assert_allclose(g, ref_g, atol=2e-6, rtol=2e-5)
    # vmap over a leading batch axis: per-example gradients
    per_ex = jax.vmap(jax.grad(lambda zi, yi, wi: jnp.sum(
        D.token_stats(zi, yi, wi, chunk_size=10).logp)))(z, y, w)
    full = jax.grad(lambda z: jnp.sum(D.token_stats(z, y, w, backend="reference").logp))(z)
    np.testing.assert_allclose(per_ex, full, atol=2e-6, rtol=2e-5)


def test_non_editable_install_ships_kernels(tmp_path):
    """A regular (non-editable) install maps kernels/ to dlm_kernels.kernels."""
    import os

    root = os.path.join(os.path.dirname(__file__), "..")
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target",
                    str(target), root], check=True, capture_output=True, text=True, timeout=600)
    code = ("import dlm_kernels, dlm_kernels.torch, dlm_kernels.jax;"
            "from dlm_kernels.kernels.triton import token_stats;"
            "from dlm_kernels.kernels.pallas import token_stats as p;"
            "assert dlm_kernels.__file__.startswith(%r), dlm_kernels.__file__" % str(target))
    env = dict(os.environ, PYTHONPATH=str(target))
    subprocess.run([sys.executable, "-c", code], check=True, cwd=str(tmp_path), env=env)


@pytest.mark.parametrize("fw_name", FWS)
def test_objectives_ask_only_for_what_they_use(fw_name, monkeypatch):
    """The kernels leave out what no output needs: CE-type objectives run without the
    entropy's sums, distillation adds the T = 1 CE sums only with a hard term; the RL
    functions, per_token_logps (with or without return_entropy) and policy_loss (its entropy
    metric), take the entropy's sums, so that their log-probs come from one program shape
    (XLA summed Σ e^x in another order beside the entropy's sum: test_invariance.py,
    test_logp_ignores_entropy)."""
    fw = framework(fw_name)
    impl = fw.registry.IMPLEMENTATIONS["chunked"]
    seen = []
    forward = type(impl).forward

    def spy(*args):
        seen.append(args[-1])  # the lowered call (token_stats.lowering.Lowered)
        return forward(*args)

    monkeypatch.setattr(type(impl), "forward", staticmethod(spy))
    rng = np.random.default_rng(new_seed())
    z = fw.array(rng.normal(size=(2, 3, 11)), "float32")
    y = fw.array(rng.integers(0, 11, (2, 3)))
    w = fw.array(np.ones((2, 3), np.float32))
    api = fw.api
    batch = api.DiffusionTokenBatch.create(model_inputs=y, target_ids=y, loss_weights=w)
    dbatch = api.DiffusionDistillationBatch.create(student_batch=batch, teacher_logits=z)
    calls = {
        "weighted_cross_entropy": lambda: api.weighted_cross_entropy(z, batch),
        "diffusion_sft_loss": lambda: api.diffusion_sft_loss(
            z, y, y, fw.array(np.full(2, 0.5, np.float32)), w, variant="reweighted-loo-ce",
            vocab_size=11),
        "per_token_logps": lambda: api.per_token_logps(z, batch),
        "per_token_logps+entropy": lambda: api.per_token_logps(z, batch, return_entropy=True),
        "opd soft+hard": lambda: api.opd_loss(z, dbatch, temperature=2.0, hard_loss_weight=0.5),
        "opd soft only": lambda: api.opd_loss(z, dbatch, temperature=2.0),
        "policy_loss": lambda: api.policy_loss(z, batch, old_logps=None,
                                               advantages=fw.array(np.ones(2, np.float32)),
                                               loss_type="grpo"),
    }
    got = {}
    for name, call in calls.items():
        seen.clear()
        if fw_name == "jax":  # the VJP is a cached program: trace it again for the spy
            import jax
            jax.clear_caches()
        call()
        (cfg,) = seen
        got[name] = (cfg.HAS_ENTROPY, cfg.SEPARATE_CE)
    assert got == {
        "weighted_cross_entropy": (False, False),
        "diffusion_sft_loss": (False, False),
        "per_token_logps": (True, False),  # the entropy's sums either way
        "per_token_logps+entropy": (True, False),
        "opd soft+hard": (False, True),
        "opd soft only": (False, False),
        "policy_loss": (True, False),  # its entropy metric, from the same pass
    }, got


def test_a_new_backend_is_one_module_and_one_table_row(tmp_path, monkeypatch):
    """A throwaway backend: its module (here a file of the test's) and one row of the backend
    table; the registry, explicit and auto choice, the documentation's list and the
    benchmark's backend list all pick it up from the table."""
    import os

    (tmp_path / "throwaway_backend.py").write_text(
        "from dlm_kernels.token_stats.op import ReferenceBackend\n"
        "from dlm_kernels._torch.ops import TorchOps\n\n\n"
        "class Throwaway(ReferenceBackend):\n"
        "    name = 'throwaway'\n"
        "    calls = 0\n\n"
        "    def compute(self, rows, cfg):\n"
        "        Throwaway.calls += 1\n"
        "        return super().compute(rows, cfg)\n\n\n"
        "IMPLEMENTATION = Throwaway(TorchOps)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.syspath_prepend(os.path.dirname(os.path.dirname(__file__)))  # for bench
    monkeypatch.delenv("DLM_KERNELS_BACKEND", raising=False)
    from dlm_kernels import _dispatch

    import dlm_kernels.torch as T
    from dlm_kernels._torch.framework import TORCH
    from bench.runner import variants

    row = _dispatch.BackendSpec("throwaway", {"torch": "throwaway_backend"}, ("cpu",),
                                "a test's backend")
    monkeypatch.setattr(_dispatch, "BACKENDS", _dispatch.BACKENDS + (row,))
    monkeypatch.setattr(TORCH.token_stats, "IMPLEMENTATIONS", dict(TORCH.token_stats.IMPLEMENTATIONS))
    TORCH.token_stats.load()
    assert "throwaway" in _dispatch.backend_names()
    assert TORCH.token_stats.native("cpu") == ("throwaway", "chunked")
    assert '"throwaway" (a test\'s backend)' in _dispatch.backends_doc()
    assert variants({"cuda": False}, "torch", "ce")[0] == ["throwaway", "chunked"]
    rng = np.random.default_rng(new_seed())
    z = torch_tensor(rng.normal(size=(3, 11)))
    y = torch_tensor(rng.integers(0, 11, 3))
    assert T.backend_for(z) == "throwaway"  # its row prefers the CPU
    ref = T.token_stats(z, y, backend="reference")
    impl = TORCH.token_stats.IMPLEMENTATIONS["throwaway"]
    before = type(impl).calls
    for got, exp in zip(T.token_stats(z, y, backend="throwaway"), ref):
        np.testing.assert_array_equal(got.numpy(), exp.numpy())
    assert type(impl).calls == before + 1


def torch_tensor(a):
    import torch

    return torch.as_tensor(a, dtype=torch.float32 if a.dtype.kind == "f" else torch.int64)


def test_backend_for_names_arrays_a_front_end_does_not_take():
    """dlm_kernels.torch.backend_for(ndarray) was an AttributeError ('str' object has no
    attribute 'type'); the root backend_for sends NumPy to dlm_kernels.jax, which takes it,
    and says so plainly where JAX cannot be imported."""
    import torch

    import dlm_kernels.jax as J
    import dlm_kernels.torch as T

    with pytest.raises(TypeError, match=r"^logits must be a torch tensor .*; got a NumPy ndarray: "
                                        r"convert it with torch\.as_tensor\(logits\)$"):
        T.backend_for(np.zeros(3, np.float32))
    with pytest.raises(TypeError, match=r"^logits\.hidden must be a torch tensor .*got a NumPy"):
        T.backend_for(T.LinearHead(np.zeros((2, 3), np.float32), torch.zeros(5, 3)))
    with pytest.raises(TypeError, match=r"^logits must be a JAX/NumPy array or ShapeDtypeStruct .*; got a torch Tensor"):
        J.backend_for(torch.zeros(3))
    assert dlm_kernels.backend_for(np.zeros(3, np.float32)) == J.backend_for(np.zeros(3, np.float32))
    code = ("import sys; sys.modules['jax'] = None\n"  # JAX cannot be imported
            "import numpy as np, dlm_kernels\n"
            "try:\n"
            "    dlm_kernels.backend_for(np.zeros(3))\n"
            "except TypeError as err:\n"
            "    print(err)\n")
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
    assert out.stdout.startswith("logits is a NumPy ndarray, which only dlm_kernels.jax takes, and "
                                 "it cannot be imported here ("), out
    assert "convert it with torch.as_tensor(logits)" in out.stdout, out.stdout


@pytest.mark.parametrize("fw_name", FWS)
def test_vocab_parallel_takes_a_process_group_or_a_mesh_axis_name(fw_name):
    """vocab_parallel(object()) failed at first use with an AttributeError (torch) or an
    unbound-axis NameError (JAX); the argument is checked where it is given."""
    fw = framework(fw_name)
    z, y = fw.array(np.zeros((2, 5), np.float32)), fw.array(np.zeros(2, np.int64))
    if fw_name == "torch":
        bad = (r"^process_group must be a torch\.distributed ProcessGroup \(dist\.group\.WORLD, "
               r"dist\.new_group\(\.\.\.\)\) or None; got object$")
        keyword = "process_group"
    else:
        bad = (r"^vocab_axis must be a mesh axis name \(a str such as 'vocab', or a tuple of "
               r"them\); got object$")
        keyword = "vocab_axis"
    with pytest.raises(TypeError, match=bad):
        fw.api.vocab_parallel(object())
    with pytest.raises(TypeError, match=bad):
        fw.api.token_stats(z, y, **{keyword: object()})
    with pytest.raises(ValueError, match=r"^vocab_size must be a positive int; got 0$"):
        fw.api.vocab_parallel("vocab" if fw_name == "jax" else None, vocab_size=0)
    if fw_name == "jax":  # a name, but no shard_map binds it here
        with pytest.raises(ValueError, match=r"^vocab_axis 'vocab' is not an axis of the "
                                             r"enclosing jax\.shard_map"):
            fw.api.token_stats(z, y, vocab_axis="vocab")


HIGHER_ORDER = (r"^backend '{}' gives first derivatives only: its custom VJP cannot be "
                r"differentiated again \(.*\)\. Use backend='reference' for higher-order derivatives")


@pytest.mark.parametrize("head", [False, True], ids=["logits", "head"])
def test_torch_double_backward_through_a_custom_vjp_raises(head):
    """A gradient taken with create_graph=True from the chunked backend looked constant: a
    backward through it silently left out the second-order terms. The first derivative is
    unchanged; differentiating it raises. The reference backend (torch autograd) supports it."""
    import torch

    import dlm_kernels.torch as T

    rng = np.random.default_rng(new_seed())
    hidden = torch.tensor(rng.normal(size=(4, 5)), dtype=torch.float32, requires_grad=True)
    weight = torch.tensor(rng.normal(size=(13, 5)), dtype=torch.float32, requires_grad=True)
    y = torch.tensor(rng.integers(0, 13, 4))
    teacher = torch.tensor(rng.normal(size=(4, 13)), dtype=torch.float32)
    logits = lambda: T.LinearHead(hidden, weight) if head else hidden @ weight.T
    for backend in ("chunked", "reference"):
        s = T.token_stats(logits(), y, teacher_logits=teacher, backend=backend)
        loss = s.logp.sum() + s.kl.sum()
        (g,) = torch.autograd.grad(loss, hidden, create_graph=True)
        s = T.token_stats(logits(), y, teacher_logits=teacher, backend=backend)
        (plain,) = torch.autograd.grad(s.logp.sum() + s.kl.sum(), hidden)
        assert torch.equal(g.detach(), plain)
        second = (g * g).sum() + (hidden * hidden).sum()  # the silent case: another path too
        if backend == "reference":
            torch.autograd.grad(second, [hidden, weight])
            continue
        with pytest.raises(NotImplementedError, match=HIGHER_ORDER.format(backend)):
            torch.autograd.grad(second, [hidden, weight])


@pytest.mark.parametrize("backend", ["chunked", "pallas"])
@pytest.mark.parametrize("head", [False, True], ids=["logits", "head"])
def test_jax_grad_of_grad_through_a_custom_vjp_raises(backend, head, monkeypatch):
    """jax.grad of jax.grad differentiated the custom VJP's own rules: the chunked backend's
    second derivative was silently 0 for 16-bit logits on a CPU, Pallas failed with a bare
    AssertionError. Every custom-VJP backend now says it gives first derivatives only; the
    reference backend (JAX autodiff) supports it."""
    import jax
    import jax.numpy as jnp

    import dlm_kernels.jax as J

    monkeypatch.setenv("DLM_KERNELS_PALLAS_INTERPRET", "1")
    rng = np.random.default_rng(new_seed())
    hidden = jnp.asarray(rng.normal(size=(2, 8, 5)), jnp.float32)
    weight = jnp.asarray(rng.normal(size=(5, 13)), jnp.float32)
    y = jnp.asarray(rng.integers(0, 13, (2, 8)))
    batch = J.DiffusionTokenBatch.create(model_inputs=y, target_ids=y, loss_weights=jnp.ones((2, 8)))

    def stats_loss(h, backend):
        logits = J.LinearHead(h, weight) if head else h @ weight
        return J.token_stats(logits, y, backend=backend).logp.sum()

    def objective(h, backend):  # a planned total (its gradient formed in the forward)
        logits = J.LinearHead(h, weight) if head else h @ weight
        return J.weighted_cross_entropy(logits, batch, backend=backend).compute()

    for loss in (stats_loss, objective):
        grad = jax.grad(loss)
        np.testing.assert_allclose(grad(hidden, backend), grad(hidden, "reference"),
                                   atol=2e-6, rtol=2e-5)
        # the reference backend's second derivative: a Hessian-vector product (forward over
        # reverse, as jax.hessian forms it; the full [80, 80] Hessian costs 80 of them)
        jax.jvp(lambda h: grad(h, "reference"), (hidden,), (jnp.ones_like(hidden),))
        for second in (jax.grad(lambda h: jnp.sum(grad(h, backend) ** 2)),
                       lambda h: jax.hessian(loss)(h, backend)):
            with pytest.raises(NotImplementedError, match=HIGHER_ORDER.format(backend)):
                second(hidden)


@pytest.mark.parametrize("fw_name", FWS)
def test_every_backend_follows_the_protocol_in_full(fw_name):
    """What a backend declares (custom_vjp, capabilities) it implements, with the protocol's
    parameters: no method is left to BackendBase's raising stub; every sampler and fused
    head follows its op's protocol in full."""
    from dlm_kernels import _dispatch
    from dlm_kernels._dispatch import Backend, missing_methods

    registry = framework(fw_name).registry
    for name, impl in registry.IMPLEMENTATIONS.items():
        assert isinstance(impl, Backend), name
        assert missing_methods(impl) == (), name
    for op, protocol in ((_dispatch.SAMPLING, _dispatch.SampleBackend),
                         (_dispatch.FUSED_HEAD, _dispatch.FusedHead)):
        for name, impl in _dispatch.registry(op, fw_name).IMPLEMENTATIONS.items():
            assert isinstance(impl, protocol) and impl.name == name, (op.name, name)
            assert op.check(impl) == (), (op.name, name)


#: per op and framework, the backends its registry holds (registered, or recorded as
#: unavailable here: jax-triton needs a GPU-enabled jaxlib)
OP_BACKENDS = {
    ("token-statistics", "torch"): {"reference", "chunked", "triton"},
    ("token-statistics", "jax"): {"reference", "chunked", "triton", "pallas"},
    ("sampler", "torch"): {"reference", "chunked", "triton"},
    ("sampler", "jax"): {"reference", "chunked", "triton", "pallas"},
    ("fused-head", "torch"): set(),
    ("fused-head", "jax"): {"pallas"},
}


@pytest.mark.parametrize("fw_name", FWS)
def test_each_op_has_its_own_registry(fw_name, monkeypatch):
    """One registry per op and framework, each holding exactly that op's backends (torch: no
    pallas; a fused head: JAX's pallas only), filled from the op's own modules: no sampler
    or fused head hangs off a token-statistics backend, and sample_tokens resolves from the
    sampler's registry."""
    from dlm_kernels import _dispatch

    fw = framework(fw_name)
    assert _dispatch.registry(_dispatch.TOKEN_STATS, fw_name) is fw.registry
    packages = {"token-statistics": "token_stats", "sampler": "sampling",
                "fused-head": "linear_head"}
    for op in (_dispatch.TOKEN_STATS, _dispatch.SAMPLING, _dispatch.FUSED_HEAD):
        reg = _dispatch.registry(op, fw_name)
        assert reg.op is op and reg.framework == fw_name
        held = set(reg.IMPLEMENTATIONS) | set(reg._unavailable)
        assert held == OP_BACKENDS[op.name, fw_name], (op.name, held)
        for spec in _dispatch.BACKENDS:
            module = op.module(spec, fw_name)
            assert module in (None, f"dlm_kernels.{packages[op.name]}.{fw_name}_{spec.name}")
    for impl in fw.registry.IMPLEMENTATIONS.values():
        assert not hasattr(impl, "sample") and not hasattr(impl, "fused_head"), impl.name
    assert "sampling" not in {f.name for f in dataclasses.fields(_dispatch.Capabilities)}
    chunked = _dispatch.registry(_dispatch.SAMPLING, fw_name).IMPLEMENTATIONS["chunked"]
    seen, sample = [], type(chunked).sample
    monkeypatch.setattr(type(chunked), "sample",
                        staticmethod(lambda *a: seen.append(a) or sample(*a)))
    fw.api.sample_tokens(fw.array(np.zeros((2, 5), np.float32)), backend="chunked")
    assert len(seen) == 1


@pytest.mark.parametrize("mod,other", [("dlm_kernels.torch", "jax"), ("dlm_kernels.jax", "torch")])
def test_a_front_end_loads_only_its_own_op_modules(mod, other):
    """Loading one front end's registries (token statistics, sampler, fused head) imports no
    module of the other framework's (sampling/jax_*.py in a torch-only process)."""
    code = (f"import sys, {mod}; from dlm_kernels import _dispatch as d; "
            f"[d.registry(op, {mod.split('.')[1]!r}) for op in (d.TOKEN_STATS, d.SAMPLING, "
            f"d.FUSED_HEAD)]; "
            f"seen = sorted(m for m in sys.modules if m.startswith('dlm_kernels.') and "
            f"m.rsplit('.', 1)[1].startswith({other + '_'!r})); assert not seen, seen")
    subprocess.run([sys.executable, "-c", code], check=True)


def _declared(capabilities, custom_vjp=True):
    from dlm_kernels._dispatch import BackendBase

    class Declared(BackendBase):
        name = "declared"

        @staticmethod
        def unsupported_reason(platform):
            return None

        @staticmethod
        def forward(rows, cfg):
            return None

        @staticmethod
        def backward(rows, stats, grads, cfg, offset=0):
            return None, None

    Declared.capabilities, Declared.custom_vjp = capabilities, custom_vjp
    return Declared


@pytest.mark.parametrize("case", ["forward_partial", "inplace", "compute"])
def test_a_backend_missing_a_method_is_refused_at_registration(case):
    """A backend whose capabilities promise more than it implements never reaches a user
    as a NotImplementedError from deep inside a call: the registry names what is missing."""
    from dlm_kernels._dispatch import TOKEN_STATS, Capabilities, Registry

    caps = {"forward_partial": Capabilities(vocab_shards=True),
            "inplace": Capabilities(inplace_grad=True),
            "compute": Capabilities()}[case]
    cls = _declared(caps, custom_vjp=case != "compute")
    want = {"forward_partial": "forward_partial (not implemented)",
            "inplace": "backward (takes no 'inplace')",
            "compute": "compute (not implemented)"}[case]
    registry = Registry("torch", TOKEN_STATS)
    with pytest.raises(TypeError, match=r"token-statistics backend 'declared' .*declares but "
                                        r"does not implement: .*" + re.escape(want)):
        registry.register(cls())
    assert "declared" not in registry.IMPLEMENTATIONS
    registry.register(_declared(Capabilities())())  # what it declares, it has
    assert registry.available() == ("declared",)


class _Sampler:
    name = "declared"

    @staticmethod
    def unsupported_reason(platform):
        return None

    @staticmethod
    def sample(z, zu, keys, suppress, cfg):
        return None


class _Head:
    name = "declared"

    @staticmethod
    def takes(rows, axis, plan):
        return False

    @staticmethod
    def forward(rows, cfg):
        return None

    @staticmethod
    def backward(rows, stats, grads, cfg):
        return None, None


@pytest.mark.parametrize("case", ["sample", "sample_params", "unsupported_reason",
                                  "head_backward", "head_params"])
def test_a_sampler_or_head_missing_a_method_is_refused_at_registration(case):
    """The sampler's and the fused head's registries check their protocols (SampleBackend,
    FusedHead) when they take an implementation, naming what is missing."""
    from dlm_kernels._dispatch import FUSED_HEAD, SAMPLING, Registry

    op, base = (FUSED_HEAD, _Head) if case.startswith("head") else (SAMPLING, _Sampler)
    cls = type("Declared", (base,), {})
    if case in ("sample", "unsupported_reason", "head_backward"):
        method = {"sample": "sample", "unsupported_reason": "unsupported_reason",
                  "head_backward": "backward"}[case]
        cls = type("Declared", (), {k: v for k, v in vars(base).items() if k != method})
    if case == "sample_params":
        cls.sample = staticmethod(lambda z, keys, cfg: None)  # no zu, no suppress
    if case == "head_params":
        cls.takes = staticmethod(lambda rows, plan: True)  # no axis
    want = {"sample": "sample (not implemented)",
            "sample_params": "sample (takes no 'zu')",
            "unsupported_reason": "unsupported_reason (not implemented)",
            "head_backward": "backward (not implemented)",
            "head_params": "takes (takes no 'axis')"}[case]
    registry = Registry("torch", op)
    with pytest.raises(TypeError, match=rf"{op.name} backend 'declared' \(Declared\) declares "
                                        r"but does not implement: .*" + re.escape(want)):
        registry.register(cls())
    assert "declared" not in registry.IMPLEMENTATIONS
    registry.register(base())  # what the protocol asks, it has
    assert registry.available() == ("declared",)


@pytest.mark.parametrize("case", ["token_stats", "gradient", "head", "soft_embedding",
                                  "sample_tokens"])
def test_eager_jax_calls_compile_once(case):
    """An eager JAX call (no enclosing jit) of the chunked backend compiles its program once
    per shape and configuration: a second call with new values compiles nothing. Before the
    VJPs ran as cached programs (``jax.jit`` with the configuration static), every eager call
    traced its loops afresh (a ``lax.fori_loop`` of a new closure compiles again), about
    0.2-0.4 s a call on a CPU."""
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp
    import jax.monitoring

    import dlm_kernels.jax as dk
    from dlm_kernels.jax.self_conditioning import soft_embedding

    n, k, d = 24, 700, 16
    y = jnp.asarray(np.arange(n) * 29 % k)
    batch = dk.DiffusionTokenBatch.create(model_inputs=y[None], target_ids=y[None],
                                          loss_weights=jnp.ones((1, n)))
    calls = {
        "token_stats": lambda z, w: dk.token_stats(z, y, temperature=0.7, chunk_size=128).lse,
        "gradient": lambda z, w: jax.grad(lambda z: dk.token_stats(
            z, y, chunk_size=128).logp.sum())(z),
        "head": lambda z, w: dk.weighted_cross_entropy(dk.LinearHead(z[None, :, :d], w),
                                                       batch).compute(),
        "soft_embedding": lambda z, w: soft_embedding(z, w.T, chunk_size=128),
        "sample_tokens": lambda z, w: dk.sample_tokens(z, temperature=0.8, top_k=3, seed=5,
                                                       step=0).token,
    }
    rng = np.random.default_rng(new_seed())

    def inputs():
        return (jnp.asarray(rng.normal(size=(n, k)), jnp.float32),
                jnp.asarray(rng.normal(size=(d, k)), jnp.float32))

    compiles = []

    def listener(event, duration, **kwargs):
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append(event)

    jax.block_until_ready(calls[case](*inputs()))  # the first call compiles
    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        z, w = inputs()
        jax.block_until_ready(calls[case](z, w))
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    assert not compiles, f"{case}: a second eager call compiled {len(compiles)} programs"
