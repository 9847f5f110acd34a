"""Recent queries only: BeaconKV's ablation, "32 recent queries + 0 beacons" (Kim et al., 2026,
arXiv 2609.04971). Each key's score is its largest attention probability from any of the last
`window` queries of any query head of its group (softmax over the head's real keys, causal);
`aggregation="mean"` averages over those points instead. With BeaconKV's threshold schedule
and protections this is the comparator that shows what the beacons add.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from reasonkv.core.policy.base import Observation, reduce_queries, window_attention
from reasonkv.core.policy.contract import Scorer
from reasonkv.core.policy.knob import tokens


@dataclass
class RecentQueryScorer(Scorer):
    window: int = tokens(32)
    aggregation: Literal["max", "mean"] = "max"

    def score(self, obs: Observation, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        probs = window_attention(obs, keys, gqa=self.aggregation)  # [B, H, W, T]
        return reduce_queries(probs, obs, self.aggregation)
