"""The uniform allocator: every (layer, KV head) gets the same budget."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch


@runtime_checkable
class Allocator(Protocol):
    def allocate(
        self, n_layers: int, n_kv_heads: int, budget: int, stats: dict | None = None
    ) -> torch.Tensor:
        """[n_layers, n_kv_heads] integer budgets summing exactly to n_layers*n_kv_heads*budget."""
        ...


@dataclass
class UniformAllocator:
    def allocate(
        self, n_layers: int, n_kv_heads: int, budget: int, stats: dict | None = None
    ) -> torch.Tensor:
        return torch.full((n_layers, n_kv_heads), budget, dtype=torch.long)
