"""Farthest-point sampling past FPS_ROWS_ON_DEMAND_ABOVE points computes only the distance rows it
visits (the all-queries ablation's buffers grow with the sequence); it must choose what the
N x N matrix path chooses, ties included."""

from __future__ import annotations

import pytest
import torch

import reasonkv.core.policy.fps as fps
from reasonkv.core.policy.fps import farthest_point_sample


def matrix_path(monkeypatch, *args) -> torch.Tensor:
    with monkeypatch.context() as m:
        m.setattr(fps, "FPS_ROWS_ON_DEMAND_ABOVE", 10**9)
        return farthest_point_sample(*args)


def test_ties_go_to_the_lowest_index_on_both_paths(monkeypatch) -> None:
    """40 copies of the 8 basis vectors (N = 320, past the threshold), seeded with a copy of e5:
    every other direction is at distance exactly 1, so FPS takes the first copy of each, and a
    copy of a chosen direction never (distance 0). Row 1 marks the first copies invalid: the
    second ones (indices 8..15) are taken instead."""
    n = 320
    assert n > fps.FPS_ROWS_ON_DEMAND_ABOVE
    pts = torch.eye(8).repeat(40, 1).expand(2, n, 8).clone()
    valid = torch.ones(2, n, dtype=torch.bool)
    valid[1, :8] = False
    seed = torch.tensor([13, 13])  # a copy of e5
    want = [[0, 1, 2, 3, 4, 6, 7, 13], [8, 9, 10, 11, 12, 13, 14, 15]]
    assert farthest_point_sample(pts, 8, seed, valid).tolist() == want
    assert matrix_path(monkeypatch, pts, 8, seed, valid).tolist() == want


@pytest.mark.parametrize("n", [257, 700])
def test_rows_on_demand_choose_what_the_matrix_chooses(monkeypatch, n: int) -> None:
    """Random queries (2 rows x 5 heads, a fifth of the points invalid, random seeds), m = 16 and
    m > valid points: the same indices, in the same order."""
    gen = torch.Generator().manual_seed(n)
    pts = torch.randn(2, 5, n, 64, generator=gen)
    valid = torch.rand(2, 5, n, generator=gen) > 0.2
    valid[1, 4] = torch.arange(n) < 3  # a head with 3 valid points: it ends in index n
    seed = torch.randint(0, 3, (2, 5), generator=gen)
    for m in (16, 40):
        got = farthest_point_sample(pts, m, seed, valid)
        assert torch.equal(got, matrix_path(monkeypatch, pts, m, seed, valid))
    assert got[1, 4, 3:].eq(n).all() and got[1, 4, :3].lt(3).all()
