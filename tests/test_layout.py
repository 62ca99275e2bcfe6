"""The suite's layout: no test file imports another test file (shared suites and input
builders live in non-test modules: ``token_stats/suite.py``, ``objectives/suite.py``, ...),
and pytest's conftest parametrises nothing behind a reader's back."""

from __future__ import annotations

import ast
import pathlib

TESTS = pathlib.Path(__file__).parent


def names_of_test_modules(path: pathlib.Path) -> set[str]:
    """The dotted names of the test modules under ``path`` (``token_stats.test_triton``,
    ``test_contract``), as pytest imports them with the folders' ``__init__.py``."""
    return {".".join(p.relative_to(path).with_suffix("").parts) for p in path.rglob("test_*.py")}


def imported_modules(path: pathlib.Path, root: pathlib.Path = TESTS) -> set[str]:
    """Every module a file imports, anywhere in it (function bodies too), relative imports
    resolved against the file's folder under ``root``."""
    package = path.parent.relative_to(root).parts
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] if node.level else ()
            module = ".".join((*base, node.module) if node.module else base)
            names.add(module)
            names.update(f"{module}.{alias.name}" for alias in node.names)  # from . import test_x
    return names


def test_no_test_file_imports_another():
    tests = names_of_test_modules(TESTS)
    found = {f"{path.relative_to(TESTS)} imports {name}"
             for path in TESTS.rglob("*.py")
             for name in imported_modules(path) & tests}
    assert not found, "shared code belongs in a non-test module: " + "; ".join(sorted(found))


def test_the_checker_sees_every_import_form(tmp_path):
    """The check above reads absolute, relative and function-level imports."""
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "test_a.py").write_text(
        "from .test_b import X\n\ndef f():\n    import test_c\n    from pkg import test_b\n")
    assert names_of_test_modules(tmp_path) == {"pkg.test_a"}
    names = imported_modules(tmp_path / "pkg" / "test_a.py", root=tmp_path)
    assert {"pkg.test_b", "test_c"} <= names


def test_conftest_parametrises_nothing():
    """Cases are named where a reader sees them (``harness.cases`` in a suite class, or
    ``pytest.mark.parametrize``), not derived from attribute names by a hook."""
    tree = ast.parse((TESTS / "conftest.py").read_text())
    hooks = [n.name for n in tree.body if isinstance(n, ast.FunctionDef)
             and n.name == "pytest_generate_tests"]
    assert not hooks, "conftest.py parametrises tests: name the cases in the test's class"


def test_torch_configuration_comes_back_after_a_deleting_undo():
    """What pytest 9.2's monkeypatch did to ``torch._dynamo.config``: its undo deleted
    ``recompile_limit``, torch hid the entry, and every later ``torch.compile`` in that worker
    failed. The restore every test runs under (conftest's ``_torch_configs_restored``) brings
    a deleted or changed entry back, so no test can leave that state behind."""
    import torch
    import torch._dynamo.config as dynamo_config

    from harness import torch_configs_restored

    limit = dynamo_config.recompile_limit
    with torch_configs_restored(("torch._dynamo.config",)):
        dynamo_config.recompile_limit = limit + 5
        delattr(dynamo_config, "recompile_limit")
    assert dynamo_config.recompile_limit == limit
    assert torch.compile(lambda x: x + 1, backend="eager")(torch.ones(2)).tolist() == [2.0, 2.0]


def test_no_test_monkeypatches_a_torch_configuration():
    """Tests change torch's configuration modules through conftest's ``torch_config`` (torch's
    own ``config.patch``), never ``monkeypatch.setattr``, whose undo deletes the entry."""
    found = []
    for path in TESTS.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr == "setattr" and node.args
                    and ast.unparse(node.args[0]).startswith("torch.")
                    and ast.unparse(node.args[0]).endswith(".config")):
                found.append(f"{path.relative_to(TESTS)}:{node.lineno}")
    assert not found, "use the torch_config fixture: " + ", ".join(found)
