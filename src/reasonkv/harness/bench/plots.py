"""The benchmark's figures: decode speed and K/V bytes against generated length."""

from __future__ import annotations

from pathlib import Path

from reasonkv.util.plotting import pyplot, save_figure


def plot_benchmark(record: dict, directory: str | Path) -> list[Path]:
    """tokens_per_second.png (per window, vs generated length) and kv_bytes.png (sampled K/V
    bytes vs generated length, marks dotted), one line per run."""
    plt = pyplot()
    import matplotlib.ticker

    directory = Path(directory)
    title = f"prompt {record['prompt_tokens']} tokens · {record.get('model', '')}".strip(" ·")

    fig, ax = plt.subplots(figsize=(7, 4))
    for r in record["runs"]:
        mid = [(w["start"] + w["end"]) / 2 for w in r["windows"]]
        ax.plot(mid, [w["tokens_per_second"] for w in r["windows"]], marker="o", ms=3, label=r["label"])
    ax.set_xlabel("generated tokens (window centre)")
    ax.set_ylabel("decode tokens/s")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(f"decode speed · {title}", fontsize=9)
    fig.tight_layout()
    speed = save_figure(fig, directory / "tokens_per_second.png", dpi=130)

    fig, ax = plt.subplots(figsize=(7, 4))
    for r in record["runs"]:
        s = r["samples"]
        ax.plot(s["tokens"], [b / 2**20 for b in s["kv_bytes"]], lw=1.2, label=r["label"])
    ax.set_xlabel("generated tokens")
    ax.set_ylabel("K/V storage (MiB)")
    ax.set_yscale("log")
    ax.yaxis.set_major_locator(matplotlib.ticker.LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    ax.yaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
    ax.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.grid(alpha=0.3, which="both")
    for length in record["lengths"]:
        ax.axvline(length, color="grey", lw=0.6, ls=":")
    ax.legend(fontsize=8)
    ax.set_title(f"physical K/V bytes · {title}", fontsize=9)
    fig.tight_layout()
    memory = save_figure(fig, directory / "kv_bytes.png", dpi=130)
    return [speed, memory]
