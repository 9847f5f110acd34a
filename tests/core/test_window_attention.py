"""window_attention's two normalisations, against a loop over queries on hand-made keys."""

from __future__ import annotations

import pytest
import torch

from reasonkv.core.policy.base import Observation, window_attention


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
