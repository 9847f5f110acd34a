"""The offline report of `reasonkv analyze`: `write_report` draws every figure of a
TraceAnalysis and writes summary.json and index.html (rendered from templates/report.html.j2:
relative PNG paths, inline CSS, no scripts)."""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path

import jinja2
import torch

from reasonkv.core.policy.scorers.beacon import BeaconKVScorer
from reasonkv.harness.analyze.beacons import simulate_beacons
from reasonkv.harness.analyze.figures import (
    plot_attention_map,
    plot_distance_histograms,
    plot_entropy,
    plot_global_heatmap,
    plot_missed,
    plot_pca,
)
from reasonkv.harness.analyze.results import TraceAnalysis
from reasonkv.harness.profile import curve_agreement

TEMPLATES = Path(__file__).with_name("templates")


def decode(tokenizer, ids: list[int]) -> str:
    """Text of token ids (tokenizers without `decode` go through batch_decode)."""
    if not ids:
        return ""
    if hasattr(tokenizer, "decode"):
        return tokenizer.decode(ids)
    return tokenizer.batch_decode([ids])[0]


REPLACEMENT = "\ufffd"  # what a byte-level tokenizer decodes a cut multi-byte character to


def _snippet(tokenizer, ids: list[int], pos: int, before: int, after: int) -> dict:
    """The text before token `pos`, the token, and the text after it. Decoded as growing
    prefixes of one window and split by difference, never token by token: a character that
    spans several byte-level tokens (≥, an emoji) stays whole, in the highlight when any of its
    bytes is the token's, and the window's ends move out to whole characters."""
    lo, hi = max(0, pos - before), min(len(ids), pos + 1 + after)
    reach = 4  # a UTF-8 character is at most 4 bytes
    while (
        lo > 0 and lo > pos - before - reach and decode(tokenizer, ids[lo : pos + 1]).startswith(REPLACEMENT)
    ):
        lo -= 1
    end = pos + 1
    while end < len(ids) and end < pos + 1 + reach and decode(tokenizer, ids[lo:end]).endswith(REPLACEMENT):
        end += 1
    hi = max(hi, min(len(ids), end + after))
    while hi < len(ids) and hi < end + after + reach and decode(tokenizer, ids[lo:hi]).endswith(REPLACEMENT):
        hi += 1
    left = decode(tokenizer, ids[lo:pos]).rstrip(REPLACEMENT)  # the token's character began before it
    upto = decode(tokenizer, ids[lo:end])
    whole = decode(tokenizer, ids[lo:hi])
    token = upto[len(left) :] if upto.startswith(left) else decode(tokenizer, ids[pos:end])
    right = whole[len(upto) :] if whole.startswith(upto) else decode(tokenizer, ids[end:hi])
    return {"pos": pos, "left": left, "token": token, "right": right}


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


@cache
def _environment() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(TEMPLATES),
        autoescape=True,
        trim_blocks=True,
        lstrip_blocks=True,
        undefined=jinja2.StrictUndefined,
    )
    env.filters["fmt"] = format  # {{ x|fmt(".3f") }} formats exactly as f"{x:.3f}"
    return env


def render_html(
    analysis: TraceAnalysis,
    summary: dict,
    pairs: list[tuple[int, int]],
    examples: dict,
    beacons: dict,
    profile_cmp: dict | None,
    model_name: str,
    command: str,
) -> str:
    """The text of index.html. Every value is escaped by the template (autoescape)."""
    return (
        _environment()
        .get_template("report.html.j2")
        .render(
            trace_id=analysis.trace_id,
            model_name=model_name,
            command=command,
            n_tokens=analysis.n_tokens,
            prompt_len=analysis.prompt_len,
            stride=analysis.stride,
            n_queries=analysis.positions.numel(),
            n_eligible=int(analysis.eligible.sum()),
            n_layers=analysis.n_layers,
            n_kv_heads=analysis.n_kv_heads,
            group_size=analysis.group_size,
            seconds=analysis.seconds,
            rule=analysis.rule,
            needed_mass=analysis.needed_mass,
            global_queries=summary["global_queries"],
            pairs=[
                {
                    "layer": li,
                    "head": h,
                    "share": 100 * float(summary["global_share"][li][h]),
                    "persistent": int(analysis.persistent[li, h].sum()),
                    "examples": examples[(li, h)],
                    "beacons": beacons[f"{li}:{h}"],
                }
                for li, h in pairs
            ],
            profile_cmp=profile_cmp,
            methods=summary["methods"],
        )
    )


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
        render_html(analysis, summary, pairs, examples, beacons, profile_cmp, model_name, command)
    )
    return summary
