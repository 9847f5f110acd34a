"""What one compression's scoring costs, per scorer, on synthetic keys of a model's shape.

Times `scorer.score(obs, keys, values)` for the scorers that need no decode-time state
(streaming, snapkv, tova, rkv): one layer of `--batch` rows x KV heads x `--tokens` keys,
with a `window`-query observation, the median of `--repeat` calls after a warm-up. The
default shape is the default model's (3 KV heads, 9 query heads, head dim 64) at budget
512 + 128 buffer, 12 rows: the sweep's largest R-KV compression. Multiply by the layers
(30 for the default model) for one compression of the whole cache.

    REASONKV_THREADS=1 .venv/bin/python benchmarks/scorer_cost.py --out scorer_cost.json

To compare two commits, run it with PYTHONPATH pointing at each checkout's src/.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

SCORERS = ("streaming", "snapkv", "tova", "rkv")


def synthetic_observation(
    batch: int, kv_heads: int, groups: int, tokens: int, dim: int, window: int, seed: int
):
    """An observation of the last `window` queries over `tokens` real keys, and the keys/values."""
    from reasonkv.core.policy import Observation

    gen = torch.Generator().manual_seed(seed)
    obs = Observation(
        queries=torch.randn(batch, kv_heads * groups, window, dim, generator=gen),
        query_index=torch.arange(tokens - window, tokens).expand(batch, window).clone(),
        token_index=torch.arange(tokens).expand(batch, kv_heads, tokens).clone(),
        scaling=dim**-0.5,
    )
    keys = torch.randn(batch, kv_heads, tokens, dim, generator=gen)
    values = torch.randn(batch, kv_heads, tokens, dim, generator=gen)
    return obs, keys, values


def time_scorer(method: str, obs, keys, values, repeat: int) -> dict:
    from reasonkv.methods.registry import get_method

    scorer = get_method(method).scorer()
    scorer.score(obs, keys, values)  # warm-up
    seconds = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        scorer.score(obs, keys, values)
        seconds.append(time.perf_counter() - t0)
    return {"method": method, "ms_median": 1e3 * statistics.median(seconds), "ms_min": 1e3 * min(seconds)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=12)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--groups", type=int, default=3, help="query heads per KV head")
    ap.add_argument("--tokens", type=int, default=640)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--window", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=10)
    ap.add_argument("--methods", default=",".join(SCORERS))
    ap.add_argument("--out", type=Path, default=None, help="write the table as JSON here")
    args = ap.parse_args()

    from reasonkv.util.runtime import set_threads

    set_threads()
    shape = {k: getattr(args, k) for k in ("batch", "kv_heads", "groups", "tokens", "dim", "window")}
    obs, keys, values = synthetic_observation(**shape, seed=0)
    rows = [time_scorer(m, obs, keys, values, args.repeat) for m in args.methods.split(",")]
    print(f"score() per layer, {shape}, {torch.get_num_threads()} thread(s), median of {args.repeat}")
    print(f"{'method':<12}{'median ms':>12}{'min ms':>10}")
    for r in rows:
        print(f"{r['method']:<12}{r['ms_median']:>12.2f}{r['ms_min']:>10.2f}")
    if args.out is not None:
        record = {"shape": shape, "threads": torch.get_num_threads(), "repeat": args.repeat, "rows": rows}
        args.out.write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
