"""Vocabulary- and data-parallel losses: JAX meshes on 8 host devices and torch.distributed
(gloo, 2 and 4 processes), against the single-device float64 oracle, gradients included.
K = 37 is not divisible by the shard counts: the padding holds NaN, which must not leak."""

from __future__ import annotations

import socket

import numpy as np
import pytest

import oracle
from bench.hlo import allreduce_bytes
from harness import assert_close, assert_exact_zero, new_seed
from dlm_kernels.testing import cancellation_scale

K = 37
KW = dict(temperature=0.8, ce_temperature=1.2, softcap=6.0, teacher_temperature=1.1)
ORA = dict(T=0.8, T_ce=1.2, softcap=6.0, T_kl=1.1)


def _problem(n, k_pad, seed=None):
    """A fresh draw (``seed`` None: a new one, printed; the torch ranks share theirs)."""
    rng = np.random.default_rng(new_seed() if seed is None else seed)
    z = (rng.normal(size=(n, k_pad)) * 3).astype(np.float32)
    u = (rng.normal(size=(n, k_pad)) * 3).astype(np.float32)
    z[:, K:] = np.nan  # padding columns: must never be read into anything
    u[:, K:] = np.nan
    y = rng.integers(0, K, n)
    x = rng.integers(0, K, n)
    d = rng.uniform(0, 4, n).astype(np.float32)
    w = (rng.uniform(size=n) < 0.8).astype(np.float32)
    w[0] = 1.0
    g = [rng.normal(size=n).astype(np.float32) for _ in range(4)]
    return z, u, y, x, d, w, g


def _expected(z, u, y, x, d, w, g):
    """(statistics, d logits, d teacher, the d logits' slack, the d teacher's cancellation
    scale: its terms q·(t - s) are of size |t| + |s|, as in the logits path's tests)."""
    active = w != 0
    ora = dict(ORA, x=x, d=d.astype(np.float64), u=u[:, :K].astype(np.float64))
    stats = oracle.token_stats(z[:, :K].astype(np.float64), y, active, **ora)
    dz, du = oracle.token_stats_vjp(z[:, :K].astype(np.float64), y, active, g, **ora)
    slack = oracle.saved_lse_slack(z[:, :K].astype(np.float64), y, active, g, **ora)
    t_kl = KW["teacher_temperature"]
    du_scale = cancellation_scale(g[3], z[:, :K] / KW["temperature"], u[:, :K] / t_kl,
                                  temperature=t_kl)
    return stats, dz, du, slack, du_scale


def _expected_d_shift(z, u, y, x, d, w, g, h=1e-5):
    """d(Σ g·stats)/d shift [N]: central differences of the float64 oracle."""
    ora = dict(ORA, x=x, u=u[:, :K].astype(np.float64))
    total = lambda d_: sum(np.nan_to_num(gi * si) for gi, si in zip(
        g, oracle.token_stats(z[:, :K].astype(np.float64), y, w != 0, d=d_, **ora)))
    d64 = d.astype(np.float64)
    return (total(d64 + h) - total(d64 - h)) / (2 * h)


# -- JAX ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("data,vocab,backend", [
    (1, 8, "chunked"), (2, 4, "chunked"), (2, 4, "pallas"), (2, 4, "triton"),
    (8, None, "chunked"), (8, None, "pallas"), (8, None, "triton")])
def test_jax_sharded_parity(data, vocab, backend, monkeypatch, request):
    """Rows over the "data" mesh axis and, unless vocab is None, the vocabulary over "vocab"
    (vocab_axis=...); with vocab None each device runs its kernel on its rows over the whole
    vocabulary. pallas: TPU interpret mode; triton: the jax-triton emulator."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, PartitionSpec as P

    import dlm_kernels.jax as D

    monkeypatch.setenv("DLM_KERNELS_PALLAS_INTERPRET", "1")
    if backend == "triton":
        pytest.importorskip("triton")
        request.getfixturevalue("jax_triton_on_cpu")
    devices = np.array(jax.devices()[:data * (vocab or 1)])
    if vocab is None:
        mesh, k_pad, row = Mesh(devices, ("data",)), K, P("data")
        tile, shard_kw = row, {}
    else:
        mesh, k_pad, row = (Mesh(devices.reshape(data, vocab), ("data", "vocab")),
                            -(-K // vocab) * vocab, P("data"))
        tile, shard_kw = P("data", "vocab"), dict(vocab_axis="vocab", vocab_size=K)
    z, u, y, x, d, w, g = _problem(6 * data, k_pad)

    def local(z, u, y, x, d, w):
        return D.token_stats(z, y, w, teacher_logits=u, teacher_grad=True, shift_ids=x, shift=d,
                             chunk_size=4 if backend == "chunked" else None, backend=backend,
                             **shard_kw, **KW)

    f = jax.shard_map(local, mesh=mesh, in_specs=(tile, tile, row, row, row, row), out_specs=row)

    def loss(z, u, d):
        s = f(z, u, y, x, d, w)
        return sum(jnp.sum(gi * si) for gi, si in zip(g, s)), s

    (_, stats), (dz, du, dd) = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2),
                                                          has_aux=True))(z, u, d)
    e_stats, e_dz, e_du, slack, du_scale = _expected(z, u, y, x, d, w, g)
    assert_close(np.asarray(dd), _expected_d_shift(z, u, y, x, d, w, g), "float32", "d shift")
    for name, got, exp in zip(("lse", "logp", "entropy", "kl"), stats, e_stats):
        assert_close(np.asarray(got), exp, "float32", name)
    assert_close(np.asarray(dz)[:, :K], e_dz, "float32", "d logits", slack=slack)
    assert_close(np.asarray(du)[:, :K], e_du, "float32", "d teacher", scale=du_scale)
    assert_exact_zero(np.asarray(dz)[:, K:], "d logits of padding columns")
    assert_exact_zero(np.asarray(du)[:, K:], "d teacher of padding columns")


@pytest.mark.parametrize("backend", ["chunked", "pallas", "triton"])
@pytest.mark.parametrize("temperature", [2.0, 1e3])
def test_jax_vocab_parallel_with_masked_shards(backend, temperature, monkeypatch, request):
    """Two of four vocabulary shards (K = 40) hold finfo.min in every column, in the student
    and the teacher (rows 0-2) or in the teacher alone (rows 3-5): they merge across devices
    as exactly nothing (a shard whose maximum is finfo.min once merged as 0 · -inf = NaN),
    and at T = 1e3 the KL is accurate relative to itself (compared as T²·KL)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, PartitionSpec as P

    import dlm_kernels.jax as D

    monkeypatch.setenv("DLM_KERNELS_PALLAS_INTERPRET", "1")
    if backend == "triton":
        pytest.importorskip("triton")
        request.getfixturevalue("jax_triton_on_cpu")
    rng = np.random.default_rng(new_seed())
    n, k, T = 6, 40, temperature
    z = (rng.normal(size=(n, k)) * 3).astype(np.float32)
    u = (rng.normal(size=(n, k)) * 3).astype(np.float32)
    fmin = np.finfo(np.float32).min
    z[:3, 10:30] = fmin
    u[:, 10:30] = fmin
    y = rng.choice(np.r_[0:10, 30:40], n)
    w = np.ones(n, np.float32)
    g = [rng.normal(size=n).astype(np.float32) for _ in range(4)]
    mesh = Mesh(np.array(jax.devices()[:4]), ("vocab",))
    tile, row = P(None, "vocab"), P()

    def local(z, u, y, w):
        return D.token_stats(z, y, w, teacher_logits=u, teacher_grad=True, temperature=T,
                             vocab_axis="vocab", chunk_size=4 if backend == "chunked" else None,
                             backend=backend)

    f = jax.shard_map(local, mesh=mesh, in_specs=(tile, tile, row, row), out_specs=row)

    def loss(z, u):
        s = f(z, u, y, w)
        return sum(jnp.sum(gi * si) for gi, si in zip(g, s)), s

    (_, stats), (dz, du) = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(z, u)
    active = w != 0
    ora = dict(T=T, u=u.astype(np.float64))
    z64 = z.astype(np.float64)
    for name, got, exp in zip(("lse", "logp", "entropy", "kl"), stats,
                              oracle.token_stats(z64, y, active, **ora)):
        scale = T * T if name == "kl" else 1.0
        assert_close(np.asarray(got) * scale, exp * scale, "float32", name)
    e_dz, e_du = oracle.token_stats_vjp(z64, y, active, g, **ora)
    assert_close(np.asarray(dz), e_dz, "float32", "d logits",
                 slack=oracle.saved_lse_slack(z64, y, active, g, **ora))
    live = u > fmin
    assert_close(np.asarray(du), e_du, "float32", "d teacher",
                 scale=cancellation_scale(g[3], np.where(live, z, 0) / T,
                                          np.where(live, u, 0) / T, temperature=T))


@pytest.mark.parametrize("backend", ["chunked", "pallas", "triton"])
def test_jax_vmap_inside_vocab_parallel(backend, monkeypatch, request):
    """jax.vmap over a batch axis inside shard_map: the same values and gradients as the
    unbatched call on the flattened rows (kernel backends fold the batch into their rows)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, PartitionSpec as P

    import dlm_kernels.jax as D

    monkeypatch.setenv("DLM_KERNELS_PALLAS_INTERPRET", "1")
    if backend == "triton":
        pytest.importorskip("triton")
        request.getfixturevalue("jax_triton_on_cpu")
    mesh = Mesh(np.array(jax.devices()[:4]), ("vocab",))
    z, u, y, x, d, w, g = _problem(6, 40)
    stats = lambda z, u, y, x, d, w: tuple(D.token_stats(
        z, y, w, teacher_logits=u, teacher_grad=True, shift_ids=x, shift=d, vocab_axis="vocab",
        vocab_size=K, backend=backend, **KW))
    tile, row = P(None, None, "vocab"), P()

    def loss(fn, z, u):
        s = jax.shard_map(fn, mesh=mesh, in_specs=(tile, tile) + (row,) * 4,
                          out_specs=row)(z, u, *(a.reshape(2, 3) for a in (y, x, d, w)))
        return sum(jnp.sum(gi.reshape(2, 3) * si) for gi, si in zip(g, s))

    batched = jax.vmap(stats)
    flat = lambda *a: tuple(v.reshape(2, 3) for v in stats(*(b.reshape((6,) + b.shape[2:])
                                                             for b in a)))
    args = (z.reshape(2, 3, 40), u.reshape(2, 3, 40))
    got = jax.jit(jax.value_and_grad(lambda z, u: loss(batched, z, u), argnums=(0, 1)))(*args)
    exp = jax.jit(jax.value_and_grad(lambda z, u: loss(flat, z, u), argnums=(0, 1)))(*args)
    assert_close(float(got[0]), float(exp[0]), "float32", "loss")
    for name, a, b in zip(("d logits", "d teacher"), got[1], exp[1]):
        assert_close(np.asarray(a)[..., :K], np.asarray(b)[..., :K], "float32", name)
        assert_exact_zero(np.asarray(a)[..., K:], f"{name} of padding columns")


def test_jax_vocab_parallel_rejects_the_reference_backend():
    """The reference backend materialises full rows: it cannot merge shard states, so asking
    for it explicitly in a vocabulary-parallel call is an error, not a silent switch."""
    import jax
    from jax.sharding import Mesh, PartitionSpec as P

    import dlm_kernels.jax as D

    mesh = Mesh(np.array(jax.devices()[:2]), ("vocab",))
    z, _, y, _, _, w, _ = _problem(4, 38)
    f = jax.shard_map(lambda z: D.token_stats(z, y, w, vocab_axis="vocab", vocab_size=K,
                                              backend="reference").lse,
                      mesh=mesh, in_specs=P(None, "vocab"), out_specs=P())
    with pytest.raises(ValueError, match="backend='reference' does not support vocabulary-parallel"):
        jax.jit(f)(z)


def test_jax_objectives_under_vocab_parallel():
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, PartitionSpec as P

    import dlm_kernels.jax as D

    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "vocab"))
    z, u, y, _, _, w, _ = _problem(8, 40)
    yb, wb = y.reshape(2, 4), w.reshape(2, 4)

    def local(z, u, y, w):
        batch = D.DiffusionTokenBatch.create(model_inputs=y, target_ids=y, loss_weights=w)
        dbatch = D.DiffusionDistillationBatch.create(student_batch=batch, teacher_logits=u)
        with D.vocab_parallel("vocab", vocab_size=K):
            total, _ = D.opd_loss(z, dbatch, temperature=1.5, soft_loss_weight=1.0, hard_loss_weight=0.3)
        return jax.lax.psum(total.unreduced_sum, "data"), jax.lax.psum(total.denominator, "data")

    f = jax.shard_map(local, mesh=mesh, in_specs=(P("data", None, "vocab"), P("data", None, "vocab"),
                                                  P("data"), P("data")), out_specs=(P(), P()))
    loss = lambda z: (lambda s, den: s / den)(*f(z, u.reshape(2, 4, 40), yb, wb))
    val, grad = jax.jit(jax.value_and_grad(loss))(z.reshape(2, 4, 40))

    batch = D.DiffusionTokenBatch.create(model_inputs=jnp.asarray(yb), target_ids=jnp.asarray(yb),
                                         loss_weights=jnp.asarray(wb))
    dbatch = D.DiffusionDistillationBatch.create(student_batch=batch,
                                                 teacher_logits=jnp.asarray(u.reshape(2, 4, 40)[..., :K]))
    ref = lambda z: D.opd_loss(z, dbatch, temperature=1.5, soft_loss_weight=1.0, hard_loss_weight=0.3,
                               backend="reference")[0].compute()
    r_val, r_grad = jax.value_and_grad(ref)(jnp.asarray(z.reshape(2, 4, 40)[..., :K]))
    assert_close(float(val), float(r_val), "float32", "loss")
    assert_close(np.asarray(grad)[..., :K], np.asarray(r_grad), "float32", "d logits")
    assert_exact_zero(np.asarray(grad)[..., K:], "padding gradient")


def test_jax_logits_objectives_under_vocab_parallel():
    """Logits sharded on K over "vocab" (NaN padding), rows over "data": weighted CE,
    per-token log-probs and the LOO SFT loss equal the unsharded reference's, values and d
    logits, and the padding's gradient is exact zeros."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, PartitionSpec as P

    import dlm_kernels.jax as D

    seed = new_seed()
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "vocab"))
    _, _, y, xt, t, m = _head_problem(4, 5, 11, 40, seed)
    z = _problem(20, 40, seed + 1)[0].reshape(4, 5, 40)

    def local(z, y, xt, t, m):
        with D.vocab_parallel("vocab", vocab_size=K):
            parts = _objectives(D, z, y, xt, t, m)
        return tuple(jax.lax.psum(v, "data") for v in parts)

    f = jax.shard_map(local, mesh=mesh, in_specs=(P("data", None, "vocab"),) + (P("data"),) * 4,
                      out_specs=(P(), P(), P()))
    val, grad = jax.jit(jax.value_and_grad(lambda z: sum(f(z, y, xt, t, m))))(z)
    ref = lambda z: sum(_objectives(D, z, *map(jnp.asarray, (y, xt, t, m)),
                                    backend="reference"))
    r_val, r_grad = jax.value_and_grad(ref)(jnp.asarray(z[..., :K]))
    r_terms = _objectives(D, jnp.asarray(z[..., :K]), *map(jnp.asarray, (y, xt, t, m)),
                          backend="reference")
    assert_close(float(val), float(r_val), "float32", "objectives", scale=_sum_scale(r_terms))
    assert_close(np.asarray(grad)[..., :K], np.asarray(r_grad), "float32", "d logits")
    assert_exact_zero(np.asarray(grad)[..., K:], "d logits of the padding")


def test_jax_collectives_move_rows_not_vocabulary():
    """The compiled vocab-parallel forward+backward all-reduces O(N) floats, never O(N·K)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, PartitionSpec as P

    import dlm_kernels.jax as D

    mesh = Mesh(np.array(jax.devices()[:8]).reshape(1, 8), ("data", "vocab"))
    n, k = 64, 8 * 512

    def local(z, u, y, w):
        s = D.token_stats(z, y, w, teacher_logits=u, vocab_axis="vocab", chunk_size=128)
        return s.logp, s.entropy, s.kl

    tile, row = P("data", "vocab"), P("data")
    f = jax.shard_map(local, mesh=mesh, in_specs=(tile, tile, row, row), out_specs=(row, row, row))
    loss = lambda z, u, y, w: sum(jnp.sum(v) for v in f(z, u, y, w))
    args = (jax.ShapeDtypeStruct((n, k), jnp.float32), jax.ShapeDtypeStruct((n, k), jnp.float32),
            jax.ShapeDtypeStruct((n,), jnp.int32), jax.ShapeDtypeStruct((n,), jnp.float32))
    hlo = jax.jit(jax.grad(loss)).trace(*args).lower().compile().as_text()
    per_op = allreduce_bytes(hlo)
    assert len(per_op) >= 2, hlo[:2000]
    for nbytes in per_op:
        assert nbytes <= 16 * 4 * n, f"an all-reduce of {nbytes} bytes (N = {n}, K = {k})"
    assert sum(per_op) <= 40 * n, f"{sum(per_op)} bytes all-reduced for {n} rows"


# -- torch.distributed ---------------------------------------------------------------------------

def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _torch_worker(rank, world, port, backend, seed):
    import torch.distributed as dist

    from dlm_kernels.testing import poisoned_outputs

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        with poisoned_outputs():  # as conftest runs every test in the parent process
            _torch_rank(rank, world, backend, seed)
    finally:
        dist.destroy_process_group()


def _torch_rank(rank, world, backend, seed):
    import torch
    import torch.distributed as dist

    import dlm_kernels.torch as D

    k_pad = -(-K // world) * world
    k_local = k_pad // world
    z, u, y, x, d, w, g = _problem(6, k_pad, seed)
    cols = slice(rank * k_local, (rank + 1) * k_local)
    zl = torch.tensor(z[:, cols]).requires_grad_(True)
    ul = torch.tensor(u[:, cols]).requires_grad_(True)
    dl = torch.tensor(d).requires_grad_(True)
    s = D.token_stats(zl, torch.tensor(y), torch.tensor(w), teacher_logits=ul, teacher_grad=True,
                      shift_ids=torch.tensor(x), shift=dl, vocab_size=K,
                      process_group=dist.group.WORLD, chunk_size=4, backend=backend, **KW)
    dz, du, dd = torch.autograd.grad(list(s), [zl, ul, dl], [torch.tensor(gi) for gi in g])
    assert_close(dd.numpy(), _expected_d_shift(z, u, y, x, d, w, g), "float32",
                 f"rank {rank} d shift (every rank: the shift is replicated)")
    parts = {name: [torch.empty_like(t) for _ in range(world)] for name, t in (("dz", dz), ("du", du))}
    dist.all_gather(parts["dz"], dz.contiguous())
    dist.all_gather(parts["du"], du.contiguous())
    e_stats, e_dz, e_du, slack, du_scale = _expected(z, u, y, x, d, w, g)
    for name, got, exp in zip(("lse", "logp", "entropy", "kl"), s, e_stats):
        assert_close(got.detach().numpy(), exp, "float32", f"rank {rank} {name}")
    full_dz = torch.cat(parts["dz"], dim=1).numpy()
    full_du = torch.cat(parts["du"], dim=1).numpy()
    assert_close(full_dz[:, :K], e_dz, "float32", "d logits", slack=slack)
    assert_close(full_du[:, :K], e_du, "float32", "d teacher", scale=du_scale)
    assert_exact_zero(full_dz[:, K:], "padding gradient")

    # the three objectives from logits sharded on K (NaN padding), with this backend
    lo, hi = rank * k_local, min((rank + 1) * k_local, K)
    h, wk, y2, xt, t, m = _head_problem(2, 5, 11, k_pad, seed + 1)
    to = lambda a: torch.tensor(a)
    z3 = _problem(10, k_pad, seed + 2)[0].reshape(2, 5, k_pad)
    zl2 = to(z3[..., cols]).requires_grad_(True)
    with D.vocab_parallel(dist.group.WORLD, vocab_size=K):
        value = sum(_objectives(D, zl2, to(y2), to(xt), to(t), to(m), backend=backend))
    (g2,) = torch.autograd.grad(value, zl2)
    ref_z = to(z3[..., :K]).requires_grad_(True)
    ref_terms = _objectives(D, ref_z, to(y2), to(xt), to(t), to(m), backend="reference")
    ref = sum(ref_terms)
    (g_ref,) = torch.autograd.grad(ref, ref_z)
    assert_close(value.item(), ref.item(), "float32", "objectives from logits",
                 scale=_sum_scale(ref_terms))
    if hi > lo:
        assert_close(g2[..., : hi - lo].numpy(), g_ref[..., lo:hi].numpy(), "float32",
                     "d logits of the objectives")
    assert_exact_zero(g2[..., max(hi - lo, 0):].numpy(), "d logits of the padding")

    # a linear head with the unembedding sharded on K: d hidden summed over the ranks
    hl = to(h).requires_grad_(True)
    wl = to(wk[cols]).requires_grad_(True)
    with D.vocab_parallel(dist.group.WORLD, vocab_size=K):
        head = D.LinearHead(hl, wl, row_chunk=4)
        value = sum(_objectives(D, head, to(y2), to(xt), to(t), to(m), backend=backend))
    gh, gw = torch.autograd.grad(value, [hl, wl])
    hr, wr = to(h).requires_grad_(True), to(wk[:K]).requires_grad_(True)
    ref_terms = _objectives(D, D.LinearHead(hr, wr), to(y2), to(xt), to(t), to(m),
                            backend="reference")
    ref = sum(ref_terms)
    r_gh, r_gw = torch.autograd.grad(ref, [hr, wr])
    assert_close(value.item(), ref.item(), "float32", "head objectives",
                 scale=_sum_scale(ref_terms))
    assert_close(gh.numpy(), r_gh.numpy(), "float32", "d hidden")
    if hi > lo:
        assert_close(gw[: hi - lo].numpy(), r_gw[lo:hi].numpy(), "float32", "d weight")
    assert_exact_zero(gw[max(hi - lo, 0):].numpy(), "d weight of the padding rows")

    # the same head with a final-logit softcap (|logits| up to 5 times it): each rank caps
    # its own columns
    hl = to(h).requires_grad_(True)
    wl = to(wk[cols]).requires_grad_(True)
    with D.vocab_parallel(dist.group.WORLD, vocab_size=K):
        head = D.LinearHead(hl, wl, softcap=0.5, row_chunk=4)
        value = sum(_objectives(D, head, to(y2), to(xt), to(t), to(m), backend=backend))
    gh, gw = torch.autograd.grad(value, [hl, wl])
    hr, wr = to(h).requires_grad_(True), to(wk[:K]).requires_grad_(True)
    ref_terms = _objectives(D, D.LinearHead(hr, wr, softcap=0.5), to(y2), to(xt), to(t), to(m),
                            backend="reference")
    ref = sum(ref_terms)
    r_gh, r_gw = torch.autograd.grad(ref, [hr, wr])
    assert_close(value.item(), ref.item(), "float32", "capped head objectives",
                 scale=_sum_scale(ref_terms))
    assert_close(gh.numpy(), r_gh.numpy(), "float32", "d hidden (capped head)")
    if hi > lo:
        assert_close(gw[: hi - lo].numpy(), r_gw[lo:hi].numpy(), "float32",
                     "d weight (capped head)")
    assert_exact_zero(gw[max(hi - lo, 0):].numpy(), "d weight of the padding rows (capped)")

    # policy_loss from the same sharded logits: the loss and d logits of the unsharded one
    batch = D.DiffusionTokenBatch.create(model_inputs=to(y2), target_ids=to(y2),
                                         loss_weights=to(m))
    old = D.per_token_logps(to(z3[..., :K]), batch, temperature=0.8, backend="reference")
    kw = dict(old_logps=old + 0.3 * to(m) * torch.sin(to(z3[..., 0])), loss_type="dapo",
              advantages=to(np.array([0.8, -1.1], np.float32)), beta=0.05, ref_logps=old,
              importance_sampling_level="sequence", temperature=0.8)
    zl3 = to(z3[..., cols]).requires_grad_(True)
    with D.vocab_parallel(dist.group.WORLD, vocab_size=K):
        value = D.policy_loss(zl3, batch, backend=backend, **kw).loss
    (g3,) = torch.autograd.grad(value, zl3)
    ref_z = to(z3[..., :K]).requires_grad_(True)
    ref = D.policy_loss(ref_z, batch, backend="reference", **kw).loss
    (g_ref,) = torch.autograd.grad(ref, ref_z)
    assert_close(value.item(), ref.item(), "float32", "policy_loss")
    if hi > lo:
        assert_close(g3[..., : hi - lo].numpy(), g_ref[..., lo:hi].numpy(), "float32",
                     "d logits of policy_loss")
    assert_exact_zero(g3[..., max(hi - lo, 0):].numpy(), "d logits of the padding (policy)")
    dist.barrier()  # no rank tears the group down while another still uses it


@pytest.mark.parametrize("world,backend", [(2, "chunked"), (4, "chunked"), (2, "triton")])
def test_torch_distributed_vocab_parallel(world, backend):
    """Each rank runs its shard with the given backend (triton: the Triton interpreter on CPU,
    TRITON_INTERPRET=1 inherited from the test process)."""
    import torch.multiprocessing as mp

    if backend == "triton":
        pytest.importorskip("triton")
    mp.spawn(_torch_worker, args=(world, _free_port(), backend, new_seed()), nprocs=world,
             join=True)


def test_torch_example_runs_under_torchrun(tmp_path):
    import os
    import subprocess
    import sys

    root = os.path.join(os.path.dirname(__file__), "..")
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                          "--master_port", str(_free_port()), "examples/vocab_parallel_torch.py"],
                         cwd=root, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.count("loss") == 2


# -- linear heads under vocabulary parallelism -------------------------------------------

def _head_problem(b, l, d, k_pad, seed):
    rng = np.random.default_rng(seed)
    h = (rng.integers(-2, 3, (b, l, d)) / 4).astype(np.float32)
    w = (rng.integers(-2, 3, (k_pad, d)) / 4).astype(np.float32)  # [K_pad, D]
    w[K:] = 0.0  # padding rows of the unembedding
    y = rng.integers(0, K, (b, l))
    xt = np.where(rng.uniform(size=(b, l)) < 0.5, K - 1, y)
    t = rng.uniform(0.1, 0.9, b).astype(np.float32)
    m = (rng.uniform(size=(b, l)) < 0.8).astype(np.float32)
    m[0, 0] = 1.0
    return h, w, y, xt, t, m


def _sum_scale(terms):
    """The size float32 rounding of a sum of objectives follows: Σ |term|. CE and the
    log-probs of the same tokens nearly cancel, so the sum itself can be far smaller than
    its terms (a relative error of 5e-4 of the sum was 3e-6 of the terms)."""
    return sum(abs(float(t)) for t in terms)


def _objectives(D, head, y, xt, t, m, backend=None):
    """Three objectives from one head or logits array: weighted CE (with a head: the
    gradient in the forward), per-token log-probs and the LOO SFT loss (recompute)."""
    batch = D.DiffusionTokenBatch.create(model_inputs=y, target_ids=y, loss_weights=m)
    ce = D.weighted_cross_entropy(head, batch, backend=backend)
    lp = D.per_token_logps(head, batch, stop_gradient=False, temperature=0.8, backend=backend)
    sft = D.diffusion_sft_loss(head, y, xt, t, m, variant="reweighted-loo-ce", vocab_size=K,
                               backend=backend)
    return ce.unreduced_sum, (lp * m).sum(), (sft * (1.0 + t)).sum()


@pytest.mark.parametrize("softcap", [None, 0.5])
def test_jax_linear_head_under_vocab_parallel(softcap):
    """The unembedding sharded on K over "vocab" (hidden replicated, rows over "data"): the
    three objectives' values, d hidden (summed over the shards) and d weight (each shard its
    own columns, exact zeros at the padding) equal the unsharded reference's; also with a
    head's final-logit softcap (|logits| up to 5 times it), which each shard applies to its
    own columns."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, PartitionSpec as P

    import dlm_kernels.jax as D

    seed = new_seed()
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "vocab"))
    h, w, y, xt, t, m = _head_problem(4, 5, 11, 40, seed)

    def local(h, w, y, xt, t, m):
        with D.vocab_parallel("vocab", vocab_size=K):
            head = D.LinearHead(h, w, softcap=softcap, weight_layout="KD", row_chunk=4)
            parts = _objectives(D, head, y, xt, t, m)
        return tuple(jax.lax.psum(v, "data") for v in parts)

    f = jax.shard_map(local, mesh=mesh,
                      in_specs=(P("data"), P("vocab", None), P("data"), P("data"), P("data"),
                                P("data")), out_specs=(P(), P(), P()))
    total = lambda h, w: sum(f(h, w, y, xt, t, m))
    val, (gh, gw) = jax.jit(jax.value_and_grad(total, argnums=(0, 1)))(h, w)

    ref = lambda h, w: sum(_objectives(
        D, D.LinearHead(h, w, softcap=softcap, weight_layout="KD"), jnp.asarray(y),
        jnp.asarray(xt), jnp.asarray(t), jnp.asarray(m), backend="reference"))
    r_val, (r_gh, r_gw) = jax.value_and_grad(ref, argnums=(0, 1))(jnp.asarray(h),
                                                                  jnp.asarray(w[:K]))
    r_terms = _objectives(D, D.LinearHead(jnp.asarray(h), jnp.asarray(w[:K]), softcap=softcap,
                                          weight_layout="KD"),
                          jnp.asarray(y), jnp.asarray(xt), jnp.asarray(t), jnp.asarray(m),
                          backend="reference")
    if softcap is not None:  # the reference's capped model, not the uncapped one
        plain = _objectives(D, D.LinearHead(jnp.asarray(h), jnp.asarray(w[:K]),
                                            weight_layout="KD"),
                            jnp.asarray(y), jnp.asarray(xt), jnp.asarray(t), jnp.asarray(m),
                            backend="reference")
        assert max(abs(float(a) - float(b)) for a, b in zip(plain, r_terms)) > 0.1
    assert_close(float(val), float(r_val), "float32", "objectives", scale=_sum_scale(r_terms))
    assert_close(np.asarray(gh), np.asarray(r_gh), "float32", "d hidden")
    assert_close(np.asarray(gw)[:K], np.asarray(r_gw), "float32", "d weight")
    assert_exact_zero(np.asarray(gw)[K:], "d weight of the padding rows")
