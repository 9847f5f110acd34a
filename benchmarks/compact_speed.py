"""What compacting one layer of quantized K/V costs: time, and bytes held beyond the storage.

An evicting method with kv_bits < 16 compacts a layer when its holes no longer fit: the kept
slots are laid out in fresh storage (`QuantizedKVStorage.compact`). This times that for one
layer of the default model's shape (3 KV heads, head dim 64, batch 1) holding `--tokens`
tokens and keeping `--keep` of them (random, seeded per repeat), the median of `--repeat`
compactions on `--threads` threads, and the most the meter held during one beyond the old
storage, the step's view and the new storage (copies the compaction makes), at 16 bits.

    nice -n 10 env PYTHONPATH=src .venv/bin/python benchmarks/compact_speed.py --out compact.json

To compare two commits, run it with PYTHONPATH pointing at each checkout's src/.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from reasonkv.core.memory_meter import MemoryMeter
from reasonkv.core.quantize import KVFormat
from reasonkv.core.quantized_storage import QuantizedKVStorage

HEADS, DIM = 3, 64


def compact_once(tokens: int, keep: int, group: int, residual: int, seed: int) -> tuple[float, int]:
    """Seconds one compaction takes, and the 16-bit bytes it holds at its peak beyond the old
    storage, the step's view and the new storage."""
    gen = torch.Generator().manual_seed(seed)
    meter = MemoryMeter()
    fmt = KVFormat(kv_bits=4, group_size=group, residual=residual)
    storage = QuantizedKVStorage(1, HEADS, torch.device("cpu"), fmt, meter=meter)
    keys = torch.randn(1, HEADS, tokens, DIM, generator=gen) * (1 + 4 * torch.rand(DIM, generator=gen))
    values = torch.randn(1, HEADS, tokens, DIM, generator=gen)
    storage.ensure_capacity(tokens, tokens + 64, keys, values)
    storage.append(keys, values, 0)
    storage.settle()
    storage.read_keys()  # the step's attention has read the layer
    held = meter.current_16bit
    meter.restart_peak()
    kept = torch.randperm(tokens, generator=gen)[:keep].sort().values.expand(1, HEADS, keep).contiguous()
    start = time.perf_counter()
    storage.compact(kept, torch.full((1, HEADS), keep), keep + 64)
    seconds = time.perf_counter() - start
    storage.settle()  # the step ends: the view goes, the new storage is what is held
    return seconds, meter.peak_16bit - held - meter.current_16bit


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=640)
    ap.add_argument("--keep", type=int, default=560)
    ap.add_argument("--repeat", type=int, default=40)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rows = []
    for group, residual in ((16, 32), (32, 0)):
        runs = [compact_once(args.tokens, args.keep, group, residual, seed) for seed in range(args.repeat)]
        ms = statistics.median(s for s, _ in runs) * 1e3
        extra = max(b for _, b in runs)
        rows.append({"group_size": group, "residual": residual, "median_ms": ms, "extra_bytes_16bit": extra})
        kib = extra / 1024
        print(f"group {group:2d} residual {residual:2d}: {ms:.3f} ms, {kib:.1f} KiB past old + view + new")
    if args.out:
        args.out.write_text(json.dumps({"args": vars(args) | {"out": str(args.out)}, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
