"""The linear head for torch: ``LinearHead`` (weight [K, D] by default, as ``nn.Linear`` and
a tied ``nn.Embedding`` hold it) and the autograd.Function that runs a backend's kernels
over token chunks of ``hidden @ weight`` (the math and the two gradient schedules:
``dlm_kernels.linear_head.head``)."""

from __future__ import annotations


import torch

from . import head as base
from .head import MIN_PRODUCT_WIDTH, VOCAB_MAJOR, head_rows, row_chunk_for, row_chunks
from .._rows import Rows
from ..token_stats import formulas as stats_math
from ..token_stats.formulas import Stats
from .._torch.buffers import empty
from .._torch.first_order import first_order_only
from .._torch.ops import TorchOps
from .._torch.vocab_parallel import vocab_parallel_stats


class LinearHead(base.LinearHead[torch.Tensor]):
    """``logits = cap(hidden @ weight (+ bias))`` of torch tensors (``softcap=c``: cap(z) =
    c·tanh(z / c), else z), given in place of a logits tensor:
    ``LinearHead(hidden, weight, bias=None, softcap=None, *, weight_layout, row_chunk)``;
    weight [K, D] by default (``nn.Linear.weight``, a tied ``nn.Embedding``), or
    [D, K] with ``weight_layout="DK"``. Gradients flow to hidden, weight and bias; no
    backend but "reference" forms the [N, K] logits (``dlm_kernels.linear_head.head.LinearHead``
    has the whole story)."""
    DEFAULT_LAYOUT: str = VOCAB_MAJOR  # nn.Linear.weight / nn.Embedding.weight: [K, D]


# The head path's token chunks, its vocabulary chunk and a head's logits are the ops
# adapter's (TorchOps.head_token_chunks, head_vocab_chunk, head_logits), which the
# framework-neutral code (linear_head.head, the sampler) calls too.


def _mm_f32(a, b, out, accumulate):
    """out (+)= a @ b, ``out`` float32 (float64 for float64 inputs), the product accumulated
    in float32: 16-bit products are never rounded to 16 bits before they are summed across
    chunks. Same-dtype operands run as one GEMM writing (or adding into) ``out`` itself, so
    the accumulation costs no extra pass over it."""
    if a.dtype == out.dtype:
        return out.addmm_(a, b) if accumulate else torch.mm(a, b, out=out)
    if a.is_cuda:
        product = torch.mm(a, b, out_dtype=out.dtype)  # 16-bit operands, float32 result
    else:
        a, b = a.to(out.dtype), b.to(out.dtype)  # CPU: no mixed-precision mm; upcast the chunk
        return out.addmm_(a, b) if accumulate else torch.mm(a, b, out=out)
    return out.add_(product) if accumulate else out.copy_(product)


def _rows_mm_f32(a, b, out, accumulate):
    """``_mm_f32`` for a product whose rows are rows' own values (d hidden = dZ·Wᵀ):
    ``TorchOps.rows_matmul``, so a row's bits depend on neither the row count nor its
    position. Accumulated, the product is formed first and then added (a matmul that adds into
    ``out`` itself rounds the sum block by block of its own)."""
    if head_rows(a.shape[0]) == a.shape[0] and b.shape[1] >= MIN_PRODUCT_WIDTH \
            and not accumulate:
        return _mm_f32(a, b, out, False)  # straight into out
    product = TorchOps.rows_matmul(a, b, out.dtype)
    return out.add_(product) if accumulate else out.copy_(product)


class _HeadGrads:
    """The gradients of one head being formed chunk by chunk: dH [N, D], dW and db
    accumulated in float32 (float64 for a float64 head), rounded once in ``result``; with
    ``blocked``, dW is rounded block by block instead (``open_block`` .. ``close_block``)."""

    def __init__(self, head, need, blocked=False):  # need: (hidden, weight, bias) booleans
        self.head, self.need = head, need
        acc = torch.promote_types(head.dtype, torch.float32)
        self.dh = torch.zeros(head.hidden.shape, dtype=acc, device=head.hidden.device) \
            if need[0] else None
        # blocked: dW in the weight's own dtype, each vocabulary block finished in a float32
        # block accumulator (open_block .. close_block) and rounded once
        self.dw = (torch.empty if blocked else torch.zeros)(
            head.weight.shape, dtype=head.weight.dtype if blocked else acc,
            device=head.weight.device) if need[1] else None
        self.dw_block = None
        self.db = torch.zeros(head.bias.shape, dtype=acc, device=head.bias.device) \
            if need[2] and head.bias is not None else None

    def add(self, dz, r0, r1):
        # dz: [R, K] gradient of rows [r0, r1)'s logits, in the head's dtype
        head = self.head
        w, h = head.weight, head.hidden[r0:r1]
        major = head.weight_layout == VOCAB_MAJOR
        if head.softcap is not None:  # a teacher head's cap, applied where its chunk formed
            raw = TorchOps.head_logits(head.without_softcap().replace(hidden=h))  # [R, K]
            dz = (dz.float() * stats_math.softcap_slope(TorchOps, raw.float(), head.softcap)
                  ).to(head.dtype)
        if self.dh is not None:  # [R, K] x [K, D]: R·K·D multiply-adds, into dH's rows
            _rows_mm_f32(dz, w if major else w.t(), self.dh[r0:r1], accumulate=False)
        if self.dw is not None:  # [K, R] x [R, D] (or [D, R] x [R, K]): K·R·D, added to dW
            _mm_f32(dz.t(), h, self.dw, True) if major else _mm_f32(h.t(), dz, self.dw, True)
        if self.db is not None:
            self.db += dz.sum(0, dtype=self.db.dtype)

    def _w_cols(self, x, b0, b1):  # the rows (KD) or columns (DK) of a vocabulary block
        return x[b0:b1] if self.head.weight_layout == VOCAB_MAJOR else x[:, b0:b1]

    def open_block(self, b0, b1):
        if self.dw is not None:
            like = self._w_cols(self.dw, b0, b1)
            self.dw_block = torch.zeros(like.shape, dtype=torch.float32, device=like.device)

    def add_block(self, dz, r0, r1, b0, b1):
        # dz: [R, K_b] gradient of rows [r0, r1)'s logits in columns [b0, b1)
        head = self.head
        w, h = self._w_cols(head.weight, b0, b1), head.hidden[r0:r1]
        major = head.weight_layout == VOCAB_MAJOR
        if self.dh is not None:  # every block adds into the same rows of dH
            _rows_mm_f32(dz, w if major else w.t(), self.dh[r0:r1], accumulate=True)
        if self.dw_block is not None:
            if major:
                _mm_f32(dz.t(), h, self.dw_block, True)
            else:
                _mm_f32(h.t(), dz, self.dw_block, True)
        if self.db is not None:
            self.db[b0:b1] += dz.sum(0, dtype=self.db.dtype)

    def close_block(self, b0, b1):
        if self.dw_block is not None:
            self._w_cols(self.dw, b0, b1).copy_(self.dw_block)  # one rounding per element
            self.dw_block = None

    def reduce(self, group):
        """Vocabulary-parallel: each rank saw its own columns, so dH is a sum over ranks
        (the hidden states are replicated, as a column-parallel head's input is)."""
        if self.dh is not None:
            import torch.distributed as dist

            dist.all_reduce(self.dh, group=group)

    def fresh(self):
        """Empty accumulators of the same head, for ``absorb``."""
        return _HeadGrads(self.head, (False,) * 3)

    def absorb(self, other, scale):
        """Add ``scale`` times another schedule's float32 gradients of the same head, so
        the sum is rounded once (in ``result``), not each term."""
        for name in ("dh", "dw", "db"):
            mine, theirs = getattr(self, name), getattr(other, name)
            if theirs is None:
                continue
            setattr(self, name, theirs * scale if mine is None else mine.add_(theirs * scale))

    def result(self, scale=None, inplace=False):
        """(dH, dW, db) in the head's dtypes (None where not needed), times ``scale``;
        ``inplace`` scales the accumulators themselves (they are spent after it), so a
        float32 head's gradients are the accumulators, with no second copy."""
        head = self.head
        out = []
        for g, like in ((self.dh, head.hidden), (self.dw, head.weight), (self.db, head.bias)):
            if g is not None and scale is not None:
                g = g.mul_(scale) if inplace else g * scale
            out.append(None if g is None else g.to(like.dtype))
        return tuple(out)


class _ArrayGrads:
    """The gradient of a logits array (a teacher's, or a student's beside a teacher head):
    [N, K] in its dtype, each token chunk's d(logits) written into its rows; the methods
    of ``_HeadGrads``, so the sweep treats both alike."""

    def __init__(self, grad):
        self.grad = grad  # [N, K]

    def add(self, dz, r0, r1):
        self.grad[r0:r1] = dz

    def add_block(self, dz, r0, r1, b0, b1):
        self.grad[r0:r1, b0:b1] = dz

    def open_block(self, b0, b1):
        pass

    def close_block(self, b0, b1):
        pass

    def reduce(self, group):
        pass  # each rank's gradient is its own columns'

    def fresh(self):
        return _ArrayGrads(torch.zeros_like(self.grad))

    def absorb(self, other, scale):
        """The two terms summed in float32 and rounded here."""
        self.grad.copy_(self.grad.float() + other.grad.float() * scale)

    def result(self, scale=None, inplace=False):
        """(d logits, None, None): one rounding of the float32 product with ``scale``."""
        g = self.grad
        if scale is not None:
            g = g.mul_(scale) if inplace else (g.float() * scale).to(g.dtype)
        return (g, None, None)


class _GradsOf:
    """The accumulator of one part of the rows, by its kind (``LogitsSource.accept``)."""

    def __init__(self, need, blocked):
        self.need, self.blocked = need, blocked

    def array(self, logits):
        return _ArrayGrads(empty(logits.shape, logits.dtype, logits.device))

    def head(self, head):
        return _HeadGrads(head, self.need, self.blocked)


class _Sweep:
    """One pass over the token chunks of a head's rows: the statistics (when not given) and,
    given per-row cotangents, the gradients of every input that needs one."""

    def __init__(self, impl, cfg, rows, group):
        self.impl, self.cfg, self.rows, self.group = impl, cfg, rows, group
        self.plan = base.head_plan(rows.logits, rows.teacher, cfg.TEACHER_GRAD)  # once
        z = rows.logits  # rows of LogitsSources: the logits and/or the teacher a head
        n, k = rows.targets.shape[0], z.shape[-1]
        like = z.device_array
        on_cpu = like.device.type == "cpu"
        self.r = row_chunk_for(n, k, like.element_size(), on_cpu, z.row_chunk)
        self.cfg = cfg._replace(chunk_size=TorchOps.head_vocab_chunk(
            impl.name, on_cpu, cfg.chunk_size, self.r, k))

    def _chunk(self, r0, r1, cols=None):
        take = lambda a: a[r0:r1]
        # logits and teacher: rows [r0, r1), columns ``cols`` (all when None)
        part = lambda x: None if x is None else x.chunk(TorchOps, take, cols)
        rows = self.rows
        return Rows(part(rows.logits), part(rows.teacher), *(
            None if x is None else take(x) for x in rows[2:]))

    def blocks(self, need):
        """The vocabulary blocks of the gradient pass (``dw_blocks``), or None for token
        chunks over the whole vocabulary: blocks when a 16-bit student head's weight needs
        its gradient and the float32 accumulator would pass HEAD_DW_ACC_BYTES
        (HEAD_DW_ACC_BYTES_TORCH_CPU on a CPU), outside a
        vocabulary-parallel group, with no teacher head needing a gradient, on a backend
        whose backward takes a column offset (``vocab_shards``)."""
        z = self.rows.logits
        if (not self.plan.student_head_grad_only or self.group is not None or not need[0][1]
                or not self.impl.capabilities.vocab_shards
                or z.weight.dtype in (torch.float32, torch.float64)):
            return None
        on_cpu = z.weight.device.type == "cpu"
        return base.dw_blocks(z.vocab, z.width, base.HEAD_DW_ACC_BYTES_TORCH_CPU if on_cpu
                              else base.HEAD_DW_ACC_BYTES)

    def run_blocked(self, stats, grads, need, blocks):
        """The gradient pass over vocabulary blocks (outer) and token chunks (inner): each
        block's logits [R, K_b] and d(logits) from the row statistics as for a vocabulary
        shard at its offset; dH accumulates across blocks, each block's dW is finished
        before the next."""
        rows, cfg = self.rows, self.cfg
        n = rows.targets.shape[0]
        acc = _Accumulators(rows, need, cfg, blocked=True)
        for b0, b1 in blocks:
            acc.student.open_block(b0, b1)
            for r0, r1 in row_chunks(n, self.r):
                rc = self._chunk(r0, r1, (b0, b1))
                sc = Stats(*(s[r0:r1] for s in stats))
                kw = {"inplace": True} if self.impl.capabilities.inplace_grad else {}
                dz, du = self.impl.backward(rc, sc, tuple(g[r0:r1] for g in grads), cfg,
                                            offset=b0, **kw)
                acc.student.add_block(dz, r0, r1, b0, b1)
                if acc.teacher is not None:  # an array's (no teacher head needs a gradient)
                    acc.teacher.add_block(du, r0, r1, b0, b1)
            acc.student.close_block(b0, b1)
        return stats, acc

    def _stats(self, rc):
        if self.group is None:
            return self.impl.forward(rc, self.cfg), 0
        return vocab_parallel_stats(rc, self.impl, self.cfg, self.group)

    def run(self, stats=None, grads=None, need=None):
        """-> (Stats, gradients or None). ``grads``: 4 [N] float32 cotangents of (lse, logp,
        entropy, kl); ``need``: per Rows field, what of it needs a gradient (a head: three
        booleans; an array: one)."""
        rows, cfg = self.rows, self.cfg
        n = rows.targets.shape[0]
        blocks = None if grads is None or stats is None else self.blocks(need)
        if blocks is not None:
            return self.run_blocked(stats, grads, need, blocks)
        acc = None if grads is None else _Accumulators(rows, need, cfg)
        parts = []
        for r0, r1 in row_chunks(n, self.r):
            rc = self._chunk(r0, r1)
            if stats is None:
                sc, offset = self._stats(rc)
                parts.append(sc)
            else:
                sc = Stats(*(s[r0:r1] for s in stats))
                offset = self._offset(rc)
            if acc is not None:
                kw = {"offset": offset} if self.group is not None else {}
                if self.plan.overwrite_chunks and self.impl.capabilities.inplace_grad:
                    kw["inplace"] = True  # the chunk's logits are formed here: overwrite them
                dz, du = self.impl.backward(rc, sc, tuple(g[r0:r1] for g in grads), cfg, **kw)
                acc.add(dz, du, r0, r1)
        if stats is None and not parts:  # no rows, no chunks: empty statistics
            stats = Stats(*(torch.zeros(0, device=rows.targets.device) for _ in Stats._fields))
        elif stats is None:
            stats = Stats(*(torch.cat(f) for f in zip(*parts)))
        if acc is not None and self.group is not None:
            acc.reduce(self.group)
        return stats, acc

    def _offset(self, rc):
        if self.group is None:
            return 0
        import torch.distributed as dist

        return dist.get_rank(self.group) * rc.logits.shape[1]


class _Accumulators:
    """The gradients of the student (head or array) and of the teacher (when teacher_grad)."""

    def __init__(self, rows, need, cfg, blocked=False):
        def make(x, needed, blocked):
            if x is None or not any(needed):
                return None
            return x.accept(_GradsOf(needed, blocked))

        self.student = make(rows.logits, need[0], blocked)
        self.teacher = make(rows.teacher, need[1], False) if cfg.TEACHER_GRAD else None

    def add(self, dz, du, r0, r1):
        for acc, g in ((self.student, dz), (self.teacher, du)):
            if acc is not None:
                acc.add(g, r0, r1)

    def absorb(self, other, scale):
        """Fold ``scale`` times another schedule's gradients into these (heads in float32,
        rounded once later; an array's two terms summed in float32 and rounded here)."""
        for name in ("student", "teacher"):
            mine, theirs = getattr(self, name), getattr(other, name)
            if theirs is None:
                continue
            if mine is None:
                mine = theirs.fresh()
                setattr(self, name, mine)
            mine.absorb(theirs, scale)

    def reduce(self, group):
        for acc in (self.student, self.teacher):
            if acc is not None:
                acc.reduce(group)


# The flat layout of the Function's tensor arguments: each of the student and the teacher
# takes three slots (its ``arrays()``: a head's hidden, weight, bias; an array in the
# first), then the row fields after them, then the four coefficient rows of a
# gradient-in-forward call. The spec holds each part's source without its arrays.
_PART = 3
_ROW_FIELDS = Rows._fields[2:]  # targets, active, shift_ids, shift
_N_ROW = len(_ROW_FIELDS)


def _pack(rows, coefficients):
    spec, tensors = [], []
    for x in (rows.logits, rows.teacher):
        if x is None:
            spec.append(None)
            tensors += [None] * _PART
        else:
            arrays = x.arrays()
            spec.append(x.with_arrays((None,) * len(arrays)))
            tensors += list(arrays) + [None] * (_PART - len(arrays))
    tensors += list(rows[2:])
    tensors += list(coefficients) if coefficients is not None else [None] * 4
    return (tuple(spec), coefficients is not None), tensors


def _unpack(spec, tensors):
    (parts, planned) = spec
    out = []
    for i, kind in enumerate(parts):
        out.append(None if kind is None else kind.with_arrays(tensors[i * _PART:(i + 1) * _PART]))
    fields = tensors[2 * _PART:2 * _PART + _N_ROW]
    coefficients = tuple(tensors[2 * _PART + _N_ROW:]) if planned else None
    return Rows(out[0], out[1], *fields), coefficients


def _needs(parts, needs_input_grad):
    """Per part (student, teacher): what needs a gradient, from the flat input flags."""
    out = []
    for i, kind in enumerate(parts):
        flags = needs_input_grad[i * _PART:(i + 1) * _PART]
        out.append(() if kind is None else tuple(flags[:len(kind.arrays())]))
    return out


def _cotangents(grads, like):
    """4 [N] float32 row cotangents, zeros for the missing ones."""
    return tuple(torch.zeros_like(like, dtype=torch.float32) if g is None else g.float()
                 for g in grads)


def _flat_grads(acc, scale=None, inplace=False):
    """The gradients in the flat argument layout (None where there is none); ``inplace``:
    scaled in the accumulators themselves (spent after it)."""
    out = []
    for part in (acc.student, acc.teacher):
        out += [None] * _PART if part is None else list(part.result(scale, inplace))
    return out


# ctx.planned when the total's gradient comes from recomputation in the backward: after the
# planned gradients were handed out in place (a second backward through a retained graph),
# or when none were planned because the gradient pass runs over vocabulary blocks
_RECOMPUTE = object()


class _LinearHeadFunction(torch.autograd.Function):
    """Custom VJP of token statistics from linear heads. Saves the inputs plus O(N) row
    statistics; with coefficients (gradient in the forward) also the float32 gradients."""

    @staticmethod
    def forward(ctx, impl, cfg, group, spec, *tensors):
        rows, coefficients = _unpack(spec, tensors)
        ctx.set_materialize_grads(False)
        sweep = _Sweep(impl, cfg, rows, group)
        needs = _needs(spec[0], ctx.needs_input_grad[4:])
        plan = coefficients is not None and any(any(n) for n in needs)
        blocked = plan and sweep.blocks(needs) is not None
        grads = _cotangents(coefficients, rows.targets) if plan and not blocked else None
        stats, acc = sweep.run(grads=grads, need=needs)
        total = None
        if coefficients is not None:
            total = base.planned_total(TorchOps, stats, coefficients)
        ctx.impl, ctx.cfg, ctx.group, ctx.spec, ctx.needs = impl, cfg, group, spec, needs
        # float32 gradients of ``total`` (None: nothing needs one)
        ctx.planned = _RECOMPUTE if blocked else acc
        ctx.save_for_backward(*tensors, *stats)
        return (*stats_math.public_stats(stats), total)

    @staticmethod
    def backward(ctx, *cotangents):  # one per returned statistic (PUBLIC_STATS), then the total's
        # read once: under non-reentrant checkpointing each read unpacks (recomputes) again
        saved = ctx.saved_tensors
        with torch.no_grad():  # first derivatives, never recorded (see ``_first_order``)
            grads = _LinearHeadFunction._backward(ctx, saved, cotangents[:-1], cotangents[-1])
        inputs = (*saved, *cotangents)
        return first_order_only(ctx.impl.name, grads, inputs)

    @staticmethod
    def _backward(ctx, saved, given, g_total):
        row_cts = given  # the returned statistics' cotangents (the total's share folded below)
        n_in = len(saved) - len(Stats._fields)
        tensors, stats = saved[:n_in], Stats(*saved[n_in:])
        planned = ctx.planned if g_total is not None else None
        if planned is _RECOMPUTE:
            # the total's share recomputed from its coefficients, as the row cotangents are
            # (a second backward after the planned gradients were handed out in place, or a
            # gradient pass over vocabulary blocks, which needs every row's statistics first)
            rows, coefficients = _unpack(ctx.spec, tensors)
            scaled = [c * g_total.float() for c in _cotangents(coefficients, rows.targets)]
            row_cts = tuple(c if g is None else g.float() + c for g, c in zip(row_cts, scaled))
            planned = None
        acc = None
        if any(g is not None for g in row_cts):  # the recompute schedule
            rows, _ = _unpack(ctx.spec, tensors)
            sweep = _Sweep(ctx.impl, ctx.cfg, rows, ctx.group)
            grads = _cotangents(row_cts, rows.targets)
            _, acc = sweep.run(stats=stats, grads=grads, need=ctx.needs)
        if acc is not None and planned is not None:
            acc.absorb(planned, g_total.float())  # one rounding of the sum of both terms
            planned = None
        out = None
        if acc is not None:
            out = _flat_grads(acc)
        elif planned is not None:  # scaled in place: no second copy of the gradients
            out = _flat_grads(planned, g_total.float(), inplace=True)
            ctx.planned = _RECOMPUTE
        if out is None:
            out = [None] * (2 * _PART)
        fields = [None] * (len(tensors) - 2 * _PART)
        if ctx.needs_input_grad[4 + 2 * _PART + _ROW_FIELDS.index("shift")]:
            fields[_ROW_FIELDS.index("shift")] = _shift_grad(ctx, tensors, stats, g_total,
                                                             given)
        return (None, None, None, None, *out, *fields)


def _shift_grad(ctx, tensors, stats, g_total, row_cts):
    """d shift of the rows' whole cotangent (the total's share folded in): the shifted
    column's logit is one dot product per row (``stats_math.shift_columns``)."""
    rows, coefficients = _unpack(ctx.spec, tensors)
    grads = _cotangents(row_cts, rows.targets)
    if g_total is not None:
        scaled = [c * g_total.float() for c in _cotangents(coefficients, rows.targets)]
        grads = tuple(g + c for g, c in zip(grads, scaled))
    offset = 0
    if ctx.group is not None:
        import torch.distributed as dist

        offset = dist.get_rank(ctx.group) * rows.logits.shape[1]
    columns = stats_math.shift_columns(TorchOps, rows, ctx.cfg, offset)
    d_shift = stats_math.shift_grad(TorchOps, columns, rows, stats, grads, ctx.cfg)
    if ctx.group is not None:  # one shard holds each shifted column; the shift is replicated
        import torch.distributed as dist

        dist.all_reduce(d_shift, group=ctx.group)
    return d_shift


def apply_head(impl, cfg, rows, group, coefficients):
    """(lse, logp, entropy, kl, total) of rows whose logits and/or teacher are heads."""
    spec, tensors = _pack(rows, coefficients)
    return _LinearHeadFunction.apply(impl, cfg, group, spec, *tensors)
