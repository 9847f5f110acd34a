"""What reading one layer of quantized K/V costs: `QuantizedKVStorage._read()` per decode step.

A decode step with kv_bits < 16 reads every layer once: it dequantizes the quantized part of
keys and values and appends the full-precision residual (a transient view, dropped at the
step's end). This times that read and drop for one layer of the default model's shape (3 KV
heads, head dim 64, batch 1) holding `--tokens` tokens (group 16, residual 32), the median
of `--repeat` reads after a warm-up, on `--threads` threads; and counts the aten ops one read
dispatches (all, and the ones that run a kernel: no views, no bare allocations). Multiply by
the layers (30 for the default model) for one step. `--basis` adds reads of keys stored
before RoPE and in the Hadamard basis (`pre_rope`, `hadamard`), which turn them back.

    nice -n 10 env PYTHONPATH=src .venv/bin/python benchmarks/dequant_speed.py --out dequant.json

To compare two commits, run it with PYTHONPATH pointing at each checkout's src/.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
ALLOCATIONS = {"aten.empty.memory_format", "aten.new_empty.default", "aten.empty_strided.default"}


BASES = {"none": {}, "pre_rope": {"pre_rope": True}, "hadamard": {"hadamard": True}}
BASES["both"] = {**BASES["pre_rope"], **BASES["hadamard"]}


def layer_storage(
    tokens: int, bits: int, dtype: torch.dtype, heads: int, dim: int, seed: int, basis: str = "none"
):
    """A quantized storage of one layer holding `tokens` tokens, laid out as decoding leaves it
    (the quantized part in whole groups with room to grow, the rest in the residual)."""
    from reasonkv.core.kv_basis import QuantizationBasis
    from reasonkv.core.memory_meter import MemoryMeter
    from reasonkv.core.quantize import KVFormat
    from reasonkv.core.quantized_storage import QuantizedKVStorage

    gen = torch.Generator().manual_seed(seed)
    fmt = KVFormat(kv_bits=bits, **BASES[basis])
    rope = QuantizationBasis(fmt, 1.0 / 10000 ** (torch.arange(0, dim, 2).float() / dim))
    storage = QuantizedKVStorage(1, heads, torch.device("cpu"), fmt, meter=MemoryMeter(), basis=rope)
    channel_range = 1 + 4 * torch.rand(dim, generator=gen)  # keys: outlier channels
    keys = (torch.randn(1, heads, tokens, dim, generator=gen) * channel_range).to(dtype)
    values = torch.randn(1, heads, tokens, dim, generator=gen).to(dtype)
    storage.ensure_capacity(tokens, tokens + 64, keys, values)
    storage.append(keys, values, 0)
    storage.record_positions(torch.arange(tokens)[None], torch.arange(tokens)[None])
    storage.settle()
    return storage


class _CountOps(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops = self.kernels = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        self.kernels += not func.is_view and str(func) not in ALLOCATIONS
        return func(*args, **(kwargs or {}))


def time_read(storage, repeat: int) -> dict:
    def read() -> None:
        storage._read()
        storage._drop_view()

    from reasonkv.core.quantize import dequantize
    from reasonkv.core.quantized_slots import head_slots

    keys, values = storage._read()  # a check: the read is the stored part dequantized, then the residual
    n, rest = storage.q_used, storage.used - storage.q_used
    for got, q, res in ((keys, storage.kq, storage.k_res), (values, storage.vq, storage.v_res)):
        want = torch.cat([dequantize(head_slots(q, n), res.dtype), res[:, :, :rest]], 2)
        assert not storage.basis.identity or torch.equal(got, want), "the read differs from dequantize"
    storage._drop_view()
    with _CountOps() as count:
        read()
    for _ in range(10):
        read()
    seconds = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        read()
        seconds.append(time.perf_counter() - t0)
    return {
        "ms_median": 1e3 * statistics.median(seconds),
        "ms_min": 1e3 * min(seconds),
        "ops": count.ops,
        "kernels": count.kernels,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", default="512,640", help="tokens held per head (comma-separated)")
    ap.add_argument("--bits", default="4,2", help="kv_bits (comma-separated: 8, 4, 2)")
    ap.add_argument("--dtypes", default="fp32,bf16", help="model dtypes (comma-separated: fp32, bf16, fp16)")
    ap.add_argument("--basis", default="none", help=f"stored bases (comma-separated: {', '.join(BASES)})")
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--layers", type=int, default=30, help="layers per step, for the per-step column")
    ap.add_argument("--repeat", type=int, default=300)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", type=Path, default=None, help="write the table as JSON here")
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    rows = []
    grid = [
        (dtype, bits, tokens, basis)
        for dtype in args.dtypes.split(",")
        for bits in map(int, args.bits.split(","))
        for tokens in map(int, args.tokens.split(","))
        for basis in args.basis.split(",")
    ]
    for dtype, bits, tokens, basis in grid:
        storage = layer_storage(tokens, bits, DTYPES[dtype], args.kv_heads, args.dim, seed=0, basis=basis)
        row = {"dtype": dtype, "bits": bits, "tokens": tokens, "basis": basis, "quantized": storage.q_used}
        row.update(time_read(storage, args.repeat))
        row["ms_per_step"] = row["ms_median"] * args.layers
        rows.append(row)
    print(
        f"_read() of one layer ({args.kv_heads} KV heads, head dim {args.dim}, batch 1), "
        f"{torch.get_num_threads()} thread(s), median of {args.repeat}; per step: x {args.layers} layers"
    )
    print(
        f"{'dtype':<6}{'bits':>5}{'tokens':>8}{'basis':>10}{'ms/layer':>10}{'min':>8}{'ms/step':>9}{'ops':>6}"
        f"{'kernels':>9}"
    )
    for r in rows:
        print(
            f"{r['dtype']:<6}{r['bits']:>5}{r['tokens']:>8}{r['basis']:>10}{r['ms_median']:>10.3f}{r['ms_min']:>8.3f}"
            f"{r['ms_per_step']:>9.2f}{r['ops']:>6}{r['kernels']:>9}"
        )
    if args.out is not None:
        record = {
            "shape": {"batch": 1, "kv_heads": args.kv_heads, "dim": args.dim, "group": 16, "residual": 32},
            "threads": torch.get_num_threads(),
            "repeat": args.repeat,
            "layers": args.layers,
            "torch": torch.__version__,
            "rows": rows,
        }
        args.out.write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
