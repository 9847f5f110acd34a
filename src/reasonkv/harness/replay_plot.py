"""The replay's figure: fidelity against trace position, one line per run."""

from __future__ import annotations

import math
from pathlib import Path

from reasonkv.harness.report_plot import is_ours, method_styles, model_note
from reasonkv.util.plotting import pyplot, save_figure

BUDGET_STYLES = ("-", "--", ":", "-.", (0, (5, 1, 1, 1, 1, 1)), (0, (1, 3)))
LEGEND_COLUMNS = 6


def merge_short_tail(curve: list[dict], min_fraction: float = 0.5) -> list[dict]:
    """`curve` (bins of trace position with pooled means) with a last bin of under `min_fraction`
    of the previous bin's positions merged into that bin (a means weighted by positions): a
    tail of a few positions, where only the longest trace is left, is noise, not a trend."""
    curve = [c for c in curve if c["positions"]]
    if len(curve) < 2 or curve[-1]["positions"] >= min_fraction * curve[-2]["positions"]:
        return curve
    a, b = curve[-2], curve[-1]
    n = a["positions"] + b["positions"]
    merged = {**a, "end": b["end"], "positions": n}
    for key in ("mean_kl", "top1"):
        if a.get(key) is not None and b.get(key) is not None:
            merged[key] = (a[key] * a["positions"] + b[key] * b["positions"]) / n
    return curve[:-2] + [merged]


def default_title(summary: list[dict], model: str | None = None) -> str:
    """What was replayed: the model, how many traces and positions each run scored."""
    traces = max((row.get("traces", 0) for row in summary), default=0)
    positions = max((row.get("positions") or 0 for row in summary), default=0)
    head = " · ".join(
        x for x in ("trace-replay fidelity", model, f"{traces} traces, {positions:,} positions per run") if x
    )
    note = model_note(model) if model else None
    return head + (f"\n{note}" if note else "")


def plot_fidelity(
    summary: list[dict], path: str | Path, title: str | None = None, model: str | None = None
) -> Path:
    """KL and top-1 agreement vs trace position, one line per (method, budget): `summary` is
    `replay.summarize`'s rows. A method keeps one colour (report's fixed map), its budgets are
    dash patterns; a short last bin is merged into the one before it; the legend sits below."""
    from matplotlib.ticker import FuncFormatter

    plt = pyplot()
    methods = list(dict.fromkeys(row["method"] for row in summary))
    colour = method_styles(methods)
    budgets = sorted({row["budget"] for row in summary if row["budget"] is not None})
    fig, (ax_kl, ax_top) = plt.subplots(1, 2, figsize=(12, 4.6))
    zero_kl = False
    for row in summary:
        curve = merge_short_tail(row["curve"])
        mid = [(c["start"] + c["end"]) / 2 for c in curve]
        s = colour[row["method"]]
        ls = (
            "-" if row["budget"] is None else BUDGET_STYLES[budgets.index(row["budget"]) % len(BUDGET_STYLES)]
        )
        kw = {
            "color": s["color"],
            "marker": s["marker"],
            "ms": 3.5,
            "ls": ls,
            "lw": 2.2 if is_ours(row["method"]) else 1.2,
        }
        kl = [(x, c["mean_kl"]) for x, c in zip(mid, curve, strict=True) if c["mean_kl"]]
        zero_kl |= len(kl) < len(curve)
        ax_kl.plot([x for x, _ in kl], [y for _, y in kl], label=row["label"], **kw)
        ax_top.plot(mid, [c["top1"] for c in curve], label=row["label"], **kw)
    ax_kl.set_ylabel("mean KL(full ‖ method) [nats], log")
    ax_top.set_ylabel("top-1 agreement with full")
    for ax in (ax_kl, ax_top):
        ax.set_xlabel("position in the trace (tokens; bins pooled over traces)")
        ax.grid(alpha=0.3)
    ax_kl.set_yscale("log")
    ax_kl.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax_kl.yaxis.set_minor_formatter(FuncFormatter(lambda v, _: f"{v:g}" if str(f"{v:g}")[0] in "25" else ""))
    handles, labels = ax_top.get_legend_handles_labels()
    rows = math.ceil(len(labels) / LEGEND_COLUMNS)
    extra = 0.25 * rows + (0.3 if zero_kl else 0.1)
    fig.set_size_inches(12, 4.6 + extra)
    fig.legend(
        handles, labels, loc="lower center", ncol=min(LEGEND_COLUMNS, len(labels)), fontsize=8, frameon=False
    )
    if zero_kl:
        fig.text(
            0.99,
            0.99,
            "bins with KL 0 (nothing evicted yet) are left out of the log axis",
            ha="right",
            va="top",
            fontsize=7,
        )
    fig.suptitle(title or default_title(summary, model), fontsize=11)
    fig.tight_layout(rect=(0, extra / (4.6 + extra), 1, 0.97))
    return save_figure(fig, path, dpi=130)
