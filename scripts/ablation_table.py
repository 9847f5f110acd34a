"""BeaconKV's ablations beside its defaults, each pooled over the traces the ablation ran on.

Reads sweep JSONL files (the ablations', and the report set's for `beaconkv` at its defaults and
`recent-query`) and, optionally, `scripts/alone_peaks.py --out` JSON for what a sequence alone
holds at 16 bits. For every (method, knobs) other than the baseline, at each budget: KL and top-1
pooled over its traces (position-weighted, as `reasonkv report` pools), and BeaconKV at its
defaults pooled over *the same traces*, so a variant run on a subset is compared on that subset;
and, where the variant holds another state, BeaconKV's KL at the variant's state: log-log
through its two budgets' (state, KL) points on those traces (outside them, the same line).

    python scripts/ablation_table.py docs/results/report-set.jsonl docs/results/beacon-ablations.jsonl \\
        --state docs/results/beacon-ablations-alone.json --out docs/results/beacon-ablations-table.json
"""

from __future__ import annotations

import argparse
import json
import math
from collections import defaultdict
from pathlib import Path

from reasonkv.harness.report import load_records

BASELINE = ("beaconkv", "{}")


def pooled(units: list[dict]) -> dict:
    n = sum(u["metrics"]["sums"]["n"] for u in units)
    return {
        "traces": len(units),
        "kl": sum(u["metrics"]["sums"]["kl"] for u in units) / n,
        "top1": sum(u["metrics"]["sums"]["top1"] for u in units) / n,
        "batched_state_16bit": _mean([u["metrics"].get("decode_peak_state_bytes_16bit") for u in units]),
    }


def _mean(values: list) -> float | None:
    return None if any(v is None for v in values) else sum(values) / len(values)


def at_state(points: list[tuple[float, float]], state: float) -> float | None:
    """KL at `state` on the line through two (state, KL) points in log-log."""
    if len(points) != 2 or points[0][0] == points[1][0]:
        return None
    (s0, k0), (s1, k1) = sorted(points)
    slope = math.log(k1 / k0) / math.log(s1 / s0)
    return k0 * math.exp(slope * math.log(state / s0))


def held(p: dict) -> float | None:
    return p["alone_state_16bit"] or p["batched_state_16bit"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("results", type=Path, nargs="+")
    p.add_argument("--state", type=Path, help="alone_peaks.py JSON: per-sequence state alone, 16-bit")
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    records, _ = load_records(args.results)
    units: dict[tuple, dict[str, dict]] = defaultdict(dict)  # (method, knobs, budget) -> item -> record
    for r in records:
        c = r["config"]
        if r.get("status") == "ok" and c["kind"] == "replay":
            units[c["method"], json.dumps(c.get("knobs", {}), sort_keys=True), c["budget"]][c["item"]] = r
    alone = {}
    if args.state:
        for row in json.loads(args.state.read_text())["rows"]:
            key = (row["method"], json.dumps(row["knobs"], sort_keys=True), row["budget"])
            alone[key] = row.get("alone_peak_state_bytes_16bit")
    rows = []
    for (method, knobs, budget), by_item in sorted(units.items()):
        base = units.get((*BASELINE, budget), {})
        items = sorted(by_item)
        if (method, knobs) == BASELINE or not all(i in base for i in items):
            continue
        row = {"method": method, "knobs": json.loads(knobs), "budget": budget, "items": items}
        row["variant"] = pooled([by_item[i] for i in items])
        row["baseline"] = pooled([base[i] for i in items])
        row["variant"]["alone_state_16bit"] = alone.get((method, knobs, budget))
        row["baseline"]["alone_state_16bit"] = alone.get((*BASELINE, budget))
        curve = []
        for other in sorted({bud for (m, k, bud) in units if (m, k) == BASELINE}):
            base_units = units[(*BASELINE, other)]
            if all(i in base_units for i in items):
                point = pooled([base_units[i] for i in items])
                point["alone_state_16bit"] = alone.get((*BASELINE, other))
                if held(point) is not None:
                    curve.append((held(point), point["kl"]))
        state = held(row["variant"])
        row["baseline_kl_at_variant_state"] = None if state is None else at_state(curve, state)
        rows.append(row)
        v, b = row["variant"], row["baseline"]
        mib = lambda x: "-" if x is None else f"{x / 2**20:.2f}"  # noqa: E731
        label = method + (f" {knobs}" if knobs != "{}" else "")
        print(
            f"| {label} @{budget} | {len(items)} | {v['kl']:.4f} / {v['top1']:.3f} | "
            f"{b['kl']:.4f} / {b['top1']:.3f} | {100 * (v['kl'] / b['kl'] - 1):+.1f} % | "
            f"{mib(held(v))} vs {mib(held(b))} MiB | "
            + (
                "-"
                if row["baseline_kl_at_variant_state"] is None
                else f"{row['baseline_kl_at_variant_state']:.4f}"
            )
            + " |"
        )
    if args.out:
        args.out.write_text(
            json.dumps({"source": [str(p) for p in args.results], "rows": rows}, indent=1) + "\n"
        )


if __name__ == "__main__":
    main()
