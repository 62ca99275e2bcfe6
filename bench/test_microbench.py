"""Microbenchmarks with pytest-benchmark, kept out of the default test run.

    python -m pytest bench/test_microbench.py --benchmark-enable --benchmark-only
    DLM_BENCH_FULL=1 ...   # the real model shapes of bench/shapes.py (GPU)

One benchmark per objective x framework x backend x mode over the shared shape table.
"""

import os

import pytest

from bench import shapes
from bench.cases import JaxCase, TorchCase
from bench.runner import detect, variants

ENV = detect()
if ENV["cuda"]:
    SHAPES = shapes.FULL_SHAPES if os.environ.get("DLM_BENCH_FULL") else shapes.MODEL_SHAPES
else:
    SHAPES = shapes.SMOKE_SHAPES + shapes.CPU_SHAPES[:1]

PARAMS = []
for fw in ("torch", "jax"):
    if not ENV[fw]:
        continue
    for obj in shapes.OBJECTIVES:
        ours, baselines = variants(ENV, fw, obj)
        for variant in ours + baselines:
            for shape in SHAPES:
                PARAMS.append(pytest.param(fw, obj, variant, shape, id=f"{fw}-{obj}-{variant}-{shape[0]}"))


@pytest.mark.parametrize("mode", ["fwd", "fwd+bwd"])
@pytest.mark.parametrize("fw,objective,variant,shape", PARAMS)
def test_microbench(benchmark, fw, objective, variant, shape, mode):
    label, n, k, dtype = shape
    cuda = ENV["cuda"] and fw == "torch"
    case = (TorchCase(objective, variant, n, k, dtype, "cuda" if cuda else "cpu") if fw == "torch"
            else JaxCase(objective, variant, n, k, dtype))
    fn = case.fwd if mode == "fwd" else case.fwdbwd
    calls = iter(range(10**9))

    def run():
        out = fn(next(calls))
        if cuda:
            import torch

            torch.cuda.synchronize()
        return out

    benchmark.extra_info.update(bytes=shapes.bytes_moved(objective, mode, n, k, 2 if dtype != "float32" else 4))
    benchmark.pedantic(run, warmup_rounds=1, rounds=5)
