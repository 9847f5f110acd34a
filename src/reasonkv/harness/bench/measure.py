"""Measuring runs on the reference's tokens, and each run's numbers as ratios to the reference's."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from reasonkv.core.cache import CompressedCache
from reasonkv.harness.bench.decode import (
    SAMPLE_EVERY,
    DecodeTrace,
    Progress,
    decode_many,
    eos_ids,
    reference_tokens,
)
from reasonkv.harness.bench.memory import max_rss, release_memory
from reasonkv.harness.bench.runs import BASELINE, BenchRun, is_plain_reference, reference_method, windows_of
from reasonkv.harness.bench.timing import SCORING, SELECTION, SectionTimer, instrument
from reasonkv.methods.api import make_cache


def _timed_cache(model, run: BenchRun, cache: CompressedCache | None = None):
    cache = cache if cache is not None else make_cache(model, run.resolved)
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
        **run.to_dict(),
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
        # The cache's meter: every moment counts, a layer holding old and new storage included.
        "peak_kv_bytes": cache.kv_meter.peak,
        "sampled_peak_kv_bytes": max(samples["kv_bytes"], default=0),
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
        "compressions": cache.n_compressions,
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
    """Teacher-force `tokens` through a fresh cache per run and measure each (see the package doc).

    interleave=False: one run after the other, each from a clean memory baseline (its RSS is
    its own). interleave=True: all runs advance step by step together, so a busy machine slows
    them alike and the ratios stay fair; RSS is then the process's and not attributed.
    `caches` may be given (built for these runs) to inspect them afterwards.
    """
    n = max(lengths)
    suppress = eos_ids(model)
    caches = caches if caches is not None else [None] * len(runs)
    pairs = list(zip(runs, caches, strict=True))
    if interleave:  # one decode pass advances every run
        passes = [("all runs, interleaved", pairs)]
    else:  # one pass per run
        passes = [(run.label, [(run, c)]) for run, c in pairs]
    results = []
    for label, group in passes:
        release_memory()
        timed = [_timed_cache(model, run, c) for run, c in group]
        tick = None if progress is None else (lambda k, label=label: progress(label, k))
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
        results += [
            _result(run, c, t, tr, tokens, n, window)
            for (run, _), (c, t), tr in zip(group, timed, traces, strict=True)
        ]
    return results


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b == 0 else a / b


def add_ratios(results: list[dict], baseline: str = BASELINE) -> None:
    """Each run's numbers as ratios to the reference's (the run that keeps every token), and
    its overhead over `baseline` at the same budget (`overhead_vs_<baseline>`; see BASELINE)."""
    full = next((r for r in results if is_plain_reference(r)), None)
    # The plain baseline only: a `streaming:kv_bits=4` variant (label with its knobs) is not it.
    same_size = {r["budget"]: r for r in results if r["label"] == f"{baseline}@{r['budget']}"}
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
        base = same_size.get(r["budget"])
        if base is not None and r is not base:
            # Extra decode time over a cache of the same size, as a share of this method's
            # time: per window and overall.
            ratios[f"overhead_vs_{baseline}"] = 1 - base["decode_seconds"] / max(r["decode_seconds"], 1e-12)
            ratios[f"overhead_vs_{baseline}_windows"] = [
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
    baseline: str = BASELINE,
) -> dict:
    """Generate the reference tokens with the cache that keeps every token, then measure every
    run on them (`measure_runs`) and add ratios (`add_ratios`, overhead over `baseline`).
    progress(label, k): k more decode steps done in the pass `label`."""
    lengths = sorted(set(int(x) for x in lengths))
    if not lengths or lengths[0] <= 0:
        raise ValueError(f"lengths must be positive token counts, got {lengths}")
    if not runs:
        raise ValueError("nothing to measure: no runs")
    n = lengths[-1]

    def tick(label: str) -> Progress | None:
        return None if progress is None else (lambda k: progress(label, k))

    start = time.perf_counter()
    ref = reference_tokens(model, prompt_ids, n, progress=tick(f"reference ({reference_method()}, greedy)"))
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
    add_ratios(results, baseline)
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
