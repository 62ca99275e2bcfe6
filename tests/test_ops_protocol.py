"""The ops adapter protocol (``dlm_kernels._ops.Ops``): both adapters, ``TorchOps`` and
``JaxOps``, have every member it declares, with signatures that accept its calls; every
``xp.<name>`` of the framework-neutral code is declared by it (a new use must be declared);
and a type checker, where one is installed, accepts both adapters as ``Ops``."""

from __future__ import annotations

import ast
import inspect
import json
import os
import pathlib
import shutil
import subprocess
import typing

import pytest

from dlm_kernels._jax.ops import JaxOps
from dlm_kernels._ops import Ops
from dlm_kernels._torch.ops import TorchOps

REPO = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = REPO / "python" / "dlm_kernels"
#: the adapters' own folders: framework-specific code, held to nothing here
FRAMEWORK_DIRS = {"_torch", "_jax"}
ADAPTERS = [TorchOps, JaxOps]

P = inspect.Parameter
POSITIONAL = (P.POSITIONAL_ONLY, P.POSITIONAL_OR_KEYWORD)


def _protocol_methods() -> dict[str, typing.Callable[..., object]]:
    return {name: value for name, value in vars(Ops).items()
            if inspect.isfunction(value) and not name.startswith("_")}


def _protocol_attributes() -> dict[str, type]:
    return dict(typing.get_type_hints(Ops))


def _protocol_members() -> set[str]:
    return set(_protocol_methods()) | set(_protocol_attributes())


def _signature_problems(declared, impl) -> list[str]:
    """Why ``impl`` (an adapter's static method) does not accept every call the protocol's
    method ``declared`` allows: the same count of positional parameters (any count where it
    takes *args), the protocol's name for each one a caller may pass by keyword, a default
    wherever the protocol has one (the same value), no other required parameter."""
    want = list(inspect.signature(declared).parameters.values())[1:]  # without self
    try:
        have = list(inspect.signature(impl).parameters.values())
    except (TypeError, ValueError):  # a C builtin (torch.exp): nothing to compare
        named = [p.name for p in want if p.kind is not P.POSITIONAL_ONLY]
        return ([f"its signature cannot be read, so the protocol may not promise keyword "
                 f"names: make {named} positional-only (/)"] if named else [])
    problems = []
    want_pos = [p for p in want if p.kind in POSITIONAL]
    have_pos = [p for p in have if p.kind in POSITIONAL]
    star_args = any(p.kind is P.VAR_POSITIONAL for p in have)
    if len(have_pos) != len(want_pos) and not (star_args and len(have_pos) < len(want_pos)):
        problems.append(f"takes {len(have_pos)} positional parameters "
                        f"({', '.join(p.name for p in have_pos)}), the protocol "
                        f"{len(want_pos)} ({', '.join(p.name for p in want_pos)})")
    for w, h in zip(want_pos, have_pos):
        if w.kind is P.POSITIONAL_OR_KEYWORD and (
                h.name != w.name or h.kind is not P.POSITIONAL_OR_KEYWORD):
            problems.append(f"parameter {h.name!r} ({h.kind.description}) stands where the "
                            f"protocol has {w.name!r}, which a caller may pass by keyword")
        if w.default is not P.empty and h.default is P.empty:
            problems.append(f"parameter {h.name!r} has no default; the protocol's "
                            f"{w.name}={w.default!r}")
        elif w.default is not P.empty and h.default != w.default:
            problems.append(f"parameter {h.name!r} defaults to {h.default!r}; the protocol's "
                            f"{w.name}={w.default!r}")
    have_by_name = {p.name: p for p in have}
    star_kwargs = any(p.kind is P.VAR_KEYWORD for p in have)
    for w in want:
        if w.kind is P.KEYWORD_ONLY and w.name not in have_by_name and not star_kwargs:
            problems.append(f"takes no keyword {w.name!r}")
    declared_names = {p.name for p in want}
    for h in have:
        if (h.kind is P.KEYWORD_ONLY and h.default is P.empty
                and h.name not in declared_names):
            problems.append(f"requires the keyword {h.name!r}, which the protocol never passes")
    return problems


@pytest.mark.parametrize("adapter", ADAPTERS, ids=lambda cls: cls.__name__)
def test_every_declared_member_is_implemented(adapter):
    """Each method of the protocol is a static method of the adapter (the class is the
    adapter) that accepts the protocol's parameters; each constant is there, of its type."""
    methods, attributes = _protocol_methods(), _protocol_attributes()
    assert len(methods) > 40 and attributes, (sorted(methods), attributes)  # read at all
    problems = []
    for name, declared in sorted(methods.items()):
        where = f"{adapter.__name__}.{name}"
        if not hasattr(adapter, name):
            problems.append(f"{where}: missing (Ops declares it)")
            continue
        if not isinstance(inspect.getattr_static(adapter, name), staticmethod):
            problems.append(f"{where}: not a static method (shared code calls it on the class)")
            continue
        problems += [f"{where}: {p}" for p in _signature_problems(declared, getattr(adapter, name))]
    for name, kind in sorted(attributes.items()):
        where = f"{adapter.__name__}.{name}"
        if not hasattr(adapter, name):
            problems.append(f"{where}: missing (Ops declares it)")
        elif not isinstance(getattr(adapter, name), kind):
            problems.append(f"{where}: {getattr(adapter, name)!r} is not a {kind.__name__} "
                            f"(Ops declares {name}: {kind.__name__})")
    assert not problems, "\n".join(problems)


def _binds_a_concrete_adapter(tree: ast.Module) -> bool:
    """Whether a module binds ``xp`` to one adapter itself (``from .._jax.ops import JaxOps
    as xp``, ``xp = TorchOps``): framework-specific code, free to use that adapter's own
    members."""
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if any((alias.asname or alias.name) == "xp" for alias in node.names):
                return True
        elif isinstance(node, ast.Assign) and isinstance(node.value, ast.Name):
            if node.value.id in ("TorchOps", "JaxOps") and any(
                    isinstance(t, ast.Name) and t.id == "xp" for t in node.targets):
                return True
    return False


def _is_adapter(node: ast.expr) -> bool:
    """``xp``, or an object's ``xp`` attribute (``self.xp``, ``front.xp``)."""
    return ((isinstance(node, ast.Name) and node.id == "xp")
            or (isinstance(node, ast.Attribute) and node.attr == "xp"))


def _shared_uses() -> tuple[dict[str, list[str]], list[str]]:
    """{member: ["file:line", ...]} of every ``xp.<member>`` in the package's framework-neutral
    modules (outside _torch/ and _jax/, the linked kernels/ and bench/ folders not followed),
    and the framework-specific modules left out (those that bind ``xp`` themselves)."""
    uses: dict[str, list[str]] = {}
    skipped = []
    for folder, dirs, files in os.walk(PACKAGE):
        dirs[:] = sorted(d for d in dirs if d not in FRAMEWORK_DIRS and d != "__pycache__"
                         and not os.path.islink(os.path.join(folder, d)))
        for name in sorted(files):
            path = pathlib.Path(folder, name)
            if path.suffix != ".py" or path.is_symlink():
                continue
            rel = path.relative_to(PACKAGE).as_posix()
            tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
            if _binds_a_concrete_adapter(tree):
                skipped.append(rel)
                continue
            for node in ast.walk(tree):
                if isinstance(node, ast.Attribute) and _is_adapter(node.value):
                    uses.setdefault(node.attr, []).append(f"{rel}:{node.lineno}")
    return uses, skipped


def test_every_shared_use_is_declared():
    """Every ``xp.<name>`` the framework-neutral code calls or reads is a member of ``Ops``:
    a new use must be declared there (and so implemented by both adapters)."""
    uses, _ = _shared_uses()
    files = {at.split(":")[0] for ats in uses.values() for at in ats}
    assert len(uses) > 30 and len(files) > 5, (sorted(uses), sorted(files))  # the walk works
    declared = _protocol_members()
    undeclared = {name: ats for name, ats in uses.items() if name not in declared}
    assert not undeclared, "\n".join(
        f"xp.{name} (used at {', '.join(ats)}): not declared by dlm_kernels._ops.Ops; declare "
        f"it there (TorchOps and JaxOps both implement it) or keep the use framework-specific"
        for name, ats in sorted(undeclared.items()))


#: ``t: Ops[...] = TorchOps``: the adapter as shared code receives it, the class itself. A type
#: checker matches a class object's attributes to a protocol only where the class declares
#: them ``ClassVar`` (PEP 544), which TorchOps / JaxOps do not (yet) for their constants and
#: the functions they assign (``exp = staticmethod(torch.exp)``); until they do, the adapter
#: is checked as an instance of its class, whose members are the same. Both spell ``where``
#: as ``staticmethod`` of an overloaded function, of which pyright keeps only the first
#: overload, ``where(condition)`` (``TorchOps.where(c, x, y)`` is itself an error to it): the
#: instance check's subclass declares the three-argument ``where`` that the adapters run.
SNIPPET = '''\
import jax
import torch

from dlm_kernels._jax.ops import JaxOps
from dlm_kernels._ops import Ops
from dlm_kernels._torch.ops import TorchOps


class _TorchInstance(TorchOps):
    @staticmethod
    def where(condition: torch.Tensor, x: torch.Tensor | float, y: torch.Tensor | float,
              /) -> torch.Tensor: ...


class _JaxInstance(JaxOps):
    @staticmethod
    def where(condition: jax.Array, x: jax.Array | float, y: jax.Array | float,
              /) -> jax.Array: ...


torch_class: Ops[torch.Tensor] = TorchOps
jax_class: Ops[jax.Array] = JaxOps
torch_instance: Ops[torch.Tensor] = _TorchInstance()
jax_instance: Ops[jax.Array] = _JaxInstance()
control: Ops[torch.Tensor] = object()
'''


def basedpyright_errors(tmp_path, name, text) -> list[tuple[int, str]]:
    """(0-based line, message) of every error basedpyright reports in ``text``, checked as
    the file ``name`` against the installed package; skips where basedpyright is missing."""
    exe = shutil.which("basedpyright")
    if exe is None:
        pytest.skip("basedpyright is not installed (pip install -e '.[test]')")
    snippet = tmp_path / name
    snippet.write_text(text, encoding="utf-8")
    run = subprocess.run([exe, "--outputjson", str(snippet)], capture_output=True, text=True,
                         timeout=120, cwd=str(REPO))
    try:
        diagnostics = json.loads(run.stdout)["generalDiagnostics"]
    except (ValueError, KeyError):
        pytest.fail(f"{exe} gave no report:\n{run.stdout[-2000:]}\n{run.stderr[-2000:]}")
    return [(d["range"]["start"]["line"], d["message"]) for d in diagnostics
            if d["severity"] == "error"]


def test_a_type_checker_accepts_both_adapters(tmp_path):
    """basedpyright (where installed) accepts TorchOps as ``Ops[torch.Tensor]`` and JaxOps as
    ``Ops[jax.Array]``: as the class (how shared code receives it) or, while the adapters do
    not declare their class attributes ``ClassVar``, as an instance (see ``SNIPPET``); and
    rejects an object that is no adapter (the check is a real one)."""
    found = basedpyright_errors(tmp_path, "ops_conformance.py", SNIPPET)
    lines = SNIPPET.splitlines()
    line_of = {line.split(":")[0]: i for i, line in enumerate(lines)
               if line.split(":")[0] in ("torch_class", "jax_class", "torch_instance",
                                         "jax_instance", "control")}
    errors: dict[int, list[str]] = {}
    for line, message in found:
        errors.setdefault(line, []).append(message)
    assert errors.pop(line_of["control"], None), (
        "basedpyright accepted object() as Ops[torch.Tensor]: the check checks nothing")
    problems = []
    for adapter, prefix, array in ((TorchOps, "torch", "torch.Tensor"),
                                   (JaxOps, "jax", "jax.Array")):
        as_class = errors.pop(line_of[f"{prefix}_class"], [])
        as_instance = errors.pop(line_of[f"{prefix}_instance"], [])
        if as_class and as_instance:
            problems.append(
                f"{adapter.__name__} is not an Ops[{array}] to basedpyright; as an instance:\n"
                + "\n".join(as_instance) + "\nas the class:\n" + "\n".join(as_class))
    problems += [f"snippet line {i + 1} ({lines[i].strip()}): {m}"
                 for i, ms in sorted(errors.items()) for m in ms]
    assert not problems, "\n\n".join(problems)


# -- the binding: one object per framework ---------------------------------------------------

def test_each_front_end_runs_on_one_binding():
    """Every shared object of a front end (the token-statistics shell, the objectives, the
    sampler and the step functions) holds that framework's one ``Framework`` binding, and
    the binding's members are that framework's: nothing is wired twice."""
    import dlm_kernels.jax as J
    import dlm_kernels.torch as T
    from dlm_kernels._dispatch import SAMPLING, TOKEN_STATS, registry
    from dlm_kernels._jax.framework import JAX
    from dlm_kernels._torch.framework import TORCH

    for front, binding, adapter, name in ((T, TORCH, TorchOps, "torch"),
                                          (J, JAX, JaxOps, "jax")):
        assert binding.name == name and binding.xp is adapter
        assert binding.token_stats is registry(TOKEN_STATS, name)
        assert binding.sampling is registry(SAMPLING, name)
        shell = front._FRONT
        assert shell.framework is binding and shell.xp is adapter
        assert shell.registry is binding.token_stats and shell.vjp is binding.vjp
        assert front._OBJECTIVES.front is shell and front._OBJECTIVES.xp is adapter
        assert front._SAMPLER.framework is binding and front._SAMPLER.registry is binding.sampling
        assert front._STEP.sampler is front._SAMPLER


BINDING_SNIPPET = '''
import jax
import torch

from dlm_kernels._dispatch import SAMPLING, TOKEN_STATS, registry
from dlm_kernels._framework import Framework
from dlm_kernels._jax.framework import JAX
from dlm_kernels._jax.ops import JaxOps
from dlm_kernels._torch.framework import TORCH
from dlm_kernels.token_stats.torch_vjp import TorchVJP

torch_binding: Framework[torch.Tensor] = TORCH
jax_binding: Framework[jax.Array] = JAX
control_xp: Framework[torch.Tensor] = Framework(
    name="torch", xp=JaxOps, vjp=TorchVJP(), token_stats=registry(TOKEN_STATS, "torch"),
    sampling=registry(SAMPLING, "torch"))
control_vjp: Framework[jax.Array] = Framework(
    name="jax", xp=JaxOps, vjp=object(), token_stats=registry(TOKEN_STATS, "jax"),
    sampling=registry(SAMPLING, "jax"))
'''


def test_a_type_checker_accepts_both_bindings(tmp_path):
    """basedpyright (where installed) accepts ``TORCH`` as ``Framework[torch.Tensor]`` and
    ``JAX`` as ``Framework[jax.Array]`` (their adapters ``Ops`` of that array type, their VJP
    adapters ``VjpAdapter``s), and rejects a binding with the other framework's adapter or
    with no VJP adapter (the check is a real one)."""
    found = basedpyright_errors(tmp_path, "binding_conformance.py", BINDING_SNIPPET)
    lines = BINDING_SNIPPET.splitlines()
    first = {line.split(":")[0]: i for i, line in enumerate(lines) if ": Framework[" in line}
    errors: dict[str, list[str]] = {}
    for line, message in found:
        owner = max((i, name) for name, i in first.items() if i <= line)[1]
        errors.setdefault(owner, []).append(message)
    assert errors.pop("control_xp", None), "basedpyright took JaxOps for torch: checks nothing"
    assert errors.pop("control_vjp", None), "basedpyright took object() as a VJP adapter"
    assert not errors, "\n".join(f"{k}: {m}" for k, ms in errors.items() for m in ms)
