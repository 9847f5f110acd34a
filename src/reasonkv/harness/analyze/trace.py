"""One trace, analysed: a full-cache replay that records attention, and method lanes beside it.

A survey pass finds each head's persistent keys (and the layers to draw); the main pass
replays the trace once more through the observer cache (see recorder.py) and, in lock-step,
through each method's cache, in chunks that end where single-token decoding would compress
(as `reasonkv replay` does). The step at which each method evicted each token gives its
missed revisits (see revisits.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from reasonkv.core.hf_compat import cache_arg
from reasonkv.core.models import model_shape
from reasonkv.harness.analyze.recorder import Recorder, observer_cache
from reasonkv.harness.analyze.results import MethodResult, TraceAnalysis
from reasonkv.harness.analyze.revisits import (
    NEVER_EVICTED,
    RevisitRule,
    approx_far_fraction,
    distance_edges,
    eligible,
    far_support,
    persistent_keys,
    pick_layers,
    update_eviction_times,
)
from reasonkv.harness.replay import chunk_plan, compare_to_reference, reference_stats
from reasonkv.methods.api import make_cache


@dataclass
class _Lane:
    result: MethodResult
    cache: object
    compressions_seen: int = 0


def _track_evictions(lane: _Lane) -> None:
    """After a forward: give every token the cache no longer holds its eviction time."""
    cache = lane.cache
    if cache.n_compressions == lane.compressions_seen:
        return  # nothing compressed since the last look
    lane.compressions_seen = cache.n_compressions
    evicted = lane.result.evicted_at
    n = evicted.shape[-1]
    for li, layer in enumerate(cache.layers):
        index = layer.token_index[0, :, : layer.used].cpu()  # [H, used]
        kept = torch.zeros(index.shape[0], n + 1, dtype=torch.bool)
        kept.scatter_(1, index.clamp(max=n), True)  # EMPTY -> the scratch column n
        evicted[li] = update_eviction_times(evicted[li], kept[:, :n], layer.seen)


def _survey(model, ids: torch.Tensor, prompt_len: int, recorder: Recorder, block: int, progress) -> None:
    cache = observer_cache(model, recorder)
    model(input_ids=ids[:, :prompt_len], **cache_arg(cache), logits_to_keep=1)
    for a in range(prompt_len, ids.shape[1], block):
        model(input_ids=ids[:, a : a + block], **cache_arg(cache), logits_to_keep=1)
        if progress is not None:
            progress("survey", min(block, ids.shape[1] - a))


def analyze_trace(
    model,
    input_ids: torch.Tensor,
    prompt_len: int,
    rule: RevisitRule,
    *,
    trace_id: str = "trace",
    stride: int = 1,
    window: int = 256,
    layers: list[int] | tuple[int, ...] | None = None,
    n_auto: int = 3,
    needed_mass: float = 0.5,
    runs: list | tuple = (),
    block: int = 256,
    stepwise: bool = False,
    progress: Callable[[str, int], None] | None = None,
) -> TraceAnalysis:
    """Replay one trace (input_ids [1, n], the first `prompt_len` tokens the prompt) with the
    full cache, recording the statistics of every `stride`-th trace query, and replay each of
    `runs` (ReplayRun) in lock-step: when it evicted each token, and its fidelity to the full
    cache (mean KL and top-1 agreement, as `reasonkv replay` measures them).

    layers: where the attention rows of the last `window` queries and the pre-RoPE queries are
    kept; None = the `n_auto` layers with the most global queries. stepwise: the method caches
    take one token per forward. progress(stage, k): k more positions ("survey", then "replay").
    """
    if input_ids.dim() != 2 or input_ids.shape[0] != 1:
        raise ValueError(f"analyze takes one trace: input_ids [1, n], got {tuple(input_ids.shape)}")
    n = int(input_ids.shape[1])
    if not 1 <= prompt_len < n - 1:
        raise ValueError(f"need 1 <= prompt_len < n - 1 (a trace of 2+ tokens); got {prompt_len}, n={n}")
    if stride < 1 or block < 1 or window < 1:
        raise ValueError("stride, block and window must be positive")
    shape = model_shape(model)
    bad = [i for i in (layers or ()) if not 0 <= i < shape.n_layers]
    if bad:
        raise ValueError(f"layer(s) {bad} out of range: the model has {shape.n_layers} layers (0-based)")
    window = min(window, n - prompt_len)
    edges = distance_edges(n)
    device = next(model.parameters()).device
    ids = input_ids.to(device)
    start = time.perf_counter()
    common = {"rule": rule, "prompt_len": prompt_len, "n_tokens": n, "stride": stride, "edges": edges}

    persistent = torch.zeros(shape.n_layers, shape.n_kv_heads, n, dtype=torch.bool)
    with torch.no_grad():
        # Survey pass: the heads' persistent keys, and the layers to draw when none are given
        # (the most global queries, as approx_far_fraction estimates them).
        if rule.persistent is not None or layers is None:
            survey = Recorder(**common, survey=True)
            _survey(model, ids, prompt_len, survey, block, progress)
            trace_pos = torch.arange(prompt_len, n, stride)
            support = far_support(trace_pos[eligible(trace_pos, rule)], n, rule)
            share = torch.zeros(shape.n_layers, shape.n_kv_heads)
            for li, tops in survey.tops.items():
                top = torch.cat(tops, dim=1)
                persistent[li] = persistent_keys(top, support, rule)
                f = approx_far_fraction(
                    top,
                    torch.cat(survey.top_weights[li], 1),
                    torch.cat(survey.totals[li], 1),
                    persistent[li],
                    rule,
                )
                share[li] = (f >= rule.fraction).float().mean(-1)
            if layers is None:
                layers = pick_layers(share, n_auto)
    recorder = Recorder(
        **common,
        excluded=torch.cat([persistent, torch.ones(*persistent.shape[:2], 1, dtype=torch.bool)], -1),
        layers=frozenset(layers),
        map_start=n - window,
        needed_mass=needed_mass,
    )
    observer = observer_cache(model, recorder)
    lanes = []
    for run in runs:
        evicted = torch.full((shape.n_layers, shape.n_kv_heads, n), NEVER_EVICTED, dtype=torch.long)
        result = MethodResult(run.label, run.method, run.budget, dict(run.knobs), evicted)
        lanes.append(_Lane(result, make_cache(model, run.resolved)))
    end = n - 1  # the last token predicts nothing: it is fed to the observer alone at the end
    with torch.no_grad():
        model(input_ids=ids[:, :prompt_len], **cache_arg(observer), logits_to_keep=1)
        for lane in lanes:
            t0 = time.perf_counter()
            model(input_ids=ids[:, :prompt_len], **cache_arg(lane.cache), logits_to_keep=1)
            _track_evictions(lane)
            lane.result.seconds += time.perf_counter() - t0
        for a in range(prompt_len, end, block):
            b = min(a + block, end)
            targets = ids[0, a + 1 : b + 1]
            out = model(input_ids=ids[:, a:b], **cache_arg(observer), logits_to_keep=0 if lanes else 1)
            ref = reference_stats(out.logits[0], targets) if lanes else None
            del out
            for lane in lanes:
                t0 = time.perf_counter()
                _advance(model, lane, ids, a, b, ref, targets, stepwise)
                lane.result.seconds += time.perf_counter() - t0
            del ref  # [block, vocab] twice: freed before the next block
            if progress is not None:
                progress("replay", b - a)
        model(input_ids=ids[:, end:], **cache_arg(observer), logits_to_keep=1)
        if progress is not None:
            progress("replay", 1)
    for lane in lanes:
        lane.result.compressions = lane.cache.n_compressions
    return _assemble(
        recorder, persistent, input_ids[0].cpu(), trace_id, shape, lanes, time.perf_counter() - start
    )


def _advance(model, lane: _Lane, ids, a, b, ref, targets, stepwise) -> None:
    """Feed [a, b) to the lane's cache in chunks that end at its compression points."""
    pos = a
    while pos < b:
        plan = 1 if stepwise else chunk_plan(lane.cache)
        k = b - pos if plan is None else min(plan, b - pos)
        layers = [layer for layer in lane.cache.layers if layer.is_initialized]
        live = sum(float(layer.n_valid.double().mean()) for layer in layers) / max(1, len(layers))
        # The i-th token of the chunk sees the cache before it plus i tokens (compression comes after).
        lane.result.live_weighted += k * live + k * (k + 1) / 2
        logits = model(input_ids=ids[:, pos : pos + k], **cache_arg(lane.cache)).logits[0]
        cmp = compare_to_reference(
            {name: t[pos - a : pos - a + k] for name, t in ref.items()},
            logits,
            targets[pos - a : pos - a + k],
        )
        lane.result.kl_sum += float(cmp["kl"].sum())
        lane.result.top1_sum += float(cmp["top1"].sum())
        lane.result.positions += k
        lane.result.forwards += 1
        _track_evictions(lane)
        pos += k


def _assemble(recorder: Recorder, persistent, ids, trace_id: str, shape, lanes, seconds) -> TraceAnalysis:
    layers = sorted(recorder.stats)

    def stack(name: str) -> torch.Tensor:
        # per layer: blocks of [H, r, ...] -> [H, N, ...]; then [L, H, N, ...]
        return torch.stack([torch.cat(recorder.stats[li][name], dim=1) for li in layers])

    positions = torch.cat(recorder.positions)
    far = stack("far")
    rule = recorder.rule
    elig = eligible(positions, rule)
    return TraceAnalysis(
        trace_id=trace_id,
        input_ids=ids,
        prompt_len=recorder.prompt_len,
        rule=rule,
        stride=recorder.stride,
        positions=positions,
        persistent=persistent,
        far_frac=far,
        is_global=elig[None, None, :] & (far >= rule.fraction),  # `classify`, from the stored fractions
        eligible=elig,
        mean_dist=stack("mean_dist"),
        dist_hist=stack("hist"),
        edges=recorder.edges,
        entropy=stack("entropy"),
        needed=stack("needed"),
        needed_weight=stack("weight"),
        needed_mass=recorder.needed_mass,
        maps={li: torch.cat(parts, dim=1) for li, parts in recorder.maps.items()},
        map_positions=torch.arange(recorder.map_start, recorder.n_tokens),
        pre_queries={li: torch.cat(parts, dim=0) for li, parts in recorder.pre.items()},
        group_size=shape.group_size,
        layers=sorted(recorder.layers),
        methods=[lane.result for lane in lanes],
        seconds=seconds,
    )
