"""Beam search reorders the batch rows of the cache every step (`reorder_cache`); per-row
scorer, schedule and allocator state in `layer.states` must follow the rows, or a beam
would evict by another beam's history."""

from __future__ import annotations

import pytest
import torch

from conftest import TEST_DEVICE, left_pad, random_prompt, tiny_model
from reasonkv import make_cache
from reasonkv.core.hf_compat import cache_arg

# (method, budget, knobs): each compresses several times in both phases below.
METHODS = [
    ("beaconkv", 24, {}),
    ("rpc", 4, {"window": 4, "n_recent": 4}),
    ("reasonalloc-head-rkv", 24, {"interval": 8}),
]


@torch.no_grad()
def _feed(model, cache, tokens: torch.Tensor, mask: torch.Tensor) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Teacher-force tokens [B, n] one per forward after `mask` [B, seen] (left padding);
    the last-position logits of each forward, and the grown mask."""
    logits = []
    for i in range(tokens.shape[1]):
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], 1)
        logits.append(
            model(input_ids=tokens[:, i : i + 1], attention_mask=mask, **cache_arg(cache)).logits[:, -1]
        )
    return logits, mask


def _row_state(cache) -> list[dict[str, torch.Tensor]]:
    """Per layer, every per-row tensor the scorer, schedule or head allocator keeps in its
    state, beacon queues fed first."""
    policy = cache.policy
    out = []
    for layer in cache.layers:
        if hasattr(policy.scorer, "flush"):
            policy.scorer.flush(layer.states.scorer, policy.rope_inv_freq, policy.rope_attention_scaling)
        found = {}
        for part in ("scorer", "schedule", "head_allocator"):
            state = getattr(layer.states, part)
            for name, t in (vars(state) if state is not None else {}).items():
                if isinstance(t, torch.Tensor) and t.dim() and t.shape[0] == layer.keys.shape[0]:
                    found[f"{part}.{name}"] = t
        out.append(found)
    return out


@pytest.mark.parametrize(("method", "budget", "knobs"), METHODS)
def test_a_reordered_row_continues_exactly_like_the_row_it_copies(
    method: str, budget: int, knobs: dict
) -> None:
    """Rows [p0, p1] (p0 shorter, left-padded) decode 40 tokens; then beam search's reorder
    makes the batch [p1, p1]. Fed the same 40 further tokens, both rows must behave exactly
    like p1 decoding alone all along: same logits, same kept tokens. Row 0 inherited p0's
    beacons, prompt length, periodic counters and head utilities unless the states moved."""
    model = tiny_model("qwen2", "sdpa", 2)
    ids, mask = left_pad([random_prompt(14, seed=70)[0], random_prompt(20, seed=71)[0]])
    first, then = random_prompt(40, seed=72, batch=2), random_prompt(40, seed=73)
    batch = make_cache(model, method, budget, **knobs)
    alone = make_cache(model, method, budget, **knobs)
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask, **cache_arg(batch))
        model(input_ids=ids[1:], **cache_arg(alone))
    _, mask = _feed(model, batch, first, mask)
    _, mask_alone = _feed(model, alone, first[1:], torch.ones(1, 20, dtype=torch.long, device=TEST_DEVICE))
    n_events = len(batch.events)
    assert n_events > 0
    batch.reorder_cache(torch.tensor([1, 1]))
    logits_batch, _ = _feed(model, batch, then.expand(2, -1), mask[[1, 1]])
    logits_alone, _ = _feed(model, alone, then, mask_alone)
    assert len(batch.events) > n_events  # it kept compressing after the reorder
    for lb, la in zip(logits_batch, logits_alone, strict=True):
        for row in (0, 1):
            torch.testing.assert_close(lb[row], la[0], atol=1e-5, rtol=1e-5)
    for state_b, state_a in zip(_row_state(batch), _row_state(alone), strict=True):
        assert state_b.keys() == state_a.keys() and state_a
        for name, t in state_a.items():
            for row in (0, 1):
                torch.testing.assert_close(state_b[name][row], t[0], atol=1e-5, rtol=1e-5, msg=name)
    for layer_b, layer_a in zip(batch.layers, alone.layers, strict=True):
        for row in (0, 1):
            assert torch.equal(
                layer_b.token_index[row, :, : layer_b.used], layer_a.token_index[0, :, : layer_a.used]
            )


def test_beam_search_with_eviction_keeps_state_per_beam() -> None:
    model = tiny_model("llama", "sdpa", 2)
    cache = make_cache(model, "beaconkv", 24)
    out = model.generate(
        random_prompt(20, seed=74), **cache_arg(cache), num_beams=3, max_new_tokens=40, do_sample=False
    )
    assert out.shape == (1, 60) and len(cache.events) > 0
    for layer in cache.layers:
        assert layer.states.scorer.beacons.shape[0] == layer.keys.shape[0] == 3
        assert layer.queries.shape[0] == 3  # the queue lives in the cache's query backlog
