"""BeaconKV's offline alternatives, for its ablation only (Kim et al., ICML 2026, arXiv
2609.04971, Figure 7): hold *every* past query a buffer admits and pick the scoring set from all
of them at each compression, instead of keeping a bounded buffer by continual FPS.

- `selection="fps"`: naive FPS over all held queries (cosine distance, seeded with the newest,
  as continual FPS's shrink is), `beacon_min` of them;
- `selection="kmeans"`: `beacon_min` K-means centroids of all held queries (Euclidean Lloyd
  iterations from those FPS points, so it is deterministic; an empty cluster keeps its centre).

Everything else is BeaconKV's (`BeaconKVScorer`, through `InitialRecentScorer`): the feed
(`beacon_feed`, `beacon_scope`), the rotation to the current position, the `recent` queries, the
aggregation and the schedule. The buffers grow with the sequence (that is the paper's point:
equal accuracy at more memory, which the state meter counts), and each compression's FPS reads
all N held queries of every head (its distance rows computed as visited past 256 points).

Where the paper is silent: no duplicate skipping (every admitted query is held), and the number
of Lloyd iterations (`kmeans_iters`, 10). Held duplicates (a repeated token repeats the first
layer's pre-RoPE query) make FPS ties between identical directions, which fp32 rounding breaks,
not always towards the older point. A K-means centroid averages queries of differing directions, so it
is shorter than its members and scores with flatter attention than a held query would (kept: the
paper compares with "K-means centroids"; FPS picks real queries).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

import torch
import torch.nn.functional as F

from reasonkv.core.policy.fps import farthest_point_sample
from reasonkv.core.policy.knob import knob
from reasonkv.core.policy.scorers.beacon import BeaconState
from reasonkv.core.policy.scorers.initial_recent import InitialRecentScorer, keep_first_points


def kmeans_centroids(
    points: torch.Tensor, valid: torch.Tensor, init: torch.Tensor, init_valid: torch.Tensor, iters: int
) -> torch.Tensor:
    """Lloyd's K-means of points [B, X, N, D] (`valid` [B, X, N]) from centres init [B, X, K, D]
    (`init_valid` [B, X, K]: a row with fewer points than K has fewer centres, and no point joins
    the absent ones). Returns the centres after `iters` rounds, fp32."""
    x, centres = points.float(), init.float()
    k = centres.shape[2]
    for _ in range(iters):
        dist = torch.cdist(x, centres).masked_fill(~init_valid[:, :, None, :], float("inf"))
        members = F.one_hot(dist.argmin(-1), k).to(x.dtype) * valid[..., None]  # [B, X, N, K]
        sizes = members.sum(2)  # [B, X, K]
        sums = members.transpose(-1, -2) @ x  # [B, X, K, D]
        centres = torch.where(sizes[..., None] > 0, sums / sizes.clamp(min=1)[..., None], centres)
    return centres


GROWTH = 64
"""Slots the all-queries buffers grow by at a time."""


@dataclass
class AllQueriesScorer(InitialRecentScorer):
    """Initial+Recent's buffers (every admitted query in arrival order, never replaced) without
    their bound; `beacon_min` is the size of the set picked from them, `beacon_max` no knob."""

    state_grows: ClassVar[bool] = True
    selection: Literal["fps", "kmeans"] = "fps"
    kmeans_iters: int = knob(10, ge=1, le=100)

    def __post_init__(self) -> None:
        super().__post_init__()
        self.beacon_max = 0  # the buffers start empty and grow

    def _admit(
        self, beacons: torch.Tensor, count: torch.Tensor, points: torch.Tensor, valid: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append every valid point, in arrival order. The buffers grow to hold the longest row,
        in steps of GROWTH slots (a copy per step, not per feed; the state meter counts the
        empty slots too: they are held)."""
        b, x, m, d = beacons.shape
        need = int((count + valid.sum(-1)).max())
        if need > m:
            grown = -(-need // GROWTH) * GROWTH
            beacons = torch.cat([beacons, beacons.new_zeros(b, x, grown - m, d)], dim=2)
        return keep_first_points(beacons, count, points, valid)

    def _scoring_points(self, st: BeaconState) -> tuple[torch.Tensor, torch.Tensor]:
        held, count = st.points(), st.count  # [B, X, N, D], [B, X]
        n = held.shape[2]
        valid = torch.arange(n, device=held.device) < count[..., None]
        chosen = farthest_point_sample(held, self.beacon_min, (count - 1).clamp(min=0), valid)
        picked = count.clamp(max=self.beacon_min)  # [B, X]; chosen ends in index n past those
        index = chosen.clamp(max=max(n - 1, 0))[..., None].expand(-1, -1, -1, held.shape[-1])
        points = held.gather(2, index)
        if self.selection == "kmeans":
            present = torch.arange(points.shape[2], device=held.device) < picked[..., None]
            points = kmeans_centroids(held, valid, points, present, self.kmeans_iters)
        return points, picked
