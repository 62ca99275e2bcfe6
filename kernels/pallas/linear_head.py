"""Pallas (Mosaic TPU) kernels of the fused linear head: the token statistics of
``logits = hidden @ weight (+ bias)`` with every logits tile computed on the MXU and used in
VMEM, so neither the [N, K] logits nor their gradient ever exist in HBM.

Three kernels, each the token-statistics math of ``token_stats`` (``fwd_body``,
``grad_tile``) fed by an MXU product instead of a logits read:

  forward   grid (N/BN rows "parallel", K/BK vocabulary "arbitrary"): z = h·Wᵀ per tile, the
            online row statistics in VMEM scratch across the vocabulary axis (1 matmul)
  dH        the same grid: z again, dz, then dH[BN, D] += dz·W in a float32 VMEM
            accumulator across the vocabulary axis, written once in h's dtype (2 matmuls);
            a teacher given as logits gets its gradient tile here
  dW, db    grid (K/BK vocabulary "parallel", N/BN rows "arbitrary"): z, dz, then
            dW[BK, D] += dzᵀ·h and db += Σ_rows dz in float32 VMEM accumulators across the
            rows, written once in the weight's dtype (2 matmuls): no float32 [K, D] in HBM

The teacher, when there is one, is a second stream of logits tiles: read from HBM (teacher
logits, whose gradient the dH kernel can write) or made on the MXU beside the student's (a
teacher head of its own width and layout, a constant); ``Part`` says which.

So a forward and backward costs 5 matmuls of 2·N·K·D FLOPs (the token-chunked path does 3 or
4, but it writes and reads [R, K] logits per chunk). dz enters the gradient matmuls rounded to
the inputs' dtype, as the logits path's gradient would; products accumulate in float32
(float32 inputs at full precision). Weight layouts: "KD" ([K, D], torch / tied embeddings)
or "DK" ([D, K], a Flax Dense kernel); W tiles are (BK, D) or (D, BK), D whole.

Ragged edges: rows past N and columns past K hold whatever the padded blocks read. The
forward masks columns past K to -inf (the logits kernel's rule) and drops rows past N on
store; the gradient kernels also zero dz there and the rows of h (dW) or W (dH) past the
edge, since a 0 times the padding's NaN would still be NaN inside a matmul.

Blocks: BK a multiple of 128 (lanes), BN a multiple of 16 (bfloat16 sublanes), D whole;
``head_blocks`` takes the first (BN, BK) of each kernel's preference order whose VMEM
estimate fits ``VMEM_BUDGET`` (12 MiB): double-buffered h, W (and teacher) blocks, the output
blocks, and float32 temporaries of the (BN, BK) tile. At D 2560, bfloat16: the forward and
dH (BN 256, BK 256; dH with a teacher BK 128), dW (BN 128, BK 256).
"""

import functools
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from . import token_stats as ts

VMEM_BUDGET = 12 * 1024 * 1024
VOCAB_MAJOR, HIDDEN_MAJOR = "KD", "DK"


class Part(NamedTuple):
    """How one stream of logits reaches a kernel: a head (``layout`` "KD" or "DK", hidden
    width ``width``, with or without a bias) or a logits array (``layout`` None), its arrays
    of ``itemsize`` bytes per element."""

    layout: Optional[str]
    width: int = 0
    has_bias: bool = False
    itemsize: int = 4

    @property
    def is_head(self):
        return self.layout is not None


def vmem_bytes(kind, bn, bk, d, itemsize, teacher=None):
    """VMEM estimate of one grid step of ``kind`` ("forward", "dh" or "dw"); ``teacher`` a
    Part (logits tiles, or a head's hidden and weight blocks) or None."""
    inputs = 2 * (bn * d + bk * d) * itemsize
    if teacher is not None:
        width = bn * bk if not teacher.is_head else (bn + bk) * teacher.width
        inputs += 2 * width * teacher.itemsize
    temporaries = bn * bk * 4 * 8
    # output blocks (double-buffered, the inputs' dtype) and the float32 accumulators
    outputs = {"forward": 2 * bn * 128 * 4, "dh": bn * d * (2 * itemsize + 4),
               "dw": (bk * d + bk) * (2 * itemsize + 4)}
    if kind == "dh" and teacher is not None and not teacher.is_head:
        outputs["dh"] += 2 * bn * bk * teacher.itemsize  # the teacher logits' gradient
    scratch = bn * 10 * 128 * 4 if kind == "forward" else 0
    return inputs + temporaries + outputs[kind] + scratch


def head_blocks(kind, k, d, itemsize, teacher=None, block_k=None, block_n=None):
    """(BN, BK) of ``kind``: the first pair of its preference order whose estimate fits, BK
    at most K rounded up to 128; ``block_n`` caps BN (the largest of 256, 128, ..., 16 not
    above it), ``block_k`` fixes BK (a multiple of 128). Never a function of the number of
    rows: BK sets the order of a row's sums over the vocabulary (and of dH's accumulation
    over it), and BN the shape of every logits tile's matmul, whose per-element order a
    compiler may choose by shape (docs/design.md §2, "One row, one answer"); a call of
    fewer rows runs one block of BN, its rows past N padding."""
    k_cap = max(128, -(-k // 128) * 128)
    bns = tuple(b for b in (256, 128, 64, 32, 16) if block_n is None or b <= block_n) or (16,)
    bks = (_round(block_k, 128),) if block_k else (512, 256, 128)
    if kind == "dw":  # dW re-reads h per vocabulary block: its intensity grows with BK
        order = [(bn, bk) for bk in bks for bn in bns]
    else:  # the forward and dH re-read W per row block: theirs grows with BN
        order = [(bn, bk) for bn in bns for bk in bks]
    for bn, bk in order:
        bk = min(bk, k_cap)
        if vmem_bytes(kind, bn, bk, d, itemsize, teacher) <= VMEM_BUDGET:
            return bn, bk
    return 16, 128


def _round(x, m):
    return max(m, (x // m) * m)


def _dot(a, b, dims):
    """a·b contracted over dims ((a_axis,), (b_axis,)), float32 out; float32 operands at full
    precision (the MXU's default is one bfloat16 pass)."""
    precision = jax.lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
    return jax.lax.dot_general(a, b, (dims, ((), ())), precision=precision,
                               preferred_element_type=jnp.float32)


def _logits_tile(h, w, b_ref, layout):
    """z (BN, BK) float32 = h (BN, D) · W tile ((BK, D) "KD", (D, BK) "DK") (+ bias)."""
    z = _dot(h, w, ((1,), (1,)) if layout == VOCAB_MAJOR else ((1,), (0,)))
    return z if b_ref is None else z + b_ref[...].astype(jnp.float32)


def _zero_past(x, axis, start, limit):
    """x with its entries whose index along ``axis`` (plus ``start``) reaches ``limit`` at 0."""
    ids = start + jax.lax.broadcasted_iota(jnp.int32, x.shape, axis)
    return jnp.where(ids < limit, x, jnp.zeros_like(x))


def _take(refs, part):
    """(tile loader of ``part`` from the front of refs, its refs, the rest)."""
    if not part.is_head:
        u_ref, *refs = refs
        return (lambda: u_ref[...].astype(jnp.float32)), (u_ref,), refs
    h_ref, w_ref, *refs = refs
    b_ref = refs.pop(0) if part.has_bias else None
    return (lambda: _logits_tile(h_ref[...], w_ref[...], b_ref, part.layout)), (
        h_ref, w_ref, b_ref), refs


def _streams(refs, student, teacher):
    """(the student's (h_ref, w_ref, b_ref), the teacher's tile loader or None, the rest)."""
    _, mine, refs = _take(refs, student)
    load_u = None
    if teacher is not None:
        load_u, _, refs = _take(refs, teacher)
    return mine, load_u, refs


def _w_spec(layout, bk, d, vocab_index):
    """The W tile of vocabulary block ``vocab_index(*grid ids)``."""
    if layout == VOCAB_MAJOR:
        return pl.BlockSpec((bk, d), lambda *g: (vocab_index(*g), 0))
    return pl.BlockSpec((d, bk), lambda *g: (0, vocab_index(*g)))


def _specs(part, bn, bk, blocks):
    """BlockSpecs of one part; ``blocks(*grid ids)`` -> (row block, vocabulary block)."""
    if not part.is_head:
        return [pl.BlockSpec((bn, bk), lambda *g: blocks(*g))]
    specs = [pl.BlockSpec((bn, part.width), lambda *g: (blocks(*g)[0], 0)),
             _w_spec(part.layout, bk, part.width, lambda *g: blocks(*g)[1])]
    if part.has_bias:
        specs.append(pl.BlockSpec((1, bk), lambda *g: (0, blocks(*g)[1])))
    return specs


def _operands(student_arrays, teacher_arrays):
    """The streamed operands in kernel order: (h, w, b) of the student, then the teacher's
    logits or (hidden, weight, bias); biases as [1, K] rows, absent ones left out."""
    out = []
    for arrays in (student_arrays, teacher_arrays):
        if arrays is None:
            continue
        if not isinstance(arrays, tuple):
            out.append(arrays)
            continue
        h, w, b = arrays
        out += [h, w] + ([b.reshape(1, -1)] if b is not None else [])
    return out


def _fwd_kernel(*refs, student, teacher, **statics):
    (h_ref, w_ref, b_ref), load_u, rest = _streams(refs, student, teacher)
    load_z = lambda: _logits_tile(h_ref[...], w_ref[...], b_ref, student.layout)  # noqa: E731
    ts.fwd_body(load_z, load_u, *rest, kb=pl.program_id(1), **statics)


def _grad(h, w, b_ref, load_u, ints_ref, floats_ref, kb, layout, statics):
    z = _logits_tile(h, w, b_ref, layout)
    return ts.grad_tile(z, load_u, ints_ref[...], floats_ref[...], kb=kb, mask_tail=True,
                        **statics)


def _dh_kernel(*refs, student, teacher, teacher_grad, n, **statics):
    (h_ref, w_ref, b_ref), load_u, rest = _streams(refs, student, teacher)
    ints_ref, floats_ref, dh_ref, *du, acc = rest  # acc: (BN, D) float32 VMEM scratch
    kb, layout = pl.program_id(1), student.layout

    @pl.when(kb == 0)
    def _init():
        acc[...] = jnp.zeros(acc.shape, acc.dtype)

    w = w_ref[...]
    dz, dt = _grad(h_ref[...], w, b_ref, load_u, ints_ref, floats_ref, kb, layout,
                   dict(statics, teacher_grad=teacher_grad))
    # W's rows past K are padding: zero them, so 0 · NaN does not reach dH
    w = _zero_past(w, 0 if layout == VOCAB_MAJOR else 1, kb * statics["bk"], statics["vocab"])
    dz = dz.astype(w.dtype)
    acc[...] += _dot(dz, w, ((1,), (0,)) if layout == VOCAB_MAJOR else ((1,), (1,)))
    if teacher_grad:
        du[0][...] = dt.astype(du[0].dtype)

    @pl.when(kb == pl.num_programs(1) - 1)
    def _write():  # rounded once, to the hidden states' dtype
        dh_ref[...] = acc[...].astype(dh_ref.dtype)


def _dw_kernel(*refs, student, teacher, n, **statics):
    (h_ref, w_ref, b_ref), load_u, rest = _streams(refs, student, teacher)
    ints_ref, floats_ref, *tail = rest  # then the outputs (dW, db), one accumulator each
    outs, accs = tail[:len(tail) // 2], tail[len(tail) // 2:]
    (dw_ref, *db), (dw_acc, *db_acc) = outs, accs  # float32 VMEM accumulators of each
    kb, rb = pl.program_id(0), pl.program_id(1)

    @pl.when(rb == 0)
    def _init():
        for ref in accs:
            ref[...] = jnp.zeros(ref.shape, ref.dtype)

    bn = h_ref.shape[0]
    h = _zero_past(h_ref[...], 0, rb * bn, n)  # rows past N are padding
    dz, _ = _grad(h, w_ref[...], b_ref, load_u, ints_ref, floats_ref, kb, student.layout,
                  dict(statics, teacher_grad=False))
    dz = _zero_past(dz, 0, rb * bn, n)
    g = dz.astype(h.dtype)
    if student.layout == VOCAB_MAJOR:  # [BK, D] += dzᵀ·h
        dw_acc[...] += _dot(g, h, ((0,), (0,)))
    else:  # [D, BK] += hᵀ·dz
        dw_acc[...] += _dot(h, g, ((0,), (0,)))
    if db:
        db_acc[0][...] += jnp.sum(dz, axis=0, keepdims=True)

    @pl.when(rb == pl.num_programs(1) - 1)
    def _write():  # rounded once, to the weight's (and bias's) dtype
        for ref, a in zip(outs, accs):
            ref[...] = a[...].astype(ref.dtype)


def _statics(vocab, bk, inv_t, inv_t_ce, inv_t_kl, softcap, has_softcap, has_shift, separate_ce,
             entropy, vocab_limit, padded, smoothing, ce_terms):
    return dict(vocab=vocab, bk=bk, inv_t=inv_t, inv_t_ce=inv_t_ce, inv_t_kl=inv_t_kl,
                softcap=softcap, has_softcap=has_softcap, has_shift=has_shift,
                separate_ce=separate_ce, entropy=entropy, vocab_limit=vocab_limit,
                padded=padded, smoothing=smoothing, ce_terms=ce_terms)


def _parts(head, teacher, layout, teacher_layout):
    """(student Part, teacher Part or None) of the arrays given."""
    h, w, b = head
    student = Part(layout, h.shape[1], b is not None, h.dtype.itemsize)
    if teacher is None:
        return student, None
    if not isinstance(teacher, tuple):
        return student, Part(None, itemsize=teacher.dtype.itemsize)
    hu, _, bu = teacher
    return student, Part(teacher_layout, hu.shape[1], bu is not None, hu.dtype.itemsize)


def head_forward(head, teacher, ints, floats, *, layout, teacher_layout=None, inv_t, inv_t_ce,
                 inv_t_kl, softcap, has_softcap, has_shift, separate_ce, entropy, vocab_limit,
                 padded, smoothing, ce_terms, block_k=None, block_n=None, interpret=False,
                 detect_races=False):
    """Row statistics [N, stats_width] (as ``token_stats.stats_forward``) of the student head =
    (h [N, D], w [K, D] "KD" or [D, K] "DK", b [K] or None) in ``layout``, with the teacher
    None, logits u [N, K], or its own head (hu, wu, bu) in ``teacher_layout``; ints [N, 3],
    floats [N, 2] as ``token_stats.stats_forward``."""
    h, w, _ = head
    n, d = h.shape
    k = w.shape[0] if layout == VOCAB_MAJOR else w.shape[1]
    student, tpart = _parts(head, teacher, layout, teacher_layout)
    bn, bk = head_blocks("forward", k, d, h.dtype.itemsize, tpart, block_k, block_n)
    kernel = functools.partial(
        _fwd_kernel, student=student, teacher=tpart, partial=False,
        **_statics(k, bk, inv_t, inv_t_ce, inv_t_kl, softcap, has_softcap, has_shift,
                   separate_ce, entropy, vocab_limit, padded, smoothing, ce_terms))
    blocks = lambda i, j: (i, j)  # noqa: E731
    row = lambda width: pl.BlockSpec((bn, width), lambda i, j: (i, 0))  # noqa: E731
    specs = _specs(student, bn, bk, blocks) + (_specs(tpart, bn, bk, blocks) if tpart else [])
    operands = _operands(head, teacher) + [ints, floats]
    return pl.pallas_call(
        kernel,
        out_shape=ts._out_struct((n, ts.stats_width(smoothing)), jnp.float32, operands),
        grid=(pl.cdiv(n, bn), pl.cdiv(k, bk)),
        in_specs=specs + [row(ts.N_INTS), row(ts.FWD_FLOATS)],
        out_specs=row(ts.stats_width(smoothing)),
        scratch_shapes=ts.scratch_shapes(bn, smoothing, partial=False),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
        interpret=ts._interpret_arg(interpret, detect_races),
        name="dlm_linear_head_fwd",
    )(*operands)


def head_backward(head, teacher, ints, floats, *, layout, teacher_layout=None, inv_t, inv_t_ce,
                  inv_t_kl, softcap, has_softcap, has_shift, separate_ce, teacher_grad, entropy,
                  vocab_limit, padded, smoothing, ce_terms, block_k=None, block_n=None,
                  interpret=False, detect_races=False):
    """-> (dh [N, D], dw in w's layout, db [K] or None, each in its input's dtype, summed in
    float32 VMEM and rounded once; du [N, K] in the teacher logits' dtype or None); arguments
    as ``head_forward``, floats [N, 16] as
    ``token_stats.stats_backward``. ``teacher_grad`` needs the teacher as logits."""
    h, w, b = head
    n, d = h.shape
    k = w.shape[0] if layout == VOCAB_MAJOR else w.shape[1]
    student, tpart = _parts(head, teacher, layout, teacher_layout)
    if teacher_grad and (tpart is None or tpart.is_head):
        raise ValueError("teacher_grad needs the teacher as logits in the fused head kernels")
    mode = dict(interpret=ts._interpret_arg(interpret, detect_races))
    stat = functools.partial(_statics, k, inv_t=inv_t, inv_t_ce=inv_t_ce, inv_t_kl=inv_t_kl,
                             softcap=softcap, has_softcap=has_softcap, has_shift=has_shift,
                             separate_ce=separate_ce, entropy=entropy, vocab_limit=vocab_limit,
                             padded=padded, smoothing=smoothing, ce_terms=ce_terms)
    operands = _operands(head, teacher) + [ints, floats]
    params = pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary"))

    # dH (and the teacher logits' gradient): rows outer, vocabulary inner
    bn, bk = head_blocks("dh", k, d, h.dtype.itemsize, tpart, block_k, block_n)
    blocks = lambda i, j: (i, j)  # noqa: E731
    row = lambda width: pl.BlockSpec((bn, width), lambda i, j: (i, 0))  # noqa: E731
    specs = _specs(student, bn, bk, blocks) + (_specs(tpart, bn, bk, blocks) if tpart else [])
    out_shape = [ts._out_struct((n, d), h.dtype, operands)]
    out_specs = [row(d)]
    if teacher_grad:
        out_shape.append(ts._out_struct(teacher.shape, teacher.dtype, operands))
        out_specs.append(pl.BlockSpec((bn, bk), blocks))
    outs = pl.pallas_call(
        functools.partial(_dh_kernel, student=student, teacher=tpart, teacher_grad=teacher_grad,
                          n=n, **stat(bk=bk)),
        out_shape=out_shape, grid=(pl.cdiv(n, bn), pl.cdiv(k, bk)),
        in_specs=specs + [row(ts.N_INTS), row(ts.BWD_FLOATS)], out_specs=out_specs,
        scratch_shapes=[pltpu.VMEM((bn, d), jnp.float32)],
        compiler_params=params, name="dlm_linear_head_dh", **mode,
    )(*operands)
    dh, du = outs[0], (outs[1] if teacher_grad else None)

    # dW and db: vocabulary outer, rows inner (grid ids (vocabulary j, rows i))
    bn, bk = head_blocks("dw", k, d, h.dtype.itemsize, tpart, block_k, block_n)
    blocks = lambda j, i: (i, j)  # noqa: E731
    row = lambda width: pl.BlockSpec((bn, width), lambda j, i: (i, 0))  # noqa: E731
    specs = _specs(student, bn, bk, blocks) + (_specs(tpart, bn, bk, blocks) if tpart else [])
    dw_shape = (k, d) if layout == VOCAB_MAJOR else (d, k)
    out_shape = [ts._out_struct(dw_shape, w.dtype, operands)]
    out_specs = [_w_spec(layout, bk, d, lambda j, i: j)]
    scratch = [pltpu.VMEM((bk, d) if layout == VOCAB_MAJOR else (d, bk), jnp.float32)]
    if b is not None:
        out_shape.append(ts._out_struct((1, k), b.dtype, operands))
        out_specs.append(pl.BlockSpec((1, bk), lambda j, i: (0, j)))
        scratch.append(pltpu.VMEM((1, bk), jnp.float32))
    outs = pl.pallas_call(
        functools.partial(_dw_kernel, student=student, teacher=tpart, n=n, **stat(bk=bk)),
        out_shape=out_shape, grid=(pl.cdiv(k, bk), pl.cdiv(n, bn)),
        in_specs=specs + [row(ts.N_INTS), row(ts.BWD_FLOATS)], out_specs=out_specs,
        scratch_shapes=scratch, compiler_params=params, name="dlm_linear_head_dw", **mode,
    )(*operands)
    dw, db = outs[0], (outs[1][0] if b is not None else None)
    return dh, dw, db, du
