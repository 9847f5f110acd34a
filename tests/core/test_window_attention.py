"""window_attention's two normalisations, against a loop over queries on hand-made keys, and
the scoring window a scorer leaves out: kept."""

from __future__ import annotations

import pytest
import torch

from reasonkv.core.policy.base import EMPTY, Observation, window_attention
from reasonkv.core.policy.scorers.rkv import RKVScorer
from reasonkv.core.policy.scorers.snapkv import SnapKVScorer
from reasonkv.core.policy.selection import protected_mask, select_tokens


@pytest.mark.parametrize("gqa", ["mean", "max_logit"])
def test_softmax_over_all_keys_then_dropping_the_newest_matches_a_loop(gqa) -> None:
    torch.manual_seed(0)
    keys = torch.randn(1, 1, 5, 4)  # one KV head, 5 tokens
    queries = torch.randn(1, 2, 2, 4)  # a group of 2 query heads, the last 2 queries
    obs = Observation(queries, torch.tensor([[3, 4]]), torch.arange(5)[None, None], 0.5)
    both = window_attention(obs, keys, exclude_last=2, gqa=gqa, softmax_over="all")
    only = window_attention(obs, keys, exclude_last=2, gqa=gqa)  # the paper's: over the candidates
    for w, q_index in enumerate((3, 4)):
        logits = torch.einsum("gd,td->gt", queries[0, :, w], keys[0, 0, : q_index + 1]) * 0.5
        if gqa == "max_logit":
            logits = logits.amax(0, keepdim=True)
        over_all = torch.softmax(logits, -1)[:, :3].mean(0)  # tokens 0-2: the 2 newest left out
        over_candidates = torch.softmax(logits[:, :3], -1).mean(0)
        assert torch.allclose(both[0, 0, w, :3], over_all, atol=1e-6)
        assert torch.allclose(only[0, 0, w, :3], over_candidates, atol=1e-6)
        assert both[0, 0, w, 3:].abs().max() == 0 and only[0, 0, w, 3:].abs().max() == 0
        assert float(both[0, 0, w].sum()) < 1 - 1e-3  # the newest tokens' share is gone


@pytest.mark.parametrize("scorer", [SnapKVScorer(window=4), RKVScorer(window=4)])
def test_the_scoring_window_is_kept_even_where_fewer_are_protected(scorer) -> None:
    """Tokens left out of the scoring window (the 4 newest real ones) score at the top, so a
    method protecting only 1 recent token still keeps them, instead of evicting them first."""
    torch.manual_seed(1)
    keys = torch.randn(1, 1, 10, 4)
    index = torch.tensor([[[0, 1, 2, 3, 4, 5, 6, 7, EMPTY, 9]]])  # a hole among the newest
    obs = Observation(torch.randn(1, 2, 4, 4), torch.tensor([[6, 7, 8, 9]]), index, 0.5)
    scores = scorer.score(obs, keys, keys)
    top = torch.finfo(scores.dtype).max
    assert scores[0, 0, [5, 6, 7, 9]].eq(top).all() and scores[0, 0, :5].lt(top).all()
    protected = protected_mask(index, 0, 1)  # only the newest token
    slots, _ = select_tokens(scores, index, torch.tensor([[5]]), protected)
    assert set(slots[0, 0].tolist()) >= {5, 6, 7, 9}
