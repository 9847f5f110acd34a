"""Speed and memory benchmark: every method decodes exactly the same tokens.

The full cache first writes `n` tokens greedily (EOS suppressed, so it never stops early).
Then every method × budget is *teacher-forced* through those tokens, one token per forward
(`model(input_ids=token, cache=cache)`), so every run does identical model work and the
only differences are the cache's: how many keys attention reads, and what scoring,
selection and compaction cost. Per run we record

- the wall time of every decode step (tokens/s per length window),
- `cache.memory()` at each length mark (physical and K/V bytes), and samples of it in between,
- the process RSS (sampled) and its peak (per run only when runs go one after the other),
- the time spent inside the cache's own work, by wrapping from outside (the cache is not
  modified): `score`, `on_step`, the head split (scoring), `compress` (selection, with
  `_compact` the gather into fresh storage, `_evict_in_place` / `_evict_slot` the holes
  every-step schedules leave between compactions), `update` (the K/V write), `attention_mask`,
  and `after_attention` (all of the post-attention work, window upkeep included),
- top-1 agreement of each step's argmax with the reference's next token (a free fidelity check),

and each as a ratio to the full cache measured in the same process.

Runs go one after the other (each from a clean memory baseline), or interleaved: every run
takes its step i before any takes step i + 1, so on a shared machine a burst of load from
other processes slows all runs alike and the ratios stay fair.

The greedy continuation of a small model may loop after a few hundred tokens; that does not
matter for speed (every run does the same work), only the top-1 column reads high then.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import gc
import os
import platform
import resource
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

from reasonkv.core.cache import CompressedCache, StepTimer
from reasonkv.harness.replay import ReplayRun
from reasonkv.methods.api import make_cache
from reasonkv.methods.registry import get_method
from reasonkv.util.formatting import format_bytes

SAMPLE_EVERY = 32
"""Decode steps between two samples of cache bytes and RSS (outside the timed region)."""

SCORING = ("score", "on_step", "split")
"""Wrapped sections that rank tokens (the scorer and the per-head split)."""
SELECTION = ("compress",)
"""Wrapped sections that choose and move tokens (`compress` includes `_compact`)."""

Progress = Callable[[int], None]


# ----------------------------------------------------------------------- runs
BenchRun = ReplayRun
"""One setting to measure: method, budget (None for `full`), knobs (the replay's run type)."""


def plan_runs(methods: Iterable[str], budgets: Iterable[int], knobs: dict | None = None) -> list[BenchRun]:
    """`full` first (every ratio is to it), then every compressing method × budget. A knob goes
    to each method that has it."""
    knobs = knobs or {}
    names = list(dict.fromkeys(["full", *methods]))
    runs = []
    for name in names:
        spec = get_method(name)
        own = {k: v for k, v in knobs.items() if k in spec.knobs()}
        if spec.compresses:
            runs += [BenchRun(name, int(b), own) for b in dict.fromkeys(budgets)]
        else:
            runs.append(BenchRun(name, None, own))
    return runs


def windows_of(n: int, window: int) -> list[tuple[int, int]]:
    """Decode-step windows [start, end) covering n steps; the last one may be shorter."""
    if window <= 0:
        raise ValueError(f"window must be positive, got {window}")
    return [(a, min(a + window, n)) for a in range(0, n, window)]


# --------------------------------------------------------------------- timing
class SectionTimer(StepTimer):
    """Wall time and call counts of named sections: the cache's own (it opens `section(name)`
    around each part of a step) and any callable wrapped with `wrap`.

    Nested sections each count their own inclusive time (`compress` contains `compact`,
    `after_attention` contains score/on_step/split/compress). With `label=True` each call
    also opens a `torch.profiler.record_function("reasonkv::NAME")`, so a profile shows them.
    """

    def __init__(self, sync: Callable[[], None] | None = None, label: bool = False):
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self.sync = sync
        self.label = label

    @contextlib.contextmanager
    def section(self, name: str):
        ctx = torch.profiler.record_function(f"reasonkv::{name}") if self.label else _NULL
        with ctx:
            start = time.perf_counter()
            try:
                yield
            finally:
                if self.sync is not None:
                    self.sync()
                self.seconds[name] += time.perf_counter() - start
                self.calls[name] += 1

    def wrap(self, name: str, fn: Callable) -> Callable:
        @functools.wraps(fn)
        def timed(*args, **kwargs):
            with self.section(name):
                return fn(*args, **kwargs)

        return timed

    def reset(self) -> None:
        self.seconds.clear()
        self.calls.clear()

    def as_dict(self) -> dict[str, dict]:
        return {k: {"seconds": self.seconds[k], "calls": self.calls[k]} for k in sorted(self.seconds)}

    def total(self, names: Iterable[str]) -> float:
        return sum(self.seconds.get(n, 0.0) for n in names)


_NULL = contextlib.nullcontext()


def instrument(cache: CompressedCache, timer: SectionTimer) -> None:
    """Time the cache's own work through its timer hook."""
    cache.timer = timer


# --------------------------------------------------------------------- memory
def current_rss() -> int | None:
    """Resident set size of this process now, in bytes (None where it cannot be read)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        pass
    try:
        import psutil

        return int(psutil.Process().memory_info().rss)
    except Exception:  # psutil missing or unsupported: RSS is optional
        return None


def max_rss() -> int:
    """The process's RSS high-water mark since it started, in bytes (Linux reports KiB)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


def release_memory() -> None:
    """Free what the previous run left: garbage, then glibc's free lists back to the OS, so
    the next run's RSS is measured from a clean baseline."""
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def cache_bytes(cache: CompressedCache) -> tuple[int, int]:
    """(K/V bytes, all cache tensors' bytes), exactly as cache.memory() counts them, without
    its per-head live counts (cheap enough to call between steps)."""
    kv = total = 0
    for layer in cache.layers:
        if not layer.is_initialized or layer.keys is None:
            continue
        kv += sum(t.numel() * t.element_size() for t in (layer.keys, layer.values))
        total += sum(t.numel() * t.element_size() for t in layer.tensors())
    return kv, total


# --------------------------------------------------------------------- decode
def eos_ids(model) -> list[int]:
    """Token ids that would end generation (suppressed so every run reaches full length)."""
    ids: set[int] = set()
    for cfg in (getattr(model, "generation_config", None), model.config):
        value = getattr(cfg, "eos_token_id", None) if cfg is not None else None
        if value is None:
            continue
        ids.update([value] if isinstance(value, int) else [int(v) for v in value])
    return sorted(ids)


def _argmax(logits: torch.Tensor, suppress: torch.Tensor | None) -> torch.Tensor:
    if suppress is not None:
        logits = logits.index_fill(-1, suppress, float("-inf"))
    return logits.argmax(-1)


@dataclass
class DecodeTrace:
    """What one decode pass recorded for one cache. Step i fed token i (i = 0..n-1)."""

    tokens: torch.Tensor  # [n] the fed tokens
    predicted: torch.Tensor  # [n] argmax after each step (EOS suppressed)
    step_seconds: list[float]
    prefill_seconds: float
    marks: list[dict]
    samples: dict[str, list]
    rss_before: int | None
    rss_peak: int | None


@torch.no_grad()
def decode_many(
    model,
    caches: list[CompressedCache],
    prompt_ids: torch.Tensor,
    n: int,
    *,
    forced: torch.Tensor | None = None,
    marks: Iterable[int] = (),
    sample_every: int = SAMPLE_EVERY,
    suppress: list[int] | None = None,
    progress: Progress | None = None,
) -> list[DecodeTrace]:
    """Prefill `prompt_ids` [1, P] into every cache, then `n` single-token forwards each,
    interleaved: step i runs for every cache (in an order that rotates with i) before step
    i + 1, so load from other processes falls on all of them alike.

    forced=None (one cache only): greedy, token 0 from the prefill, token i+1 = argmax after
    step i, EOS suppressed. forced [n]: every cache is fed exactly those tokens. A greedy pass
    and a forced pass of the same tokens do the same work.
    marks: after step L-1 (L tokens fed), record cache.memory(). Only the forward itself is
    timed; bookkeeping (memory, RSS, argmax) happens outside the timed region. RSS is the
    process's, so it is attributed to a cache only when there is one.
    """
    if prompt_ids.dim() != 2 or prompt_ids.shape[0] != 1:
        raise ValueError(
            f"the benchmark decodes one sequence: prompt_ids [1, P], got {tuple(prompt_ids.shape)}"
        )
    if forced is None and len(caches) != 1:
        raise ValueError("greedy decoding (forced=None) takes exactly one cache")
    if forced is not None and forced.numel() < n:
        raise ValueError(f"{forced.numel()} forced tokens for {n} steps")
    device = next(model.parameters()).device
    sync = torch.cuda.synchronize if device.type == "cuda" else None
    bad = torch.tensor(suppress, device=device) if suppress else None
    marks = set(marks)
    prompt_ids = prompt_ids.to(device)
    own_rss = len(caches) == 1
    clock = time.perf_counter
    count = len(caches)

    rss_before = current_rss() if own_rss else None
    rss_peak = rss_before
    prefill = [0.0] * count
    tokens = forced[:n].to(device) if forced is not None else torch.empty(n, dtype=torch.long, device=device)
    for j, cache in enumerate(caches):
        start = clock()
        out = model(input_ids=prompt_ids, cache=cache, logits_to_keep=1)
        if sync is not None:
            sync()
        prefill[j] = clock() - start
        if forced is None:
            tokens[0] = _argmax(out.logits[0, -1], bad)
        del out
    predicted = torch.empty(count, n, dtype=torch.long, device=device)
    step_seconds = [[0.0] * n for _ in caches]
    record_marks: list[list[dict]] = [[] for _ in caches]
    samples = [{"tokens": [], "kv_bytes": [], "physical_bytes": [], "rss": []} for _ in caches]
    for i in range(n):
        ids = tokens[i : i + 1].view(1, 1)
        fed = i + 1
        for r in range(count):
            j = (i + r) % count
            start = clock()
            out = model(input_ids=ids, cache=caches[j])
            if sync is not None:
                sync()
            step_seconds[j][i] = clock() - start
            predicted[j, i] = _argmax(out.logits[0, -1], bad)
            del out
        if forced is None and fed < n:
            tokens[fed] = predicted[0, i]
        for j, cache in enumerate(caches):
            if fed in marks:
                mem = cache.memory()
                live = mem["live_tokens"]
                record_marks[j].append(
                    {
                        "tokens": fed,
                        "seen": int(mem["seen_tokens"]),
                        "kv_bytes": int(mem["kv_bytes"]),
                        "physical_bytes": int(mem["physical_bytes"]),
                        "live_tokens_mean": float(live.float().mean()) if live is not None else 0.0,
                    }
                )
            if fed % sample_every == 0 or fed in marks or fed == n:
                kv, phys = cache_bytes(cache)
                rss = current_rss() if own_rss else None
                if rss is not None:
                    rss_peak = max(rss_peak or 0, rss)
                for key, value in zip(samples[j], (fed, kv, phys, rss), strict=True):
                    samples[j][key].append(value)
        if progress is not None:
            progress(count)
    return [
        DecodeTrace(
            tokens=tokens.cpu(),
            predicted=predicted[j].cpu(),
            step_seconds=step_seconds[j],
            prefill_seconds=prefill[j],
            marks=record_marks[j],
            samples=samples[j],
            rss_before=rss_before,
            rss_peak=rss_peak,
        )
        for j in range(count)
    ]


def decode(
    model,
    cache: CompressedCache,
    prompt_ids: torch.Tensor,
    n: int,
    **kwargs,
) -> DecodeTrace:
    """`decode_many` for one cache (greedy when `forced` is not given)."""
    return decode_many(model, [cache], prompt_ids, n, **kwargs)[0]


def reference_tokens(
    model, prompt_ids: torch.Tensor, n: int, progress: Progress | None = None
) -> DecodeTrace:
    """The full cache's greedy continuation: n tokens, EOS suppressed (never stops early)."""
    cache = make_cache(model, "full", None)
    return decode(model, cache, prompt_ids, n, suppress=eos_ids(model), progress=progress)


# -------------------------------------------------------------------- measure
def _timed_cache(model, run: BenchRun, cache: CompressedCache | None = None):
    cache = cache if cache is not None else make_cache(model, run.method, run.budget, **run.knobs)
    device = next(model.parameters()).device
    timer = SectionTimer(sync=torch.cuda.synchronize if device.type == "cuda" else None)
    instrument(cache, timer)
    return cache, timer


def _result(
    run: BenchRun, cache, timer: SectionTimer, trace: DecodeTrace, tokens, n: int, window: int
) -> dict:
    steps = trace.step_seconds
    decode_seconds = sum(steps)
    score_seconds = timer.total(SCORING)
    select_seconds = timer.total(SELECTION)
    agree = (trace.predicted[: n - 1] == tokens[1:n].cpu()).double()
    samples = trace.samples
    return {
        "method": run.method,
        "budget": run.budget,
        "knobs": dict(run.knobs),
        "label": run.label,
        "steps": n,
        "prefill_seconds": trace.prefill_seconds,
        "decode_seconds": decode_seconds,
        "tokens_per_second": n / max(decode_seconds, 1e-12),
        "windows": [
            {
                "start": a,
                "end": b,
                "seconds": sum(steps[a:b]),
                "tokens_per_second": (b - a) / max(sum(steps[a:b]), 1e-12),
            }
            for a, b in windows_of(n, window)
        ],
        "marks": trace.marks,
        "samples": samples,
        "peak_kv_bytes": max(samples["kv_bytes"], default=0),
        "peak_physical_bytes": max(samples["physical_bytes"], default=0),
        "rss_before": trace.rss_before,
        "rss_peak": trace.rss_peak,
        "rss_peak_delta": None
        if trace.rss_peak is None or trace.rss_before is None
        else trace.rss_peak - trace.rss_before,
        "max_rss": max_rss(),
        "sections": timer.as_dict(),
        "score_seconds": score_seconds,
        "select_seconds": select_seconds,
        "score_select_seconds": score_seconds + select_seconds,
        "score_select_fraction": (score_seconds + select_seconds) / max(decode_seconds, 1e-12),
        "compressions": len(cache.events),
        "top1_agreement": float(agree.mean()) if agree.numel() else None,
        "step_seconds": steps,
    }


def measure_runs(
    model,
    runs: list[BenchRun],
    prompt_ids: torch.Tensor,
    tokens: torch.Tensor,
    lengths: list[int],
    window: int,
    *,
    interleave: bool = False,
    sample_every: int = SAMPLE_EVERY,
    progress: Callable[[str, int], None] | None = None,
    caches: list[CompressedCache] | None = None,
) -> list[dict]:
    """Teacher-force `tokens` through a fresh cache per run and measure each (see module doc).

    interleave=False: one run after the other, each from a clean memory baseline (its RSS is
    its own). interleave=True: all runs advance step by step together, so a busy machine slows
    them alike and the ratios stay fair; RSS is then the process's and not attributed.
    `caches` may be given (built for these runs) to inspect them afterwards.
    """
    n = max(lengths)
    suppress = eos_ids(model)
    caches = caches if caches is not None else [None] * len(runs)
    if interleave:
        release_memory()
        timed = [_timed_cache(model, run, c) for run, c in zip(runs, caches, strict=True)]
        tick = None if progress is None else (lambda k: progress("all runs, interleaved", k))
        traces = decode_many(
            model,
            [c for c, _ in timed],
            prompt_ids,
            n,
            forced=tokens,
            marks=lengths,
            sample_every=sample_every,
            suppress=suppress,
            progress=tick,
        )
        return [
            _result(run, c, t, tr, tokens, n, window)
            for run, (c, t), tr in zip(runs, timed, traces, strict=True)
        ]
    results = []
    for run, given in zip(runs, caches, strict=True):
        release_memory()
        cache, timer = _timed_cache(model, run, given)
        tick = None if progress is None else (lambda k, label=run.label: progress(label, k))
        trace = decode(
            model,
            cache,
            prompt_ids,
            n,
            forced=tokens,
            marks=lengths,
            sample_every=sample_every,
            suppress=suppress,
            progress=tick,
        )
        results.append(_result(run, cache, timer, trace, tokens, n, window))
    return results


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b == 0 else a / b


def add_ratios(results: list[dict]) -> None:
    """Each run's numbers as ratios to the full cache's (and its overhead over `streaming` at
    the same budget: the cost of scoring, since streaming scores nothing)."""
    full = next((r for r in results if r["method"] == "full"), None)
    streaming = {r["budget"]: r for r in results if r["method"] == "streaming"}
    for r in results:
        ratios: dict[str, object] = {}
        if full is not None:
            ratios["tokens_per_second"] = _ratio(r["tokens_per_second"], full["tokens_per_second"])
            ratios["windows"] = [
                _ratio(w["tokens_per_second"], f["tokens_per_second"])
                for w, f in zip(r["windows"], full["windows"], strict=True)
            ]
            fm = {m["tokens"]: m for m in full["marks"]}
            ratios["kv_bytes"] = [_ratio(m["kv_bytes"], fm[m["tokens"]]["kv_bytes"]) for m in r["marks"]]
            ratios["physical_bytes"] = [
                _ratio(m["physical_bytes"], fm[m["tokens"]]["physical_bytes"]) for m in r["marks"]
            ]
            ratios["peak_kv_bytes"] = _ratio(r["peak_kv_bytes"], full["peak_kv_bytes"])
            ratios["rss_peak_delta"] = _ratio(r["rss_peak_delta"], full["rss_peak_delta"])
            ratios["score_select_seconds"] = _ratio(r["score_select_seconds"], full["decode_seconds"])
        base = streaming.get(r["budget"])
        if base is not None and r is not base:
            # Extra decode time over a cache of the same size that scores nothing, as a share
            # of this method's time: per window and overall.
            ratios["overhead_vs_streaming"] = 1 - base["decode_seconds"] / max(r["decode_seconds"], 1e-12)
            ratios["overhead_vs_streaming_windows"] = [
                1 - b["seconds"] / max(w["seconds"], 1e-12)
                for w, b in zip(r["windows"], base["windows"], strict=True)
            ]
        r["ratios"] = ratios


def run_benchmark(
    model,
    prompt_ids: torch.Tensor,
    runs: list[BenchRun],
    lengths: list[int],
    *,
    window: int = 1024,
    interleave: bool = False,
    sample_every: int = SAMPLE_EVERY,
    progress: Callable[[str, int], None] | None = None,
) -> dict:
    """Generate the reference tokens with the full cache, then measure every run on them
    (`measure_runs`). progress(label, k): k more decode steps done in the pass `label`."""
    lengths = sorted(set(int(x) for x in lengths))
    if not lengths or lengths[0] <= 0:
        raise ValueError(f"lengths must be positive token counts, got {lengths}")
    if not runs:
        raise ValueError("nothing to measure: no runs")
    n = lengths[-1]

    def tick(label: str) -> Progress | None:
        return None if progress is None else (lambda k: progress(label, k))

    start = time.perf_counter()
    ref = reference_tokens(model, prompt_ids, n, progress=tick("reference (full, greedy)"))
    reference = {
        "tokens": ref.tokens.tolist(),
        "seconds": ref.prefill_seconds + sum(ref.step_seconds),
        "tokens_per_second": n / max(sum(ref.step_seconds), 1e-12),
    }
    results = measure_runs(
        model,
        runs,
        prompt_ids,
        ref.tokens,
        lengths,
        window,
        interleave=interleave,
        sample_every=sample_every,
        progress=progress,
    )
    add_ratios(results)
    return {
        "prompt_tokens": int(prompt_ids.shape[1]),
        "lengths": lengths,
        "window": window,
        "interleave": interleave,
        "sample_every": sample_every,
        "reference": reference,
        "runs": results,
        "wall_seconds": time.perf_counter() - start,
    }


def prompt_input(tokenizer, text: str) -> torch.Tensor:
    """[1, P] prompt ids as reasonkv.generate feeds them (chat template when there is one)."""
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
        )
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    else:
        ids = tokenizer(text)["input_ids"]
    return torch.tensor([list(ids)], dtype=torch.long)


# ------------------------------------------------------------------ machine
def machine_info() -> dict:
    """Where the numbers come from: CPU, cores, load, threads, versions."""
    import transformers

    cpu = platform.processor()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    mem_total = None
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal"):
                mem_total = int(line.split()[1]) * 1024
    try:
        from importlib.metadata import version

        ours = version("reasonkv")
    except Exception:  # running from a source tree without metadata
        ours = None
    return {
        "platform": platform.platform(),
        "cpu": cpu,
        "cores": os.cpu_count(),
        "memory_bytes": mem_total,
        "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "reasonkv": ours,
    }


# ------------------------------------------------------------------- profile
PROFILE_GROUPS = {
    "attention kernel": ("aten::scaled_dot_product_attention",),
    "linear (QKV/O, MLP, lm_head)": ("aten::linear",),
    "scoring": ("reasonkv::score", "reasonkv::on_step", "reasonkv::split"),
    "selection + compaction": ("reasonkv::compress",),
    "cache write": ("reasonkv::update",),
    "mask building": ("reasonkv::mask",),
}


@torch.no_grad()
def profile_decode(
    model,
    run: BenchRun,
    prompt_ids: torch.Tensor,
    tokens: torch.Tensor,
    context: int,
    steps: int,
    *,
    row_limit: int = 20,
) -> dict:
    """Profile `steps` forced decode steps after `context` generated tokens, with torch.profiler.

    The cache is brought to `context` by feeding chunks that end where step-by-step decoding
    would compress (the replay's chunk plan), so its state is the one decoding would have.
    Returns the wall time per step (unprofiled and profiled), inclusive CPU time per group
    (PROFILE_GROUPS; "after_attention other" is window upkeep and bookkeeping, "rest" the
    remaining framework and Python work) and the profiler's table.
    """
    from torch.profiler import ProfilerActivity, profile

    from reasonkv.harness.replay import chunk_plan

    if tokens.numel() < context + 2 * steps:
        raise ValueError(f"need {context + 2 * steps} tokens, got {tokens.numel()}")
    cache = make_cache(model, run.method, run.budget, **run.knobs)
    timer = SectionTimer(label=True)
    instrument(cache, timer)
    ids = torch.cat([prompt_ids[0], tokens.to(prompt_ids.device)])[None]
    p = int(prompt_ids.shape[1])
    model(input_ids=ids[:, :p], cache=cache, logits_to_keep=1)
    pos = p
    while pos < p + context:
        plan = chunk_plan(cache)
        k = p + context - pos if plan is None else min(plan, p + context - pos)
        model(input_ids=ids[:, pos : pos + k], cache=cache, logits_to_keep=1)
        pos += k
    clock = time.perf_counter
    start = clock()
    for _ in range(steps):  # unprofiled: the honest wall time of these steps
        model(input_ids=ids[:, pos : pos + 1], cache=cache)
        pos += 1
    plain = (clock() - start) / steps
    timer.reset()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = clock()
        for _ in range(steps):
            model(input_ids=ids[:, pos : pos + 1], cache=cache)
            pos += 1
        profiled = (clock() - start) / steps
    averages = prof.key_averages()
    inclusive = {evt.key: evt.cpu_time_total / 1e6 for evt in averages}
    groups = {g: sum(inclusive.get(k, 0.0) for k in keys) / steps for g, keys in PROFILE_GROUPS.items()}
    nested = sum(groups[g] for g in ("scoring", "selection + compaction"))
    groups["after_attention other"] = max(
        0.0, inclusive.get("reasonkv::after_attention", 0.0) / steps - nested
    )
    groups["rest (framework, python, small ops)"] = max(0.0, profiled - sum(groups.values()))
    return {
        "method": run.method,
        "budget": run.budget,
        "label": run.label,
        "context": context,
        "steps": steps,
        "seen_tokens": int(cache.memory()["seen_tokens"]),
        "compressions": timer.calls.get("compress", 0),
        "step_seconds": plain,
        "profiled_step_seconds": profiled,
        "groups_seconds_per_step": groups,
        "table": averages.table(sort_by="cpu_time_total", row_limit=row_limit),
    }


# ----------------------------------------------------------------- reporting
def _fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def summary_table(record: dict):
    """One row per run: speed (first/last window), K/V at the longest length, RSS, scoring cost."""
    from rich import box
    from rich.table import Table

    from reasonkv.util.tables import fill_table

    runs = record["runs"]
    lengths = record["lengths"]
    table = Table(
        title=f"decode speed and memory · prompt {record['prompt_tokens']} + {lengths[-1]} forced tokens",
        caption="tok/s over the first and last windows of decoding; × full: ratio to the full cache in the "
        "same run. KV: K/V storage at the longest length; peak KV: largest seen (sampled). RSS Δ: peak RSS "
        "above the run's start. score+select: share of decode time in scoring, selection and compaction; "
        "vs streaming: extra time over streaming at the same budget. top-1: argmax = reference's next token.",
        box=box.SIMPLE_HEAD,
        caption_justify="left",
    )
    cols = ("method", "budget", "tok/s first", "tok/s last", "× full", "KV", "× full ", "peak KV", "RSS Δ")
    cols += ("score+select", "vs streaming", "top-1")
    rows = []
    for r in runs:
        ratios = r.get("ratios", {})
        last_mark = r["marks"][-1] if r["marks"] else {}
        kv_ratio = (ratios.get("kv_bytes") or [None])[-1]
        win_ratio = (ratios.get("windows") or [None])[-1]
        over = ratios.get("overhead_vs_streaming")
        rows.append(
            [
                r["method"],
                "-" if r["budget"] is None else str(r["budget"]),
                f"{r['windows'][0]['tokens_per_second']:.1f}",
                f"{r['windows'][-1]['tokens_per_second']:.1f}",
                _fmt(win_ratio, ".2f"),
                format_bytes(last_mark.get("kv_bytes")),
                _fmt(kv_ratio, ".3f"),
                format_bytes(r["peak_kv_bytes"]),
                format_bytes(r["rss_peak_delta"]),
                f"{100 * r['score_select_fraction']:.1f}%",
                "-" if over is None else f"{100 * over:+.1f}%",
                _fmt(r["top1_agreement"], ".3f"),
            ]
        )
    return fill_table(table, cols, rows)


def windows_table(record: dict):
    """Tokens/s per window (rows: runs), with the ratio to full."""
    from rich import box
    from rich.table import Table

    table = Table(title="tokens/s per window of decode steps (× full)", box=box.SIMPLE_HEAD)
    table.add_column("run", no_wrap=True)
    for w in record["runs"][0]["windows"]:
        table.add_column(f"{w['start']}–{w['end']}", justify="right", no_wrap=True)
    for r in record["runs"]:
        ratios = r.get("ratios", {}).get("windows") or [None] * len(r["windows"])
        cells = [
            f"{w['tokens_per_second']:.1f}" + ("" if q is None else f" ({q:.2f})")
            for w, q in zip(r["windows"], ratios, strict=True)
        ]
        table.add_row(r["label"], *cells)
    return table


def memory_table(record: dict):
    """K/V bytes at each length mark (rows: runs), with the ratio to full."""
    from rich import box
    from rich.table import Table

    table = Table(title="K/V bytes at each length (× full)", box=box.SIMPLE_HEAD)
    table.add_column("run", no_wrap=True)
    for length in record["lengths"]:
        table.add_column(str(length), justify="right", no_wrap=True)
    for r in record["runs"]:
        ratios = r.get("ratios", {}).get("kv_bytes") or [None] * len(r["marks"])
        cells = [
            format_bytes(m["kv_bytes"]) + ("" if q is None else f" ({q:.3f})")
            for m, q in zip(r["marks"], ratios, strict=True)
        ]
        table.add_row(r["label"], *cells)
    return table


def plot_benchmark(record: dict, directory: str | Path) -> list[Path]:
    """tokens_per_second.png (per window, vs generated length) and kv_bytes.png (sampled K/V
    bytes vs generated length, marks dotted), one line per run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    title = f"prompt {record['prompt_tokens']} tokens · {record.get('model', '')}".strip(" ·")

    fig, ax = plt.subplots(figsize=(7, 4))
    for r in record["runs"]:
        mid = [(w["start"] + w["end"]) / 2 for w in r["windows"]]
        ax.plot(mid, [w["tokens_per_second"] for w in r["windows"]], marker="o", ms=3, label=r["label"])
    ax.set_xlabel("generated tokens (window centre)")
    ax.set_ylabel("decode tokens/s")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(f"decode speed · {title}", fontsize=9)
    fig.tight_layout()
    speed = directory / "tokens_per_second.png"
    fig.savefig(speed, dpi=130)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 4))
    for r in record["runs"]:
        s = r["samples"]
        ax.plot(s["tokens"], [b / 2**20 for b in s["kv_bytes"]], lw=1.2, label=r["label"])
    ax.set_xlabel("generated tokens")
    ax.set_ylabel("K/V storage (MiB)")
    ax.set_yscale("log")
    ax.yaxis.set_major_locator(matplotlib.ticker.LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    ax.yaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
    ax.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.grid(alpha=0.3, which="both")
    for length in record["lengths"]:
        ax.axvline(length, color="grey", lw=0.6, ls=":")
    ax.legend(fontsize=8)
    ax.set_title(f"physical K/V bytes · {title}", fontsize=9)
    fig.tight_layout()
    memory = directory / "kv_bytes.png"
    fig.savefig(memory, dpi=130)
    plt.close(fig)
    return [speed, memory]
