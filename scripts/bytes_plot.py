"""KL and top-1 against peak K/V bytes per sequence at 16 bits: evicting, quantizing, or both.

Every point is a configuration replayed on the same traces, x its decode-time peak K/V of one
sequence alone with every unquantized value counted at 16 bits (what a bf16/fp16 server holds):
- evict-only at 16 bits: the peak sweep's pooled fidelity, at the alone peaks that
  `scripts/alone_peaks.py` predicts (fp32 bytes, halved: nothing is quantized there);
- everything that stores K/V below 16 bits (kv_bits, the two-tier cache, quant-int*):
  sweeps that replay each trace alone, at their metered 16-bit peaks.

    python scripts/bytes_plot.py --evict docs/results/replay-sweep-peak.jsonl \\
      --alone-peaks docs/results/alone-peaks.json --low-bit docs/results/bytes-sweep-alone.jsonl \\
      --methods beaconkv,h2o --out docs/results/bytes.png --json docs/results/bytes-points.json
    python scripts/bytes_plot.py --curves docs/results/bytes-length-probe.jsonl \
      --out docs/results/bytes-length-probe.png
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from reasonkv.core.quantize import KVFormat
from reasonkv.harness.report import load_records, summarize_results
from reasonkv.util.plotting import pyplot, save_figure

MIB = 2**20


def _label(row: dict) -> str:
    knobs = ",".join(f"{k}={v}" for k, v in sorted(row.get("knobs", {}).items()))
    return f"{row['method']}[{knobs}]" if knobs else row["method"]


SHORT = {
    "kv_bits": lambda v: f"{v}-bit",
    "group_size": lambda v: f"g{v}",
    "value_group_size": lambda v: f"vg{v}",
    "residual": lambda v: f"r{v}",
    "fp_sinks": lambda v: "sink" if v == 1 else f"{v} sinks",
    "pre_rope": lambda v: "pre-RoPE" if v else "",
    "hadamard": lambda v: "Hadamard" if v else "",
    "fraction": lambda v: f"evict 1/{1 / v:g}" if (1 / v).is_integer() else f"evict {v:g}",
}
"""Legend names of storage and schedule knobs (the legend would be wider than the plots)."""


def _legend(family: str) -> str:
    """A family's name with its knobs abbreviated: beaconkv[fp_sinks=1,kv_bits=4] -> beaconkv [4-bit sink]."""
    head, sep, rest = family.partition("[")
    if not sep:
        return family
    knobs, _, tail = rest.partition("]")
    parts = []
    for pair in knobs.split(","):
        k, _, v = pair.partition("=")
        value = {"True": True, "False": False}.get(v, v)
        if k in SHORT:
            value = float(v) if k == "fraction" else int(v) if v.isdigit() else value
            parts.append(SHORT[k](value))
        else:
            parts.append(pair)
    return f"{head} [{' '.join(p for p in parts if p)}]{tail}"


def _family(row: dict) -> str:
    """Which curve a point belongs to: a method under one knob setting, budgets along it. A
    two-tier cache's low budget is a multiple of its budget here, so the curve is keyed by
    that multiple, its bits and its other knobs."""
    knobs = dict(row.get("knobs", {}))
    low = knobs.pop("low_budget", 0)
    if not low:
        return _label(row)
    bits = knobs.pop("low_bits", KVFormat().low_bits)
    ratio = low / row["budget"] if row.get("budget") else None
    size = f"{ratio:g}x its budget" if ratio else f"{low} tokens"
    return f"{_label({'method': row['method'], 'knobs': knobs})} + a {bits}-bit tier of {size}"


def _rows(path: Path) -> list[dict]:
    records, _ = load_records([path])
    return [row for section in summarize_results(records) for row in section.rows]


def alone_peaks_16bit(path: Path) -> dict[tuple[str, int], float]:
    """(method, budget) -> peak bytes of one sequence alone at 16 bits, for the unquantized,
    default-knob rows of `scripts/alone_peaks.py --out` (fp32 bytes there, so halved)."""
    rows = json.loads(path.read_text())["rows"]
    return {
        (r["method"], r["budget"]): r["alone_peak_kv_bytes"] / 2
        for r in rows
        if not r["knobs"] and r.get("alone_peak_kv_bytes") is not None
    }


def points(evict: Path, peaks: dict[tuple[str, int], float], low_bit: Path, methods: list[str]) -> list[dict]:
    out = []
    evicted = [row for row in _rows(evict) if row["method"] in methods and not row.get("knobs")]
    full = max((row["traces"] for row in evicted), default=0)
    for row in evicted:
        key = (row["method"], row.get("budget"))
        if key in peaks:
            out.append(
                {**_point(row), "peak_16bit_mib": peaks[key] / MIB, "family": f"{row['method']} (16-bit)"}
            )
    for row in _rows(low_bit):
        if row.get("peak_kv_bytes_16bit") is None:
            continue
        if row["traces"] < full:  # a sweep still running: its mean is not comparable yet
            print(f"left out (partial: {row['traces']} of {full} traces): {_label(row)}@{row.get('budget')}")
            continue
        out.append(
            {**_point(row), "peak_16bit_mib": row["peak_kv_bytes_16bit"] / MIB, "family": _family(row)}
        )
    return out


def _point(row: dict) -> dict:
    return {
        "label": _label(row),
        "budget": row.get("budget"),
        "traces": row["traces"],
        "mean_kl": row["mean_kl"],
        "top1": row["top1"],
    }


def evict_only_at(pts: list[dict], mib: float) -> dict | None:
    """The best evict-only (16-bit) point at `mib`: per method, KL interpolated log-log and
    top-1 linearly in log memory between its two nearest budgets (past its last two:
    extrapolated, and said so); the method with the lowest KL wins."""
    best = None
    for fam in {p["family"] for p in pts if p["family"].endswith("(16-bit)")}:
        mine = sorted((p for p in pts if p["family"] == fam), key=lambda p: p["peak_16bit_mib"])
        if len(mine) < 2 or mib < mine[0]["peak_16bit_mib"]:
            continue
        i = next((i for i in range(len(mine) - 1) if mib <= mine[i + 1]["peak_16bit_mib"]), len(mine) - 2)
        a, b = mine[i], mine[i + 1]
        t = math.log(mib / a["peak_16bit_mib"]) / math.log(b["peak_16bit_mib"] / a["peak_16bit_mib"])
        kl = math.exp(math.log(a["mean_kl"]) + t * (math.log(b["mean_kl"]) - math.log(a["mean_kl"])))
        top1 = a["top1"] + t * (b["top1"] - a["top1"])
        if best is None or kl < best["mean_kl"]:
            best = {"method": fam.split(" ")[0], "mean_kl": kl, "top1": top1, "extrapolated": t > 1}
    return best


def goal_bytes(peaks: dict[tuple[str, int], float]) -> float | None:
    """The issue's reference memory: SnapKV@128's peak alone, at 16 bits (MiB)."""
    peak = peaks.get(("snapkv", 128))
    return None if peak is None else peak / MIB


def plot(pts: list[dict], out: Path, goal_mib: float | None = None) -> Path:
    plt = pyplot()
    fig, (ax_kl, ax_top1) = plt.subplots(1, 2, figsize=(12, 6.4))
    families = list(dict.fromkeys(p["family"] for p in pts))
    colors = plt.get_cmap("tab20").colors  # more curves than the default cycle's 10 colours
    for i, fam in enumerate(families):
        mine = sorted((p for p in pts if p["family"] == fam), key=lambda p: p["peak_16bit_mib"])
        x = [p["peak_16bit_mib"] for p in mine]
        style = {
            "marker": "os^Dv"[i % 5],
            "color": colors[(2 * i) % 20 + (2 * i) // 20 % 2],
            "linestyle": "-" if len(mine) > 1 else "none",
            "label": _legend(fam),
        }
        ax_kl.plot(x, [p["mean_kl"] for p in mine], **style)
        ax_top1.plot(x, [p["top1"] for p in mine], **style)
    if goal_mib is not None:  # the goal: KL <= 0.07 and top-1 >= 0.94 at SnapKV@128's memory
        for ax, level in ((ax_kl, 0.07), (ax_top1, 0.94)):
            ax.axvline(goal_mib, color="grey", linestyle=":", linewidth=1)
            ax.axhline(level, color="grey", linestyle=":", linewidth=1)
            ax.annotate(
                "goal at snapkv@128's memory",
                (goal_mib, level),
                fontsize=7,
                color="grey",
                xytext=(4, 4),
                textcoords="offset points",
            )
    for ax in (ax_kl, ax_top1):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("peak K/V per sequence, MiB at 16 bits (one trace alone)")
        ax.grid(alpha=0.3, which="both")
    ax_kl.set_yscale("log")
    ax_kl.set_ylabel("mean KL(full ‖ method), nats")
    ax_top1.set_ylabel("top-1 agreement with the full cache")
    fig.legend(*ax_kl.get_legend_handles_labels(), loc="lower center", ncol=3, fontsize=7, frameon=False)
    traces = sorted({p["traces"] for p in pts})
    fig.suptitle(
        "Evict, quantize, or both: SmolLM2-135M (not a reasoning model) reading "
        f"{'/'.join(map(str, traces))} reasoning traces, 2,048 tokens",
        fontsize=10,
    )
    fig.tight_layout(rect=(0, 0.2, 1, 1))  # the legend below both plots
    return save_figure(fig, out)


def curves(path: Path, out: Path) -> Path:
    """KL per position bin, pooled over traces, one line per method × budget: where a budget
    starts to bind, eviction's KL rises; quantization's stays level and its bytes grow."""
    records, _ = load_records([path])
    pooled: dict[str, dict[int, list[float]]] = {}
    for r in records:
        if r.get("status") != "ok" or r["config"]["method"] == "full":
            continue
        c = r["config"]
        name = c["method"] if c.get("budget") is None else f"{c['method']}@{c['budget']}"
        for b in r["metrics"]["curve"]:  # bins share their starts; a trace's last one ends early
            kl_sum, n = pooled.setdefault(name, {}).setdefault(b["start"], [0.0, 0])
            pooled[name][b["start"]] = [kl_sum + b["mean_kl"] * b["positions"], n + b["positions"]]
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for name, bins in pooled.items():
        starts = sorted(bins)
        ax.plot(
            starts, [bins[x][0] / bins[x][1] for x in starts], marker="o", label=name, drawstyle="steps-post"
        )
    ax.set_yscale("log")
    ax.set_xlabel("trace position (start of each bin, prompt included)")
    ax.set_ylabel("mean KL(full ‖ method) in the bin, nats")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    traces = len({r["config"]["item"] for r in records})
    ax.set_title(f"Along the chain: SmolLM2-135M (not a reasoning model), {traces} traces", fontsize=10)
    fig.tight_layout()
    return save_figure(fig, out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--evict", type=Path, help="the peak sweep (evict-only, 16 bits)")
    p.add_argument("--alone-peaks", type=Path, help="scripts/alone_peaks.py --out JSON")
    p.add_argument("--low-bit", type=Path, help="sweep of low-bit units, each trace alone")
    p.add_argument("--curves", type=Path, help="instead: KL along the chain of this sweep's units")
    p.add_argument("--methods", default="beaconkv,h2o", help="evict-only methods to draw")
    p.add_argument("--out", type=Path, default=Path("bytes.png"))
    p.add_argument("--json", type=Path, default=None, help="also write the points here")
    args = p.parse_args()
    if args.curves is not None:
        print("plot ->", curves(args.curves, args.out))
        return
    if None in (args.evict, args.alone_peaks, args.low_bit):
        p.error("--evict, --alone-peaks and --low-bit are needed (or --curves)")
    peaks = alone_peaks_16bit(args.alone_peaks)
    pts = points(args.evict, peaks, args.low_bit, args.methods.split(","))
    for pt in sorted(pts, key=lambda q: (q["family"], q["peak_16bit_mib"])):
        line = (
            f"{pt['family']:<46} {pt['label']:<40} {pt['budget']!s:>5} {pt['peak_16bit_mib']:6.2f} MiB "
            f"KL {pt['mean_kl']:.4f} top-1 {pt['top1']:.3f} ({pt['traces']} traces)"
        )
        ref = None if pt["family"].endswith("(16-bit)") else evict_only_at(pts, pt["peak_16bit_mib"])
        if ref is not None:
            pt["evict_only_there"] = ref
            line += (
                f"; best evict-only there{' (extrapolated)' if ref['extrapolated'] else ''}: "
                f"{ref['method']} {ref['mean_kl']:.4f} / {ref['top1']:.3f}, "
                f"KL {100 * (pt['mean_kl'] / ref['mean_kl'] - 1):+.0f} %"
            )
        print(line)
    print("plot ->", plot(pts, args.out, goal_bytes(peaks)))
    if args.json:
        args.json.write_text(json.dumps(pts, indent=1) + "\n")


if __name__ == "__main__":
    main()
