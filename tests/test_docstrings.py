"""The docstrings both front ends share are written once, as templates in
``dlm_kernels._docstrings``, and stamped into ``dlm_kernels.torch`` and ``dlm_kernels.jax``
as literals (what IDEs and type checkers show). A front end's docstring that differs from
its rendered template fails here, by function and framework, until re-stamped; a public
name with a twin in the other front end must have a template."""

from __future__ import annotations

import ast
import difflib
import functools

import pytest

from dlm_kernels import _docstrings as docs

#: the public names of one front end without a twin in the other, and why they have no
#: template (every other public name has one)
WITHOUT_TWIN = {
    ("jax", "VocabAxis"): "JAX's type of ``vocab_axis``; torch takes a ProcessGroup",
}
#: the front ends' other modules and why none of their docstrings is a template:
#: test_other_modules_hold_no_second_copy checks that the twins hold one copy
OTHER_MODULES = {
    "torch/nn.py": "torch only: the losses as nn.Modules, each docstring citing its function",
    "torch/integrations": "torch only: patches for transformers' models",
    "torch/self_conditioning.py": "soft_embedding's docstring, written once",
    "jax/self_conditioning.py": "soft_embedding's docstring cites the torch one",
}


@functools.cache
def front_end(framework: str) -> tuple[str, dict[str, ast.Expr], list[str]]:
    """(source, docstring statements by name, public names) of a front end."""
    source = (docs.PACKAGE / docs.FRONT_ENDS[framework]).read_text(encoding="utf-8")
    tree = ast.parse(source)
    return source, docs.docstring_nodes(tree), docs.public_names(tree)


@pytest.mark.parametrize("name", list(docs.DOCS))
@pytest.mark.parametrize("framework", docs.FRAMEWORKS)
def test_front_end_docstring_is_its_template(framework, name):
    """The literal docstring of ``name`` in the front end is its template rendered for that
    framework, byte for byte (its indentation and closing quotes included)."""
    source, nodes, _ = front_end(framework)
    assert name in nodes, (f"dlm_kernels.{framework}: {name} has no docstring; give it one "
                           f"and run {docs.STAMP_COMMAND}")
    node = nodes[name]
    have = ast.get_source_segment(source, node)
    want = docs.literal(docs.render(name, framework), " " * node.col_offset)
    diff = "".join(difflib.unified_diff(
        (have or "").splitlines(True), want.splitlines(True),
        f"dlm_kernels/{docs.FRONT_ENDS[framework]}", "template", n=1))
    assert have == want, (
        f"the docstring of {name} in dlm_kernels.{framework} (line {node.lineno}) differs from "
        f"its template in dlm_kernels._docstrings: edit the template, then run "
        f"{docs.STAMP_COMMAND}\n{diff}")


def test_every_twin_has_a_template():
    """Every public function, class, method and documented attribute that both front ends
    declare has one template, and only those have one; a name in one front end alone is
    listed in WITHOUT_TWIN."""
    public = {fw: set(front_end(fw)[2]) for fw in docs.FRAMEWORKS}
    twins = set.intersection(*public.values())
    assert sorted(twins - set(docs.DOCS)) == [], (
        f"public names of both front ends without a template in dlm_kernels._docstrings "
        f"(write one, then run {docs.STAMP_COMMAND})")
    assert sorted(set(docs.DOCS) - twins) == [], "templates of no twin"
    alone = {(fw, n) for fw in docs.FRAMEWORKS for n in public[fw] - twins}
    assert alone == set(WITHOUT_TWIN), "a name of one front end only: list it in WITHOUT_TWIN"


def test_the_templates_cover_these_names():
    """The names the templates cover, in the front ends' order: a change to the list is a
    change of the public API, seen here."""
    assert list(docs.DOCS) == [
        "Logits", "WeightedSum", "WeightedSum.compute", "WeightedSum.replace",
        "DiffusionTokenBatch", "DiffusionTokenBatch.create", "DiffusionTokenBatch.validate",
        "DiffusionTokenBatch.replace", "DiffusionDistillationBatch",
        "DiffusionDistillationBatch.create", "DiffusionDistillationBatch.validate",
        "DiffusionDistillationBatch.replace", "PolicyLossResult", "token_stats",
        "backend_for", "vocab_parallel", "reweight", "loo_to_denoiser_logits",
        "diffusion_sft_loss", "diffusion_sft_logps", "validate_diffusion_logits",
        "merge_diffusion_batches", "per_token_logps", "compute_diffusion_per_token_logps",
        "compute_diffusion_logits", "weighted_cross_entropy", "opd_loss", "policy_loss",
        "sample_tokens", "commit_tokens", "add_gumbel_noise", "get_num_transfer_tokens",
        "get_transfer_index",
    ]
    for framework in docs.FRAMEWORKS:
        order = [n for n in front_end(framework)[2] if n in docs.DOCS]
        assert order == list(docs.DOCS), framework


def test_other_modules_hold_no_second_copy():
    """The front ends' modules besides ``__init__`` (OTHER_MODULES): where both frameworks
    have one, each public function of the JAX module cites its torch twin instead of
    repeating its docstring."""
    listed = {p for p in OTHER_MODULES}
    found = {str(p.relative_to(docs.PACKAGE)) for fw in docs.FRAMEWORKS
             for p in (docs.PACKAGE / fw).iterdir()
             if p.name != "__init__.py" and p.name != "__pycache__"}
    assert found == listed, "a new module of a front end: list it in OTHER_MODULES"
    torch_path = docs.PACKAGE / "torch" / "self_conditioning.py"
    jax_path = docs.PACKAGE / "jax" / "self_conditioning.py"
    torch_public = docs.public_names(ast.parse(torch_path.read_text(encoding="utf-8")))
    jax_nodes = docs.docstring_nodes(ast.parse(jax_path.read_text(encoding="utf-8")))
    for name in torch_public:
        if name in jax_nodes:
            text = jax_nodes[name].value.value  # type: ignore[attr-defined]
            assert text.startswith(f"As ``dlm_kernels.torch.self_conditioning.{name}``"), name


def test_placeholders_have_a_text_in_every_framework():
    """Both frameworks define the same words, each template's parts name both frameworks
    and appear in the template, and every template renders (no unknown placeholder)."""
    assert len({tuple(sorted(words)) for words in docs.WORDS.values()}) == 1
    used = set()
    for name, doc in docs.DOCS.items():
        placeholders = set(docs.PLACEHOLDER.findall(doc.template))
        used |= placeholders
        for part, texts in doc.parts.items():
            assert set(texts) == set(docs.FRAMEWORKS), (name, part)
            assert part in placeholders, (name, part)
            assert part not in docs.WORDS["torch"], (name, part)
        for framework in docs.FRAMEWORKS:
            assert docs.PLACEHOLDER.findall(docs.render(name, framework)) == [], name
    assert set(docs.WORDS["torch"]) <= used, "a word no template uses"


@pytest.mark.parametrize("framework", docs.FRAMEWORKS)
def test_rendered_docstrings_fit_100_columns(framework):
    """Each rendered docstring, indented as its definition, fits in 100 columns."""
    _, nodes, _ = front_end(framework)
    long = [f"{name}: {line}" for name in docs.DOCS
            for line in (" " * nodes[name].col_offset + docs.literal(
                docs.render(name, framework), " " * nodes[name].col_offset)).split("\n")
            if len(line) > 100]
    assert long == []


def test_stamp_rewrites_only_the_docstring_literals():
    """``stamp`` replaces exactly the docstring literals (a single-quoted one too, on lines
    with non-ASCII text before and after) and leaves every other byte; stamping again
    changes nothing; a name without a docstring is an error."""
    old = ('"""Module, Σ."""\n'
           "Logits = int | str  # ε\n"
           "'a stale ε'\n"
           "\n"
           "class WeightedSum:  # Σ w\n"
           '    """Stale, ünïcode."""\n'
           "\n"
           "    x: int = 1\n"
           "\n"
           "    def compute(self):  # ‖\n"
           "        'old'; y = 'é'\n"
           "        return {'é': y}\n")
    names = ["Logits", "WeightedSum", "WeightedSum.compute"]
    new, changed = docs.stamp(old, "jax", names)
    assert changed == names
    want = old
    for name, was, indent in (("Logits", "'a stale ε'", ""),
                              ("WeightedSum", '"""Stale, ünïcode."""', "    "),
                              ("WeightedSum.compute", "'old'", "        ")):
        want = want.replace(was, docs.literal(docs.render(name, "jax"), indent))
    assert new == want
    assert docs.stamp(new, "jax", names) == (new, [])
    with pytest.raises(ValueError, match="token_stats"):
        docs.stamp(old, "jax", ["token_stats"])


def test_the_command_finds_nothing_to_stamp(capsys):
    """``python -m dlm_kernels._docstrings`` (no --write) exits 0 on the tree as committed."""
    assert docs.main([]) == 0, capsys.readouterr().out
    assert docs.main(["--check"]) == 2
