"""H2O (Zhang et al., 2023, arXiv 2306.14048): heavy hitters by cumulative attention + recent tokens.

F_j = Σ_steps Σ_queries Σ_{g in group} softmax(q_g·K^T/√d)_j, accumulated at every forward
for every stored token and carried along through evictions; keep the newest
⌊recent_ratio·B⌋ tokens and the top of F among the rest (the paper's 50/50 split).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import ClassVar

import torch

from reasonkv.core.policy.base import Observation, window_attention
from reasonkv.core.policy.contract import Scorer
from reasonkv.core.policy.knob import unit

QUERY_CHUNK = 256
"""Prompt queries per block at prefill, so the fp32 probabilities stay O(chunk × cache)."""


@dataclass
class H2OScorer(Scorer):
    """Cumulative attention per (row, KV head, token), summed over the GQA group's query heads,
    kept in the per-token state "h2o_acc" (so it moves with the keys at every eviction). The
    newest ⌊recent_ratio · target⌋ real tokens of each head score +inf: H2O's recent half.
    `score` reads only that state, so the query window is the minimum (1)."""

    recent_ratio: float = unit(0.5)
    window: int = field(default=1, init=False, repr=False)
    state_names: ClassVar[tuple[str, ...]] = ("h2o_acc",)

    def __post_init__(self) -> None:
        if not 0.0 <= self.recent_ratio <= 1.0:
            raise ValueError(f"recent_ratio must be within [0, 1], got {self.recent_ratio}")

    def on_step(self, step: Observation, keys: torch.Tensor) -> None:
        """Add the attention of this forward's queries (all of `step`'s) to "h2o_acc"."""
        q = step.queries.shape[2]
        acc = step.state["h2o_acc"]  # a view of the cache's per-token state: updated in place
        for start in range(0, q, QUERY_CHUNK):
            sl = slice(start, min(start + QUERY_CHUNK, q))
            block = replace(step, queries=step.queries[:, :, sl], query_index=step.query_index[:, sl])
            acc += window_attention(block, keys, gqa="sum").sum(dim=2)  # [B, H, T]

    def score(self, obs: Observation, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        acc = obs.state["h2o_acc"].float()
        if obs.targets is None:
            return acc.clone()
        recent = (obs.targets.double() * self.recent_ratio).floor().long()  # [H]
        valid = obs.key_valid
        rank_from_end = valid.flip(-1).cumsum(-1).flip(-1)  # 1 for the newest real token
        is_recent = valid & (rank_from_end <= recent.to(acc.device)[None, :, None])
        return acc.masked_fill(is_recent, float("inf"))
