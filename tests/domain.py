"""The user's domain as test axes: a pairwise covering design, inputs drawn per case, and
the float64 oracle's expectation for inputs that float32 cannot hold as given.

``pairwise(axes, rng)`` returns cases (one value per axis) in which every pair of values
of two different axes meets at least once: far fewer cases than the full product, a fresh
design per seed (``DLM_TEST_SEED`` replays one).
"""

from __future__ import annotations

import itertools

import numpy as np


def pairwise(axes, rng):
    """[{axis: value}] covering every pair of values of two axes (greedy, random order)."""
    names = list(axes)
    levels = [len(axes[n]) for n in names]
    uncovered = {(i, a, j, b) for i, j in itertools.combinations(range(len(names)), 2)
                 for a in range(levels[i]) for b in range(levels[j])}
    cases = []
    while uncovered:
        pairs = sorted(uncovered)
        i, a, j, b = pairs[rng.integers(len(pairs))]
        chosen = {i: a, j: b}
        for k in rng.permutation(len(names)):
            if k in chosen:
                continue
            gain = [sum((min(k, m), v if k < m else w, max(k, m), w if k < m else v)
                        in uncovered for m, w in chosen.items()) for v in range(levels[k])]
            best = np.flatnonzero(np.array(gain) == max(gain))
            chosen[int(k)] = int(rng.choice(best))
        for (k, v), (m, w) in itertools.combinations(sorted(chosen.items()), 2):
            uncovered.discard((k, v, m, w))
        cases.append({names[k]: axes[names[k]][v] for k, v in chosen.items()})
    return cases


def case_id(case):
    return ",".join(f"{k}={v}" for k, v in case.items())
