"""Figures and the offline `index.html` of `reasonkv analyze` (see reasonkv.harness.analyze).

Every plot function takes plain tensors and a path and returns the path, so each can be
drawn (and tested) on its own; `write_report` draws them all from a TraceAnalysis and
writes index.html (relative PNG paths, inline CSS, no scripts) and summary.json.
"""

from __future__ import annotations

import html
import json
from pathlib import Path

import torch

from reasonkv.core.policy.scorers.beacon import BeaconKVScorer
from reasonkv.harness.analyze import TraceAnalysis, pca_2d, simulate_beacons, unit


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    _plt().close(fig)
    return path


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
    plt = _plt()
    n_layers, n_heads = share.shape
    fig, ax = plt.subplots(figsize=(max(6.0, 0.32 * n_layers + 2), 1.0 + 0.45 * n_heads + 0.8))
    im = ax.imshow(share.T.numpy(), aspect="auto", cmap="viridis", vmin=0, vmax=max(0.05, float(share.max())))
    if n_layers <= 48 and n_heads <= 16:
        for li in range(n_layers):
            for h in range(n_heads):
                v = float(share[li, h])
                color = "white" if v < 0.6 * float(share.max()) else "black"
                ax.text(li, h, f"{100 * v:.0f}", ha="center", va="center", fontsize=6.5, color=color)
    ax.set_xticks(range(n_layers))
    ax.set_xticklabels([str(i) for i in range(n_layers)], fontsize=7)
    for tick in ax.get_xticklabels():
        if highlight and int(tick.get_text()) in highlight:
            tick.set_fontweight("bold")
            tick.set_color("crimson")
    ax.set_yticks(range(n_heads))
    ax.set_xlabel("layer (drawn layers in red)")
    ax.set_ylabel("KV head")
    fig.colorbar(im, ax=ax, label="share of global queries", fraction=0.03, pad=0.01)
    ax.set_title(title or "global (thought-revisiting) queries per layer × KV head, % of eligible queries")
    fig.tight_layout()
    return _save(fig, path)


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
    plt = _plt()
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
    return _save(fig, path)


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

    plt = _plt()
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
            s=12,
            color="grey",
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
    return _save(fig, path)


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
    plt = _plt()
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
    return _save(fig, path)


def plot_entropy(
    curve: torch.Tensor, profile: dict | None, path: str | Path, label: str = "this trace"
) -> Path:
    """This trace's per-layer normalised entropy against a profile's demand (± std across its traces)."""
    plt = _plt()
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
    return _save(fig, path)


def plot_missed(rows: list[dict], path: str | Path) -> Path:
    """Missed revisits per method: rows of {label, missed (TraceAnalysis.missed), mean_kl}."""
    plt = _plt()
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
    return _save(fig, path)


# ------------------------------------------------------------------- text
def decode(tokenizer, ids: list[int]) -> str:
    """Text of token ids (tokenizers without `decode` go through batch_decode)."""
    if not ids:
        return ""
    if hasattr(tokenizer, "decode"):
        return tokenizer.decode(ids)
    return tokenizer.batch_decode([ids])[0]


def _snippet(tokenizer, ids: list[int], pos: int, before: int, after: int) -> dict:
    lo, hi = max(0, pos - before), min(len(ids), pos + 1 + after)
    return {
        "pos": pos,
        "left": decode(tokenizer, ids[lo:pos]),
        "token": decode(tokenizer, ids[pos : pos + 1]),
        "right": decode(tokenizer, ids[pos + 1 : hi]),
    }


def revisit_examples(
    analysis: TraceAnalysis, tokenizer, layer: int, head: int, top: int = 3, context: int = 6
) -> list[dict]:
    """The `top` global queries of (layer, head) with the largest far fraction (those in the
    map window first) and the text around each needed key they point back to."""
    glob = analysis.is_global[layer, head]
    if not bool(glob.any()):
        return []
    ff = analysis.far_frac[layer, head]
    in_window = analysis.positions >= int(analysis.map_positions[0])
    order = sorted(
        glob.nonzero().flatten().tolist(), key=lambda i: (not bool(in_window[i]), -float(ff[i]), i)
    )
    ids = analysis.input_ids.tolist()
    out = []
    for i in order[:top]:
        p = int(analysis.positions[i])
        keys = [
            {**_snippet(tokenizer, ids, int(k), context, context), "weight": float(w)}
            for k, w in zip(
                analysis.needed[layer, head, i].tolist(),
                analysis.needed_weight[layer, head, i].tolist(),
                strict=True,
            )
            if k >= 0
        ]
        out.append(
            {
                "query": _snippet(tokenizer, ids, p, 2 * context, 0),
                "far_fraction": float(ff[i]),
                "in_window": bool(in_window[i]),
                "needed": keys,
            }
        )
    return out


# ----------------------------------------------------------------- report
def _pairs(analysis: TraceAnalysis, heads: list[int] | None) -> list[tuple[int, int]]:
    share = analysis.global_fraction()
    pairs = []
    for li in analysis.layers:
        chosen = heads if heads is not None else [int(share[li].argmax())]
        pairs += [(li, h) for h in chosen]
    return pairs


def _pca_inputs(analysis: TraceAnalysis, layer: int, head: int) -> dict:
    g = analysis.group_size
    pre = analysis.pre_queries[layer][:, head * g : (head + 1) * g]  # [n, G, D]
    n = pre.shape[0]
    glob_q = torch.zeros(n, dtype=torch.bool)
    glob_q[analysis.positions] = analysis.is_global[layer, head]
    pos_q = torch.arange(n)
    defaults = BeaconKVScorer()
    beacons, source = simulate_beacons(pre, defaults.beacon_max, defaults.beacon_min, defaults.recent)
    src_pos = (source // g).tolist()
    return {
        "points": pre.reshape(n * g, -1),
        "is_global": glob_q.repeat_interleave(g),
        "positions": pos_q.repeat_interleave(g),
        "is_prompt": (pos_q < analysis.prompt_len).repeat_interleave(g),
        "beacons": beacons,
        "beacon_positions": src_pos,
        "beacons_from_global": int(sum(bool(glob_q[p]) for p in src_pos)),
        "settings": {
            "beacon_max": defaults.beacon_max,
            "beacon_min": defaults.beacon_min,
            "recent": defaults.recent,
        },
    }


def summary_dict(analysis: TraceAnalysis, examples: dict, beacons: dict, profile_cmp: dict | None) -> dict:
    """The JSON summary: rule, shares, persistent keys, histograms, entropy, methods' missed revisits."""
    local, glob = analysis.class_histograms()
    rule = analysis.rule
    return {
        "trace": analysis.trace_id,
        "tokens": analysis.n_tokens,
        "prompt_tokens": analysis.prompt_len,
        "stride": analysis.stride,
        "rule": {
            "distance": rule.distance,
            "fraction": rule.fraction,
            "n_sink": rule.n_sink,
            "top_k": rule.top_k,
            "persistent": rule.persistent,
            "min_support": rule.min_support,
            "needed_mass": analysis.needed_mass,
            "text": rule.describe(),
        },
        "eligible_queries": int(analysis.eligible.sum()),
        "global_share": analysis.global_fraction().tolist(),
        "global_queries": int(analysis.is_global.sum()),
        "persistent_keys": [[k.nonzero().flatten().tolist() for k in layer] for layer in analysis.persistent],
        "distance_edges": analysis.edges.tolist(),
        "distance_hist_local": local.tolist(),
        "distance_hist_global": glob.tolist(),
        "entropy": analysis.entropy_curve().tolist(),
        "profile_agreement": profile_cmp,
        "layers": analysis.layers,
        "revisits": {f"{li}:{h}": ex for (li, h), ex in examples.items()},
        "beacons": beacons,
        "methods": [
            {
                "label": m.label,
                "method": m.method,
                "budget": m.budget,
                "knobs": m.knobs,
                "mean_kl": m.mean_kl,
                "top1": m.top1,
                "live_tokens": m.live_tokens,
                "positions": m.positions,
                "forwards": m.forwards,
                "compressions": m.compressions,
                "seconds": m.seconds,
                **analysis.missed(m),
            }
            for m in analysis.methods
        ],
        "seconds": analysis.seconds,
    }


def _snippet_html(s: dict) -> str:
    left, token, right = (html.escape(s[k]) for k in ("left", "token", "right"))
    return f"<code>{left}<mark>{token}</mark>{right}</code>"


CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Helvetica,Arial,sans-serif;max-width:1150px;margin:2em auto;
padding:0 1em;color:#222;line-height:1.45}
h1{font-size:1.5em}h2{margin-top:2em;border-bottom:1px solid #ddd;padding-bottom:.2em}
figure{margin:1em 0}figure img{max-width:100%;border:1px solid #eee}
figcaption{font-size:.92em;color:#444;margin-top:.4em}
table{border-collapse:collapse;font-size:.92em}
td,th{border:1px solid #ccc;padding:.25em .6em;text-align:right}
th{background:#f4f4f4}td.l,th.l{text-align:left}
code{background:#f6f6f6;padding:0 .2em;white-space:pre-wrap}mark{background:#ffe066;font-weight:bold}
.rule{background:#f7f9fc;border-left:4px solid #4a7bd0;padding:.6em 1em}
ul.rev li{margin-bottom:.5em}
"""


def _fig(path: str, caption: str) -> str:
    src = html.escape(path)
    return f'<figure><img src="{src}" alt="{src}"><figcaption>{caption}</figcaption></figure>'


def write_report(
    analysis: TraceAnalysis,
    tokenizer,
    out_dir: str | Path,
    *,
    heads: list[int] | None = None,
    profile: dict | None = None,
    model_name: str = "model",
    command: str = "",
) -> dict:
    """Draw every figure into out_dir and write index.html and summary.json; returns the summary.
    heads: KV heads drawn for every chosen layer (None = each layer's head with the most global queries)."""
    from reasonkv.harness.profile import curve_agreement

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rule = analysis.rule
    share = analysis.global_fraction()
    pairs = _pairs(analysis, heads)

    plot_global_heatmap(share, out / "global_share.png", highlight=analysis.layers)
    local, glob = analysis.class_histograms()
    sel = analysis.layers
    ok = analysis.eligible[None, None, :]
    counts = torch.stack(
        [(~analysis.is_global & ok).sum(-1), (analysis.is_global & ok).sum(-1)], dim=-1
    )  # [L, H, 2]
    plot_distance_histograms(
        local[sel],
        glob[sel],
        counts[sel],
        analysis.edges,
        sel,
        rule.distance,
        out / "distance_histograms.png",
    )

    examples, beacons = {}, {}
    for li, h in pairs:
        rows = analysis.maps[li][h]
        in_rec = torch.isin(analysis.map_positions, analysis.positions)
        glob_rows = torch.zeros(rows.shape[0], dtype=torch.bool)
        idx = torch.searchsorted(analysis.positions, analysis.map_positions[in_rec])
        glob_rows[in_rec] = analysis.is_global[li, h, idx]
        plot_attention_map(
            rows,
            analysis.map_positions,
            glob_rows,
            analysis.prompt_len,
            rule.distance,
            out / f"attention_L{li}_H{h}.png",
            persistent=analysis.persistent[li, h],
            title=f"layer {li}, KV head {h}: the last {rows.shape[0]} queries over all keys",
        )
        examples[(li, h)] = revisit_examples(analysis, tokenizer, li, h)
        pca = _pca_inputs(analysis, li, h)
        plot_pca(
            pca["points"],
            pca["is_global"],
            pca["positions"],
            pca["beacons"],
            out / f"pca_L{li}_H{h}.png",
            is_prompt=pca["is_prompt"],
            title=f"layer {li}, KV head {h}: pre-RoPE queries of its {analysis.group_size} query heads "
            f"and BeaconKV's beacons after the trace",
        )
        beacons[f"{li}:{h}"] = {
            "positions": pca["beacon_positions"],
            "from_global_queries": pca["beacons_from_global"],
            **pca["settings"],
        }

    curve = analysis.entropy_curve()
    profile_cmp = None
    if profile is not None and len(profile.get("demand", [])) == curve.numel():
        profile_cmp = curve_agreement(curve.tolist(), profile["demand"])
    else:
        profile = None
    plot_entropy(curve, profile, out / "entropy_wave.png")

    method_rows = [
        {"label": m.label, "missed": analysis.missed(m), "mean_kl": m.mean_kl, "live": m.live_tokens}
        for m in analysis.methods
    ]
    if method_rows:
        plot_missed(method_rows, out / "missed_revisits.png")

    summary = summary_dict(analysis, examples, beacons, profile_cmp)
    summary.update({"model": model_name, "command": command})
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    (out / "index.html").write_text(
        _html(analysis, summary, pairs, examples, beacons, method_rows, profile_cmp, model_name, command)
    )
    return summary


def _html(analysis, summary, pairs, examples, beacons, method_rows, profile_cmp, model_name, command) -> str:
    rule = analysis.rule
    esc = html.escape
    n_trace = analysis.n_tokens - analysis.prompt_len
    parts = [
        "<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'>",
        f"<title>reasonkv analyze: {esc(analysis.trace_id)}</title><style>{CSS}</style></head><body>",
        f"<h1>Thought revisiting in <code>{esc(model_name)}</code> on trace "
        f"<code>{esc(analysis.trace_id)}</code></h1>",
        f"<p>{analysis.n_tokens} tokens ({analysis.prompt_len} prompt + {n_trace} trace), "
        f"{'every' if analysis.stride == 1 else f'every {analysis.stride}th'} trace query recorded "
        f"({analysis.positions.numel()} queries, "
        f"{int(analysis.eligible.sum())} eligible), {analysis.n_layers} layers × {analysis.n_kv_heads} "
        f"KV heads. The attention of a KV head is the mean over its {analysis.group_size} query heads. "
        f"Replay took {analysis.seconds:.1f} s. Numbers: <a href='summary.json'>summary.json</a>.</p>",
    ]
    if command:
        parts.append(f"<p><code>{esc(command)}</code></p>")
    persistent_txt = (
        "none (persistent-key detection off)"
        if rule.persistent is None
        else f"keys among the {rule.top_k} strongest far keys of at least {rule.persistent:g} of the "
        f"eligible queries that see them ≥ D back (at least {rule.min_support} such queries), computed "
        "as a fixpoint (with the strongest ones removed, weaker ones can enter the top)"
    )
    parts.append(
        "<h2>The rule</h2><div class='rule'>"
        "<p>A query at position p is <b>global</b> (thought revisiting) when p − D ≥ n_sink and its "
        f"<b>{rule.top_k}</b> strongest keys at least <b>D = {rule.distance}</b> tokens back hold at "
        f"least <b>φ = {rule.fraction:g}</b> of its attention mass; it is <b>local</b> otherwise. Both "
        f"masses leave out the first <b>n_sink = {rule.n_sink}</b> tokens (attention sinks) and the "
        f"head's <b>persistent keys</b>: {persistent_txt}. Persistent keys are secondary sinks (small "
        "models park attention on a few early tokens for every query); every method keeps them, "
        "because recent queries attend them too, so no revisit is needed to keep them.</p>"
        "<p>The keys a global query <b>needs</b>: its strongest far keys, in decreasing attention, "
        f"until they hold {analysis.needed_mass:g} of its top-{rule.top_k} far mass. A needed key is "
        "<b>missed</b> by a method when the method had already evicted it before the query came.</p></div>"
    )
    parts.append("<h2>Where the global queries are</h2>")
    parts.append(
        _fig(
            "global_share.png",
            "Share of the eligible trace queries that are global, per layer (x) and KV head (y), in %. "
            f"{summary['global_queries']} global (layer, head, query) triples in all. The layers drawn "
            "below are in red.",
        )
    )
    parts.append(
        _fig(
            "distance_histograms.png",
            "Attention-weighted distance: for each query, the share of its attention (sinks and "
            "persistent keys aside) that lands at each distance (log2 bins), averaged over the local "
            "(red) and the global (blue) queries of the head; in brackets, how many queries. The dashed "
            "line is D. Local queries keep their mass near the diagonal; global ones put a second mode "
            "far back.",
        )
    )
    parts.append("<h2>Attention maps and what the revisits read</h2>")
    for li, h in pairs:
        share = 100 * float(summary["global_share"][li][h])
        parts.append(f"<h3>Layer {li}, KV head {h} ({share:.1f}% global)</h3>")
        parts.append(
            _fig(
                f"attention_L{li}_H{h}.png",
                "Attention of the last queries of the trace (rows) over every key (columns), log colour "
                "scale. Green triangles on the right mark global queries; keys left of the dashed line "
                "are at least D back; the dotted line is where the trace starts (before it: the prompt); "
                "grey ticks on top are the head's persistent keys.",
            )
        )
        ex = examples[(li, h)]
        if not ex:
            parts.append("<p>No global query in this head.</p>")
            continue
        items = []
        for e in ex:
            keys = "".join(
                f"<li>key {k['pos']} (attention {k['weight']:.3f}): {_snippet_html(k)}</li>"
                for k in e["needed"]
            )
            where = "" if e["in_window"] else " (outside the map window)"
            items.append(
                f"<li>query {e['query']['pos']}{where}, far fraction {e['far_fraction']:.2f}: "
                f"{_snippet_html(e['query'])}<ul>{keys}</ul></li>"
            )
        parts.append(
            "<p>The strongest revisits of this head: the query token (highlighted, with the text before "
            "it) and the keys it needed, with the text around them:</p>"
            f"<ul class='rev'>{''.join(items)}</ul>"
        )
    parts.append("<h2>Beacons: the geometry of revisiting queries</h2>")
    for li, h in pairs:
        b = beacons[f"{li}:{h}"]
        sources = ", ".join(map(str, b["positions"]))
        parts.append(
            _fig(
                f"pca_L{li}_H{h}.png",
                "Pre-RoPE queries (RoPE undone with the model's inverse frequencies) of the "
                f"{analysis.group_size} query heads of layer {li}, KV head {h}, unit-normalised (FPS "
                "uses cosine distance) and projected on their first two principal components. Left: "
                "prompt / local / global queries; right: coloured by position. Stars: the "
                f"{len(b['positions'])} beacons BeaconKV's continual FPS would hold at the end of the "
                f"trace (buffer {b['beacon_max']}→{b['beacon_min']}, the newest {b['recent']} queries "
                "still in the recent window), fed these full-cache queries; "
                f"{b['from_global_queries']} of them come from global queries (query positions "
                f"{sources}).",
            )
        )
    parts.append("<h2>The Reasoning Wave</h2>")
    agree = (
        f" Agreement with the shipped profile: Pearson r = {profile_cmp['pearson_r']:.3f}, largest "
        f"relative gap {profile_cmp['max_relative_gap']:.2f}."
        if profile_cmp
        else " No profile ships for this model (make one with <code>reasonkv profile</code>)."
    )
    parts.append(
        _fig(
            "entropy_wave.png",
            "Per-layer normalised attention entropy of this trace's queries (mean over heads and "
            "queries, red): the demand signal ReasonAlloc's layer budgets follow, against the profile "
            "(blue)." + agree,
        )
    )
    parts.append("<h2>Missed revisits</h2>")
    if not method_rows:
        parts.append("<p>No method was replayed (<code>--methods</code>).</p>")
    else:
        table = [
            "<table><tr><th class='l'>method</th><th>missed keys</th><th>needed keys</th>"
            "<th>missed %</th><th>global queries with a miss</th><th>mean KL</th><th>top-1</th>"
            "<th>live tokens / head</th><th>compressions</th></tr>"
        ]
        for m in summary["methods"]:
            kl = "-" if m["mean_kl"] is None else f"{m['mean_kl']:.4f}"
            top1 = "-" if m["top1"] is None else f"{m['top1']:.3f}"
            cells = [
                m["missed_keys"],
                m["needed_keys"],
                f"{100 * m['missed_fraction']:.1f}",
                f"{m['queries_with_missed']} / {m['global_queries']}",
                kl,
                top1,
                f"{m['live_tokens']:.0f}",
                m["compressions"],
            ]
            row = "".join(f"<td>{c}</td>" for c in cells)
            table.append(f"<tr><td class='l'>{esc(m['label'])}</td>{row}</tr>")
        table.append("</table>")
        parts.append(
            _fig(
                "missed_revisits.png",
                "Left: the share of the needed keys of all global queries (every layer and head) that "
                "the method had already evicted when the query came, with the counts, the method's mean "
                "KL(full ‖ method) over the trace and the mean tokens per head it held. Right: missed "
                "keys per layer, and (dashed) the needed keys. Each method replays the same trace "
                "teacher-forced, in chunks that end where token-by-token decoding would compress.",
            )
        )
        parts.append("".join(table))
    parts.append("</body></html>")
    return "\n".join(parts)
