"""SnapKV at decode time (Li et al., 2024, arXiv 2404.14469; decode variant as in R-KV).

A_j = mean over the last `window` queries of softmax_{j in C}(max_g q_g . k_j / sqrt(d)),
C = the cache minus the newest `window` tokens (kept anyway); then max-pool along tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from reasonkv.core.policy.base import (
    MAX_KERNEL,
    GqaReduce,
    Observation,
    keep_newest,
    pool_tokens,
    reduce_queries,
    window_attention,
)
from reasonkv.core.policy.contract import Scorer
from reasonkv.core.policy.knob import knob, tokens


@dataclass
class SnapKVScorer(Scorer):
    window: int = tokens(8)
    kernel: int = knob(7, ge=1, le=MAX_KERNEL)
    pooling: Literal["max", "avg", "none"] = "max"
    gqa: GqaReduce = "max_logit"
    softmax: Literal["candidates", "all"] = "candidates"
    """Normalise over the candidates C (the paper's formula above) or over every key, the newest
    `window` included, before they are left out (kvpress's DecodingPress(SnapKVPress))."""

    def score(self, obs: Observation, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        probs = window_attention(obs, keys, exclude_last=self.window, gqa=self.gqa, softmax_over=self.softmax)
        scores = pool_tokens(reduce_queries(probs, obs, "mean"), self.kernel, self.pooling)
        return keep_newest(scores, obs, self.window)
