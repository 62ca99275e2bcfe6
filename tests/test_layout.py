"""The layout of the suite and of the package: no test file imports another test file
(shared suites and input builders live in non-test modules: ``token_stats/suite.py``,
``objectives/suite.py``, ...), pytest's conftest parametrises nothing behind a reader's back,
every ``dlm_kernels.<name>`` the comments, docstrings and documents cite exists, and the
package's imports form no cycle."""

from __future__ import annotations

import ast
import importlib
import io
import pathlib
import re
import tokenize

import pytest

TESTS = pathlib.Path(__file__).parent
ROOT = TESTS.parent


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


# -- names the text cites ------------------------------------------------------------------

#: where comments, docstrings and documents cite the package's names
TEXT_ROOTS = ("python", "kernels", "bench", "docs", "examples", "README.md")
#: a dotted name of the package (not ``torch.ops.dlm_kernels.<op>``, a custom op's namespace)
DOTTED = re.compile(r"(?<![\w.])dlm_kernels(?:\.[A-Za-z_]\w*)+")
#: the optional frameworks: a name whose module needs a missing one is not checked here
FRAMEWORKS = {"torch", "jax", "jaxlib", "triton", "jax_triton"}


def text_files(root: pathlib.Path = ROOT) -> list[pathlib.Path]:
    """The .py and .md files under ``TEXT_ROOTS``, each once (not again through the links
    ``python/dlm_kernels/kernels`` and ``python/dlm_kernels/bench``)."""
    found = []
    for name in TEXT_ROOTS:
        top = root / name
        paths = [top] if top.is_file() else sorted(top.rglob("*"))
        found += [p for p in paths if p.suffix in (".py", ".md") and p.is_file()
                  and not any(q.is_symlink() for q in p.relative_to(root).parents
                              if str(q) != "." and (root / q).is_symlink())]
    return found


def prose_of_python(source: str) -> list[tuple[int, str]]:
    """(line, text) of every comment and every string that stands as a statement (docstrings,
    attribute docstrings) of a Python source: what a reader reads, not what the code runs."""
    out = [(tok.start[0], tok.string)
           for tok in tokenize.generate_tokens(io.StringIO(source).readline)
           if tok.type == tokenize.COMMENT]
    for node in ast.walk(ast.parse(source)):
        if (isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
                and isinstance(node.value.value, str)):
            out.append((node.lineno, node.value.value))
    return out


def cited_names(path: pathlib.Path) -> list[tuple[int, str]]:
    """(line, name) of every ``dlm_kernels.<dotted>`` name in a file's prose (a Python
    file's comments and docstrings, a Markdown file's whole text)."""
    text = path.read_text()
    parts = prose_of_python(text) if path.suffix == ".py" else [(1, text)]
    return [(line + part[:m.start()].count("\n"), m.group())
            for line, part in parts for m in DOTTED.finditer(part)]


def resolve(name: str) -> str | None:
    """None where ``name`` is a module of the package or an attribute of one (the longest
    prefix that is a module imported, the rest read with getattr), else what is missing;
    "skip" where the module needs a framework that is not installed."""
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        module_name = ".".join(parts[:cut])
        try:
            value = importlib.import_module(module_name)
        except ModuleNotFoundError as err:
            missing = err.name or ""
            if module_name == missing or module_name.startswith(missing + "."):
                continue  # not a module: a shorter prefix is, and the rest are attributes
            if missing.split(".")[0] in FRAMEWORKS:
                return "skip"
            raise
        for i, attr in enumerate(parts[cut:], cut):
            if not hasattr(value, attr):
                return f"{'.'.join(parts[:i])} has no {attr!r}"
            value = getattr(value, attr)
        return None
    return f"no module {parts[0]!r}"


def test_cited_names_exist():
    """Every ``dlm_kernels.<dotted>`` name in the comments, docstrings and documents is a
    module of the package or an attribute of one: a module moved or renamed takes its
    citations with it."""
    bad = []
    for path in text_files():
        for line, name in cited_names(path):
            why = resolve(name)
            if why not in (None, "skip"):
                bad.append(f"{path.relative_to(ROOT)}:{line}: {name} ({why})")
    assert not bad, "names the text cites that do not exist:\n" + "\n".join(bad)


def test_the_citation_reader_reads_prose_only(tmp_path):
    """Comments and docstrings are read, code is not: a custom op's namespace
    (``torch.ops.dlm_kernels.x``) and a string the code uses are not citations."""
    source = ('"""See dlm_kernels.a.b."""\n'
              "x = torch.ops.dlm_kernels.op(1)  # dlm_kernels.c\n"
              "y = 'dlm_kernels.not_prose'\n"
              "def f():\n    \"\"\"Uses\n    dlm_kernels.d.e (x).\"\"\"\n")
    (tmp_path / "m.py").write_text(source)
    (tmp_path / "m.md").write_text("text\n`dlm_kernels.f` and torch.ops.dlm_kernels.g.\n")
    assert cited_names(tmp_path / "m.py") == [(2, "dlm_kernels.c"), (1, "dlm_kernels.a.b"),
                                              (6, "dlm_kernels.d.e")]
    assert cited_names(tmp_path / "m.md") == [(2, "dlm_kernels.f")]
    assert resolve("dlm_kernels.testing.TOLERANCES") is None
    assert resolve("dlm_kernels.kernels.layout.ROW_STATS") is None
    assert resolve("dlm_kernels.testing.NO_SUCH") == "dlm_kernels.testing has no 'NO_SUCH'"
    assert resolve("dlm_kernels._no_such_module.x") == "dlm_kernels has no '_no_such_module'"


# -- the package's imports ------------------------------------------------------------------

#: the package's source trees by dotted prefix: kernels/ and bench/ join it through the
#: links python/dlm_kernels/kernels and python/dlm_kernels/bench (also importable as the
#: top-level ``kernels`` and ``bench`` from the repository root)
TREES = {"dlm_kernels": "python/dlm_kernels", "dlm_kernels.kernels": "kernels",
         "dlm_kernels.bench": "bench"}


def package_modules(root: pathlib.Path = ROOT, trees: dict[str, str] = TREES
                    ) -> dict[str, pathlib.Path]:
    """{dotted name: file} of every module of the package (a folder's ``__init__.py`` under
    the folder's name), each once."""
    modules = {}
    for prefix, folder in trees.items():
        top = root / folder
        for path in sorted(top.rglob("*.py")):
            parts = path.relative_to(top).with_suffix("").parts
            if any((top / pathlib.Path(*parts[:i])).is_symlink() for i in range(1, len(parts))):
                continue  # a link to another tree, listed under its own prefix
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join((prefix, *parts))] = path
    return modules


def _imports(tree: ast.AST):
    """(node, in_function) of every import statement, those under ``if TYPE_CHECKING:`` left
    out (they never run)."""
    def visit(node, in_function):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                children = child.orelse
            else:
                children = [child]
            for c in children:
                if isinstance(c, (ast.Import, ast.ImportFrom)):
                    yield c, in_function
                yield from visit(c, in_function or isinstance(
                    c, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))
    yield from visit(tree, False)


def imported_from(node: ast.ImportFrom, package: str) -> str:
    """The dotted module a ``from ... import`` of a module in ``package`` names, relative
    levels resolved."""
    base = node.module or ""
    if not node.level:
        return base
    parts = package.split(".")
    return ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))


def import_graph(modules: dict[str, pathlib.Path], top: str = "dlm_kernels"):
    """({module: modules it imports}, [(module, line, imported module)] of the imports made
    inside a function) over the package's own modules. ``from a import b`` imports ``a.b``
    where that is a module, else ``a``; ``kernels.x`` and ``bench.x`` are the package's
    ``dlm_kernels.kernels.x`` and ``dlm_kernels.bench.x``. Importing ``a.b.c`` runs the
    ``__init__`` of ``a`` and ``a.b`` too, so each is an edge unless it encloses the
    importer (a package is being imported already when one of its modules runs)."""
    aliases = {prefix.rpartition(".")[2]: prefix for prefix in TREES if prefix != top}

    def owner(name):  # the longest prefix of ``name`` that is a module of the package
        first, _, rest = name.partition(".")
        if first in aliases:
            name = aliases[first] + ("." + rest if rest else "")
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name

    edges = {name: set() for name in modules}
    inside = []
    for module, path in modules.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        for node, in_function in _imports(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            else:
                base = imported_from(node, package)
                names = [f"{base}.{alias.name}" if owner(f"{base}.{alias.name}")
                         == f"{base}.{alias.name}" else base for alias in node.names]
            for target in {owner(n) for n in names if n.split(".")[0] in (top, *aliases)}:
                if not target:
                    continue
                if in_function:
                    inside.append((module, node.lineno, target))
                chain = [target]
                while "." in chain[-1]:
                    chain.append(chain[-1].rpartition(".")[0])
                edges[module].update(t for t in chain if t in modules and t != module
                                     and not module.startswith(t + "."))
    return edges, inside


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The import cycles: every strongly connected component of more than one module
    (Tarjan's algorithm, iterative), each sorted, the list sorted."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []
    for start in sorted(edges):
        if start in index:
            continue
        work = [(start, iter(sorted(edges[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, successors = work[-1]
            for nxt in successors:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(edges[nxt]))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return sorted(found)


#: the import cycles left: none (there were 5: _checks / _config / linear_head.head;
#: each framework's ops adapter, linear head path and token-statistics VJP; bench's cases /
#: memory and runner / linear_head / sampling)
MAX_CYCLES = 0
#: the front ends: a module that serves both frameworks imports one inside the function that
#: needs it, so that the other framework need not be installed (the package root's
#: backend_for, the benchmark's cases); those imports are listed, not counted
FRONT_ENDS = ("dlm_kernels.torch", "dlm_kernels.jax")
#: the other imports of the package's own modules made inside a function (10), each of a
#: module that needs an optional framework, imported only where that framework is used: the
#: package root imports the head module only when backend_for is called (``import
#: dlm_kernels`` stays light), ``dlm_kernels.testing`` a framework's plumbing only when its
#: helper is asked for (2), and the benchmark the torch DiffusionGemma integration, the
#: Triton kernels and launchers (6) and each framework's binding (2) only for the cases that
#: run. The number can only go down.
MAX_IN_FUNCTION_IMPORTS = 10


def test_no_import_cycles():
    """No module of the package imports, directly or through others (function bodies
    included), a module that imports it back: the layers of docs/design.md §6 hold."""
    found = cycles(import_graph(package_modules())[0])
    assert len(found) <= MAX_CYCLES, "import cycles (each a set of modules that import each\n" \
        "other, directly or not):\n" + "\n".join(", ".join(c) for c in found)


def test_in_function_imports_only_go_down():
    """An import inside a function hides an edge of the graph from a reader (it is counted
    in the cycles above all the same); the ones left are listed by kind above."""
    _, inside = import_graph(package_modules())
    counted = [(m, line, t) for m, line, t in inside if t not in FRONT_ENDS]
    listing = "\n".join(f"{m}:{line} imports {t}" for m, line, t in counted)
    assert len(counted) <= MAX_IN_FUNCTION_IMPORTS, (
        f"{len(counted)} in-function imports (besides the front ends'):\n{listing}")


#: the package's layers, bottom first (docs/design.md §6): a module belongs to the layer of
#: the longest name listed that is it or encloses it. Imports go down or stay level.
LAYERS = (
    ("kernels", ("dlm_kernels.kernels",)),
    ("definitions", ("dlm_kernels._checks", "dlm_kernels._config", "dlm_kernels._env",
                     "dlm_kernels._ops", "dlm_kernels._rows", "dlm_kernels._schedule",
                     "dlm_kernels._guards", "dlm_kernels._framework", "dlm_kernels._dispatch",
                     "dlm_kernels._docstrings", "dlm_kernels.token_stats.formulas",
                     "dlm_kernels.token_stats.lowering", "dlm_kernels.linear_head.head")),
    ("framework plumbing", ("dlm_kernels._torch", "dlm_kernels._jax")),
    ("ops", ("dlm_kernels.token_stats", "dlm_kernels.linear_head", "dlm_kernels.sampling")),
    ("bindings", ("dlm_kernels._torch.framework", "dlm_kernels._jax.framework")),
    ("objectives", ("dlm_kernels._objectives", "dlm_kernels._policy", "dlm_kernels._contract",
                    "dlm_kernels.sampling.upstream")),
    ("front ends", ("dlm_kernels.torch", "dlm_kernels.jax", "dlm_kernels.testing")),
    ("root", ("dlm_kernels",)),
    ("benchmark", ("dlm_kernels.bench",)),
)
#: arrows back up the layers: none
MAX_ARROWS_UP = 0


def layer_of(module: str, layers=LAYERS) -> int:
    best = max(((len(name), i) for i, (_, names) in enumerate(layers) for name in names
                if module == name or module.startswith(name + ".")), default=None)
    assert best is not None, f"{module} is in no layer of LAYERS"
    return best[1]


def arrows_up(edges: dict[str, set[str]], modules: dict[str, pathlib.Path],
              layers=LAYERS) -> list[str]:
    """The imports that go up the layers. An edge to a package whose ``__init__`` imports
    nothing is not one: importing ``a.b.c`` runs ``a.b``'s empty ``__init__``, a namespace of
    no layer."""
    def empty(module):
        path = modules[module]
        return path.name == "__init__.py" and not any(_imports(ast.parse(path.read_text())))

    return sorted(f"{a} ({layers[layer_of(a, layers)][0]}) imports {b} "
                  f"({layers[layer_of(b, layers)][0]})"
                  for a, targets in edges.items() for b in targets
                  if not empty(b) and layer_of(b, layers) > layer_of(a, layers))


def test_imports_go_down_the_layers():
    """Every module's imports (function bodies included) go down ``LAYERS`` or stay level:
    from the front ends through the objectives, the frameworks' bindings, the ops and the
    frameworks' plumbing to the definitions every layer shares and the kernels."""
    modules = package_modules()
    edges, _ = import_graph(modules)
    found = arrows_up(edges, modules)
    assert len(found) <= MAX_ARROWS_UP, "imports back up the layers:\n" + "\n".join(found)


def test_the_layer_check_finds_an_arrow_up(tmp_path):
    """A module importing one of a higher layer is found; one importing a module of its own
    or a lower layer, or a package whose ``__init__`` is empty, is not."""
    pkg = tmp_path / "p"
    (pkg / "ops").mkdir(parents=True)
    files = {"__init__.py": "", "ops/__init__.py": "", "ops/a.py": "from ..front import f\n",
             "ops/b.py": "from . import a\nfrom .. import low\n", "low.py": "import p.ops\n",
             "front.py": "from .ops import b\n"}
    for name, text in files.items():
        (pkg / name).write_text(text)
    layers = (("low", ("p.low",)), ("ops", ("p.ops",)), ("front", ("p.front", "p")))
    modules = package_modules(tmp_path, {"p": "p"})
    edges, _ = import_graph(modules, top="p")
    assert arrows_up(edges, modules, layers) == ["p.ops.a (ops) imports p.front (front)"]


def private_imports(modules: dict[str, pathlib.Path]) -> list[str]:
    """``from M import _name`` where M lies outside the importer's own folder (a private
    name is its module's folder's business; shared plumbing exports public names)."""
    found = []
    for module, path in modules.items():
        if module.startswith(("dlm_kernels.bench", "dlm_kernels.kernels")):
            continue
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        for node, _ in _imports(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.ImportFrom):
                continue
            base = imported_from(node, package)
            folder = base if base in modules and modules[base].name == "__init__.py" \
                else base.rpartition(".")[0]
            private = [a.name for a in node.names  # a module of the package is no name
                       if a.name.startswith("_") and not a.name.startswith("__")
                       and f"{base}.{a.name}" not in modules]
            if private and base.startswith("dlm_kernels") and folder != package:
                found.append(f"{module} imports {', '.join(private)} from {base}")
    return sorted(found)


def test_no_private_name_crosses_a_folder():
    """No module takes a private name from a module of another folder (an op's, or the
    frameworks' plumbing): what two folders share is public in the one that holds it."""
    found = private_imports(package_modules())
    assert not found, "private names imported across folders:\n" + "\n".join(found)


def test_the_import_graph_sees_every_form(tmp_path):
    """Absolute, relative, from-package and in-function imports; a package's ``__init__``
    imported on the way; TYPE_CHECKING imports left out; a cycle through a function found."""
    pkg = tmp_path / "p"
    (pkg / "sub").mkdir(parents=True)
    files = {"__init__.py": "",
             "a.py": "from . import b\nfrom typing import TYPE_CHECKING\n"
                     "if TYPE_CHECKING:\n    from .c import X\n",
             "b.py": "def f():\n    from .sub.d import Y\n",
             "c.py": "import p.sub\n",
             "sub/__init__.py": "from .d import Y\n",
             "sub/d.py": "from ..a import Z\n"}
    for name, text in files.items():
        (pkg / name).write_text(text)
    modules = package_modules(tmp_path, {"p": "p"})
    edges, inside = import_graph(modules, top="p")
    assert edges["p.a"] == {"p.b"}
    assert edges["p.b"] == {"p.sub.d", "p.sub"}
    assert edges["p.c"] == {"p.sub"}
    assert edges["p.sub"] == {"p.sub.d"}  # its own module; p.sub encloses it: no edge back
    assert edges["p.sub.d"] == {"p.a"}
    assert inside == [("p.b", 2, "p.sub.d")]
    assert cycles(edges) == [["p.a", "p.b", "p.sub", "p.sub.d"]]


# -- the call path from a public function to its op ------------------------------------------

class CallWalker:
    """What a reader (or a static tool) can follow from a function without running it: calls
    of functions and classes by name (imports resolved), ``NAME.method(...)`` where the
    module-level NAME is ``Class(...)`` or a module, ``self.method(...)``, and
    ``self.attr.method(...)`` where ``__init__`` sets ``self.attr`` from a parameter annotated
    with a class. A callable passed in as a plain value is where sight is lost."""

    def __init__(self, modules: dict[str, pathlib.Path]):
        self.modules = modules
        self.trees = {name: ast.parse(path.read_text(), str(path))
                      for name, path in modules.items()}

    def _package(self, module: str) -> str:
        return module if self.modules[module].name == "__init__.py" \
            else module.rpartition(".")[0]

    def lookup(self, module: str, name: str):
        """('def', module, node) / ('class', module, node) / ('module', dotted, None) /
        ('instance', module, class node) for a name bound at the top of ``module``."""
        for node in self.trees[module].body:
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.name == name:
                return ("class" if isinstance(node, ast.ClassDef) else "def", module, node)
            if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name
                                                     for t in node.targets):
                if isinstance(node.value, ast.Call) and isinstance(node.value.func, ast.Name):
                    found = self.lookup(module, node.value.func.id)
                    if found and found[0] == "class":
                        return ("instance", found[1], found[2])
            if isinstance(node, ast.ImportFrom):
                for alias in node.names:
                    if (alias.asname or alias.name) != name:
                        continue
                    base = node.module or ""
                    if node.level:
                        parts = self._package(module).split(".")
                        parts = parts[:len(parts) - node.level + 1]
                        base = ".".join(parts + ([base] if base else []))
                    if f"{base}.{alias.name}" in self.modules:
                        return ("module", f"{base}.{alias.name}", None)
                    if base in self.modules:
                        return self.lookup(base, alias.name)
        return None

    @staticmethod
    def method(cls: ast.ClassDef, name: str):
        return next((n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == name),
                    None)

    def attribute_class(self, module: str, cls: ast.ClassDef, attr: str):
        """The class ``__init__`` gives ``self.attr``, from a parameter's annotation."""
        init = self.method(cls, "__init__")
        if init is None:
            return None
        notes = {a.arg: a.annotation for a in init.args.args + init.args.kwonlyargs}
        for node in ast.walk(init):
            if (isinstance(node, ast.Assign) and isinstance(node.value, ast.Name)
                    and any(isinstance(t, ast.Attribute) and t.attr == attr
                            and isinstance(t.value, ast.Name) and t.value.id == "self"
                            for t in node.targets)):
                note = notes.get(node.value.id)
                if note is not None:
                    name = note.value if isinstance(note, ast.Constant) else ast.unparse(note)
                    found = self.lookup(module, name)
                    if found and found[0] == "class":
                        return found[1], found[2]
        return None

    def callees(self, module: str, fn: ast.FunctionDef, cls=None):
        """(module, qualified name, node, class) of each call in ``fn`` the walker follows."""
        out = []
        for call in (n for n in ast.walk(fn) if isinstance(n, ast.Call)):
            f = call.func
            if isinstance(f, ast.Name):
                found = self.lookup(module, f.id)
                if found and found[0] == "def":
                    out.append((found[1], f.id, found[2], None))
                elif found and found[0] == "class":
                    init = self.method(found[2], "__init__")
                    if init is not None:
                        out.append((found[1], f"{f.id}.__init__", init, (found[1], found[2])))
            elif isinstance(f, ast.Attribute):
                owner = None  # (module, class node) whose method f.attr is
                if isinstance(f.value, ast.Name) and f.value.id == "self" and cls:
                    owner = cls
                elif isinstance(f.value, ast.Name):
                    found = self.lookup(module, f.value.id)
                    if found and found[0] == "instance":
                        owner = (found[1], found[2])
                    elif found and found[0] == "module":
                        sub = self.lookup(found[1], f.attr)
                        if sub and sub[0] == "def":
                            out.append((sub[1], f.attr, sub[2], None))
                elif (isinstance(f.value, ast.Attribute) and isinstance(f.value.value, ast.Name)
                      and f.value.value.id == "self" and cls):
                    owner = self.attribute_class(cls[0], cls[1], f.value.attr)
                if owner is not None:
                    node = self.method(owner[1], f.attr)
                    if node is not None:
                        out.append((owner[0], f"{owner[1].name}.{f.attr}", node, owner))
        return out

    def reach(self, module: str, name: str) -> set[str]:
        """'module:qualified name' of every function reachable from ``module.name``."""
        found = self.lookup(module, name)
        todo = [(found[1], name, found[2], None)]
        seen = set()
        while todo:
            mod, qual, node, cls = todo.pop()
            if f"{mod}:{qual}" in seen:
                continue
            seen.add(f"{mod}:{qual}")
            todo.extend(self.callees(mod, node, cls))
        return seen


@pytest.mark.parametrize("front", ["dlm_kernels.torch", "dlm_kernels.jax"])
@pytest.mark.parametrize("objective", ["diffusion_sft_loss", "weighted_cross_entropy"])
def test_a_static_walk_reaches_the_op(front, objective):
    """From a public objective, the calls a reader can follow (no callable handed in as a
    value) reach the token-statistics op's one entry point, and never re-enter a public
    front-end function on the way. Failed while the objectives received the public
    ``token_stats`` as a callback (the walk stopped at ``self.token_stats``)."""
    walker = CallWalker(package_modules())
    reached = walker.reach(front, objective)
    assert "dlm_kernels.token_stats.op:TokenStatsFrontEnd.token_stats_total" in reached, \
        sorted(reached)
    public = {f"{front}:{name}" for name in __import__(front, fromlist=["_"]).__all__}
    assert reached & public == {f"{front}:{objective}"}, sorted(reached & public)


def test_the_call_walker_follows_each_form(tmp_path):
    """Names, imported functions, module-level instances, ``self.method`` and an annotated
    ``self.attr``; a callable stored unannotated is not followed."""
    pkg = tmp_path / "p"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "op.py").write_text("class Op:\n    def run(self):\n        return leaf()\n"
                               "def leaf():\n    return 1\n")
    (pkg / "obj.py").write_text(
        "from .op import Op\n"
        "class Obj:\n"
        "    def __init__(self, op: Op, fn):\n        self.op = op\n        self.fn = fn\n"
        "    def a(self):\n        return self.b()\n"
        "    def b(self):\n        return self.op.run()\n"
        "    def c(self):\n        return self.fn()\n")
    (pkg / "front.py").write_text("from .obj import Obj as _Obj\nfrom .op import Op\n"
                                  "_O = _Obj(Op(), None)\n"
                                  "def a():\n    return _O.a()\n"
                                  "def c():\n    return _O.c()\n")
    walker = CallWalker(package_modules(tmp_path, {"p": "p"}))
    assert walker.reach("p.front", "a") == {"p.front:a", "p.obj:Obj.a", "p.obj:Obj.b",
                                            "p.op:Op.run", "p.op:leaf"}
    assert walker.reach("p.front", "c") == {"p.front:c", "p.obj:Obj.c"}


#: the host files (python/dlm_kernels, the kernels' folder aside) that may name an option of
#: the CE term: the checked CeTerm (_config), each front end's signatures (torch, jax, nn),
#: the lowering that turns it into kernel constants, and the math that reads those
MAX_FILES_NAMING_AN_OPTION = 6
#: host files of prose only, not counted: the front ends' docstring templates
#: (``dlm_kernels._docstrings``), whose words the front ends carry
PROSE_FILES = ("_docstrings.py",)


@pytest.mark.parametrize("option", ["label_smoothing", "z_loss_weight"])
def test_an_option_is_declared_once(option):
    """An option reaches the kernels as one typed object (``_config.CeTerm``), so it is named
    in few host files; the objectives and the op pass the object along (label_smoothing was
    named in 8 files while each layer took it as a keyword)."""
    top = ROOT / "python" / "dlm_kernels"
    files = sorted(str(p.relative_to(top)) for p in top.rglob("*.py")
                   if not any((top / part).is_symlink() for part in p.relative_to(top).parts[:1])
                   and str(p.relative_to(top)) not in PROSE_FILES and option in p.read_text())
    assert len(files) <= MAX_FILES_NAMING_AN_OPTION, files


def test_the_run_shares_compiled_programs():
    """The suite keeps XLA's compiled programs on disk for the run (conftest.py), every
    program cached however fast it compiled: JAX reads the directory the environment names."""
    import os

    jax = pytest.importorskip("jax")
    directory = os.environ.get("JAX_COMPILATION_CACHE_DIR")
    assert directory and os.path.isdir(directory), directory
    assert jax.config.jax_compilation_cache_dir == directory
    assert float(jax.config.jax_persistent_cache_min_compile_time_secs) == 0.0
