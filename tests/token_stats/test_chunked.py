"""The token-statistics primitive on the chunked backends, torch and JAX: the suite of
``suite.py`` over ragged vocabulary chunks, torch.compile, and torch's CPU row blocks."""

from __future__ import annotations

import numpy as np
import pytest

import oracle
from dlm_kernels.testing import TOLERANCES, tolerance
from harness import assert_close, assert_exact_zero, cases

from .suite import (FEATURES, ROTATED_SHAPE_DTYPES, ChunkedSuite, TokenStatsSuite,
                    TorchCompileChecks, TorchInplaceChecks, make_case, shift_tie_case)


class TestTorchChunked(TorchInplaceChecks, TorchCompileChecks, ChunkedSuite):
    FW = "torch"
    COMPILE_CHUNK = 32

    def test_torch_compile_inductor(self, rng):
        """What users run: torch.compile's default backend, Inductor (C++ on CPU), with
        fullgraph=True: forward and backward over two vocabulary chunks, every feature on,
        equal to eager."""
        fw = self.fw
        case = make_case(fw, rng, (2, 3), 97, "float32", FEATURES["all"], poison=False)

        def loss(z):
            s = fw.api.token_stats(z, case["y"], case["w"], teacher_logits=case["u"],
                                   chunk_size=64, backend=self.BACKEND, **case["api_kw"])
            return s.logp.sum() + 0.5 * s.entropy.sum() + s.kl.sum() + 0.1 * s.lse.sum()

        self.check_compiled(loss, case["z"], backend="inductor")

    def test_noncontiguous_inputs(self, rng):
        """Transposed and sliced logits give the same answer as contiguous copies."""
        import torch

        fw = self.fw
        base = fw.array(rng.normal(size=(40, 6, 2)) * 3, "float32")
        z = base.permute(1, 2, 0)[:, :, 3:]  # [6, 2, 37], no unit stride on the last dim
        assert not z.is_contiguous()
        y = fw.array(rng.integers(0, 37, (6, 2)))
        u = fw.array(rng.normal(size=(6, 2, 37)), "float32")
        kw = dict(teacher_logits=u, temperature=0.8, backend=self.BACKEND, chunk_size=16)
        z1 = z.detach().clone().requires_grad_(True)
        z2 = z.detach().contiguous().requires_grad_(True)
        s1, s2 = fw.api.token_stats(z1, y, **kw), fw.api.token_stats(z2, y, **kw)
        g1, = torch.autograd.grad(sum(v.sum() for v in s1), z1)
        g2, = torch.autograd.grad(sum(v.sum() for v in s2), z2)
        for a, b in zip(s1, s2):
            assert_close(fw.numpy(a), fw.numpy(b))
        assert_close(fw.numpy(g1), fw.numpy(g2))


class TestTorchChunkedRowBlocks:
    """The CPU schedule of the torch chunked backend (``token_stats/torch_row_blocks.py``)
    with blocks of 5 rows over two workers and tiles of 128 columns: 12 rows make blocks of 5, 5 and 2,
    K = 1271 ten tiles, the last ragged. Every feature the in-place tile gradient covers
    (entropy off), and the general path (softcap, teacher gradient) in blocks, float32 and
    bfloat16, inactive rows poisoned with NaN/inf."""

    FW, BACKEND = "torch", "chunked"

    @pytest.fixture(autouse=True)
    def small_blocks(self, monkeypatch):
        import torch

        from dlm_kernels.token_stats import (torch_chunked as _chunked,
                                             torch_row_blocks as _row_blocks)

        monkeypatch.setattr(_row_blocks, "ROW_BLOCK", 5)
        monkeypatch.setattr(_row_blocks, "BLOCK_ELEMENTS", 0)  # blocks of 5 rows at any K
        monkeypatch.setattr(_row_blocks, "WORKER_ELEMENTS", 1)  # and two workers on them
        monkeypatch.setattr(_chunked, "TILE_BYTES", 5 * 4 * 128)
        threads = torch.get_num_threads()
        torch.set_num_threads(2)  # two workers even on a one-core runner
        yield
        torch.set_num_threads(threads)

    @pytest.mark.parametrize("feature,dtype", [
        ("plain", "float32"), ("temperature", "bfloat16"), ("ce_temperature", "float32"),
        ("shift", "bfloat16"), ("teacher", "float32"), ("all", "float32")])
    def test_row_blocks_match_the_oracle(self, rng, feature, dtype):
        suite = TestTorchChunked()
        case = make_case(suite.fw, rng, (4, 3), 1271, dtype, FEATURES[feature])
        suite.check(case, rng, dtype, entropy=False)
        suite.check(case, rng, dtype, chunk_size=300, entropy=feature == "all")


    @pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
    def test_negative_shift_at_the_row_max(self, rng, dtype):
        """A LOO shift is often negative. Each active row's shifted column is its max by 120,
        and the shift takes it 150-250 below: the max of the shifted row is another column's,
        and a max taken before the shift would leave every e^x of the row to underflow (the
        tiles take the shifted tile's max, whatever the shift's sign)."""
        fw = TestTorchChunked().fw
        case = make_case(fw, rng, (4, 3), 1271, dtype, FEATURES["shift"])
        n, z = case["n"], case["z_np"].copy()  # [N, K] float64 of what the backend sees
        x = rng.integers(0, case["k"], size=n)
        act = case["active"]
        z[act, x[act]] = z[act].max(axis=1) + 120.0
        d = -rng.uniform(150.0, 250.0, size=n).astype(np.float32)
        case["z"] = fw.array(z.reshape(case["rows"] + (case["k"],)), dtype)
        case["z_np"] = fw.numpy(case["z"]).reshape(n, case["k"])
        case["api_kw"].update(shift_ids=fw.array(x.reshape(case["rows"])),
                              shift=fw.array(d.reshape(case["rows"])))
        case["ora_kw"].update(x=x, d=d.astype(np.float64))
        TestTorchChunked().check(case, rng, dtype, entropy=False)

    @pytest.mark.parametrize("kind,temperature,entropy", TokenStatsSuite.SHIFT_TIES, ids=str)
    def test_shift_gradient_at_ties(self, rng, kind, temperature, entropy):
        """The suite's ``test_shift_gradient_at_ties`` in row blocks and tiles of 128 columns
        (without entropy: the in-place tile gradient, ``_tile_grads_into``)."""
        TestTorchChunked().check_shift_ties(rng, kind, temperature, entropy)


class TestTorchChunkedCompiled:
    """The compiled CPU forward and backward (``token_stats/torch_compiled.py``) at small
    shapes: every call compiles (no size threshold); the backward in blocks of 5 rows (12
    rows: 5, 5, 2; 13 rows: 5, 8, no block of one row), the forward in tiles of 300 columns
    (1271: four of 300, the last 371) merged, against the oracle: temperatures, the shift,
    the teacher, and everything at once (softcap, entropy, teacher gradient too), float32
    and bfloat16, inactive rows poisoned with NaN/inf."""

    FW, BACKEND = "torch", "chunked"

    @pytest.fixture(autouse=True)
    def compiled_everywhere(self, monkeypatch, compiled_loops):
        from dlm_kernels.token_stats import torch_chunked

        tc = compiled_loops
        monkeypatch.setattr(tc, "BLOCK_BYTES", 5 * 4 * 1271)
        monkeypatch.setattr(tc, "SUM_COLUMNS", 300)  # 1271 columns: tiles of 300, the last 371
        forward, backward = [], []
        real_forward, real_backward = tc.compiled_partial, tc.compiled_grads
        monkeypatch.setattr(torch_chunked, "compiled_partial",
                            lambda *a: forward.append(real_forward(*a)) or forward[-1])
        monkeypatch.setattr(torch_chunked, "compiled_grads",
                            lambda *a: backward.append(real_backward(*a)) or backward[-1])
        yield
        assert forward and all(s is not None for s in forward), "the compiled forward did not run"
        assert backward and all(backward), "the compiled backward did not run"

    @pytest.mark.parametrize("feature,dtype,rows", [
        ("plain", "float32", (4, 3)), ("temperature", "bfloat16", (13,)),
        ("shift", "bfloat16", (4, 3)), ("teacher", "float32", (13,)), ("all", "float32", (4, 3))])
    def test_compiled_forward_matches_the_oracle(self, rng, feature, dtype, rows):
        suite = TestTorchChunked()
        case = make_case(suite.fw, rng, rows, 1271, dtype, FEATURES[feature])
        suite.check(case, rng, dtype, entropy=feature == "all")

    def test_compiled_forward_recomputes_each_shifted_tile(self, rng):
        """The tiles run unshifted and each row's tile that holds its shifted column runs
        again on the gathered rows: rows 0-3 share a tile (two on one column), row 4 is
        alone in its tile of the first block (repeated, no size of 1), tile edges 0, 299,
        300 and 1270, a shifted column that is the target, tiles no row of a block shifts
        into, and a shift of 40 that puts nearly all of a row's mass on its shifted column."""
        suite = TestTorchChunked()
        case = make_case(suite.fw, rng, (13,), 1271, "float32", FEATURES["shift"])
        x = np.array([700, 700, 650, 899, 10, 0, 299, 300, 1270, 0, 1000, 1100, 1200])
        x[9] = case["y_np"][9]
        d = rng.uniform(0.0, 6.0, size=13).astype(np.float32)
        d[[2, 6]] = 40.0
        case["api_kw"].update(shift_ids=suite.fw.array(x), shift=suite.fw.array(d))
        case["ora_kw"].update(x=x, d=d.astype(np.float64))
        suite.check(case, rng, "float32", entropy=True)

    def test_shift_gradient_at_ties(self, rng):
        """The suite's ``test_shift_gradient_at_ties`` through the compiled loops, once: at
        the configuration of ``test_compiled_forward_recomputes_each_shifted_tile`` (T = 1,
        entropy), whose compiled graphs it shares."""
        TestTorchChunked().check_shift_ties(rng, "huge", 1.0, True)


def test_plain_chunk_loop_shift_gradient_at_ties(rng, monkeypatch):
    """The suite's ``test_shift_gradient_at_ties`` through the plain chunk loop (what runs
    on an accelerator and under torch.compile: ``stats_math.chunk_grads`` chunk by chunk)."""
    from dlm_kernels.token_stats import torch_chunked

    monkeypatch.setattr(torch_chunked, "use_row_blocks", lambda x: False)
    for kind, temperature, entropy in TokenStatsSuite.SHIFT_TIES:
        TestTorchChunked().check_shift_ties(rng, kind, temperature, entropy, chunk_size=100)


@pytest.mark.parametrize("dtype,temperature", [("float32", 1e-3), ("bfloat16", 1e-4)])
def test_tile_gradient_is_the_shared_math(rng, monkeypatch, dtype, temperature):
    """The in-place tile gradient (``_tile_grads_into``, hand-fused for speed) equals
    ``stats_math.chunk_grads`` run over the same row blocks and saved statistics, at the
    inputs where how a logit is formed shows (``shift_tie_case``: the LOO shift at the row
    max, fl(z_x + d) rounding, T small enough for its error to pass the dtype's rounding),
    with every feature the tiles cover: a teacher
    (stop-gradient), T_ce, label smoothing, z-loss and padding columns. Each within the
    float32 error model of a backward from saved statistics (twice: two implementations)."""
    from dlm_kernels.token_stats import torch_chunked

    fw = TestTorchChunked().fw
    k, v, T, eps, lam = 307, 300, temperature, 0.1, 1e-4
    T_ce = 1.5 * T
    case = shift_tie_case(fw, rng, "small T", T, k, dtype)
    n, x, y = case["n"], case["x"], np.minimum(case["y"], v - 1)
    u = rng.normal(size=(n, k)).astype(np.float32) * 0.03
    kw = dict(temperature=T, ce_temperature=T_ce, teacher_temperature=2 * T,
              label_smoothing=eps, z_loss_weight=lam, vocab_size=v, entropy=False)
    cots = [rng.normal(size=n).astype(np.float32) for _ in range(3)]  # lse, logp, kl

    def grads():
        def fn(z):
            st = fw.api.token_stats(z, fw.array(y), shift_ids=fw.array(x),
                                    shift=fw.array(case["d"]), teacher_logits=fw.array(u),
                                    backend="chunked", **kw)
            return st.lse, st.logp, st.kl
        return fw.vjp(fn, [case["z"]], cots)[1][0]

    calls = []
    tiles = torch_chunked._tile_grads_into
    monkeypatch.setattr(torch_chunked, "_tile_grads_into",
                        lambda *a: calls.append(1) or tiles(*a))
    fused = grads()
    assert calls, "the tile gradient did not run"
    monkeypatch.setattr(torch_chunked, "_tile_grads_into",
                        lambda dz, rows, stats, g, cfg, offset:
                        torch_chunked._grads_into(dz, None, rows, stats, g, cfg, offset))
    shared = grads()
    g = [cots[0], cots[1], np.zeros(n), cots[2]]
    slack = oracle.saved_lse_slack(case["r"][:, :v], y, np.ones(n, bool), g, T=T, T_ce=T_ce,
                                   u=u[:, :v].astype(np.float64), T_kl=2 * T,
                                   label_smoothing=eps, z_loss_weight=lam)
    # two results each rounded to the dtype: ``tolerance``'s rounded_twice rtol
    rounding = (tolerance(dtype, rounded_twice=True)[1] - TOLERANCES[dtype][1]) * np.abs(shared)
    assert_close(fused[:, :v], shared[:, :v], dtype, "tile d logits vs chunk_grads",
                 slack=2 * slack + rounding[:, :v])
    assert_exact_zero(fused[:, v:], "tile d logits of padding columns")


def test_compiled_sums_over_flat_rows(rng, monkeypatch, compiled_loops):
    """A student near uniform over K = 131072 (logits in [-0.01, 0] at T = 100: terms of
    its sum within 1e-4 of each other), a teacher of scale 30: float32 sums lane by lane
    over whole rows (8192 terms a lane) round each near-equal term the same way, and the
    KL came out about 6e-4 relative off (tests/test_domain.py found it); the compiled
    tiles' sums (SUM_COLUMNS) meet the float32 tolerance against the float64 oracle."""
    import torch

    import dlm_kernels.torch as D
    import oracle
    from dlm_kernels.token_stats import torch_chunked

    tc = compiled_loops
    ran = []
    monkeypatch.setattr(torch_chunked, "compiled_partial",
                        lambda *a: ran.append(tc.compiled_partial(*a)) or ran[-1])

    n, k = 4, 131072
    z = rng.uniform(-0.01, 0.0, size=(n, k))
    u = rng.normal(size=(n, k)) * 30.0
    y = rng.integers(0, k, size=n)
    s = D.token_stats(torch.tensor(z, dtype=torch.float32), torch.tensor(y),
                      teacher_logits=torch.tensor(u, dtype=torch.float32), temperature=100.0,
                      entropy=False, backend="chunked")
    z32, u32 = z.astype(np.float32).astype(np.float64), u.astype(np.float32).astype(np.float64)
    lse, logp, _, kl = oracle.token_stats(z32, y, np.ones(n, bool), u=u32, T=100.0)
    for name, got, exp in (("lse", s.lse, lse), ("logp", s.logp, logp), ("kl", s.kl, kl)):
        assert_close(got.numpy(), exp, "float32", name)
    assert ran and ran[0] is not None, "the compiled forward did not run"


def test_compiled_row_blocks_leave_no_block_of_one_row(monkeypatch):
    """Dynamo specialises a size of 1: a remainder of one row joins the block before it."""
    from dlm_kernels.token_stats import torch_compiled as tc

    monkeypatch.setattr(tc, "BLOCK_BYTES", 5 * 4 * 1271)
    assert tc.row_blocks(12, 1271) == [(0, 5), (5, 10), (10, 12)]
    assert tc.row_blocks(11, 1271) == [(0, 5), (5, 11)]
    assert tc.row_blocks(1, 1271) == [(0, 1)]


def test_compiled_forward_falls_back_when_it_cannot_compile(rng, monkeypatch):
    """No C++ compiler (a compile that raises): one warning, the eager tiles' answer, and no
    compile tried again in the process; after a compile has worked, a failure (Dynamo's
    recompile limit) sends only that call to the tiles."""
    from dlm_kernels.token_stats import torch_compiled as tc

    def no_compiler(*args):
        raise RuntimeError("no C++ compiler found")

    monkeypatch.setattr(tc, "COMPILE_MIN_VOCAB", 0)
    monkeypatch.setattr(tc._Compiled, "fn", no_compiler)
    monkeypatch.setattr(tc._Compiled, "worked", False)
    monkeypatch.setattr(tc._Compiled, "failed", False)
    monkeypatch.setattr(tc._Compiled, "warned", False)
    suite = TestTorchChunked()
    case = make_case(suite.fw, rng, (4, 3), 1271, "float32", FEATURES["teacher"])
    with pytest.warns(RuntimeWarning, match="no C.. compiler found.*eager tiles run instead"):
        suite.check(case, rng, "float32", entropy=False)
    assert tc._Compiled.failed and not tc.use_compiled(1 << 20)
    monkeypatch.setattr(tc._Compiled, "failed", False)
    monkeypatch.setattr(tc._Compiled, "worked", True)
    suite.check(case, rng, "float32", entropy=False)  # said once: no second warning
    assert not tc._Compiled.failed and tc.use_compiled(1 << 20)


def test_inplace_backward_whose_compile_fails_midway_finishes_on_the_tiles(rng, monkeypatch,
                                                                          compiled_loops):
    """The compiled backward writing over the logits (``inplace_grad``) compiles a graph per
    storage offset it meets, so a compile can fail (Dynamo's recompile limit) after its first
    row block was written. A failed block writes nothing: the rows from it on still hold
    logits and the eager tiles finish them, the rows before keep the compiled loop's bits.
    It raised there (and before that, the eager tiles wrote every block again, reading the
    gradients of the rows already written as logits)."""
    import torch

    import dlm_kernels.torch as dk

    tc = compiled_loops
    monkeypatch.setattr(tc, "BLOCK_BYTES", 5 * 4 * 1271)  # 12 rows: blocks 0-5, 5-10, 10-12
    z0 = torch.tensor(rng.normal(size=(12, 1271)) * 3, dtype=torch.float32)
    y = torch.tensor(rng.integers(0, 1271, 12))

    def grad(inplace):
        z = z0.clone().requires_grad_(True)
        (g,) = torch.autograd.grad(dk.token_stats(z, y, inplace_grad=inplace).logp.sum(), z)
        return g.detach().clone()

    expected = grad(False)
    real, calls = tc._Compiled.grads_over, []

    def failing_at(block):
        def run(z, *rest):
            calls.append(z.shape[0])
            if len(calls) == block:
                raise RuntimeError("recompile limit")
            return real(z, *rest)
        return run

    monkeypatch.setattr(tc._Compiled, "warned", True)  # (the warning has its own test)
    for block, first_eager_row in ((1, 0), (2, 5), (3, 10)):
        calls.clear()
        monkeypatch.setattr(tc._Compiled, "grads_over", failing_at(block))
        got = grad(True)
        # the compiled rows bitwise; the eager tiles' rows within float32's rounding (they
        # sum in their own order: a compile that fails changes the path, ``_fell_back``)
        assert torch.equal(got[:first_eager_row], expected[:first_eager_row]), block
        assert_close(got.numpy(), expected.numpy(), "float32", f"d logits, block {block}")
    assert tc._Compiled.worked and not tc._Compiled.failed


@pytest.mark.parametrize("loops", ["compiled", "eager"])
def test_inplace_backward_is_seen_by_autograd(rng, monkeypatch, compiled_loops, loops):
    """Logits that another operation saved for its own backward: the gradient written over
    them (``inplace_grad``, by the compiled loop or the eager tiles) bumps their version, so
    where that backward runs after ours (an operation recorded before the statistics) autograd
    refuses it instead of letting it read gradients as logits; where it runs before (recorded
    after), it read the logits and the sum of the two gradients is right."""
    import torch

    import dlm_kernels.torch as dk

    if loops == "eager":
        monkeypatch.setattr(compiled_loops, "COMPILE_MIN_VOCAB", 1 << 30)
    z0 = torch.tensor(rng.normal(size=(12, 1271)) * 3, dtype=torch.float32)
    y = torch.tensor(rng.integers(0, 1271, 12))
    z = z0.clone().requires_grad_(True)
    (expected,) = torch.autograd.grad(dk.token_stats(z, y).logp.sum(), z)
    z = z0.clone().requires_grad_(True)
    square = (z ** 2).sum()  # pow saves z; recorded first, its backward runs after ours
    loss = dk.token_stats(z, y, inplace_grad=True).logp.sum() + square
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()
    z = z0.clone().requires_grad_(True)
    loss = dk.token_stats(z, y, inplace_grad=True).logp.sum() + (z ** 2).sum()
    loss.backward()
    assert_close(z.grad.detach().numpy(), (expected + 2 * z0).numpy(), "float32", "d logits")


def test_compiled_loops_take_their_threads_at_run_time(rng, monkeypatch, compiled_loops,
                                                        torch_config):
    """Inductor fixes a loop nest's threads from the sizes of the call that compiled it, and
    its disk cache hands that code to later processes: compiled first at [6, 97] (a test's
    size), the float32 backward later ran on one thread over [128, 131072] blocks
    (bench/NOTES.md). Compiled here at that size, from scratch (fresh copies of the two
    functions, no cache), every generated loop nest is still an OpenMP parallel region."""
    import types

    from torch._inductor.utils import run_and_get_code

    tc = compiled_loops
    fresh = lambda f: types.FunctionType(f.__code__.replace(), f.__globals__, f.__name__)  # noqa: E731
    monkeypatch.setattr(tc, "_tile_state", fresh(tc._tile_state))
    monkeypatch.setattr(tc, "_block_grads", fresh(tc._block_grads))
    monkeypatch.setattr(tc._Compiled, "fn", None)
    monkeypatch.setattr(tc._Compiled, "grads", None)
    torch_config("torch._inductor.config", fx_graph_cache=False)
    suite = TestTorchChunked()
    case = make_case(suite.fw, rng, (6,), 97, "float32", FEATURES["teacher"])
    _, codes = run_and_get_code(lambda: suite.check(case, rng, "float32", entropy=False))
    kernels = [part for code in codes for part in code.split('extern "C"')[1:]]
    assert len(kernels) >= 2, codes  # the forward's and the backward's
    serial = [k for k in kernels if "#pragma omp parallel" not in k]
    assert not serial, f"{len(serial)} of {len(kernels)} generated kernels have no parallel region"


def test_compiled_forward_falls_back_from_a_later_tile(rng, monkeypatch, compiled_loops):
    """A compile that fails after others have worked, at the last tile (the shifted rows'
    graph, compiled where the first shifted column lies: Dynamo's recompile limit, say),
    leaves the call to the eager tiles with one warning; it does not reach the caller."""
    tc = compiled_loops
    real = tc._compiled()
    assert real is not None

    def no_shifted_graph(z, u, shift_ids, *rest):
        if shift_ids is not None:
            raise RuntimeError("recompile limit reached")
        return real(z, u, shift_ids, *rest)

    monkeypatch.setattr(tc, "SUM_COLUMNS", 300)
    monkeypatch.setattr(tc._Compiled, "fn", no_shifted_graph)
    monkeypatch.setattr(tc._Compiled, "worked", True)
    monkeypatch.setattr(tc._Compiled, "warned", False)
    suite = TestTorchChunked()
    case = make_case(suite.fw, rng, (6,), 1271, "float32", FEATURES["shift"])
    x = np.full(6, 1200)  # every shifted column in the last tile
    case["api_kw"]["shift_ids"] = suite.fw.array(x)
    case["ora_kw"]["x"] = x
    with pytest.warns(RuntimeWarning, match="recompile limit reached.*eager tiles run instead"):
        suite.check(case, rng, "float32", entropy=False)
    assert not tc._Compiled.failed


@pytest.mark.parametrize("feature,dtype", [("plain", "bfloat16"), ("teacher", "float32")])
def test_tiles_reuse_the_threads_scratch_and_never_read_it(rng, feature, dtype):
    """The CPU tiles come from the calling thread's reused buffer (``scratch``), which holds
    whatever the last call left: here NaN in all of it, and the call (one block, on this
    thread) still matches the oracle."""
    from dlm_kernels.token_stats.torch_row_blocks import scratch

    old = scratch(1 << 21)  # 8 MiB: past what this call's tiles take, so not regrown
    old.fill_(float("nan"))
    assert scratch(3, 5, 7).data_ptr() == old.data_ptr()  # reused, not allocated again
    suite = TestTorchChunked()
    case = make_case(suite.fw, rng, (3, 4), 1271, dtype, FEATURES[feature])
    suite.check(case, rng, dtype, entropy=False)
    assert scratch(1).data_ptr() == old.data_ptr()


def test_row_blocks_are_sized_by_the_work():
    """A small call runs on the calling thread in one block (two workers' Python calls
    contend for the interpreter lock: 3.4 ms for 1.3 ms at N 256, K 2048); a large one is
    shared out in blocks of at least BLOCK_ELEMENTS logits over the workers."""
    import threading

    import torch

    from dlm_kernels.token_stats import torch_row_blocks as rb

    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        # each worker computes on one thread, and the caller keeps its own count
        team = rb.run_blocks(lambda r0, r1: torch.get_num_threads(), 1 << 16, 1 << 10)
        assert team == [1] * len(team) and len(team) > 1 and torch.get_num_threads() == 2, team
        for n, k, blocks, on_workers in ((256, 2048, 1, False), (4096, 2048, 8, True),
                                         (4096, 32768, 64, True), (256, 16384, 4, False)):
            seen = []
            rb.run_blocks(lambda r0, r1: seen.append((r1 - r0, threading.current_thread())), n, k)
            assert len(seen) == blocks and sum(r for r, _ in seen) == n, (n, k, seen)
            assert all(r * k >= rb.BLOCK_ELEMENTS for r, _ in seen[:-1]), (n, k, seen)
            main = [t is threading.main_thread() for _, t in seen]
            assert not any(main) if on_workers else all(main), (n, k, seen)
    finally:
        torch.set_num_threads(threads)


class TestJaxChunked(ChunkedSuite):
    FW = "jax"
    # one cast as each chunk is read, the same at every shape (the chunk loop is what the
    # shapes test): each shape once, the dtypes in turn, as the JAX reference
    shape_dtype = cases(*ROTATED_SHAPE_DTYPES)
    # The features at ragged chunks of 100 only: one chunk (chunk_size None at K <= 4096) is
    # the peeled first chunk that every call runs, its lax.fori_loop of zero trips
    # (jax_chunked._block_partial, the backward's block_step); a call of chunks of 100 runs
    # that first chunk and then the loop and its merges. The shape sweep and the shift ties
    # keep both (one chunk at every K up to 1271; the CPU plan's chunks of 4096 at 50257 in
    # the full tier, tests/full_tier.txt).
    CHUNK_SIZES = (100,)
    SHAPE_CHUNK_SIZES = (None, 100)


def test_compiled_loops_compile_one_graph_whatever_the_tile_flag(compiled_loops, monkeypatch):
    """torch never rounds a product on its own (``TorchOps.rounded`` is the identity), so a
    call lowered with ``ROUND_TILES`` (a LinearHead's rows) and one without share the
    compiled backward: before, the flag the formulas read was one more guard of Dynamo's, a
    second graph of the same loop (and one more towards its recompile limit)."""
    import torch
    from torch._dynamo.utils import counters

    import dlm_kernels.torch as D
    from dlm_kernels.token_stats import op
    from dlm_kernels.token_stats.lowering import lower

    gen = torch.Generator().manual_seed(0)
    z = torch.randn(6, 97, generator=gen, requires_grad=True)
    y = torch.randint(0, 97, (6,), generator=gen)

    def backward():
        s = D.token_stats(z, y, temperature=0.7, backend="chunked")
        (s.logp.sum() + s.entropy.sum()).backward()
        return z.grad.clone()

    plain = backward()
    graphs = counters["stats"]["unique_graphs"]
    monkeypatch.setattr(op, "lower", lambda cfg, *, has_shift, heads=False: lower(
        cfg, has_shift=has_shift, heads=True))
    z.grad = None
    flagged = backward()
    assert counters["stats"]["unique_graphs"] == graphs
    assert torch.equal(plain, flagged)
