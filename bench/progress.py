"""Progress of a benchmark run and its closing summary.

``Progress`` prints one line per finished case: a bar, case i of n, the time spent and an
estimate of the time left (the mean time per case so far, times the cases to go).
``summary`` condenses a run into one line per (framework, objective, backend): its
forward+backward time against the reference backend's and its peak memory against the
reference's, geometric means over the shapes both ran.
"""

from __future__ import annotations

import math
import sys
import time


def clock(seconds):
    """m:ss (h:mm:ss past an hour)."""
    seconds = int(round(seconds))
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


class Progress:
    def __init__(self, total, stream=None, width=24):
        self.total, self.done, self.width = total, 0, width
        self.stream = stream if stream is not None else sys.stdout
        self.started = time.monotonic()

    def step(self, what, result=""):
        """One case finished: print its line."""
        self.done += 1
        elapsed = time.monotonic() - self.started
        left = elapsed / self.done * max(self.total - self.done, 0)
        filled = min(self.width, self.width * self.done // max(self.total, 1))
        bar = "#" * filled + "-" * (self.width - filled)
        print(f"[{bar}] {self.done:>3}/{self.total} {clock(elapsed)} spent, ~{clock(left)} left"
              f" | {what}" + (f" | {result}" if result else ""), file=self.stream, flush=True)


def _geomean(values):
    values = [v for v in values if v and v > 0 and math.isfinite(v)]
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else None


def summary(results, baseline="reference"):
    """Lines of text: per (framework, objective, backend) other than the baseline, the
    forward+backward speedup over it and how many times less peak memory beyond the inputs,
    geometric means over the shapes where both have a number."""
    rows = [r for r in results if r.get("mode") == "fwd+bwd" and "ms" in r]
    index = {(r["framework"], r["objective"], r["shape"], r["backend"]): r for r in rows}
    keys = sorted({(r["framework"], r["objective"], r["backend"]) for r in rows
                   if r["backend"] != baseline}, key=lambda k: (k[0], k[1], k[2]))
    lines = [f"Summary (forward+backward, vs the {baseline} backend; geometric mean over "
             f"shapes):",
             f"  {'framework':9s} {'objective':9s} {'backend':18s} {'speedup':>8s} "
             f"{'memory':>14s}  shapes"]
    for fw, obj, backend in keys:
        speed, memory, shapes = [], [], []
        for (f, o, shape, b), r in index.items():
            base = index.get((f, o, shape, baseline))
            if (f, o, b) != (fw, obj, backend) or base is None:
                continue
            shapes.append(shape)
            speed.append(base["ms"] / r["ms"] if r["ms"] > 0 else None)
            if base.get("peak_bytes") and r.get("peak_bytes"):
                memory.append(base["peak_bytes"] / r["peak_bytes"])
        s, m = _geomean(speed), _geomean(memory)
        mem = "-" if not m else (f"{m:.1f}x less" if m >= 1 else f"{1 / m:.1f}x more")
        lines.append(f"  {fw:9s} {obj:9s} {backend:18s} {(f'{s:.2f}x' if s else '-'):>8s} "
                     f"{mem:>14s}  {len(shapes)}")
    return lines
