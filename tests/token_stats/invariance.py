"""One row, one answer (docs/design.md §2): the checks the invariance tests share —
rows drawn once, run alone and in several batch arrangements, every output and gradient
compared bitwise (tests/token_stats/test_invariance.py for the framework-native backends,
test_invariance_kernels.py for the Triton and Pallas kernels)."""

from __future__ import annotations

import numpy as np

from harness import new_seed

#: (temperature, what else): the fast tiles (CE with a shift), the general chunk loop
#: (entropy, label smoothing, softcap) and distillation with a teacher and its gradient
FEATURES = {
    "shift": dict(temperature=0.7, entropy=False, shift=True),
    "general": dict(temperature=0.5, label_smoothing=0.1, softcap=20.0),
    "teacher": dict(temperature=2.0, teacher=True, shift=True),
}
N_ROWS = 23  # rows drawn; the batches below take them in several arrangements
TILES = 24  # copies of the draw in the largest arrangement


def _draw(k, n=N_ROWS):
    rng = np.random.default_rng(new_seed())
    return dict(
        z=(rng.standard_normal((n, k)) * 4).astype(np.float32),
        u=rng.standard_normal((n, k)).astype(np.float32),
        y=rng.integers(0, k, n), sid=rng.integers(0, k, n),
        d=rng.uniform(-30.0, 30.0, n).astype(np.float32),
        cot=rng.standard_normal((4, n)).astype(np.float32))


def _arrangements(n=N_ROWS):
    """(name, row order, shape) of a draw of n rows: all in one flat batch, reversed, as
    [B, L] (n - 3 rows), among padding rows (weight 0, NaN logits) at both ends, and (the
    default draw) 24 copies of it."""
    yield "flat", np.arange(n), (n,)
    yield "reversed", np.arange(n)[::-1], (n,)
    b = 4 if (n - 3) % 4 == 0 else 2
    yield "[B, L]", np.arange(n - 3)[::-1], (b, (n - 3) // b)
    yield "padded", np.concatenate([[-1, -1], np.arange(n), [-1]]), (n + 3,)
    if n == N_ROWS:  # (the kernels' tests draw fewer rows; their blocks do not depend on N)
        # 552 rows, reversed copies of the draw: past one CPU row block of the JAX chunked
        # backend (512 rows at 4096 columns: a full block, then 40 rows ending at row 552)
        yield "tiled", np.tile(np.arange(n)[::-1], TILES), (TILES, n)


def _run(fw, backend, data, order, shape, opts, device="cpu"):
    """Outputs and gradients of the rows ``order`` (-1: a padding row), each [len(order), ...]
    float32 NumPy, computed in one call of logits shaped ``shape + (K,)`` on ``device``
    (torch)."""
    opts = dict(opts)
    shift, teacher = opts.pop("shift", False), opts.pop("teacher", False)
    pad = order < 0
    idx = np.where(pad, 0, order)
    z = np.where(pad[:, None], np.nan, data["z"][idx])
    u = data["u"][idx]
    w = (~pad).astype(np.float32)
    cot = np.where(pad[None], 0.0, data["cot"][:, idx]).astype(np.float32)
    k = z.shape[-1]
    resh = lambda a: a.reshape(shape + a.shape[1:])  # noqa: E731
    kw = dict(opts, backend=backend)
    if shift:
        kw.update(shift_ids=resh(data["sid"][idx]), shift=resh(data["d"][idx]))
    if teacher:
        kw.update(teacher_logits=resh(u), teacher_grad=True)
    return fw(resh(z), resh(data["y"][idx]), resh(w), cot.reshape((len(cot),) + shape), kw, k,
              device)


def _torch(z, y, w, cot, kw, k, device):
    import torch

    import dlm_kernels.torch as dk

    t = lambda a: torch.tensor(np.asarray(a), device=device)  # noqa: E731
    kw = {name: t(v) if isinstance(v, np.ndarray) else v for name, v in kw.items()}
    leaves = {"z": t(z).requires_grad_(True)}
    if "shift" in kw:
        leaves["shift"] = kw["shift"] = kw["shift"].requires_grad_(True)
    if "teacher_logits" in kw:
        leaves["u"] = kw["teacher_logits"] = kw["teacher_logits"].requires_grad_(True)
    s = dk.token_stats(leaves["z"], t(y), t(w), **kw)
    outs = [v for v in s if v is not None]
    total = sum((o * t(c)).sum() for o, c in zip(outs, cot))
    grads = torch.autograd.grad(total, list(leaves.values()))
    flat = lambda a: a.detach().reshape(len(y.reshape(-1)), -1).cpu().numpy()  # noqa: E731
    return [flat(o) for o in outs] + [flat(g) for g in grads]


def _jax(z, y, w, cot, kw, k, device):
    import jax
    import jax.numpy as jnp

    import dlm_kernels.jax as dk

    kw = {name: jnp.asarray(v) if isinstance(v, np.ndarray) else v for name, v in kw.items()}
    kw.pop("teacher_grad", None)
    leaves = {"z": jnp.asarray(z)}
    for name, key in (("shift", "shift"), ("u", "teacher_logits")):
        if key in kw:
            leaves[name] = kw.pop(key)

    def f(leaves):
        extra = {"shift": leaves.get("shift"), "teacher_logits": leaves.get("u")}
        extra = {key: v for key, v in extra.items() if v is not None}
        s = dk.token_stats(leaves["z"], jnp.asarray(y), jnp.asarray(w), **kw, **extra)
        outs = [v for v in s if v is not None]
        return sum((o * c).sum() for o, c in zip(outs, jnp.asarray(cot))), outs

    (_, outs), grads = jax.value_and_grad(f, has_aux=True)(leaves)
    n = len(np.asarray(y).reshape(-1))
    flat = lambda a: np.asarray(a).reshape(n, -1)  # noqa: E731
    return [flat(o) for o in outs] + [flat(grads[name]) for name in leaves]


FRAMEWORKS = {"torch": _torch, "jax": _jax}


def check_one_row_one_answer(fw_name, backend, k, feature, n_rows=N_ROWS, device="cpu",
                             **options):
    """Every output and gradient of the first, a middle and the last of ``n_rows`` rows
    (an odd number, at least 5), each alone, against the same rows in every
    ``_arrangements`` batch, bitwise; ``device``: torch's (the JAX arrays stay on JAX's
    default device); ``options`` are more arguments of the call (a ``chunk_size``)."""
    fw = FRAMEWORKS[fw_name]
    data = _draw(k, n_rows)
    opts = dict(FEATURES[feature], **options)
    alone = {}
    for r in (0, n_rows // 2, n_rows - 1):  # each alone: the first, a middle, the last
        alone[r] = _run(fw, backend, data, np.array([r]), (1,), opts, device)
    for name, order, shape in _arrangements(n_rows):
        got = _run(fw, backend, data, order, shape, opts, device)
        for r, want in alone.items():
            for pos in np.flatnonzero(order == r):  # every place it holds (none: skip)
                for i, (a, b) in enumerate(zip(want, got)):
                    if not np.array_equal(a[0], b[pos], equal_nan=True):
                        bad = np.flatnonzero(~((a[0] == b[pos])
                                               | (np.isnan(a[0]) & np.isnan(b[pos]))))
                        raise AssertionError(
                            f"{fw_name} {backend} {feature} K {k} {options}: row {r} alone and at row "
                            f"{pos} of the {name} batch {shape} differ in output {i} at "
                            f"column {bad[0]}: {a[0].flat[bad[0]]!r} vs {b[pos].flat[bad[0]]!r}")


def check_logp_ignores_entropy(fw_name, backend, k, dtype, shape=(4, 16), device=None):
    """``per_token_logps`` with and without ``return_entropy``: the same logp bits, at T = 1
    and 0.7 (a backend may take another path when it keeps the entropy's sum: the path must
    not change how Σ e^x is summed); ``device``: torch's, where not the suites' own. Seed 9
    drew rows whose JAX chunked bfloat16 logp (K 5000) differed before ``per_token_logps``
    took the entropy's sums either way."""
    from harness import framework

    fw = framework(fw_name)
    api = fw.api
    array = fw.array if device is None else (lambda a, dt=None: fw.array(a, dt).to(device))
    for seed in (9, new_seed()):
        _check_logp_ignores_entropy(fw, array, np.random.default_rng(seed), backend, k, dtype,
                                    shape)


def _check_logp_ignores_entropy(fw, array, rng, backend, k, dtype, shape):
    api, fw_name = fw.api, fw.name
    z = array((rng.standard_normal(shape + (k,)) * 4).astype(np.float32), dtype)
    ids = array(rng.integers(0, k, shape))
    batch = api.DiffusionTokenBatch(model_inputs=ids, target_ids=ids,
                                    loss_weights=array(np.ones(shape, np.float32)))
    for t in (1.0, 0.7):
        with_h, _ = api.per_token_logps(z, batch, temperature=t, return_entropy=True,
                                        backend=backend)
        alone = api.per_token_logps(z, batch, temperature=t, backend=backend)
        a, b = (np.asarray(fw.numpy(v)).reshape(-1) for v in (with_h, alone))
        bad = np.flatnonzero(~((a == b) | (np.isnan(a) & np.isnan(b))))
        assert bad.size == 0, (
            f"{fw_name} {backend} {dtype} K {k} T {t}: logp with and without the entropy "
            f"differ in {bad.size} of {a.size} rows, first at {bad[0]}: {a[bad[0]]!r} vs "
            f"{b[bad[0]]!r}")


# -- the step's sampler --------------------------------------------------------------------

def _sample(fw_name, backend, z, seed, chunk_size, **kw):
    """The Sample fields of sample_tokens(z [B, L, K]) as float64 NumPy [B, L] each (ints
    exactly), the noise keyed per sequence by ``seed`` [B]."""
    z, seed = np.ascontiguousarray(z), np.ascontiguousarray(seed)
    if fw_name == "torch":
        import torch

        import dlm_kernels.torch as dk

        s = dk.sample_tokens(torch.tensor(z), seed=torch.tensor(seed), step=3,
                             chunk_size=chunk_size, backend=backend, **kw)
        return {f: getattr(s, f).detach().numpy() for f in s._fields}
    import jax.numpy as jnp

    import dlm_kernels.jax as dk

    s = dk.sample_tokens(jnp.asarray(z), seed=jnp.asarray(seed), step=3, chunk_size=chunk_size,
                         backend=backend, **kw)
    return {f: np.asarray(getattr(s, f)) for f in s._fields}


SAMPLER_MODES = {"greedy": dict(temperature=0.0), "draw": dict(temperature=0.8),
                 "top_k": dict(temperature=1.3, top_k=5)}
#: modes only some tests take: [R, 64] slot tiles (8 to 128 rows straddle XLA's small-tile size)
MORE_SAMPLER_MODES = {"wide_top_k": dict(temperature=1.3, top_k=64)}


def check_sampler_one_row_one_answer(fw_name, backend, k, chunk_size, mode, shape=(3, 3)):
    """Each sequence of a [B, L] batch (``shape``) alone ([1, L]) against the batch and the
    batch reversed, every Sample field bitwise (the noise is keyed per sequence, on its seed
    and the position inside it, so a sequence draws the same tokens anywhere); greedy, also
    each row alone ([1, 1])."""
    rng = np.random.default_rng(new_seed())
    b, length = shape
    z = (rng.standard_normal((b, length, k)) * 3).astype(np.float32)
    seed = rng.integers(0, 2**31, b)
    kw = {**SAMPLER_MODES, **MORE_SAMPLER_MODES}[mode]
    run = lambda zz, ss: _sample(fw_name, backend, zz, ss, chunk_size, **kw)  # noqa: E731
    batches = {"batch": run(z, seed), "reversed": run(z[::-1], seed[::-1])}
    for i in (0, b - 1):
        alone = run(z[i:i + 1], seed[i:i + 1])
        for name, got in batches.items():
            at = i if name == "batch" else b - 1 - i
            _same(alone, {f: v[at:at + 1] for f, v in got.items()},
                  f"{fw_name} {backend} {mode}: sequence {i} alone and in the {name}")
    if mode == "greedy":
        for j in (0, length - 1):
            alone = run(z[:1, j:j + 1], seed[:1])
            _same(alone, {f: v[:1, j:j + 1] for f, v in batches["batch"].items()},
                  f"{fw_name} {backend} greedy: row (0, {j}) alone and in the batch")


def _same(want, got, what):
    for field, a in want.items():
        b = got[field]
        same = (a == b) | (np.isnan(a) & np.isnan(b)) if a.dtype.kind == "f" else a == b
        if not np.all(same):
            bad = np.flatnonzero(~same)
            raise AssertionError(f"{what}: {field} differs at {bad[0]}: "
                                 f"{a.flat[bad[0]]!r} vs {b.flat[bad[0]]!r}")
