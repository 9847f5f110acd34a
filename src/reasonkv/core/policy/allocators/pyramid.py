"""PyramidKV's layer schedule (Cai et al., 2024, arXiv 2406.02069): more tokens low, fewer high.

With C' = budget − window (the part that is scored; the window is kept anyway) and β:
    min = C'/β,  max = 2C' − min,  b_l = window + max − l·(max − min)/(L − 1)
so layer 0 gets the most, the budget falls linearly, and the mean is exactly the budget.
Integers by largest-remainder rounding: Σ_l b_l = L·budget exactly, non-increasing, every
layer ≥ window. (The reference also clips max to the prompt length at prefill; at decode
time the length is unknown, so there is no clip.)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from reasonkv.core.policy.contract import Allocator
from reasonkv.core.policy.knob import knob, tokens
from reasonkv.core.policy.rounding import largest_remainder


def pyramid_layer_budgets(n_layers: int, budget: int, beta: float = 20.0, window: int = 8) -> torch.Tensor:
    """[n_layers] per-head budgets of PyramidKV's linear schedule, summing to n_layers·budget."""
    scored = budget - window
    if n_layers == 1 or scored <= 0:
        return torch.full((n_layers,), budget, dtype=torch.long)
    lo = scored / beta
    hi = 2 * scored - lo
    step = (hi - lo) / (n_layers - 1)
    shares = window + hi - step * torch.arange(n_layers, dtype=torch.float64)
    return largest_remainder(shares.clamp(min=0), n_layers * budget)


@dataclass
class PyramidAllocator(Allocator):
    """PyramidKV layer budgets, the same for every head of a layer.

    `window` is PyramidKV's w (C' = C − w); it has the same name as the scorer's observation
    window on purpose: in PyramidKV/SnapKV they are one number.
    """

    beta: float = knob(20.0, ge=1.0)  # >= 1: min = C'/beta <= max
    window: int = tokens(8, minimum=0)

    def allocate(
        self, n_layers: int, n_kv_heads: int, budget: int, stats: dict | None = None
    ) -> torch.Tensor:
        per_layer = pyramid_layer_budgets(n_layers, budget, self.beta, self.window)
        return per_layer[:, None].expand(n_layers, n_kv_heads).clone()
