"""Random eviction: the floor every scoring evictor must clear. Sinks and the recent window are
kept by the cache's protection; every other token gets a fresh uniform random priority at
each compression and the lowest go.

The draw is a hash of (seed, layer, KV head, the token's RoPE position, the newest query's
position), not a random generator's stream, so it is reproducible and the same for a
sequence alone or inside a left-padded batch (positions, unlike slots or sequence indices,
do not move with padding).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from reasonkv.core.policy.base import Observation
from reasonkv.core.policy.contract import Scorer
from reasonkv.core.policy.knob import knob

MODULUS = 2**31


def mix(x: torch.Tensor) -> torch.Tensor:
    """Three rounds of a linear congruential step and an xor-shift over int64 values in
    [0, 2^31): products stay below 2^62, so nothing overflows."""
    for _ in range(3):
        x = (x * 1103515245 + 12345) % MODULUS
        x = x ^ (x >> 13)
    return x


@dataclass
class RandomScorer(Scorer):
    seed: int = knob(0, ge=0)

    def score(self, obs: Observation, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        index = obs.token_index  # [B, H, T]
        b, h, _ = index.shape
        positions = obs.query_positions if obs.query_positions is not None else obs.query_index
        newest = torch.where(obs.query_valid, obs.query_index, -1).argmax(-1, keepdim=True)  # [B, 1]
        now = positions.gather(-1, newest)  # [B, 1] position of the newest query
        offset = obs.query_index.gather(-1, newest) - now  # sequence index minus position (padding)
        token_pos = torch.where(obs.key_valid, index - offset[:, :, None], 0)
        head = torch.arange(h, device=index.device)[None, :, None]
        x = (token_pos % MODULUS) * 73856093 % MODULUS
        x = x ^ ((now[:, :, None] % MODULUS) * 19349663 % MODULUS)
        x = x ^ (head * 83492791 % MODULUS) ^ (obs.layer_idx * 2654435 % MODULUS) ^ (self.seed % MODULUS)
        return (mix(x) >> 7).float()  # 24-bit integers: exact in float32, higher = keep
