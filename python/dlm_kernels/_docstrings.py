"""The docstrings of the public names both front ends declare, each written once.

``dlm_kernels.torch`` and ``dlm_kernels.jax`` declare the same functions and classes; each
keeps a literal docstring (what IDEs and type checkers show), stamped from a template here.
A template is the cleaned docstring (continuation lines without the definition's indent;
a final newline puts the closing quotes on a line of their own) with placeholders:

- the framework's words, ``WORDS``: ``{array}``, ``{arrays}``, ``{an_array}``,
  ``{host_arrays}``, ``{device_arrays}``, ``{compile}``, ``{backends}``, ``{shard}``;
- a template's own parts where the frameworks differ in more than a word (``Doc.parts``:
  each placeholder's text per framework, written side by side).

Any other brace stays as written. ``render(name, framework)`` gives a docstring;

    python -m dlm_kernels._docstrings            # lists the docstrings that differ
    python -m dlm_kernels._docstrings --write    # stamps them into the front ends

rewrites each differing docstring literal in place (found with ``ast``), every other byte
of the file as it was. ``tests/test_docstrings.py`` fails while any differs.
"""

from __future__ import annotations

import ast
import dataclasses
import pathlib
import re
import sys
from collections.abc import Sequence

#: the framework's words every template may use
WORDS: dict[str, dict[str, str]] = {
    "torch": {
        "array": "tensor",
        "arrays": "tensors",
        "an_array": "a tensor",
        "host_arrays": "CPU tensors",
        "device_arrays": "CUDA tensors",
        "compile": "``torch.compile``",
        "backends": '"reference", "chunked", "triton"',
        "shard": "process_group",
    },
    "jax": {
        "array": "array",
        "arrays": "arrays",
        "an_array": "an array",
        "host_arrays": "concrete host arrays",
        "device_arrays": "accelerator arrays",
        "compile": "``jit``",
        "backends": '"reference", "chunked", "triton", "pallas"',
        "shard": "vocab_axis",
    },
}
FRAMEWORKS = tuple(WORDS)

#: the file of each front end, under the package
FRONT_ENDS = {"torch": "torch/__init__.py", "jax": "jax/__init__.py"}
PACKAGE = pathlib.Path(__file__).resolve().parent
#: a placeholder: a name in braces
PLACEHOLDER = re.compile(r"\{([A-Za-z_]\w*)\}")
#: the command that stamps the templates into the front ends
STAMP_COMMAND = "python -m dlm_kernels._docstrings --write"


@dataclasses.dataclass(frozen=True)
class Doc:
    """A docstring template and its own parts: {placeholder: {framework: text}}."""

    template: str
    parts: dict[str, dict[str, str]]


#: every docstring both front ends share, by name (``Class.method`` for a method; a module
#: attribute's docstring under the attribute's name), in the front ends' order
DOCS: dict[str, Doc] = {}


def _doc(name: str, template: str, **parts: dict[str, str]) -> None:
    DOCS[name] = Doc(template, parts)


def render(name: str, framework: str) -> str:
    """The docstring of ``name`` in the ``framework`` front end ("torch" or "jax"), cleaned
    (as ``inspect.cleandoc`` gives it, a final newline where the closing quotes stand on a
    line of their own)."""
    doc = DOCS[name]
    words = {**WORDS[framework], **{k: v[framework] for k, v in doc.parts.items()}}

    def word(m: re.Match[str]) -> str:
        if m.group(1) not in words:
            raise KeyError(f"{name}: no text for {{{m.group(1)}}} in the {framework} front end")
        return words[m.group(1)]

    text = PLACEHOLDER.sub(word, doc.template)
    if "\\" in text or '"""' in text or any(line != line.rstrip() for line in text.split("\n")):
        raise ValueError(f"{name}: a docstring holds a backslash, '\"\"\"' or trailing spaces")
    return text


def literal(text: str, indent: str) -> str:
    """The docstring literal of ``text`` for a body indented by ``indent``."""
    lines = text.split("\n")
    body = [lines[0]] + [indent + line if line else "" for line in lines[1:]]
    if len(lines) > 1 and not lines[-1]:
        body[-1] = indent  # the closing quotes on a line of their own
    return '"""' + "\n".join(body) + '"""'


def docstring_nodes(tree: ast.Module) -> dict[str, ast.Expr]:
    """The docstring statements of a module: each function's and class's (``name``), each
    method's (``Class.method``), and each module attribute's (the string right after its
    assignment)."""
    def first(body: list[ast.stmt]) -> ast.Expr | None:
        if (body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
                and isinstance(body[0].value.value, str)):
            return body[0]
        return None

    found: dict[str, ast.Expr] = {}
    for i, node in enumerate(tree.body):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            if (doc := first(node.body)) is not None:
                found[node.name] = doc
            if isinstance(node, ast.ClassDef):
                for member in node.body:
                    if (isinstance(member, (ast.FunctionDef, ast.AsyncFunctionDef))
                            and (doc := first(member.body)) is not None):
                        found[f"{node.name}.{member.name}"] = doc
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            doc = first(tree.body[i + 1:])
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if doc is not None:
                found.update((t.id, doc) for t in targets if isinstance(t, ast.Name))
    return found


def public_names(tree: ast.Module) -> list[str]:
    """The public definitions of a module, in order: functions and classes, the methods of
    the classes, and the module attributes that carry a docstring (no leading underscore)."""
    documented = docstring_nodes(tree)
    names = []
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.append(node.name)
            if isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
                names += [f"{node.name}.{m.name}" for m in node.body
                          if isinstance(m, (ast.FunctionDef, ast.AsyncFunctionDef))]
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names += [t.id for t in targets if isinstance(t, ast.Name) and t.id in documented]
    return [n for n in names if not n.rpartition(".")[2].startswith("_")]


def stamp(source: str, framework: str,
          names: Sequence[str] | None = None) -> tuple[str, list[str]]:
    """(source with the docstrings of ``names`` (default: every name of ``DOCS``) rendered
    for ``framework``, the names whose docstring changed). Only the docstring literals
    change; a name without a docstring in ``source`` is a ValueError."""
    data = source.encode()
    starts = [0]  # byte offset of each line (ast's columns count UTF-8 bytes)
    for line in data.splitlines(keepends=True):
        starts.append(starts[-1] + len(line))
    nodes = docstring_nodes(ast.parse(source))
    names = list(DOCS) if names is None else list(names)
    missing = [name for name in names if name not in nodes]
    if missing:
        raise ValueError(f"no docstring to stamp in the {framework} front end: "
                         + ", ".join(missing) + " (give each one, any text)")
    edits, changed = [], []
    for name in names:
        node = nodes[name]
        assert node.end_lineno is not None and node.end_col_offset is not None
        begin = starts[node.lineno - 1] + node.col_offset
        end = starts[node.end_lineno - 1] + node.end_col_offset
        indent = " " * node.col_offset
        text = render(name, framework)
        new = literal(text, indent)
        expected = "\n".join(indent + line if i and line else line
                             for i, line in enumerate(text.split("\n")))
        if text.endswith("\n"):
            expected += indent
        assert ast.literal_eval(new) == expected, name  # the literal reads back as the text
        if data[begin:end].decode() != new:
            edits.append((begin, end, new.encode()))
            changed.append(name)
    for begin, end, new in sorted(edits, reverse=True):
        data = data[:begin] + new + data[end:]
    return data.decode(), changed


def stale(framework: str, package: pathlib.Path = PACKAGE) -> tuple[str, str, list[str]]:
    """(the front end's source, its source stamped, the names whose docstring differs)."""
    source = (package / FRONT_ENDS[framework]).read_text(encoding="utf-8")
    return (source, *stamp(source, framework))


def main(argv: list[str]) -> int:
    write = "--write" in argv
    unknown = [a for a in argv if a != "--write"]
    if unknown:
        print(f"usage: python -m dlm_kernels._docstrings [--write]; got {unknown}")
        return 2
    differ = False
    for framework in FRAMEWORKS:
        _, stamped, changed = stale(framework)
        if not changed:
            continue
        differ = True
        path = PACKAGE / FRONT_ENDS[framework]
        if write:
            path.write_text(stamped, encoding="utf-8")
        print(f"{'stamped' if write else 'differs from its template'} in "
              f"{path.relative_to(PACKAGE.parent.parent)}: {', '.join(changed)}")
    if differ and not write:
        print(f"re-stamp: {STAMP_COMMAND}")
    return 1 if differ and not write else 0


# -- the templates ---------------------------------------------------------------------------

_doc("Logits", """\
What every ``logits`` argument takes: a [..., K] {array}, or a LinearHead standing for one.""")


_doc("WeightedSum", """\
A loss kept as ``unreduced_sum`` over ``denominator`` (sums across micro-batches or
devices add field by field); ``compute()`` is their ratio, 0 for a 0 denominator, NaN
for a NaN or negative one. The objectives give Σ w·loss and Σ w, both times 2^-64 when
a weight reaches 2^64 (so that Σ w·loss stays a float32 number up to weights of 3.4e38;
docs/design.md §3).""")


_doc("WeightedSum.compute", """\
unreduced_sum / denominator; exactly 0 (gradient too) for a 0 denominator, NaN
for a NaN or negative one.""")


_doc("WeightedSum.replace", """\
A copy with some fields replaced.""")


_doc("DiffusionTokenBatch", """\
Target-aligned diffusion batch: position (b, l) predicts ``target_ids[b, l]`` from
``model_inputs`` (the noisy canvas); it is active when its weight is non-zero.

model_inputs: a batch-major pytree of {arrays} (a dict such as {"input_tokens": [B, L]
  int, "positions": [B, L] int, "time": [B] float}, any nesting, or one bare {array}):
  every leaf non-scalar with leading dimension B and a bool or real numeric dtype.
target_ids: [B, L] int.
loss_weights: [B, L] bool, int or float, kept as given (objectives convert to float32).
""")


_doc("DiffusionTokenBatch.create", """\
The batch, validated (``validate``).""")


_doc("DiffusionTokenBatch.validate", """\
Static checks always (TypeError for a wrong kind or dtype, ValueError for a
shape); value checks (finite, non-negative weights; active targets >= 0) on every
{array} that holds values (not a traced one; {device_arrays} too, one device sync
each). Returns self.""")


_doc("DiffusionTokenBatch.replace", """\
A copy with some fields replaced (not validated).""")


_doc("DiffusionDistillationBatch", """\
A student batch plus the teacher's logits at the same positions.

student_batch: DiffusionTokenBatch;  teacher_logits: [B, L, K] float (or a LinearHead).
Active targets must lie in [0, K) of the teacher logits (checked where the student batch's
value checks run). Teacher values (finite at active positions) are checked by
``opd_loss`` when its soft term is enabled, so a batch for a hard-only loss may carry
any finite-shaped teacher.
""")


_doc("DiffusionDistillationBatch.create", """\
The batch, validated (``validate``).""")


_doc("DiffusionDistillationBatch.validate", """\
The student batch's checks, the teacher's shape against it, and every active
target inside the teacher's vocabulary (where the student batch's value checks
run). Returns self.""")


_doc("DiffusionDistillationBatch.replace", """\
A copy with some fields replaced (not validated).""")


_doc("PolicyLossResult", """\
What ``policy_loss`` returns: the loss to differentiate and the metrics TRL's
``GRPOTrainer`` logs, each a [] float32 {array} (the metrics are constants).

loss: the normalised policy loss (``loss_type``'s normaliser).
clip_ratio_low, clip_ratio_high, clip_ratio_region: the shares of clipped ratios (TRL's
  clip_ratio/low_mean, high_mean, region_mean; with "cispo" its cispo_clip_ratio).
kl: the mean KL term, None when beta = 0.
entropy: the mean entropy at the temperature.
""")


#: the ``inplace_grad`` argument of ``token_stats`` and ``policy_loss``
_INPLACE_GRAD = {
    "torch": ("opt-in. Write d(logits) into the logits buffer itself instead of a new\n"
              "    tensor (saves one [..., K] allocation); after backward the logits tensor\n"
              "    holds the gradient, so nothing else may read those logits afterwards.\n"
              "    Supported by the chunked and triton backends, for logits given as a tensor\n"
              "    (with a LinearHead, student or teacher, it is a ValueError). The same bits\n"
              "    as without it; under ``torch.compile`` the graph's functionalization\n"
              "    returns the gradient in a buffer of its own (no saving there)."),
    "jax": ("torch only (JAX arrays are immutable): True raises a ValueError; donate\n"
            "    the logits buffer to ``jit`` to let XLA reuse it instead."),
}


_doc("token_stats", """\
Streaming token statistics of docs/design.md §2, differentiable (custom VJP).

Args:
  logits: [..., K] student logits (float32, bfloat16 or float16), or a LinearHead.
  targets: [...] integer target ids; active targets must lie in [0, K) (a target outside
    gives logp = NaN rather than a silent wrong value; the primitive reads no values on
    the host, the objectives check them where that costs no device sync).
  weights: [...] optional; a row is active when its weight is non-zero (the weight's
    value is not applied here). Inactive rows read nothing that can leak: their outputs
    and gradients are exact zeros. None = every row active.
  temperature: T of p = softmax(s), s = (cap(z) + d·[k == x]) / T; at least
    ``FLOAT32_MIN_TEMPERATURE`` = 2^-102 (about 2e-31), below which it is a ValueError: every
    exponent is a logit difference (r - m) scaled by 1/T afterwards (docs/design.md §2),
    float32-exact at any T from there up. Results whose size passes the float32 range
    (|cap(z)| / T past 3.4e38) overflow to ±inf.
  ce_temperature: temperature of the ``logp`` term (default: ``temperature``; the same
    minimum); a different value costs one more running sum in the same pass.
  softcap: c > 0 for cap(z) = c·tanh(z / c), or None. Any c > 0: for |z / c| below 0.625
    cap(z) is z·(1 + u·Q(u)), u = (z / c)², with a fitted polynomial Q; beyond,
    c·tanh(z / c), saturating at ±c. A student ``LinearHead(..., softcap=c)`` carries
    its own cap, which is this one (a different ``softcap`` here is a ValueError); a
    teacher head's cap applies to the teacher.
  shift_ids, shift: LOO shift; ``shift`` ([...] per row, or a scalar; float) is added to
    the logit at column ``shift_ids`` ([...] int) before the temperature. An active row
    whose shift id lies outside [0, K) gets NaN in every statistic. The shift is
    differentiable.
  teacher_logits: [..., K] optional teacher logits u for ``kl`` (or a LinearHead).
  teacher_temperature: T_kl of q = softmax(u / T_kl) (default: ``temperature``).
  teacher_grad: also differentiate with respect to ``teacher_logits``.
  entropy: compute ``entropy`` (default True); False leaves its sums out of both passes
    and returns ``entropy=None``.
  chunk_size: vocabulary chunk of the chunked backend, block size of the kernel
    backends (default: a heuristic).{padded}
  inplace_grad: {inplace_grad}
  vocab_size: the true vocabulary when the last axis is padded: columns >= vocab_size
    are excluded and get a zero gradient (with a ``{shard}``: the global size).
  label_smoothing: ε in [0, 1] (default 0). ``logp`` becomes minus the smoothed CE,
    Σ_k q_k·log p'_k with q = (1 - ε)·onehot(y) + ε/K over the K valid columns (K =
    ``vocab_size`` when given, else the logits' last dim; the global K under vocabulary
    parallelism), as ``torch.nn.functional.cross_entropy(label_smoothing=ε)``. A column
    at -inf makes it -inf (finfo.min: huge), as in torch.
  z_loss_weight: λ >= 0, finite (default 0). ``logp`` also carries -λ·lse_ce², lse_ce
    the logsumexp of the logits at ``ce_temperature`` (PaLM's z-loss; Liger's
    ``lse_square_scale``). Both options change ``logp`` only; with ε = λ = 0 it is the
    target's log-probability.
  {shard}: {shard_of}
    Targets and shift ids are global ids. Partial states merge with two all-reduces of
    per-row floats (40 bytes per row); the backward is local. ``vocab_parallel(...)``
    applies the same to every objective inside a ``with`` block.
  backend: None (auto), or one of {backends}.

Non-finite student logits in an active row: an entry at -inf has probability 0 (a
target at -inf has logp = -inf with a finite gradient). A NaN or +inf entry (after the
softcap), or a row that is -inf everywhere, leaves no distribution: lse, logp, entropy
and kl are NaN (lse is -inf for the all -inf row) and so is the row's gradient.

Returns:
  TokenStats(lse, logp, entropy, kl), each float32 of shape [...] (entropy None when
  ``entropy=False``).
""", padded={
    "torch": "",
    "jax": (" The chunked backend runs a call of fewer than\n"
            "    ``16384 // chunk_size`` rows padded to that many (one row, one answer:\n"
            "    docs/design.md §2), so a chunk under 2048 columns with few rows copies up to\n"
            "    16384 x K / chunk_size logits (1024 rows of K at a chunk of 16)."),
}, inplace_grad=_INPLACE_GRAD, shard_of={
    "torch": ("vocabulary parallelism. The logits are this rank's contiguous shard of\n"
              "    the vocabulary."),
    "jax": ("vocabulary parallelism (inside ``jax.shard_map``). The logits are this\n"
            "    device's contiguous shard of the vocabulary along that mesh axis."),
})


_doc("backend_for", """\
The name of the backend ``backend`` (None = auto) resolves to for these logits.""")


_doc("vocab_parallel", """\
Within this block{traced}, every objective treats its logits as
this {shard_of}
(as ``token_stats(..., {shard}=..., vocab_size=...)`` does).""", traced={
    "torch": "",
    "jax": " (traced inside ``jax.shard_map``)",
}, shard_of={
    "torch": "rank's vocabulary shard of ``process_group``",
    "jax": "device's shard of the mesh axis ``vocab_axis``",
})


_doc("reweight", """\
Time weight [B]: -alpha_dot / max(alpha, EPS) for reweighted variants, else 1.""")


_doc("loo_to_denoiser_logits", """\
LOO -> denoiser logits: logits [B, L, K] + delta at column xt [B, L]; float32.

delta = log1p(vocab_size·alpha / max(1 - alpha, EPS)) with alpha [B], [B, 1] or
[B, L], or one number for every sequence. An xt outside [0, vocab_size) raises
ValueError where its values can be read without a device sync, else makes that
position's logits NaN. Materialises a [B, L, K] {array}; the losses apply the same
shift inside the fused primitive instead.
""")


_doc("diffusion_sft_loss", """\
Megatron-Bridge DiffusionGemma SFT loss, [B] float32.

loss[b] = w_b · Σ_l M_bl·CE_bl / max(Σ_l M_bl, 1) with logits [B, L, K], clean tokens
x0 [B, L], noisy tokens xt [B, L], times t [B] in [0, 1] (or one number for every
sequence) and loss_mask M [B, L] (finite, non-negative). ``variant`` picks the time
weight w and the LOO shift (``VARIANTS``); ``diffusion_weight_clip`` bounds w from
above. ``vocab_size`` <= K. ``alpha_fn`` and ``alpha_dot_fn`` get t as [B] (a number
broadcast, as float32); in a reweighted variant each returns [B] or a number, in a LOO
variant alpha may also be [B, 1] or [B, L].
``label_smoothing`` ε in [0, 1] and ``z_loss_weight`` λ >= 0 (default 0: the plain
CE) make CE_bl the label-smoothed CE plus λ·lse² (see ``token_stats``).

Bad values raise ValueError where they can be read without a device sync
({host_arrays}; {device_arrays} inside ``sync_checks()``): an x0 outside
[0, vocab_size) where the mask is set, an xt outside it in a LOO variant, a negative or
non-finite mask, a t outside [0, 1]. Elsewhere ({device_arrays}, {compile}) such a
value makes that sequence's loss NaN, never a plausible number.
""")


_doc("diffusion_sft_logps", """\
Sequence log-probs -w_b · Σ_l M_bl·CE_bl, [B] float32 (arguments as
``diffusion_sft_loss``).""")


_doc("validate_diffusion_logits", """\
Check logits [B, L, K] against a DiffusionTokenBatch and return ``logits``: rank,
[B, L] alignment, a floating dtype and K >= 1 always; active targets in [0, K) on
{host_arrays} ({device_arrays} inside ``sync_checks()``; elsewhere an out-of-range
active target shows as a NaN log-prob). ``name`` is the logits' name in the errors.""")


_doc("merge_diffusion_batches", """\
Concatenate batches on the batch axis, every leaf of every field (model_inputs is a
pytree). All must have one type, the same tree structure and the same trailing shapes
and dtypes; everything is checked before anything is built.""")


_doc("per_token_logps", """\
Target log-probs [B, L] at ``temperature`` (and the entropy [B, L] when
``return_entropy``: a tuple); exactly 0 at inactive positions; constants (no gradient)
when ``stop_gradient``.""")


_doc("compute_diffusion_per_token_logps", """\
``per_token_logps(logits_fn(model, batch.model_inputs), batch, ...)``; the arguments
are checked before the model runs.""")


_doc("compute_diffusion_logits", """\
Tunix's ``compute_diffusion_logits``: validate ``batch`` (``batch.validate()``), call
``logits_fn(model, batch.model_inputs)``, check the result against the batch
(``validate_diffusion_logits``: [B, L, K], a floating dtype, K >= 1, active targets
below K where their values can be read without a device sync) and return it. A
``LinearHead`` returned by ``logits_fn`` is checked by its shape and passed through.""")


_doc("weighted_cross_entropy", """\
WeightedSum(Σ w·CE, Σ w) at T = 1 over the batch's active positions.

``label_smoothing`` ε in [0, 1]: CE against (1 - ε)·onehot(target) + ε/K over the K
valid columns (torch's ``cross_entropy(label_smoothing=ε)``); ``z_loss_weight`` λ >= 0
adds λ·lse² per active position (PaLM's z-loss). Both default to 0.
""")


_doc("opd_loss", """\
On-policy distillation: (WeightedSum total, {"distill/soft_loss", "distill/hard_loss"}).

soft = T²·KL(softmax(u/T) ‖ softmax(z/T)), hard = CE(z) at T = 1; one pass over the
student logits serves both. The teacher is stop-gradient. A disabled term (weight 0)
neither reads nor validates its inputs; its aux entry is WeightedSum(0, Σ w).
``label_smoothing`` and ``z_loss_weight`` apply to the hard term only (as in
``weighted_cross_entropy``); both default to 0.
""")


_doc("policy_loss", """\
TRL ``GRPOTrainer``'s policy losses on a diffusion batch: the scalar loss and the
metrics TRL logs (``PolicyLossResult``), differentiable in the logits.

logp is the log-probability of ``batch.target_ids`` at ``temperature``, taken with the
entropy in one pass over the vocabulary (a LinearHead never forms its logits); the
weights w = ``batch.loss_weights`` are the completion mask (a float weight scales its
token's term). With r = exp(logp - old_logps) and A the sequence's advantage, the
per-token loss ℓ is

  "grpo", "bnpo", "dr_grpo", "dapo": -min(r'·A, clip(r, 1 - epsilon, 1 + epsilon_high)·A),
    r' = min(r, delta) when ``delta`` is given (two-sided clipping), else r;
  "cispo": -min(r, epsilon_high)·A·logp, the capped ratio a constant;

plus beta·(exp(ref - logp) - (ref - logp) - 1), ref = ``ref_logps``, when beta != 0
(times r when ``use_bias_correction_kl``). The loss normalises Σ w·ℓ:

  grpo: the mean over the B sequences of Σ_l w·ℓ / max(Σ_l w, 1);
  bnpo: Σ w·ℓ / max(Σ w, 1);
  dr_grpo: Σ w·ℓ / (B·max_completion_length), max_completion_length L by default;
  dapo, cispo: Σ w·ℓ / max(num_items_in_batch, 1), Σ w by default.

Args:
  logits: [B, L, K] logits, or a LinearHead standing for them.
  batch: the DiffusionTokenBatch the logits score.
  old_logps: [B, L] float, the sampling policy's log-probs (``per_token_logps`` of the
    same batch at the same temperature), or None: on-policy, logp itself as a constant
    (r = 1 exactly).
  advantages: [B], one per sequence.
  loss_type: one of "grpo", "bnpo", "dr_grpo", "dapo", "cispo".
  epsilon: in [0, 1]: the ratio's lower clip bound is 1 - epsilon.
  epsilon_high: >= 0 (None: epsilon): the upper clip bound is 1 + epsilon_high; with
    "cispo" (> 0) the cap of the ratio itself.
  delta: None, or > 1: the two-sided clipping bound of the unclipped term.
  beta: >= 0, the KL term's weight; ref_logps ([B, L] float) must be given when it is
    not 0 (otherwise they are not read).
  use_bias_correction_kl: multiply the KL term by r (importance-sampling correction).
  importance_sampling_level: "token" (a ratio per token) or "sequence" (GSPO: sequence
    b's ratio is exp of its weighted mean log-ratio, Σ_l w·(logp - old) / max(Σ_l w, 1),
    for every token of it).
  temperature: T > 0 of logp and the entropy (the sampling temperature).
  max_completion_length: dr_grpo's constant (a positive int; default L).
  num_items_in_batch: dapo's and cispo's count, a number or a 0-d {array} (default Σ w):
    across data-parallel ranks, the global token count. TRL's trainer passes that count
    divided by the number of processes, whose gradients DDP then averages.
  inplace_grad: {inplace_grad}
  backend: None (auto), or one of {backends}.

Returns:
  PolicyLossResult: ``loss`` ([] float32) and TRL's metrics as constants, each a
  weighted mean over tokens, Σ w·x / max(Σ w, 1): ``clip_ratio_low`` (r < 1 - epsilon
  with A < 0), ``clip_ratio_high`` (r > 1 + epsilon_high with A > 0; r after delta) and
  ``clip_ratio_region`` (either); with importance_sampling_level="sequence" these three
  are means over the B sequences, as TRL takes them. With "cispo", clip_ratio_high and
  clip_ratio_region are TRL's cispo_clip_ratio (r > epsilon_high with A > 0) and
  clip_ratio_low is 0. ``kl``: the KL term (times r with the bias correction), None when
  beta = 0. ``entropy``: the entropy at T.

old_logps, ref_logps and advantages are constants (no gradient). Positions of weight 0
take no part (a -inf or NaN there reaches nothing). Bad values raise ValueError where
they can be read without a device sync ({host_arrays}; {device_arrays} inside
``sync_checks()``): non-finite advantages, old_logps or ref_logps non-finite where the
weight is set, a negative or non-finite num_items_in_batch, and the batch's own checks.
Elsewhere ({device_arrays}, {compile}) they make the loss and every metric NaN, never a
plausible number.
""", inplace_grad=_INPLACE_GRAD)


_doc("sample_tokens", """\
One denoising step's draw, in one pass over each row's vocabulary (see ``Sample``).

Args:
  logits: [..., K] float logits (e.g. [B, L, K]); the conditional ones with guidance. A
    ``LinearHead(hidden, weight)`` in their place is read in token chunks of its
    ``row_chunk`` rows (never [N, K]), a head's softcap applied to each chunk in
    float32; so may ``uncond_logits`` be.
  temperature: T of softmax(z / T): 0 is greedy (the argmax, ties to the lowest id; the
    statistics are then those of softmax(z)), else T in [1e-3, 3.4e38]: below 1e-3 the
    float32 rounding of z / T would swamp the noise, so a smaller T raises.
  seed, step: ints (or integer scalar {arrays}, traced ones too) keying the counter-based
    noise (docs/design.md §3): the same (seed, step) draws the same tokens on every
    backend; change ``step`` every denoising step. ``seed`` may also be a [B] integer
    {array}, one per sequence (B = logits.shape[0]): sequence b's noise is then keyed on
    (seed[b], step, its position inside the sequence, column), so it draws the same tokens
    alone or at any batch index, whatever its neighbours. One seed s keys the flattened
    row index instead: a batch of one with seed s equals seed [s].{vmap}
  top_k: None or k in [1, 64]: draw among the k most likely tokens (renormalised; every
    statistic is taken under that distribution).
  suppress_ids: ids in [0, K) never drawn (e.g. the mask token): an [S] integer {array},
    a list, or one int; their logits count as -inf. An id outside [0, K) raises where
    its value can be read; where it cannot, every row has no valid draw (below).
  uncond_logits, cfg_scale: classifier-free guidance, z = z_u + (s + 1)(z_c - z_u), both
    read in the same pass.
  chunk_size: the vocabulary chunk of the chunked backend (default: a heuristic){padded}.
  stats_temperature: T_s of the returned statistics (logp, top1_logp, top2_logp,
    entropy, hence of every confidence of ``commit_tokens``): None takes the draw's T
    (softmax(z) at T = 0); 1.0 gives LLaDA's, Fast-dLLM's and Megatron-Bridge's
    confidence softmax(z)[token] while drawing at T. The token is drawn at ``temperature``
    either way, in the same pass; at T = 0 only None or 1 is accepted. With top_k the
    statistics are those of the k kept tokens renormalised at T_s.
  backend: None (auto), or one of {backends}. Every
    backend draws the same tokens for the same (seed, step).

Returns:
  Sample(token, logp, argmax, top1_logp, top2_logp, entropy) with the logits' leading
  shape; ``Sample.vocab_size`` = K. A row with no valid draw -- a NaN or +inf logit after
  guidance, suppression and the temperature, or no finite one -- has token -1, argmax
  -1 and NaN logp, top1_logp, top2_logp and entropy; ``commit_tokens`` never commits it.
  Without top_k, on logits without guidance or suppressed ids, logp and entropy are bit
  for bit those of the token statistics on the same backend and logits:
  ``per_token_logps(logits, batch with the tokens as targets, temperature=T_s,
  return_entropy=True)``, ``token_stats(..., chunk_size=chunk_size)`` with a chunk_size
  (docs/design.md §3, "Rollout = trainer"): an on-policy importance ratio is exactly 1.
  Not differentiable.
""", vmap={
    "torch": "",
    "jax": ("\n"
            "    Under ``jax.vmap`` an unmapped seed draws alike in every mapped instance; map a\n"
            "    seed per instance (``jax.vmap(f)(logits, seeds)``, f passing ``seed=s``) to\n"
            "    draw them independently."),
}, padded={
    "torch": "",
    "jax": ("; as in\n"
            "    ``token_stats``, a call of fewer than ``16384 // chunk_size`` rows runs padded\n"
            "    to that many"),
})


_doc("commit_tokens", """\
Commit the surest masked positions of a canvas: ([B, L] new canvas, [B, L] bool
committed).

Args:
  canvas: [B, L] int tokens whose dtype holds every id of the vocabulary (else a
    ValueError, never a wrapped id).
  sample: the ``Sample`` of this step's logits.
  masked: [B, L] bool, the positions still masked (inside the current block for
    block-wise semi-autoregressive decoding: the caller passes the intersection).
  rule: "topk" (LLaDA: the ``k`` most confident masked positions per sequence),
    "threshold" (Fast-dLLM: every masked position with confidence > ``threshold``, at
    least the most confident one) or "entropy_budget" (lowest entropy first while the
    entropies sum to at most ``budget`` nats; at least one).
  k, threshold, budget: a number or {an_array} of shape [] or [B] (per sequence); ``k`` an
    int >= 0, ``threshold`` and ``budget`` not NaN.
  confidence: "probability" (of the drawn token), "margin" (p1 - p2) or "neg_entropy".
    Ties go to the lower position.
  inclusive: rule="threshold" commits confidence >= ``threshold`` (as the
    ``get_transfer_index`` of Fast-dLLM and Megatron-Bridge do) rather than the default
    confidence > ``threshold``.
  exclusive: rule="entropy_budget" commits a position when the entropies ranked before
    it (not its own) sum to at most ``budget``: the k lowest entropies with
    H_1 + ... + H_(k-1) <= budget, one position more than the default where it fits.
    This is the acceptance of DiffusionGemma's ``EntropyBoundSampler`` in transformers
    (its running sum less each position's own entropy, formed the same way in float32),
    given the same entropies. Only with rule="entropy_budget" (else a ValueError).
Defaults against upstream: rule="topk" with confidence="probability" is LLaDA's
low-confidence remasking when the Sample's statistics are at temperature 1
(``sample_tokens(..., stats_temperature=1.0)``, or temperature=0); Fast-dLLM's and
Megatron-Bridge's threshold rule is rule="threshold", inclusive=True with the same
statistics; confidence="neg_entropy" is Megatron-Bridge's ``neg_entropy=True``.
``get_transfer_index`` is that upstream step itself.
A row with no valid draw (token -1) is never committed and never ranks above a valid one.
""")


_doc("add_gumbel_noise", """\
Upstream's ``add_gumbel_noise``: scores whose argmax over the last axis is a draw from
softmax(logits / temperature).

At temperature 0 it returns ``logits`` as they are (a LinearHead's logits formed), as
upstream does. Otherwise upstream returns exp(logits) / (-log u)^T in float64; this
returns its log divided by T, logits / T + g with g our keyed Gumbel noise
(``sample_tokens``'s, the same (seed, step) arguments), as a [..., K] float32 {array}:
the same argmax (a monotone map of upstream's form), no overflow of exp(logits), half
the bytes -- and its argmax is exactly ``sample_tokens(logits, temperature=T, seed=seed,
step=step).token``. Equal to upstream's in distribution, not in bits. It materialises
[..., K], as upstream's does; ``get_transfer_index`` and ``sample_tokens`` never do.
temperature: 0 or in [1e-3, 3.4e38] (``sample_tokens``'s range).
""")


_doc("get_num_transfer_tokens", """\
Upstream's ``get_num_transfer_tokens``: [B, steps] tokens to commit per step for a
linear schedule, {index_ints}. Row b gives mask_count_b // steps per step,
and its first mask_count_b % steps steps one more, mask_count_b the number of True
(non-zero) entries of mask_index [B, L]. ``steps`` is a positive int.""", index_ints={
    "torch": "int64",
    "jax": "int32 (int64 under x64)",
})


_doc("get_transfer_index", """\
Upstream's ``get_transfer_index``: ([B, L] x0, [B, L] bool transfer_index), from one
read of the logits (``sample_tokens``; no [B, L, K] noise or softmax).

Args:
  logits: [B, L, K] float logits, or a LinearHead standing for them.
  temperature: of the draw: x0 = argmax(add_gumbel_noise(logits, temperature)), greedy
    at 0 (ties to the lowest id); else in [1e-3, 3.4e38].
  remasking: "low_confidence" (confidence softmax(logits)[x0], at temperature 1 whatever
    the draw's) or "random" (a uniform per position, keyed like the noise); any other
    value raises NotImplementedError, as upstream.
  mask_index: [B, L] bool, the positions to fill; x: [B, L] int canvas whose dtype holds
    every id below K. x0 = where(mask_index, draw, x).
  num_transfer_tokens: per row k, an int or [B] or [B, 1] ints: without a threshold row b
    commits the k_b most confident positions, masked ones first (off the mask the
    confidence is -inf; past the masked count upstream's topk fills k with unmasked
    positions, where x0 = x, and so does this: the lowest ones). A k above L raises
    an error that is both a ValueError and upstream's RuntimeError (torch.topk's); where
    k cannot be read without a device sync (traced, or {device_arrays} outside
    ``sync_checks()``), every position is committed.
  threshold: a number (or [B]): every masked position whose confidence is >= threshold,
    and always the most confident one (num_transfer_tokens is then ignored).
  neg_entropy: with "low_confidence", the confidence is Σ_k p_k log p_k, p =
    softmax(logits) (upstream's Σ p log(p + 1e-10) is larger by less than K·1e-10).
  seed, step, backend: as ``sample_tokens`` (seed also [B], one per sequence).

Exactly upstream's: greedy tokens, which positions are committed, the k past the masked
count; ties at the k-th place go to the lower position (torch.topk leaves them
unspecified). Not upstream's bits: the draws (equal in distribution: keyed noise), the
confidences (float32 here, float64 upstream). x0 has x's dtype; a position whose logits
have no valid draw (NaN, +inf, none finite) keeps x and is never ranked above a valid one.
""")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
