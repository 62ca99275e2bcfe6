"""Launch-plan sweep of the two streaming Triton kernels at one shape: the plan the heuristic
(``launch_config`` in kernels/triton/token_stats.py) picks, against its neighbours.

    python -m bench.launch_sweep                      # N = 16384, K = 262144, bfloat16
    python -m bench.launch_sweep --teacher --n 4096   # two logit streams (OPD)

For each (BLOCK_K, num_warps) it times, with CUDA events, the partial (forward) kernel, which
reads N·K·E bytes of logits (twice that with a teacher), and the gradient kernel, which reads
the same and writes N·K·E; it reports ms, GB/s of those bytes and their fraction of the copy
bandwidth measured in the same run, and marks the heuristic's plan. Writes
``<out>/launch-sweep-<device>-<date>.json``. Without a GPU it runs the Triton interpreter
(TRITON_INTERPRET=1) at whatever tiny shape it is given: a smoke test of the script only.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import re

from dlm_kernels._config import make_config
from dlm_kernels.token_stats.lowering import lower

from .timing import copy_bandwidth, measure

DTYPES = ("bfloat16", "float16", "float32")


def sweep(n, k, dtype, teacher, blocks, warps, reps, save=lambda report: None):
    """Time every plan; ``save(report)`` after each one (a timeout keeps what was measured)."""
    import torch

    from dlm_kernels.kernels.triton import token_stats as kernels
    from dlm_kernels._torch import triton as triton_plan
    from dlm_kernels.token_stats import torch_triton as triton_launch

    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    gen = torch.Generator(device).manual_seed(0)
    normal = lambda: (torch.randn(n, k, generator=gen, device=device) * 3).to(getattr(torch, dtype))
    z = normal()  # [N, K]
    u = normal() if teacher else None
    y = torch.randint(0, k, (n,), generator=gen, device=device)
    active = torch.ones(n, dtype=torch.int8, device=device)
    # CE (no entropy; with a teacher its KL beside), every temperature 1
    low = lower(make_config(has_teacher=teacher, entropy=False), has_shift=False)
    stats = torch.ops.dlm_kernels.token_stats_fwd(z, u, y, active, None, None, *low)
    grads = [torch.randn(n, generator=gen, device=device) for _ in range(4)]
    dz = torch.empty_like(z)
    elem, streams = z.element_size(), 2 if teacher else 1
    read = streams * n * k * elem  # bytes of logits each kernel reads
    copy_gbps, _ = copy_bandwidth(device, min(read, 1 << 30))
    chosen = triton_plan.plan(z, u)
    rows = []
    device_name = torch.cuda.get_device_name() if cuda else "cpu (Triton interpreter)"
    report = dict(device=device_name, date=_dt.date.today().isoformat(), n=n, k=k, dtype=dtype,
                  teacher=teacher, copy_gbps=copy_gbps, heuristic=chosen, rows=rows)
    for block_k in blocks:
        for num_warps in warps:
            cfg = dict(kernels.launch_config(k, elem, teacher, block_k),
                       num_warps=num_warps)
            row = dict(block_k=cfg["block_k"], num_warps=num_warps, splits=cfg["splits"],
                       heuristic=cfg == chosen)
            launches = {
                "partial": (read, lambda _: triton_launch.launch_partial(
                    z, u, None, None, active, low, launch=cfg)),
                "grad": (read + n * k * elem, lambda _: triton_launch.launch_grad(
                    z, u, y, active, None, None, stats, grads, dz, None, low, launch=cfg)),
            }
            for name, (nbytes, launch) in launches.items():
                try:
                    t = measure(launch, cuda=cuda, warmup=2, reps=reps, budget_s=10.0)
                except Exception as err:  # noqa: BLE001 - a plan the compiler rejects
                    row[name] = dict(error=f"{type(err).__name__}: {err}"[:300])
                    continue
                gbps = nbytes / (t["ms"] * 1e-3) / 1e9
                row[name] = dict(ms=t["ms"], p20=t["p20"], p80=t["p80"], bytes=nbytes,
                                 gbps=gbps, frac_copy=gbps / copy_gbps)
            rows.append(row)
            print(_line(row), flush=True)
            save(report)
    return report


def _line(row):
    cells = [f"BLOCK_K={row['block_k']:>6} warps={row['num_warps']:>2} S={row['splits']:>2}"]
    for name in ("partial", "grad"):
        r = row.get(name, {})
        cells.append(f"{name} {r['ms']:8.3f} ms {100 * r['frac_copy']:5.1f}% copy" if "ms" in r
                     else f"{name} {r.get('error', '?')[:40]}")
    return " | ".join(cells) + ("  <- heuristic" if row["heuristic"] else "")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=16384)
    p.add_argument("--k", type=int, default=262144)
    p.add_argument("--dtype", choices=DTYPES, default="bfloat16")
    p.add_argument("--teacher", action="store_true")
    p.add_argument("--blocks", default="2048,4096,8192,16384")
    p.add_argument("--warps", default="4,8,16")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    args = p.parse_args(argv)
    ints = lambda s: [int(v) for v in s.split(",") if v]
    os.makedirs(args.out, exist_ok=True)

    defaults = p.parse_args([])
    case = (args.n, args.k, args.dtype, args.teacher)
    tag = ("" if case == (defaults.n, defaults.k, defaults.dtype, defaults.teacher)  # the target
           else f"-n{args.n}-k{args.k}-{args.dtype}" + ("-teacher" if args.teacher else ""))

    def save(report):
        slug = re.sub(r"[^a-z0-9]+", "-", report["device"].lower()).strip("-")
        path = os.path.join(args.out, f"launch-sweep-{slug}-{report['date']}{tag}.json")
        with open(path, "w") as f:
            json.dump(report, f, indent=1)
        return path

    report = sweep(args.n, args.k, args.dtype, args.teacher, ints(args.blocks), ints(args.warps),
                   args.reps, save)
    print(f"copy bandwidth {report['copy_gbps']:.1f} GB/s; wrote {save(report)}")
    return report


if __name__ == "__main__":
    main()
