"""The figures of `reasonkv report`: a fixed look per method and the replay / eval panels.

Every registered method has its own colour and marker (`METHOD_STYLES`, tested to cover the
registry with no two alike), the same in every figure; our methods (BeaconKV and the
ReasonAlloc family) are drawn thicker. KL is drawn on log axes, where a KL of exactly 0 (the
full cache, a method that never evicted) cannot sit: such points are marked hollow on the
bottom edge and the caption names them.
"""

from __future__ import annotations

import math
from pathlib import Path

from reasonkv.core.models import model_note
from reasonkv.util.plotting import pyplot, save_figure

# ----------------------------------------------------------------------- styles
METHOD_STYLES: dict[str, dict] = {
    # the reference
    "full": {"color": "#000000", "marker": "*"},
    # others' methods: warm colours and greys, thin lines
    "streaming": {"color": "#7f7f7f", "marker": "v"},
    "tova": {"color": "#bcbd22", "marker": "<"},
    "snapkv": {"color": "#ff7f0e", "marker": "s"},
    "h2o": {"color": "#8c564b", "marker": "^"},
    "rkv": {"color": "#d62728", "marker": "D"},
    "rpc": {"color": "#17becf", "marker": "P"},
    "recent-query": {"color": "#2ca02c", "marker": "o"},
    "initial-recent": {"color": "#98df8a", "marker": "d"},
    "random": {"color": "#e377c2", "marker": "X"},
    "pyramidkv": {"color": "#ffbb78", "marker": "h"},
    "pyramid-rkv": {"color": "#ff9896", "marker": "h"},
    "adakv-snapkv": {"color": "#e6ab02", "marker": ">"},
    "adakv-rkv": {"color": "#7f0000", "marker": ">"},
    # quantization only (no eviction): greys to blacks by precision
    "quant-int8": {"color": "#525252", "marker": "1"},
    "quant-int4": {"color": "#969696", "marker": "2"},
    "quant-int2": {"color": "#bdbdbd", "marker": "3"},
    # ours: blues, teals and purples, thick lines
    "beaconkv": {"color": "#1f77b4", "marker": "o"},
    "reasonalloc-beaconkv": {"color": "#4eb3d3", "marker": "s"},
    "beaconkv-all-queries": {"color": "#9ecae1", "marker": "*"},  # its ablation
    "reasonalloc-rkv": {"color": "#08306b", "marker": "D"},
    "reasonalloc-snapkv": {"color": "#6a3d9a", "marker": "p"},
    "reasonalloc-layer-rkv": {"color": "#00897b", "marker": "^"},
    "reasonalloc-head-rkv": {"color": "#3949ab", "marker": "v"},
}
_SPARE_COLOURS = ("#9467bd", "#bc80bd", "#636363", "#fdb462", "#b3de69", "#80b1d3", "#fb8072", "#ccebc5")
_LINE_STYLES = ("-", "--", ":", "-.")


def is_ours(method: str) -> bool:
    return method == "beaconkv" or method.startswith("reasonalloc-")


def method_styles(names: list[str], methods: dict[str, str] | None = None) -> dict[str, dict]:
    """Plot keyword arguments per line name: its method's fixed colour and marker (`methods` maps
    a name such as "snapkv[interval=8]" to its method; by default the name is the method), a
    new dash pattern for each further knob setting of one method, spare colours with dashes for
    methods the map does not know. Ours are thicker with bigger markers."""
    methods = methods or {}
    out, seen, spare = {}, {}, 0
    for name in names:
        method = methods.get(name, name)
        if method in METHOD_STYLES:
            base = dict(METHOD_STYLES[method])
            k = seen.get(method, 0)
            seen[method] = k + 1
            base["ls"] = _LINE_STYLES[k % len(_LINE_STYLES)]
        else:
            base = {
                "color": _SPARE_COLOURS[spare % len(_SPARE_COLOURS)],
                "marker": "*",
                "ls": _LINE_STYLES[1 + spare // len(_SPARE_COLOURS) % 3],
            }
            spare += 1
        ours = is_ours(method)
        base.update({"lw": 2.6 if ours else 1.3, "ms": 7 if ours else 4.5, "zorder": 3 if ours else 2})
        out[name] = base
    return out


def _log2_ticks(ax, values: list[float], exact: bool = False) -> None:
    """A log2 x axis labelled with plain numbers: at `values` themselves when `exact` (the
    budgets), else at the powers of two they span (the values when that leaves under 3)."""
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator

    values = sorted({v for v in values if v and v > 0})
    if not values:
        return
    ax.set_xscale("log", base=2)
    ticks = values
    if not exact:
        lo, hi = math.floor(math.log2(values[0])), math.ceil(math.log2(values[-1]))
        powers = [2.0**k for k in range(lo, hi + 1) if values[0] / 1.05 <= 2.0**k <= values[-1] * 1.05]
        ticks = powers if len(powers) >= 3 else values
    ax.xaxis.set_major_locator(FixedLocator(ticks))
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:.3g}" if v < 10 else f"{v:.0f}"))
    ax.xaxis.set_minor_locator(NullLocator())


def _bottom_marks(ax, points: list[tuple[float, dict]]) -> None:
    """Hollow markers on the bottom edge: points whose y (a KL of 0) the log axis cannot show."""
    bottom = ax.get_ylim()[0]
    for x, style in points:
        ax.plot(
            [x],
            [bottom],
            marker=style["marker"],
            ms=style["ms"] + 2,
            mfc="none",
            mec=style["color"],
            mew=1.5,
            ls="none",
            clip_on=False,
            zorder=4,
        )


def _lines(ax, by_name: dict, style: dict, x_of, y_of, log_y: bool = False) -> list[str]:
    """One line per name through its (x, y) points; on a log y axis the points at y <= 0 are
    left out of the line and returned (as row labels) for `_bottom_marks`."""
    zeros, marks = [], []
    for name, rows in by_name.items():
        pts = [(x_of(r), y_of(r), r) for r in rows]
        pts = sorted((x, y, r) for x, y, r in pts if x is not None and y is not None)
        drawn = [(x, y) for x, y, _ in pts if y > 0 or not log_y]
        kw = {k: v for k, v in style[name].items()}
        if drawn:
            ax.plot([x for x, _ in drawn], [y for _, y in drawn], label=name, **kw)
        for x, y, r in pts:
            if log_y and y <= 0:
                zeros.append(r["label"])
                marks.append((x, style[name]))
    if log_y:
        from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

        ax.set_yscale("log")
        ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        ax.yaxis.set_minor_formatter(NullFormatter())
        ax.autoscale_view()
        _bottom_marks(ax, marks)
    return zeros


# ----------------------------------------------------------------------- replay
REFERENCE_ORDER = ("snapkv", "recent-query", "streaming", "h2o", "rkv")


def _reference(by_name: dict[str, list[dict]]) -> str | None:
    """The method the relative panel divides by: the first of REFERENCE_ORDER present (a
    common baseline), else the first compressing method that is not ours."""
    names = [n for n, rows in by_name.items() if any(r["mean_kl"] for r in rows)]
    for ref in REFERENCE_ORDER:
        if ref in names:
            return ref
    others = [n for n in names if not is_ours(by_name[n][0]["method"])]
    return others[0] if others else None


def _relative_panel(ax, by_name, style, ref: str, limit: float = 60.0) -> None:
    """KL relative to `ref` at the same budget, in %: values beyond ±limit sit on the edge as
    hollow triangles with their value written beside them."""
    ref_kl = {r["budget"]: r["mean_kl"] for r in by_name[ref] if r["mean_kl"]}
    series = {}
    for name, rows in by_name.items():
        pts = [
            (r["budget"], 100 * (r["mean_kl"] / ref_kl[r["budget"]] - 1))
            for r in rows
            if r["budget"] in ref_kl and r["mean_kl"]
        ]
        if pts:
            series[name] = sorted(pts)
    values = [abs(v) for pts in series.values() for _, v in pts]
    lim = min(limit, max(5.0, 1.15 * max(values, default=5.0)))
    stacked: dict[tuple, int] = {}  # values past the edge at one budget, written one under another
    for name, pts in series.items():
        s = style[name]
        inside = [(x, v) for x, v in pts if abs(v) <= lim]
        if inside:
            ax.plot([x for x, _ in inside], [v for _, v in inside], label=name, **s)
        for x, v in pts:
            if abs(v) > lim:
                edge = math.copysign(lim, v)
                stacked[(x, edge)] = k = stacked.get((x, edge), -1) + 1
                ax.plot(
                    [x], [edge], marker="^" if v > 0 else "v", ms=8, mfc="none", mec=s["color"], ls="none"
                )
                ax.annotate(
                    f"{v:+.0f} %",
                    (x, edge),
                    textcoords="offset points",
                    xytext=(6, -3 - 9 * k * (1 if v > 0 else -1)),
                    fontsize=7,
                    color=s["color"],
                )
    ax.axhline(0, color="black", lw=0.8)
    ax.set_ylim(-lim * 1.05, lim * 1.05)
    ax.set_ylabel(f"KL relative to {ref} at the same budget [%]")
    ax.set_xlabel("budget (KV tokens per head)")
    _log2_ticks(ax, [x for pts in series.values() for x, _ in pts], exact=True)


def _memory_axis(rows: list[dict]) -> tuple:
    """The x of the memory panels: peak K/V bytes with unquantized values at 16 bits where every
    row has them (methods storing K/V at 8/4/2 bits then sit on one axis with the rest), else
    as run, else the budget (records from before peaks were measured)."""
    for key, label in (
        ("peak_kv_bytes_16bit", "peak K/V per sequence while decoding, unquantized values at 16 bits [MiB]"),
        ("peak_kv_bytes", "peak K/V per sequence while decoding [MiB]"),
    ):
        if rows and all(r.get(key) is not None for r in rows):
            return (lambda r, key=key: None if r.get(key) is None else r[key] / 2**20), label, True
    return (lambda r: r["budget"]), "budget (KV tokens per head)", False


def _replay_figure(plt, by_name, style, section) -> tuple:
    # Rows without a budget: the full cache (KL 0, a dashed line) and methods that keep every
    # token at lower precision (quant-int*: one point each, on the memory panels only).
    full = [r for rows in by_name.values() for r in rows if r["budget"] is None and not r["mean_kl"]]
    singles = {n: [r for r in rows if r["budget"] is None and r["mean_kl"]] for n, rows in by_name.items()}
    singles = {n: rows for n, rows in singles.items() if rows}
    compressing = [r for rows in by_name.values() for r in rows if r["budget"] is not None]
    x_mem, x_label, by_peak = _memory_axis(compressing + [r for rows in singles.values() for r in rows])
    if not by_peak:
        singles = {}
    lines = {n: [r for r in rows if r["budget"] is not None] for n, rows in by_name.items()}
    lines = {n: rows for n, rows in lines.items() if rows}
    ref = _reference(lines)
    drawn = {n: lines.get(n, []) + singles.get(n, []) for n in by_name if n in lines or n in singles}
    fig, axes = plt.subplots(2, 2, figsize=(12.5, 9.5))
    (ax_mem, ax_live), (ax_rel, ax_top) = axes
    zeros = _lines(ax_mem, drawn, style, x_mem, lambda r: r["mean_kl"], log_y=True)
    _lines(ax_live, drawn, style, lambda r: r["live_tokens"], lambda r: r["mean_kl"], log_y=True)
    _lines(ax_top, drawn, style, x_mem, lambda r: r["top1"])
    for ax, x_of in ((ax_mem, x_mem), (ax_live, lambda r: r["live_tokens"]), (ax_top, x_mem)):
        for r in full:
            if x_of(r) is not None:
                ax.axvline(x_of(r), ls="--", color="grey", lw=1, label=f"{r['name']} (KL 0)")
    for ax, x_of, exact in ((ax_mem, x_mem, not by_peak), (ax_live, lambda r: r["live_tokens"], False)):
        xs = [x_of(r) for rows in by_name.values() for r in rows]
        _log2_ticks(ax, [x for x in xs if x is not None], exact=exact)
    on_top = compressing + full + [r for rows in singles.values() for r in rows]
    _log2_ticks(ax_top, [x_mem(r) for r in on_top if x_mem(r) is not None], exact=not by_peak)
    ax_mem.set(xlabel=x_label, ylabel="mean KL(full ‖ method) [nats], log")
    ax_live.set(xlabel="live KV tokens per head (mean over positions)", ylabel="mean KL [nats], log")
    ax_top.set(xlabel=x_label, ylabel="top-1 agreement with full")
    if ref is not None:
        _relative_panel(ax_rel, lines, style, ref)
    else:
        ax_rel.set_axis_off()
    for ax in axes.flat:
        ax.grid(alpha=0.3, which="major")
    notes = [
        "Thick lines: our methods (beaconkv, reasonalloc-*). Dashed grey: the full cache (KL 0).",
    ]
    if singles:
        notes.append("Single points: methods that evict nothing and store every token at lower precision.")
    if zeros:
        notes.append(
            "KL of exactly 0 cannot sit on a log axis: hollow markers on the bottom edge ("
            + ", ".join(dict.fromkeys(zeros))
            + ")."
        )
    if ref is not None:
        notes.append(f"Lower left: each method's KL over {ref}'s at the same budget (not the same memory).")
    return fig, axes, " ".join(notes)


# ------------------------------------------------------------------------- eval
def wilson_interval(successes: float, n: int, z: float = 1.959964) -> tuple[float, float]:
    """The Wilson score interval of a proportion (95 % by default); (0, 1) when n is 0."""
    if n <= 0:
        return 0.0, 1.0
    p = successes / n
    den = 1 + z * z / n
    mid = (p + z * z / (2 * n)) / den
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / den
    return max(0.0, mid - half), min(1.0, mid + half)


def _eval_figure(plt, by_name, style, section) -> tuple:
    fig, (ax_acc, ax_len) = plt.subplots(1, 2, figsize=(12.5, 4.8))
    budgets = []
    compressing = [n for n, rows in by_name.items() if any(r["budget"] is not None for r in rows)]
    for name, rows in by_name.items():
        # Side by side at each budget, so that the error bars of one budget do not cover each other.
        dodge = (
            2 ** (0.025 * (compressing.index(name) - (len(compressing) - 1) / 2))
            if name in compressing
            else 1
        )
        pts = sorted(
            (r["budget"], r["pass@1"], r["samples"])
            for r in rows
            if r["budget"] is not None and r["pass@1"] is not None
        )
        if pts:
            budgets += [b for b, _, _ in pts]
            lo_hi = [wilson_interval(p * n, n) for _, p, n in pts]
            ax_acc.errorbar(
                [b * dodge for b, _, _ in pts],
                [p for _, p, _ in pts],
                yerr=[
                    [p - lo for (_, p, _), (lo, _) in zip(pts, lo_hi, strict=True)],
                    [hi - p for (_, p, _), (_, hi) in zip(pts, lo_hi, strict=True)],
                ],
                capsize=3,
                label=name,
                **style[name],
            )
        lengths = sorted(
            (r["budget"], r["mean_length"])
            for r in rows
            if r["budget"] is not None and r["mean_length"] is not None
        )
        if lengths:
            ax_len.plot([b for b, _ in lengths], [v for _, v in lengths], label=name, **style[name])
        for r in rows:
            if r["budget"] is None and r["pass@1"] is not None:
                lo, hi = wilson_interval(r["pass@1"] * r["samples"], r["samples"])
                ax_acc.axhline(r["pass@1"], ls="--", color="grey", lw=1, label=f"{r['name']} (no eviction)")
                ax_acc.axhspan(lo, hi, color="grey", alpha=0.12, lw=0)
                if r["mean_length"] is not None:
                    ax_len.axhline(r["mean_length"], ls="--", color="grey", lw=1)
    ax_acc.set_ylim(0, 1)
    for ax in (ax_acc, ax_len):
        _log2_ticks(ax, budgets, exact=True)
        ax.set_xlabel("budget (KV tokens per head)")
        ax.grid(alpha=0.3)
    ax_acc.set_ylabel("pass@1 (95 % Wilson interval)")
    ax_len.set_ylabel("mean generated length [tokens]")
    rows = [r for rs in by_name.values() for r in rs]
    sizes = sorted({(r["samples"] // max(1, r["problems"]), r["problems"]) for r in rows})
    if len(sizes) == 1:
        ((per, problems),) = sizes
        n_text = f"n = {per} samples × {problems} problems = {per * problems} per point"
    else:
        n_text = "n per point from {} to {} samples".format(
            min(r["samples"] for r in rows), max(r["samples"] for r in rows)
        )
    ax_acc.set_title(n_text, fontsize=9)
    caption = (
        f"Error bars: 95 % Wilson intervals over the samples ({n_text}; samples of one problem are "
        "counted as independent, so the bars are if anything too narrow). Grey band: the full cache's. "
        "Thick lines: our methods (beaconkv, reasonalloc-*)."
    )
    return fig, [ax_acc, ax_len], caption


# ----------------------------------------------------------------------- figure
LEGEND_COLUMNS = 5


def _drawn(section) -> dict[str, list[dict]]:
    by_name: dict[str, list[dict]] = {}
    for row in section.rows:
        if row["units"] > row["errors"]:
            by_name.setdefault(row["name"], []).append(row)
    return by_name


def plot_section(section, path: str | Path) -> tuple[Path, str]:
    """Replay: mean KL (log) against peak K/V bytes per sequence (the budget when the records
    predate peak bytes) and against the mean live tokens per head, KL relative to a baseline at
    the same budget, and top-1. Eval: pass@1 with 95 % intervals and mean length against the
    budget. One legend below the panels; returns the path and the caption (also drawn under
    the figure), which says what the axes cannot."""
    plt = pyplot()
    by_name = _drawn(section)
    style = method_styles(list(by_name), {n: rows[0]["method"] for n, rows in by_name.items()})
    build = _replay_figure if section.kind == "replay" else _eval_figure
    fig, axes, caption = build(plt, by_name, style, section)
    handles, labels = [], []
    for ax in axes if isinstance(axes, list) else axes.flat:
        for h, lab in zip(*ax.get_legend_handles_labels(), strict=True):
            if lab not in labels:
                handles.append(h)
                labels.append(lab)
    # The reference first, then others' methods, then ours.
    rank = {n: 0 if n not in by_name else 2 if is_ours(by_name[n][0]["method"]) else 1 for n in labels}
    order = sorted(range(len(labels)), key=lambda i: rank.get(labels[i], 0))
    handles, labels = [handles[i] for i in order], [labels[i] for i in order]
    legend_rows = math.ceil(len(labels) / LEGEND_COLUMNS)
    width, height = fig.get_size_inches()
    extra = 0.28 * legend_rows + 0.75
    fig.set_size_inches(width, height + extra)
    legend = fig.legend(
        handles,
        labels,
        loc="lower center",
        ncol=min(LEGEND_COLUMNS, len(labels)),
        fontsize=9,
        frameon=False,
        bbox_to_anchor=(0.5, 0.45 / (height + extra)),
    )
    for text in legend.get_texts():
        name = text.get_text()
        if name in by_name and is_ours(by_name[name][0]["method"]):
            text.set_fontweight("bold")
    fig.text(0.5, 0.01, caption, ha="center", va="bottom", fontsize=8, wrap=True, color="#333")
    note = model_note(section.model)
    fig.suptitle(section.title + (f"\n{note}" if note else ""), fontsize=12)
    fig.tight_layout(rect=(0, extra / (height + extra), 1, 1))
    return save_figure(fig, path, dpi=130), caption
