"""What one row, one answer costs on a CPU: the JAX chunked backend's token statistics
(forward, and forward+backward) at this tree against an earlier revision, on the CPU grids'
shapes, timed in alternating processes on the same machine.

    python -m bench.invariance_cost --before REV [--rounds 4] [--reps 7] [--out DIR]

REV is a git revision of this repository (for the invariance work of 2026-12-04:
``ad94b09^1``, the tree before the JAX chunked backend's chunks and row blocks were fixed by
K; every later change to them is in the current tree). The revision is checked out into a
temporary git worktree; each process imports one tree's ``python/`` folder, jits the calls,
warms them up and prints the median of ``--reps`` timed calls per case. The trees alternate,
process by process, ``--rounds`` times each, so that a slower stretch of a shared machine falls
on both; the report gives, per case, the median over rounds of each tree's medians, the
p20-p80 spread over rounds and the ratio after / before. The torch CPU paths are not timed:
their per-row sums were batch-invariant before that work (docs/design.md §2). Writes
``<out>/invariance-cost-<device>-<date>.{json,md}`` (default ``./bench-results``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import subprocess
import sys
import tempfile

from .cli import detect, device_slug
from .timing import _stats

ROOT = pathlib.Path(__file__).resolve().parent.parent

#: (name, N, K, dtype, chunk_size, temperature, teacher): the quick CPU grid's and the full
#: CPU grid's token-statistics shapes (bench/shapes.py: QUICK_CPU_SHAPES, CPU_SHAPES) at
#: T = 1; the largest at T = 0.7, alone and with a teacher (its KL: where every product a sum
#: takes is rounded on its own, JaxOps.rounded); then three calls the current tree pads to
#: min_block_rows(C) rows: 8 rows of a small vocabulary (to 64), and 64 rows in a user's
#: chunks of 256 columns (to 64) and of 16 (to 1024: a copy of 1024 x 4096 logits)
CASES = [
    ("N256-K2k", 256, 2048, "float32", None, 1.0, False),
    ("N256-K16k", 256, 16384, "float32", None, 1.0, False),
    ("N256-K16k-bf16", 256, 16384, "bfloat16", None, 1.0, False),
    ("N512-K4k", 512, 4096, "float32", None, 1.0, False),
    ("N512-K32k", 512, 32768, "float32", None, 1.0, False),
    ("N512-K32k-bf16", 512, 32768, "bfloat16", None, 1.0, False),
    ("N512-K32k-T0.7", 512, 32768, "float32", None, 0.7, False),
    ("N512-K32k-T0.7-teacher", 512, 32768, "float32", None, 0.7, True),
    ("N8-K256", 8, 256, "float32", None, 1.0, False),
    ("N64-K4k-chunk256", 64, 4096, "float32", 256, 1.0, False),
    ("N64-K4k-chunk16", 64, 4096, "float32", 16, 1.0, False),
]
MODES = ("fwd", "fwd+bwd")

# One process: time every case of one tree (argv: reps, JSON cases); prints a JSON
# {case/mode: median ms}. Inputs are drawn the same way in both trees.
_PROBE = r"""
import json, statistics, sys, time
import numpy as np
import jax, jax.numpy as jnp
import dlm_kernels.jax as D

reps, cases = int(sys.argv[1]), json.loads(sys.argv[2])
out = {"module": D.__file__}
for name, n, k, dtype, chunk, t, teacher in cases:
    rng = np.random.default_rng(0)
    z = jnp.asarray(rng.standard_normal((n, k)) * 4, dtype)
    y = jnp.asarray(rng.integers(0, k, n), jnp.int32)
    u = jnp.asarray(rng.standard_normal((n, k)), dtype) if teacher else None
    stats = lambda z: D.token_stats(z, y, teacher_logits=u, temperature=t, chunk_size=chunk,
                                    backend="chunked")
    fwd = jax.jit(lambda z: (lambda s: (s.logp, s.entropy, s.kl))(stats(z)))
    both = jax.jit(jax.value_and_grad(lambda z: (lambda s: s.logp.sum() + s.entropy.sum()
                                                 + s.kl.sum())(stats(z))))
    for mode, fn in (("fwd", fwd), ("fwd+bwd", both)):
        for _ in range(2):
            jax.block_until_ready(fn(z))
        times = []
        for _ in range(reps):
            t = time.perf_counter()
            jax.block_until_ready(fn(z))
            times.append((time.perf_counter() - t) * 1e3)
        out[f"{name}/{mode}"] = statistics.median(times)
print(json.dumps(out))
"""


def _run_tree(python_dir, reps, cases):
    env = {**os.environ, "PYTHONPATH": str(python_dir)}
    proc = subprocess.run([sys.executable, "-c", _PROBE, str(reps), json.dumps(cases)],
                          env=env, capture_output=True, text=True, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", required=True, help="the git revision to compare with")
    parser.add_argument("--rounds", type=int, default=4, help="processes per tree (default 4)")
    parser.add_argument("--reps", type=int, default=7, help="timed calls per case (default 7)")
    parser.add_argument("--out", default="bench-results", help="results folder")
    parser.add_argument("--cases", default=None,
                        help="comma-separated case names (default: all: " +
                             ", ".join(c[0] for c in CASES) + ")")
    args = parser.parse_args(argv)
    chosen = [c for c in CASES if args.cases is None or c[0] in args.cases.split(",")]
    if not chosen:
        parser.error(f"--cases names no case; the cases: {', '.join(c[0] for c in CASES)}")

    rev = subprocess.run(["git", "-C", str(ROOT), "rev-parse", args.before], check=True,
                         capture_output=True, text=True).stdout.strip()
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], check=True,
                          capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "python"],
                           check=True, capture_output=True, text=True).stdout.strip()
    if dirty:  # "after" is the working tree: say so
        head += "+uncommitted"
    cases = [list(c) for c in chosen]
    times = {"before": [], "after": []}
    with tempfile.TemporaryDirectory() as tmp:
        tree = pathlib.Path(tmp) / "before"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(tree), rev],
                       check=True, capture_output=True)
        try:
            trees = {"before": tree / "python", "after": ROOT / "python"}
            for r in range(args.rounds):
                for which in ("before", "after") if r % 2 == 0 else ("after", "before"):
                    got = _run_tree(trees[which], args.reps, cases)
                    assert got.pop("module").startswith(str(trees[which])), which
                    times[which].append(got)
                    print(f"round {r + 1}/{args.rounds} {which}: " + ", ".join(
                        f"{key} {ms:.2f}" for key, ms in got.items()), flush=True)
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)],
                           check=False, capture_output=True)

    rows = []
    for name, *_ in chosen:
        for mode in MODES:
            key = f"{name}/{mode}"
            b, a = (_stats([t[key] for t in times[which]]) for which in ("before", "after"))
            rows.append(dict(case=name, mode=mode, before_ms=b["ms"], before_p20=b["p20"],
                             before_p80=b["p80"], after_ms=a["ms"], after_p20=a["p20"],
                             after_p80=a["p80"], ratio=a["ms"] / b["ms"]))
    date = datetime.date.today().isoformat()
    device = detect()["device"]
    meta = dict(device=device, date=date, before=rev, after=head, rounds=args.rounds,
                reps=args.reps, load_average=os.getloadavg(),
                what="JAX chunked token_stats (logp and entropy), jitted; median ms of "
                     "each process's median over --reps calls, then the median over rounds")
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"invariance-cost-{device_slug(device)}-{date}"
    stem.with_suffix(".json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    lines = [f"# One row, one answer: cost on {device}, {date}", "",
             f"JAX chunked token statistics, jitted; before = {rev[:10]}, after = "
             f"{head[:10]}; {args.rounds} processes per tree, alternating; {args.reps} calls "
             f"each; load average at the end {os.getloadavg()[0]:.2f}.", "",
             "| case | mode | before ms (p20-p80) | after ms (p20-p80) | after / before |",
             "|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['case']} | {r['mode']} | {r['before_ms']:.2f} "
                     f"({r['before_p20']:.2f}-{r['before_p80']:.2f}) | {r['after_ms']:.2f} "
                     f"({r['after_p20']:.2f}-{r['after_p80']:.2f}) | {r['ratio']:.3f} |")
    total_b = sum(r["before_ms"] for r in rows)
    total_a = sum(r["after_ms"] for r in rows)
    lines += ["", f"All cases: {total_a:.1f} ms after against {total_b:.1f} ms before "
                  f"({total_a / total_b:.3f})."]
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"wrote {stem}.json and .md")


if __name__ == "__main__":
    main()
