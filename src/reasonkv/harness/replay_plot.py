"""The replay's figure: fidelity against trace position, one line per run."""

from __future__ import annotations

from pathlib import Path

from reasonkv.util.plotting import pyplot, save_figure


def plot_fidelity(summary: list[dict], path: str | Path, title: str | None = None) -> Path:
    """KL and top-1 agreement vs trace position, one line per (method, budget): `summary` is
    `replay.summarize`'s rows."""
    plt = pyplot()
    fig, (ax_kl, ax_top) = plt.subplots(1, 2, figsize=(11, 4))
    for row in summary:
        curve = [c for c in row["curve"] if c["positions"]]
        mid = [(c["start"] + c["end"]) / 2 for c in curve]
        ax_kl.plot(mid, [c["mean_kl"] for c in curve], marker="o", ms=3, label=row["label"])
        ax_top.plot(mid, [c["top1"] for c in curve], marker="o", ms=3, label=row["label"])
    ax_kl.set_ylabel("mean KL(full ‖ method) [nats]")
    ax_top.set_ylabel("top-1 agreement with full")
    for ax in (ax_kl, ax_top):
        ax.set_xlabel("position in the trace (tokens)")
        ax.grid(alpha=0.3)
    ax_kl.set_yscale("symlog", linthresh=1e-3)
    ax_top.legend(fontsize=7, ncol=2)
    fig.suptitle(title or "trace-replay fidelity")
    fig.tight_layout()
    return save_figure(fig, path, dpi=130)
