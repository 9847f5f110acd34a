"""What one sequence holds at its peak, K/V and beside it, per method and budget, at 16 bits.

Predicted exactly from each method's schedule (`reasonkv.harness.bench.capacity.peak_state_bytes`,
which the tests hold equal to the cache's meter) for one sequence alone of `--prompt` tokens
decoding `--tokens` more, with the model in bf16 (every floating-point element at 2 bytes: the
16-bit pricing the results read). Beside the K/V: the slot indices, the query window (the queries
a scorer reads and any backlog), policy state (BeaconKV's beacon buffers) and counters. Methods
whose peak the schedule arithmetic cannot follow (per-head splits, RPC, quantized storage) are
listed as such.

    python benchmarks/state_table.py --model smollm2-135m --budgets 64,128,256,512 \\
        --out docs/performance-data/state-smollm2.json
    python benchmarks/state_table.py --model random:qwen3-8b:hidden=128,intermediate=256 \\
        --budgets 1024 --tokens 4096 --out docs/performance-data/state-qwen3-8b.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from reasonkv.core.models import load_model
from reasonkv.harness.bench.capacity import peak_kv_slots, peak_state_bytes, slot_bytes, state_shape
from reasonkv.methods.api import make_cache
from reasonkv.util.formatting import format_bytes

METHODS = "streaming,h2o,tova,snapkv,rkv,random,recent-query,initial-recent,beaconkv"


def row(model, method: str, budget: int, prompt: int, tokens: int, knobs: dict) -> dict:
    def fresh():
        return make_cache(model, method, budget, **knobs)

    out = {"method": method, "budget": budget, "knobs": knobs}
    try:
        state, _ = peak_state_bytes(model, fresh(), fresh(), prompt, tokens, decode_only=True)
    except ValueError as err:
        return {**out, "unpredictable": str(err)}
    kv = peak_kv_slots(fresh(), prompt, tokens, decode_only=True) * slot_bytes(model)
    shape = state_shape(model, fresh())
    seen = prompt + tokens
    window = sum(q * min(seen, w) for q, w in zip(shape.query, shape.window, strict=True))
    return {
        **out,
        "peak_kv_bytes": kv,
        "peak_state_bytes": state,
        "beside_bytes": state - kv,
        "beside_share": (state - kv) / kv,
        "query_window_bytes": window,
        "policy_state_bytes": sum(shape.other),
        "queries_kept": shape.window[0],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--methods", default=METHODS)
    p.add_argument("--budgets", default="64,128,256,512")
    p.add_argument("--prompt", type=int, default=160, help="prompt tokens (the publish traces': 79-263)")
    p.add_argument("--tokens", type=int, default=1888, help="tokens decoded after it")
    p.add_argument("--set", action="append", default=[], help="key=value for every method (repeatable)")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    model, _ = load_model(args.model, device="cpu", dtype="bfloat16")
    knobs = {
        k: json.loads(v) if v[:1].isdigit() or v in ("true", "false") else v
        for k, v in (s.split("=", 1) for s in args.set)
    }
    rows = [
        row(model, m, int(b), args.prompt, args.tokens, knobs)
        for m in args.methods.split(",")
        for b in args.budgets.split(",")
    ]
    print(f"{args.model}, bf16 (16-bit pricing), one sequence alone: {args.prompt} + {args.tokens} tokens")
    print(
        f"{'method':<16}{'budget':>7}{'peak K/V':>12}{'beside':>11}{'share':>8}{'window':>11}{'policy':>11}"
    )
    for r in rows:
        if "unpredictable" in r:
            print(f"{r['method']:<16}{r['budget']:>7}  {r['unpredictable']}")
            continue
        print(
            f"{r['method']:<16}{r['budget']:>7}{format_bytes(r['peak_kv_bytes']):>12}"
            f"{format_bytes(r['beside_bytes']):>11}{r['beside_share']:>8.1%}"
            f"{format_bytes(r['query_window_bytes']):>11}{format_bytes(r['policy_state_bytes']):>11}"
        )
    if args.out is not None:
        record = {
            "model": args.model,
            "prompt": args.prompt,
            "tokens": args.tokens,
            "knobs": knobs,
            "rows": rows,
        }
        args.out.write_text(json.dumps(record, indent=1) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
