"""The package's internal host layer type-checks: basedpyright, where installed,
reports no error in the framework-neutral code (the objectives, the checks, the
configuration, the dispatch, the ops protocol and its two adapters, the token-statistics op
with its lowering, math and VJPs, the sampler, the linear head) nor in the two front ends,
under its default rules, as tests/test_ops_protocol.py runs it. The token-statistics
``State`` and ``Stats`` are spelled out for the checker beside their run-time definitions
from the kernels' buffer layout: the two name the same fields."""

from __future__ import annotations

import ast
import json
import pathlib
import shutil
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = REPO / "python" / "dlm_kernels"

#: the internals checked, as paths under the package
FILES = (
    "_objectives.py",
    "_policy.py",
    "_contract.py",
    "_checks.py",
    "_guards.py",
    "_config.py",
    "_dispatch.py",
    "_ops.py",
    "_framework.py",
    "_torch/ops.py",
    "_torch/framework.py",
    "_jax/ops.py",
    "_jax/framework.py",
    "token_stats/__init__.py",
    "token_stats/op.py",
    "token_stats/lowering.py",
    "token_stats/formulas.py",
    "token_stats/torch_vjp.py",
    "token_stats/jax_vjp.py",
    "sampling/core.py",
    "sampling/upstream.py",
    "linear_head/head.py",
    "torch/__init__.py",
    "jax/__init__.py",
)


def test_the_internals_type_check():
    """basedpyright reports no error in ``FILES`` (warnings aside), their imports resolved in
    this interpreter's environment; each error is listed when there are any."""
    exe = shutil.which("basedpyright")
    if exe is None:
        pytest.skip("basedpyright is not installed (pip install -e '.[test]')")
    pytest.importorskip("torch")  # the front ends' and adapters' imports must resolve
    pytest.importorskip("jax")
    paths = [PACKAGE / f for f in FILES]
    assert all(p.is_file() for p in paths), [str(p) for p in paths if not p.is_file()]
    run = subprocess.run([exe, "--outputjson", "--pythonpath", sys.executable,
                          *map(str, paths)],
                         capture_output=True, text=True, timeout=300, cwd=str(REPO))
    try:
        report = json.loads(run.stdout)
        diagnostics = report["generalDiagnostics"]
    except (ValueError, KeyError):
        pytest.fail(f"{exe} gave no report:\n{run.stdout[-2000:]}\n{run.stderr[-2000:]}")
    assert report["summary"]["filesAnalyzed"] >= len(FILES), report["summary"]
    errors = []
    for d in diagnostics:
        if d["severity"] == "error":
            where = pathlib.Path(d["file"]).resolve()
            where = where.relative_to(PACKAGE) if where.is_relative_to(PACKAGE) else where
            line = d["range"]["start"]["line"] + 1 if "range" in d else 0
            errors.append(f"{where}:{line}: [{d.get('rule', '')}] {d['message']}")
    assert not errors, f"{len(errors)} basedpyright errors:\n" + "\n".join(errors)


def _checker_fields(path: pathlib.Path) -> dict[str, tuple[str, ...]]:
    """{class name: its annotated fields} of the classes a module defines under
    ``if TYPE_CHECKING:``."""
    fields = {}
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if (isinstance(node, ast.If) and isinstance(node.test, ast.Name)
                and node.test.id == "TYPE_CHECKING"):
            for cls in node.body:
                if isinstance(cls, ast.ClassDef):
                    fields[cls.name] = tuple(
                        s.target.id for s in cls.body
                        if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name))
    return fields


def test_the_checker_reads_the_kernels_layout():
    """``formulas.State`` / ``Stats`` as the checker reads them (classes under
    TYPE_CHECKING) have the fields, in order, of the run-time tuples, which the kernels'
    buffer layout names (``kernels.layout.PARTIAL_STATE`` / ``ROW_STATS``)."""
    from dlm_kernels.kernels.layout import PARTIAL_STATE, ROW_STATS
    from dlm_kernels.token_stats import formulas

    seen = _checker_fields(PACKAGE / "token_stats" / "formulas.py")
    assert seen.get("State") == formulas.State._fields == PARTIAL_STATE, seen
    assert seen.get("Stats") == formulas.Stats._fields == ROW_STATS, seen
