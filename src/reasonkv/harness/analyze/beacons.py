"""BeaconKV's beacons, simulated offline: which pre-RoPE queries its continual FPS would hold
after a trace, and a 2-D PCA to draw them with the queries."""

from __future__ import annotations

import torch

from reasonkv.core.policy.fps import add_points


def pca_2d(points: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(coords [N, 2], mean [D], basis [D, 2], explained [2] variance ratios) of points [N, D]."""
    x = points.double()
    mean = x.mean(0)
    centred = x - mean
    _, s, vh = torch.linalg.svd(centred, full_matrices=False)
    basis = vh[:2].T
    var = s**2
    explained = var[:2] / var.sum().clamp(min=1e-30)
    return (centred @ basis).float(), mean.float(), basis.float(), explained.float()


def unit(x: torch.Tensor) -> torch.Tensor:
    """Rows scaled to unit norm (the cosine geometry BeaconKV's FPS works in)."""
    return x / x.norm(dim=-1, keepdim=True).clamp(min=1e-12)


def simulate_beacons(
    pre_queries: torch.Tensor, beacon_max: int = 32, beacon_min: int = 16, recent: int = 16
) -> tuple[torch.Tensor, torch.Tensor]:
    """The beacons BeaconKV's continual FPS holds for one KV head after pre_queries [N, G, D]
    (pre-RoPE, oldest first, the group's G query heads): every query but the newest `recent`
    has left the recent window and entered the buffer, G points per query in (query, head)
    order. Returns (beacons [M, D], source [M] index of the point each came from, in the
    flattened N·G order), in buffer order."""
    n, g, d = pre_queries.shape
    points = pre_queries[: max(0, n - recent)].reshape(-1, d).float()
    beacons = torch.zeros(1, 1, beacon_max, d)
    count = torch.zeros(1, 1, dtype=torch.long)
    if points.shape[0]:
        valid = torch.ones(1, 1, points.shape[0], dtype=torch.bool)
        beacons, count = add_points(beacons, count, points[None, None], valid, beacon_min)
    held = beacons[0, 0, : int(count[0, 0])]
    # Beacons are copies of points: find where each came from (the nearest point, exactly 0).
    source = torch.cdist(held, points).argmin(-1) if held.shape[0] else torch.zeros(0, dtype=torch.long)
    return held, source
