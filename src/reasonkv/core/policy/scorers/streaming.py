"""StreamingLLM (Xiao et al., 2023, arXiv 2309.17453): attention sinks + a recent window.

No scores: the selection's protection (first `n_sink` real tokens, newest rest) is the
whole method, so every unprotected token scores the same and recency breaks the tie.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from reasonkv.core.policy.base import Observation
from reasonkv.core.policy.contract import Scorer
from reasonkv.core.policy.knob import tokens


@dataclass
class StreamingScorer(Scorer):
    window: int = tokens(0, minimum=0)

    def score(self, obs: Observation, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        # Newer tokens score higher, so the top-k of the unprotected middle is the newest part.
        idx = obs.token_index.clamp(max=torch.iinfo(torch.int32).max)
        return idx.float()
