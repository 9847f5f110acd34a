"""The offline Reasoning Wave profiler (ReasonAlloc's first level).

Replays reasoning traces through a model with the full cache and records, per layer and
KV head, at every `stride`-th trace position: the normalised entropy of the query's
attention over the whole cache (the demand signal: diffuse attention needs more tokens)
and the attention mass its top-k keys capture (a second signal). The per-layer mean
entropy is the demand curve that ReasonAlloc's layer budgets follow.

Profiles are JSON, keyed by model name and a hash of the attention-relevant config, so a
profile is never applied to a model it was not made for.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

import torch

from reasonkv.core.cache import CompressedCache, LayerPolicy
from reasonkv.core.hf_compat import cache_arg
from reasonkv.core.models import attention_modules, model_shape
from reasonkv.core.policy.allocators.reasonalloc import attention_stats
from reasonkv.core.policy.base import Observation
from reasonkv.core.policy.contract import Scorer
from reasonkv.core.policy.schedules import NEVER
from reasonkv.harness.traces import replay_input
from reasonkv.methods.api import install_attention
from reasonkv.methods.profiles import PROFILE_FORMAT, config_hash
from reasonkv.util.records import utc_timestamp


@dataclass
class _Observer(Scorer):
    """Scorer-shaped recorder: sees every forward's queries through the cache's on_step
    hook (the step observation holds all of them) and accumulates per-head statistics; it is
    never asked to evict, so the cache's query window can be the minimum."""

    window: ClassVar[int] = 1
    stride: int
    topk: int
    start: int = 0  # first sequence index to profile (the trace start)
    entropy: dict[int, list[torch.Tensor]] = field(default_factory=dict)  # per layer: [H] per position
    mass: dict[int, list[torch.Tensor]] = field(default_factory=dict)

    def score(self, obs, keys, values):  # pragma: no cover - NEVER schedule: no compression
        raise RuntimeError("the profiler never evicts")

    def on_step(self, step: Observation, keys: torch.Tensor) -> None:
        index = step.query_index[0]  # this forward's queries only (-1 = padding)
        sel = (index >= 0) & (index >= self.start) & ((index - self.start) % self.stride == 0)
        for i in sel.nonzero().flatten().tolist():
            one = Observation(
                step.queries[:, :, i : i + 1], step.query_index[:, i : i + 1], step.token_index, step.scaling
            )
            ent, mass = attention_stats(one, keys, self.topk)
            self.entropy.setdefault(step.layer_idx, []).append(ent[0])
            self.mass.setdefault(step.layer_idx, []).append(mass[0])


def profile_trace(
    model, ids: torch.Tensor, prompt_len: int, *, chunk: int = 64, stride: int = 16, topk: int = 64
) -> dict[str, torch.Tensor]:
    """Replay one tokenised trace with the full cache; return entropy and top-k mass
    [steps, L, H] at every `stride`-th trace position."""
    shape = model_shape(model)
    ids = ids.to(next(model.parameters()).device)  # tokenizers give CPU tensors; the model may be on a GPU
    install_attention(model)
    observer = _Observer(stride=stride, topk=topk, start=prompt_len)
    budgets = torch.ones(shape.n_layers, shape.n_kv_heads, dtype=torch.long)
    modules = attention_modules(model)
    cache = CompressedCache(
        budgets,
        LayerPolicy(scorer=observer, schedule=NEVER, n_sink=0, n_recent=0),
        method="profile",
        attention_modules=modules,
        scaling=float(modules[0].scaling),
    )
    with torch.no_grad():
        model(input_ids=ids[:, :prompt_len], **cache_arg(cache), logits_to_keep=1)
        for s in range(prompt_len, ids.shape[1], chunk):
            model(input_ids=ids[:, s : s + chunk], **cache_arg(cache), logits_to_keep=1)
    layers = sorted(observer.entropy)
    ent = torch.stack([torch.stack(observer.entropy[i]) for i in layers], dim=1)
    mass = torch.stack([torch.stack(observer.mass[i]) for i in layers], dim=1)
    return {"entropy": ent, "topk_mass": mass}


def profile_traces(
    model,
    tokenizer,
    rows: list[dict],
    *,
    max_tokens: int = 2048,
    chunk: int = 64,
    stride: int = 16,
    topk: int = 64,
    command: str | None = None,
    progress: Callable[[int, int, str], None] | None = None,
) -> dict:
    """Profile `rows` (trace dicts) and return the profile as a JSON-ready dict."""
    if not rows:
        raise ValueError("no traces to profile")
    shape = model_shape(model)
    per_trace, per_trace_mass, per_head, per_head_mass, ids_used, tokens = [], [], [], [], [], 0
    for n, row in enumerate(rows):
        inp = replay_input(tokenizer, row, max_tokens)
        stats = profile_trace(model, inp.input_ids, inp.prompt_len, chunk=chunk, stride=stride, topk=topk)
        per_trace.append(stats["entropy"].mean((0, 2)))
        per_trace_mass.append(stats["topk_mass"].mean((0, 2)))
        per_head.append(stats["entropy"].mean(0))
        per_head_mass.append(stats["topk_mass"].mean(0))
        ids_used.append(row["id"])
        tokens += int(inp.input_ids.shape[1])
        if progress is not None:
            progress(n + 1, len(rows), row["id"])
    curves = torch.stack(per_trace)  # [traces, L]
    return {
        "format": PROFILE_FORMAT,
        "model": shape.name,
        "config_hash": config_hash(model.config),
        "n_layers": shape.n_layers,
        "n_kv_heads": shape.n_kv_heads,
        "signal": "mean normalised attention entropy of trace queries over the full cache",
        "demand": curves.mean(0).tolist(),
        "demand_std": curves.std(0, unbiased=False).tolist(),
        "per_trace_demand": curves.tolist(),
        "topk_mass": torch.stack(per_trace_mass).mean(0).tolist(),
        "topk": topk,
        "head_entropy": torch.stack(per_head).mean(0).tolist(),
        "head_topk_mass": torch.stack(per_head_mass).mean(0).tolist(),
        "traces": ids_used,
        "tokens_seen": tokens,
        "max_tokens": max_tokens,
        "chunk": chunk,
        "stride": stride,
        "command": command or " ".join(sys.argv),
        "created": utc_timestamp(),
    }


def curve_agreement(a: list[float], b: list[float]) -> dict[str, float]:
    """How alike two demand curves are: Pearson r and the largest relative gap."""
    x, y = torch.tensor(a, dtype=torch.float64), torch.tensor(b, dtype=torch.float64)
    xc, yc = x - x.mean(), y - y.mean()
    r = float((xc * yc).sum() / math.sqrt(float((xc**2).sum() * (yc**2).sum()) or 1.0))
    gap = float(((x - y).abs() / ((x + y) / 2).clamp(min=1e-12)).max())
    return {"pearson_r": r, "max_relative_gap": gap}


def plot_wave(profile: dict, path: str | Path, title: str | None = None) -> Path:
    """The Reasoning Wave: per-layer demand with its spread across traces."""
    from reasonkv.util.plotting import pyplot, save_figure

    plt = pyplot()
    curves = torch.tensor(profile.get("per_trace_demand") or [profile["demand"]], dtype=torch.float64)
    mean = curves.mean(0)
    layers = list(range(curves.shape[1]))
    fig, ax = plt.subplots(figsize=(7, 3.8))
    lo, hi = curves.min(0).values, curves.max(0).values
    ax.fill_between(layers, lo, hi, alpha=0.2, label="min-max over traces")
    std = curves.std(0, unbiased=False)
    ax.fill_between(layers, mean - std, mean + std, alpha=0.35, label="±1 std")
    ax.plot(layers, mean, marker="o", ms=3, label="mean demand")
    ax.set_xlabel("layer")
    ax.set_ylabel("normalised attention entropy")
    ax.set_title(
        title
        or f"Reasoning Wave: {profile.get('model', '?')} ({len(profile.get('traces') or [])} traces, "
        f"{profile.get('tokens_seen', '?')} tokens)"
    )
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return save_figure(fig, path, dpi=130)
