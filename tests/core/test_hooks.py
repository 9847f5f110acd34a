"""The scorer hook contract: on_step sees exactly this forward's queries, before the cache's
query window moves on; afterwards the window holds the scorer's `window` newest queries."""

from __future__ import annotations

import torch

import reasonkv
from conftest import TEST_DEVICE, left_pad, random_prompt, tiny_model
from reasonkv.core.hf_compat import cache_arg
from reasonkv.core.policy.scorers.h2o import H2OScorer
from reasonkv.core.policy.scorers.snapkv import SnapKVScorer


def test_on_step_gets_this_forwards_queries_and_the_previous_window(monkeypatch) -> None:
    model = tiny_model("llama", "sdpa", 2)
    calls: list[tuple[list[list[int]], object, object]] = []
    original = H2OScorer.on_step
    cache = reasonkv.make_cache(model, "h2o", 64)

    def spy(self, step, keys):
        if step.layer_idx == 0:
            calls.append((step.query_index.tolist(), cache.layers[0].window.query_index, step.queries.shape))
        return original(self, step, keys)

    monkeypatch.setattr(H2OScorer, "on_step", spy)
    ids, mask = left_pad([random_prompt(3, seed=1)[0], random_prompt(5, seed=2)[0]])
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask, **cache_arg(cache))
        for _ in range(2):
            mask = torch.cat([mask, torch.ones(2, 1, dtype=mask.dtype, device=mask.device)], dim=1)
            model(
                input_ids=torch.tensor([[7], [9]], device=TEST_DEVICE),
                attention_mask=mask,
                **cache_arg(cache),
            )
    (prefill, window0, shape0), (step1, window1, shape1), (step2, window2, _) = calls
    assert prefill == [[-1, -1, 2, 3, 4], [0, 1, 2, 3, 4]]  # padding queries are -1
    assert window0 is None and shape0[2] == 5  # nothing observed before the prompt
    assert step1 == [[5], [5]] and shape1[2] == 1
    assert window1.tolist() == [[4], [4]]  # the previous window (h2o keeps 1 query), not yet moved
    assert step2 == [[6], [6]] and window2.tolist() == [[5], [5]]


def test_window_keeps_the_newest_queries_of_the_scorer() -> None:
    model = tiny_model("llama", "sdpa", 2)
    cache = reasonkv.make_cache(model, "snapkv", 64, window=4, n_recent=4)
    assert isinstance(cache.policy.scorer, SnapKVScorer)
    with torch.no_grad():
        model(input_ids=random_prompt(6, seed=3), **cache_arg(cache))
        assert cache.layers[1].query_index.tolist() == [[2, 3, 4, 5]]
        model(input_ids=torch.tensor([[11]], device=TEST_DEVICE), **cache_arg(cache))
    assert cache.layers[1].query_index.tolist() == [[3, 4, 5, 6]]
    assert cache.layers[1].queries.shape[2] == 4
