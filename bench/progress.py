"""Progress of a benchmark run and its closing summary.

``Progress`` prints one line per finished case: a bar, case i of n, the time spent and an
estimate of the time left (the mean time per case so far, times the cases to go).
``summary`` condenses a run: first, per objective, each backend of ours against the
strongest peer a user would run instead ("CE fwd+bwd, torch chunked: 1.3x faster than
torch.compile (upstream+compile), 1/9 of its memory (6 shapes)"), then against every peer;
forward+backward time and peak memory beyond the inputs, geometric means over the shapes
both ran.
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
    """Peak memory of ours relative to a peer's: 1/9 -> "1/9 of its memory", 0.4 -> "40% of
    its memory" (a fraction 1/n only from 1/4 down, where rounding n misstates it by at most
    an eighth), 2.5 -> "2.5x its memory"."""
    if ratio <= 0.25:
        return f"1/{1 / ratio:.0f} of its memory"
    if ratio < 0.95:
        return f"{100 * ratio:.0f}% of its memory"
    if ratio <= 1.05:
        return "the same memory"
    return f"{ratio:.1f}x its memory" if ratio < 10 else f"{ratio:.0f}x its memory"


#: the peers in words, by framework (the backend names of the tables in brackets)
_PEER_WORDS = {("torch", "upstream"): "eager PyTorch (upstream)",
               ("torch", "upstream+compile"): "torch.compile (upstream+compile)",
               ("torch", "reference+compile"): "torch.compile of our reference "
                                               "(reference+compile)",
               ("torch", "liger"): "Liger (liger)",
               ("jax", "upstream"): "jax.jit (upstream)"}
_OBJECTIVE_WORDS = {"ce": "CE", "sft": "SFT", "policy": "Policy", "opd": "OPD"}


def summary(results, peers=("reference", "reference+compile", "upstream", "upstream+compile",
                            "liger"), oracle="reference"):
    """Lines of text, forward+backward, geometric means over the shapes both timed. First,
    per objective, framework and backend of ours, the comparison against the strongest
    (fastest) peer a user would run instead (every name in ``peers`` but ``oracle``, our own
    materialised parity backend): "CE fwd+bwd, torch chunked: 1.3x faster than torch.compile
    (upstream+compile), 1/9 of its memory (6 shapes)". Then one line per (framework,
    objective, backend) against every such peer, the strongest first."""
    rows = [r for r in results if r.get("mode") == "fwd+bwd" and "ms" in r]
    index = {(r["framework"], r["objective"], r["shape"], r["backend"]): r for r in rows}
    objectives = sorted({r["objective"] for r in rows},
                        key=lambda o: (list(_OBJECTIVE_WORDS) + [o]).index(o))
    frameworks = sorted({r["framework"] for r in rows},
                        key=lambda f: (["torch", "jax", f]).index(f))
    keys = [(fw, obj, backend) for obj in objectives for fw in frameworks
            for backend in sorted({r["backend"] for r in rows if r["backend"] not in peers
                                   and (r["framework"], r["objective"]) == (fw, obj)})]
    lead = ["Summary (forward+backward against the strongest peer users run instead; "
            "geometric mean over shapes):"]
    detail = ["Against every peer, the strongest first:"]
    for fw, obj, backend in keys:
        found = []  # (time ratio, words)
        for peer in peers:
            if peer == oracle:
                continue
            speed, memory, n = _against(index, fw, obj, backend, peer)
            if speed:
                words = (f"{ratio_words(speed)} than {_PEER_WORDS.get((fw, peer), peer)}"
                         + (f", {_memory_words(memory)}" if memory else "")
                         + f" ({n} shape{'s' * (n != 1)})")
                found.append((speed, words))
        found.sort()
        what = f"{_OBJECTIVE_WORDS.get(obj, obj)} fwd+bwd, {fw} {backend}"
        lead.append(f"  {what}: {found[0][1] if found else 'no peer timed'}")
        detail.append(f"  {fw:9s} {obj:9s} {backend:10s} "
                      + ("; ".join(w for _, w in found) if found else "no peer timed"))
    return lead + detail


def _ms(ms):
    return f"{ms:.0f}" if ms >= 100 else f"{ms:.1f}" if ms >= 10 else f"{ms:.2f}"


def _mib(nbytes):
    return f"{nbytes / 2**30:.1f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.0f} MiB"


def target_summary(results, peers=("reference", "reference+compile", "upstream",
                                   "upstream+compile", "liger"), oracle="reference"):
    """Lines of text for the --cpu-target grid: per objective, shape and dtype (a shape
    ending in -busy: beside the busy loop), each framework's backend of ours against its
    strongest peer per fwd+bwd ("torch chunked vs torch.compile: fwd 1.2x faster, bwd 1.1x
    slower, fwd+bwd 1.0x faster (640 vs 650 ms); memory beyond inputs 60 MiB vs 1.0 GiB,
    1/17 of its memory"), then the other peers' fwd+bwd ratios."""
    timed = {(r["framework"], r["objective"], r["shape"], r["backend"], r["mode"]): r
             for r in results if "ms" in r and r["ms"] > 0}
    shapes = []  # (objective, shape, n, k, dtype) in the order first timed
    for r in results:
        key = (r["objective"], r["shape"], r["n"], r["k"], r["dtype"])
        if key not in shapes:
            shapes.append(key)
    shapes.sort(key=lambda s: (list(_OBJECTIVE_WORDS) + [s[0]]).index(s[0]))
    lines = ["CPU target (ours against the strongest peer users run instead, median ms; "
             "memory beyond the inputs):"]
    for obj, shape, n, k, dtype in shapes:
        lines.append(f"  {_OBJECTIVE_WORDS.get(obj, obj)} N {n}, K {k}, {dtype}"
                     + (", beside a busy loop" if shape.endswith("-busy") else "") + ":")
        for fw in ("torch", "jax"):
            backends = sorted({b for (f, o, sh, b, m) in timed
                               if (f, o, sh) == (fw, obj, shape) and b not in peers})
            found = sorted({b for (f, o, sh, b, m) in timed if (f, o, sh) == (fw, obj, shape)
                            and b in peers and b != oracle and m == "fwd+bwd"},
                           key=lambda b: timed[(fw, obj, shape, b, "fwd+bwd")]["ms"])
            for backend in backends:
                ours = timed.get((fw, obj, shape, backend, "fwd+bwd"))
                if not found or ours is None:
                    lines.append(f"    {fw} {backend}: no peer timed")
                    continue
                best = found[0]
                ratios = [f"{mode} {ratio_words(base['ms'] / mine['ms'])}"
                          for mode in ("fwd", "bwd", "fwd+bwd")
                          for mine, base in [(timed.get((fw, obj, shape, backend, mode)),
                                              timed.get((fw, obj, shape, best, mode)))]
                          if mine and base]
                peak = timed[(fw, obj, shape, best, "fwd+bwd")].get("peak_bytes")
                memory = (f"; memory beyond inputs {_mib(ours['peak_bytes'])} vs {_mib(peak)}"
                          + (f", {_memory_words(ours['peak_bytes'] / peak)}"
                             if ours["peak_bytes"] else "")
                          if ours.get("peak_bytes") is not None and peak else "")
                base_ms = timed[(fw, obj, shape, best, "fwd+bwd")]["ms"]
                others = [f"{ratio_words(timed[(fw, obj, shape, b, 'fwd+bwd')]['ms'] / ours['ms'])}"
                          f" than {_PEER_WORDS.get((fw, b), b)}" for b in found[1:]]
                lines.append(f"    {fw} {backend} vs {_PEER_WORDS.get((fw, best), best)}: "
                             f"{', '.join(ratios)} ({_ms(ours['ms'])} vs {_ms(base_ms)} ms)"
                             + memory + (f"; fwd+bwd {'; '.join(others)}" if others else ""))
    return lines


def _against(index, fw, obj, backend, peer):
    """(time ratio peer / ours, memory ratio ours / peer, shapes) over the shapes where both
    have a number."""
    speed, memory, n = [], [], 0
    for (f, o, shape, b), r in index.items():
        base = index.get((f, o, shape, peer))
        if (f, o, b) != (fw, obj, backend) or base is None or r["ms"] <= 0:
            continue
        n += 1
        speed.append(base["ms"] / r["ms"])
        if base.get("peak_bytes") and r.get("peak_bytes"):
            memory.append(r["peak_bytes"] / base["peak_bytes"])
    return _geomean(speed), _geomean(memory), n
