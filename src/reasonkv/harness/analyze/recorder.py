"""Attention, recorded during a full-cache replay.

`Recorder` is a scorer-shaped observer on the NEVER schedule (it never evicts): the cache
hands it every forward's queries, and it recomputes their attention over the full cache, per
layer and KV head (the mean over the GQA group's query heads), keeping the statistics of the
recorded queries, the attention rows of the map window and the pre-RoPE queries of the drawn
layers.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch

from reasonkv.core.cache import CompressedCache, LayerPolicy
from reasonkv.core.models import attention_modules, model_shape
from reasonkv.core.policy.base import EMPTY, Observation, grouped_logits, masked_softmax
from reasonkv.core.policy.contract import Scorer
from reasonkv.core.policy.rope import unapply_rope
from reasonkv.core.policy.schedules import NEVER
from reasonkv.harness.analyze.revisits import (
    RevisitRule,
    distance_histogram,
    eligible,
    far_fraction,
    far_keys,
    key_masks,
    mean_distance,
    needed_keys,
    normalised_entropy,
)
from reasonkv.methods.api import install_attention


@dataclass
class Recorder(Scorer):
    """Scorer-shaped observer (the NEVER schedule: it never evicts). For every forward of every
    layer it computes the recorded queries' attention over the full cache. Survey mode (the
    first pass) only keeps each query's strongest far keys, for the persistent keys; the second
    pass keeps the per-query statistics with those keys excluded."""

    window: ClassVar[int] = 1
    rule: RevisitRule
    prompt_len: int
    n_tokens: int
    stride: int
    edges: torch.Tensor
    survey: bool = False
    excluded: torch.Tensor | None = None  # [L, H, n + 1] bool (the last column: EMPTY slots)
    layers: frozenset[int] = frozenset()  # maps and pre-RoPE queries are kept for these
    map_start: int = 0
    needed_mass: float = 0.5
    survey_keys: int = 32
    tops: dict[int, list[torch.Tensor]] = field(default_factory=dict)
    top_weights: dict[int, list[torch.Tensor]] = field(default_factory=dict)
    totals: dict[int, list[torch.Tensor]] = field(default_factory=dict)
    stats: dict[int, dict[str, list[torch.Tensor]]] = field(default_factory=dict)
    maps: dict[int, list[torch.Tensor]] = field(default_factory=dict)
    pre: dict[int, list[torch.Tensor]] = field(default_factory=dict)
    positions: list[torch.Tensor] = field(default_factory=list)

    def score(self, obs, keys, values):  # pragma: no cover - NEVER schedule: no compression
        raise RuntimeError("the analyzer never evicts")

    def on_step(self, step: Observation, keys: torch.Tensor) -> None:
        li = step.layer_idx
        idx = step.query_index[0]  # [s] this forward's queries
        if not self.survey and li in self.layers:  # every query: BeaconKV's buffer sees them all
            pos = step.query_positions[0] if step.query_positions is not None else idx
            pre = unapply_rope(step.queries[0], pos[None, :], step.rope_inv_freq, step.rope_attention_scaling)
            self.pre.setdefault(li, []).append(pre.transpose(0, 1).cpu())
        sel = (idx >= self.prompt_len) & ((idx - self.prompt_len) % self.stride == 0)
        if self.survey:
            sel = sel & eligible(idx, self.rule)
        in_map = (idx >= self.map_start) if (li in self.layers and not self.survey) else torch.zeros_like(sel)
        rows = (sel | in_map).nonzero().flatten()
        if rows.numel() == 0:
            return
        qi = idx[rows]  # [r]
        kp = step.token_index[0]  # [H, T]
        logits = grouped_logits(step.queries[:, :, rows], keys, step.scaling)  # [1, H, G, r, T]
        visible = (kp[:, None, :] <= qi[None, :, None]) & (kp[:, None, :] != EMPTY)  # [H, r, T]
        probs = masked_softmax(logits, visible[None, :, None])[0]  # [H, G, r, T]
        attn = probs.mean(1)  # [H, r, T] the group's mean attention
        kpq = kp[:, None, :]
        s = sel[rows]
        if self.survey:
            a, q = attn[:, s], qi[s]
            top, weight = far_keys(a, q, kpq, self.rule, k=self.survey_keys)  # sinks aside
            pad = self.survey_keys - top.shape[-1]
            self.tops.setdefault(li, []).append(torch.nn.functional.pad(top, (0, pad), value=-1).cpu())
            self.top_weights.setdefault(li, []).append(torch.nn.functional.pad(weight, (0, pad)).cpu())
            counted = key_masks(q, kpq, self.rule, None)[1]
            self.totals.setdefault(li, []).append(torch.where(counted, a, 0.0).sum(-1).cpu())
            return
        excl = None
        if self.excluded is not None:
            table = self.excluded[li].to(kp.device)  # [H, n + 1]
            excl = table.gather(1, kp.clamp(max=self.n_tokens))[:, None, :]  # [H, 1, T]
        if li == 0 and bool(sel.any()):
            self.positions.append(idx[sel].cpu())
        if bool(s.any()):
            a, q = attn[:, s], qi[s]
            need, weight = needed_keys(a, q, kpq, self.rule, self.needed_mass, excl)
            pad = self.rule.top_k - need.shape[-1]  # early blocks can have fewer keys than top_k
            rec = self.stats.setdefault(li, {})
            for name, value in (
                ("far", far_fraction(a, q, kpq, self.rule, excl)),
                ("mean_dist", mean_distance(a, q, kpq, self.rule, excl)),
                ("hist", distance_histogram(a, q, kpq, self.edges, self.rule, excl)),
                ("entropy", normalised_entropy(probs[:, :, s], visible[:, None, s]).mean(1)),
                ("needed", torch.nn.functional.pad(need, (0, pad), value=-1)),
                ("weight", torch.nn.functional.pad(weight, (0, pad))),
            ):
                rec.setdefault(name, []).append(value.cpu())
        m = in_map[rows]
        if bool(m.any()):
            # Rows over all n tokens (keys not yet seen are 0); in a full cache slots are positions.
            full = attn.new_zeros(attn.shape[0], int(m.sum()), self.n_tokens)
            order = kp.clamp(max=self.n_tokens - 1)[:, None, :].expand(-1, full.shape[1], -1)
            full.scatter_add_(2, order, torch.where(kp[:, None, :] != EMPTY, attn[:, m], 0.0))
            self.maps.setdefault(li, []).append(full.cpu())


def _rope_of(model) -> tuple[torch.Tensor | None, float]:
    """The model's RoPE inverse frequencies and attention scaling (as make_cache finds them)."""
    rotary = getattr(getattr(model, "model", model), "rotary_emb", None)
    return getattr(rotary, "inv_freq", None), float(getattr(rotary, "attention_scaling", 1.0))


def observer_cache(model, recorder: Recorder) -> CompressedCache:
    """A cache on the NEVER schedule (it never compresses, so it stays full) that shows every
    forward of every layer to `recorder`."""
    shape = model_shape(model)
    install_attention(model)
    inv_freq, att_scaling = _rope_of(model)
    modules = attention_modules(model)
    policy = LayerPolicy(
        scorer=recorder,
        schedule=NEVER,
        n_sink=0,
        n_recent=0,
        rope_inv_freq=inv_freq,
        rope_attention_scaling=att_scaling,
    )
    budgets = torch.ones(shape.n_layers, shape.n_kv_heads, dtype=torch.long)
    return CompressedCache(
        budgets, policy, method="analyze", attention_modules=modules, scaling=float(modules[0].scaling)
    )
