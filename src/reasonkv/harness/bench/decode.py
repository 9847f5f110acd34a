"""The decode loops: prefill, then one token per forward, timed around the forward alone."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from reasonkv.core.cache import CompressedCache
from reasonkv.core.hf_compat import cache_arg
from reasonkv.harness.bench.memory import cache_bytes, current_rss
from reasonkv.harness.bench.runs import reference_method
from reasonkv.methods.api import make_cache

SAMPLE_EVERY = 32
"""Decode steps between two samples of cache bytes and RSS (outside the timed region)."""

Progress = Callable[[int], None]


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

    tokens: torch.Tensor  # [n] the fed tokens (every batch row is fed the same ones)
    predicted: torch.Tensor  # [n] argmax of row 0 after each step (EOS suppressed)
    step_seconds: list[float]
    prefill_seconds: float
    marks: list[dict]
    samples: dict[str, list]
    rss_before: int | None
    rss_peak: int | None
    predicted_rows: torch.Tensor | None = None  # [B, n] every row's argmax (predicted is row 0)

    @property
    def batch(self) -> int:
        return 1 if self.predicted_rows is None else int(self.predicted_rows.shape[0])


@torch.no_grad()
def decode_many(
    model,
    caches: list[CompressedCache],
    prompt_ids: torch.Tensor | list[torch.Tensor],
    n: int,
    *,
    forced: torch.Tensor | None = None,
    marks: Iterable[int] = (),
    sample_every: int = SAMPLE_EVERY,
    suppress: list[int] | None = None,
    progress: Progress | None = None,
) -> list[DecodeTrace]:
    """Prefill `prompt_ids` into every cache, then `n` single-token forwards each,
    interleaved: step i runs for every cache (in an order that rotates with i) before step
    i + 1, so load from other processes falls on all of them alike.

    prompt_ids: [B, P] for every cache, or one [B_j, P] per cache (a batch size per cache;
    the batch-capacity benchmark repeats one prompt B_j times). No padding: every row's
    prompt is P real tokens.
    forced=None (one cache only): greedy, token 0 from the prefill, token i+1 = row 0's argmax
    after step i, EOS suppressed. forced [n]: every cache is fed exactly those tokens. Every
    batch row is fed the same token at each step. A greedy pass and a forced pass of the same
    tokens do the same work.
    marks: after step L-1 (L tokens fed), record cache.memory(). Only the forward itself is
    timed; bookkeeping (memory, RSS, argmax) happens outside the timed region. RSS is the
    process's, so it is attributed to a cache only when there is one.
    """
    prompts = list(prompt_ids) if isinstance(prompt_ids, (list, tuple)) else [prompt_ids] * len(caches)
    if len(prompts) != len(caches):
        raise ValueError(f"{len(prompts)} prompts for {len(caches)} caches")
    for p in prompts:
        if p.dim() != 2 or p.shape[0] < 1 or p.shape[1] != prompts[0].shape[1]:
            raise ValueError(
                f"prompt_ids must be [B, P] with the same P for every cache, got {tuple(p.shape)}"
            )
    if forced is None and len(caches) != 1:
        raise ValueError("greedy decoding (forced=None) takes exactly one cache")
    if forced is not None and forced.numel() < n:
        raise ValueError(f"{forced.numel()} forced tokens for {n} steps")
    device = next(model.parameters()).device
    sync = torch.cuda.synchronize if device.type == "cuda" else None
    bad = torch.tensor(suppress, device=device) if suppress else None
    marks = set(marks)
    prompts = [p.to(device) for p in prompts]
    rows = [p.shape[0] for p in prompts]
    own_rss = len(caches) == 1
    clock = time.perf_counter
    count = len(caches)

    rss_before = current_rss() if own_rss else None
    rss_peak = rss_before
    prefill = [0.0] * count
    tokens = forced[:n].to(device) if forced is not None else torch.empty(n, dtype=torch.long, device=device)
    for j, cache in enumerate(caches):
        start = clock()
        out = model(input_ids=prompts[j], **cache_arg(cache), logits_to_keep=1)
        if sync is not None:
            sync()
        prefill[j] = clock() - start
        if forced is None:
            tokens[0] = _argmax(out.logits[0, -1], bad)
        del out
    predicted = [torch.empty(b, n, dtype=torch.long, device=device) for b in rows]
    step_seconds = [[0.0] * n for _ in caches]
    record_marks: list[list[dict]] = [[] for _ in caches]
    samples = [{"tokens": [], "kv_bytes": [], "physical_bytes": [], "rss": []} for _ in caches]
    for i in range(n):
        token = tokens[i : i + 1].view(1, 1)
        fed = i + 1
        for r in range(count):
            j = (i + r) % count
            ids = token.expand(rows[j], 1)  # every row is fed the same token
            start = clock()
            out = model(input_ids=ids, **cache_arg(caches[j]))
            if sync is not None:
                sync()
            step_seconds[j][i] = clock() - start
            predicted[j][:, i] = _argmax(out.logits[:, -1], bad)
            del out
        if forced is None and fed < n:
            tokens[fed] = predicted[0][0, i]
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
            predicted=predicted[j][0].cpu(),
            step_seconds=step_seconds[j],
            prefill_seconds=prefill[j],
            marks=record_marks[j],
            samples=samples[j],
            rss_before=rss_before,
            rss_peak=rss_peak,
            predicted_rows=predicted[j].cpu(),
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
    """The reference cache's greedy continuation: n tokens, EOS suppressed (never stops early)."""
    cache = make_cache(model, reference_method(), None)
    return decode(model, cache, prompt_ids, n, suppress=eos_ids(model), progress=progress)


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
