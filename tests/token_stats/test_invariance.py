"""One row, one answer (docs/design.md §2): every per-row statistic and gradient of the
token-statistics primitive is a function of that row's inputs alone, bitwise, whatever the
batch around it — the number of rows, the row's position, a [B, L] or flat layout, padding
rows — and whichever internal path a backend takes (torch chunked: the compiled CPU loops,
the row-block tiles and the plain chunk loop; JAX chunked: its row blocks, a call of fewer
than 8 rows, a full block and the block that ends the rows). The Triton and
Pallas kernels have their own file (``test_invariance_kernels.py``)."""

from __future__ import annotations

import pytest

from .invariance import (FEATURES, SAMPLER_MODES, check_logp_ignores_entropy,
                         check_one_row_one_answer, check_sampler_one_row_one_answer)


@pytest.mark.parametrize("feature", sorted(FEATURES))
@pytest.mark.parametrize("fw_name,backend", [("torch", "chunked"), ("torch", "reference"),
                                             ("jax", "chunked"), ("jax", "reference")])
def test_one_row_one_answer(fw_name, backend, feature, monkeypatch):
    """K 12000: three vocabulary chunks of the CPU's 4096 columns, the last ragged; torch
    chunked on its eager paths (the compiled loops' threshold raised past K; they have their
    own test below)."""
    from dlm_kernels.token_stats import torch_compiled as tc

    monkeypatch.setattr(tc, "COMPILE_MIN_VOCAB", 1 << 30, raising=False)
    check_one_row_one_answer(fw_name, backend, 12000, feature)


def test_one_row_one_answer_compiled_loops(compiled_loops):
    """The torch chunked backend's compiled CPU loops (every K here: ``compiled_loops``) give
    a row the same bits alone (run as two copies of it) and in any batch, whatever block
    their rows fall in and however many threads share a block."""
    check_one_row_one_answer("torch", "chunked", 4500, "teacher")


def test_inplace_grad_writes_the_same_bits(compiled_loops):
    """``inplace_grad=True`` writes bitwise the gradient of the default call, on the compiled
    loops as on the eager paths: at K 4500 (compiled loops at every K, ``compiled_loops``)
    and at K 12000 on the eager tiles (the compiled loops' threshold past K). The in-place
    backward took the eager tiles wherever the default took the compiled loops: 1.1 M of
    2^24 elements an ulp or so apart at N 512, K 32768 (policy_loss), and 1.7x slower.
    float32 logits: a bfloat16 gradient's rounding hid the difference."""
    import numpy as np
    import torch

    import dlm_kernels.torch as dk

    rng = np.random.default_rng(7)
    for k, threshold in ((4500, 0), (12000, 1 << 30)):
        compiled_loops.COMPILE_MIN_VOCAB = threshold
        z0 = torch.tensor(rng.normal(size=(5, k)) * 3, dtype=torch.float32)
        y = torch.tensor(rng.integers(0, k, 5))
        w = torch.tensor([1.0, 0.0, 2.0, 1.0, 0.5])
        cot = [torch.tensor(rng.normal(size=5), dtype=torch.float32) for _ in range(3)]
        grads = []
        for inplace in (False, True):
            z = z0.clone().requires_grad_(True)
            # the configuration of test_chunked's in-place failure test: one compiled graph
            s = dk.token_stats(z, y, w, inplace_grad=inplace)
            total = (cot[0] * s.lse + cot[1] * s.logp + cot[2] * s.entropy).sum()
            (g,) = torch.autograd.grad(total, z)
            assert (g.data_ptr() == z.data_ptr()) == inplace
            grads.append(g.detach().clone())
        diff = (grads[0] != grads[1]).nonzero()
        assert len(diff) == 0, (f"K {k}: {len(diff)} elements differ, the first at "
                                f"{tuple(diff[0].tolist())}")


def test_the_torch_path_depends_on_k_alone():
    """Which torch chunked path runs is a function of K (and the features), never of N: a
    row-count threshold would move a row between paths that sum in different orders."""
    from dlm_kernels.token_stats import torch_compiled as tc

    k = tc.COMPILE_MIN_VOCAB
    assert tc.use_compiled(k) and not tc.use_compiled(k - 1)


# -- a row's logp does not depend on whether its entropy was asked for -----------------------

@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("fw_name,backend", [("torch", "chunked"), ("torch", "reference"),
                                             ("jax", "chunked"), ("jax", "reference")])
def test_logp_ignores_entropy(fw_name, backend, dtype, monkeypatch):
    """K 5000: torch chunked on its eager paths (two vocabulary chunks; the compiled loops
    have their own test below)."""
    from dlm_kernels.token_stats import torch_compiled as tc

    monkeypatch.setattr(tc, "COMPILE_MIN_VOCAB", 1 << 30, raising=False)
    check_logp_ignores_entropy(fw_name, backend, 5000, dtype)


def test_logp_ignores_entropy_compiled_loops(compiled_loops):
    """The torch chunked backend's compiled CPU loops (bfloat16: where Inductor's loop nest
    with the entropy's sum once summed Σ e^x in another order)."""
    check_logp_ignores_entropy("torch", "chunked", 4500, "bfloat16")


@pytest.mark.parametrize("mode", sorted(SAMPLER_MODES))
@pytest.mark.parametrize("fw_name,backend", [("torch", "chunked"), ("torch", "reference"),
                                             ("jax", "chunked"), ("jax", "reference")])
def test_sampler_one_row_one_answer(fw_name, backend, mode):
    """The denoising step's Sample fields (greedy, drawn, top-k) of each sequence alone and in
    a batch, bitwise: K 300 in vocabulary chunks of 128, the last ragged."""
    check_sampler_one_row_one_answer(fw_name, backend, 300, 128, mode)


# -- JAX: XLA's CPU code for a small [R, C] tile ----------------------------------------------

@pytest.mark.parametrize("feature", sorted(FEATURES))
@pytest.mark.parametrize("backend", ["chunked", "reference"])
def test_jax_small_vocabulary_one_row_one_answer(backend, feature):
    """K 37 (one chunk): XLA's CPU compiler emits other code for an [R, 37] tile of under
    about 4096 elements (a row's logp, entropy and gradient an ulp apart between 96 rows and
    128). A row alone and among the 552 rows of the tiled arrangement agree because every
    block, and the reference's whole-row program, holds at least ``min_block_rows`` rows."""
    check_one_row_one_answer("jax", backend, 37, feature)


@pytest.mark.parametrize("backend", ["chunked", "reference"])
def test_jax_ce_terms_rows_alone_small_vocabulary(backend):
    """K 37, the CE term's z-loss and label smoothing at T 0.7: the logp and d logits of 448
    rows (the first, then the last) alone against the same rows among 899, bitwise, under
    jit(value_and_grad). The reference backend's per-row products (lse_ce = m / T_ce + la_ce,
    λ·lse_ce², the smoothing's weights) were left to XLA to fuse into the sums that take
    them: 5 to 9 rows' logp an ulp apart between the two batches (seeds 37, 38, 40)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    import dlm_kernels.jax as D
    from harness import new_seed

    k, n, part = 37, 899, 448
    options = dict(temperature=0.7, ce_temperature=1.3, z_loss_weight=1e-3,
                   label_smoothing=0.1, backend=backend)

    def loss(z, y, g):
        logp = D.token_stats(z, y, **options).logp
        return jnp.sum(g * logp), logp

    program = jax.jit(jax.value_and_grad(loss, has_aux=True))
    for seed in (37, new_seed()):
        rng = np.random.default_rng(seed)
        z = (rng.normal(size=(n, k)) * 3).astype(np.float32)
        y, g = rng.integers(0, k, n), rng.normal(size=n).astype(np.float32)
        (_, logp), dz = program(z, y, g)
        for rows in (np.arange(part), np.arange(n - part, n)):
            (_, logp_part), dz_part = program(z[rows], y[rows], g[rows])
            for name, a, b in (("logp", logp_part, logp[rows]), ("d logits", dz_part, dz[rows])):
                a, b = np.asarray(a).reshape(part, -1), np.asarray(b).reshape(part, -1)
                bad = np.flatnonzero(~(a == b).all(1))  # rows with an element apart
                assert bad.size == 0, (
                    f"{backend} seed {seed}: {name} of rows {rows[bad][:8]} alone differ from "
                    f"the batch's (first: {a[bad[0]]!r} vs {b[bad[0]]!r})")


@pytest.mark.parametrize("mode", sorted(SAMPLER_MODES))
@pytest.mark.parametrize("backend", ["chunked", "reference"])
def test_jax_small_vocabulary_sampler_one_row_one_answer(backend, mode):
    """The step at K 37 over 3 x 200 rows (past min_block_rows(37) = 448 rows, so the batch
    runs in blocks of its own, not padded as a sequence alone is) against each sequence
    alone."""
    check_sampler_one_row_one_answer("jax", backend, 37, None, mode, shape=(3, 200))


@pytest.mark.parametrize("backend", ["chunked", "reference"])
def test_jax_wide_top_k_one_row_one_answer(backend):
    """top_k 64 at K 8192 over 2 x 68 rows: the slots' statistics of a [rows, 64] tile ran
    on rows padded to a multiple of 8 only, and a sequence's rows in a block of 136 and alone
    (68) fell on both sides of XLA's small-tile size (entropy an ulp apart, chunked); they
    run on at least min_block_rows(64) = 256 rows now."""
    check_sampler_one_row_one_answer("jax", backend, 8192, None, "wide_top_k", shape=(2, 68))


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_jax_vocab_parallel_one_row_one_answer(temperature):
    """JAX chunked under vocabulary parallelism (2 shards of K 96, chunks of 16; a teacher
    with its gradient, a LOO shift): every statistic and gradient of a row alone and among
    three equals its bits in a batch of 13. The shards' merge and ``finalize`` run on [N]
    arrays outside the row blocks, padded to a multiple of 8 (before: the lone last row's
    d logits was an ulp off for seed 0). With chunks of 16 columns a block holds at least
    ``min_block_rows(16)`` = 1024 rows, so 13 rows, 3 and 1 all run padded to one block of
    1024: this checks the merge and finalize, not blocks of different sizes (those:
    ``test_jax_gradient_rows_alone``)."""
    import jax
    import numpy as np
    from jax.sharding import Mesh, PartitionSpec as P

    import dlm_kernels.jax as D

    mesh = Mesh(np.array(jax.devices()[:2]), ("vocab",))
    tile, row = P(None, "vocab"), P()

    def local(z, u, y, x, d):
        return D.token_stats(z, y, teacher_logits=u, teacher_grad=True, temperature=temperature,
                             shift_ids=x, shift=d, vocab_axis="vocab", chunk_size=16,
                             backend="chunked")

    f = jax.shard_map(local, mesh=mesh, in_specs=(tile, tile, row, row, row), out_specs=row)
    _check_rows_alone(f, 13, 96, ([12], [0, 1, 2]))


#: keyword sets of test_jax_gradient_rows_alone: every per-row factor of the backward
ROWS_ALONE_OPTIONS = {
    "teacher T 0.7": dict(temperature=0.7),
    "CE terms": dict(temperature=0.7, ce_temperature=1.3, label_smoothing=0.1,
                     z_loss_weight=1e-3),
    "softcap": dict(temperature=1.6, teacher_temperature=0.5, softcap=20.0),
}


@pytest.mark.parametrize("options", sorted(ROWS_ALONE_OPTIONS))
@pytest.mark.parametrize("backend", ["chunked", "reference"])
def test_jax_gradient_rows_alone(backend, options):
    """K 4096 (one chunk; min_block_rows 8), 20 rows: a block of 16 rows, then one of 8 ending
    at row 20; a teacher with its gradient and a LOO shift, every weight 1 (an all-true mask
    XLA knows when compiling). Every output and gradient of rows 1, 11, 13 and 18 alone (each
    padded to one block of 8) against the batch. XLA fuses a product and the sum that takes
    it into one multiply-add where both share a fused loop, and a row's per-row factors (g /
    T and the CE term's coefficients) shared one with other sums in the row alone than in the
    batch: at T != 1 hundreds of d logits of a row were up to 3e-5 apart (``JaxOps.rounded``)."""
    import dlm_kernels.jax as D

    def stats(z, u, y, x, d):
        return D.token_stats(z, y, teacher_logits=u, teacher_grad=True, shift_ids=x, shift=d,
                             backend=backend, **ROWS_ALONE_OPTIONS[options])

    _check_rows_alone(stats, 20, 4096, ([1], [11], [13], [18]))


def test_jax_chunked_gradient_rows_alone_over_chunks():
    """As ``test_jax_gradient_rows_alone`` at T 0.7 with a teacher, in two chunks of 2048
    columns (min_block_rows(2048) = 8: the batch in blocks of 16 and 8 rows, a row alone in
    one of 8): the tiles' products, unrounded for logits given as arrays, are contracted
    alike in each chunk of the loop at every block height."""
    import dlm_kernels.jax as D

    def stats(z, u, y, x, d):
        return D.token_stats(z, y, teacher_logits=u, teacher_grad=True, shift_ids=x, shift=d,
                             temperature=0.7, chunk_size=2048, backend="chunked")

    _check_rows_alone(stats, 20, 4096, ([1], [11], [13], [18]))


def _check_rows_alone(stats, n, k, row_sets):
    """``stats(z, u, y, x, d)`` (a teacher, targets, shift ids and shifts of n rows of K): every
    output and the gradients of z, u and d of each set of ``row_sets`` alone against the
    same rows of the batch, bitwise, under jit; seed 0 and a fresh one."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from harness import new_seed

    for seed in (0, new_seed()):
        rng = np.random.default_rng(seed)
        z, u = ((rng.normal(size=(n, k)) * 3).astype(np.float32) for _ in range(2))
        y, x = rng.integers(0, k, n), rng.integers(0, k, n)
        d = rng.uniform(0.0, 4.0, n).astype(np.float32)
        g = [rng.normal(size=n).astype(np.float32) for _ in range(4)]

        def run(idx):
            idx = np.asarray(idx)
            cots = [jnp.asarray(gi[idx]) for gi in g]

            def loss(z_, u_, d_):
                s = stats(z_, u_, jnp.asarray(y[idx]), jnp.asarray(x[idx]), d_)
                return sum(jnp.sum(c * si) for c, si in zip(cots, s)), s

            (_, s), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(
                z[idx], u[idx], d[idx])
            return [np.asarray(v) for v in (*s, *grads)]

        batch = run(np.arange(n))
        for rows in row_sets:
            for name, a, b in zip(("lse", "logp", "entropy", "kl", "d logits", "d teacher",
                                   "d shift"), run(rows), batch):
                assert np.array_equal(a, b[rows]), (
                    f"seed {seed}: {name} of rows {rows} alone differs from the batch's in "
                    f"{int(np.sum(a != b[rows]))} elements")


@pytest.mark.parametrize("backend", ["chunked", "reference"])
def test_jax_row_blocks_under_x64(backend):
    """Under ``jax.enable_x64`` (Python ints and loop counters are int64 there) every tile
    and buffer index is one dtype: the token statistics with a gradient, the sampler and a
    LinearHead with a teacher head and their gradients, jitted, give the bits they give
    without x64 (the linear-head benchmark's float64 reference found an int64/int32 mix in
    the new loop buffer that raised, and the chunked backend raised under x64 before it)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    import dlm_kernels.jax as D
    from harness import new_seed

    rng = np.random.default_rng(new_seed())
    z = rng.normal(size=(19, 300)).astype(np.float32) * 3
    y = rng.integers(0, 300, 19)
    h, w = (rng.normal(size=s).astype(np.float32) for s in ((19, 16), (300, 16)))

    def run():
        zz, yy = jnp.asarray(z), jnp.asarray(y, jnp.int32)
        stats = lambda z: D.token_stats(z, yy, temperature=0.7, backend=backend)  # noqa: E731
        (_, s), g = jax.jit(jax.value_and_grad(lambda z: (stats(z).logp.sum(), stats(z)),
                                               has_aux=True))(zz)
        draw = jax.jit(lambda z: D.sample_tokens(z, temperature=0.8, seed=3, backend=backend))(zz)
        hh, ww = jnp.asarray(h), jnp.asarray(w)  # a LinearHead [K, D] with a teacher head
        head = lambda h, w: D.token_stats(  # noqa: E731
            D.LinearHead(h, w, weight_layout="KD", row_chunk=8), yy,
            teacher_logits=D.LinearHead(h, w * 0.5, weight_layout="KD"),
            teacher_grad=True, temperature=0.7, backend=backend).kl.sum()
        head_grads = jax.jit(jax.grad(head, argnums=(0, 1)))(hh, ww)
        return [np.asarray(v) for v in (*s, g, *draw, *head_grads)]

    plain = run()
    with jax.enable_x64(True):
        wide = run()
    for i, (a, b) in enumerate(zip(wide, plain)):
        assert a.dtype == b.dtype and np.array_equal(a, b, equal_nan=True), i


#: (head options, token_stats options) of test_linear_head_rows_alone
HEAD_CASES = {
    "plain": ({}, {}),
    "bias, softcap, shift, teacher head, chunks of 16 rows": (
        dict(bias=True, softcap=20.0, row_chunk=16), dict(shift=True, teacher=True)),
    # products 7 and 11 columns wide (d hidden, the logits): torch's CPU matmul rounded a row
    # by its position at output widths 5 to 11 (8 aside) until they were padded to 16
    "narrow products: D 7, K 11, shift": (dict(d=7, k=11), dict(shift=True)),
}


@pytest.mark.parametrize("case", sorted(HEAD_CASES))
@pytest.mark.parametrize("backend", ["chunked", "reference"])
@pytest.mark.parametrize("fw_name", ["torch", "jax"])
def test_linear_head_rows_alone(fw_name, backend, case):
    """A LinearHead (D 64, K 300, or a narrow D 7, K 11) at T 0.7: every statistic, d hidden and d shift of rows
    alone (0, 7, 69), and of rows 3-7, against the same rows among 70 (past one matmul group
    of 64 rows). The shift's gradient reads the shifted column's logit, one product of D per
    row summed (``LinearHead.column``): in JAX it differed alone before its rows were padded
    as whole-row arithmetic's. A head's logits and d hidden come from the platform's matmul, which on a CPU
    rounds a row by its row count (XLA: 1 row, and up to 48 rows at D 64; torch's: 1 and 2
    rows): before every such matmul ran on rows padded to a multiple of 64
    (``linear_head.head.head_rows``), a row alone differed from the batch's in both
    frameworks; in JAX, before every token chunk ran inside one loop and every product a
    sum takes was rounded on its own (``JaxOps.rounded``), a row's d hidden with a teacher
    head and chunks of 16 rows still did."""
    import numpy as np

    from harness import framework, new_seed

    fw = framework(fw_name)
    api = fw.api
    head_kw, stats_kw = HEAD_CASES[case]
    rng = np.random.default_rng(new_seed())
    n, d, k = 70, head_kw.get("d", 64), head_kw.get("k", 300)
    h, ht = (rng.normal(size=(n, d)).astype(np.float32) for _ in range(2))
    w, wt = ((rng.normal(size=(k, d)) * 0.2).astype(np.float32) for _ in range(2))
    bias = rng.normal(size=k).astype(np.float32) if head_kw.get("bias") else None
    y, x = rng.integers(0, k, n), rng.integers(0, k, n)
    shift = rng.uniform(0.0, 3.0, n).astype(np.float32)
    cots = [rng.normal(size=n).astype(np.float32) for _ in range(4)]
    softcap, row_chunk = head_kw.get("softcap"), head_kw.get("row_chunk")

    def run(idx):
        def fn(hidden, d_, weight, b, ids, sid, th, tw):
            head = api.LinearHead(hidden, weight, b, softcap, weight_layout="KD",
                                  row_chunk=row_chunk)
            kw = {}
            if stats_kw.get("shift"):
                kw.update(shift_ids=sid, shift=d_)
            if stats_kw.get("teacher"):
                kw.update(teacher_logits=api.LinearHead(th, tw, weight_layout="KD",
                                                        row_chunk=row_chunk))
            return tuple(api.token_stats(head, ids, temperature=0.7, backend=backend, **kw))

        outs, (dh, dd) = fw.vjp(fn, [fw.array(h[idx]), fw.array(shift[idx])],
                                [c[idx] for c in cots], args=(
            fw.array(w), None if bias is None else fw.array(bias), fw.array(y[idx]),
            fw.array(x[idx]), fw.array(ht[idx]), fw.array(wt)))
        return [*outs, dh, dd]

    batch = run(np.arange(n))
    for rows in ([0], [7], [69], [3, 4, 5, 6, 7]):
        for name, a, b in zip(("lse", "logp", "entropy", "kl", "d hidden", "d shift"),
                              run(np.array(rows)), batch):
            a, b = np.asarray(a), np.asarray(b)[rows]
            assert np.array_equal(a, b, equal_nan=True), (
                f"{fw_name} {backend}: {name} of rows {rows} alone differs from the batch's "
                f"in {int(np.sum(a != b))} elements")
