"""Serving at fixed memory in vLLM (CPU build): plain vLLM against reasonkv's methods.

Every run gets the same KV pool (`--blocks` blocks of `--block-size` tokens) and the same N
prompts, each generating exactly `--new-tokens` tokens (ignore_eos, greedy). Reported per run:
aggregate output tokens/s, the most requests running at once and the mean (over all steps, and
"queued": over the steps where some request waits, i.e. where the pool is the limit), preemptions, vLLM's
KV-usage figure (mean over steps), time to first token and time per output token (medians over
requests), and each run's ratio to plain vLLM. "plain" is vLLM with the plugin installed and off
(tests/vllm_adapter prove its tokens equal vLLM's without the plugin; it still counts scheduler
steps for the table). Runs go one after another, each in a fresh process (a vLLM engine spawns
processes of its own); plain vLLM runs first and last, so drift on a busy machine shows as the
gap between its two runs.

`--shared-prefix N` puts one system prompt of N tokens before every request's own prompt, with
vLLM's prefix caching on (as by default), and reports each run's prefix-cache hit rate (cached
prompt tokens over prompt tokens; the warm-up's blocks are dropped first); `--knobs JSON` gives
every method those knobs, e.g. '{"protect_prompt": true}' (a compressed request shares prompt
blocks only where its prompt is kept whole: serving/prefix_sharing.py).

The run named `short` is the short-context limit: plain vLLM in a pool that holds every request
whole, each generating only `--budget` tokens, so every request holds about what a compressed
one holds and nothing is compressed: what a step costs at that size. The table gives each
run's TPOT against it.

A run named `METHOD@fp8` (also `@fp8_e5m2`; `plain@fp8` for vLLM alone) stores the KV cache in
vLLM's fp8 format, in a pool of the same bytes: `--blocks` counts blocks of the model's dtype,
and an fp8 run gets as many more blocks as its elements are smaller (twice, from bf16). A run
may carry knobs of its own, applied after `--knobs`: `tova:evict_every=64`, `tova:evict_every=64@fp8`.

Run with the vLLM venv's Python; the model is a folder vLLM loads (the default model:
`.venv/bin/python scripts/export_for_vllm.py build/smollm2-135m`):

    .venv-vllm/bin/python benchmarks/vllm_serving.py --model build/smollm2-135m \\
        --requests 16 --new-tokens 4096 --blocks 96 --budget 512 \\
        --methods snapkv,rkv,streaming,h2o,beaconkv --out docs/performance-data/vllm-serving.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PLAIN = "plain"
SHORT = "short"


def worker(spec: dict) -> dict:
    """One engine over the prompts: what it produced and when (runs in its own process)."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    extra = {}
    method, kv, own = split_run(spec["method"])
    if method == SHORT:  # every request whole in the pool (and vLLM's null block), generating `budget` tokens
        longest = max(map(len, spec["prompts"])) + spec["budget"]
        spec = {**spec, "new_tokens": spec["budget"], "max_model_len": longest + spec["block_size"],
                "blocks": spec["requests"] * -(-longest // spec["block_size"]) + 1}  # fmt: skip
    elif method != PLAIN:
        entry = {"method": method, "budget": spec["budget"], **spec["knobs"], **own}
        extra["additional_config"] = {"reasonkv": entry}
    blocks = spec["blocks"]
    if kv != "auto":  # the same bytes: one-byte elements instead of the model dtype's
        import torch

        extra["kv_cache_dtype"] = kv
        blocks *= getattr(torch, spec["dtype"]).itemsize
    llm = LLM(
        model=spec["model"],
        dtype=spec["dtype"],
        max_model_len=spec["max_model_len"],
        enforce_eager=True,
        block_size=spec["block_size"],
        num_gpu_blocks_override=blocks,
        max_num_seqs=spec["requests"],
        disable_log_stats=False,
        seed=0,
        **extra,
    )
    params = SamplingParams(max_tokens=spec["new_tokens"], temperature=0.0, ignore_eos=True, detokenize=False)
    prompts = [TokensPrompt(prompt_token_ids=p) for p in spec["prompts"]]
    llm.generate(prompts[:1], SamplingParams(max_tokens=4, detokenize=False), use_tqdm=False)  # warm-up
    if not llm.reset_prefix_cache():  # the timed requests find only what they cache themselves
        raise RuntimeError("vLLM did not drop the warm-up's cached blocks")
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - start
    ttft, tpot, preempted = [], [], 0
    for out in outputs:
        m = out.metrics
        n = len(out.outputs[0].token_ids)
        if m is not None and m.first_token_ts and m.last_token_ts:
            ttft.append(m.first_token_latency)
            tpot.append((m.last_token_ts - m.first_token_ts) / max(n - 1, 1))
            preempted += m.num_preemptions
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    cached = sum(o.num_cached_tokens or 0 for o in outputs)
    prompt_tokens = sum(len(p) for p in spec["prompts"])
    return {"wall_s": wall, "tokens": tokens, "ttft_s": ttft, "tpot_s": tpot, "preemptions": preempted,
            "prefix_hit_rate": cached / prompt_tokens}  # fmt: skip


def split_run(name: str) -> tuple[str, str, dict]:
    """A run's method, KV cache dtype and own knobs: "snapkv@fp8" -> ("snapkv", "fp8", {}),
    "tova:evict_every=64" -> ("tova", "auto", {"evict_every": 64}) (read as the CLI reads
    `method:key=value`)."""
    from reasonkv.cli.common import CliError, parse_method_entry

    entry, _, kv = name.partition("@")
    try:
        method, knobs = parse_method_entry(entry)
    except CliError as error:
        raise SystemExit(f"vllm_serving: {error}") from None
    return method, kv or "auto", knobs


def run(spec: dict, trace: Path) -> dict:
    """`worker` in a fresh interpreter, with the adapter's per-step trace."""
    with tempfile.TemporaryDirectory() as tmp:
        spec_path, out_path = Path(tmp) / "spec.json", Path(tmp) / "out.json"
        spec_path.write_text(json.dumps(spec))
        # Step counts only: the kept-index records (every layer's whole cache at each
        # compression, every step for H2O) would be written inside the timed run.
        env = {
            **os.environ,
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "REASONKV_VLLM_TRACE": str(trace),
            "REASONKV_VLLM_TRACE_KINDS": "step",
        }
        cmd = [sys.executable, __file__, "--worker", str(spec_path), str(out_path)]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"{spec['method']} failed:\n{proc.stderr[-3000:]}")
        return json.loads(out_path.read_text())


def summarise(method: str, result: dict, trace: Path) -> dict:
    steps = []
    if trace.exists():
        with trace.open() as lines:  # line by line: a trace may be long
            steps = [s for s in map(json.loads, lines) if s["kind"] == "step"]
    row = {
        "method": method,
        "tok_s": result["tokens"] / result["wall_s"],
        "wall_s": result["wall_s"],
        "tokens": result["tokens"],
        "preemptions": result["preemptions"],
        "prefix_hit_rate": result["prefix_hit_rate"],
        "ttft_s": statistics.median(result["ttft_s"]) if result["ttft_s"] else None,
        "tpot_s": statistics.median(result["tpot_s"]) if result["tpot_s"] else None,
    }
    if steps:
        row["most_running"] = max(s["running"] for s in steps)
        row["mean_running"] = statistics.fmean(s["running"] for s in steps)
        queued = [s["running"] for s in steps if s["waiting"]]  # the tail, where none waits, left out
        row["mean_running_queued"] = statistics.fmean(queued) if queued else None
        row["mean_kv_usage"] = statistics.fmean(s["usage"] for s in steps)
    return row


def prompts(n: int, length: int, vocab: int, shared: int = 0, seed: int = 0) -> list[list[int]]:
    """n prompts of `length` + 8 i tokens each, after one shared prefix of `shared` tokens."""
    import random

    rng = random.Random(seed)
    prefix = [rng.randrange(100, vocab) for _ in range(shared)]
    return [prefix + [rng.randrange(100, vocab) for _ in range(length + 8 * i)] for i in range(n)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    parser.add_argument("--model", default="build/smollm2-135m")
    parser.add_argument("--methods", default="snapkv,rkv,streaming,h2o,beaconkv")
    parser.add_argument("--budget", type=int, default=512)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--shared-prefix", type=int, default=0, help="a system prompt's tokens before each")
    parser.add_argument("--knobs", type=json.loads, default={}, help="JSON object of knobs for every method")
    parser.add_argument("--new-tokens", type=int, default=4096)
    parser.add_argument("--blocks", type=int, default=96)
    parser.add_argument("--block-size", type=int, default=128)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--out", type=Path, help="JSON record, written after every run; rerun to resume")
    parser.add_argument(
        "--no-plain-last",
        dest="plain_last",
        action="store_false",
        help="Run plain vLLM first only (by default it runs first and last, to show drift)",
    )
    parser.add_argument(
        "--no-plain",
        dest="plain",
        action="store_false",
        help="Do not run plain vLLM (its run at fixed memory is the longest; the methods compare "
        "with each other and with `short`, and the x plain column stays empty)",
    )
    args = parser.parse_args()
    if args.worker:
        spec = json.loads(Path(args.worker[0]).read_text())
        Path(args.worker[1]).write_text(json.dumps(worker(spec)))
        return
    vocab = json.loads((Path(args.model) / "config.json").read_text())["vocab_size"]
    base = {
        "model": str(args.model), "dtype": args.dtype, "budget": args.budget, "knobs": args.knobs,
        "requests": args.requests, "new_tokens": args.new_tokens, "blocks": args.blocks,
        "block_size": args.block_size, "shared_prefix": args.shared_prefix,
        "prompts": prompts(args.requests, args.prompt_tokens, vocab, args.shared_prefix),
        "max_model_len": args.shared_prefix + args.prompt_tokens + 8 * args.requests + args.new_tokens
        + args.block_size,
    }  # fmt: skip
    order = [*([PLAIN] if args.plain else []), *args.methods.split(",")]
    order += [PLAIN] if args.plain and args.plain_last else []
    for name in order:  # before any engine starts
        method, _, own = split_run(name)
        if own and method in (PLAIN, SHORT):
            raise SystemExit(f"vllm_serving: run {name!r} has knobs, but {method!r} compresses nothing")
    settings = {k: v for k, v in base.items() if k != "prompts"}
    command = " ".join([Path(sys.executable).name, *sys.argv])
    rows = resumed(args.out, settings, order)
    with tempfile.TemporaryDirectory() as tmp:
        for i, method in enumerate(order):
            if i < len(rows):
                print(f"[{i + 1}/{len(order)}] {method}: done before ({rows[i]['tok_s']:.1f} tok/s)")
                continue
            trace = Path(tmp) / f"{i}-{method}.trace"
            print(f"[{i + 1}/{len(order)}] {method} ...", flush=True)
            row = summarise(method, run({**base, "method": method}, trace), trace)
            rows.append(row)
            print(
                f"    {row['tok_s']:.1f} tok/s, {row['preemptions']} preemptions, {row['wall_s']:.0f} s",
                flush=True,
            )
            if args.out:  # after every run: an interrupted benchmark resumes from here
                save(args.out, command, settings, order, rows)
    plain_runs = [r["tok_s"] for r in rows if r["method"] == PLAIN]
    plain = statistics.fmean(plain_runs) if plain_runs else None

    print(f"\n{'method':<24}{'tok/s':>8}{'x plain':>9}{'running':>9}{'mean':>7}{'queued':>7}{'preempt':>9}"
          f"{'KV use':>8}{'TTFT s':>8}{'TPOT ms':>9}{'x short':>8}{'hit %':>7}")  # fmt: skip
    short = next((r["tpot_s"] for r in rows if r["method"] == SHORT and r["tpot_s"]), None)
    for r in rows:
        r["vs_plain"] = None if plain is None else r["tok_s"] / plain
        vs_plain = f"{'-':>9}" if plain is None else f"{r['vs_plain']:>9.2f}"
        running = (
            f"{r['most_running']:>9}{r['mean_running']:>7.1f}" if "most_running" in r else f"{'-':>9}{'-':>7}"
        )
        queued = r.get("mean_running_queued")
        running += f"{queued:>7.1f}" if queued is not None else f"{'-':>7}"
        usage = f"{r['mean_kv_usage']:>8.2f}" if "mean_kv_usage" in r else f"{'-':>8}"
        ttft = f"{r['ttft_s']:>8.2f}" if r["ttft_s"] is not None else f"{'-':>8}"
        tpot = f"{1000 * r['tpot_s']:>9.1f}" if r["tpot_s"] is not None else f"{'-':>9}"
        hits = f"{100 * r['prefix_hit_rate']:>7.1f}" if "prefix_hit_rate" in r else f"{'-':>7}"
        if short and r["tpot_s"] is not None:
            r["tpot_vs_short"] = r["tpot_s"] / short
        vs_short = f"{r['tpot_vs_short']:>8.2f}" if "tpot_vs_short" in r else f"{'-':>8}"
        print(
            f"{r['method']:<24}{r['tok_s']:>8.1f}{vs_plain}{running}{r['preemptions']:>9}{usage}{ttft}"
            f"{tpot}{vs_short}{hits}"
        )
    if args.out:
        save(args.out, command, settings, order, rows)


def resumed(out: Path | None, settings: dict, order: list[str]) -> list[dict]:
    """The rows an earlier, interrupted run of the same settings and order left in `out`."""
    if out is None or not out.exists():
        return []
    record = json.loads(out.read_text())
    if record.get("settings") != settings or record.get("order") != order:
        raise SystemExit(f"{out} holds a run of other settings or methods: move it, or pass another --out")
    return record["rows"]


def save(out: Path, command: str, settings: dict, order: list[str], rows: list[dict]) -> None:
    # Notes added to the record by hand (which code ran, why it stopped) survive a resume.
    kept = json.loads(out.read_text()) if out.exists() else {}
    record = {
        **kept,
        "command": command,
        "settings": settings,
        "order": order,
        "complete": len(rows) == len(order),
        "cpus": os.cpu_count(),
        "load": os.getloadavg(),
        "rows": rows,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
