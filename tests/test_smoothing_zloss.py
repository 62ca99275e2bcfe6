"""Label smoothing (``label_smoothing`` ε) and z-loss (``z_loss_weight`` λ) of the CE term:
``logp`` = (1 - ε)·log p'_y + ε·mean_k log p'_k - λ·lse_ce², on every backend (kernels in
their interpreters, at tiny shapes), through a linear head and under vocabulary
parallelism, values and every gradient against the float64 oracle (tests/oracle.py)."""

from __future__ import annotations

import numpy as np
import pytest

import oracle
from harness import assert_close, assert_exact_zero, framework

BACKENDS = [("torch", "reference"), ("torch", "chunked"), ("torch", "triton"),
            ("jax", "reference"), ("jax", "chunked"), ("jax", "triton"), ("jax", "pallas")]
# (K, chunk, features): a chunk that does not divide K; softcap, T != 1, a separate CE
# temperature and the LOO shift together; a teacher beside the CE term
CASES = {
    "k37": (37, 16, dict(label_smoothing=0.1, z_loss_weight=0.01)),
    "k130-all": (130, 48, dict(label_smoothing=0.3, z_loss_weight=0.02, temperature=0.8,
                               ce_temperature=1.3, softcap=4.0, shift=True)),
    "k130-teacher": (130, 48, dict(label_smoothing=1.0, z_loss_weight=0.0, temperature=1.2,
                                   teacher=True, shift=True)),
}
N = 5


@pytest.fixture
def backend_env(request, monkeypatch):
    """Puts the kernel backends on the CPU: Pallas in TPU interpret mode, JAX's triton
    through the jax-triton emulator."""
    fw_name, backend = request.param
    monkeypatch.setenv("DLM_KERNELS_PALLAS_INTERPRET", "1")
    if backend == "triton":
        pytest.importorskip("triton")
        if fw_name == "jax":
            request.getfixturevalue("jax_triton_on_cpu")
    return fw_name, backend


def _draw(rng, k, feat, n=N):
    z = (rng.normal(size=(n, k)) * 3).astype(np.float32)
    y = rng.integers(0, k, n)
    w = np.ones(n, np.float32)
    w[[1, 3]] = 0.0  # inactive rows, poisoned: nothing of them may leak
    z[1], z[3], y[1], y[3] = np.nan, np.inf, -1, k + 5
    case = dict(z=z, y=y, w=w, k=k, x=None, d=None, u=None)
    if feat.get("shift"):
        case.update(x=rng.integers(0, k, n), d=rng.uniform(0, 4, n).astype(np.float32))
    if feat.get("teacher"):
        case["u"] = (rng.normal(size=(n, k)) * 3).astype(np.float32)
    return case


def _api_kw(feat):
    return {key: feat[key] for key in ("label_smoothing", "z_loss_weight", "temperature",
                                       "ce_temperature", "softcap") if key in feat}


def _oracle_kw(case, feat):
    kw = dict(T=feat.get("temperature", 1.0), T_ce=feat.get("ce_temperature"),
              softcap=feat.get("softcap"), label_smoothing=feat.get("label_smoothing", 0.0),
              z_loss_weight=feat.get("z_loss_weight", 0.0))
    if case["x"] is not None:
        kw.update(x=case["x"], d=case["d"].astype(np.float64))
    if case["u"] is not None:
        kw["u"] = case["u"].astype(np.float64)
    return kw


@pytest.mark.parametrize("backend_env", BACKENDS, ids=lambda b: "-".join(b), indirect=True)
@pytest.mark.parametrize("name", list(CASES))
def test_token_stats_against_the_oracle(backend_env, name, rng):
    """The four statistics, d logits (with the saved-statistics slack of the other tests),
    d shift, and exact zeros in inactive rows."""
    fw_name, backend = backend_env
    fw = framework(fw_name)
    k, chunk, feat = CASES[name]
    case = _draw(rng, k, feat)
    shift = case["x"] is not None
    teacher = None if case["u"] is None else fw.array(case["u"])

    def fn(z, *d):
        kw = dict(shift_ids=fw.array(case["x"]), shift=d[0]) if shift else {}
        s = fw.api.token_stats(z, fw.array(case["y"]), fw.array(case["w"]),
                               teacher_logits=teacher, chunk_size=chunk, backend=backend,
                               **kw, **_api_kw(feat))
        return tuple(s)

    if fw_name == "jax":
        fn = fw.jax.jit(fn)
    cots = [rng.normal(size=N).astype(np.float32) for _ in range(4)]
    if teacher is None:
        cots[3] = np.zeros(N, np.float32)
    primals = [fw.array(case["z"])] + ([fw.array(case["d"])] if shift else [])
    outs, grads = fw.vjp(fn, primals, cots)
    active = case["w"] != 0
    ora = _oracle_kw(case, feat)
    z64 = case["z"].astype(np.float64)
    expected = oracle.token_stats(z64, case["y"], active, **ora)
    for stat, got, exp in zip(("lse", "logp", "entropy", "kl"), outs, expected):
        assert_close(got, exp, "float32", stat)
    dz, _, d_shift = oracle.token_stats_vjp(z64, case["y"], active, cots, with_shift=True, **ora)
    slack = oracle.saved_lse_slack(z64, case["y"], active, cots, **ora)
    assert_close(grads[0], dz, "float32", "d logits", slack=slack)
    assert_exact_zero(grads[0][~active], "d logits of inactive rows")
    if shift:
        assert_close(grads[1], d_shift, "float32", "d shift")


# -- the objectives, from logits and through a linear head -----------------------------------

EPS_LAM = dict(label_smoothing=0.2, z_loss_weight=0.02)
HEAD_BACKENDS = [("torch", "chunked"), ("torch", "triton"), ("jax", "chunked"),
                 ("jax", "pallas")]
F32_U = 2.0 ** -24


def _objective_problem(rng, b=2, l=3, d=8, k=37):
    quarter = lambda shape: (rng.integers(-2, 3, shape) / 4).astype(np.float32)  # noqa: E731
    h, w, bias = quarter((b, l, d)), quarter((k, d)), quarter((k,))  # exact float32 logits
    y = rng.integers(0, k - 1, (b, l))
    xt = np.where(rng.uniform(size=(b, l)) < 0.5, k - 1, y)
    t = rng.uniform(0.1, 0.9, b).astype(np.float32)
    m = (rng.uniform(size=(b, l)) < 0.7).astype(np.float32) * rng.uniform(0.5, 2.0, (b, l))
    m = m.astype(np.float32)
    m[0, 0] = 1.5
    u = (rng.normal(size=(b, l, k)) * 2).astype(np.float32)
    cots = (np.float32(rng.normal()), rng.normal(size=b).astype(np.float32),
            np.float32(rng.normal()))
    return dict(h=h, w=w, bias=bias, y=y, xt=xt, t=t, m=m, u=u, k=k, cots=cots)


def _objectives(fw, logits, p, t, m, backend):
    """(weighted CE's sum, the LOO SFT loss [B], distillation's total with a hard term)."""
    api, y, xt, u = fw.api, fw.array(p["y"]), fw.array(p["xt"]), fw.array(p["u"])
    batch = api.DiffusionTokenBatch.create(model_inputs=y, target_ids=y, loss_weights=m)
    ce = api.weighted_cross_entropy(logits, batch, backend=backend, **EPS_LAM).unreduced_sum
    sft = api.diffusion_sft_loss(logits, y, xt, t, fw.array(p["m"]), variant="reweighted-loo-ce",
                                 vocab_size=p["k"], backend=backend, **EPS_LAM)
    dbatch = api.DiffusionDistillationBatch.create(student_batch=batch, teacher_logits=u)
    opd, _ = api.opd_loss(logits, dbatch, temperature=2.0, soft_loss_weight=1.0,
                          hard_loss_weight=0.5, backend=backend, **EPS_LAM)
    return ce, sft, opd.unreduced_sum


def _expected_objectives(p):
    """Values, d logits [B, L, K], d loss weights [B, L] and d t [B] of Σ cot·objectives
    from the float64 oracle (d t by central differences of it)."""
    z = (p["h"].astype(np.float64) @ p["w"].T.astype(np.float64) + p["bias"])  # [B, L, K]
    b, l, k = z.shape
    zf, y, m = z.reshape(b * l, k), p["y"].reshape(-1), p["m"].reshape(-1).astype(np.float64)
    active, c1, c2, c3 = m != 0, *p["cots"]
    _, logp, _, _ = oracle.token_stats(zf, y, active, **EPS_LAM)
    opd_kw = dict(T=2.0, T_ce=1.0, T_kl=2.0, u=p["u"].reshape(b * l, k).astype(np.float64),
                  **EPS_LAM)
    _, logp_h, _, kl = oracle.token_stats(zf, y, active, **opd_kw)
    sft = lambda t: oracle.sft_loss(z, p["y"], p["xt"], t, p["m"], "reweighted-loo-ce", k,
                                    **EPS_LAM)  # noqa: E731
    t64 = p["t"].astype(np.float64)
    values = (np.sum(m * -logp), sft(t64), np.sum(m * (4.0 * kl - 0.5 * logp_h)))
    zero = np.zeros(b * l)
    dz_ce, _ = oracle.token_stats_vjp(zf, y, active, (zero, -c1 * m, zero, zero), **EPS_LAM)
    dz_opd, _ = oracle.token_stats_vjp(zf, y, active, (zero, -0.5 * c3 * m, zero, 4.0 * c3 * m),
                                       **opd_kw)
    dz_sft = oracle.sft_loss_grad(z, p["y"], p["xt"], t64, p["m"], "reweighted-loo-ce", k, c2,
                                  **EPS_LAM)
    dz = (dz_ce + dz_opd).reshape(b, l, k) + dz_sft
    d_m = (c1 * -logp + c3 * (4.0 * kl - 0.5 * logp_h)).reshape(b, l)
    h = 1e-5
    d_t = np.array([(np.sum(c2 * sft(t64 + h * e)) - np.sum(c2 * sft(t64 - h * e))) / (2 * h)
                    for e in np.eye(b)])
    return values, dz, d_m, d_t


@pytest.mark.parametrize("backend_env", HEAD_BACKENDS, ids=lambda b: "-".join(b), indirect=True)
def test_objectives_through_a_linear_head(backend_env, rng):
    """weighted_cross_entropy (its gradient formed in the forward), the LOO SFT loss (t's
    gradient through the shift) and opd_loss's hard term with label smoothing and z-loss, from
    LinearHead(hidden, weight, bias) (torch [K, D], JAX [D, K]; JAX's pallas: the fused
    Mosaic head): values and the gradients of hidden, weight, bias, loss weights and t; on
    torch's chunked also from the logits themselves."""
    fw_name, backend = backend_env
    fw = framework(fw_name)
    p = _objective_problem(rng)
    values, dz, d_m, d_t = _expected_objectives(p)
    kd = fw.api.LinearHead.DEFAULT_LAYOUT == "KD"

    def from_head(h, w, bias, t, m):
        head = fw.api.LinearHead(h, w, bias, row_chunk=4)
        return _objectives(fw, head, p, t, m, backend)

    if fw_name == "jax":  # one compiled program: far quicker than op-by-op dispatch here
        from_head = fw.jax.jit(from_head)

    weight = p["w"] if kd else p["w"].T
    primals = [fw.array(a) for a in (p["h"], weight, p["bias"], p["t"], p["m"])]
    outs, (gh, gw, gb, gt, gm) = fw.vjp(from_head, primals, p["cots"])
    for name, got, exp in zip(("weighted CE", "SFT loss", "opd total"), outs, values):
        assert_close(got, exp, "float32", name, scale=float(np.sum(np.abs(exp))))
    b, l, k = dz.shape
    dzf, hf = dz.reshape(b * l, k), p["h"].reshape(b * l, -1).astype(np.float64)
    slack = lambda a, c: (k * F32_U) * (np.abs(a) @ np.abs(c)) + 2e-6  # noqa: E731
    assert_close(gh.reshape(b * l, -1), dzf @ p["w"], "float32", "d hidden",
                 slack=slack(dzf, p["w"]))
    gw_kd = gw if kd else gw.T
    assert_close(gw_kd, dzf.T @ hf, "float32", "d weight", slack=slack(dzf.T, hf))
    assert_close(gb, dzf.sum(0), "float32", "d bias", slack=slack(dzf.T, np.ones((b * l, 1)))[:, 0])
    assert_close(gm, d_m, "float32", "d loss weights", scale=float(np.max(np.abs(d_m))))
    assert_close(gt, d_t, "float32", "d t", scale=float(np.max(np.abs(d_t))))
    if (fw_name, backend) == ("torch", "chunked"):  # the same objectives from the logits array
        z = (p["h"] @ p["w"].T + p["bias"]).astype(np.float32)
        outs, (gz, gt, gm) = fw.vjp(lambda z, t, m: _objectives(fw, z, p, t, m, backend),
                                    [fw.array(z), fw.array(p["t"]), fw.array(p["m"])], p["cots"])
        for name, got, exp in zip(("weighted CE", "SFT loss", "opd total"), outs, values):
            assert_close(got, exp, "float32", name, scale=float(np.sum(np.abs(exp))))
        assert_close(gz, dz, "float32", "d logits")
        assert_close(gm, d_m, "float32", "d loss weights", scale=float(np.max(np.abs(d_m))))
        assert_close(gt, d_t, "float32", "d t", scale=float(np.max(np.abs(d_t))))


# -- vocabulary parallelism -----------------------------------------------------------------

VP_K = 37  # not divisible by the shard counts: the padding columns hold NaN
VP_FEAT = dict(label_smoothing=0.25, z_loss_weight=0.03, temperature=0.9, ce_temperature=1.2,
               softcap=6.0, shift=True)


def _vp_problem(seed, n, k_pad):
    rng = np.random.default_rng(seed)
    case = _draw(rng, VP_K, VP_FEAT, n)
    z = np.full((n, k_pad), np.nan, np.float32)
    z[:, :VP_K] = case["z"]
    cots = [rng.normal(size=n).astype(np.float32) for _ in range(4)]
    cots[3] = np.zeros(n, np.float32)
    return case, z, cots


def _vp_check(case, cots, stats, dz, dd, where=""):
    """Statistics, d logits (the padding's exact zeros) and d shift against the oracle over
    the global vocabulary (ε/K with K = vocab_size = 37)."""
    active = case["w"] != 0
    ora = _oracle_kw(case, VP_FEAT)
    z64 = case["z"].astype(np.float64)
    for name, got, exp in zip(("lse", "logp", "entropy", "kl"), stats,
                              oracle.token_stats(z64, case["y"], active, **ora)):
        assert_close(got, exp, "float32", where + name)
    e_dz, _, e_dd = oracle.token_stats_vjp(z64, case["y"], active, cots, with_shift=True, **ora)
    slack = oracle.saved_lse_slack(z64, case["y"], active, cots, **ora)
    assert_close(dz[:, :VP_K], e_dz, "float32", where + "d logits", slack=slack)
    assert_exact_zero(dz[:, VP_K:], where + "d logits of the padding")
    assert_close(dd, e_dd, "float32", where + "d shift")


@pytest.mark.parametrize("backend", ["chunked", "pallas", "triton"])
def test_jax_vocab_parallel(backend, monkeypatch, request, rng):
    """Four vocabulary shards of a mesh axis (vocab_axis, vocab_size = 37 of 40 columns):
    the merged Σ r (one more float per row in the all-reduce) and the global K."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, PartitionSpec as P

    monkeypatch.setenv("DLM_KERNELS_PALLAS_INTERPRET", "1")
    if backend == "triton":
        pytest.importorskip("triton")
        request.getfixturevalue("jax_triton_on_cpu")
    api = framework("jax").api
    case, z, cots = _vp_problem(int(rng.integers(2**31)), 6, 40)
    mesh = Mesh(np.array(jax.devices()[:4]), ("vocab",))

    def local(z, y, w, x, d):
        return tuple(api.token_stats(z, y, w, shift_ids=x, shift=d, vocab_axis="vocab",
                                     vocab_size=VP_K, backend=backend,
                                     chunk_size=4 if backend == "chunked" else None,
                                     **_api_kw(VP_FEAT)))

    f = jax.shard_map(local, mesh=mesh, in_specs=(P(None, "vocab"), P(), P(), P(), P()),
                      out_specs=P())
    args = [jnp.asarray(a) for a in (case["y"], case["w"], case["x"])]

    def loss(z, d):
        s = f(z, *args, d)
        return sum(jnp.sum(g * v) for g, v in zip(cots, s)), s

    (_, stats), (dz, dd) = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(
        jnp.asarray(z), jnp.asarray(case["d"]))
    _vp_check(case, cots, [np.asarray(s) for s in stats], np.asarray(dz), np.asarray(dd))


def _torch_worker(rank, world, port, seed):
    import torch
    import torch.distributed as dist

    from dlm_kernels.testing import poisoned_outputs

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    try:
        with poisoned_outputs():
            case, z, cots = _vp_problem(seed, 6, 38)
            k_local = 38 // world
            cols = slice(rank * k_local, (rank + 1) * k_local)
            api = framework("torch").api
            for backend in ("chunked", "triton"):
                zl = torch.tensor(z[:, cols]).requires_grad_(True)
                dl = torch.tensor(case["d"]).requires_grad_(True)
                s = api.token_stats(zl, torch.tensor(case["y"]), torch.tensor(case["w"]),
                                    shift_ids=torch.tensor(case["x"]), shift=dl,
                                    vocab_size=VP_K, process_group=dist.group.WORLD,
                                    chunk_size=4, backend=backend, **_api_kw(VP_FEAT))
                dz, dd = torch.autograd.grad(list(s), [zl, dl], [torch.tensor(c) for c in cots])
                parts = [torch.empty_like(dz) for _ in range(world)]
                dist.all_gather(parts, dz.contiguous())
                _vp_check(case, cots, [v.detach().numpy() for v in s],
                          torch.cat(parts, dim=1).numpy(), dd.numpy(),
                          f"rank {rank}, {backend}: ")
            dist.barrier()
    finally:
        dist.destroy_process_group()


def test_torch_vocab_parallel(rng):
    """Two gloo ranks, each a shard of 19 of 38 columns (vocab_size = 37), chunked and triton
    (the Triton interpreter): statistics, d logits and d shift against the oracle."""
    import socket

    import torch.multiprocessing as mp

    pytest.importorskip("triton")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    mp.spawn(_torch_worker, args=(2, port, int(rng.integers(2**31))), nprocs=2, join=True)


# -- parity with torch, padded and masked vocabularies, arguments ---------------------------

@pytest.mark.parametrize("eps,lam", [(0.1, 0.01), (0.0, 0.05)])  # (z-loss alone)
def test_torch_cross_entropy_parity(eps, lam, rng):
    """chunked against torch.nn.functional.cross_entropy(label_smoothing=ε) + λ·lse², values
    and d logits; with vocab_size = 100 < K = 130 the padding columns are dropped (K = 100
    in the uniform term) and get exact zeros."""
    import torch
    import torch.nn.functional as F

    api = framework("torch").api
    z = torch.tensor(rng.normal(size=(5, 130)) * 3, dtype=torch.float32)
    y = torch.tensor(rng.integers(0, 100, 5))
    for vocab in (None, 100):
        zl, zr = z.clone().requires_grad_(True), z.clone().requires_grad_(True)
        s = api.token_stats(zl, y, vocab_size=vocab, chunk_size=48, backend="chunked",
                            label_smoothing=eps, z_loss_weight=lam)
        zk = zr[:, :vocab]
        ref = (F.cross_entropy(zk, y, label_smoothing=eps, reduction="none")
               + lam * torch.logsumexp(zk, -1) ** 2)
        g = torch.tensor(rng.normal(size=5), dtype=torch.float32)
        (gl,) = torch.autograd.grad(-s.logp, zl, g)
        (gr,) = torch.autograd.grad(ref, zr, g)
        assert_close(-s.logp.detach().numpy(), ref.detach().numpy(), "float32", "CE")
        assert_close(gl.numpy(), gr.numpy(), "float32", "d logits")
        if vocab is not None:
            assert_exact_zero(gl[:, vocab:].numpy(), "d logits of the padding")


def test_masked_columns_as_torch(rng):
    """A column at -inf makes the smoothed CE +inf and one at finfo.min makes it huge, as in
    torch's cross_entropy (docs/design.md §9); the target's own term stays finite."""
    import torch
    import torch.nn.functional as F

    api = framework("torch").api
    z = torch.tensor(rng.normal(size=(3, 37)), dtype=torch.float32)
    z[0, 5], z[1, 6] = float("-inf"), torch.finfo(torch.float32).min
    y = torch.tensor([1, 2, 3])
    for backend in ("reference", "chunked"):
        ce = -api.token_stats(z, y, label_smoothing=0.1, backend=backend).logp
        ref = F.cross_entropy(z, y, label_smoothing=0.1, reduction="none")
        assert ce[0].item() == ref[0].item() == float("inf"), (backend, ce, ref)
        assert_close(ce[1:].numpy(), ref[1:].numpy(), "float32", f"{backend} CE")
        plain = -api.token_stats(z, y, backend=backend).logp
        assert torch.isfinite(plain).all(), (backend, plain)


@pytest.mark.parametrize("fw_name", ["torch", "jax"])
def test_bad_arguments_name_themselves(fw_name):
    """ε outside [0, 1] or NaN, λ negative or not finite, a bool or a string: a ValueError
    naming the argument and the value, from token_stats and the objectives (checked even
    where the term is off); NumPy scalars are numbers."""
    fw = framework(fw_name)
    api = fw.api
    z, y = fw.array(np.zeros((2, 3, 5), np.float32)), fw.array(np.zeros((2, 3), np.int32))
    batch = api.DiffusionTokenBatch.create(model_inputs=y, target_ids=y,
                                           loss_weights=fw.array(np.ones((2, 3), np.float32)))
    dbatch = api.DiffusionDistillationBatch.create(student_batch=batch, teacher_logits=z)
    calls = [lambda **kw: api.token_stats(z, y, **kw),
             lambda **kw: api.weighted_cross_entropy(z, batch, **kw),
             lambda **kw: api.diffusion_sft_loss(z, y, y, 0.5, y, variant="base-sft", vocab_size=5,
                                                 **kw),
             lambda **kw: api.opd_loss(z, dbatch, hard_loss_weight=0.0, **kw)]
    bad = [("label_smoothing", -0.1, "-0.1"), ("label_smoothing", 1.5, "1.5"),
           ("label_smoothing", float("nan"), "nan"), ("label_smoothing", True, "bool"),
           ("z_loss_weight", -1.0, "-1.0"), ("z_loss_weight", float("inf"), "inf"),
           ("z_loss_weight", "0.1", "'0.1'")]
    for call in calls:
        for name, value, shown in bad:
            with pytest.raises(ValueError, match=f"{name} must be .*{shown}"):
                call(**{name: value})
        ok = lambda: call(label_smoothing=np.float32(0.5), z_loss_weight=np.float64(1e-4))  # noqa: E731
        fw.jax.jit(ok)() if fw_name == "jax" else ok()  # JAX: one program, not op by op


def test_default_configuration_is_unchanged():
    """ε = λ = 0 is the configuration without the options (equal, same hash): no new
    specialisation, no Σ r, no CE coefficients."""
    from dlm_kernels._config import CeTerm, make_config
    from dlm_kernels.token_stats.lowering import lower

    plain, zero = make_config(), make_config(ce=CeTerm(label_smoothing=0, z_loss_weight=0.0),
                                             smoothing_vocab=37)
    assert plain == zero and hash(plain) == hash(zero)
    low = lower(zero, has_shift=False)
    assert low == lower(plain, has_shift=False)
    assert not low.SMOOTH and not low.Z_LOSS and not low.CE_TERMS


def test_pallas_lowers_for_tpu_with_both_options(monkeypatch):
    """The Mosaic kernels with label smoothing and z-loss (Σ r scratch, the CE coefficients'
    columns) lower for TPU, from logits (forward and gradient, every feature on) and from a
    linear head (the three fused kernels)."""
    import jax
    import jax.numpy as jnp

    monkeypatch.setenv("DLM_KERNELS_PALLAS_INTERPRET", "0")
    api = framework("jax").api
    n, d, k = 1024, 256, 50257
    opts = dict(label_smoothing=0.1, z_loss_weight=1e-4, backend="pallas")

    def loss(z, u, y, x, w):
        s = api.token_stats(z, y, w, teacher_logits=u, teacher_grad=True, temperature=0.9,
                            ce_temperature=1.1, softcap=30.0, shift_ids=x, shift=w * 2.0,
                            **opts)
        return jnp.sum(s.logp) + jnp.sum(s.entropy) + jnp.sum(s.kl)

    def head_loss(h, w, y, m):
        batch = api.DiffusionTokenBatch.create(model_inputs=y, target_ids=y, loss_weights=m)
        head = api.LinearHead(h, w, row_chunk=512)
        return api.weighted_cross_entropy(head, batch, **opts).unreduced_sum

    spec = jax.ShapeDtypeStruct
    lowered = lambda f, args, argnums: jax.jit(jax.value_and_grad(f, argnums=argnums)).trace(  # noqa: E731
        *args).lower(lowering_platforms=("tpu",)).as_text()
    text = lowered(loss, (spec((n, k), jnp.bfloat16), spec((n, k), jnp.bfloat16),
                          spec((n,), jnp.int32), spec((n,), jnp.int32), spec((n,), jnp.float32)),
                   (0, 1))
    assert text.count("tpu_custom_call") == 2, "forward and backward Mosaic kernels expected"
    text = lowered(head_loss, (spec((1, n, d), jnp.bfloat16), spec((d, k), jnp.bfloat16),
                               spec((1, n), jnp.int32), spec((1, n), jnp.float32)), (0, 1))
    for kernel in ("dlm_linear_head_fwd", "dlm_linear_head_dh", "dlm_linear_head_dw"):
        assert text.count(kernel) >= 1, f"{kernel} not in the program"
