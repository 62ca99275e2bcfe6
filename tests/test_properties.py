"""Property tests: random shapes, chunk sizes and feature sets for the chunked backends of
both frameworks against the float64 oracle (hypothesis draws what the tables above do not)."""

from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, given, settings, strategies as st

import oracle
from dlm_kernels.testing import cancellation_scale
from harness import assert_close, framework


@st.composite
def problems(draw):
    n = draw(st.integers(1, 9))
    k = draw(st.integers(1, 300))
    feat = dict(
        temperature=draw(st.sampled_from([0.5, 1.0, 1.7])),
        ce_temperature=draw(st.sampled_from([None, 1.0, 0.8])),
        softcap=draw(st.sampled_from([None, 3.0, 30.0])),
        shift=draw(st.booleans()),
        teacher=draw(st.booleans()),
    )
    chunk = draw(st.sampled_from([None, 1, 7, 64, 128]))
    fw = draw(st.sampled_from(["torch", "jax"]))
    seed = draw(st.integers(0, 2**31 - 1))
    return n, k, feat, chunk, fw, seed


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problems())
def test_chunked_matches_oracle(problem):
    n, k, feat, chunk, fw_name, seed = problem
    fw = framework(fw_name)
    rng = np.random.default_rng(seed)
    z = rng.normal(size=(n, k)) * 4
    y = rng.integers(0, k, n)
    w = (rng.uniform(size=n) < 0.8).astype(np.float32)
    kw = {key: feat[key] for key in ("temperature", "ce_temperature", "softcap")}
    ora = dict(T=feat["temperature"], T_ce=feat["ce_temperature"], softcap=feat["softcap"])
    if feat["shift"]:
        x, d = rng.integers(0, k, n), rng.uniform(0, 5, n).astype(np.float32)
        kw.update(shift_ids=fw.array(x), shift=fw.array(d))
        ora.update(x=x, d=d.astype(np.float64))
    u = None
    if feat["teacher"]:
        u = rng.normal(size=(n, k)) * 4
        ora["u"] = u.astype(np.float32).astype(np.float64)
    g = [rng.normal(size=n).astype(np.float32) for _ in range(4)]
    teacher = fw.array(u, "float32") if u is not None else None

    def fn(zz, *tt):
        return fw.api.token_stats(zz, fw.array(y), fw.array(w), teacher_logits=tt[0] if tt else teacher,
                                  teacher_grad=bool(tt), chunk_size=chunk, backend="chunked", **kw)

    primals = [fw.array(z, "float32")] + ([teacher] if teacher is not None else [])
    outs, grads = fw.vjp(fn, primals, g)
    z32 = z.astype(np.float32).astype(np.float64)
    active = w != 0
    for name, got, exp in zip(("lse", "logp", "entropy", "kl"), outs,
                              oracle.token_stats(z32, y, active, **ora)):
        assert_close(got, exp, "float32", name)
    dz, du = oracle.token_stats_vjp(z32, y, active, g, **ora)
    assert_close(grads[0], dz, "float32", "d logits",
                 slack=oracle.saved_lse_slack(z32, y, active, g, **ora))
    if u is not None:
        scale = cancellation_scale(g[3], ora["u"][active] / ora["T"], z32[active] / ora["T"],
                                   temperature=ora["T"])
        assert_close(grads[1], du, "float32", "d teacher", scale=scale)
