"""soft_embedding (dlm_kernels.torch.self_conditioning): Σ_k softmax(cap(z)/T)_k·E[k] from
dense logits or a LinearHead, against the float64 NumPy oracle (tests/oracle.py:
soft_embedding_vjp), values and every gradient, both backends; streamed without any [N, V]
buffer; clear errors for bad input."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from dlm_kernels.testing import assert_close, new_seed
from dlm_kernels.torch import LinearHead
from dlm_kernels.torch.self_conditioning import soft_embedding

from oracle import soft_embedding_vjp

N, V, D, DH = 7, 301, 19, 11
CHUNK = 64  # V 301 = 4 full chunks and a ragged one
DT = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def _t(a, dtype):
    return torch.as_tensor(np.asarray(a, np.float64)).to(DT[dtype])


def _np(t):
    return t.detach().double().numpy()


def _check(got, ref, name, dtype):
    assert_close(_np(got), ref[name], dtype, name=name, slack=ref["slack_" + name])


def _run_dense(z, E, g, dtype, backend, **kw):
    zt, Et = _t(z, dtype).requires_grad_(True), _t(E, dtype).requires_grad_(True)
    out = soft_embedding(zt, Et, chunk_size=CHUNK, backend=backend, **kw)
    dz, dE = torch.autograd.grad(out, (zt, Et), _t(g, dtype))
    # the reference backend is torch's softmax of cap(z) / T: s rounded before the maximum
    ref = soft_embedding_vjp(_np(Et), _np(_t(g, dtype)), z=_np(zt), T=kw.get("temperature", 1.0),
                             softcap=kw.get("softcap"), scaled_first=backend == "reference")
    return out, dz, dE, ref


@pytest.mark.parametrize("backend", ["chunked", "reference"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("temperature,softcap", [(1.0, None), (1e-2, None), (1e3, None),
                                                 (0.7, 2.0), (1e-2, 2.0)])
def test_dense(backend, dtype, temperature, softcap):
    rng = np.random.default_rng(new_seed())
    z, E, g = rng.normal(size=(N, V)) * 3, rng.normal(size=(V, D)), rng.normal(size=(N, D))
    out, dz, dE, ref = _run_dense(z, E, g, dtype, backend, temperature=temperature,
                                  softcap=softcap)
    assert out.dtype == DT[dtype] and out.shape == (N, D)
    _check(out, ref, "out", dtype)
    _check(dE, ref, "dE", dtype)
    _check(dz, ref, "dz", dtype)


@pytest.mark.parametrize("temperature", [1.0, 1e-2, 1e3])
def test_large_logits_and_masked_chunks(temperature):
    """Logits of 1e4 scale; columns [0, 64) (the whole first chunk: the running maximum starts
    at -inf) are -inf and [128, 192) (a whole middle chunk) the float32 minimum."""
    rng = np.random.default_rng(new_seed())
    z = rng.normal(size=(N, V)) * 1e4
    z[:, :CHUNK] = -np.inf
    z[:, 2 * CHUNK:3 * CHUNK] = np.finfo(np.float32).min
    E, g = rng.normal(size=(V, D)), rng.normal(size=(N, D))
    for backend in ("chunked",) + (("reference",) if temperature >= 1.0 else ()):
        out, dz, dE, ref = _run_dense(z, E, g, "float32", backend, temperature=temperature)
        _check(out, ref, "out", "float32")
        _check(dE, ref, "dE", "float32")
        _check(dz, ref, "dz", "float32")
        assert (dz[:, :CHUNK] == 0).all() and (dz[:, 2 * CHUNK:3 * CHUNK] == 0).all()


@pytest.mark.parametrize("layout", ["KD", "DK"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("temperature", [1.0, 1e-2, 1e3])
def test_head_with_active_cap(layout, dtype, temperature):
    """A LinearHead with a bias, logits |z| up to ~40 under a cap of 3 (tanh saturated):
    values and the gradients of hidden, weight, bias and the embedding table."""
    rng = np.random.default_rng(new_seed())
    h, W = rng.normal(size=(N, DH)) * 3, rng.normal(size=(V, DH)) * 1.5
    b, E, g = rng.normal(size=V), rng.normal(size=(V, D)), rng.normal(size=(N, D))
    ht, Wt, bt, Et = (_t(a, dtype).requires_grad_(True) for a in (h, W, b, E))
    for backend in ("chunked", "reference"):
        w_in = Wt if layout == "KD" else Wt.t()
        head = LinearHead(ht, w_in, bt, weight_layout=layout)
        out = soft_embedding(head, Et, temperature=temperature, softcap=3.0, chunk_size=CHUNK,
                             backend=backend)
        grads = torch.autograd.grad(out, (ht, Wt, bt, Et), _t(g, dtype))
        ref = soft_embedding_vjp(_np(Et), _np(_t(g, dtype)), head=(_np(ht), _np(Wt), _np(bt)),
                                 T=temperature, softcap=3.0, scaled_first=backend == "reference")
        assert np.abs(ref["out"]).max() > 0 and np.abs(_np(ht) @ _np(Wt).T).max() > 20
        _check(out, ref, "out", dtype)
        for name, got in zip(("dh", "dW", "db", "dE"), grads):
            _check(got, ref, name, dtype)


@pytest.mark.parametrize("backend", ["chunked", "reference"])
def test_head_softcap_is_the_cap(backend):
    """A LinearHead's own softcap is the cap (the head's logits are cap(h·W)): the same bits as
    the cap passed as ``softcap=`` beside a plain head, values and gradients; both given must
    agree (a ValueError naming both otherwise)."""
    rng = np.random.default_rng(new_seed())
    h, W, E = rng.normal(size=(N, DH)) * 3, rng.normal(size=(V, DH)) * 1.5, rng.normal(size=(V, D))
    g = _t(rng.normal(size=(N, D)), "float32")
    outs = []
    for head_cap, call_cap in ((3.0, None), (None, 3.0), (3.0, 3.0)):
        ht, Wt, Et = (_t(a, "float32").requires_grad_(True) for a in (h, W, E))
        out = soft_embedding(LinearHead(ht, Wt, softcap=head_cap), Et, softcap=call_cap,
                             chunk_size=CHUNK, backend=backend)
        outs.append([out] + list(torch.autograd.grad(out, (ht, Wt, Et), g)))
    assert np.abs(h @ W.T).max() > 20  # the cap is active
    for other in outs[1:]:
        for name, a, b in zip(("out", "dh", "dW", "dE"), outs[0], other):
            assert torch.equal(a, b), f"{backend} {name}: head's softcap vs softcap="
    with pytest.raises(ValueError, match="softcap=2.0 was given .* softcap=3.0"):
        soft_embedding(LinearHead(_t(h, "float32"), _t(W, "float32"), softcap=3.0),
                       _t(E, "float32"), softcap=2.0, backend=backend)


def test_tied_table_gradients_add():
    """DiffusionGemma's head weight is its embedding table: one tensor, both gradients."""
    rng = np.random.default_rng(new_seed())
    h, W, g = rng.normal(size=(N, D)) * 2, rng.normal(size=(V, D)), rng.normal(size=(N, D))
    ht, Wt = _t(h, "float32").requires_grad_(True), _t(W, "float32").requires_grad_(True)
    out = soft_embedding(LinearHead(ht, Wt), Wt, temperature=0.5, softcap=4.0, chunk_size=CHUNK)
    dh, dW = torch.autograd.grad(out, (ht, Wt), _t(g, "float32"))
    ref = soft_embedding_vjp(W, g, head=(h, W, None), T=0.5, softcap=4.0)
    _check(out, ref, "out", "float32")
    _check(dh, ref, "dh", "float32")
    assert_close(_np(dW), ref["dW"] + ref["dE"], "float32", name="dW",
                 slack=ref["slack_dW"] + ref["slack_dE"])


def test_leading_dims_and_no_grad_inputs():
    """[B, L, V] logits give [B, L, D]; only the embedding's gradient when only it is asked."""
    rng = np.random.default_rng(new_seed())
    z, E = rng.normal(size=(2, 3, V)), rng.normal(size=(V, D))
    Et = _t(E, "float32").requires_grad_(True)
    out = soft_embedding(_t(z, "float32"), Et, chunk_size=CHUNK)
    assert out.shape == (2, 3, D)
    ref = soft_embedding_vjp(E, np.ones((6, D)), z=z.reshape(6, V))
    assert_close(_np(out).reshape(6, D), ref["out"], name="out", slack=ref["slack_out"])
    (dE,) = torch.autograd.grad(out.sum(), (Et,))
    _check(dE, ref, "dE", "float32")


class _LargestBuffer(TorchDispatchMode):
    """Records the most elements of any tensor an op returns."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def test_chunked_head_forms_no_rows_by_vocabulary_buffer():
    """Forward and backward of the chunked head path: no tensor of N·V elements (the largest
    are the [V, D] gradients and one [N, C] chunk); the reference path does form one."""
    n, v, d, c = 64, 4096, 16, 256
    h = torch.randn(n, d, requires_grad=True)
    W = torch.randn(v, d, requires_grad=True)
    for backend, expect_small in (("chunked", True), ("reference", False)):
        with _LargestBuffer() as probe:
            out = soft_embedding(LinearHead(h, W), W, softcap=5.0, chunk_size=c, backend=backend)
            torch.autograd.grad(out.sum(), (h, W))
        if expect_small:
            assert probe.largest <= max(v * d, n * c), probe.largest
        else:
            assert probe.largest >= n * v, probe.largest


def test_oracle_gradients_match_finite_differences():
    rng = np.random.default_rng(new_seed())
    h, W, b = rng.normal(size=(3, 4)), rng.normal(size=(5, 4)) * 2, rng.normal(size=5)
    E, g = rng.normal(size=(5, 6)), rng.normal(size=(3, 6))
    T, c = 0.7, 1.5
    ref = soft_embedding_vjp(E, g, head=(h, W, b), T=T, softcap=c)

    def f(h, W, b, E):
        return np.sum(g * soft_embedding_vjp(E, g, head=(h, W, b), T=T, softcap=c)["out"])

    args = [h, W, b, E]
    for i, name in enumerate(("dh", "dW", "db", "dE")):
        fd = np.zeros_like(args[i])
        for idx in np.ndindex(args[i].shape):
            plus = [a.copy() for a in args]
            minus = [a.copy() for a in args]
            plus[i][idx] += 1e-6
            minus[i][idx] -= 1e-6
            fd[idx] = (f(*plus) - f(*minus)) / 2e-6
        np.testing.assert_allclose(ref[name], fd, rtol=1e-6, atol=1e-8, err_msg=name)


@pytest.mark.parametrize("call,error,words", [
    (lambda z, E: soft_embedding(z, E[:-1]), ValueError, "V = 301"),
    (lambda z, E: soft_embedding(z, E[0]), ValueError, "shape [19]"),
    (lambda z, E: soft_embedding(z.long(), E), TypeError, "torch.int64"),
    (lambda z, E: soft_embedding(z, E, temperature=0.0), ValueError, "temperature"),
    (lambda z, E: soft_embedding(z, E, softcap=-1.0), ValueError, "softcap"),
    (lambda z, E: soft_embedding(z, E, chunk_size=0), ValueError, "chunk_size"),
    (lambda z, E: soft_embedding(z, E, backend="triton"), ValueError, "'triton'"),
    (lambda z, E: soft_embedding(z.numpy(), E), TypeError, "ndarray"),
    (lambda z, E: soft_embedding(LinearHead(torch.ones(N, 3), torch.ones(V, 4)), E),
     ValueError, "logits.weight must have shape [K, D]"),
    (lambda z, E: soft_embedding(LinearHead(torch.ones(N, 4), torch.ones(V, 4),
                                            torch.ones(V + 1)), E), ValueError, "[302]"),
])
def test_bad_input(call, error, words):
    z, E = torch.zeros(N, V), torch.zeros(V, D)
    with pytest.raises(error) as info:
        call(z, E)
    assert words in str(info.value), str(info.value)


@pytest.mark.parametrize("kind", ["dense", "KD", "DK"])
@pytest.mark.parametrize("temperature", [1.0, 1e-2])
def test_jax_twin(kind, temperature):
    """dlm_kernels.jax.self_conditioning.soft_embedding (jitted, float32): values and every
    gradient against the oracle, dense logits (a whole -inf chunk) or a capped head."""
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp

    from dlm_kernels.jax import LinearHead as JaxHead
    from dlm_kernels.jax.self_conditioning import soft_embedding as jax_soft_embedding

    rng = np.random.default_rng(new_seed())
    E, g = rng.normal(size=(V, D)), rng.normal(size=(N, D))
    f32 = jnp.float32
    if kind == "dense":
        z = rng.normal(size=(N, V)) * 3
        z[:, :CHUNK] = -np.inf
        args = (jnp.asarray(z, f32), jnp.asarray(E, f32))

        def fn(z, E):
            return jax_soft_embedding(z, E, temperature=temperature, chunk_size=CHUNK)
        names = ("dz", "dE")
        ref = soft_embedding_vjp(np.asarray(args[1], np.float64), g,
                                 z=np.asarray(args[0], np.float64), T=temperature)
    else:
        h, W, b = rng.normal(size=(N, DH)) * 3, rng.normal(size=(V, DH)) * 1.5, rng.normal(size=V)
        args = tuple(jnp.asarray(a, f32) for a in (h, W, b, E))

        def fn(h, W, b, E):
            w_in = W if kind == "KD" else W.T
            return jax_soft_embedding(JaxHead(h, w_in, b, weight_layout=kind), E,
                                      temperature=temperature, softcap=3.0, chunk_size=CHUNK)
        names = ("dh", "dW", "db", "dE")
        ref = soft_embedding_vjp(np.asarray(args[3], np.float64), g,
                                 head=tuple(np.asarray(a, np.float64) for a in args[:3]),
                                 T=temperature, softcap=3.0)
    out, vjp = jax.vjp(jax.jit(fn), *args)
    grads = vjp(jnp.asarray(g, f32))
    assert out.dtype == f32 and out.shape == (N, D)
    assert_close(np.asarray(out, np.float64), ref["out"], name="out", slack=ref["slack_out"])
    for name, got in zip(names, grads):
        assert_close(np.asarray(got, np.float64), ref[name], name=name, slack=ref["slack_" + name])


@pytest.mark.parametrize("kind", ["dense", "head"])
@pytest.mark.parametrize("backend", ["chunked", "reference"])
@pytest.mark.parametrize("fw_name", ["torch", "jax"])
def test_rows_alone(fw_name, backend, kind):
    """One row, one answer (docs/design.md §2): the soft embedding of rows alone (0, 7, 69)
    and of rows 3-7, and their gradients (d logits or d hidden), against the same rows among
    70 (past one matmul group of 64 rows), at T 0.7 with a softcap, bitwise. Every case
    failed before each matmul that forms a row's values ran on rows padded to a multiple of
    64 (``linear_head.head.head_rows``); the JAX chunked cases failed until every per-row
    value was computed in blocks of rows (whole [N, ...] arrays round a row by N in XLA's CPU
    code), and the JAX reference from a head without a bias raised until its accumulation
    dtype skipped the absent bias."""
    from harness import framework

    fw = framework(fw_name)
    rng = np.random.default_rng(new_seed())
    n, d, dh = 70, 32, 16  # (torch's matmul rounds a row by its position at widths 11 and 19)
    E, g = rng.normal(size=(V, d)).astype(np.float32), rng.normal(size=(n, d)).astype(np.float32)
    z = (rng.normal(size=(n, V)) * 3).astype(np.float32)
    h, W = rng.normal(size=(n, dh)).astype(np.float32), rng.normal(size=(V, dh)).astype(np.float32)
    if fw_name == "torch":
        fn_soft, Head = soft_embedding, LinearHead
    else:
        from dlm_kernels.jax import LinearHead as Head
        from dlm_kernels.jax.self_conditioning import soft_embedding as fn_soft

    def run(idx):
        def fn(x, emb, w):
            logits = x if kind == "dense" else Head(x, w, weight_layout="KD")
            return (fn_soft(logits, emb, temperature=0.7, softcap=3.0, chunk_size=CHUNK,
                            backend=backend),)

        x = z[idx] if kind == "dense" else h[idx]
        (out,), (dx,) = fw.vjp(fn, [fw.array(x)], [g[idx]], args=(fw.array(E), fw.array(W)))
        return out, dx

    batch = run(np.arange(n))
    for rows in ([0], [7], [69], [3, 4, 5, 6, 7]):
        for name, a, b in zip(("out", "d input"), run(np.array(rows)), batch):
            a, b = np.asarray(a), np.asarray(b)[rows]
            assert np.array_equal(a, b), (f"{fw_name} {backend} {kind}: {name} of rows {rows} "
                                          f"alone differs from the batch's in "
                                          f"{int(np.sum(a != b))} elements")


@pytest.mark.parametrize("kind,dtype", [("dense", "float32"), ("dense", "bfloat16"),
                                        ("KD", "float32"), ("DK", "float32")])
def test_jax_row_blocks(kind, dtype, monkeypatch):
    """The JAX chunked backend in several row blocks (blocks of 16 rows forced, below the
    size that keeps a row's bits, so 45 rows run as two blocks and a last block of 16 that
    overlaps the second by 3 rows): values and every gradient against the oracle (the
    overlapped rows updated and summed into dE, dW and db once; 16-bit d logits are carried
    as their bits on a CPU). Failed before the overlap kept the rows an earlier block had
    updated. (Bitwise across batches: test_jax_rows_alone_in_batches, at real block sizes.)"""
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp

    from dlm_kernels.jax import LinearHead as JaxHead
    from dlm_kernels.jax import self_conditioning as jsc

    n, vocab, chunk = 45, 2051, 1024  # chunks of 1024 columns: blocks of at least 16 rows
    rng = np.random.default_rng(new_seed())
    E, g = rng.normal(size=(vocab, D)), rng.normal(size=(n, D))
    dt = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}[dtype]
    if kind == "dense":
        args = [jnp.asarray(rng.normal(size=(n, vocab)) * 3, dt), jnp.asarray(E, dt)]

        def fn(z, E):
            return jsc.soft_embedding(z, E, temperature=0.7, chunk_size=chunk)
    else:
        w = rng.normal(size=(vocab, DH)) * 1.5
        args = [jnp.asarray(a, dt) for a in (rng.normal(size=(n, DH)) * 3,
                                             w if kind == "KD" else w.T,
                                             rng.normal(size=vocab), E)]

        def fn(h, W, b, E):
            return jsc.soft_embedding(JaxHead(h, W, b, weight_layout=kind), E,
                                      temperature=0.7, softcap=3.0, chunk_size=chunk)

    def run():
        out, vjp = jax.vjp(jax.jit(fn), *args)
        return (out, *vjp(jnp.asarray(g, dt)))

    monkeypatch.setattr(jsc, "rows_per_block", lambda n_rows, columns, on_cpu: 16)
    monkeypatch.setattr(jsc, "min_block_rows", lambda columns: 16)
    blocks = run()
    names = ("out", "dz", "dE") if kind == "dense" else ("out", "dh", "dW", "db", "dE")
    f64 = [np.asarray(a, np.float64) for a in args]
    ref = (soft_embedding_vjp(f64[1], np.asarray(jnp.asarray(g, dt), np.float64), z=f64[0],
                              T=0.7) if kind == "dense" else
           soft_embedding_vjp(f64[3], g, head=(f64[0], f64[1] if kind == "KD" else f64[1].T,
                                               f64[2]), T=0.7, softcap=3.0))
    for name, got in zip(names, blocks):
        assert got.dtype == dt, (name, got.dtype)
        got = np.asarray(got, np.float64)
        if name == "dW" and kind == "DK":
            got = got.T
        assert_close(got, ref[name], dtype, name=name, slack=ref["slack_" + name])


@pytest.mark.parametrize("n", [130, 600, 1100, 2048])
@pytest.mark.parametrize("kind", ["dense", "KD"])
def test_jax_rows_alone_in_batches(kind, n):
    """The JAX chunked soft embedding of rows alone against the same rows in a batch of N
    rows, bitwise, value and d input, at D 32 and Dh 64 (row values of [R, 32]). Failed at 130
    rows while a block's row count followed N and only its [R, C] tiles held
    MIN_BLOCK_ELEMENTS: every block now has ``block_rows`` rows, a function of the chunk and
    the widths (XLA's CPU code rounds a row by a smaller tile's row count). Past one block
    (1100 and 2048 rows: blocks of 1024 here) a row's d input differed from the row alone by
    an ulp in a few dozen columns until a call of one block's rows held spare rows past it:
    its block was the whole array, XLA hoisted the block's work out of the loop of blocks and
    fused it around the matmuls otherwise (``_Rows``)."""
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp

    from dlm_kernels.jax import LinearHead as JaxHead
    from dlm_kernels.jax.self_conditioning import soft_embedding as jax_soft_embedding

    vocab, d, dh, chunk = 2051, 32, 64, 1024
    rng = np.random.default_rng(new_seed())
    E = jnp.asarray(rng.normal(size=(vocab, d)), jnp.float32)
    W = jnp.asarray(rng.normal(size=(vocab, dh)) * 0.3, jnp.float32)
    x_all = rng.normal(size=(n, vocab if kind == "dense" else dh)) * 3
    g_all = rng.normal(size=(n, d))

    def run(x, g):
        def fn(x):
            logits = x if kind == "dense" else JaxHead(x, W, weight_layout="KD")
            return jax_soft_embedding(logits, E, temperature=0.7, softcap=3.0, chunk_size=chunk)
        out, vjp = jax.vjp(jax.jit(fn), jnp.asarray(x, jnp.float32))
        return np.asarray(out), np.asarray(vjp(jnp.asarray(g, jnp.float32))[0])

    batch = run(x_all, g_all)
    for r in (0, 7, 129):
        out, dx = run(x_all[[r]], g_all[[r]])
        for name, a, b in (("out", out[0], batch[0][r]), ("d input", dx[0], batch[1][r])):
            assert np.array_equal(a, b), (f"{kind}: {name} of row {r} alone differs from the "
                                          f"batch of {n}'s in {int(np.sum(a != b))} elements")


def test_jax_second_derivatives_raise():
    """A second derivative of the JAX chunked soft embedding raises the package's clear error
    (its VJP is first order), never a silent zero (a bfloat16 jvp of the gradient gave 0: the
    gradient is carried as its bits) nor JAX's internal while-loop error."""
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp

    from dlm_kernels.jax.self_conditioning import soft_embedding as jax_soft_embedding

    rng = np.random.default_rng(new_seed())
    E = jnp.asarray(rng.normal(size=(V, D)), jnp.float32)
    for dtype in (jnp.float32, jnp.bfloat16):
        z = jnp.asarray(rng.normal(size=(N, V)), dtype)
        loss = lambda z: jax_soft_embedding(z, E.astype(dtype), chunk_size=CHUNK).astype(  # noqa: E731
            jnp.float32).sum()
        with pytest.raises(NotImplementedError, match="first-order|second|higher"):
            jax.jvp(jax.grad(loss), (z,), (jnp.ones_like(z),))
        with pytest.raises(NotImplementedError, match="first-order|second|higher"):
            jax.grad(lambda z: jax.grad(loss)(z).astype(jnp.float32).sum())(z)
