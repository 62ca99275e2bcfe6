"""The denoising-step benchmark: one step's draw over [N, K] logits.

    python -m bench.sampling                      # this device's default shapes
    python -m bench.sampling --n 1024 --k 32768 --dtype float32

Side by side in one run (torch):

  ours              sample_tokens (token, its log-prob, argmax, top-2, entropy in one pass)
  ours-jax          the same from dlm_kernels.jax, under jax.jit (skipped where JAX is
                    not installed)
  llada-float64     the step as LLaDA's generate.py writes it: logits cast to float64,
                    float64 Gumbel noise over all of [N, K], argmax, a float64 softmax and
                    a gather of the drawn token's probability
  llada+compile     the same under torch.compile
  float32           a plain float32 step: log-softmax, Gumbel noise, argmax, gather, the
                    entropy and the top-2 (what ours returns, materialised)

and the whole upstream step, ``get_transfer_index`` (draw, confidence, the per-row top-k
commit), over the same logits as [B, L, K] (B = 8), half the positions masked, k = 8 per row
(at most L):

  upstream-step     LLaDA / Fast-dLLM / Megatron-Bridge's get_transfer_index as written:
                    float64 noise and softmax over [B, L, K], torch.topk per row
  upstream-step+compile  the same under torch.compile
  ours-step         dlm_kernels.torch.get_transfer_index (one read of the logits)

It reports milliseconds (median, p20-p80), GB/s of the one read of the logits the step must
make (N·K·bytes), the percent of the copy bandwidth measured in the same run, and the peak
memory beyond the logits (CPU: resident-set growth of a fresh process; CUDA: allocator peak).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import gc

from .cli import add_common_args, detect, write_outputs
from .memory import cuda_peak_delta, probe_in_subprocess, rss_peak_delta
from .progress import ratio_words
from .timing import copy_bandwidth, measure

VARIANTS = ("ours", "ours-jax", "llada-float64", "llada+compile", "float32", "upstream-step",
            "upstream-step+compile", "ours-step")
STEP_BATCH = 8  # B of the step variants' [B, L, K] view of the [N, K] logits


def baseline(variant):
    """The variant of ours each variant is compared with: ours-step for the whole upstream
    step, ours for the draw."""
    return "ours-step" if "step" in variant else "ours"
CPU_SHAPES = [dict(n=1024, k=32768, dtype="float32")]
GPU_SHAPES = [dict(n=n, k=k, dtype="bfloat16") for n in (16384, 256) for k in (262144, 151936)]


def _llada_step(z, temperature):
    import torch

    z64 = z.to(torch.float64)
    u = torch.rand_like(z64)
    token = torch.argmax(z64.exp() / (-torch.log(u)) ** temperature, dim=-1)
    p = torch.softmax(z64, dim=-1)
    return token, torch.gather(p, -1, token[:, None])[:, 0]


def _float32_step(z, temperature):
    import torch

    s = z.float() / temperature
    logq = torch.log_softmax(s, dim=-1)
    g = -torch.log(-torch.log(torch.rand_like(s)))
    token = torch.argmax(s + g, dim=-1)
    top2 = torch.topk(logq, 2, dim=-1).values
    entropy = -(logq.exp() * logq).sum(-1)
    return token, torch.gather(logq, -1, token[:, None])[:, 0], top2, entropy


def _upstream_step(z, temperature, mask_index, x, num_transfer_tokens):
    """get_transfer_index as LLaDA, Fast-dLLM and Megatron-Bridge write it (low-confidence
    remasking, no threshold): z [B, L, K]."""
    import torch

    z64 = z.to(torch.float64)
    noisy = z64.exp() / (-torch.log(torch.rand_like(z64))) ** temperature
    x0 = torch.argmax(noisy, dim=-1)
    p = torch.softmax(z64, dim=-1)
    x0_p = torch.gather(p, -1, x0[..., None])[..., 0]
    x0 = torch.where(mask_index, x0, x)
    confidence = torch.where(mask_index, x0_p, float("-inf"))
    transfer_index = torch.zeros_like(x0, dtype=torch.bool)
    for j in range(confidence.shape[0]):
        _, select_index = torch.topk(confidence[j], k=int(num_transfer_tokens[j]))
        transfer_index[j, select_index] = True
    return x0, transfer_index


def _step_inputs(n, device, gen):
    """(mask [B, L], canvas [B, L], k [B]) of the step variants."""
    import torch

    b = STEP_BATCH if n % STEP_BATCH == 0 else 1
    mask = torch.rand((b, n // b), generator=gen, device=device) < 0.5
    x = torch.zeros((b, n // b), dtype=torch.long, device=device)
    return mask, x, torch.full((b,), min(8, n // b), device=device)


class JaxSampleCase:
    """ours-jax: the jitted step on JAX's default device (the step number traced, so one
    compilation serves every call)."""

    def __init__(self, n, k, dtype, seed=0):
        import jax

        import dlm_kernels.jax as dj

        self.jax = jax
        keys = jax.random.split(jax.random.PRNGKey(seed))
        self.sets = [(jax.random.normal(key, (n, k)) * 3).astype(dtype) for key in keys]
        self.step = jax.jit(lambda z, i: dj.sample_tokens(z, temperature=0.8, seed=0, step=i))

    def __call__(self, i):
        return self.jax.block_until_ready(self.step(self.sets[i % 2], i))

    def input_bytes(self):
        z = self.sets[0]
        return z.size * z.dtype.itemsize


def _jax_platform():
    import jax

    return jax.default_backend()


def make_case(variant, n, k, dtype, device):
    if variant == "ours-jax":
        return JaxSampleCase(n, k, dtype)
    return SampleCase(variant, n, k, dtype, device)


class SampleCase:
    def __init__(self, variant, n, k, dtype, device, seed=0):
        import torch

        import dlm_kernels.torch as dk

        self.torch = torch
        gen = torch.Generator(device).manual_seed(seed)
        self.sets = [(torch.randn((n, k), generator=gen, device=device) * 3).to(
            getattr(torch, dtype)) for _ in range(2)]
        if variant == "ours":
            self.step = lambda z, i: dk.sample_tokens(z, temperature=0.8, seed=0, step=i)
        elif variant == "llada-float64":
            self.step = lambda z, i: _llada_step(z, 0.8)
        elif variant == "llada+compile":
            torch._dynamo.reset()
            compiled = torch.compile(_llada_step, dynamic=False)
            self.step = lambda z, i: compiled(z, 0.8)
        elif variant == "float32":
            self.step = lambda z, i: _float32_step(z, 0.8)
        elif variant in ("upstream-step", "upstream-step+compile", "ours-step"):
            mask, x, k_rows = _step_inputs(n, device, gen)
            view = lambda z: z.view(mask.shape[0], mask.shape[1], k)  # noqa: E731
            if variant == "ours-step":
                self.step = lambda z, i: dk.get_transfer_index(
                    view(z), 0.8, "low_confidence", mask, x, k_rows, seed=0, step=i)
            else:
                fn = _upstream_step
                if variant == "upstream-step+compile":
                    torch._dynamo.reset()
                    fn = torch.compile(_upstream_step, dynamic=False)
                self.step = lambda z, i: fn(view(z), 0.8, mask, x, k_rows)
        else:
            raise ValueError(f"unknown variant {variant!r}")

    def __call__(self, i):
        return self.step(self.sets[i % 2], i)

    def input_bytes(self):
        z = self.sets[0]
        return z.numel() * z.element_size()


def _probe(variant, n, k, dtype):
    case = make_case(variant, n, k, dtype, "cpu")
    if variant == "ours-jax":  # warmed at full size: the compilation's memory falls outside
        print(rss_peak_delta(lambda: case(0), lambda: case(1)))
        return
    print(rss_peak_delta(lambda: case(0), lambda: SampleCase(variant, 8, min(k, 1024), dtype,
                                                             "cpu")(0)))


def peak_bytes(variant, n, k, dtype, cuda):
    """Peak memory of one step beyond its inputs (CUDA: the allocator; CPU: a fresh
    process's resident set)."""
    if cuda and variant == "ours-jax":
        return None  # JAX's allocator is not torch's: no comparable peak
    if cuda:
        case = SampleCase(variant, n, k, dtype, "cuda")
        case(0)
        return cuda_peak_delta(lambda: case(1))
    return probe_in_subprocess([f"{__package__}.sampling", "--probe", variant, "--n", str(n), "--k",
                                str(k), "--dtype", dtype])


def run(shapes, reps=5, cuda=False, variants=VARIANTS, progress=lambda s: print(s, flush=True)):
    device = "cuda" if cuda else "cpu"
    copy_gbps, _ = copy_bandwidth(device, 2**30 if cuda else 2**28)
    results = []
    for shape in shapes:
        n, k, dtype = shape["n"], shape["k"], shape["dtype"]
        for variant in variants:
            row = dict(variant=variant, **shape)
            try:
                if variant == "ours-jax" and cuda and _jax_platform() != "gpu":
                    raise RuntimeError(f"skipped: JAX runs on {_jax_platform()} here, not the GPU")
                case = make_case(variant, n, k, dtype, device)
                t = measure(case, cuda=cuda, reps=reps)
                nbytes = case.input_bytes()
                case = None
                gc.collect()
                row.update(ms=t["ms"], p20=t["p20"], p80=t["p80"], bytes=nbytes,
                           gbps=nbytes / (t["ms"] * 1e-3) / 1e9,
                           peak_bytes=peak_bytes(variant, n, k, dtype, cuda))
                row["pct_copy"] = 100 * row["gbps"] / copy_gbps
            except Exception as err:  # noqa: BLE001 - e.g. out of memory
                row["error"] = f"{type(err).__name__}: {str(err).splitlines()[0][:160]}"
            results.append(row)
            progress(_line(row))
    return dict(device=detect()["device"], date=_dt.date.today().isoformat(),
                copy_gbps=copy_gbps, results=results)


def _line(r):
    what = f"sampling: {r['variant']:14s} N={r['n']} K={r['k']} {r['dtype']}"
    if "error" in r:
        return f"{what} {r['error']}"
    peak = "n/a" if r["peak_bytes"] is None else f"{r['peak_bytes'] / 2**20:8.1f} MiB"
    return f"{what} {r['ms']:9.2f} ms {r['gbps']:7.1f} GB/s peak {peak}"


def markdown(report):
    lines = [f"### denoising step (device: {report['device']}; {report['date']}; copy "
             f"bandwidth {report['copy_gbps']:.1f} GB/s measured in the same run)", "",
             "| N | K | dtype | variant | ms (p20-p80) | GB/s of the one read | % copy | "
             "peak MiB beyond the logits | ours (ours-step for a step) against it |",
             "|---|---|---|---|---|---|---|---|---|"]
    ours = {(r["variant"], r["n"], r["k"], r["dtype"]): r for r in report["results"]
            if r["variant"] in ("ours", "ours-step") and "ms" in r}
    for r in report["results"]:
        head = f"| {r['n']} | {r['k']} | {r['dtype']} | {r['variant']} |"
        if "error" in r:
            lines.append(f"{head} {r['error'][:100]} | | | | |")
            continue
        mine = ours.get((baseline(r["variant"]), r["n"], r["k"], r["dtype"]))
        ratio = (ratio_words(r["ms"] / mine["ms"]) if mine and r["variant"] != mine["variant"]
                 else "-")
        peak = f"{r['peak_bytes'] / 2**20:.1f}" if r["peak_bytes"] is not None else "n/a"
        lines.append(f"{head} {r['ms']:.1f} ({r['p20']:.1f}-{r['p80']:.1f}) | {r['gbps']:.1f} | "
                     f"{r['pct_copy']:.0f}% | {peak} | {ratio} |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m bench.sampling", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=None, help="rows N = B·L (default: the device's)")
    p.add_argument("--k", type=int, default=None, help="vocabulary K")
    p.add_argument("--dtype", default=None, help="float32 or bfloat16")
    p.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated subset")
    add_common_args(p)
    args = p.parse_args(argv)
    import torch

    cuda = torch.cuda.is_available()
    shapes = GPU_SHAPES if cuda else CPU_SHAPES
    if args.n or args.k or args.dtype:
        base = shapes[0]
        shapes = [dict(n=args.n or base["n"], k=args.k or base["k"],
                       dtype=args.dtype or base["dtype"])]
    if args.probe:
        return _probe(args.probe, **shapes[0])
    report = run(shapes, reps=args.reps, cuda=cuda, variants=args.variants.split(","))
    write_outputs(args, report, markdown(report))
    return report


if __name__ == "__main__":
    main()
