"""The linear-head benchmark: losses straight from hidden states and the unembedding.

    python -m bench.linear_head                       # this device's default shape
    python -m bench.linear_head --n 4096 --d 256 --k 32768 --dtype float32

Every case computes a loss of ``hidden [N, D] @ weight`` (K columns; the summed cross
entropy unless named otherwise) and its gradients with respect to hidden and weight, side by
side in one run:

  ours (ce)         LinearHead + weighted_cross_entropy: gradient in the forward (3 matmuls)
  ours (policy)     LinearHead + per_token_logps with entropy: recompute (4 matmuls)
  ours (grpo)       LinearHead + policy_loss (TRL's GRPO loss, type dapo, off-policy ratios)
  unfused (grpo)    logits = hidden @ weight.T, then policy_loss on them
  liger (grpo)      Liger-Kernel's LigerFusedLinearGRPOLoss, the same loss (its torch.compile'd
                    chunks on CUDA, eager chunks elsewhere)
  unfused           logits = hidden @ weight.T, then our fused loss (3 matmuls, [N, K] logits
                    and their gradient in memory)
  torch.linear_ce   torch.nn.functional.linear_cross_entropy with its chunked options
  reference+compile torch.compile of F.cross_entropy(hidden @ weight.T)
  liger, cce        Liger-Kernel's fused linear cross entropy, Cut Cross-Entropy (CUDA only;
                    skipped where they do not install or run)
  JAX: ours, unfused, tokamax (``linear_softmax_cross_entropy_loss``, XLA implementation)

It reports milliseconds (median, p20-p80) of the forward, the backward and both; the
TFLOP/s of the matmuls the pass must do (forward: the logits, 2·N·D·K; forward+backward:
logits, dH and dW, 3 x 2·N·D·K) next to the matmul rate measured in the same run (one
[N, D] x [D, K] product of the inputs' dtype); and the peak memory beyond the inputs and
their gradients (CPU torch: resident-set growth of a fresh process; CUDA: allocator peak;
JAX: XLA temporary bytes). A memory-scaling row repeats ``ours (ce)`` at 2N.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import gc
import sys

import numpy as np

from dlm_kernels.testing import TOLERANCES, new_seed

from .cli import add_common_args, detect, write_outputs
from .memory import cuda_peak_delta, probe_in_subprocess, rss_peak_delta
from .timing import measure

VARIANTS_TORCH = ("ours-ce", "ours-policy", "unfused", "torch.linear_ce", "reference+compile",
                  "liger", "cce", "ours-grpo", "unfused-grpo", "liger-grpo")
GRPO_VARIANTS = ("ours-grpo", "unfused-grpo", "liger-grpo")
#: Liger's published fused-linear GRPO shape (B 16 x T 1024 rows, H 4096, V 128256), run by
#: bench/gpu_check.sh with the GRPO variants
GRPO_GPU_SHAPE = dict(n=16 * 1024, d=4096, k=128256, dtype="bfloat16")
VARIANTS_JAX = ("ours-ce", "ours-policy", "unfused", "tokamax")
CPU_SHAPE = dict(n=4096, d=256, k=32768, dtype="float32")  # the targets' shape
CPU_MAIN_SHAPE = dict(n=1024, d=128, k=8192, dtype="float32")  # inside python -m bench --full
CPU_QUICK_SHAPE = dict(n=512, d=64, k=4096, dtype="float32")  # inside the quick python -m bench
# the quick main job's variants on a CPU: the scalar loss against the unfused pipeline and
# each framework's peer (not torch.compile's, tens of seconds to compile)
QUICK_VARIANTS = {"torch": ("ours-ce", "unfused", "torch.linear_ce"),
                  "jax": ("ours-ce", "unfused", "tokamax")}
GPU_SHAPE = dict(n=16384, d=2560, k=262144, dtype="bfloat16")


def variants_of(variants, framework):
    """The variants timed for one framework: ``variants`` None (all of them), a sequence
    (the same names for every framework) or a dict by framework."""
    if variants is None:
        return VARIANTS_TORCH if framework == "torch" else VARIANTS_JAX
    return variants[framework] if isinstance(variants, dict) else variants


def matmul_flops(mode, n, d, k):
    """The matmuls forward+backward must do: the logits, dH and dW, 2·N·D·K each."""
    if mode != "fwd+bwd":
        raise ValueError("only the whole pass has a schedule-independent matmul count")
    return 3 * 2.0 * n * d * k


class Skipped(Exception):
    """A peer that cannot run here (recorded as ``skipped: why``)."""


# -- torch ------------------------------------------------------------------------------------

class TorchHeadCase:
    """One variant at one shape; ``fwdbwd(i)`` returns (dH, dW) of input set i."""

    def __init__(self, variant, n, d, k, dtype, device, seed=0):
        import torch

        self.torch, self.variant = torch, variant
        self.device = torch.device(device)
        tdtype = getattr(torch, dtype)
        gen = torch.Generator(self.device).manual_seed(seed)
        self.sets = []
        for _ in range(2):  # two input sets, alternated: no call re-reads a cached copy
            h = torch.randn((1, n, d), generator=gen, device=self.device).to(tdtype)
            w = (torch.randn((k, d), generator=gen, device=self.device) * (3 / d ** 0.5)).to(tdtype)
            y = torch.randint(0, k, (1, n), generator=gen, device=self.device)
            self.sets.append((h.requires_grad_(True), w.requires_grad_(True), y,
                              self._rollout(h, w, y, gen) if variant in GRPO_VARIANTS else None))
        self._loss = self._make_loss()

    def _rollout(self, h, w, y, gen):
        """(old log-probs [1, N], advantages [1]) of one GRPO set: the current log-probs
        moved by noise, so that some ratios fall outside the clip range."""
        import dlm_kernels.torch as dk

        torch = self.torch
        batch = dk.DiffusionTokenBatch.create(model_inputs=y, target_ids=y,
                                              loss_weights=torch.ones(y.shape, device=y.device))
        old = dk.per_token_logps(dk.LinearHead(h.detach(), w.detach()), batch).float()
        old = old + 0.3 * torch.randn(old.shape, generator=gen, device=self.device)
        return old, torch.randn((1,), generator=gen, device=self.device)
        self._graphs = {}

    def _make_loss(self):
        torch, variant = self.torch, self.variant
        import torch.nn.functional as F

        import dlm_kernels.torch as dk

        def batch(y):
            return dk.DiffusionTokenBatch.create(model_inputs=y, target_ids=y,
                                                 loss_weights=torch.ones(y.shape, device=y.device))

        if variant in ("ours-grpo", "unfused-grpo"):
            def grpo(h, w, y, rl):
                z = dk.LinearHead(h, w) if variant == "ours-grpo" else h @ w.T
                return dk.policy_loss(z, batch(y), old_logps=rl[0], advantages=rl[1],
                                      loss_type="dapo", epsilon=0.2).loss
            return grpo
        if variant == "liger-grpo":
            from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss

            loss = LigerFusedLinearGRPOLoss(beta=0.0, use_ref_model=False, loss_type="dapo",
                                            epsilon_low=0.2, epsilon_high=0.2,
                                            compiled=self.device.type == "cuda")
            return lambda h, w, y, rl: loss(h, w, y, torch.ones(y.shape, device=y.device), rl[1],
                                            old_per_token_logps=rl[0])[0]
        if variant == "ours-ce":
            return lambda h, w, y, _: dk.weighted_cross_entropy(dk.LinearHead(h, w), batch(y)).unreduced_sum
        if variant == "ours-policy":
            def policy(h, w, y, _):
                lp, ent = dk.per_token_logps(dk.LinearHead(h, w), batch(y), stop_gradient=False,
                                             return_entropy=True)
                return lp.sum() + 0.01 * ent.sum()
            return policy
        if variant == "unfused":
            return lambda h, w, y, _: dk.weighted_cross_entropy(h @ w.T, batch(y)).unreduced_sum
        if variant == "torch.linear_ce":
            options = torch.nn.LinearCrossEntropyOptions(allow_retain_graph=True)
            return lambda h, w, y, _: F.linear_cross_entropy(h[0], w, y[0], reduction="sum",
                                                          options=options)
        if variant == "reference+compile":
            torch._dynamo.reset()
            return torch.compile(lambda h, w, y, _: F.cross_entropy(
                (h[0] @ w.T).float(), y[0], reduction="sum"), dynamic=False)
        if variant == "liger":
            if self.device.type != "cuda":
                raise Skipped("Liger's Triton kernels need a CUDA device")
            from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

            loss = LigerFusedLinearCrossEntropyLoss(reduction="sum")
            return lambda h, w, y, _: loss(w, h[0], y[0])
        if variant == "cce":
            if self.device.type != "cuda":
                raise Skipped("Cut Cross-Entropy's kernels need a CUDA device")
            from cut_cross_entropy import linear_cross_entropy

            return lambda h, w, y, _: linear_cross_entropy(h[0], w, y[0], reduction="sum")
        raise ValueError(f"unknown variant {variant!r}")

    def fwd(self, i):
        return self._loss(*self.sets[i % 2])

    def fwdbwd(self, i):
        h, w = self.sets[i % 2][:2]
        return self.torch.autograd.grad(self._loss(*self.sets[i % 2]), (h, w))

    def prepare_bwd(self):
        self._graphs = {i: self.fwd(i) for i in range(2)}

    def bwd(self, i):
        h, w = self.sets[i % 2][:2]
        return self.torch.autograd.grad(self._graphs[i % 2], (h, w), retain_graph=True)

    def release(self):
        self._graphs = {}

    def grad_bytes(self):
        h, w = self.sets[0][:2]
        return h.numel() * h.element_size() + w.numel() * w.element_size()

    def cuda_peak_bytes(self):
        return cuda_peak_delta(lambda: self.fwdbwd(0)) - self.grad_bytes()


def cpu_peak_bytes(variant, n, d, k, dtype):
    """Resident-set growth of one forward+backward in a fresh process, minus the gradients."""
    return probe_in_subprocess([f"{__package__}.linear_head", "--probe", variant, "--n", str(n),
                                "--d", str(d), "--k", str(k), "--dtype", dtype])


def _probe(variant, n, d, k, dtype):
    case = TorchHeadCase(variant, n, d, k, dtype, "cpu")
    warm = lambda: TorchHeadCase(variant, 16, d, min(k, 1024), dtype, "cpu").fwdbwd(0)
    print(rss_peak_delta(lambda: case.fwdbwd(0), warm) - case.grad_bytes())


# -- JAX --------------------------------------------------------------------------------------

class JaxHeadCase:
    def __init__(self, variant, n, d, k, dtype, seed=0):
        import jax
        import jax.numpy as jnp

        import dlm_kernels.jax as dk

        self.jax, self.variant = jax, variant
        jdtype = getattr(jnp, dtype)
        keys = iter(jax.random.split(jax.random.key(seed), 6))
        self.sets = []
        for _ in range(2):
            h = jax.random.normal(next(keys), (1, n, d), jnp.float32).astype(jdtype)
            w = (jax.random.normal(next(keys), (d, k), jnp.float32) * (3 / d ** 0.5)).astype(jdtype)
            y = jax.random.randint(next(keys), (1, n), 0, k, jnp.int32)
            self.sets.append((h, w, y))

        def batch(y):
            return dk.DiffusionTokenBatch.create(model_inputs=y, target_ids=y,
                                                 loss_weights=jnp.ones(y.shape, jnp.float32))

        if variant == "ours-ce":
            loss = lambda h, w, y: dk.weighted_cross_entropy(dk.LinearHead(h, w), batch(y)).unreduced_sum
        elif variant == "ours-policy":
            def loss(h, w, y):
                lp, ent = dk.per_token_logps(dk.LinearHead(h, w), batch(y), stop_gradient=False,
                                             return_entropy=True)
                return lp.sum() + 0.01 * ent.sum()
        elif variant == "unfused":
            loss = lambda h, w, y: dk.weighted_cross_entropy(h @ w, batch(y)).unreduced_sum
        elif variant == "tokamax":
            import tokamax
            from absl import flags

            if not flags.FLAGS.is_parsed():  # absl would parse this program's own argv
                flags.FLAGS.mark_as_parsed()

            loss = lambda h, w, y: tokamax.linear_softmax_cross_entropy_loss(
                h[0], y[0], w, reduction="sum", implementation="xla")
        else:
            raise ValueError(f"unknown variant {variant!r}")
        self._fwd = jax.jit(loss)
        self._fb = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))

    def fwd(self, i):
        return self._fwd(*self.sets[i % 2]).block_until_ready()

    def fwdbwd(self, i):
        return self.jax.block_until_ready(self._fb(*self.sets[i % 2]))

    def temp_bytes(self):
        return int(self._fb.lower(*self.sets[0]).compile().memory_analysis().temp_size_in_bytes)


# -- parity ---------------------------------------------------------------------------------------

def parity(frameworks=("torch", "jax"), cuda=False):
    """Loss and (dH, dW) of both schedules (weighted CE; per-token log-probs with entropy)
    from a head vs the same objective on materialised float64 logits (the reference
    backend), at an awkward shape (N = 37, D = 19, K = 301, several token chunks), float32.
    Returns rows of dict(framework, objective, ok, max_abs_err, seed) on a fresh draw
    (DLM_TEST_SEED=seed draws it again)."""
    atol, rtol = TOLERANCES["float32"]
    seed = new_seed()
    rng = np.random.default_rng(seed)
    n, d, k = 37, 19, 301
    h64, w64 = rng.standard_normal((1, n, d)), rng.standard_normal((k, d)) / d ** 0.5 * 3
    y = rng.integers(0, k, (1, n))
    rows = []
    for fw in frameworks:
        for objective in ("ce", "policy"):
            got = _head_grads(fw, objective, h64, w64, y, head=True, cuda=cuda)
            want = _head_grads(fw, objective, h64, w64, y, head=False, cuda=cuda)
            errs = [float(np.max(np.abs(g - e))) for g, e in zip(got, want)]
            ok = all(np.allclose(g, e, rtol=rtol, atol=atol * max(1.0, float(np.abs(e).max())))
                     for g, e in zip(got, want))
            rows.append(dict(framework=fw, objective=objective, ok=bool(ok),
                             max_abs_err=dict(zip(("loss", "d_hidden", "d_weight"), errs)),
                             seed=seed))
    return rows


def _head_grads(fw, objective, h64, w64, y, head, cuda):
    """(loss, dH, dW) as float64 NumPy: from a LinearHead (float32, the native backend) or
    from float64 logits on the reference backend."""
    if fw == "torch":
        import torch

        import dlm_kernels.torch as dk

        dev = "cuda" if cuda else "cpu"
        dt = torch.float32 if head else torch.float64
        h = torch.tensor(h64, device=dev, dtype=dt, requires_grad=True)
        w = torch.tensor(w64, device=dev, dtype=dt, requires_grad=True)
        yy = torch.tensor(y, device=dev)
        batch = dk.DiffusionTokenBatch.create(model_inputs=yy, target_ids=yy,
                                              loss_weights=torch.ones(yy.shape, device=dev))
        z = dk.LinearHead(h, w, row_chunk=8) if head else h @ w.T
        value = _objective(dk, objective, z, batch, None if head else "reference")
        gh, gw = torch.autograd.grad(value, (h, w))
        return [np.asarray(v.detach().double().cpu()) for v in (value, gh, gw)]
    import jax
    import jax.numpy as jnp

    import dlm_kernels.jax as dk

    with jax.enable_x64(not head):
        dt = jnp.float32 if head else jnp.float64
        yy = jnp.asarray(y)
        batch = dk.DiffusionTokenBatch.create(model_inputs=yy, target_ids=yy,
                                              loss_weights=jnp.ones(y.shape, jnp.float32))

        def loss(h, w):
            z = dk.LinearHead(h, w, weight_layout="KD", row_chunk=8) if head else h @ w.T
            return _objective(dk, objective, z, batch, None if head else "reference")

        value, (gh, gw) = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(
            jnp.asarray(h64, dt), jnp.asarray(w64, dt))
        return [np.asarray(v, np.float64) for v in (value, gh, gw)]


def _objective(dk, objective, z, batch, backend):
    if objective == "ce":
        return dk.weighted_cross_entropy(z, batch, backend=backend).unreduced_sum
    lp, ent = dk.per_token_logps(z, batch, stop_gradient=False, return_entropy=True,
                                 backend=backend)
    return lp.sum() + 0.01 * ent.sum()


# -- the run -----------------------------------------------------------------------------------

def matmul_rate(framework, n, d, k, dtype, cuda):
    """TFLOP/s of the device's matmul in ``dtype``, measured now: the best of the three
    products a head does (logits H·Wᵀ, dH = dZ·W, dW = dZᵀ·H, each 2·N·D·K), so the ceiling
    is the fastest form (CPU BLAS runs them at rates up to 2x apart)."""
    best = float("inf")
    if framework == "torch":
        import torch

        dev = "cuda" if cuda else "cpu"
        dt = getattr(torch, dtype)
        h, w = torch.randn(n, d, device=dev).to(dt), torch.randn(k, d, device=dev).to(dt)
        dz = torch.randn(n, k, device=dev).to(dt)
        for product in (lambda: h @ w.T, lambda: dz @ w, lambda: dz.T @ h):
            t = measure(lambda _: product(), cuda=cuda, warmup=1, reps=5, budget_s=10.0)
            best = min(best, t["ms"])
    else:
        import jax
        import jax.numpy as jnp

        dt = getattr(jnp, dtype)
        h, w, dz = jnp.ones((n, d), dt), jnp.ones((k, d), dt), jnp.ones((n, k), dt)
        for product in (lambda h, w, dz: h @ w.T, lambda h, w, dz: dz @ w,
                        lambda h, w, dz: dz.T @ h):
            f = jax.jit(product)
            t = measure(lambda _: f(h, w, dz).block_until_ready(), warmup=1, reps=5,
                        budget_s=10.0)
            best = min(best, t["ms"])
    return 2.0 * n * d * k / (best * 1e-3) / 1e12


def run_case(framework, variant, n, d, k, dtype, cuda, reps, rate, memory=True):
    base = dict(framework=framework, backend=variant, n=n, d=d, k=k, dtype=dtype)
    try:
        if framework == "torch":
            case = TorchHeadCase(variant, n, d, k, dtype, "cuda" if cuda else "cpu")
        else:
            case = JaxHeadCase(variant, n, d, k, dtype)
        timings = {"fwd": measure(case.fwd, cuda=cuda, reps=reps),
                   "fwd+bwd": measure(case.fwdbwd, cuda=cuda, reps=reps)}
        if framework == "torch" and variant != "reference+compile":
            case.prepare_bwd()
            timings["bwd"] = measure(case.bwd, cuda=cuda, reps=reps)
            case.release()
        else:  # compiled backwards donate their buffers: derived from the other two
            timings["bwd"] = dict(ms=max(timings["fwd+bwd"]["ms"] - timings["fwd"]["ms"], 0.0),
                                  p20=None, p80=None, derived="fwd+bwd minus fwd")
        if not memory:
            peak, kind = None, "not measured"
        elif framework == "jax":
            peak, kind = case.temp_bytes(), "XLA temp bytes"
        elif cuda:
            peak, kind = case.cuda_peak_bytes(), "cuda allocator peak minus gradients"
        else:
            case = None
            gc.collect()
            peak, kind = cpu_peak_bytes(variant, n, d, k, dtype), "VmHWM growth minus gradients"
    except Exception as err:  # noqa: BLE001 - a peer missing, or out of memory
        first = str(err).splitlines()[0][:160] if str(err) else ""
        why = f"skipped: {first}" if isinstance(err, (Skipped, ImportError)) else \
            f"{type(err).__name__}: {first}"
        return [dict(base, mode=m, error=why) for m in ("fwd", "bwd", "fwd+bwd")]
    finally:
        case = None
        gc.collect()
    rows = []
    for mode in ("fwd", "bwd", "fwd+bwd"):
        t = timings[mode]
        # TFLOP/s of the whole pass only: how the three matmuls split between the forward
        # and the backward is the schedule's choice (a scalar loss forms its gradient in the
        # forward), while forward+backward must do all three whatever the schedule
        tflops = None
        if mode == "fwd+bwd" and t["ms"] > 0:
            tflops = matmul_flops(mode, n, d, k) / (t["ms"] * 1e-3) / 1e12
        rows.append(dict(base, mode=mode, ms=t["ms"], p20=t["p20"], p80=t["p80"],
                         derived=t.get("derived"), tflops=tflops,
                         pct_matmul=100 * tflops / rate if tflops else None,
                         peak_bytes=peak, peak_kind=kind))
    return rows


def run(n, d, k, dtype, frameworks=("torch", "jax"), reps=5, cuda=False,
        progress=lambda line: print(line, flush=True), variants=None, memory=True,
        scaling=True):
    """Every variant of every framework at (n, d, k, dtype), then (``scaling``) the
    memory-scaling row at 2N. Returns dict(shape, matmul_tflops per framework, results)."""
    results, rates = [], {}
    checks = parity(frameworks, cuda)
    for row in checks:
        progress(f"linear head parity {row['framework']}/{row['objective']}: "
                 f"{'ok' if row['ok'] else 'FAIL'} {row['max_abs_err']}")
    for fw in frameworks:
        rates[fw] = matmul_rate(fw, n, d, k, dtype, cuda and fw == "torch")
        for variant in variants_of(variants, fw):
            rows = run_case(fw, variant, n, d, k, dtype, cuda and fw == "torch", reps, rates[fw],
                            memory)
            results += rows
            progress(_line(rows))
        if not scaling:
            continue
        rows = run_case(fw, "ours-ce", 2 * n, d, k, dtype, cuda and fw == "torch", reps,
                        rates[fw], memory)
        for r in rows:
            r["scaling"] = "2N"
        results += rows
        progress(_line(rows))
    return dict(device=_device(cuda), date=_dt.date.today().isoformat(),
                shape=dict(n=n, d=d, k=k, dtype=dtype), matmul_tflops=rates, parity=checks,
                results=results)


def _device(cuda):
    return detect()["device"]


def _line(rows):
    fb = next(r for r in rows if r["mode"] == "fwd+bwd")
    what = f"{fb['framework']:5s} {fb['backend']:18s} N={fb['n']}"
    if "error" in fb:
        return f"linear head: {what} {fb['error']}"
    return (f"linear head: {what} fwd+bwd {fb['ms']:9.2f} ms {fb['tflops']:6.2f} TFLOP/s "
            f"peak {fb['peak_bytes'] / 2**20 if fb['peak_bytes'] is not None else float('nan'):8.1f} MiB")


def markdown(report):
    s = report["shape"]
    rates = ", ".join(f"{fw} {r:.2f} TFLOP/s" for fw, r in report["matmul_tflops"].items())
    checks = report["parity"]
    bad = [(c["framework"], c["objective"]) for c in checks if not c["ok"]]
    lines = [f"### linear head: N={s['n']} D={s['d']} K={s['k']} {s['dtype']} "
             f"(matmul rate measured in the same run: {rates})", "",
             f"Device: {report['device']}; {report['date']}", "",
             f"Parity of the head vs float64 logits: {len(checks) - len(bad)}/{len(checks)} pass"
             + (f" (FAIL: {bad})" if bad else ""), "",
             "| framework | variant | mode | ms (p20-p80) | TFLOP/s | % matmul rate | "
             "peak MiB beyond inputs and gradients | vs unfused |", "|---|---|---|---|---|---|---|---|"]
    index = {(r["framework"], r["backend"], r["mode"], r.get("scaling")): r
             for r in report["results"] if "ms" in r}
    for r in report["results"]:
        name = r["backend"] + (" (2N)" if r.get("scaling") else "")
        if "error" in r:
            lines.append(f"| {r['framework']} | {name} | {r['mode']} | {r['error'][:100]} | | | | |")
            continue
        spread = f" ({r['p20']:.1f}-{r['p80']:.1f})" if r["p20"] is not None else " (derived)"
        unfused = index.get((r["framework"], "unfused", r["mode"], None))
        ratio = f"{unfused['ms'] / r['ms']:.2f}x" if unfused and r["ms"] > 0 and not r.get("scaling") else "-"
        peak = f"{r['peak_bytes'] / 2**20:.1f}" if r["peak_bytes"] is not None else "n/a"
        tflops = f"{r['tflops']:.2f}" if r["tflops"] else "-"
        pct = f"{r['pct_matmul']:.0f}%" if r["pct_matmul"] else "-"
        lines.append(f"| {r['framework']} | {name} | {r['mode']} | {r['ms']:.1f}{spread} | "
                     f"{tflops} | {pct} | {peak} | {ratio} |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m bench.linear_head", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=None, help="rows N (default: the device's shape)")
    p.add_argument("--d", type=int, default=None, help="hidden width D")
    p.add_argument("--k", type=int, default=None, help="vocabulary K")
    p.add_argument("--dtype", default=None, help="float32 or bfloat16")
    p.add_argument("--frameworks", default="torch,jax", help="default torch,jax")
    p.add_argument("--variants", default=None, help="comma-separated subset of the variants")
    p.add_argument("--no-scaling", action="store_true", help="skip the memory-scaling row at 2N")
    add_common_args(p)
    args = p.parse_args(argv)
    try:
        import torch

        cuda = torch.cuda.is_available()
    except ImportError:
        cuda = False
    shape = dict(GPU_SHAPE if cuda else CPU_SHAPE)
    for key in shape:
        if getattr(args, key) is not None:
            shape[key] = getattr(args, key)
    if args.probe:
        return _probe(args.probe, **shape)
    report = run(**shape, frameworks=tuple(args.frameworks.split(",")), reps=args.reps, cuda=cuda,
                 variants=args.variants.split(",") if args.variants else None,
                 scaling=not args.no_scaling)
    write_outputs(args, report, markdown(report))
    if not all(c["ok"] for c in report["parity"]):
        print("linear head parity FAILED", file=sys.stderr)
    return report


if __name__ == "__main__":
    main()
