"""Integer budgets that sum exactly: rounding real shares and capping them. Pure torch."""

from __future__ import annotations

import torch


def largest_remainder(shares: torch.Tensor, total: torch.Tensor | int) -> torch.Tensor:
    """Round non-negative real `shares` [..., n] to integers summing exactly to `total` [...]:
    floor everything, then one more unit to the largest fractional parts (ties: lower index)."""
    base = shares.floor().long()
    missing = torch.as_tensor(total, device=shares.device).long() - base.sum(-1)
    order = torch.sort(shares - base, dim=-1, descending=True, stable=True).indices
    rank = torch.empty_like(order).scatter_(
        -1, order, torch.arange(shares.shape[-1], device=shares.device).expand_as(order).contiguous()
    )
    return base + (rank < missing[..., None]).long()


def fill_to_caps(
    shares: torch.Tensor, cap: torch.Tensor, weights: torch.Tensor | None = None, tolerance: float = 0.0
) -> torch.Tensor:
    """Water-filling: clip real shares [B, H] at `cap` and hand each row's excess to its heads
    below their cap, in proportion to `weights` (None: to their current shares), until no row
    has more than `tolerance` left over. Row sums are unchanged where the caps allow."""
    cap = cap.to(shares.dtype)
    for _ in range(shares.shape[-1]):
        excess = (shares - cap).clamp(min=0).sum(-1, keepdim=True)
        if not bool((excess > tolerance).any()):
            break
        shares = torch.minimum(shares, cap)
        room = shares < cap
        w = shares.clamp(min=1e-9) if weights is None else weights
        w = torch.where(room, w, torch.zeros_like(w))
        shares = shares + w / w.sum(-1, keepdim=True).clamp(min=1e-12) * excess
    return torch.minimum(shares, cap)


def water_fill(weights: torch.Tensor, total: int, lo: int = 0, hi: int | None = None) -> torch.Tensor:
    """Integers proportional to `weights` [n] within [lo, hi] that sum exactly to `total`.

    Clipped entries are fixed at their bound and the rest is shared again among the free
    ones, until nothing violates a bound (at most n rounds: each fixes at least one entry).
    """
    n = weights.numel()
    hi_v = float("inf") if hi is None else hi
    if total < n * lo or total > n * hi_v:
        raise ValueError(f"cannot split {total} into {n} parts within [{lo}, {hi}]")
    w = weights.double().clamp(min=0)
    fixed = torch.full((n,), float("nan"), dtype=torch.float64)
    for _ in range(n + 1):
        free = fixed.isnan()
        left = total - fixed[~free].sum()
        wf = w[free]
        share = wf / wf.sum() * left if wf.sum() > 0 else torch.full_like(wf, left / free.sum())
        values = fixed.clone()
        values[free] = share
        low, high = free & (values < lo), free & (values > hi_v)
        if not (low.any() or high.any()):
            break
        if low.any() and high.any():
            # Fix one side a round: the side with the larger violation is surely at its bound
            # in the answer; fixing both at once can overshoot the total.
            if (values[high] - hi_v).sum() > (lo - values[low]).sum():
                low = torch.zeros_like(low)
            else:
                high = torch.zeros_like(high)
        fixed[low], fixed[high] = lo, hi_v
    out = largest_remainder(values, total)
    # Rounding can push a share that sat exactly on a bound by one unit; move it back.
    return out.clamp(min=lo) if hi is None else out.clamp(lo, hi)
