"""Progress of a benchmark run and its closing summary.

``Progress`` prints one line per finished case: a bar, case i of n, the time spent and an
estimate of the time left (the mean time per case so far, times the cases to go).
``summary`` condenses a run: per objective, each backend of ours against the peers a user
would run instead, forward+backward time and peak memory beyond the inputs, geometric means
over the shapes both ran. A speed claim ("1.3x faster than torch.compile
(upstream+compile) at all 6 shapes") only where the p20-p80 spreads of the two, timed side
by side rep by rep, are apart at every shape; what is within noise is said so, after what
was measured apart. Then the machine's load before and after the run.
"""

from __future__ import annotations

import math
import sys
import time
from typing import NamedTuple, Optional


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
    """A time ratio in words: base / ours = 1.9 -> "1.9x faster", 0.37 -> "2.7x slower"; "n/a"
    where either time is 0 (a backward derived as fwd+bwd minus fwd can be) or the ratio is
    not finite."""
    if not (speedup > 0 and math.isfinite(speedup)):
        return "n/a"
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


def spread_verdict(ours, peer):
    """"faster", "slower" or "within noise": ours against a peer from the p20-p80 spreads of
    their times (rows of one shape and mode), a speed claim only where the spreads do not
    overlap; None where either has no spread (a derived time)."""
    if any(r.get("p20") is None or r.get("p80") is None for r in (ours, peer)):
        return None
    if ours["p80"] < peer["p20"]:
        return "faster"
    if ours["p20"] > peer["p80"]:
        return "slower"
    return "within noise"


def ratio_band(ours, peer):
    """(median, low, high) of ours / peer time: the medians' ratio and the bounds the p20-p80
    spreads allow (ours p20 / peer p80 to ours p80 / peer p20; the band holds 1 exactly where
    ``spread_verdict`` says "within noise"); the bounds None without spreads."""
    mid = ours["ms"] / peer["ms"] if peer["ms"] > 0 else None
    if spread_verdict(ours, peer) is None or not peer["p20"] > 0:
        return mid, None, None
    return mid, ours["p20"] / peer["p80"], ours["p80"] / peer["p20"]


class Comparison(NamedTuple):
    """Ours against one peer over the shapes both timed (forward+backward)."""

    peer: str
    speed: float  # geometric mean of peer / ours time
    memory: Optional[float]  # geometric mean of ours / peer peak memory
    verdicts: dict  # {"faster" | "slower" | "within noise": [peer / ours time, a shape each]}

    @property
    def shapes(self) -> int:
        return sum(len(v) for v in self.verdicts.values())

    @property
    def settled(self) -> Optional[str]:
        """"faster" or "slower" where every shape's spreads say so, else None."""
        found = [v for v, speeds in self.verdicts.items() if speeds]
        return found[0] if found in (["faster"], ["slower"]) else None


def _peer_name(fw, peer):
    return _PEER_WORDS.get((fw, peer), peer)


def _settled_words(fw, c: Comparison) -> str:
    """"1.3x faster than torch.compile (upstream+compile) at all 6 shapes, 1/9 of its memory"."""
    where = "at the one shape" if c.shapes == 1 else f"at all {c.shapes} shapes"
    return (f"{ratio_words(c.speed)} than {_peer_name(fw, c.peer)} {where}"
            + (f", {_memory_words(c.memory)}" if c.memory else ""))


def _unsettled_words(fw, c: Comparison) -> str:
    """"vs eager PyTorch (upstream): within noise at 4 of 6 shapes, 1.2x slower at 2"."""
    parts = []
    for verdict in ("within noise", "faster", "slower"):
        speeds = c.verdicts.get(verdict, [])
        if not speeds:
            continue
        count = f"{len(speeds)} of {c.shapes} shapes" if not parts else f"{len(speeds)}"
        parts.append(f"within noise at {count}" if verdict == "within noise"
                     else f"{ratio_words(_geomean(speeds))} at {count}")
    return (f"vs {_peer_name(fw, c.peer)}: {', '.join(parts)}"
            + (f"; {_memory_words(c.memory)}" if c.memory else ""))


def load_line(load):
    """The machine's load in words, from dict(before=, after=, cores=) (os.getloadavg's 1,
    5 and 15 minute averages), with a warning where other work ran beside the benchmark."""
    if not load or load.get("before") is None:
        return "Machine load: unknown (no os.getloadavg here)"
    before, after, cores = load["before"], load.get("after"), load.get("cores") or 1
    line = (f"Machine load (1-minute average): {before[0]:.2f} before the run"
            + (f", {after[0]:.2f} after it" if after else "") + f", {cores} cores")
    if before[0] >= 0.5 * cores:
        line += (" -- other work was running: the spreads overlap more and the medians "
                 "move; re-run on a quiet machine for verdicts")
    return line


def comparisons(results, peers=("reference", "reference+compile", "upstream",
                                "upstream+compile", "liger"), oracle="reference"):
    """{(framework, objective, backend of ours): [Comparison, the strongest peer first]},
    forward+backward, over the shapes both timed."""
    rows = [r for r in results if r.get("mode") == "fwd+bwd" and "ms" in r and r["ms"] > 0]
    index = {(r["framework"], r["objective"], r["shape"], r["backend"]): r for r in rows}
    objectives = sorted({r["objective"] for r in rows},
                        key=lambda o: (list(_OBJECTIVE_WORDS) + [o]).index(o))
    frameworks = sorted({r["framework"] for r in rows},
                        key=lambda f: (["torch", "jax", f]).index(f))
    out = {}
    for obj in objectives:
        for fw in frameworks:
            for backend in sorted({r["backend"] for r in rows if r["backend"] not in peers
                                   and (r["framework"], r["objective"]) == (fw, obj)}):
                found = [c for peer in peers if peer != oracle
                         for c in [_against(index, fw, obj, backend, peer)] if c]
                out[(fw, obj, backend)] = sorted(found, key=lambda c: c.speed)
    return out


def summary(results, peers=("reference", "reference+compile", "upstream", "upstream+compile",
                            "liger"), oracle="reference", load=None):
    """Lines of text, forward+backward, ours against what users run instead (every name in
    ``peers`` but ``oracle``, our own materialised parity backend), geometric means over the
    shapes both timed. A speed claim only where the p20-p80 spreads of the two (timed side
    by side, rep by rep) are apart at every shape (``spread_verdict``). First what was
    measured so ("CE fwd+bwd, torch chunked: 1.3x faster than torch.compile
    (upstream+compile) at all 6 shapes, 1/9 of its memory"), the strongest peer first; then
    what was not settled ("within noise at 4 of 6 shapes, ..."), to re-measure on a quiet
    machine; then the machine's load (``load``: dict(before=, after=, cores=))."""
    found = comparisons(results, peers, oracle)
    lead = ["Summary (forward+backward, ours against what users run instead, geometric mean "
            "over shapes; a speed claim only where the p20-p80 spreads of calls timed side "
            "by side are apart at every shape):"]
    unsettled = ["Not settled (the spreads overlap, or shapes disagree; re-measure on a quiet "
                 "machine):"]
    for (fw, obj, backend), comps in found.items():
        what = f"{_OBJECTIVE_WORDS.get(obj, obj)} fwd+bwd, {fw} {backend}"
        if not comps:
            lead.append(f"  {what}: no peer timed")
            continue
        sure = [_settled_words(fw, c) for c in comps if c.settled]
        if sure:
            lead.append(f"  {what}: " + "; ".join(sure))
        unsettled += [f"  {what} {_unsettled_words(fw, c)}" for c in comps if not c.settled]
    lines = lead + (unsettled if len(unsettled) > 1 else [])
    if load is not None:
        lines.append(load_line(load))
    return lines


def _ms(ms):
    return f"{ms:.0f}" if ms >= 100 else f"{ms:.1f}" if ms >= 10 else f"{ms:.2f}"


def _mib(nbytes):
    return f"{nbytes / 2**30:.1f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.0f} MiB"


def target_summary(results, peers=("reference", "reference+compile", "upstream",
                                   "upstream+compile", "liger"), oracle="reference"):
    """Lines of text for the --cpu-target grid: per objective, shape and dtype (a shape
    ending in -busy: beside the busy loop), each framework's backend of ours against its
    strongest peer per fwd+bwd ("torch chunked vs torch.compile: fwd 1.2x faster, bwd within
    noise, fwd+bwd 1.1x faster (640 vs 700 ms); memory beyond inputs 60 MiB vs 1.0 GiB,
    1/17 of its memory"), then the other peers' fwd+bwd ratios; a ratio only where the
    p20-p80 spreads are apart (``spread_verdict``), else "within noise"."""
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
                ratios = [f"{mode} {_verdict_words(mine, base)}"
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
                others = [f"{_verdict_words(ours, timed[(fw, obj, shape, b, 'fwd+bwd')])}"
                          f" {'of' if _within(ours, timed[(fw, obj, shape, b, 'fwd+bwd')]) else 'than'}"
                          f" {_PEER_WORDS.get((fw, b), b)}" for b in found[1:]]
                lines.append(f"    {fw} {backend} vs {_PEER_WORDS.get((fw, best), best)}: "
                             f"{', '.join(ratios)} ({_ms(ours['ms'])} vs {_ms(base_ms)} ms)"
                             + memory + (f"; fwd+bwd {'; '.join(others)}" if others else ""))
    return lines


def _verdict_words(ours, peer):
    """Ours against a peer at one shape and mode: "1.3x faster" where the p20-p80 spreads
    are apart, "within noise" where they overlap, "1.3x faster (derived)" without spreads."""
    verdict = spread_verdict(ours, peer)
    if verdict == "within noise":
        return verdict
    words = ratio_words(peer["ms"] / ours["ms"]) if ours["ms"] > 0 else "n/a"
    return words if verdict else f"{words} (derived)"


def _within(ours, peer):
    return spread_verdict(ours, peer) == "within noise"


def _against(index, fw, obj, backend, peer):
    """Ours against ``peer`` over the shapes where both have a time (a Comparison), or None
    where they share none."""
    speed, memory, verdicts = [], [], {}
    for (f, o, shape, b), r in index.items():
        base = index.get((f, o, shape, peer))
        if (f, o, b) != (fw, obj, backend) or base is None or not r["ms"] > 0:
            continue
        speed.append(base["ms"] / r["ms"])
        verdicts.setdefault(spread_verdict(r, base) or "within noise", []).append(speed[-1])
        if base.get("peak_bytes") and r.get("peak_bytes"):
            memory.append(r["peak_bytes"] / base["peak_bytes"])
    if not speed:
        return None
    return Comparison(peer, _geomean(speed), _geomean(memory), verdicts)
