"""The public API as a reader and a type checker see it: both front ends declare the same
names with the same signatures, nothing internal is exported, and a type checker resolves
every public name to a concrete signature (pyright's type completeness)."""

from __future__ import annotations

import dataclasses
import inspect
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import types

import pytest

import dlm_kernels.jax as dj
import dlm_kernels.torch as dk

#: the one intended difference: the vocabulary-parallel keyword names each framework's notion
SHARD_KEYWORDS = {"process_group": "vocab_axis"}
#: names a front end module may hold beside __all__: typing helpers and imported modules
TYPING_HELPERS = {"annotations", "Any", "Callable", "Sequence", "AbstractContextManager",
                  "Logits", "VocabAxis"}


def _shape(sig: inspect.Signature) -> list[tuple[str, object, object]]:
    """(name, kind, default) per parameter, the torch shard keyword renamed as JAX's."""
    return [(SHARD_KEYWORDS.get(p.name, p.name), p.kind, p.default)
            for p in sig.parameters.values()]


def test_both_front_ends_export_the_same_names():
    assert list(dk.__all__) == list(dj.__all__)
    for api in (dk, dj):
        for name in api.__all__:
            value = getattr(api, name)
            if callable(value):
                assert value.__name__ == name, (api.__name__, name, value)


@pytest.mark.parametrize("name", dk.__all__)
def test_public_signatures_are_identical(name):
    """Every function, and every method of every class, takes the same parameters in the
    same order with the same kinds and defaults in both front ends."""
    t, j = getattr(dk, name), getattr(dj, name)
    if isinstance(t, types.FunctionType):
        assert _shape(inspect.signature(t)) == _shape(inspect.signature(j)), name
        assert t.__doc__ and j.__doc__, name
    elif isinstance(t, type):
        assert t.__doc__ and j.__doc__, name
        if dataclasses.is_dataclass(t):
            assert [f.name for f in dataclasses.fields(t)] == \
                [f.name for f in dataclasses.fields(j)], name
        own = lambda cls: {m for m, v in vars(cls).items()  # tree_*: JAX's pytree protocol
                           if not m.startswith(("_", "tree_")) and callable(v)}
        methods = own(t)
        assert methods == own(j), name
        for m in methods:
            assert (_shape(inspect.signature(getattr(t, m)))
                    == _shape(inspect.signature(getattr(j, m)))), (name, m)
    else:
        assert t == j, name  # constants


@pytest.mark.parametrize("api", [dk, dj], ids=["torch", "jax"])
def test_internals_stay_out_of_the_public_namespace(api):
    """What is not in __all__ is private (a leading underscore), an imported module, or a
    typing helper of the annotations: no ops adapter, Objectives, REGISTRY or factory."""
    stray = sorted(n for n, v in vars(api).items()
                   if not n.startswith("_") and n not in api.__all__
                   and not isinstance(v, types.ModuleType) and n not in TYPING_HELPERS)
    assert stray == []
    for internal in ("REGISTRY", "Objectives", "TorchOps", "JaxOps", "make_contract"):
        assert not hasattr(api, internal), internal


def _type_checker():
    for exe in ("basedpyright", "pyright"):
        path = shutil.which(exe) or shutil.which(exe, path=os.path.dirname(sys.executable))
        if path:
            return path
    return None


@pytest.mark.parametrize("module", ["dlm_kernels.torch", "dlm_kernels.jax"])
def test_a_type_checker_sees_every_public_name(module, tmp_path):
    """pyright --verifytypes: type completeness of at least 95 % (the installed package, as
    the README installs it), and every name in __all__ of a known type: a concrete
    signature, never Any or Unknown."""
    exe = _type_checker()
    if exe is None:
        pytest.skip("neither basedpyright nor pyright is installed (pip install -e '.[test]')")
    run = subprocess.run([exe, "--verifytypes", module, "--ignoreexternal", "--outputjson"],
                         capture_output=True, text=True, timeout=300, cwd=str(tmp_path))
    try:
        report = json.loads(run.stdout)["typeCompleteness"]
    except (ValueError, KeyError):
        pytest.fail(f"{exe} gave no report:\n{run.stdout[-2000:]}\n{run.stderr[-2000:]}")
    assert report["packageRootDirectory"].endswith("dlm_kernels"), report["packageRootDirectory"]
    score = report["completenessScore"]
    unknown = [s["name"] for s in report["symbols"]
               if s["isExported"] and not s["isTypeKnown"]]
    assert score >= 0.95 and not unknown, (score, unknown)
    public = {f"{module}.{n}" for n in __import__(module, fromlist=["_"]).__all__}
    seen = {s["name"] for s in report["symbols"] if s["name"] in public}
    assert seen == public, public - seen


#: a test of the kind of a logits argument: ``grep -rn "is_head\|isinstance(.*LinearHead"``,
#: the same test spelled with the protocol's classes, and a read of the protocol's kind flag
#: ``.materialized`` (``head_plan`` turns the kinds into schedule choices once; its
#: ``HeadPlan`` fields are those choices, not kinds)
KIND_TEST = re.compile(r"is_head|isinstance\(.*(LinearHead|LogitsSource|DenseLogits)"
                       r"|\.materialized\b")


def test_the_kind_of_logits_is_decided_in_few_places():
    """Objectives and checks read the ``LogitsSource`` protocol; an array or a LinearHead is
    told apart where an op is entered (``linear_head.head.as_logits``), never in their bodies:
    at most 5 such tests under python/, in at most 2 files (symbolic links not followed, as
    ``grep -r`` does not)."""
    root = pathlib.Path(__file__).resolve().parents[1] / "python"
    hits = {}
    for folder, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if not os.path.islink(os.path.join(folder, d))]
        for name in files:
            path = pathlib.Path(folder, name)
            if path.is_symlink() or path.suffix != ".py":
                continue
            lines = [f"{i}: {line.strip()}"
                     for i, line in enumerate(path.read_text().splitlines(), 1)
                     if KIND_TEST.search(line) and not line.lstrip().startswith("def is_head")]
            if lines:
                hits[str(path.relative_to(root))] = lines
    count = sum(len(lines) for lines in hits.values())
    assert count <= 5 and len(hits) <= 2, f"{count} tests of the kind of logits: {hits}"
