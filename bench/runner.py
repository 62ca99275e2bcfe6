"""The main job: parity check, then the benchmark of every available backend on this device.

    python -m bench              # quick: QUICK_ESTIMATE on a quiet 2-core CPU (its estimate)
    python -m bench --full       # the whole grid: on a GPU the real model vocabularies
    python -m bench --smoke      # seconds; what the test suite runs
    python -m bench --cpu-target # the CPU target grid (N 4096, K 32k and 128k): an hour or more
    dlm-kernels-bench ...        # the same, installed as a command (any directory)

Per objective (ce, sft, policy, opd) x framework x backend x shape x mode (fwd, bwd, fwd+bwd) it
reports milliseconds (median, p20-p80), GB/s of the bytes the pass must move, the percent of
the copy bandwidth measured in the same run, peak memory beyond the inputs, and the speedup
over each baseline; then the linear-head cases (bench/linear_head.py) and the denoising
step's (bench/sampling.py: our draw beside LLaDA's float64 step and a plain float32 one).
The variants of one objective at one shape are timed side by side, call by call (ours, a
peer, ours, a peer, ...), so that a slower stretch of a shared machine falls on each alike,
and a speed-up is claimed only where the p20-p80 spreads are apart. It prints its estimated
run time (from its case list: QUICK_ESTIMATE for the quick CPU grid on a quiet 2-core
machine; longer when busy, and at a first run, which compiles every torch.compile graph from
scratch), the machine's load average, a line per case with the time left, and at the end a
summary, what was measured apart first, then what is within noise, then the load again; the
summary and full tables go to ``<out>/<device>-<date>.{json,md,png}`` (``--out``, by
default ``./bench-results``).

``--cpu-target`` times the CPU target grid instead: ce, sft, policy and opd at N 4096,
K 32768 and 131072, float32 and bf16; torch chunked (for policy also with its gradient
written over the logits, ``inplace_grad``) beside eager and torch.compile of the upstream
loss, JAX chunked beside jitted upstream; with ``--busy-core`` the torch CE K 32768 float32
cases once more beside a busy loop. No linear head or denoising step; files
``<device>-<date>-cpu-target.*``, a summary per objective, shape and dtype.
"""

from __future__ import annotations

import argparse
import atexit
import gc
import json
import os
import subprocess
import sys
import time
from typing import NamedTuple

import numpy as np

from dlm_kernels.testing import new_seed, tolerance

from . import linear_head, sampling, shapes
from .cli import detect, device_slug, try_import
from .cases import (ROTATE, JaxCase, TorchCase, case_bytes, ours_backend, rotate_sets,
                    upstream_bytes, writes_inputs)
from .memory import cpu_peak_bytes, cuda_peak_delta, meminfo_bytes, package_cwd
from .plot import PEER_NAMES, plot
from .progress import (Progress, clock, load_line, ratio_words, spread_verdict, summary,
                       target_summary)
from .timing import copy_bandwidth, copy_bandwidth_jax, error_line, measure, measure_interleaved


# -- environment ------------------------------------------------------------------------------

def share_gpu_with_torch(environ):
    """torch and JAX share one GPU in this process. At its first operation (detect() asks for
    its backend) JAX would take 75 % of the card and leave torch's real-size cases to run out
    of memory: it allocates on demand instead, up to half the card. Set before jax is imported;
    a caller's own setting wins. One name of the limit only: jaxlib 0.11 refuses to start its
    GPU plugin when both are set (and JAX then runs on the CPU); the older name is read by
    jax 0.10 and, deprecated, by 0.11."""
    environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    if not (environ.get("XLA_CLIENT_MEM_FRACTION") or environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION")):
        environ["XLA_PYTHON_CLIENT_MEM_FRACTION"] = "0.5"


def frameworks_to_time(env, requested):
    """The requested frameworks that are installed; JAX not when it fell back to the CPU beside
    a CUDA GPU (no CUDA jaxlib, or its plugin failed to start): GPU shapes on the CPU take
    minutes a case and say nothing about the GPU."""
    out = [f for f in requested if env.get(f)]
    if env["cuda"] and "jax" in out and env["jax_backend"] == "cpu":
        print("JAX runs on the CPU beside a CUDA GPU (see the plugin error above, if any); "
              "its cases are skipped", flush=True)
        out.remove("jax")
    return out


def skip_reason(env, variant, shape_index, elapsed_s, budget_s, memory=None):
    """Why a case is not run, or None: past the time budget; or, on a GPU, the chunked
    fallback beyond the first shape (the path without Triton, bound there by launches and
    float32 temporaries; at the target shape alone it spends about a minute of a run into
    which a short GPU run must also fit the rest of the grid); or (``memory``: the case's
    (estimated bytes, bytes it may use), --cpu-target's materialised losses) more memory than
    the machine has: the process would be killed, with the cases after it."""
    if budget_s is not None and elapsed_s > budget_s:
        return "time budget"
    if env["cuda"] and variant == "chunked" and shape_index > 0:
        return "the fallback is timed at the first GPU shape only"
    if memory is not None and memory[0] > memory[1]:
        return (f"does not fit in memory here (needs about {memory[0] / 2**30:.0f} GiB, "
                f"{memory[1] / 2**30:.0f} GiB usable)")
    return None


#: the rows that are not ours: our own materialised ``reference`` (a parity oracle, kept as a
#: table row, out of the summary's comparisons) and what a user would run instead
PEERS = PEER_NAMES


def variants(env, framework, objective, smoke=False):
    """(ours, [baselines]) for one framework on this device: ``reference``, then the peers
    a user would run instead (bench/upstream.py; torch.compile of it outside --smoke, where
    its compile would take most of the run; Liger on a GPU)."""
    if framework == "torch":
        from dlm_kernels._torch.framework import TORCH

        # the backends auto would use here, from the backend table (on a CPU the chunked
        # one alone: interpreters are not timed)
        native = list(TORCH.token_stats.native("cuda" if env["cuda"] else "cpu"))
        baselines = ["reference", "upstream"] + ([] if smoke else ["upstream+compile"])
        if env["cuda"]:
            baselines.append("reference+compile")
            if objective == "ce" and try_import("liger_kernel") is not None:
                baselines.append("liger")
        return native, baselines
    from dlm_kernels._jax.framework import JAX

    return list(JAX.token_stats.native(env["jax_backend"])), ["reference", "upstream"]


def missing_peers(env, smoke=False):
    """Lines naming the peers this run does not time, and why."""
    lines = []
    if smoke:
        lines.append("torch upstream+compile: not timed in --smoke (its compile takes the run)")
    if not env["cuda"]:
        lines.append("Liger, Cut Cross-Entropy: GPU kernels, not timed on a CPU "
                     "(bench/gpu_check.sh)")
    elif try_import("liger_kernel") is None:
        lines.append("Liger: not installed")
    return lines


# -- parity ---------------------------------------------------------------------------------------

def parity(env):
    """Every native backend vs the reference backend at a small awkward shape, all features,
    on a fresh draw (its seed in every row: DLM_TEST_SEED=seed draws it again)."""
    rows = []
    seed = new_seed()
    rng = np.random.default_rng(seed)
    n, k = 37, 1271
    z64 = rng.standard_normal((n, k)) * 3
    u64 = rng.standard_normal((n, k)) * 3
    y = rng.integers(0, k, n)
    x = rng.integers(0, k, n)
    w = (rng.uniform(size=n) < 0.8).astype(np.float32)
    dsh = rng.uniform(0, 5, n).astype(np.float32)
    kw = dict(temperature=0.9, ce_temperature=1.1, softcap=20.0, teacher_temperature=1.3)
    for fw in ("torch", "jax"):
        if not env[fw]:
            continue
        ours, _ = variants(env, fw, "opd")
        for backend in ours:
            for dtype in ("float32", "bfloat16"):
                got = _stats_and_grad(fw, env, backend, dtype, z64, u64, y, x, dsh, w, kw)
                ref = _stats_and_grad(fw, env, "reference", dtype, z64, u64, y, x, dsh, w, kw)
                errs = {name: float(np.max(np.abs(g - r))) for name, g, r in
                        zip(("lse", "logp", "entropy", "kl", "dlogits"), got, ref)}
                # the statistics are float32; d logits in the dtype, each side rounded to it
                tol = {name: tolerance(dtype, rounded_twice=True) if name == "dlogits"
                       else tolerance("float32") for name in errs}
                ok = all(np.allclose(g, r, atol=tol[name][0], rtol=tol[name][1])
                         for name, g, r in zip(errs, got, ref))
                rows.append(dict(framework=fw, backend=backend, dtype=dtype, ok=bool(ok),
                                 max_abs_err=errs, seed=seed))
    return rows


def _stats_and_grad(fw, env, backend, dtype, z64, u64, y, x, dsh, w, kw):
    if fw == "torch":
        import torch

        import dlm_kernels.torch as dk

        dev = "cuda" if env["cuda"] else "cpu"
        z = torch.tensor(z64, device=dev).to(getattr(torch, dtype)).requires_grad_(True)
        u = torch.tensor(u64, device=dev).to(getattr(torch, dtype))
        t = lambda a: torch.tensor(a, device=dev)
        s = dk.token_stats(z, t(y), t(w), teacher_logits=u, shift_ids=t(x), shift=t(dsh),
                          backend=backend, **kw)
        (g,) = torch.autograd.grad(s.logp.sum() + s.entropy.sum() + s.kl.sum(), z)
        return [v.detach().double().cpu().numpy() for v in (*s, g)]
    import jax
    import jax.numpy as jnp

    import dlm_kernels.jax as dk

    z = jnp.asarray(z64, getattr(jnp, dtype))
    u = jnp.asarray(u64, getattr(jnp, dtype))

    def f(z):
        s = dk.token_stats(z, jnp.asarray(y), jnp.asarray(w), teacher_logits=u,
                          shift_ids=jnp.asarray(x), shift=jnp.asarray(dsh), backend=backend, **kw)
        return jnp.sum(s.logp) + jnp.sum(s.entropy) + jnp.sum(s.kl), s

    (_, s), g = jax.value_and_grad(f, has_aux=True)(z)
    return [np.asarray(v, np.float64) for v in (*s, g)]


# -- the benchmark ----------------------------------------------------------------------------------

def untimed_rows(fw, objective, variant, label, n, k, dtype, error):
    """A case's result rows, one per mode, when it has no timings: why (skipped, or the error)."""
    return [dict(framework=fw, objective=objective, backend=variant, shape=label, n=n, k=k,
                 dtype=dtype, mode=m, error=error) for m in shapes.MODES]


def run_case(env, fw, objective, variant, label, n, k, dtype, copy_gbps, args, rotate=ROTATE):
    """The rows of one case, a row per mode (``rotate``: its input sets, bench/cases.py)."""
    return run_group(env, fw, objective, [variant], label, n, k, dtype, copy_gbps, args, rotate)


def _make_cases(env, fw, objective, names, n, k, dtype, rotate):
    """{variant: its case, or the error that building it raised}; every variant but those
    that write their gradient into their inputs (``writes_inputs``) reads the first one's
    input sets."""
    cuda = env["cuda"] and fw == "torch"
    cases, shared = {}, None
    for variant in names:
        own = writes_inputs(variant)
        try:
            if fw == "torch":
                case = TorchCase(objective, variant, n, k, dtype, "cuda" if cuda else "cpu",
                                 rotate=rotate, sets=None if own else shared)
            else:
                case = JaxCase(objective, variant, n, k, dtype, rotate=rotate, sets=shared)
        except Exception as err:  # noqa: BLE001 - e.g. the reference running out of memory
            cases[variant] = error_line(err)
            continue
        cases[variant] = case
        if shared is None and not own:
            shared = case.sets
    return cases


def _timings(env, fw, cases, reps):
    """{variant: {mode: the timing dict}}: forward, then forward+backward, each timed
    interleaved across the variants rep by rep (bench/timing.py ``measure_interleaved``);
    torch's separate backward (not under compile) one variant after another, each holding
    its graphs only while it is timed; elsewhere the backward is derived. A variant whose
    call raised gets dict(error=...) for the mode."""
    cuda = env["cuda"] and fw == "torch"
    out = {v: {} for v in cases}
    for mode, call in (("fwd", "fwd"), ("fwd+bwd", "fwdbwd")):
        timed = measure_interleaved({v: getattr(c, call) for v, c in cases.items()
                                     if "error" not in out[v]}, cuda=cuda, reps=reps)
        for v, t in timed.items():
            out[v][mode] = t
            if "error" in t:
                out[v]["error"] = t["error"]
    for v, case in cases.items():
        if "error" in out[v]:
            continue
        if fw == "torch" and case.separate_bwd:
            try:
                case.prepare_bwd()
                out[v]["bwd"] = dict(measure(case.bwd, cuda=cuda, reps=reps), interleaved=False)
            except Exception as err:  # noqa: BLE001
                out[v]["error"] = error_line(err)
            finally:
                case.release()
            continue
        fb, f = out[v]["fwd+bwd"], out[v]["fwd"]
        out[v]["bwd"] = dict(ms=max(fb["ms"] - f["ms"], 0.0), p20=None, p80=None,
                             reps=fb["reps"], derived="fwd+bwd minus fwd")
        if "back_to_back_ms" in fb and "back_to_back_ms" in f:
            out[v]["bwd"]["back_to_back_ms"] = max(fb["back_to_back_ms"] - f["back_to_back_ms"], 0.0)
    return out


def _peak(env, fw, case, objective, variant, n, k, dtype):
    """(peak bytes beyond the inputs, what the number is) of one forward+backward."""
    if fw == "torch" and env["cuda"]:
        return cuda_peak_delta(lambda: case.fwdbwd(0)), "cuda max_memory_allocated delta"
    if fw == "torch":
        return (cpu_peak_bytes(objective, variant, n, k, dtype),
                "VmHWM delta (own process, bench/memory.py)")
    return case.temp_bytes(), "XLA temp bytes (memory_analysis)"


def run_group(env, fw, objective, names, label, n, k, dtype, copy_gbps, args, rotate=ROTATE):
    """The rows of the variants ``names`` of one objective at one shape, a row per variant
    and mode: built on one draw of inputs, timed side by side rep by rep (``_timings``), then
    each one's peak memory (CPU torch: in a process of its own, bench/memory.py). A variant
    that fails gets rows with its error; the others are still timed."""
    elem = 2 if dtype in ("bfloat16", "float16") else 4
    cuda = env["cuda"] and fw == "torch"
    started = time.monotonic()
    cases = _make_cases(env, fw, objective, names, n, k, dtype, rotate)
    timings = {v: dict(error=c) for v, c in cases.items() if isinstance(c, str)}
    built = {v: c for v, c in cases.items() if not isinstance(c, str)}
    timings.update(_timings(env, fw, built, args.reps) if built else {})
    if fw == "torch" and not cuda:  # the probes run in a process of their own: free the
        cases = built = {v: None for v in built}  # memory they will need (the inputs)
        gc.collect()
    peaks = {}
    for v in list(built):
        case = built.pop(v)
        if "error" in timings[v]:
            continue
        try:
            peaks[v] = _peak(env, fw, case, objective, v, n, k, dtype)
        except Exception as err:  # noqa: BLE001
            timings[v]["error"] = error_line(err)
    cases = case = None  # drop the inputs, so that emptying the cache hands them back
    gc.collect()
    if cuda:
        import torch

        torch.cuda.empty_cache()  # (JAX shares the card: torch must not sit on freed blocks)
    wall_s = (time.monotonic() - started) / max(len(names), 1)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    out = []
    for variant in names:
        out += _variant_rows(fw, objective, variant, label, n, k, dtype, elem, copy_gbps,
                             timings[variant], peaks.get(variant), rotate, wall_s, load)
    return out


def _variant_rows(fw, objective, variant, label, n, k, dtype, elem, copy_gbps, timing, peak,
                  rotate, wall_s, load):
    """One variant's rows, a row per mode (its error in each where it has one)."""
    if "error" in timing:
        return untimed_rows(fw, objective, variant, label, n, k, dtype, timing["error"])
    peak_bytes, peak_kind = peak
    out = []
    for mode in shapes.MODES:
        t = timing[mode]
        nbytes = shapes.bytes_moved(objective, mode, n, k, elem)
        gbps = nbytes / (t["ms"] * 1e-3) / 1e9 if t["ms"] > 0 else None
        out.append(dict(framework=fw, objective=objective, backend=variant, shape=label, n=n,
                        k=k, dtype=dtype, mode=mode, ms=t["ms"], p20=t["p20"], p80=t["p80"],
                        reps=t["reps"], times_ms=t.get("times"), derived=t.get("derived"),
                        interleaved=t.get("interleaved", t.get("derived") is None),
                        back_to_back_ms=t.get("back_to_back_ms"),
                        bytes=nbytes, gbps=gbps, rotate=rotate,
                        pct_copy=100 * gbps / copy_gbps if gbps else None,
                        peak_bytes=peak_bytes, peak_kind=peak_kind, case_s=wall_s,
                        load_1min=load))
    return out


def add_speedups(results):
    index = {(r["framework"], r["objective"], r["shape"], r["mode"], r["backend"]): r
             for r in results if "ms" in r}
    for r in results:
        if "ms" not in r:
            continue
        r["speedup"] = {}
        for (fw, obj, shape, mode, b), base in index.items():
            if (fw, obj, shape, mode) == (r["framework"], r["objective"], r["shape"], r["mode"]) \
                    and b != r["backend"] and r["ms"] > 0:
                r["speedup"][b] = base["ms"] / r["ms"]


def vocab_parallel_comm(env):
    """All-reduce bytes per row of the vocab-parallel path, from ``python -m bench.comm``."""
    if not env["jax"]:
        return None
    out = subprocess.run([sys.executable, "-m", f"{__package__}.comm"], capture_output=True,
                         text=True, cwd=package_cwd())
    if out.returncode != 0:
        print(f"vocab-parallel comm measurement failed: {out.stderr[-500:]}", flush=True)
        return None
    return json.loads(out.stdout.strip().splitlines()[-1])


def markdown(env, copy_gbps, results, parity_rows, summary_lines=None):
    """The run's Markdown: the device, the machine's load, the closing summary
    (``summary_lines``), parity, then a table per objective."""
    lines = [f"Device: {env['device']} — {env['date'][:10]} — {env.get('threads', '?')} threads"
             + (" — beside a busy-loop process on one core" if env.get("busy_core") else "") + " — "
             f"copy bandwidth {copy_gbps:.1f} GB/s (measured in the same run)", ""]
    if env.get("load"):
        lines += [load_line(env["load"]), ""]
    if summary_lines:
        lines += ["## Summary", "", "```text", *summary_lines, "```", ""]
    if env.get("busy_repeat"):
        lines += ["Shapes ending in -busy: the same cases once more beside a busy-loop "
                  "process on one core.", ""]
    lines += [f"Not timed: {line}" for line in env.get("missing_peers", [])]
    lines += ["Speed-ups compare ours with what users run instead (upstream: the loss written "
              "materialised, bench/upstream.py); `reference` is our parity oracle. Each "
              "objective's variants at one shape are timed side by side, call by call (the "
              "separate backward one variant after another); a speed-up is given only where "
              "the p20-p80 spreads are apart, else \"within noise\".", ""]
    bad = [p for p in parity_rows if not p["ok"]]
    seed = parity_rows[0]["seed"] if parity_rows else None
    lines.append(f"Parity vs reference (seed {seed}): "
                 f"{len(parity_rows) - len(bad)}/{len(parity_rows)} pass" +
                 ("" if not bad else f" (FAIL: {[(p['framework'], p['backend'], p['dtype']) for p in bad]})"))
    # GPU runs: also the mean of the same calls back to back (bench/timing.py)
    b2b = any(r.get("back_to_back_ms") is not None for r in results)
    header = ["framework", "backend", "shape", "mode", "ms (p20-p80)"] + (["ms back to back"] if b2b else []) \
        + ["GB/s", "% copy", "peak MiB beyond inputs", "vs upstream", "vs upstream+compile"]
    row_of = lambda cells: "| " + " | ".join(cells) + " |"
    peer = {(r["framework"], r["objective"], r["shape"], r["mode"], r["backend"]): r
            for r in results if "ms" in r and r["backend"] in PEERS}
    for obj in shapes.OBJECTIVES:
        rows = [r for r in results if r["objective"] == obj]
        if not rows:
            continue
        lines += ["", f"### {obj}", "", row_of(header), "|" + "---|" * len(header)]
        for r in rows:
            cells = [r["framework"], r["backend"], r["shape"], r["mode"]]
            if "error" in r:
                error = r["error"].split(". ")[0][:120]  # e.g. "OutOfMemoryError: CUDA out of memory"
                lines.append(row_of(cells + [error] + [""] * (len(header) - 5)))
                continue
            spread = f" ({r['p20']:.2f}-{r['p80']:.2f})" if r["p20"] is not None else " (derived)"
            cells.append(f"{r['ms']:.2f}{spread}")
            if b2b:
                cells.append("%.2f" % r["back_to_back_ms"] if r.get("back_to_back_ms") is not None else "-")
            cells += [f"{r['gbps']:.1f}" if r["gbps"] else "-",
                      f"{r['pct_copy']:.0f}%" if r["pct_copy"] else "-",
                      f"{r['peak_bytes'] / 2**20:.0f}" if r["peak_bytes"] is not None else "n/a"]
            cells += [_speedup_cell(r, peer.get((r["framework"], r["objective"], r["shape"],
                                                 r["mode"], b)))
                      for b in ("upstream", "upstream+compile")]
            lines.append(row_of(cells))
    return "\n".join(lines) + "\n"


def _speedup_cell(row, base):
    """A table's "vs <peer>" cell of one of our rows: the speed-up in words where the p20-p80
    spreads are apart, "within noise" where they overlap, "(derived)" after a derived time."""
    if base is None or row["backend"] in PEERS or not (row["ms"] > 0 and base["ms"] > 0):
        return "-"  # a derived backward can be 0 ms: no ratio
    verdict = spread_verdict(row, base)
    if verdict == "within noise":
        return verdict
    return ratio_words(base["ms"] / row["ms"]) + ("" if verdict else " (derived)")


def main(argv=None):
    p = argparse.ArgumentParser(
        prog="python -m bench", formatter_class=_HelpFormatter,
        description=__doc__.replace("QUICK_ESTIMATE", minutes_words(quick_estimate_s())))
    p.add_argument("--full", action="store_true",
                   help="the whole grid (GPU: bench/shapes.py's FULL_SHAPES; CPU: CPU_SHAPES, "
                        "and every linear-head variant); default: the quick grid")
    p.add_argument("--smoke", action="store_true", help="one tiny shape (seconds)")
    p.add_argument("--reps", type=int, default=None,
                   help="timed calls per case (default: 5 on a CPU, 10 on a GPU)")
    p.add_argument("--cpu-target", action="store_true",
                   help="the CPU target grid in place of the quick one: "
                        f"{', '.join(shapes.CPU_TARGET_OBJECTIVES)} at N 4096, K 32768 and "
                        "131072, float32 and bf16; torch chunked (policy: also in place), "
                        "upstream and upstream+compile, JAX chunked and upstream (jit); with "
                        "--busy-core the torch CE K 32768 float32 cases once more beside a busy "
                        "loop. "
                        "An hour or more on 2 cores (it prints its estimate at start)")
    p.add_argument("--objectives", default=None,
                   help="comma-separated objectives to time (default: "
                        f"{','.join(shapes.OBJECTIVES)}; with --cpu-target "
                        f"{','.join(shapes.CPU_TARGET_OBJECTIVES)})")
    p.add_argument("--frameworks", default="torch,jax",
                   help="comma-separated frameworks (default: %(default)s)")
    p.add_argument("--out", default="bench-results",
                   help="directory for the JSON, Markdown and PNG results, created "
                        "(default: %(default)s, under the current directory)")
    p.add_argument("--no-linear-head", dest="linear_head", action="store_false",
                   help="leave out the linear-head cases (bench/linear_head.py)")
    p.add_argument("--no-sampling", dest="sampling", action="store_false",
                   help="leave out the denoising step's cases (bench/sampling.py)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch intra-op threads for the run (default: torch's, usually the "
                        "cores); set and reported, so timings on a shared machine say it")
    p.add_argument("--busy-core", action="store_true",
                   help="time beside a competing process (a busy loop on one core), as on a "
                        "shared machine; the report's name ends in -busy, to sit beside a "
                        "quiet run's (with --cpu-target: the quiet grid, then its torch CE "
                        "K 32768 float32 cases again beside the busy loop, in one report)")
    p.add_argument("--budget-s", type=float, default=None,
                   help="stop starting new cases after this many seconds (recorded as skipped)")
    args = p.parse_args(argv)

    if args.cpu_target and (args.smoke or args.full):
        p.error("--cpu-target is a grid of its own: not with --smoke or --full")
    load_before = load_average()  # before this process adds its own work
    share_gpu_with_torch(os.environ)
    env = detect()
    env["load"] = dict(before=load_before, after=None, cores=os.cpu_count())
    if args.cpu_target and env["cuda"]:
        p.error("--cpu-target times the CPU; this machine's torch runs on its CUDA GPU")
    if env["torch"]:
        import torch

        if args.threads is not None:
            torch.set_num_threads(args.threads)
        env["threads"] = torch.get_num_threads()
    else:
        env["threads"] = os.cpu_count()
    env["missing_peers"] = missing_peers(env, args.smoke)
    if args.cpu_target:
        env["missing_peers"].append("reference (our parity oracle): not timed in --cpu-target")
    env["busy_core"] = args.busy_core and not args.cpu_target  # the whole run beside the loop
    env["busy_repeat"] = args.busy_core and args.cpu_target  # some cases again beside it
    print(f"device: {env['device']}; threads: {env['threads']}; versions: {env['versions']}",
          flush=True)
    print(load_line(env["load"]), flush=True)
    if args.reps is None:
        args.reps = 10 if env["cuda"] else 5
    if env["cuda"]:
        grid = (shapes.FULL_SHAPES if args.full
                else shapes.MODEL_SHAPES[:1] + shapes.MODEL_SHAPES[-1:])
        copy_gbps, copy_t = copy_bandwidth("cuda", 2**30)
    else:
        grid = (shapes.SMOKE_SHAPES if args.smoke else shapes.CPU_TARGET_SHAPES
                if args.cpu_target else shapes.CPU_SHAPES if args.full
                else shapes.QUICK_CPU_SHAPES)
        size = 2**26 if args.smoke else 2**28  # past the caches, except at smoke size
        if env["torch"]:
            copy_gbps, copy_t = copy_bandwidth("cpu", size)
        else:
            copy_gbps, copy_t = copy_bandwidth_jax(size)
    print(f"copy bandwidth: {copy_gbps:.1f} GB/s", flush=True)

    parity_rows = parity(env)
    for row in parity_rows:
        print(f"parity {row['framework']}/{row['backend']}/{row['dtype']}: "
              f"{'ok' if row['ok'] else 'FAIL'} {row['max_abs_err']}", flush=True)

    os.makedirs(args.out, exist_ok=True)
    slug = device_slug(env["device"])
    stem = os.path.join(args.out, f"{slug}-{env['date'][:10]}" + ("-smoke" if args.smoke else "")
                        + ("-cpu-target" if args.cpu_target else "")
                        + ("-busy" if env["busy_core"] else ""))

    def save(**extra):  # after every case too: a run cut short by a timeout keeps what it measured
        report = dict(env, copy_gbps=copy_gbps, copy_timing=copy_t, parity=parity_rows,
                      shapes=grid, results=results, **extra)
        with open(stem + ".json", "w") as f:
            json.dump(report, f, indent=1)
        return report

    results = []
    frameworks = frameworks_to_time(env, args.frameworks.split(","))
    objectives = (args.objectives.split(",") if args.objectives else
                  list(shapes.CPU_TARGET_OBJECTIVES if args.cpu_target else shapes.OBJECTIVES))
    # (framework, shape index, shape, objective, variant, beside the busy loop)
    if args.cpu_target:
        cases = [(fw, index, shape, obj, variant, False)
                 for fw in frameworks for index, shape in enumerate(grid) for obj in objectives
                 for variant in shapes.cpu_target_variants(fw, obj)]
        repeat = shapes.CPU_TARGET_BUSY
        if (args.busy_core and repeat["framework"] in frameworks
                and repeat["objective"] in objectives):
            cases += [(repeat["framework"], 0, repeat["shape"], repeat["objective"], variant, True)
                      for variant in shapes.cpu_target_variants(repeat["framework"],
                                                                repeat["objective"])]
        rotate = cpu_target_memory(cases)
        usable_bytes = 0.85 * (meminfo_bytes("MemAvailable") or float("inf"))
    else:
        cases = [(fw, index, shape, obj, variant, False)
                 for fw in frameworks for index, shape in enumerate(grid) for obj in objectives
                 for variant in sum(variants(env, fw, obj, args.smoke), [])]
        rotate = {}
    # no linear head or denoising step in --cpu-target: its grid is the whole run
    head_plan = (linear_head_plan(env, args.smoke, args.full)
                 if args.linear_head and not args.cpu_target else None)
    sample_plan = (sampling_plan(env, args.smoke, args.full)
                   if args.sampling and not args.cpu_target else None)
    if not env["cuda"]:
        estimate = run_seconds(cases, rotate, args.reps, head_plan is not None,
                               sample_plan is not None)
        print(f"estimated run time: {minutes_words(estimate)} ({clock(estimate)}; rough: "
              "from this run's case list and the times of a quiet 2-core Xeon, "
              "bench/runner.py run_seconds; longer on a busy machine, and at a first run, "
              "which compiles every torch.compile graph from scratch)", flush=True)
    progress = Progress(len(cases) + (linear_head_cases(head_plan, frameworks)
                                      if head_plan else 0)
                        + (len(sample_plan.shapes) * len(sample_plan.variants)
                           if sample_plan else 0))
    started = time.monotonic()
    # the competitor: a busy loop for the rest of the run, or (--cpu-target) from its first
    # case beside it on (killed when the process exits)
    busy = start_busy_loop() if env["busy_core"] else None
    atexit.register(lambda: busy is not None and busy.poll() is None and busy.kill())
    # Framework outermost: a run that its budget cuts short has timed torch's whole grid (the
    # baselines the Triton issue asks for) before any JAX case. The variants of one objective
    # at one shape run together, timed side by side rep by rep (``run_group``).
    for group in group_cases(cases):
        fw, index, (label, n, k, dtype), obj, _, beside_busy = group[0]
        if beside_busy:
            label += "-busy"
            if busy is None:
                busy = start_busy_loop()
        names = []
        for *_, variant, _ in group:
            memory = None
            if args.cpu_target and variant == "upstream":  # eager / jit: every [N, K] temporary
                memory = (upstream_bytes(obj, n, k, dtype), usable_bytes)
            why = skip_reason(env, variant, index, time.monotonic() - started, args.budget_s,
                              memory)
            if why:
                results += untimed_rows(fw, obj, variant, label, n, k, dtype, f"skipped: {why}")
                progress.step(f"{fw} {obj} {variant} {label}", f"skipped: {why}")
            else:
                names.append(variant)
        if not names:
            continue
        rows = run_group(env, fw, obj, names, label, n, k, dtype, copy_gbps, args,
                         rotate=rotate.get((obj, n, k, dtype), ROTATE))
        for row in rows:
            row["busy"] = beside_busy  # (--cpu-target's repeat beside the busy loop)
        results += rows
        add_speedups(results)
        save(partial=True)
        for variant in names:
            fb = next(r for r in rows if r["mode"] == "fwd+bwd" and r["backend"] == variant)
            progress.step(f"{fw} {obj} {variant} {label}",
                          f"fwd+bwd {fb['ms']:.2f} ms ({fb['p20']:.2f}-{fb['p80']:.2f}), "
                          f"{fb['gbps']:.1f} GB/s" if "ms" in fb else fb["error"])
    if env["busy_repeat"] and busy is not None:
        busy.kill()
    comm = None if args.cpu_target else vocab_parallel_comm(env)
    head = None
    if head_plan:

        def head_progress(line):
            if line.startswith("linear head parity"):
                print(line, flush=True)
            else:
                progress.step(line)

        head = linear_head.run(**head_plan.shape, frameworks=tuple(frameworks), reps=args.reps,
                               cuda=env["cuda"], variants=head_plan.variants,
                               scaling=head_plan.scaling, progress=head_progress)
    draw = None
    if sample_plan:
        draw = sampling.run(sample_plan.shapes, reps=args.reps, cuda=env["cuda"],
                            variants=sample_plan.variants, progress=progress.step)
    env["load"]["after"] = load_average()
    lines = closing_summary(results, head, draw, env["load"], args.cpu_target)
    report = save(vocab_parallel_comm=comm, linear_head=head, sampling=draw, summary=lines)
    table = markdown(env, copy_gbps, results, parity_rows, lines)
    if head is not None:
        table += "\n" + linear_head.markdown(head)
    if draw is not None:
        table += "\n" + sampling.markdown(draw)
    if comm:
        table += ("\nVocabulary-parallel communication (JAX, 1 x 8 mesh, compiled HLO all-reduces, "
                  "forward + backward): " + ", ".join(
                      f"N={c['n']} K={c['k']}: {c['bytes_per_row']:.0f} B/row "
                      f"(logits {c['logits_bytes_per_row']} B/row)" for c in comm) + "\n")
    with open(stem + ".md", "w") as f:
        f.write(table)
    png = plot(results, stem + ".png", head, env, draw)
    print("\n".join(lines), flush=True)
    print(f"full tables: {stem}.md; data: {stem}.json" + (f"; plot: {png}" if png else ""))
    if not all(r["ok"] for r in parity_rows) or (
            head is not None and not all(c["ok"] for c in head["parity"])):
        sys.exit(1)
    return report


def load_average():
    """os.getloadavg()'s 1, 5 and 15 minute averages as a list, or None where there is none."""
    try:
        return [round(v, 2) for v in os.getloadavg()]
    except (AttributeError, OSError):
        return None


def closing_summary(results, head, draw, load, cpu_target=False):
    """The run's closing lines: --cpu-target's per-shape summary, the summary against the
    peers (quiet cases only), the linear head's and the denoising step's, then the machine's
    load; the same lines go into the results' JSON and Markdown."""
    lines = target_summary(results, PEERS) if cpu_target else []
    lines += summary([r for r in results if not r.get("busy")], PEERS)
    if head is not None:
        lines += linear_head_summary(head)
    if draw is not None:
        lines += sampling_summary(draw)
    return lines + [load_line(load)]


def group_cases(cases):
    """The cases in runs of one framework, shape, objective and busy flag (their order kept):
    the variants ``run_group`` times side by side."""
    groups = []
    for case in cases:
        fw, index, shape, obj, _, beside_busy = case
        if groups and groups[-1][0][:4] == (fw, index, shape, obj) and groups[-1][0][5] == beside_busy:
            groups[-1].append(case)
        else:
            groups.append([case])
    return groups


def start_busy_loop():
    """The competing process of --busy-core: a Python busy loop, on one core."""
    return subprocess.Popen([sys.executable, "-c", "while True: pass"])


#: rough forward+backward nanoseconds per logit by (framework, variant) and objective on a
#: 2-core Xeon: chunked, upstream and upstream+compile at N 4096, K 32768 (bench/NOTES.md,
#: the CPU target grid; the JAX sft and opd ones guessed from its CE), reference at N 256, K 16384
#: (the quick run of 2026-12-02; its policy and sft taken as CE's), for the run-time estimate
_NS_PER_LOGIT = {("torch", "chunked"): {"ce": 4.5, "sft": 5.0, "policy": 5.0, "opd": 19.0},
                 ("torch", "upstream"): {"ce": 6.5, "sft": 15.5, "policy": 10.0, "opd": 29.0},
                 ("torch", "upstream+compile"): {"ce": 4.5, "sft": 7.0, "policy": 5.0,
                                                 "opd": 12.0},
                 ("torch", "reference"): {"ce": 14.0, "sft": 14.0, "policy": 14.0, "opd": 40.0},
                 ("jax", "chunked"): {"ce": 2.1, "sft": 2.5, "policy": 3.5, "opd": 8.0},
                 ("jax", "upstream"): {"ce": 3.9, "sft": 4.5, "policy": 5.0, "opd": 12.0},
                 ("jax", "reference"): {"ce": 2.5, "sft": 2.5, "policy": 4.5, "opd": 11.0}}
_CALL_FLOOR_S = 0.002  # one call at the quick grid's smallest shapes (host time, mostly)
#: one torch.compile of a case's loss, in the timed process and again in its memory probe:
#: at the CPU target's sizes (a guess, a minute each), and at the quick grid's. These,
#: ``_CASE_S`` and the fixed costs below are calibrated on the quick grid before sft joined
#: it (3 objectives): the parts of its loaded run (bench/NOTES.md, 14 min 35 s: compiles
#: 405 s, the other torch cases 202 s, JAX 128 s, start 51 s, ...) scaled to the 3 min 19 s
#: it took on the quiet 2-core Xeon (2026-12-02). A first run on a machine, with Inductor's
#: cache on disk cold, compiles for longer. Every run records each case's seconds
#: (``case_s``) to calibrate them again.
_COMPILE_S = 60.0
_SMALL_COMPILE_S = 2.4
_CASE_S = {"torch": 0.3, "jax": 0.4}  # building a case, its probe's fork, JAX's two jits
_SETUP_NS = 5.0  # drawing one input logit
#: start-up (imports, copy bandwidth, parity) with the vocabulary-parallel HLO, the quick
#: linear head and the quick denoising step on a quiet 2-core CPU, the same calibration
_FIXED_S = 16.0
_HEAD_S = 5.0
_SAMPLING_S = 11.0


def _measure_seconds(call_s, reps, budget_s=20.0):
    """bench/timing.measure's time: 2 warm-up calls, then ``reps`` timed ones, stopping past
    ``budget_s`` once 3 ran."""
    timed = min(reps, max(3, int(budget_s / call_s) + 1)) if call_s > 0 else reps
    return (2 + timed) * call_s


def case_seconds(fw, n, k, dtype, obj, variant, sets, reps):
    """One case's estimated seconds on a 2-core CPU (``_NS_PER_LOGIT``; fwd taken as 35 % of
    fwd+bwd, as in bench/NOTES.md): its input sets, fwd and fwd+bwd timed, torch's separate
    bwd (not under compile), its memory probe's call, each compile."""
    ns = _NS_PER_LOGIT.get((fw, ours_backend(variant)[0]), {})
    fb = ns.get(obj, max(ns.values(), default=20.0)) * n * k * 1e-9 + _CALL_FLOOR_S
    total = _CASE_S.get(fw, 1.0) + _SETUP_NS * n * k * 1e-9 * sets * (2 if obj == "opd" else 1)
    total += _measure_seconds(0.35 * fb, reps) + _measure_seconds(fb, reps)
    if fw == "torch":
        total += 2 * fb  # the memory probe's warm-up and measured calls
        if variant.endswith("+compile"):
            total += 2 * (_COMPILE_S if n * k >= 1 << 24 else _SMALL_COMPILE_S)
        else:
            total += sets * 0.35 * fb + _measure_seconds(0.65 * fb, reps)
    return total


def run_seconds(cases, rotate, reps, head=False, sampling=False):
    """The run's estimated seconds on a 2-core CPU: start-up, every case (``case_seconds``),
    the linear head and denoising step where they run. Rough: constants from a 2-core Xeon
    (bench/NOTES.md and the quick run of 2026-12-02), a machine of its own."""
    total = _FIXED_S + _HEAD_S * head + _SAMPLING_S * sampling
    for fw, _, (_, n, k, dtype), obj, variant, _ in cases:
        total += case_seconds(fw, n, k, dtype, obj, variant,
                              rotate.get((obj, n, k, dtype), ROTATE), reps)
    return total


#: the variants timed on a CPU (bench: ``variants``), for the estimate --help quotes
CPU_VARIANTS = {"torch": ("chunked", "reference", "upstream", "upstream+compile"),
                "jax": ("chunked", "reference", "upstream")}


def quick_cases(objectives=shapes.OBJECTIVES, frameworks=("torch", "jax")):
    """The cases of ``python -m bench`` on a CPU, in the order the run takes them."""
    return [(fw, index, shape, obj, variant, False)
            for fw in frameworks for index, shape in enumerate(shapes.QUICK_CPU_SHAPES)
            for obj in objectives for variant in CPU_VARIANTS[fw]]


def quick_estimate_s(objectives=shapes.OBJECTIVES):
    """The quick job's estimated seconds on a quiet 2-core CPU (its own case list, the
    default 5 calls a case, the linear head and denoising step): what --help and the README
    quote, and what the run prints at its start."""
    return run_seconds(quick_cases(objectives), {}, 5, head=True, sampling=True)


def minutes_words(seconds):
    """"about 5 min" (whole minutes, at least 1)."""
    return f"about {max(1, round(seconds / 60))} min"


def cpu_target_memory(cases, share=0.85):
    """{(objective, n, k, dtype): input sets} for the --cpu-target cases: 2, or 1 where 2
    would not fit in ``share`` of the memory available now (bench/cases.py ``case_bytes``);
    printed, with a warning where even one set may not fit."""
    available = meminfo_bytes("MemAvailable")
    keys = sorted({(obj, n, k, dtype) for _, _, (_, n, k, dtype), obj, _, _ in cases},
                  key=lambda key: (key[2], key[3], key[0]))
    if available is None:
        print("memory available unknown (no /proc/meminfo): one input set per case", flush=True)
        return {key: 1 for key in keys}
    budget = share * available
    # variants that write into their inputs draw sets of their own (``writes_inputs``)
    own = {key: len({v for _, _, (_, n, k, dtype), obj, v, _ in cases
                     if (obj, n, k, dtype) == key and writes_inputs(v)}) for key in keys}
    rotate = {key: rotate_sets(*key, budget, own[key]) for key in keys}
    single = [f"{obj} K {k} {dtype}" for (obj, n, k, dtype), r in rotate.items() if r == 1]
    print(f"memory: {available / 2**30:.1f} GiB available; {ROTATE} input sets per case, "
          f"1 where {ROTATE} would not fit in {share:.0%} of it (estimated peak, "
          "bench/cases.py case_bytes)" + (f": {', '.join(single)}" if single else ""),
          flush=True)
    for (obj, n, k, dtype), r in rotate.items():
        need = case_bytes(obj, n, k, dtype, 1, own[(obj, n, k, dtype)])
        if r == 1 and need > budget:
            print(f"warning: {obj} N {n} K {k} {dtype} needs about {need / 2**30:.1f} GiB "
                  "with one input set: it may not fit", flush=True)
    return rotate


class HeadPlan(NamedTuple):
    shape: dict  # n, d, k, dtype
    variants: object  # None (all), names, or names by framework (linear_head.variants_of)
    scaling: bool  # also the 2N memory-scaling row


def linear_head_plan(env, smoke, full=False):
    """The main job's linear-head cases: the GPU target shape on a GPU; on a CPU a shape of a
    few seconds a case, with ``--full`` every variant (torch.compile's too, which compiles for
    tens of seconds) and the 2N row, otherwise a smaller shape without either; at smoke size
    two variants at a tiny awkward shape."""
    if smoke:
        return HeadPlan(dict(n=64, d=16, k=257, dtype="float32"), ["ours-ce", "unfused"], True)
    if env["cuda"]:
        return HeadPlan(dict(linear_head.GPU_SHAPE), None, True)
    if full:
        return HeadPlan(dict(linear_head.CPU_MAIN_SHAPE), None, True)
    return HeadPlan(dict(linear_head.CPU_QUICK_SHAPE), linear_head.QUICK_VARIANTS, False)


def linear_head_cases(plan, frameworks):
    """How many cases ``linear_head.run`` times for ``plan``: each variant, then the 2N row."""
    return sum(len(linear_head.variants_of(plan.variants, fw)) + plan.scaling for fw in frameworks)


def _noise(mine, base):
    return spread_verdict(mine, base) == "within noise"


def _bar_words(mine, base):
    """Ours (``mine``) against another row in words: "1.5x faster", "2.0x slower", or
    "within noise" where their p20-p80 spreads overlap (no speed claim then)."""
    if _noise(mine, base):
        return "within noise"
    return ratio_words(base["ms"] / mine["ms"]) if mine["ms"] > 0 else "n/a"


def linear_head_summary(head):
    """One line per framework and variant: forward+backward time, TFLOP/s, faster or slower
    than the unfused pipeline (where the p20-p80 spreads are apart, else within noise)."""
    rows = [r for r in head["results"] if r["mode"] == "fwd+bwd" and not r.get("scaling")]
    unfused = {r["framework"]: r for r in rows if r["backend"] == "unfused" and "ms" in r}
    s = head["shape"]
    lines = [f"Linear head (N={s['n']} D={s['d']} K={s['k']} {s['dtype']}, forward+backward):"]
    for r in rows:
        if "ms" not in r:
            lines.append(f"  {r['framework']:9s} {r['backend']:18s} {r['error'][:60]}")
            continue
        base = unfused.get(r["framework"])
        vs = (f"{_bar_words(r, base)} {'of' if _noise(r, base) else 'than'} unfused"
              if base and base is not r and r["ms"] > 0 else "")
        lines.append(f"  {r['framework']:9s} {r['backend']:18s} {r['ms']:9.1f} ms "
                     f"{(r['tflops'] or 0):7.2f} TFLOP/s  {vs}")
    return lines


class SamplePlan(NamedTuple):
    shapes: list  # dicts of n, k, dtype
    variants: tuple


def sampling_plan(env, smoke, full=False):
    """The main job's denoising-step cases: on a GPU its first benchmark shape (B·L 16384,
    K 262144, bf16); on a CPU N 1024 with ``--full`` (the issue's shape), else N 256; at
    smoke size ours and the float32 step at a tiny awkward shape. torch.compile's variant
    only with ``--full`` or on a GPU (it compiles for tens of seconds)."""
    if smoke:
        return SamplePlan([dict(n=40, k=1000, dtype="float32")], ("ours", "float32"))
    quick = tuple(v for v in sampling.VARIANTS if "+compile" not in v)
    if env["cuda"]:
        return SamplePlan(sampling.GPU_SHAPES[:1], sampling.VARIANTS if full else quick)
    if full:
        return SamplePlan(sampling.CPU_SHAPES, sampling.VARIANTS)
    return SamplePlan([dict(sampling.CPU_SHAPES[0], n=256)], quick)


def sampling_summary(draw):
    """One line per shape and variant: time, GB/s of the one read, how much faster or slower
    ours is (ours-step for the whole step; where the p20-p80 spreads are apart, else within
    noise)."""
    lines = ["Denoising step (one draw over [N, K] logits):"]
    ours = {(r["variant"], r["n"], r["k"], r["dtype"]): r for r in draw["results"]
            if r["variant"] in ("ours", "ours-step") and "ms" in r}
    for r in draw["results"]:
        what = f"  N={r['n']} K={r['k']} {r['dtype']} {r['variant']:14s}"
        if "ms" not in r:
            lines.append(f"{what} {r['error'][:60]}")
            continue
        mine = ours.get((sampling.baseline(r["variant"]), r["n"], r["k"], r["dtype"]))
        vs = (f"{mine['variant']} {_bar_words(mine, r)}"
              if mine and r["variant"] != mine["variant"] and mine["ms"] > 0 else "")
        lines.append(f"{what} {r['ms']:9.1f} ms {r['gbps']:7.1f} GB/s  {vs}")
    return lines


class _HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """The module docstring as written."""


def cli():
    """The ``dlm-kernels-bench`` command: ``main`` with the process's arguments; the exit
    status says whether parity held (``main`` exits 1 where it did not)."""
    main()
    return 0
