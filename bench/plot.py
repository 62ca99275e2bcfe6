"""The benchmark's picture: ``plot`` renders a run's results to a PNG.

One row per objective and N, per framework three panels against K: forward+backward time
(log scales, the median a line, the p20-p80 spread a band); ours / peer, the question "how
much faster and leaner than what I would use" (time: the medians' ratio with the band the
two spreads allow, which holds 1 where they overlap; peak memory dotted; a line at 1; log
scale); peak memory beyond the inputs (a log axis where one series dwarfs the rest). Then
the row's legend in a column of its own (never over the data), ours named "(ours)". No panel
without data: a framework that timed nothing in a row, or a memory that was not measured,
gets none. A series is one backend and dtype; its colour and its marker each say which, the
same in every panel and every run (``series_style``). Then a row of bars for the linear
head's variants and one for the denoising step's, each bar with its value at its end, ours
dark and the peers light, on a log axis where one bar dwarfs the rest.
"""

from __future__ import annotations

from typing import Optional

from . import shapes
from .progress import ratio_band

#: the backends that are not ours (bench/runner.py PEERS: our parity reference and the peers)
PEER_NAMES = ("reference", "reference+compile", "upstream", "upstream+compile", "liger")

#: each backend's hue (matplotlib's tab10), float32 at full strength, 16-bit dtypes lighter
_HUES = {"chunked": "tab:blue", "triton": "tab:green", "pallas": "tab:cyan",
         "reference": "tab:gray", "reference+compile": "tab:brown", "upstream": "tab:red",
         "upstream+compile": "tab:purple", "liger": "tab:orange"}
#: each backend's markers: (float32, bfloat16), no shape used twice
_MARKERS = {"chunked": ("o", "s"), "triton": ("^", "v"), "pallas": ("<", ">"),
            "reference": ("D", "d"), "reference+compile": ("p", "h"),
            "upstream": ("X", "P"), "upstream+compile": ("*", "8"), "liger": ("H", "x")}
_DTYPES = ("float32", "bfloat16")
#: for backends or dtypes outside the table: the colours and markers left over
_SPARE_COLOURS = ("tab:olive", "tab:pink", "black", "gold", "navy", "lime", "teal", "maroon")
_SPARE_MARKERS = ("1", "2", "3", "4", "+", "|", "_", ".")

#: what each framework's memory number is, by the ``peak_kind`` its rows carry
_MEMORY_KIND = (("VmHWM", "resident-set growth"), ("cuda", "allocator peak"),
                ("XLA", "XLA temporaries"))


def _lighter(colour: str, amount: float = 0.45) -> str:
    from matplotlib.colors import to_hex, to_rgb

    r, g, b = to_rgb(colour)
    return to_hex((r + (1 - r) * amount, g + (1 - g) * amount, b + (1 - b) * amount))


def series_style(keys) -> dict[tuple[str, str], tuple[str, str]]:
    """{(backend, dtype): (colour, marker)} for the series ``keys``: from the fixed table
    (the same in every panel and run), spares in order for pairs outside it; no colour and no
    marker twice."""
    from matplotlib.colors import to_hex

    style = {}
    for backend, dtype in keys:
        if backend in _HUES and dtype in _DTYPES:
            i = _DTYPES.index(dtype)
            colour = _HUES[backend] if i == 0 else _lighter(_HUES[backend])
            style[(backend, dtype)] = (to_hex(colour), _MARKERS[backend][i])
    taken_c = {c for c, _ in style.values()}
    taken_m = {m for _, m in style.values()}
    spare_c = [to_hex(c) for c in _SPARE_COLOURS if to_hex(c) not in taken_c]
    spare_m = [m for m in _SPARE_MARKERS if m not in taken_m]
    for key in sorted(set(keys) - set(style)):
        style[key] = (spare_c.pop(0), spare_m.pop(0))
    return style


def _size(marker: str) -> float:
    return 9.0 if marker == "*" else 6.0


def _k_label(k: int) -> str:
    return f"{k // 1024}k" if k >= 1024 and k % 1024 == 0 else str(k)


def _value(v: float) -> str:
    """A bar's number: three significant digits, no exponent."""
    return f"{v:.0f}" if v >= 100 else f"{v:.1f}" if v >= 10 else f"{v:.2f}"


def _memory_unit(rows: list[dict]) -> tuple[str, int]:
    """MiB, or GiB where a panel's peaks pass 4 GiB."""
    peaks = [r["peak_bytes"] for r in rows if r.get("peak_bytes") is not None]
    return ("GiB", 2**30) if peaks and max(peaks) > 4 * 2**30 else ("MiB", 2**20)


def _memory_label(rows: list[dict]) -> str:
    kinds = {r.get("peak_kind") or "" for r in rows}
    words = sorted({w for k in kinds for key, w in _MEMORY_KIND if key in k})
    return _memory_unit(rows)[0] + (f" ({', '.join(words)})" if words else "")


def _series_order(key: tuple[str, str]) -> tuple:
    """Ours first, then the peers; float32 before 16-bit."""
    backend, dtype = key
    order = list(_HUES)
    return (order.index(backend) if backend in order else len(order), backend,
            _DTYPES.index(dtype) if dtype in _DTYPES else len(_DTYPES), dtype)


#: a panel takes a log axis where its largest value passes this many times its smallest
DWARF = 20.0
#: which of our backends a ratio panel divides by the peers (the first one timed)
_OURS_ORDER = ("triton", "pallas", "chunked")


def _dwarfed(values) -> bool:
    """Whether one value dwarfs the rest: the largest over DWARF times the smallest (> 0)."""
    known = [v for v in values if v is not None and v > 0]
    return len(known) > 1 and max(known) > DWARF * min(known)


def _bars(ax, labels: list[str], values: list, unit: str, colours: list[str]) -> None:
    """Horizontal bars, the first label on top, each with its value (or n/a) at its end; a
    log axis where one bar dwarfs the rest."""
    from matplotlib.ticker import FuncFormatter

    known = [v for v in values if v is not None and v > 0]
    log = _dwarfed(known)
    floor = min(known) / 2 if log else 0.0
    bars = ax.barh(labels, [v - floor if v else 0.0 for v in values], left=floor,
                   color=colours)
    ax.bar_label(bars, labels=[f"{_value(v)} {unit}" if v is not None else "n/a"
                               for v in values], padding=3, fontsize=7)
    if log:
        ax.set_xscale("log")
        ax.set_xlim(floor, 2.5 * max(known))
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        ax.xaxis.set_minor_formatter(FuncFormatter(
            lambda v, _: f"{v:g}" if f"{v:e}"[0] in "25" else ""))
        ax.tick_params(axis="x", which="both", labelsize=7)
    else:
        ax.set_xlim(0, 1.22 * max(known) if known else 1)
    ax.invert_yaxis()
    ax.tick_params(axis="y", labelsize=7)
    ax.grid(alpha=0.3, axis="x")


def ours_of(backends) -> Optional[str]:
    """The backend of ours a ratio panel divides by the peers: the first of ``_OURS_ORDER``
    among ``backends`` (peers left out), else the first other in name order."""
    mine = sorted(b for b in backends if b not in PEER_NAMES)
    return next((b for b in _OURS_ORDER if b in mine), mine[0] if mine else None)


def ratios(rows: list[dict], ours: str) -> dict:
    """{(peer, dtype): [(k, time median, low, high, memory)]}: ours / peer forward+backward
    time (medians, and the band the p20-p80 spreads allow, ``progress.ratio_band``) and peak
    memory, a point per K both timed; our own parity reference left out."""
    index = {(r["backend"], r["dtype"], r["k"]): r for r in rows}
    out = {}
    for (backend, dtype, k), peer in sorted(index.items()):
        mine = index.get((ours, dtype, k))
        if backend not in PEER_NAMES or backend == "reference" or mine is None:
            continue
        mid, low, high = ratio_band(mine, peer)
        memory = (mine["peak_bytes"] / peer["peak_bytes"]
                  if mine.get("peak_bytes") and peer.get("peak_bytes") else None)
        out.setdefault((backend, dtype), []).append((k, mid, low, high, memory))
    return out


def _label(backend: str, dtype: str) -> str:
    """A series' legend label: "chunked (ours) float32", "upstream+compile bfloat16"."""
    return f"{backend}{'' if backend in PEER_NAMES else ' (ours)'} {dtype}"


def _row_panels(mine: list[dict], frameworks: list[str]) -> list[tuple[str, str]]:
    """The panels of one row, (framework, "time" | "ratio" | "memory"): each framework that
    timed something its time and ratio panels (the ratio where a peer was timed beside ours)
    and its memory panel where it has a number; no panel without data."""
    panels = []
    for fw in frameworks:
        own = [r for r in mine if r["framework"] == fw]
        if not own:
            continue
        panels.append((fw, "time"))
        ours = ours_of({r["backend"] for r in own})
        if ours and ratios(own, ours):
            panels.append((fw, "ratio"))
        if any(r.get("peak_bytes") for r in own):
            panels.append((fw, "memory"))
    return panels


def figure(results: list[dict], head: dict | None = None, env: dict | None = None,
           draw: dict | None = None):
    """The benchmark's figure (module docstring), or None when nothing was timed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.ticker import FuncFormatter

    # the lines: quiet runs only (a --cpu-target repeat beside the busy loop is in the tables)
    rows = [r for r in results if r["mode"] == "fwd+bwd" and "ms" in r and not r.get("busy")]
    line_rows = [(o, n) for o in shapes.OBJECTIVES
                 for n in sorted({r["n"] for r in rows if r["objective"] == o}, reverse=True)]
    frameworks = [f for f in ("torch", "jax") if any(r["framework"] == f for r in rows)]
    frameworks += sorted({r["framework"] for r in rows} - set(frameworks))
    head_rows = [r for r in (head or {}).get("results", [])
                 if r["mode"] == "fwd+bwd" and "ms" in r and not r.get("scaling")]
    draw_rows = [r for r in (draw or {}).get("results", []) if "ms" in r]
    n_rows = len(line_rows) + bool(head_rows) + bool(draw_rows)
    if not n_rows:
        return None
    panels = {key: _row_panels([r for r in rows if (r["objective"], r["n"]) == key], frameworks)
              for key in line_rows}
    n_cols = max([len(p) for p in panels.values()] + [2 if head_rows or draw_rows else 0])
    legend = [0.75] if line_rows else []  # the legends' column
    fig = plt.figure(figsize=(4.3 * n_cols + 4.3 * sum(legend), 3.4 * n_rows + 0.5),
                     layout="constrained")
    grid = fig.add_gridspec(n_rows, n_cols + len(legend), width_ratios=[1] * n_cols + legend)
    style = series_style({(r["backend"], r["dtype"]) for r in rows})
    plain = FuncFormatter(lambda v, _: f"{v:g}")
    # minor ticks of a log axis: label 2 and 5 of each decade only
    sparse = FuncFormatter(lambda v, _: f"{v:g}" if f"{v:e}"[0] in "25" else "")
    for i, (obj, n) in enumerate(line_rows):
        mine = [r for r in rows if r["objective"] == obj and r["n"] == n]
        ks = sorted({r["k"] for r in mine})
        ms = [v for r in mine for v in (r["ms"], r.get("p20"), r.get("p80")) if v and v > 0]
        keys, ratio_keys = set(), False
        for j, (fw, kind) in enumerate(panels[(obj, n)]):
            ax = fig.add_subplot(grid[i, j])
            own = [r for r in mine if r["framework"] == fw]
            if kind == "time":
                keys |= _time_panel(ax, own, style)
                ax.set_title(f"{obj}, {fw}: fwd+bwd time, N = {n}", fontsize=10)
                ax.set_ylabel("ms (median, p20-p80 band)", fontsize=8)
                if ms:  # the same time scale in each framework's panel of the row
                    ax.set_ylim(min(ms) / 1.3, max(ms) * 1.3)
            elif kind == "ratio":
                ours = ours_of({r["backend"] for r in own})
                _ratio_panel(ax, ratios(own, ours), style)
                ratio_keys = True
                ax.set_title(f"{obj}, {fw}: {ours} (ours) / peer", fontsize=10)
                ax.set_ylabel("ratio (below 1: ours faster, leaner)", fontsize=8)
            else:
                keys |= _memory_panel(ax, own, style)
                ax.set_title(f"{obj}, {fw}: peak memory beyond inputs", fontsize=10)
            ax.set_xscale("log", base=2)
            ax.set_xticks(ks, [_k_label(k) for k in ks])
            ax.minorticks_off()
            ax.set_xlabel("vocabulary K")
            ax.grid(alpha=0.3)
            if kind != "memory" or ax.get_yscale() == "log":
                ax.yaxis.set_major_formatter(plain)
                ax.yaxis.set_minor_formatter(sparse)
            ax.tick_params(axis="y", which="both", labelsize=7)
        legend_ax = fig.add_subplot(grid[i, -1])
        legend_ax.axis("off")
        handles = [Line2D([], [], color=style[key][0], marker=style[key][1],
                          markersize=_size(style[key][1]),
                          linestyle="-" if key[1] == "float32" else "--", label=_label(*key))
                   for key in sorted(keys, key=_series_order)]
        if ratio_keys:  # what the ratio panels' two kinds of line are
            handles += [Line2D([], [], color="0.3", marker="o", label="ratio: time (band: p20-p80)"),
                        Line2D([], [], color="0.3", marker="o", markerfacecolor="none",
                               linestyle=":", label="ratio: peak memory")]
        legend_ax.legend(handles=handles, loc="center left", fontsize=8, frameon=False,
                         title="backend, dtype", title_fontsize=8, borderaxespad=0)
    extra = []  # (time title, memory title, labels, ours or a peer, rows) of each bar row
    if head_rows:
        s = head["shape"]
        extra.append((f"linear head: N = {s['n']}, D = {s['d']}, K = {s['k']}, {s['dtype']}, "
                      "forward+backward", "linear head: peak beyond inputs and gradients",
                      [f"{r['framework']} {r['backend']}" for r in head_rows],
                      [r["backend"].startswith("ours") for r in head_rows], head_rows))
    if draw_rows:
        shape_of = lambda r: f"N = {r['n']}, K = {r['k']}, {r['dtype']}"  # noqa: E731
        one = len({shape_of(r) for r in draw_rows}) == 1  # the shape in the title, else per bar
        extra.append((f"denoising step{': ' + shape_of(draw_rows[0]) if one else ''}",
                      "denoising step: peak beyond the logits",
                      [r["variant"] if one else f"{r['variant']} ({shape_of(r)})"
                       for r in draw_rows],
                      [r["variant"].startswith("ours") for r in draw_rows], draw_rows))
    half = max(n_cols // 2, 1)
    for i, (t_title, m_title, labels, ours, bars) in enumerate(extra, start=len(line_rows)):
        ax_t = fig.add_subplot(grid[i, :half])
        _bars(ax_t, labels, [r["ms"] for r in bars], "ms",
              ["tab:blue" if o else _lighter("tab:blue", 0.55) for o in ours])
        ax_t.set_xlabel("ms (median; ours dark)" + (", log scale" if ax_t.get_xscale() == "log"
                                                     else ""))
        ax_t.set_title(t_title, fontsize=10)
        peaks = [r["peak_bytes"] / 2**20 if r.get("peak_bytes") is not None else None
                 for r in bars]
        if any(v is not None for v in peaks):  # no memory panel without a number
            ax_m = fig.add_subplot(grid[i, half:2 * half])
            _bars(ax_m, labels, peaks, "MiB",
                  ["tab:orange" if o else _lighter("tab:orange", 0.55) for o in ours])
            ax_m.set_xlabel("MiB (ours dark)" + (", log scale" if ax_m.get_xscale() == "log"
                                                  else ""))
            ax_m.set_title(m_title, fontsize=10)
    if env is not None:
        load = (env.get("load") or {}).get("before")
        fig.suptitle(f"dlm-kernels benchmark: {env['device']}, {env['date'][:10]}"
                     + (f" (load average {load[0]:.2f} at the start)" if load else ""))
    return fig


def _look(style, key) -> dict:
    colour, marker = style[key]
    return dict(color=colour, marker=marker, markersize=_size(marker),
                linestyle="-" if key[1] == "float32" else "--", label=_label(*key))


def _time_panel(ax, own: list[dict], style) -> set:
    """Each series' median time against K, its p20-p80 spread a band; log axes."""
    keys = set()
    for key in sorted({(r["backend"], r["dtype"]) for r in own}, key=_series_order):
        keys.add(key)
        pts = sorted((r["k"], r["ms"], r.get("p20"), r.get("p80")) for r in own
                     if (r["backend"], r["dtype"]) == key)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], **_look(style, key))
        band = [p for p in pts if p[2] is not None and p[3] is not None]
        if band:
            ax.fill_between([p[0] for p in band], [p[2] for p in band], [p[3] for p in band],
                            color=style[key][0], alpha=0.15, linewidth=0)
    ax.set_yscale("log")
    return keys


def _memory_panel(ax, own: list[dict], style) -> set:
    """Each series' peak memory against K: a log axis where one dwarfs the rest (points of
    0 bytes are then left out: the tables have them), else linear from 0."""
    keys = set()
    unit, unit_bytes = _memory_unit(own)
    log = _dwarfed([r.get("peak_bytes") for r in own])
    for key in sorted({(r["backend"], r["dtype"]) for r in own}, key=_series_order):
        pts = sorted((r["k"], r["peak_bytes"] / unit_bytes) for r in own
                     if (r["backend"], r["dtype"]) == key and r.get("peak_bytes") is not None
                     and (r["peak_bytes"] > 0 or not log))
        if pts:
            keys.add(key)
            ax.plot(*zip(*pts), **_look(style, key))
    if log:
        ax.set_yscale("log")
    else:
        ax.set_ylim(bottom=0)
    ax.set_ylabel(_memory_label(own) + (", log scale" if log else ""), fontsize=8)
    return keys


def _ratio_panel(ax, found: dict, style) -> None:
    """ours / peer against K: time (the medians' ratio, a band where the spreads allow) in
    each peer's colour and marker, memory dotted with hollow markers; a line at 1, log axis."""
    values = [1.0]
    for key in sorted(found, key=_series_order):
        colour, marker = style[key]
        pts = found[key]
        look = dict(color=colour, marker=marker, markersize=_size(marker))
        ax.plot([p[0] for p in pts], [p[1] for p in pts],
                linestyle="-" if key[1] == "float32" else "--", **look)
        band = [p for p in pts if p[2] is not None]
        if len(band) > 1:
            ax.fill_between([p[0] for p in band], [p[2] for p in band], [p[3] for p in band],
                            color=colour, alpha=0.15, linewidth=0)
        elif band:  # one K: the band as an error bar
            (k, mid, low, high, _), = band
            ax.errorbar([k], [mid], yerr=[[mid - low], [high - mid]], color=colour,
                        linewidth=1, capsize=3)
        memory = [(p[0], p[4]) for p in pts if p[4]]
        if memory:
            ax.plot(*zip(*memory), linestyle=":", markerfacecolor="none", **look)
        values += [v for p in pts for v in (p[1], p[2], p[3], p[4]) if v and v > 0]
    ax.axhline(1.0, color="0.2", linewidth=0.8, zorder=0)
    ax.set_yscale("log")
    ax.set_ylim(min(values) / 1.3, max(values) * 1.3)


def plot(results: list[dict], path: str, head: dict | None = None, env: dict | None = None,
         draw: dict | None = None) -> str | None:
    """Render ``figure(...)`` to ``path``; returns the path, or None when nothing was timed."""
    import matplotlib.pyplot as plt

    fig = figure(results, head, env, draw)
    if fig is None:
        return None
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
