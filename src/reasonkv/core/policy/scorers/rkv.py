"""R-KV (Cai et al., 2025, arXiv 2505.24133): importance minus redundancy.

Z_j = λ·Â_j − (1−λ)·R_j. Â = max-pooled mean over the last `window` queries of
softmax_{j in C}(max_g q_g·k_j/√d), C = the cache minus the newest `window` tokens;
R_j = softmax_j(mean_i S_ij), S = cosine similarity of the keys (per KV head, diagonal 0),
where each row i forgets its most recent near-duplicate (S_ij > threshold), so the newest
copy of a repeated token is spared and the older copies carry the penalty.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from reasonkv.core.policy.base import (
    MAX_KERNEL,
    Observation,
    keep_newest,
    masked_softmax,
    pool_tokens,
    reduce_queries,
    window_attention,
)
from reasonkv.core.policy.contract import Scorer
from reasonkv.core.policy.knob import knob, tokens, unit

_CPU_SIM_ELEMENTS = 1 << 19
"""Similarity entries per pass on a CPU (2 MB of float32: cache-sized)."""
_SIM_ELEMENTS = 1 << 26
"""Similarity entries per pass elsewhere (256 MB of float32)."""


@dataclass
class RKVScorer(Scorer):
    """R-KV's joint score. Only real keys take part in the redundancy term: EMPTY slots
    (padding, ragged heads) are left out of the similarity rows and columns, of the mean's
    denominator and of the softmax, so a padded batch row scores exactly as it would alone.

    Deviation from the reference code: a row with no token above the threshold zeroes
    nothing (the reference's argmax falls back to index 0 and zeroes S_i0 by accident).
    """

    window: int = tokens(8)
    kernel: int = knob(7, ge=1, le=MAX_KERNEL)
    pooling: Literal["max", "avg", "none"] = "max"
    mix_lambda: float = unit(0.1)
    sim_threshold: float = knob(0.5, ge=-1.0, le=1.0)

    def score(self, obs: Observation, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        probs = window_attention(obs, keys, exclude_last=self.window, gqa="max_logit")
        importance = pool_tokens(reduce_queries(probs, obs, "mean"), self.kernel, self.pooling)
        scores = self.mix_lambda * importance - (1 - self.mix_lambda) * self.redundancy(obs, keys)
        return keep_newest(scores, obs, self.window)

    def redundancy(self, obs: Observation, keys: torch.Tensor) -> torch.Tensor:
        """[B, H, T] R_j: a distribution over each head's real keys (0 on EMPTY slots)."""
        valid = obs.key_valid
        k = keys.float()
        # Zeroed EMPTY keys give zero similarity rows and columns without a [T, T] pair mask.
        k = k / (k.norm(dim=-1, keepdim=True) + 1e-8) * valid[..., None]
        b, h, t, d = k.shape
        flat, flat_valid = k.reshape(b * h, t, d), valid.reshape(b * h, t)
        column_sums = flat.new_empty(b * h, t)
        # A few heads' [T, T] similarities at a time: on a CPU they then stay in cache (2x
        # faster than all at once at T = 640); anywhere they bound the temporary's size.
        limit = _CPU_SIM_ELEMENTS if k.device.type == "cpu" else _SIM_ELEMENTS
        step = max(1, limit // (t * t))
        for s in range(0, b * h, step):
            column_sums[s : s + step] = self._similarity_column_sums(
                flat[s : s + step], flat_valid[s : s + step]
            )
        n_real = valid.sum(-1, keepdim=True).clamp(min=1).to(k.dtype)
        return masked_softmax(column_sums.reshape(b, h, t) / n_real, valid)

    def _similarity_column_sums(self, k: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """[N, T] sum_i S_ij for N heads' unit keys k [N, T, D] (EMPTY ones zeroed)."""
        sim = k @ k.transpose(-1, -2)  # [N, T, T]
        sim.diagonal(dim1=-2, dim2=-1).zero_()
        t = sim.shape[-1]
        slots = torch.arange(t, device=sim.device)
        similar = sim > self.sim_threshold
        if self.sim_threshold < 0:  # then the zeros (EMPTY keys, the diagonal) would pass too
            similar &= valid[:, None, :]
            similar.diagonal(dim1=-2, dim2=-1).fill_(False)
        # Slots are in positional order, so the largest similar slot is the most recent one
        # (int32: the [T, T] temporary at half the int64 cost).
        last = torch.where(similar, slots.int(), -1).amax(dim=-1).long()  # [N, T]; -1 = none
        # A row with no similar token zeroes its own diagonal entry, already 0.
        sim.scatter_(-1, torch.where(last >= 0, last, slots)[..., None], 0.0)
        return sim.sum(dim=-2)
