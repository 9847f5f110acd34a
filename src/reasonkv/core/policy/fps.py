"""Continual farthest-point sampling (FPS) with cosine distance: how BeaconKV keeps a bounded,
diverse buffer of queries per head (scorers/beacon.py). Pure torch, every buffer a row."""

from __future__ import annotations

import torch

DUPLICATE_EPS = 1e-5
"""Cosine distance at or below which a point counts as identical (fp32 rounding of 0)."""


FPS_ROWS_ON_DEMAND_ABOVE = 256
"""Above this many points, farthest-point sampling computes only the m distance rows it visits,
not the N x N matrix: the all-queries ablation's N grows with the sequence (a 2K-token trace's
matrix is 4.5 GB on the default model). BeaconKV's own buffers stay far below it, so its FPS
runs exactly as before (one matrix product; the two differ in the last bits of a distance)."""


def _units(x: torch.Tensor) -> torch.Tensor:
    return x / x.norm(dim=-1, keepdim=True).clamp(min=1e-12)


def farthest_point_sample(
    points: torch.Tensor, m: int, seed: torch.Tensor | int, valid: torch.Tensor | None = None
) -> torch.Tensor:
    """Greedy FPS with cosine distance: points [..., N, D] -> [..., m] chosen indices, ascending.

    Starts from `seed` (an index, or [...] indices), then repeatedly adds the point whose
    distance to its nearest chosen point is largest (ties: the lowest index). With `valid`
    [..., N] only those points are candidates; a row with fewer than m ends in index N.
    """
    n = points.shape[-2]
    u = _units(points.float())
    seed = torch.as_tensor(seed, device=points.device).expand(points.shape[:-2])[..., None]  # [..., 1]
    # A point's distance to itself is set below any real one (cosine distances are >= 0 up to
    # rounding), so once chosen its nearest-chosen distance is -1: argmax never picks it
    # again and no separate "chosen" mask has to be kept in the loop. An invalid point looks
    # chosen from the start, and is never counted.
    if n > FPS_ROWS_ON_DEMAND_ABOVE:

        def row(i: torch.Tensor) -> torch.Tensor:  # the distances of point i, computed now
            ui = u.gather(-2, i[..., None].expand(*i.shape[:-1], 1, u.shape[-1]))  # [..., 1, D]
            r = (1.0 - ui @ u.transpose(-1, -2)).squeeze(-2).scatter(-1, i, -1.0)
            return r if valid is None else r.masked_fill(~valid, -1.0)

    else:
        dist = 1.0 - u @ u.transpose(-1, -2)  # [..., N, N]
        dist.diagonal(dim1=-2, dim2=-1).fill_(-1.0)
        if valid is not None:
            dist = dist.masked_fill(~valid[..., None, :], -1.0)

        def row(i: torch.Tensor) -> torch.Tensor:  # dist[..., i, :]
            return dist.gather(-2, i[..., None].expand(*i.shape[:-1], 1, n)).squeeze(-2)

    nearest = row(seed)
    for _ in range(min(m, n) - 1):
        nearest = torch.minimum(nearest, row(nearest.argmax(-1, keepdim=True)))
    chosen = nearest < -0.5
    if valid is not None:
        chosen = chosen & valid
    slots = torch.arange(n, device=points.device).expand_as(chosen)
    return torch.where(chosen, slots, n).sort(dim=-1).values[..., : min(m, n)]


def add_points(
    beacons: torch.Tensor, count: torch.Tensor, points: torch.Tensor, valid: torch.Tensor, beacon_min: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Continual FPS: feed points [B, H, P, D] (oldest first; `valid` [B, H, P]) into the
    buffers beacons [B, H, M, D] holding `count` [B, H] points in arrival order.

    Equivalent to adding the points one at a time: a point identical in direction to a held
    (or earlier, same-call) point is skipped; when a buffer reaches M it shrinks to
    `beacon_min` by FPS seeded with its newest point. Points go in chunks of at most
    M - `beacon_min`, so a buffer fills at most once a chunk: every buffer takes the chunk's
    points up to its own fill, the full ones shrink, and they then take the rest of the chunk
    against what they kept. The result is the sequential one, whatever the buffers' counts.
    """
    b, h, m_max, d = beacons.shape
    n, width, total = b * h, m_max + 1, points.shape[2]
    # Every buffer a row [B*H, M + 1, D]; the slot past the end takes the skipped points, so
    # writing needs no condition.
    buf = torch.cat([beacons, beacons.new_zeros(b, h, 1, d)], dim=2).view(n, width, d)
    count, points, valid = count.reshape(n), points.reshape(n, total, d), valid.reshape(n, total)
    slots = torch.arange(m_max, device=beacons.device)
    step = m_max - beacon_min
    for start in range(0, total, step):
        chunk, ok = points[:, start : start + step].float(), valid[:, start : start + step]
        u = _units(chunk)
        stored = chunk.to(buf.dtype)  # as held: what later points are compared with
        new = _new_points(u, ok, buf[:, :m_max].float(), slots < count[:, None])
        before = new.cumsum(-1) - new.long()  # points added ahead of each
        later = before >= (m_max - count)[:, None]  # after this buffer's fill: the second round
        new = new & ~later
        count = _append(buf, stored, new, count)
        # Only the full buffers shrink: FPS over those alone (a pool's rows fill at different
        # steps, so most of a feed's buffers are not full). One host sync: which are full.
        which = (count == m_max).nonzero().squeeze(1)
        if not len(which):
            continue
        filled = buf.index_select(0, which)[:, :m_max]
        keep = farthest_point_sample(filled, beacon_min, m_max - 1)  # seeded with the newest
        kept = filled.gather(1, keep[..., None].expand(-1, -1, d))
        buf.index_copy_(0, which, torch.cat([kept, kept.new_zeros(len(which), width - beacon_min, d)], 1))
        count = count.index_fill(0, which, beacon_min)
        # The rest of their chunk, against what they kept (a point that matched a dropped
        # beacon or an earlier point of the chunk is new again).
        ok = ok.index_select(0, which) & later.index_select(0, which)
        new = _new_points(u.index_select(0, which), ok, kept.float(), None)
        _append(buf, stored.index_select(0, which), new, count.index_select(0, which), which)
        count = count.index_add(0, which, new.sum(-1))
    held = buf[:, :m_max].reshape(b, h, m_max, d).clone(memory_format=torch.contiguous_format)
    return held, count.reshape(b, h)  # not a view of buf


def _new_points(
    u: torch.Tensor, ok: torch.Tensor, held: torch.Tensor, in_use: torch.Tensor | None
) -> torch.Tensor:
    """[N, k] which of the points (unit vectors u [N, k, D], `ok` [N, k]) are new: valid, and
    identical in direction to no held point (`held` [N, M, D], where `in_use` [N, M]; None:
    all) and no earlier valid point of theirs."""
    # u·h >= (1 - eps)·|h| is u·(h/|h|) >= 1 - eps without dividing every held vector by its
    # norm at every feed (the buffers are most of a feed's bytes); a zero vector is never matched.
    reach = (1.0 - DUPLICATE_EPS) * held.norm(dim=-1).clamp(min=1e-12)  # [N, M]
    dup = u @ held.transpose(-1, -2) >= reach[:, None, :]  # [N, k, M]
    dup_held = (dup if in_use is None else dup & in_use[:, None, :]).any(-1)
    k = u.shape[1]
    same = u @ u.transpose(-1, -2) >= 1.0 - DUPLICATE_EPS
    earlier = torch.ones(k, k, dtype=torch.bool, device=u.device).tril(-1)
    dup_prev = (same & earlier & ok[:, None, :]).any(-1)
    return ok & ~dup_held & ~dup_prev


def _append(
    buf: torch.Tensor,
    points: torch.Tensor,
    new: torch.Tensor,
    count: torch.Tensor,
    rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """Write the `new` points [N', k] of `points` [N', k, D] after each buffer's `count` (buffers
    `rows` of `buf`, all when None); returns the counts after."""
    width, d = buf.shape[1], buf.shape[2]
    slot = torch.where(new, count[:, None] + new.cumsum(-1) - 1, width - 1)
    row = torch.arange(len(count), device=count.device) if rows is None else rows
    at = (row[:, None] * width + slot).flatten()  # flat rows: index_copy_ is far faster than scatter_
    buf.view(-1, d).index_copy_(0, at, points.reshape(-1, d))
    return count + new.sum(-1)
