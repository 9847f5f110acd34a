"""torch.profiler over a few decode steps at a chosen context, grouped by what the time went to."""

from __future__ import annotations

import time

import torch

from reasonkv.core.hf_compat import cache_arg
from reasonkv.harness.bench.runs import BenchRun
from reasonkv.harness.bench.timing import SectionTimer, instrument
from reasonkv.methods.api import make_cache

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
    cache = make_cache(model, run.resolved)
    timer = SectionTimer(label=True)
    instrument(cache, timer)
    device = next(model.parameters()).device  # tokenizers give CPU tensors; the model may be on a GPU
    ids = torch.cat([prompt_ids[0].to(device), tokens.to(device)])[None]
    p = int(prompt_ids.shape[1])
    model(input_ids=ids[:, :p], **cache_arg(cache), logits_to_keep=1)
    pos = p
    while pos < p + context:
        plan = chunk_plan(cache)
        k = p + context - pos if plan is None else min(plan, p + context - pos)
        model(input_ids=ids[:, pos : pos + k], **cache_arg(cache), logits_to_keep=1)
        pos += k
    clock = time.perf_counter
    start = clock()
    for _ in range(steps):  # unprofiled: the honest wall time of these steps
        model(input_ids=ids[:, pos : pos + 1], **cache_arg(cache))
        pos += 1
    plain = (clock() - start) / steps
    timer.reset()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = clock()
        for _ in range(steps):
            model(input_ids=ids[:, pos : pos + 1], **cache_arg(cache))
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
