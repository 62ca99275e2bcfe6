"""The benchmark's picture: ``plot`` renders a run's results to a PNG.

One row per objective and N: forward+backward time against K (log scales), one panel per
framework, then peak memory beyond the inputs, one panel per framework, then the row's legend
in a column of its own (never over the data). A series is one backend and dtype; its colour
and its marker each say which, the same in every panel and every run (``series_style``).
Then a row of bars for the linear head's variants and one for the denoising step's, each bar
with its value at its end, ours dark and the peers light.
"""

from __future__ import annotations

from . import shapes

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


def _bars(ax, labels: list[str], values: list, unit: str, colours: list[str]) -> None:
    """Horizontal bars, the first label on top, each with its value (or n/a) at its end."""
    known = [v for v in values if v is not None]
    bars = ax.barh(labels, [v or 0.0 for v in values], color=colours)
    ax.bar_label(bars, labels=[f"{_value(v)} {unit}" if v is not None else "n/a"
                               for v in values], padding=3, fontsize=7)
    ax.set_xlim(0, 1.22 * max(known) if known and max(known) > 0 else 1)
    ax.invert_yaxis()
    ax.tick_params(axis="y", labelsize=7)
    ax.grid(alpha=0.3, axis="x")


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
    n_fw = max(len(frameworks), 1)
    legend = [0.6] if line_rows else []  # the legends' column
    fig = plt.figure(figsize=(4.3 * 2 * n_fw + 4.3 * sum(legend), 3.4 * n_rows + 0.5),
                     layout="constrained")
    grid = fig.add_gridspec(n_rows, 2 * n_fw + len(legend), width_ratios=[1] * (2 * n_fw) + legend)
    style = series_style({(r["backend"], r["dtype"]) for r in rows})
    plain = FuncFormatter(lambda v, _: f"{v:g}")
    # minor ticks of a log axis: label 2 and 5 of each decade only
    sparse = FuncFormatter(lambda v, _: f"{v:g}" if f"{v:e}"[0] in "25" else "")
    for i, (obj, n) in enumerate(line_rows):
        mine = [r for r in rows if r["objective"] == obj and r["n"] == n]
        ks = sorted({r["k"] for r in mine})
        time_axes = [fig.add_subplot(grid[i, j]) for j in range(n_fw)]
        ms = [r["ms"] for r in mine if r["ms"] > 0]
        keys = set()
        for j, fw in enumerate(frameworks):
            ax_t, ax_m = time_axes[j], fig.add_subplot(grid[i, n_fw + j])
            own = [r for r in mine if r["framework"] == fw]
            unit, unit_bytes = _memory_unit(own)
            for key in sorted({(r["backend"], r["dtype"]) for r in own}, key=_series_order):
                keys.add(key)
                pts = sorted((r["k"], r["ms"], r["peak_bytes"]) for r in own
                             if (r["backend"], r["dtype"]) == key)
                colour, marker = style[key]
                look = dict(color=colour, marker=marker, markersize=_size(marker),
                            linestyle="-" if key[1] == "float32" else "--", label=" ".join(key))
                ax_t.plot([p[0] for p in pts], [p[1] for p in pts], **look)
                mem = [(p[0], p[2] / unit_bytes) for p in pts if p[2] is not None]
                if mem:
                    ax_m.plot(*zip(*mem), **look)
            ax_t.set_title(f"{obj}, {fw}: fwd+bwd time, N = {n}", fontsize=10)
            ax_m.set_title(f"{obj}, {fw}: peak memory beyond inputs", fontsize=10)
            if not own:
                for ax in (ax_t, ax_m):
                    ax.text(0.5, 0.5, "not timed", ha="center", va="center",
                            transform=ax.transAxes, color="0.4")
                    ax.tick_params(labelbottom=False, labelleft=False, length=0)
                continue
            for ax in (ax_t, ax_m):
                ax.set_xscale("log", base=2)
                ax.set_xticks(ks, [_k_label(k) for k in ks])
                ax.minorticks_off()
                ax.set_xlabel("vocabulary K")
                ax.grid(alpha=0.3)
            ax_t.set_yscale("log")
            if ms:  # the same time scale in each framework's panel of the row
                ax_t.set_ylim(min(ms) / 1.3, max(ms) * 1.3)
            ax_t.yaxis.set_major_formatter(plain)
            ax_t.yaxis.set_minor_formatter(sparse)
            ax_t.tick_params(axis="y", which="both", labelsize=7)
            ax_m.set_ylim(bottom=0)
            ax_m.set_ylabel(_memory_label(own), fontsize=8)
        time_axes[0].set_ylabel("ms (median, log scale)")
        legend_ax = fig.add_subplot(grid[i, -1])
        legend_ax.axis("off")
        handles = [Line2D([], [], color=style[key][0], marker=style[key][1],
                          markersize=_size(style[key][1]),
                          linestyle="-" if key[1] == "float32" else "--", label=" ".join(key))
                   for key in sorted(keys, key=_series_order)]
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
    for i, (t_title, m_title, labels, ours, bars) in enumerate(extra, start=len(line_rows)):
        ax_t = fig.add_subplot(grid[i, :n_fw])
        ax_m = fig.add_subplot(grid[i, n_fw:2 * n_fw])
        _bars(ax_t, labels, [r["ms"] for r in bars], "ms",
              ["tab:blue" if o else _lighter("tab:blue", 0.55) for o in ours])
        ax_t.set_xlabel("ms (median; ours dark)")
        ax_t.set_title(t_title, fontsize=10)
        _bars(ax_m, labels, [r["peak_bytes"] / 2**20 if r.get("peak_bytes") is not None
                             else None for r in bars], "MiB",
              ["tab:orange" if o else _lighter("tab:orange", 0.55) for o in ours])
        ax_m.set_xlabel("MiB (ours dark)")
        ax_m.set_title(m_title, fontsize=10)
    if env is not None:
        fig.suptitle(f"dlm-kernels benchmark: {env['device']}, {env['date'][:10]}")
    return fig


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
