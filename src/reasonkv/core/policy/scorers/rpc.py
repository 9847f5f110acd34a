"""RPC, Reasoning Path Compression (Song et al., 2025, arXiv 2505.13866).

s_j = avg_pool( mean over all query heads of Σ_{i in last R queries} softmax_{j in C}(q_i·k_j/√d) ),
C = the generated tokens minus the newest R (the prompt and the recent window are kept anyway).
The periodic keep-P/c-per-P-tokens rule is the schedule's: reasonkv.core.policy.schedules.PeriodicRatio.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from reasonkv.core.policy.base import (
    MAX_KERNEL,
    Observation,
    candidate_mask,
    grouped_logits,
    masked_softmax,
    pool_tokens,
)
from reasonkv.core.policy.contract import Scorer
from reasonkv.core.policy.knob import knob, tokens


@dataclass
class RPCScorer(Scorer):
    """`window` = R, the selector queries (and the newest R tokens left out of the candidates).

    aggregation "all" (the paper's default) averages over every query head of the layer, so
    every KV head gets the same score vector and keeps the same tokens; it is computed as
    per-KV-head group means averaged across KV heads, which needs the heads to share one slot
    layout (true under RPC, whose heads always keep the same tokens). "group" keeps the
    per-KV-head group mean. The prompt boundary is `obs.prompt_end` ([B] sequence index where
    generation starts).
    """

    window: int = tokens(32)
    kernel: int = knob(7, ge=1, le=MAX_KERNEL)
    pooling: Literal["avg", "max", "none"] = "avg"
    aggregation: Literal["all", "group"] = "all"

    def score(self, obs: Observation, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        logits = grouped_logits(obs.queries, keys, obs.scaling)  # [B, H, G, W, T]
        allowed = candidate_mask(obs, exclude_last=self.window)  # [B, H, 1, W, T]
        prompt_end = obs.prompt_end
        if prompt_end is not None:
            generated = obs.token_index >= prompt_end.to(obs.token_index.device)[:, None, None]
            allowed = allowed & generated[:, :, None, None, :]
        # Sum over the selector queries (invalid ones give all-zero rows), mean over the group.
        scores = masked_softmax(logits, allowed).sum(dim=3).mean(dim=2)  # [B, H, T]
        if self.aggregation == "all":
            index = obs.token_index
            if not torch.equal(index, index[:, :1].expand_as(index)):
                raise ValueError(
                    "rpc aggregation='all' shares one token selection across KV heads, but this layer's "
                    "heads hold different tokens; use aggregation='group'"
                )
            scores = scores.mean(dim=1, keepdim=True)
        return pool_tokens(scores, self.kernel, self.pooling).expand_as(obs.token_index)
