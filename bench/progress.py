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


def ratio_words(speedup):
    """A time ratio in words: base / ours = 1.9 -> "1.9x faster", 0.37 -> "2.7x slower"."""
    if speedup >= 1:
        return f"{speedup:.1f}x faster"
    return f"{1 / speedup:.1f}x slower"


def _memory_words(ratio):
    """Peak memory of ours relative to a peer's: 1/9 -> "1/9 of its memory"."""
    if ratio <= 1:
        return f"1/{1 / ratio:.0f} of its memory" if ratio < 0.95 else "the same memory"
    return f"{ratio:.1f}x its memory"


def summary(results, peers=("reference", "reference+compile", "upstream", "upstream+compile",
                            "liger"), oracle="reference"):
    """Lines of text: per (framework, objective, backend of ours), forward+backward against
    each peer a user would run instead (every name in ``peers`` but ``oracle``, our own
    materialised parity backend), the strongest (fastest) peer first: time ratio and peak
    memory beyond the inputs, geometric means over the shapes where both have a number."""
    rows = [r for r in results if r.get("mode") == "fwd+bwd" and "ms" in r]
    index = {(r["framework"], r["objective"], r["shape"], r["backend"]): r for r in rows}
    keys = sorted({(r["framework"], r["objective"], r["backend"]) for r in rows
                   if r["backend"] not in peers})
    lines = ["Summary (forward+backward against what users run instead, the strongest first; "
             "geometric mean over shapes):"]
    for fw, obj, backend in keys:
        found = []
        for peer in peers:
            if peer == oracle:
                continue
            speed, memory, shapes = [], [], []
            for (f, o, shape, b), r in index.items():
                base = index.get((f, o, shape, peer))
                if (f, o, b) != (fw, obj, backend) or base is None or r["ms"] <= 0:
                    continue
                shapes.append(shape)
                speed.append(base["ms"] / r["ms"])
                if base.get("peak_bytes") and r.get("peak_bytes"):
                    memory.append(r["peak_bytes"] / base["peak_bytes"])
            s, m = _geomean(speed), _geomean(memory)
            if s:
                words = f"{ratio_words(s)} than {peer}" + (f", {_memory_words(m)}" if m else "")
                found.append((s, f"{words} ({len(shapes)} shapes)"))
        text = "; ".join(w for _, w in sorted(found)) if found else "no peer timed"
        lines.append(f"  {fw:9s} {obj:9s} {backend:10s} {text}")
    return lines
