"""TOVA (Oren et al., 2024, arXiv 2401.06104): keep the tokens the current query attends to.

score_j = mean over the group's query heads of softmax(q_t . k_j / sqrt(d)), with q_t the
newest query only. Run every step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from reasonkv.core.policy.base import Observation, window_attention
from reasonkv.core.policy.contract import Scorer
from reasonkv.core.policy.knob import tokens


@dataclass
class TOVAScorer(Scorer):
    window: int = tokens(1)

    def score(self, obs: Observation, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        probs = window_attention(obs, keys, gqa="mean")  # [B, H, W, T]
        return probs[:, :, -1]
