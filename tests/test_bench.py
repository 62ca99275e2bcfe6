"""The main-job runner works end to end at smoke size and reports what the README promises."""

import json
import os
import re
import subprocess
import sys

import pytest

from harness import assert_close

ROOT = os.path.join(os.path.dirname(__file__), "..")


def test_bench_smoke(tmp_path):
    """python -m bench end to end at smoke size: a progress line per case (i of n, time
    left), the summary, and the files with every measured field."""
    out = subprocess.run([sys.executable, "-m", "bench", "--smoke", "--reps", "3", "--objectives",
                          "ce,sft,opd", "--no-linear-head", "--out", str(tmp_path)], cwd=ROOT,
                         check=True, capture_output=True, text=True).stdout
    steps = [line for line in out.splitlines() if line.startswith("[")]
    n = len(steps)  # 9 cases x 2 frameworks (ours, reference, upstream), then the sampler's 2
    assert n == 20 and steps[-1].startswith("[" + "#" * 24 + "]") and f" {n}/{n} " in steps[-1], out
    assert all(" left | " in line for line in steps), steps
    summary = out[out.index("Summary (forward+backward"):].splitlines()
    # each of ours against the upstream loss (never our own reference), in the lead where the
    # spreads were apart ("1.3x faster than ... at the one shape"), else said to be within
    # noise; ratios in words: no "0.32x faster"
    for obj in ("CE", "SFT", "OPD"):
        for fw, peer in (("torch", "eager PyTorch"), ("jax", "jax.jit")):
            what = f"  {obj} fwd+bwd, {fw} chunked"
            settled = re.compile(re.escape(what) + r": \d+\.\dx (faster|slower) than "
                                 + re.escape(peer) + r" \(upstream\) at the one shape")
            noise = f"{what} vs {peer} (upstream): within noise at 1 of 1 shapes"
            assert sum(bool(settled.match(line)) or line.startswith(noise)
                       for line in summary) == 1, (what, summary)
    assert not any(re.search(r"\b0\.\d+x", line) for line in summary), summary
    assert re.search(r"Machine load \(1-minute average\): [0-9.]+ before the run, [0-9.]+ "
                     r"after it, \d+ cores", out), out
    (report,) = [json.load(open(tmp_path / f)) for f in os.listdir(tmp_path) if f.endswith(".json")]
    assert report["summary"][0].startswith("Summary (forward+backward")
    assert "\n".join(report["summary"]) in out
    assert len(report["load"]["before"]) == 3 and len(report["load"]["after"]) == 3
    assert report["copy_gbps"] > 0 and report["device"] and report["versions"]["numpy"]
    assert report["threads"] >= 1 and f"threads: {report['threads']}" in out
    assert report["parity"] and all(p["ok"] for p in report["parity"])
    rows = [r for r in report["results"] if "ms" in r]
    assert {r["mode"] for r in rows} == {"fwd", "bwd", "fwd+bwd"}
    assert {(r["framework"], r["backend"]) for r in rows} >= {("torch", "chunked"), ("torch", "reference"),
                                                              ("jax", "chunked"), ("jax", "reference")}
    for r in rows:
        assert r["ms"] >= 0 and r["bytes"] > 0 and "speedup" in r
        assert r["derived"] or len(r["times_ms"]) == r["reps"]
        assert r["peak_bytes"] is None or r["peak_bytes"] >= 0
    comm = report["vocab_parallel_comm"]
    assert comm and all(c["bytes_per_row"] <= c["analytic_bytes_per_row"] for c in comm)
    assert any(f.endswith(".png") for f in os.listdir(tmp_path))
    assert any(f.endswith(".md") for f in os.listdir(tmp_path))
    assert report["linear_head"] is None  # --no-linear-head
    draws = report["sampling"]["results"]
    assert [r["variant"] for r in draws] == ["ours", "float32"] and all(
        r["ms"] > 0 and r["peak_bytes"] is not None for r in draws), draws
    table = open([os.path.join(tmp_path, f) for f in os.listdir(tmp_path) if f.endswith(".md")][0]).read()
    assert "Denoising step" in out and "### denoising step" in table
    assert "## Summary" in table and all(line in table for line in report["summary"])
    assert all(r["interleaved"] for r in rows if r["mode"] != "bwd")


def test_bench_runs_installed_from_any_directory(tmp_path):
    """The installed benchmark (``python -m dlm_kernels.bench``, the ``dlm-kernels-bench``
    command) starts outside the checkout, and says what each option does and its default."""
    out = subprocess.run([sys.executable, "-m", "dlm_kernels.bench", "--help"], cwd=tmp_path,
                         check=True, capture_output=True, text=True).stdout
    text = " ".join(out.split())
    assert "--full" in text and "(default: bench-results, under the current directory)" in text
    assert "timed calls per case (default: 5 on a CPU, 10 on a GPU)" in text
    assert "(default: None)" not in text and "(default: True)" not in text, out


def test_grpo_head_variants_are_one_loss(monkeypatch):
    """The linear-head benchmark's GRPO variants (ours from a LinearHead, ours on materialised
    logits, Liger's fused linear GRPO) time one loss: the same value and (dH, dW) on the same
    inputs, at an awkward shape with ratios outside the clip range."""
    import pytest

    pytest.importorskip("liger_kernel.chunked_loss")
    monkeypatch.syspath_prepend(ROOT)
    from bench.linear_head import GRPO_VARIANTS, TorchHeadCase

    out = {}
    for variant in GRPO_VARIANTS:
        case = TorchHeadCase(variant, 37, 19, 301, "float32", "cpu")
        value = case.fwd(0)
        out[variant] = [value.detach().double().numpy()] + [
            g.double().numpy() for g in case.fwdbwd(0)]
    old, _ = case.sets[0][3]
    h, w, y = case.sets[0][:3]
    logp = (h[0] @ w.T).log_softmax(-1).gather(-1, y[0, :, None])[:, 0]  # [N]
    ratio = (logp - old[0]).exp()
    assert ((ratio - 1).abs() > 0.2).any(), "no ratio outside the clip range"
    for variant in GRPO_VARIANTS[1:]:
        for name, got, want in zip(("loss", "dH", "dW"), out[variant], out["ours-grpo"]):
            assert_close(got, want, "float32", f"{variant} {name}")


def test_linear_head_bench(monkeypatch):
    """The linear-head cases (what python -m bench appends to its grid): parity first, then the
    fused head beside the unfused pipeline in both frameworks, with a 2N scaling row."""
    monkeypatch.syspath_prepend(ROOT)
    from bench import linear_head as LH

    head = LH.run(n=64, d=16, k=257, dtype="float32", reps=1, variants=["ours-ce", "unfused"],
                  memory=False)  # the memory probes are bench/memory.py's, timed in the smoke run
    assert head["parity"] and all(p["ok"] for p in head["parity"])
    timed = [r for r in head["results"] if "ms" in r]
    assert {(r["framework"], r["backend"]) for r in timed} == {
        (fw, v) for fw in ("torch", "jax") for v in ("ours-ce", "unfused")}
    for r in timed:  # TFLOP/s only where the matmul count does not depend on the schedule
        assert r["ms"] > 0 or (r["ms"] == 0 and r["derived"])  # a derived bwd may be 0
        assert (r["tflops"] is not None) == (r["mode"] == "fwd+bwd")
        assert r["peak_kind"] == "not measured"
    assert any(r.get("scaling") == "2N" for r in timed)



def test_bench_keeps_partial_report(tmp_path, monkeypatch):
    """A run killed mid-way (the GPU check's timeout) leaves the cases measured so far on disk."""
    import pytest

    monkeypatch.syspath_prepend(ROOT)
    import bench.runner as R

    real, calls = R.run_group, []

    def run_group_then_die(*args, **kwargs):
        if calls:
            raise KeyboardInterrupt  # the second group never finishes
        calls.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(R, "run_group", run_group_then_die)
    monkeypatch.setattr(R, "parity", lambda env: [])  # not what this test is about
    monkeypatch.setattr(R, "vocab_parallel_comm", lambda env: None)
    with pytest.raises(KeyboardInterrupt):
        R.main(["--smoke", "--reps", "2", "--objectives", "ce,opd", "--frameworks", "torch",
                "--no-linear-head", "--out", str(tmp_path)])
    (report,) = [json.load(open(tmp_path / f)) for f in os.listdir(tmp_path) if f.endswith(".json")]
    assert report["partial"] is True
    assert calls[0][2] == "ce" and len(calls[0][3]) > 1  # the first group: ce, every variant
    assert {(r["backend"], r["mode"]) for r in report["results"]} == {
        (v, m) for v in calls[0][3] for m in ("fwd", "bwd", "fwd+bwd")}
    assert all("ms" in r and "speedup" in r for r in report["results"])

def _same_loss_as_ours(variant, objective="ce"):
    """The loss a baseline variant times, and its gradient, equal ours (the chunked backend)
    on the same inputs: a peer configured to compute something else (another reduction,
    other targets) would be timed on another problem."""
    import torch

    from bench.cases import TorchCase

    out = []
    for name in ("chunked", variant):  # ours first: Liger writes its gradient into its input
        case = TorchCase(objective, name, 16, 257, "float32", "cpu")
        z, batch = case.sets[0]
        value = case._loss(z, batch)
        (grad,) = torch.autograd.grad(value, z)
        out.append((value.detach().double().numpy(), grad.detach().double().numpy()))
    (v_ours, g_ours), (v_peer, g_peer) = out
    assert_close(v_peer, v_ours, "float32", f"{variant} loss")
    assert_close(g_peer, g_ours, "float32", f"{variant} d logits")


def test_the_inplace_policy_variant_times_our_loss(monkeypatch):
    """"chunked+inplace" (policy_loss with inplace_grad=True) is the chunked loss and gradient,
    on input sets of its own (it writes into them) and with its backward derived (a second
    backward of one graph would read the overwritten logits); other objectives refuse it."""
    monkeypatch.syspath_prepend(ROOT)
    from bench.cases import TorchCase, writes_inputs

    _same_loss_as_ours("chunked+inplace", "policy")
    case = TorchCase("policy", "chunked+inplace", 16, 257, "float32", "cpu", rotate=1)
    (grad,) = case.fwdbwd(0)
    assert grad.data_ptr() == case.sets[0][0].data_ptr(), "not written over the logits"
    assert writes_inputs("chunked+inplace") and not writes_inputs("chunked")
    assert not case.separate_bwd
    ce = TorchCase("ce", "chunked+inplace", 16, 257, "float32", "cpu", rotate=1)
    with pytest.raises(ValueError, match="policy objective only; got objective 'ce'"):
        ce.fwd(0)


def test_upstream_baselines_time_our_loss(monkeypatch):
    """The materialised upstream losses (bench/upstream.py), torch eager and JAX jitted, are
    our loss and gradient for every objective (the torch.compile of the same function is the
    same code)."""
    import jax
    import numpy as np

    monkeypatch.syspath_prepend(ROOT)
    from bench.cases import JaxCase

    for objective in ("ce", "policy", "opd"):
        _same_loss_as_ours("upstream", objective)
        grads = []
        for name in ("chunked", "upstream"):
            case = JaxCase(objective, name, 16, 257, "float32")
            value, grad = case.fwdbwd(0)
            grads.append((np.float64(value), np.asarray(grad, np.float64)))
        assert_close(grads[1][0], grads[0][0], "float32", f"jax upstream {objective} loss")
        assert_close(grads[1][1], grads[0][1], "float32", f"jax upstream {objective} d logits")


def test_sft_baselines_are_the_sft_loss(monkeypatch):
    """Objective "sft" (the reweighted LOO SFT loss): ours (chunked) and the upstream loss as
    Megatron-Bridge writes it (``one_hot`` shift, CE, mask, time weight; torch eager, JAX
    jitted) each give the float64 oracle's loss and d logits on the case's own inputs, at an
    awkward K."""
    import numpy as np
    import oracle
    import torch

    monkeypatch.syspath_prepend(ROOT)
    from bench.cases import SFT_VARIANT, JaxCase, TorchCase

    n, k = 13, 300
    for name in ("chunked", "upstream"):
        for fw in ("torch", "jax"):
            case = (TorchCase("sft", name, n, k, "float32", "cpu") if fw == "torch"
                    else JaxCase("sft", name, n, k, "float32"))
            z, b = case.sets[0]
            if fw == "torch":
                value = case._loss(z, b)
                (grad,) = torch.autograd.grad(value, z)
                value, grad = value.detach(), grad
                z = z.detach()
            else:
                value, grad = case.fwdbwd(0)
            arrays = [np.asarray(a, np.float64) for a in (value, grad, z, b.t, b.loss_mask)]
            value, grad, z64, t, mask = arrays
            x0, xt = np.asarray(b.x0), np.asarray(b.xt)
            assert 0.05 <= t.item() <= 0.95 and (x0 != xt).any()  # a real shift, elsewhere
            want = oracle.sft_loss(z64, x0, xt, t, mask, SFT_VARIANT, k).sum()
            want_grad = oracle.sft_loss_grad(z64, x0, xt, t, mask, SFT_VARIANT, k, np.ones(1))
            assert_close(value, want, "float32", f"{fw} {name} sft loss")
            assert_close(grad, want_grad, "float32", f"{fw} {name} sft d logits")


def test_torch_compile_baseline_case(monkeypatch):
    """The torch.compile baseline (timed on GPUs) computes our loss and runs end to end; its
    backward is derived."""
    import types

    monkeypatch.syspath_prepend(ROOT)
    from bench.runner import detect, run_case

    _same_loss_as_ours("reference+compile")
    rows = run_case(detect(), "torch", "ce", "reference+compile", "tiny", 16, 257, "float32",
                    10.0, types.SimpleNamespace(reps=2))
    assert all(r["ms"] > 0 for r in rows if r["mode"] != "bwd"), rows
    assert next(r for r in rows if r["mode"] == "bwd")["derived"]


def test_torch_compile_baseline_compiles_every_case_statically(monkeypatch):
    """Across the grid, every reference+compile case is one graph at its own static shape.
    Before the fix the second shape recompiled with symbolic sizes and, past Dynamo's limit of
    8 recompiles of the shared `loss`, later cases ran the reference eagerly under the compile
    label. Dynamo is run with a backend that records each graph's inputs (no Inductor)."""
    import torch

    monkeypatch.syspath_prepend(ROOT)
    from bench.cases import TorchCase

    graphs, real_compile = [], torch.compile

    def record(gm, example_inputs):
        graphs.append([tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                       for t in example_inputs])
        return gm.forward

    monkeypatch.setattr(torch, "compile", lambda fn, **kw: real_compile(fn, backend=record, **kw))
    for n, k in ((16, 257), (24, 257), (8, 300), (16, 311)):  # 12 cases, more than 8
        for objective in ("ce", "policy", "opd"):
            case = TorchCase(objective, "reference+compile", n, k, "float32", "cpu")
            before = len(graphs)
            case.fwd(0), case.fwdbwd(1)
            (inputs,) = graphs[before:]  # one graph per case, the same for both calls
            assert all(isinstance(s, tuple) for s in inputs), (objective, n, k, inputs)
            assert (1, n, k) in inputs, (objective, n, k, inputs)


def test_liger_baseline_case(monkeypatch):
    """The Liger-Kernel baseline (timed on GPUs) computes our loss and runs end to end; on
    CPU through the Triton interpreter that conftest turns on."""
    import types

    import pytest

    pytest.importorskip("liger_kernel")
    monkeypatch.syspath_prepend(ROOT)
    from bench import shapes
    from bench.runner import detect, run_case

    _same_loss_as_ours("liger")
    rows = run_case(detect(), "torch", "ce", "liger", "tiny", 16, 257, "float32", 10.0,
                    types.SimpleNamespace(reps=2))
    assert [r["mode"] for r in rows] == list(shapes.MODES), rows
    assert all(r["ms"] > 0 for r in rows if r["mode"] != "bwd"), rows


def test_launch_sweep_smoke(tmp_path):
    """bench/launch_sweep.py end to end (Triton interpreter): every plan timed, the heuristic's
    plan marked once, bytes as documented."""
    import pytest

    pytest.importorskip("triton")
    n, k = 3, 300
    subprocess.run([sys.executable, "-m", "bench.launch_sweep", "--n", str(n), "--k", str(k),
                    "--dtype", "float32", "--blocks", "128,512", "--warps", "1,2", "--reps", "2",
                    "--out", str(tmp_path)], cwd=ROOT, check=True, capture_output=True, text=True)
    (name,) = os.listdir(tmp_path)  # a non-default case is named after its shape
    assert name.endswith(f"-n{n}-k{k}-float32.json"), name
    report = json.load(open(tmp_path / name))
    assert [(r["block_k"], r["num_warps"]) for r in report["rows"]] == [
        (128, 1), (128, 2), (512, 1), (512, 2)]
    plan = report["heuristic"]  # K = 300 f32: one 512-column block (2 KiB), 2 warps
    assert (plan["block_k"], plan["num_warps"]) == (512, 2)
    assert [r["heuristic"] for r in report["rows"]] == [False, False, False, True]
    for r in report["rows"]:
        assert r["partial"]["bytes"] == n * k * 4 and r["grad"]["bytes"] == 2 * n * k * 4
        assert r["partial"]["ms"] > 0 and r["grad"]["gbps"] > 0


def test_share_gpu_with_torch_sets_one_memory_limit(monkeypatch):
    """jaxlib 0.11 refuses to start its GPU plugin when both names of the memory limit are set
    (the first H200 run's JAX fell back to the CPU so): the bench sets one, and none over a
    caller's own."""
    monkeypatch.syspath_prepend(ROOT)
    from bench.runner import share_gpu_with_torch

    names = ("XLA_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_MEM_FRACTION")
    env = {}
    share_gpu_with_torch(env)
    assert env["XLA_PYTHON_CLIENT_PREALLOCATE"] == "false"
    assert sum(n in env for n in names) == 1 and 0 < float(env[names[1]]) <= 0.5
    for name in names:
        env = {name: "0.3"}
        share_gpu_with_torch(env)
        assert {n: env.get(n) for n in names} == {n: "0.3" if n == name else None for n in names}
    xla_client = __import__("jaxlib.xla_client", fromlist=["xla_client"])
    if hasattr(xla_client, "generate_pjrt_gpu_plugin_options"):  # jaxlib's own check, no GPU needed
        for name in names:
            monkeypatch.delenv(name, raising=False)
        env = {}
        share_gpu_with_torch(env)
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        assert xla_client.generate_pjrt_gpu_plugin_options()["memory_fraction"] == 0.5


def test_jax_on_cpu_beside_a_gpu_is_not_timed(monkeypatch):
    monkeypatch.syspath_prepend(ROOT)
    from bench.runner import frameworks_to_time

    env = dict(torch=True, jax=True, cuda=True, jax_backend="cpu")
    assert frameworks_to_time(env, ["torch", "jax"]) == ["torch"]
    assert frameworks_to_time(dict(env, jax_backend="gpu"), ["torch", "jax"]) == ["torch", "jax"]
    assert frameworks_to_time(dict(env, cuda=False), ["torch", "jax"]) == ["torch", "jax"]
    assert frameworks_to_time(dict(env, jax=False), ["torch", "jax"]) == ["torch"]


def test_detect_does_not_import_jax_triton(monkeypatch, tmp_path):
    """The first H200 run: the benchmark's version report imported jax_triton, whose import
    blanks TRITON_CACHE_DIR, and every torch Triton compile after it failed. detect() reads
    versions from package metadata and imports no jax_triton."""
    import sys

    (tmp_path / "jax_triton.py").write_text(
        "import os\nos.environ['TRITON_CACHE_DIR'] = ''  # what jax-triton 0.3.1 does\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.syspath_prepend(ROOT)
    monkeypatch.delitem(sys.modules, "jax_triton", raising=False)
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "cache"))
    from bench.runner import detect

    env = detect()
    assert "jax_triton" not in sys.modules
    assert os.environ["TRITON_CACHE_DIR"] == str(tmp_path / "cache")
    assert env["versions"]["numpy"] and env["versions"].get("torch")


def test_back_to_back_timing(monkeypatch):
    """On a GPU, measure() also times the same calls back to back between one pair of events
    (host time before the first launch then overlaps the GPU's work); a stand-in for CUDA
    events on the host clock checks the bookkeeping here."""
    import time
    import types

    monkeypatch.syspath_prepend(ROOT)
    import bench.timing as T

    class Event:
        def __init__(self, enable_timing):
            assert enable_timing

        def record(self):
            self.t = time.perf_counter()

        def synchronize(self):
            pass

        def elapsed_time(self, other):
            return (other.t - self.t) * 1e3

    fake = types.SimpleNamespace(cuda=types.SimpleNamespace(Event=Event))
    monkeypatch.setattr(T, "_torch_cuda", lambda: fake)
    calls = []

    def fn(i):
        calls.append(i)
        time.sleep(0.002)

    t = T.measure(fn, cuda=True, warmup=1, reps=4)
    assert calls == [0] + [0, 1, 2, 3] + [0, 1, 2, 3]  # warm-up, per call, back to back
    assert t["reps"] == 4 and 2.0 <= t["back_to_back_ms"] < 50 and 2.0 <= t["ms"] < 50
    assert "back_to_back_ms" not in T.measure(fn, cuda=False, warmup=0, reps=2)


def test_markdown_back_to_back_column(monkeypatch):
    monkeypatch.syspath_prepend(ROOT)
    from bench.runner import add_speedups, markdown

    row = dict(framework="torch", objective="ce", backend="triton", shape="s", mode="fwd",
               ms=2.0, p20=1.9, p80=2.1, gbps=10.0, pct_copy=50.0, peak_bytes=2**20)
    env = dict(device="d", date="2026-11-30")
    for b2b in (None, 1.5):
        results = [dict(row, back_to_back_ms=b2b),
                   dict(row, backend="reference", error="OutOfMemoryError: CUDA out of memory. More")]
        add_speedups(results)
        table = markdown(env, 20.0, results, [])
        lines = [l for l in table.splitlines() if l.startswith("|")]
        assert len({l.count("|") for l in lines}) == 1, table  # every row has the header's cells
        assert ("ms back to back" in table) == (b2b is not None)
        assert ("| 1.50 |" in table) == (b2b is not None)
        assert "OutOfMemoryError: CUDA out of memory |" in table and "More" not in table


def test_skip_reason(monkeypatch):
    monkeypatch.syspath_prepend(ROOT)
    from bench.runner import skip_reason

    gpu, cpu = dict(cuda=True), dict(cuda=False)
    assert skip_reason(gpu, "triton", 3, 10.0, 60.0) is None
    assert skip_reason(gpu, "chunked", 0, 10.0, 60.0) is None  # the first shape: timed
    assert "first GPU shape" in skip_reason(gpu, "chunked", 1, 10.0, 60.0)
    assert skip_reason(cpu, "chunked", 2, 10.0, None) is None  # CPU: the fallback is the point
    assert skip_reason(cpu, "reference", 0, 61.0, 60.0) == "time budget"


def test_full_grid_is_the_issues_grid_then_new_vocabularies(monkeypatch):
    """--full times the Triton issue's grid (target shape first), then each model vocabulary
    not already in it, no (N, K) twice: a GPU run's minutes are not spent on repeats."""
    monkeypatch.syspath_prepend(ROOT)
    from bench import shapes as S

    grid = [(n, k) for _, n, k, _ in S.FULL_SHAPES[:6]]
    assert grid[0] == (16384, 262144)
    assert sorted(grid) == sorted((n, k) for n in (4096, 16384) for k in (32768, 131072, 262144))
    keys = [(n, k, dtype) for _, n, k, dtype in S.FULL_SHAPES]
    assert len(set(keys)) == len(keys) and {k for _, k, _ in keys} >= set(S.MODELS.values())


def test_torch_grid_is_timed_before_any_jax_case(monkeypatch, tmp_path):
    """A run that its budget cuts short has timed every torch shape before the first JAX case."""
    monkeypatch.syspath_prepend(ROOT)
    import bench.runner as R
    from bench import shapes as S

    order = []

    def stub_group(env, fw, objective, names, label, n, k, dtype, copy_gbps, args, rotate):
        order.append((fw, label))
        return sum((R.untimed_rows(fw, objective, v, label, n, k, dtype, "stub") for v in names),
                   [])

    monkeypatch.setattr(R, "run_group", stub_group)
    monkeypatch.setattr(R, "parity", lambda env: [])
    monkeypatch.setattr(R, "vocab_parallel_comm", lambda env: None)
    monkeypatch.setattr(S, "SMOKE_SHAPES", [("a", 8, 130, "float32"), ("b", 4, 70, "float32")])
    # (the denoising step runs after the grid, never through run_group: test_bench_smoke's)
    R.main(["--smoke", "--reps", "1", "--objectives", "ce", "--no-linear-head", "--no-sampling",
            "--out", str(tmp_path)])
    frameworks = [fw for fw, _ in order]
    assert frameworks == sorted(frameworks, key=["torch", "jax"].index), order
    assert {label for fw, label in order if fw == "torch"} == {"a", "b"}


def test_sampling_bench(tmp_path):
    """python -m bench.sampling at a small shape: every variant asked for is timed (torch and
    JAX side by side), with the bytes of its one read, % of copy and its peak memory. (ours and
    float32, torch's SampleCase as the steps here are, run through the same bench.sampling.run
    in test_bench_smoke, timed and probed for their peak.)"""
    variants = ["ours-jax", "upstream-step", "ours-step"]
    subprocess.run([sys.executable, "-m", "bench.sampling", "--n", "64", "--k", "1000",
                    "--dtype", "float32", "--reps", "2", "--variants", ",".join(variants),
                    "--json", str(tmp_path / "s.json"), "--md", str(tmp_path / "s.md")],
                   cwd=ROOT, check=True, capture_output=True, text=True)
    report = json.load(open(tmp_path / "s.json"))
    rows = {r["variant"]: r for r in report["results"]}
    assert list(rows) == variants and report["copy_gbps"] > 0 and report["device"]
    for r in rows.values():
        assert "error" not in r, r
        assert r["ms"] > 0 and r["bytes"] == 64 * 1000 * 4 and r["pct_copy"] > 0
        assert r["peak_bytes"] is not None and r["peak_bytes"] >= 0
    table = open(tmp_path / "s.md").read()
    assert all(f"| {v} |" in table for v in variants), table
    # ours-step against it, in words
    assert re.search(r"\| upstream-step \|.*\| [0-9]+\.[0-9]x (faster|slower) \|", table), table


# -- the picture and the words (synthetic results: no timing) --------------------------------------

def _synthetic_run(seed=0, ns=(256,), ks=(2048, 4096, 16384), objectives=("ce", "policy", "opd")):
    """(results, head, draw) as a CPU quick run would report them, every peer included."""
    import numpy as np

    rng = np.random.default_rng(seed)
    backends = {"torch": ("chunked", "reference", "upstream", "upstream+compile"),
                "jax": ("chunked", "reference", "upstream")}
    kinds = {"torch": "VmHWM delta (own process)", "jax": "XLA temp bytes (memory_analysis)"}
    results = []
    for fw, names in backends.items():
        for obj in objectives:
            for n in ns:
                for dtype in ("float32", "bfloat16"):
                    for k in ks:
                        for b in names:
                            base = dict(framework=fw, objective=obj, backend=b, n=n, k=k,
                                        dtype=dtype, shape=f"N{n}-K{k}-{dtype}")
                            for mode in ("fwd", "bwd", "fwd+bwd"):
                                scale = (1 if b == "chunked" else 3) * n * k / 2**17
                                results.append(dict(
                                    base, mode=mode, ms=float(scale * rng.uniform(0.8, 1.2)),
                                    peak_bytes=int(scale * 2**20 * rng.uniform(1, 4)),
                                    peak_kind=kinds[fw]))
    head = dict(shape=dict(n=512, d=64, k=4096, dtype="float32"), results=[
        dict(framework=fw, backend=b, mode="fwd+bwd", ms=float(rng.uniform(5, 30)),
             peak_bytes=None if b == "tokamax" else int(rng.uniform(1, 40) * 2**20))
        for fw, b in (("torch", "ours-ce"), ("torch", "unfused"), ("jax", "ours-ce"),
                      ("jax", "tokamax"))])
    # the denoising step as the quick run of 2026-12-01 measured it: times within one decade,
    # where a log axis had two labels
    draw = dict(results=[dict(variant=v, n=256, k=32768, dtype="float32", ms=ms,
                              peak_bytes=None if mib is None else int(mib * 2**20))
                         for v, ms, mib in (("ours", 73.6, 28.7), ("ours-jax", 86.5, None),
                                            ("llada-float64", 206.9, 320.0),
                                            ("float32", 94.7, 160.0))])
    return results, head, draw


def _rendered(monkeypatch, tmp_path, *run, env=None):
    """The figure bench.runner.plot draws for ``run`` (results, head, draw), kept open."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    monkeypatch.syspath_prepend(ROOT)
    from bench.runner import plot

    figures = []
    monkeypatch.setattr(plt, "close", lambda fig=None: figures.append(fig))
    results, head, draw = run
    env = env or dict(device="a CPU (2 cores)", date="2026-12-02")
    assert plot(results, str(tmp_path / "p.png"), head, env, draw)
    (fig,) = figures
    fig.canvas.draw()
    monkeypatch.undo()
    return fig


def _data_axes(fig):
    return [ax for ax in fig.axes if ax.get_lines() or ax.patches]


def test_plot_series_have_their_own_colour_and_marker(monkeypatch, tmp_path):
    """A series is one backend and dtype; in a panel no two series share a colour or
    a marker, and a series keeps its colour and marker in every panel (the peers too); ours
    is named so in the labels."""
    from matplotlib.colors import to_hex

    fig = _rendered(monkeypatch, tmp_path, *_synthetic_run())
    seen = {}
    line_axes = [ax for ax in _data_axes(fig) if ax.get_lines()]
    series_axes = [ax for ax in line_axes if "/ peer" not in ax.get_title()]
    for ax in series_axes:
        styles = [(line.get_label(), to_hex(line.get_color()), line.get_marker())
                  for line in ax.get_lines()]
        assert len({c for _, c, _ in styles}) == len(styles), (ax.get_title(), styles)
        assert len({m for _, _, m in styles}) == len(styles), (ax.get_title(), styles)
        assert len(styles) in (6, 8), styles  # jax: 3 backends x 2 dtypes; torch: 4 x 2
        for label, colour, marker in styles:
            assert seen.setdefault(label, (colour, marker)) == (colour, marker), label
    # 3 objectives x (time, ours / peer, memory) x (torch, jax)
    assert len(series_axes) == 12 and len(line_axes) == 18
    assert {label.split()[0] for label in seen} == {
        "chunked", "reference", "upstream", "upstream+compile"}, seen
    assert {label for label in seen if "(ours)" in label} == {
        "chunked (ours) float32", "chunked (ours) bfloat16"}, seen
    import matplotlib.pyplot as plt

    plt.close(fig)


def test_plot_ratio_panel_answers_how_much_faster(monkeypatch, tmp_path):
    """A panel per objective and framework of ours / peer: the forward+backward time ratio
    per peer and dtype (its band from the p20-p80 spreads, which holds 1 where they overlap),
    the peak-memory ratio dotted, a line at 1, a log axis; our own reference is no peer."""
    from matplotlib.colors import to_hex

    results, _, _ = _synthetic_run(objectives=("ce",))
    for r in results:
        r.update(p20=0.9 * r["ms"], p80=1.1 * r["ms"])
    fig = _rendered(monkeypatch, tmp_path, results, None, None)
    (ratio,) = [ax for ax in fig.axes if ax.get_title() == "ce, torch: chunked (ours) / peer"]
    assert ratio.get_yscale() == "log"
    lines = [line for line in ratio.get_lines() if len(line.get_xdata()) == 3]
    times = [line for line in lines if line.get_linestyle() != ":"]
    memory = [line for line in lines if line.get_linestyle() == ":"]
    # torch: upstream and upstream+compile (no reference) x 2 dtypes, each time and memory
    assert len(times) == len(memory) == 4, [line.get_label() for line in lines]
    assert {to_hex(line.get_color()) for line in times} == {to_hex(line.get_color())
                                                            for line in memory}
    assert any(list(line.get_ydata()) == [1.0, 1.0] for line in ratio.get_lines())  # y = 1
    assert len(ratio.collections) == 4  # a band per time ratio
    for line in times:  # ours is 1/3 of the peer's time in the synthetic run, 0.8-1.2 each
        assert all(0.2 < v < 0.5 for v in line.get_ydata()), list(line.get_ydata())
    import matplotlib.pyplot as plt

    plt.close(fig)


def test_plot_legends_sit_outside_the_data(monkeypatch, tmp_path):
    fig = _rendered(monkeypatch, tmp_path, *_synthetic_run())
    legends = [ax.get_legend() for ax in fig.axes if ax.get_legend()] + fig.legends
    assert len(legends) == 3  # one per row of lines
    for legend in legends:
        box = legend.get_window_extent()
        for ax in _data_axes(fig):
            assert not box.overlaps(ax.get_window_extent()), ax.get_title()
    import matplotlib.pyplot as plt

    plt.close(fig)


def test_plot_bars_carry_their_values(monkeypatch, tmp_path):
    """The linear head's and the denoising step's bars, time and memory, each with its
    number (or n/a) at its end; the step's time axis with readable tick labels."""
    fig = _rendered(monkeypatch, tmp_path, *_synthetic_run())
    bar_axes = [ax for ax in _data_axes(fig) if ax.patches]
    assert len(bar_axes) == 4
    for ax in bar_axes:  # at least 3 labels, one size, none over another
        labels = [t for t in ax.get_xticklabels() if t.get_visible() and t.get_text()
                  and ax.get_xlim()[0] <= t.get_position()[0] <= ax.get_xlim()[1]]
        assert len(labels) >= 3, (ax.get_title(), [t.get_text() for t in labels])
        assert len({t.get_fontsize() for t in labels}) == 1, ax.get_title()
        boxes = [t.get_window_extent() for t in labels]
        assert not any(a.overlaps(b) for i, a in enumerate(boxes) for b in boxes[i + 1:])
    for ax in bar_axes:
        texts = [t.get_text() for t in ax.texts]
        assert len(texts) == len(ax.patches), (ax.get_title(), texts)
        assert all(re.fullmatch(r"[0-9.]+ (ms|MiB)|n/a", t) for t in texts), texts
    by_title = {ax.get_title(): ax for ax in bar_axes}
    step = by_title["denoising step: N = 256, K = 32768, float32"]
    assert sorted(t.get_text() for t in step.texts) == ["207 ms", "73.6 ms", "86.5 ms",
                                                         "94.7 ms"]
    memory = by_title["denoising step: peak beyond the logits"]
    assert "n/a" in [t.get_text() for t in memory.texts]  # ours-jax: no peak
    import matplotlib.pyplot as plt

    plt.close(fig)


def test_plot_a_row_per_n(monkeypatch, tmp_path):
    """A GPU grid with two N: each line is a trend over K at one N (never zig-zags between
    N); a framework that timed nothing in a row gets no panel there (no empty panels), and
    a panel of memory that was not measured is not drawn."""
    results, _, _ = _synthetic_run(ns=(16384, 4096), ks=(32768, 131072, 262144),
                                   objectives=("ce",))
    results = [r for r in results if r["framework"] == "torch" or r["n"] == 16384]
    for r in results:
        if r["framework"] == "jax":
            r["peak_bytes"] = None
    fig = _rendered(monkeypatch, tmp_path, results, None, None)
    titles = [ax.get_title() for ax in fig.axes]
    assert "ce, torch: fwd+bwd time, N = 16384" in titles
    assert "ce, torch: fwd+bwd time, N = 4096" in titles
    assert "ce, jax: fwd+bwd time, N = 16384" in titles
    assert not any(t.startswith("ce, jax") and t.endswith("N = 4096") for t in titles), titles
    assert "ce, jax: peak memory beyond inputs" not in titles
    for ax in _data_axes(fig):
        for line in ax.get_lines():
            ks = list(line.get_xdata())
            if len(ks) > 2:
                assert ks == sorted(set(ks)) and len(ks) == 3, (ax.get_title(), ks)
    assert all(ax in _data_axes(fig) or not ax.axison for ax in fig.axes)  # legends aside
    import matplotlib.pyplot as plt

    plt.close(fig)


def test_plot_log_axis_where_one_bar_dwarfs_the_rest(monkeypatch, tmp_path):
    """A bar row whose largest value is more than 20 times its smallest takes a log axis (the
    small bars stay readable); one within that range stays linear from 0."""
    results, head, draw = _synthetic_run(objectives=("ce",))
    for r, ms in zip(draw["results"], (1.0, 2.0, 400.0, 3.0)):
        r["ms"] = ms
    fig = _rendered(monkeypatch, tmp_path, results, head, draw)
    by_title = {ax.get_title(): ax for ax in fig.axes}
    step = by_title["denoising step: N = 256, K = 32768, float32"]
    assert step.get_xscale() == "log" and "log scale" in step.get_xlabel()
    assert sorted(t.get_text() for t in step.texts) == ["1.00 ms", "2.00 ms", "3.00 ms", "400 ms"]
    widths = {round(p.get_x() + p.get_width(), 6) for p in step.patches}
    assert widths == {1.0, 2.0, 3.0, 400.0}  # each bar ends at its value
    assert by_title["denoising step: peak beyond the logits"].get_xscale() == "linear"
    import matplotlib.pyplot as plt

    plt.close(fig)


def _timed_row(fw, obj, backend, shape, ms, mib, spread=0.05, mode="fwd+bwd"):
    """A result row of ``ms`` (its p20-p80 ``spread`` either side) and ``mib`` peak."""
    return dict(framework=fw, objective=obj, backend=backend, shape=shape, mode=mode, ms=ms,
                p20=ms * (1 - spread), p80=ms * (1 + spread), peak_bytes=int(mib * 2**20))


def test_summary_leads_with_the_strongest_peer(monkeypatch):
    """The closing summary leads, per objective, with ours against the fastest peer
    a user would run instead (never our own reference), ratios in words."""
    monkeypatch.syspath_prepend(ROOT)
    from bench.progress import summary
    from bench.runner import PEERS

    row = _timed_row
    results = [row("torch", "ce", "chunked", "a", 10.0, 1.0),
               row("torch", "ce", "reference", "a", 5.0, 9.0),  # the oracle: not a peer
               row("torch", "ce", "upstream", "a", 30.0, 12.0),
               row("torch", "ce", "upstream+compile", "a", 13.0, 9.0),
               row("jax", "ce", "chunked", "a", 20.0, 6.0),
               row("jax", "ce", "upstream", "a", 10.0, 10.0),
               row("torch", "opd", "chunked", "a", 8.0, 3.0)]
    lines = summary(results, PEERS)
    assert lines[1:4] == [
        "  CE fwd+bwd, torch chunked: 1.3x faster than torch.compile (upstream+compile) at "
        "the one shape, 1/9 of its memory; 3.0x faster than eager PyTorch (upstream) at the "
        "one shape, 1/12 of its memory",
        "  CE fwd+bwd, jax chunked: 2.0x slower than jax.jit (upstream) at the one shape, 60% "
        "of its memory",
        "  OPD fwd+bwd, torch chunked: no peer timed"], lines
    assert len(lines) == 4  # all measured apart: nothing left to re-measure
    assert not any(re.search(r"\b0\.\d+x", line) for line in lines), lines
    from bench.progress import _memory_words

    assert [_memory_words(r) for r in (1 / 9, 0.4, 1.0, 2.5, 52000.0)] == [
        "1/9 of its memory", "40% of its memory", "the same memory", "2.5x its memory",
        "52000x its memory"]  # 0.4 read "1/2", 52000 "52000.0x" before


def test_summary_claims_speed_only_where_spreads_are_apart(monkeypatch):
    """On a busy machine the p20-p80 spreads of ours and a peer overlap: no speed claim is
    made from such a shape ("within noise"), the lead holds only what was measured apart at
    every shape, the rest follows to re-measure; the tables' cells say the same."""
    monkeypatch.syspath_prepend(ROOT)
    from bench.progress import load_line, ratio_band, spread_verdict, summary
    from bench.runner import PEERS, add_speedups, markdown

    row = _timed_row
    ours, close, far = (row("torch", "ce", "chunked", "a", 10.0, 1.0, 0.1),
                        row("torch", "ce", "upstream", "a", 10.5, 1.0, 0.1),
                        row("torch", "ce", "upstream", "a", 20.0, 1.0, 0.05))
    assert spread_verdict(ours, close) == "within noise"
    assert spread_verdict(ours, far) == "faster" and spread_verdict(far, ours) == "slower"
    assert spread_verdict(ours, dict(close, p20=None, p80=None)) is None  # a derived time
    low, high = ratio_band(ours, close)[1:]
    assert low < 1 < high  # the ratio's band holds 1 exactly where the spreads overlap
    assert ratio_band(ours, far)[2] < 1
    results = [ours, close, dict(ours, shape="b"), dict(far, shape="b"),
               row("torch", "ce", "upstream+compile", "a", 10.2, 1.0, 0.1),
               row("torch", "ce", "upstream+compile", "b", 10.1, 1.0, 0.1),
               row("torch", "sft", "chunked", "a", 10.0, 1.0, 0.01),
               row("torch", "sft", "upstream", "a", 40.0, 2.0, 0.01),
               row("torch", "sft", "upstream+compile", "a", 10.3, 1.0, 0.1)]
    lines = summary(results, PEERS)
    lead = lines[:lines.index(next(l for l in lines if l.startswith("Not settled")))]
    assert lead[1:] == ["  SFT fwd+bwd, torch chunked: 4.0x faster than eager PyTorch "
                        "(upstream) at the one shape, 50% of its memory"], lines
    assert not any("CE" in line or "torch.compile" in line for line in lead), lines
    assert lines[len(lead) + 1:] == [
        "  CE fwd+bwd, torch chunked vs torch.compile (upstream+compile): within noise at 2 of "
        "2 shapes; the same memory",
        "  CE fwd+bwd, torch chunked vs eager PyTorch (upstream): within noise at 1 of 2 "
        "shapes, 2.0x faster at 1; the same memory",
        "  SFT fwd+bwd, torch chunked vs torch.compile (upstream+compile): within noise at 1 "
        "of 1 shapes; the same memory"], lines
    for r in results:
        r.update(k=1, n=1, dtype="float32", gbps=None, pct_copy=None)
    add_speedups(results)
    table = markdown(dict(device="d", date="2026-12-03"), 1.0, results, [])
    ce = table[table.index("### ce"):table.index("### sft")]
    cells = {line.split(" | ")[2]: line for line in ce.splitlines()
             if line.startswith("| torch | chunked |")}
    assert cells["a"].endswith("| within noise | within noise |"), cells
    assert cells["b"].endswith("| 2.0x faster | within noise |"), cells
    busy = load_line(dict(before=[2.4, 3.1, 3.8], after=[3.0, 3.2, 3.7], cores=2))
    assert busy.startswith("Machine load (1-minute average): 2.40 before the run, 3.00 after "
                           "it, 2 cores") and "re-run on a quiet machine" in busy
    assert "quiet" not in load_line(dict(before=[0.1, 0.2, 0.2], after=[1.9, 1, 1], cores=2))


def test_interleaved_timing_order(monkeypatch):
    """measure_interleaved: each function's warm-up, then rep by rep A0 B0 A1 B1 ... (never all
    of A, then all of B); one that raises leaves the loop with its error, the rest go on."""
    monkeypatch.syspath_prepend(ROOT)
    from bench.timing import measure_interleaved

    calls = []

    def fn(name, fail_at=None):
        def call(i):
            calls.append((name, i))
            if i == fail_at and len([c for c in calls if c[0] == name]) > 2:
                raise MemoryError("out of memory")
        return call

    t = measure_interleaved({"ours": fn("ours"), "peer": fn("peer"), "bad": fn("bad", 1)},
                            warmup=2, reps=3)
    assert calls == [("ours", 0), ("ours", 1), ("peer", 0), ("peer", 1), ("bad", 0), ("bad", 1),
                     ("ours", 0), ("peer", 0), ("bad", 0), ("ours", 1), ("peer", 1),
                     ("bad", 1), ("ours", 2), ("peer", 2)], calls
    assert t["ours"]["reps"] == t["peer"]["reps"] == 3 and len(t["ours"]["times"]) == 3
    assert t["ours"]["p20"] <= t["ours"]["ms"] <= t["ours"]["p80"]
    assert t["bad"] == dict(error="MemoryError: out of memory")


def test_run_group_times_the_variants_side_by_side(monkeypatch):
    """The variants of one objective at one shape are timed call by call on one draw of
    inputs (ours, peer, ours, peer, ... for the forward and for forward+backward); torch's
    separate backward one variant after another."""
    import types

    monkeypatch.syspath_prepend(ROOT)
    import bench.runner as R
    from bench.cases import TorchCase

    calls = []
    for mode in ("fwd", "fwdbwd", "bwd"):
        def logged(self, i, real=getattr(TorchCase, mode), mode=mode):
            calls.append((mode, self.variant, i))
            return real(self, i)
        monkeypatch.setattr(TorchCase, mode, logged)
    monkeypatch.setattr(R, "cpu_peak_bytes", lambda *a: 2**20)  # no probe process here
    env = dict(cuda=False)
    rows = R.run_group(env, "torch", "ce", ["chunked", "upstream"], "tiny", 16, 257, "float32",
                       10.0, types.SimpleNamespace(reps=3))
    for mode in ("fwd", "fwdbwd"):
        got = [(v, i) for m, v, i in calls if m == mode]
        # (after them, the separate backward's timing builds its graphs with fwd)
        assert len(got) == 10 + 4 * (mode == "fwd"), (mode, calls)
        assert got[:10] == [("chunked", 0), ("chunked", 1), ("upstream", 0), ("upstream", 1)] + [
            (v, i) for i in range(3) for v in ("chunked", "upstream")], (mode, calls)
    bwd = [(v, i) for m, v, i in calls if m == "bwd"]
    assert bwd == [("chunked", i) for i in (0, 1, 0, 1, 2)] + [
        ("upstream", i) for i in (0, 1, 0, 1, 2)], bwd
    assert {(r["backend"], r["mode"]) for r in rows} == {
        (v, m) for v in ("chunked", "upstream") for m in ("fwd", "bwd", "fwd+bwd")}
    assert all(r["interleaved"] == (r["mode"] != "bwd") and r["peak_bytes"] == 2**20
               and r["case_s"] > 0 for r in rows)


def test_load_and_summary_go_into_the_results(monkeypatch, tmp_path, capsys):
    """The machine's load average before and after the run, and the closing summary, are in
    the results' JSON and Markdown, not only on stdout. Cases are stubs (no timing)."""
    monkeypatch.syspath_prepend(ROOT)
    import bench.runner as R

    loads = [(2.4, 2.0, 1.5), (3.8, 3.0, 2.0)]  # at the start, then ever after
    monkeypatch.setattr(os, "getloadavg", lambda: loads.pop(0) if len(loads) > 1 else loads[0])

    def stub_group(env, fw, objective, names, label, n, k, dtype, copy_gbps, args, rotate):
        ms = {"chunked": 10.0, "reference": 30.0, "upstream": 11.0}
        return [dict(framework=fw, objective=objective, backend=v, shape=label, n=n, k=k,
                     dtype=dtype, mode=m, ms=ms[v], p20=ms[v] * 0.8, p80=ms[v] * 1.2,
                     gbps=1.0, pct_copy=5.0, peak_bytes=2**20, rotate=rotate)
                for v in names for m in ("fwd", "bwd", "fwd+bwd")]

    monkeypatch.setattr(R, "run_group", stub_group)
    monkeypatch.setattr(R, "parity", lambda env: [])
    monkeypatch.setattr(R, "vocab_parallel_comm", lambda env: None)
    monkeypatch.setattr(R, "plot", lambda *a: None)
    R.main(["--smoke", "--reps", "1", "--objectives", "ce", "--frameworks", "torch",
            "--no-linear-head", "--no-sampling", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    (stem,) = {f.rsplit(".", 1)[0] for f in os.listdir(tmp_path)}
    report = json.load(open(tmp_path / f"{stem}.json"))
    table = open(tmp_path / f"{stem}.md").read()
    assert report["load"]["before"] == [2.4, 2.0, 1.5] and report["load"]["after"] == [3.8, 3.0, 2.0]
    assert report["load"]["cores"] == os.cpu_count()
    lines = report["summary"]
    assert lines[0].startswith("Summary (") and lines[-1].startswith(
        "Machine load (1-minute average): 2.40 before the run, 3.80 after it")
    assert "  CE fwd+bwd, torch chunked vs eager PyTorch (upstream): within noise at 1 of 1 " \
           "shapes; the same memory" in lines
    assert "\n".join(lines) in out and "## Summary" in table
    assert all(line in table for line in lines)
    assert table.index("Machine load") < table.index("## Summary") < table.index("### ce")


def test_memory_probe_warms_up_at_the_measured_shape(monkeypatch):
    """The memory probe's warm-up is the measured call itself, at its shape: a warm-up at
    another N made a static-shape torch.compile peer compile again inside the window, and
    the compile's memory (33 MiB at every K of the quick grid) was reported as the loss's."""
    monkeypatch.syspath_prepend(ROOT)
    import bench.cases
    import bench.memory as M

    built, ran = [], []

    class Case:
        def __init__(self, objective, variant, n, k, dtype, device, rotate=2):
            self.shape = (variant, n, k)
            built.append(self)

        def fwdbwd(self, i):
            ran.append(self.shape)

    monkeypatch.setattr(bench.cases, "TorchCase", Case)
    windows = []
    monkeypatch.setattr(M, "rss_peak_delta",
                        lambda run, warm: (warm(), windows.append(len(ran)), run(), 0)[-1])
    for n, k in ((256, 2048), (4096, 32768)):
        ran.clear(), built.clear()
        M._probe("ce", "upstream+compile", n, k, "float32")
        assert ran == [("upstream+compile", n, k)] * 2 and windows[-1] == 1, ran
        assert len(built) == 1  # the same case (its compiled graph) in and before the window


def test_run_time_estimate_is_one_number(monkeypatch):
    """The quick job's time has one source: its estimate from its own case list, which the
    run prints, --help quotes and the README quotes."""
    monkeypatch.syspath_prepend(ROOT)
    import bench.runner as R

    words = R.minutes_words(R.quick_estimate_s())
    assert re.fullmatch(r"about \d+ min", words)
    env = dict(cuda=False, jax_backend="cpu")
    for fw, names in R.CPU_VARIANTS.items():  # the case list the estimate takes is the run's
        assert tuple(sum(R.variants(env, fw, "ce"), [])) == names
    readme = " ".join(open(os.path.join(ROOT, "README.md")).read().split())
    assert f"the job's own estimate from its case list: {words} on a quiet 2-core CPU" in readme
    out = subprocess.run([sys.executable, "-m", "bench", "--help"], cwd=ROOT, check=True,
                         capture_output=True, text=True).stdout
    assert f"quick: {words} on a quiet 2-core CPU" in out, out


def test_bar_summaries_say_faster_or_slower(monkeypatch):
    """The linear head's and the denoising step's closing lines: "1.5x faster" or "2.0x
    slower", never a bare "0.50x"."""
    monkeypatch.syspath_prepend(ROOT)
    from bench.runner import linear_head_summary, sampling_summary

    head = dict(shape=dict(n=8, d=4, k=300, dtype="float32"), results=[
        dict(framework="torch", backend=b, mode="fwd+bwd", ms=ms, p20=0.95 * ms, p80=1.05 * ms,
             tflops=1.0)
        for b, ms in (("ours-ce", 10.0), ("unfused", 15.0), ("torch.linear_ce", 30.0),
                      ("ours-policy", 14.5))])
    lines = linear_head_summary(head)
    assert lines[1].endswith("1.5x faster than unfused") and lines[3].endswith(
        "2.0x slower than unfused") and "than unfused" not in lines[2], lines
    assert lines[4].endswith("within noise of unfused"), lines  # spreads overlap: no claim
    draw = dict(results=[dict(variant=v, n=8, k=300, dtype="float32", ms=ms, p20=0.9 * ms,
                              p80=1.1 * ms, gbps=1.0)
                         for v, ms in (("ours", 10.0), ("llada-float64", 40.0),
                                       ("float32", 5.0), ("float64", 10.5))])
    lines = sampling_summary(draw)
    assert lines[2].endswith("ours 4.0x faster") and lines[3].endswith("ours 2.0x slower"), lines
    assert lines[4].endswith("ours within noise"), lines


def test_quick_grid_has_a_trend_per_dtype(monkeypatch):
    """At least 3 vocabularies per dtype in the quick CPU grid, at one N, none repeated."""
    monkeypatch.syspath_prepend(ROOT)
    from bench import shapes as S

    by_dtype = {}
    for _, n, k, dtype in S.QUICK_CPU_SHAPES:
        by_dtype.setdefault((n, dtype), []).append(k)
    assert {dtype for _, dtype in by_dtype} == {"float32", "bfloat16"}
    assert all(len(set(ks)) == len(ks) >= 3 for ks in by_dtype.values()), by_dtype


def test_cpu_target_times_the_issues_grid(monkeypatch, tmp_path, capsys):
    """--cpu-target (the CPU target grid): ce, sft, policy and opd at N 4096, K 32768 and 131072,
    float32 and bf16; torch chunked, upstream and upstream+compile (and for policy the
    chunked loss with its gradient written in place), then JAX chunked and upstream; with
    --busy-core the torch CE K 32768 float32 cases once more, the busy loop started for them
    only; files of their own; an estimate first; the summary per objective,
    shape and dtype. Cases are stubs (no timing)."""
    monkeypatch.syspath_prepend(ROOT)
    import bench.runner as R

    timed, popen = [], []

    class FakeLoop:  # the busy loop's process
        def __init__(self):
            popen.append(("started", len(timed)))

        def poll(self):
            return 0

        def kill(self):
            popen.append(("killed", len(timed)))

    def stub_group(env, fw, objective, names, label, n, k, dtype, copy_gbps, args, rotate):
        rows = []
        for variant in names:
            timed.append((fw, objective, variant, label, n, k, dtype, rotate))
            ms = {"chunked": 10.0, "chunked+inplace": 10.0, "upstream": 40.0,
                  "upstream+compile": 20.0}[variant]
            rows += [dict(framework=fw, objective=objective, backend=variant, shape=label, n=n,
                          k=k, dtype=dtype, mode=m, ms=ms, p20=ms, p80=ms, gbps=1.0,
                          pct_copy=5.0, peak_bytes=2**20 * ms, rotate=rotate)
                     for m in ("fwd", "bwd", "fwd+bwd")]
        return rows

    monkeypatch.setattr(R, "run_group", stub_group)
    monkeypatch.setattr(R, "meminfo_bytes", lambda field: 1 << 40)  # every case fits
    monkeypatch.setattr(R, "parity", lambda env: [])
    monkeypatch.setattr(R, "start_busy_loop", FakeLoop)
    monkeypatch.setattr(R, "plot", lambda *a: None)
    R.main(["--cpu-target", "--busy-core", "--reps", "1", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    quiet = [c for c in timed if not c[3].endswith("-busy")]
    grid = {(n, k, dtype) for *_, n, k, dtype, _ in quiet}
    assert grid == {(4096, k, d) for k in (32768, 131072) for d in ("float32", "bfloat16")}
    assert {(fw, v) for fw, _, v, *_ in quiet} == {
        ("torch", "chunked"), ("torch", "chunked+inplace"), ("torch", "upstream"),
        ("torch", "upstream+compile"), ("jax", "chunked"), ("jax", "upstream")}
    assert {o for _, o, *_ in quiet} == {"ce", "sft", "policy", "opd"}
    assert {o for _, o, v, *_ in quiet if v == "chunked+inplace"} == {"policy"}
    assert len(quiet) == 4 * (4 * 5 + 1) and len(set(quiet)) == len(quiet)
    busy = timed[len(quiet):]  # last, beside the loop started after the quiet grid
    assert [(fw, o, v, label, k, d) for fw, o, v, label, _, k, d, _ in busy] == [
        ("torch", "ce", v, "cpu-N4096-K32k-busy", 32768, "float32")
        for v in ("chunked", "upstream", "upstream+compile")]
    assert popen == [("started", len(quiet)), ("killed", len(timed))]
    assert {r for *_, r in timed} <= {1, 2}
    assert out.index("estimated run time: ") < out.index("[")  # before the first case
    assert re.search(r"memory: [0-9.]+ GiB available; 2 input sets per case", out), out
    (stem,) = {f.rsplit(".", 1)[0] for f in os.listdir(tmp_path)}
    assert stem.endswith("-cpu-target"), stem
    lines = out[out.index("CPU target ("):].splitlines()
    assert lines[1] == "  CE N 4096, K 32768, float32:"
    assert lines[2] == ("    torch chunked vs torch.compile (upstream+compile): fwd 2.0x faster, "
                        "bwd 2.0x faster, fwd+bwd 2.0x faster (10.0 vs 20.0 ms); memory beyond "
                        "inputs 10 MiB vs 20 MiB, 50% of its memory; fwd+bwd 4.0x faster than "
                        "eager PyTorch (upstream)")
    assert lines[3].startswith("    jax chunked vs jax.jit (upstream): fwd 4.0x faster")
    assert "  CE N 4096, K 32768, float32, beside a busy loop:" in lines
    assert [line for line in lines if line.startswith("  ") and not line.startswith("    ")][
        :3] == ["  CE N 4096, K 32768, float32:", "  CE N 4096, K 32768, bfloat16:",
                "  CE N 4096, K 131072, float32:"]
    assert any(line.startswith("  SFT N 4096, K 131072, bfloat16:") for line in lines)
    table = open(tmp_path / f"{stem}.md").read()
    assert "### sft" in table and "cpu-N4096-K32k-busy" in table and "-busy:" in table
    report = json.load(open(tmp_path / f"{stem}.json"))
    assert all(r["busy"] == r["shape"].endswith("-busy") for r in report["results"])


def test_cpu_target_memory_keeps_one_set_where_two_would_not_fit(monkeypatch, capsys):
    """Two input sets per case where they fit in 85 % of the memory available; one where they
    would not (a case of K 131072 float32 logits, 2 GiB a tensor, on a 23 GB machine), with a
    warning where even one may not fit."""
    monkeypatch.syspath_prepend(ROOT)
    import bench.runner as R
    from bench.cases import case_bytes

    gib = 2**30
    monkeypatch.setattr(R, "meminfo_bytes", lambda field: 21 * gib)
    cases = [("torch", 0, (f"s{k}", 4096, k, "float32"), obj, "chunked", False)
             for k in (32768, 131072) for obj in ("ce", "opd")]
    rotate = R.cpu_target_memory(cases)
    assert rotate == {("ce", 4096, 32768, "float32"): 2, ("opd", 4096, 32768, "float32"): 2,
                      ("ce", 4096, 131072, "float32"): 1, ("opd", 4096, 131072, "float32"): 1}
    assert case_bytes("ce", 4096, 131072, "float32", 2) > 0.85 * 21 * gib
    out = capsys.readouterr().out
    assert "1 where 2 would not fit" in out and "ce K 131072 float32" in out
    assert "warning: opd N 4096 K 131072 float32" in out and "warning: ce" not in out


def test_cpu_target_memory_counts_the_input_sets_of_an_in_place_variant(monkeypatch):
    """A variant that writes into its inputs (policy's chunked+inplace) draws input sets of
    its own: they count in the estimate (on a machine where two sets of the policy case fit
    without them and not with them, one set)."""
    monkeypatch.syspath_prepend(ROOT)
    import bench.runner as R
    from bench.cases import case_bytes

    monkeypatch.setattr(R, "meminfo_bytes", lambda field: int(7.1 * 2**30))
    budget = 0.85 * 7.1 * 2**30
    assert case_bytes("policy", 4096, 32768, "float32", 2) < budget
    assert case_bytes("policy", 4096, 32768, "float32", 2, own_sets=1) > budget
    case = lambda v: ("torch", 0, ("s", 4096, 32768, "float32"), "policy", v, False)
    assert R.cpu_target_memory([case("chunked")]) == {("policy", 4096, 32768, "float32"): 2}
    assert R.cpu_target_memory([case("chunked"), case("chunked+inplace")]) == {
        ("policy", 4096, 32768, "float32"): 1}


def test_cpu_target_skips_a_materialised_loss_that_would_not_fit():
    """A jitted upstream OPD at N 4096, K 131072 float32 passed 24 GB and the kernel killed
    the run, with every case after it: such a case is skipped and says why, one that fits
    runs."""
    from bench import runner as R
    from bench.cases import upstream_bytes

    env = dict(cuda=False)
    need = upstream_bytes("opd", 4096, 131072, "float32")
    assert need > 24 * 2**30
    why = R.skip_reason(env, "upstream", 0, 0.0, None, (need, 0.85 * 22 * 2**30))
    assert why is not None and "does not fit in memory" in why and "GiB" in why, why
    assert R.skip_reason(env, "upstream", 0, 0.0, None,
                         (upstream_bytes("ce", 4096, 32768, "float32"), 0.85 * 22 * 2**30)) is None


def test_host_time_profiles_the_chunked_backend():
    """python -m bench.host_time --backend chunked --profile: each case's host time per call,
    then where it goes by module and how many ATen ops one call dispatches."""
    out = subprocess.run([sys.executable, "-m", "bench.host_time", "--backend", "chunked",
                          "--rows", "64", "--vocab", "16", "--reps", "5", "--profile"],
                         cwd=ROOT, check=True, capture_output=True, text=True).stdout
    cases = re.findall(r"^(ce forward|ce forward\+backward|sft loo forward\+backward) +"
                       r"[0-9.]+ ms host time per call .*chunked, work included\)$", out, re.M)
    assert cases == ["ce forward", "ce forward+backward", "sft loo forward+backward"], out
    assert out.count("profile (cProfile own time per call") == 3
    assert len(re.findall(r"%\s+[0-9.]+ calls  dlm_kernels/_objectives\.py", out)) == 3, out
    assert len(re.findall(r"ATen ops per call \(nested included\): \d+; most: ", out)) == 3


def test_invariance_cost_compares_two_trees(tmp_path):
    """python -m bench.invariance_cost --before HEAD at its smallest case: a worktree of the
    revision is made and removed, both trees are timed, and the report names the revision,
    the device, and a ratio per mode. Skipped outside a git checkout."""
    import pytest

    top = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--show-toplevel"],
                         capture_output=True, text=True)
    if top.returncode != 0 or os.path.realpath(top.stdout.strip()) != os.path.realpath(ROOT):
        pytest.skip("needs this repository as a git checkout of its own")
    worktrees = subprocess.run(["git", "-C", str(ROOT), "worktree", "list"], check=True,
                               capture_output=True, text=True).stdout
    subprocess.run([sys.executable, "-m", "bench.invariance_cost", "--before", "HEAD",
                    "--rounds", "1", "--reps", "1", "--cases", "N8-K256",
                    "--out", str(tmp_path)], cwd=ROOT, check=True, capture_output=True, text=True)
    (report,) = tmp_path.glob("invariance-cost-*.json")
    data = json.loads(report.read_text())
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], check=True,
                          capture_output=True, text=True).stdout.strip()
    assert data["meta"]["before"] == head and data["meta"]["device"]
    assert [(r["case"], r["mode"]) for r in data["rows"]] == [("N8-K256", "fwd"),
                                                              ("N8-K256", "fwd+bwd")]
    assert all(r["before_ms"] > 0 and r["after_ms"] > 0 and r["ratio"] > 0 for r in data["rows"])
    assert subprocess.run(["git", "-C", str(ROOT), "worktree", "list"], check=True,
                          capture_output=True, text=True).stdout == worktrees  # removed again


def test_diffusion_gemma_bench(monkeypatch):
    """The DiffusionGemma head benchmark at a tiny shape: every case runs and is timed (the
    loss forward+backward and the denoising steps after the first, dense and patched), the
    step probe measures exactly one step with its self-conditioning input, and the loss probe
    counts the parameter gradients it allocates. Skipped without transformers' DiffusionGemma."""
    import pytest

    pytest.importorskip("transformers.models.diffusion_gemma")
    monkeypatch.syspath_prepend(ROOT)
    from bench import diffusion_gemma as DG

    report = DG.run(ds=(32,), v=515, canvas=8, batch=1, dtype="float32", reps=1,
                    memory=False, progress=lambda line: None)
    rows = report["results"]
    assert [r["case"] for r in rows] == list(DG.CASES) and all(r["d"] == 32 for r in rows)
    assert all("error" not in r and r["ms"] > 0 and r["reps"] >= 1 for r in rows), rows
    table = DG.markdown(report)
    assert all(f"| {c} | 32 | 515 | 8 | float32 |" in table for c in DG.CASES), table
    for case in ("loss-patched", "step-dense"):
        got = DG._probe(case, 32, 515, 8, 1, "float32")
        assert got["peak_bytes"] >= 0 and got["weight_bytes"] > 515 * 32 * 4, got
        # the loss's gradients include the tied table's; a step leaves none
        assert (got["grad_bytes"] >= 515 * 32 * 4) == case.startswith("loss"), got
    fake = [dict(case=c, d=d, peak_bytes=(8 if "dense" in c else 2) * 515 * 8 * 4 + 6 * 515 * d)
            for d in (32, 48) for c in DG.CASES]
    fits = DG.fit(fake, 1, 8, 515)
    assert abs(fits["loss-dense"]["a_in_blv_float32"] - 8) < 1e-6, fits
    assert abs(fits["step-patched"]["b_over_v"] - 6) < 1e-6, fits
    assert DG.ratios(fake)[("loss", 32)] > 1


def test_a_zero_millisecond_time_gives_no_ratio(monkeypatch):
    """A backward derived as fwd+bwd minus fwd is 0 ms when a peer's forward median exceeds
    its fwd+bwd median (noise at the smallest shapes): the main job's table then says "-" /
    "n/a" for that ratio. Before, its Markdown divided by it and the README's first command
    ended in a ZeroDivisionError after its last case (2026-12-04, a 2-core AMD EPYC)."""
    monkeypatch.syspath_prepend(ROOT)
    from bench import progress as P
    from bench import runner as R

    def row(backend, mode, ms, p20, p80):
        return dict(framework="torch", objective="ce", shape="cpu-N256-K2k", mode=mode,
                    backend=backend, ms=ms, p20=p20, p80=p80, gbps=None, pct_copy=None,
                    peak_bytes=None)

    results = [row("chunked", "bwd", 0.4, None, None), row("upstream", "bwd", 0.0, None, None),
               row("chunked", "fwd+bwd", 0.0, None, None),
               row("upstream", "fwd+bwd", 0.8, 0.7, 0.9)]
    env = dict(device="cpu", date="2026-12-04")
    text = R.markdown(env, 10.0, results, [])
    bwd_line = next(line for line in text.splitlines() if "| chunked |" in line and "| bwd |" in line)
    assert bwd_line.rstrip(" |").endswith("-"), bwd_line
    assert P.ratio_words(0.0) == "n/a" and P.ratio_words(float("inf")) == "n/a"
    assert P.ratio_words(2.0) == "2.0x faster" and P.ratio_words(0.5) == "2.0x slower"
    P.summary(results)  # ours at 0 ms takes no part in a mean
