"""Initial+Recent: BeaconKV's comparator with a fixed observation set (Kim et al., ICML 2026,
arXiv 2609.04971, Table 3).

BeaconKV's scorer and schedule (`BeaconKVScorer`: the same rotation of the held queries to the
current position, the same `recent` queries beside them, max or mean aggregation, pooling,
`beacon_scope` and `beacon_feed`), but each buffer holds the *first* `beacon_min` queries
admitted to it (real, and allowed by `beacon_feed`: generated ones by default), in arrival
order, and never changes once full: no farthest-point sampling, no replacement. The buffer has
exactly `beacon_min` slots, so `beacon_max` is not a knob here. Where the paper is silent: a
query identical in direction to a held one still takes a slot (skipping those is part of
BeaconKV's FPS upkeep, not of "the first queries").
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from reasonkv.core.policy.scorers.beacon import BeaconKVScorer


def keep_first_points(
    held: torch.Tensor, count: torch.Tensor, points: torch.Tensor, valid: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fill the empty slots of buffers held [B, X, M, D] (`count` [B, X] taken, in arrival
    order) with the valid points [B, X, P, D] (oldest first; `valid` [B, X, P]) in order; the
    points that find no empty slot are dropped, and no held point is ever replaced."""
    b, x, m, d = held.shape
    slot = count[..., None] + valid.cumsum(-1) - 1  # where each valid point goes, if below m
    taken = valid & (slot < m)
    # One slot past the end takes the dropped points, so the scatter needs no condition.
    buf = torch.cat([held, held.new_zeros(b, x, 1, d)], dim=2)
    buf.scatter_(2, torch.where(taken, slot, m)[..., None].expand(-1, -1, -1, d), points.to(buf.dtype))
    return buf[:, :, :m].clone(memory_format=torch.contiguous_format), count + taken.sum(-1)  # not a view


@dataclass
class InitialRecentScorer(BeaconKVScorer):
    beacon_max: int = field(init=False, repr=False)
    """The buffer's slots: `beacon_min`, set from it (the fixed set never grows or shrinks)."""

    def __post_init__(self) -> None:
        self.beacon_max = self.beacon_min
        super().__post_init__()

    def _check_sizes(self) -> None:
        """No rule between its sizes: `beacon_max` is `beacon_min`."""

    def _admit(
        self, beacons: torch.Tensor, count: torch.Tensor, points: torch.Tensor, valid: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return keep_first_points(beacons, count, points, valid)
