"""The uniform allocator: every (layer, KV head) gets the same budget."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from reasonkv.core.policy.contract import Allocator


@dataclass
class UniformAllocator(Allocator):
    def allocate(
        self, n_layers: int, n_kv_heads: int, budget: int, stats: dict | None = None
    ) -> torch.Tensor:
        return torch.full((n_layers, n_kv_heads), budget, dtype=torch.long)
