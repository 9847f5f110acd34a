"""The figures of `reasonkv analyze`: each takes plain tensors and a path, draws one PNG and
returns the path, so each can be drawn (and tested) on its own."""

from __future__ import annotations

from pathlib import Path

import torch

from reasonkv.harness.analyze.beacons import pca_2d, unit
from reasonkv.util.plotting import pyplot, save_figure

DPI = 110


def _bin_labels(edges: torch.Tensor) -> list[str]:
    labels = []
    for lo, hi in zip(edges[:-1].tolist(), edges[1:].tolist(), strict=True):
        labels.append(str(lo) if hi - lo == 1 else f"{lo}-{hi - 1}")
    return labels


# ------------------------------------------------------------------ figures
def plot_global_heatmap(
    share: torch.Tensor, path: str | Path, highlight: list[int] | None = None, title: str | None = None
) -> Path:
    """Heatmap of the share of global queries, share [L, H] (layers along x)."""
    plt = pyplot()
    n_layers, n_heads = share.shape
    fig, ax = plt.subplots(figsize=(max(6.0, 0.32 * n_layers + 2), 1.0 + 0.45 * n_heads + 0.8))
    pct = 100 * share  # the cells and the colour bar both in %
    im = ax.imshow(pct.T.numpy(), aspect="auto", cmap="viridis", vmin=0, vmax=max(5.0, float(pct.max())))
    if n_layers <= 48 and n_heads <= 16:
        for li in range(n_layers):
            for h in range(n_heads):
                v = float(pct[li, h])
                color = "white" if v < 0.6 * float(pct.max()) else "black"
                ax.text(li, h, f"{v:.0f}", ha="center", va="center", fontsize=6.5, color=color)
    ax.set_xticks(range(n_layers))
    ax.set_xticklabels([str(i) for i in range(n_layers)], fontsize=7)
    for tick in ax.get_xticklabels():
        if highlight and int(tick.get_text()) in highlight:
            tick.set_fontweight("bold")
            tick.set_color("crimson")
    ax.set_yticks(range(n_heads))
    ax.set_xlabel("layer (drawn layers in red)")
    ax.set_ylabel("KV head")
    fig.colorbar(im, ax=ax, label="global queries [% of eligible]", fraction=0.03, pad=0.01)
    ax.set_title(title or "global (thought-revisiting) queries per layer × KV head, % of eligible queries")
    fig.tight_layout()
    return save_figure(fig, path, dpi=DPI)


def plot_distance_histograms(
    local: torch.Tensor,
    glob: torch.Tensor,
    counts: torch.Tensor,
    edges: torch.Tensor,
    layers: list[int],
    distance: int,
    path: str | Path,
) -> Path:
    """Mean attention mass by distance bin of local vs global queries: local/glob [len(layers), H, B]
    (rows of the chosen layers), counts [len(layers), H, 2] (local, global queries)."""
    plt = pyplot()
    n_rows, n_heads, n_bins = local.shape
    fig, axes = plt.subplots(
        n_rows, n_heads, figsize=(3.3 * n_heads + 0.5, 2.4 * n_rows + 0.6), squeeze=False, sharex=True
    )
    x = torch.arange(n_bins).float()
    labels = _bin_labels(edges)
    d_bin = int(torch.bucketize(torch.tensor(distance), edges, right=True)) - 1
    for r, li in enumerate(layers):
        for h in range(n_heads):
            ax = axes[r][h]
            n_loc, n_glob = int(counts[r, h, 0]), int(counts[r, h, 1])
            ax.bar(x - 0.2, local[r, h].numpy(), width=0.4, color="tab:red", label=f"local ({n_loc})")
            ax.bar(x + 0.2, glob[r, h].numpy(), width=0.4, color="tab:blue", label=f"global ({n_glob})")
            ax.axvline(d_bin - 0.5, color="grey", ls="--", lw=0.8)
            ax.set_title(f"layer {li}, KV head {h}", fontsize=9)
            ax.legend(fontsize=7, loc="upper left")
            ax.grid(alpha=0.25, axis="y")
            if h == 0:
                ax.set_ylabel("attention mass")
    for ax in axes[-1]:
        ax.set_xticks(x.tolist())
        ax.set_xticklabels(labels, rotation=60, fontsize=7)
        ax.set_xlabel("distance query − key (tokens, log2 bins)")
    fig.suptitle(
        "where queries look: mean attention by distance (sinks and persistent keys aside); dashed: "
        f"D={distance}"
    )
    fig.tight_layout()
    return save_figure(fig, path, dpi=DPI)


def plot_attention_map(
    rows: torch.Tensor,
    positions: torch.Tensor,
    is_global: torch.Tensor,
    prompt_len: int,
    distance: int,
    path: str | Path,
    persistent: torch.Tensor | None = None,
    title: str | None = None,
) -> Path:
    """Attention of a window of queries rows [W, n] (positions [W]) over all keys, log colour
    scale; global queries (is_global [W]) marked on the right, the D boundary dashed, the
    prompt end dotted and persistent keys (bool [n]) ticked on top."""
    from matplotlib.colors import LogNorm

    plt = pyplot()
    w, n = rows.shape
    first, last = int(positions[0]), int(positions[-1])
    fig, ax = plt.subplots(figsize=(11, 5.2))
    data = rows.clamp(min=1e-5).numpy()
    im = ax.imshow(
        data,
        aspect="auto",
        cmap="magma",
        norm=LogNorm(vmin=1e-4, vmax=1.0),
        extent=(-0.5, n - 0.5, last + 0.5, first - 0.5),
        interpolation="nearest",
    )
    ax.plot(
        [first - distance, last - distance],
        [first, last],
        color="white",
        ls="--",
        lw=0.9,
        label=f"d = D = {distance}",
    )
    ax.axvline(prompt_len - 0.5, color="cyan", ls=":", lw=1.0, label="trace starts")
    glob_pos = positions[is_global]
    if glob_pos.numel():
        ax.scatter(
            [n + 0.012 * n] * glob_pos.numel(),
            glob_pos.numpy(),
            marker="<",
            s=14,
            color="limegreen",
            clip_on=False,
            label=f"global queries ({glob_pos.numel()})",
        )
    if persistent is not None and bool(persistent.any()):
        keys = persistent.nonzero().flatten()
        ax.scatter(
            keys.numpy(),
            [first - 0.5 - 0.02 * w] * keys.numel(),
            marker="v",
            s=28,
            color="dimgrey",
            clip_on=False,
            label="persistent keys (excluded)",
        )
    ax.set_xlim(-0.5, n - 0.5)
    ax.set_ylim(last + 0.5, first - 0.5)
    ax.set_xlabel("key position")
    ax.set_ylabel("query position")
    fig.colorbar(im, ax=ax, label="attention (group mean)", pad=0.04)
    ax.legend(fontsize=7, loc="lower left", framealpha=0.8)
    ax.set_title(title or "attention map")
    fig.tight_layout()
    return save_figure(fig, path, dpi=DPI)


def plot_pca(
    points: torch.Tensor,
    is_global: torch.Tensor,
    positions: torch.Tensor,
    beacons: torch.Tensor,
    path: str | Path,
    is_prompt: torch.Tensor | None = None,
    title: str | None = None,
) -> Path:
    """2-D PCA of pre-RoPE queries points [N, D] (unit-normalised: the cosine geometry of
    BeaconKV's FPS), global ones (is_global [N]) coloured, beacons [M, D] starred; the right
    panel colours the points by position [N] instead."""
    plt = pyplot()
    coords, mean, basis, explained = pca_2d(unit(points.float()))
    b = (unit(beacons.float()) - mean) @ basis if beacons.numel() else torch.zeros(0, 2)
    prompt = is_prompt if is_prompt is not None else torch.zeros_like(is_global)
    local = ~is_global & ~prompt
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(12, 5.2))
    ax.scatter(
        *coords[prompt].T.numpy(), s=6, color="tab:cyan", alpha=0.5, label=f"prompt ({int(prompt.sum())})"
    )
    ax.scatter(*coords[local].T.numpy(), s=6, color="0.6", alpha=0.5, label=f"local ({int(local.sum())})")
    ax.scatter(
        *coords[is_global].T.numpy(),
        s=10,
        color="tab:red",
        alpha=0.8,
        label=f"global ({int(is_global.sum())})",
    )
    sc = ax2.scatter(*coords.T.numpy(), s=6, c=positions.numpy(), cmap="viridis", alpha=0.7)
    fig.colorbar(sc, ax=ax2, label="query position")
    for a in (ax, ax2):
        if b.shape[0]:
            a.scatter(
                *b.T.numpy(),
                marker="*",
                s=160,
                color="gold",
                edgecolor="black",
                lw=0.8,
                label=f"beacons ({b.shape[0]})",
            )
        a.set_xlabel(f"PC1 ({100 * float(explained[0]):.0f}% var)")
        a.set_ylabel(f"PC2 ({100 * float(explained[1]):.0f}% var)")
        a.grid(alpha=0.2)
    ax.legend(fontsize=7, markerscale=1.5)
    ax.set_title("local / global queries")
    ax2.set_title("by position")
    fig.suptitle(title or "pre-RoPE queries (PCA)")
    fig.tight_layout()
    return save_figure(fig, path, dpi=DPI)


def plot_entropy(
    curve: torch.Tensor, profile: dict | None, path: str | Path, label: str = "this trace"
) -> Path:
    """This trace's per-layer normalised entropy against a profile's demand (± std across its traces)."""
    plt = pyplot()
    layers = list(range(curve.numel()))
    fig, ax = plt.subplots(figsize=(8, 3.8))
    if profile is not None:
        demand = torch.tensor(profile["demand"])
        std = torch.tensor(profile.get("demand_std", [0.0] * demand.numel()))
        ax.fill_between(
            layers, demand - std, demand + std, alpha=0.25, color="tab:blue", label="profile ±1 std"
        )
        ax.plot(
            layers,
            demand,
            marker="o",
            ms=3,
            color="tab:blue",
            label=f"profile ({len(profile.get('traces', []))} traces)",
        )
    ax.plot(layers, curve.numpy(), marker="s", ms=3, color="tab:red", label=label)
    ax.set_xlabel("layer")
    ax.set_ylabel("normalised attention entropy")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title("the Reasoning Wave: per-layer attention entropy")
    fig.tight_layout()
    return save_figure(fig, path, dpi=DPI)


def plot_missed(rows: list[dict], path: str | Path) -> Path:
    """Missed revisits per method: rows of {label, missed (TraceAnalysis.missed), mean_kl}."""
    plt = pyplot()
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(12, 4.2))
    labels = [r["label"] for r in rows]
    frac = [100 * r["missed"]["missed_fraction"] for r in rows]
    bars = ax.bar(range(len(rows)), frac, color="tab:purple")
    for bar, r in zip(bars, rows, strict=True):
        kl = r.get("mean_kl")
        text = f"{r['missed']['missed_keys']}/{r['missed']['needed_keys']}"
        text += f"\nKL {kl:.3f}" if kl is not None else ""
        text += f", {r['live']:.0f} live" if r.get("live") else ""
        ax.annotate(
            text, (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom", fontsize=8
        )
    ax.set_xticks(range(len(rows)))
    ax.set_xticklabels(labels, fontsize=8)
    ax.set_ylabel("needed far keys already evicted (%)")
    ax.set_ylim(0, max([*frac, 1.0]) * 1.3)
    ax.set_title("missed revisits (missed / needed keys; mean KL to full)")
    ax.grid(alpha=0.25, axis="y")
    for r in rows:
        ax2.plot(r["missed"]["per_layer"], marker="o", ms=3, label=r["label"])
    if rows:
        ax2.plot(rows[0]["missed"]["needed_per_layer"], color="0.5", ls="--", lw=1, label="needed")
    ax2.set_xlabel("layer")
    ax2.set_ylabel("missed needed keys")
    ax2.set_title("per layer")
    ax2.grid(alpha=0.25)
    ax2.legend(fontsize=7)
    fig.tight_layout()
    return save_figure(fig, path, dpi=DPI)
