"""What one compaction in vLLM's CPU paged cache costs: `TileLayout.compact` and `.move` alone.

One layer of the default model's shape (3 KV heads, head dim 64) in bf16, blocks of `--block`
tokens laid out by the kernel this CPU picks for them (AMX tiles where the CPU has them),
`--requests` requests of `--tokens` slots each over scattered blocks, each head keeping its own
`--keep` of them (random, seeded per repeat) moved into its first slots, every request in one
call. `compact` (what a bf16/fp32 cache takes: the kept tokens written back from what the step
read, with vLLM's write op) and `move` (what an fp8 cache takes: the stored elements moved by
offset) are timed on the same moves. Reported: the median of `--repeat` calls after
`--warmup`, on `--threads` threads.

    .venv-vllm/bin/python benchmarks/paged_move_speed.py --out move.json

To compare two commits, run it with PYTHONPATH pointing at each checkout's src/ (before
the pooled step, `move` took one request and `compact` did not exist).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

from reasonkv.serving.vllm.paged_kv import TileLayout

HEADS, DIM = 3, 64


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--keep", type=int, default=448)
    ap.add_argument("--requests", type=int, default=1)
    ap.add_argument("--block", type=int, default=128)
    ap.add_argument("--repeat", type=int, default=50)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    isa = _get_attn_isa(torch.bfloat16, args.block, DIM)
    layout = TileLayout(args.block, DIM, torch.bfloat16, isa)
    gen = torch.Generator().manual_seed(0)
    n_blocks = -(-args.tokens // args.block)
    r = args.requests
    cache = torch.randn(4 * n_blocks * r, HEADS, args.block, 2 * DIM, generator=gen).to(torch.bfloat16)
    # scattered, as a pool hands them out
    table = torch.randperm(4 * n_blocks * r, generator=gen)[: n_blocks * r].int().view(r, n_blocks)
    times: dict[str, list[float]] = {"compact": [], "move": []}
    for _ in range(args.warmup + args.repeat):
        kept = [
            torch.randperm(args.tokens, generator=gen)[: args.keep].sort().values for _ in range(r * HEADS)
        ]
        slots = torch.stack(kept).view(r, HEADS, args.keep)
        read = layout.read(cache, table, args.tokens)
        start = time.perf_counter()
        layout.compact(cache, table, slots, [args.keep] * r, read)
        times["compact"].append(time.perf_counter() - start)
        start = time.perf_counter()
        layout.move(cache, table, slots, [args.keep] * r)
        times["move"].append(time.perf_counter() - start)
    ms = {name: 1e3 * statistics.median(t[args.warmup :]) for name, t in times.items()}
    print(
        f"{isa}, blocks of {args.block}: {r} request(s), {args.keep} of {args.tokens} slots, {HEADS} heads: "
        f"compact {ms['compact']:.3f} ms, move {ms['move']:.3f} ms"
    )
    if args.out:
        record = {"args": vars(args) | {"out": str(args.out)}, "isa": isa, "median_ms": ms}
        args.out.write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
