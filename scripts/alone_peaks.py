"""Per-sequence peak K/V of a replay sweep's units as if each trace ran alone.

A sweep with `batch_traces = true` replays its traces as one left-padded batch and records the
batch's peak K/V divided by its rows. Rows of different prompt lengths compress at different
steps and share one storage, so for schedules whose rows fall out of step (the buffer
schedules of SnapKV and R-KV, BeaconKV's threshold) that is more than one sequence alone
holds. For every unit whose schedule `reasonkv bench`'s capacity planner can follow, this
predicts the decode-time peak of the trace alone from the schedule's arithmetic (exact: tests
compare it with the cache's meter and with a replay alone) and prints, per method × budget ×
knobs, the mean over traces next to the batched record; units it cannot follow (per-head
splits, RPC's growing cache, quantized storage) are listed as such.

Beside it, the peak of everything a sequence alone holds (K/V, slot indices, query windows,
beacon buffers, policy state) as a bf16 server holds it: predicted the same way on the model
loaded in bf16 (`alone_peak_state_bytes_16bit`; tensors that stay fp32 by design, such as H2O's
accumulated attention, at their 4 bytes).

    python scripts/alone_peaks.py docs/results/replay-sweep-peak.jsonl --out alone-peaks.json
    python scripts/alone_peaks.py docs/results/report-set.jsonl docs/results/beacon-ablations.jsonl \
        --out docs/results/beacon-ablations-alone.json
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

from reasonkv.core.models import load_model
from reasonkv.harness.bench.capacity import alone_peaks, peak_kv_slots, slot_bytes
from reasonkv.harness.report import load_records
from reasonkv.methods.api import make_cache


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("results", type=Path, nargs="+", help="sweep JSONL files (mixed freely)")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--out", type=Path, default=None, help="also write the rows as JSON here")
    args = p.parse_args()
    model, _ = load_model(args.model, device="cpu", dtype="float32")
    half, _ = load_model(args.model, device="cpu", dtype="bfloat16")
    per_slot = slot_bytes(model)  # fp32, as the sweep ran; at 16 bits: half
    records, _ = load_records(args.results)
    groups: dict[tuple, list] = defaultdict(list)
    states: dict[tuple, int] = {}
    for r in records:
        c, m = r["config"], r["metrics"]
        if r.get("status") != "ok" or c["kind"] != "replay" or c.get("budget") is None:
            continue
        knobs = c.get("knobs", {})
        key = (c["method"], c["budget"], json.dumps(knobs, sort_keys=True))
        cache = make_cache(model, c["method"], c["budget"], **knobs)
        prompt, n = m["prompt_len"], m["tokens"] - 1 - m["prompt_len"]
        try:
            slots = peak_kv_slots(cache, prompt, n, decode_only=True)
        except ValueError as err:
            groups[key].append((None, m.get("decode_peak_kv_bytes"), str(err), None))
            continue
        if (key, prompt, n) not in states:
            states[key, prompt, n] = alone_peaks(half, c["method"], c["budget"], knobs, prompt, n).state
        groups[key].append((slots * per_slot, m.get("decode_peak_kv_bytes"), None, states[key, prompt, n]))
    rows = []
    for (method, budget, knobs), units in sorted(groups.items()):
        batched = [b for _, b, _, _ in units if b is not None]
        row = {
            "method": method,
            "budget": budget,
            "knobs": json.loads(knobs),
            "traces": len(units),
            "batched_peak_kv_bytes": sum(batched) / len(batched) if batched else None,
        }
        if any(a is None for a, _, _, _ in units):
            row["alone_peak_kv_bytes"] = row["alone_peak_state_bytes_16bit"] = None
            row["why_not"] = next(w for _, _, w, _ in units if w)
        else:
            row["alone_peak_kv_bytes"] = sum(a for a, _, _, _ in units) / len(units)
            row["alone_peak_state_bytes_16bit"] = sum(st for _, _, _, st in units) / len(units)
        rows.append(row)
        mib = lambda x: "-" if x is None else f"{x / 2**20:7.2f}"  # noqa: E731
        ratio = (
            f"{row['batched_peak_kv_bytes'] / row['alone_peak_kv_bytes']:.3f}"
            if row["alone_peak_kv_bytes"] and row["batched_peak_kv_bytes"]
            else "-"
        )
        label = f"{method}@{budget}" + (f" {knobs}" if knobs != "{}" else "")
        print(
            f"{label:50s} alone {mib(row['alone_peak_kv_bytes'])} MiB  batched "
            f"{mib(row['batched_peak_kv_bytes'])} MiB  batched/alone {ratio}  "
            f"state alone @16-bit {mib(row['alone_peak_state_bytes_16bit'])} MiB"
        )
    if args.out is not None:
        args.out.write_text(
            json.dumps(
                {"source": [str(p) for p in args.results], "per_slot_bytes": per_slot, "rows": rows}, indent=1
            )
        )


if __name__ == "__main__":
    main()
