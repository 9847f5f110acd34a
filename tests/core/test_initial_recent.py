"""Initial+Recent (BeaconKV's Table 3 comparator): which queries form its fixed observation set,
the tokens it keeps where BeaconKV keeps others, its knobs and its memory, and the method end to
end against the full cache."""

from __future__ import annotations

import math

import pytest
import torch

from beacon_helpers import default_inv_freq, kept_by, stream
from conftest import dynamic_cache, greedy_loop, random_prompt, tiny_model
from reasonkv import get_method, make_cache
from reasonkv.core.policy import (
    BeaconKVScorer,
    InitialRecentScorer,
)

FIXED = 16  # beacon_min: the size of the fixed set


# ------------------------------------------------------------------ the observation set
@pytest.mark.parametrize(
    ("scope", "feed", "first"),
    [
        # the index of each row's first admitted query (row 1 is left-padded by 3)
        ("query_head", "generated", (12, 12)),  # padding and the 12-slot prompt never enter
        ("query_head", "all", (0, 3)),  # the prompt does, padding still does not
        ("kv_head", "generated", (12, 12)),  # a KV head's set: its G heads' points, query by query
    ],
)
def test_the_set_is_the_first_admitted_queries_in_order_and_never_changes(scope, feed, first) -> None:
    """Row 0 unpadded, row 1 with 3 padding slots; 2 KV heads of 2 query heads each; recent 4,
    a queue of 3. After every forward (a prompt, single steps, chunks) each buffer holds, in order,
    the first `beacon_min` = 16 admitted queries that have left the recent window (fewer while
    fewer have); once full it is never touched again (40 more leave after that)."""
    b, h, grp, d = 2, 2, 2, 16
    scorer = InitialRecentScorer(recent=4, upkeep_every=3, beacon_scope=scope, beacon_feed=feed)
    per_query = 1 if scope == "query_head" else grp  # points each query adds to one buffer
    phase1 = (12, 1, 1, 1, 7, 1, 5, 1, 1, 1, 1)  # 32: the last set ("generated") fills here
    phase2 = (1,) * 8 + (20,) + (1,) * 12  # 40 more queries
    n = sum(phase1) + sum(phase2)
    pre = torch.randn(b, h * grp, n, d, generator=torch.Generator().manual_seed(11))
    inv = default_inv_freq(d)
    full_at = None
    for seen, state, _ in stream(
        scorer, pre, phase1 + phase2, pads=(0, 3), prompt_len=12, kv_heads=h, inv_freq=inv
    ):
        assert state.beacons.shape == (b, h * grp // per_query, FIXED, d)  # 16 slots, no more
        left = seen - 4  # queries out of the recent window
        for r in range(b):
            admitted = list(range(first[r], max(left, first[r])))[: FIXED // per_query]
            for buf in range(state.beacons.shape[1]):
                heads = [buf] if scope == "query_head" else [buf * grp + g for g in range(grp)]
                expected = [pre[r, head, i] for i in admitted for head in heads]
                assert int(state.count[r, buf]) == len(expected)
                if expected:
                    torch.testing.assert_close(
                        state.beacons[r, buf, : len(expected)], torch.stack(expected), atol=2e-5, rtol=0
                    )
        if full_at is None and bool((state.count == FIXED).all()):
            full_at, snapshot = seen, state.beacons.clone()
        elif full_at is not None:
            assert torch.equal(state.beacons, snapshot) and bool((state.count == FIXED).all())
    assert full_at is not None and n - full_at >= 40


# ------------------------------------------------------- where it and BeaconKV differ
def test_the_first_queries_decide_where_beaconkv_lets_later_ones_decide() -> None:
    """One head, D=8, RoPE with zero frequencies (positions do not rotate, so the numbers stay
    readable). Keys: token 0 = 8·e0 (a sink), token 3 = 8·e1 ("A"), token 6 = 8·e2 ("B"), the
    rest zero. After a 4-query prompt, the first 16 generated queries are e1 (+ noise outside the
    keys' span), so they give A probability e^√8/(e^√8 + 11) ≈ 0.606; the next 40 are 4·e2, which
    give B ≈ 1; the 4 recent ones are 4·e0 (they read the sink). Keeping the sink, the 2 newest
    tokens and one more: Initial+Recent's set is the 16 first queries, so it keeps A (3); BeaconKV's
    FPS buffer holds the later queries, so it keeps B (6)."""
    d, t, e = 8, 12, torch.eye(8)
    noise = torch.zeros(64, d)
    noise[:, 4:] = 0.1 * torch.randn(64, 4, generator=torch.Generator().manual_seed(3))
    queries = torch.cat(
        [e[3].expand(4, d), e[1].expand(16, d), 4 * e[2].expand(40, d), 4 * e[0].expand(4, d)]
    )
    pre = (queries + noise)[None, None]  # [1, 1, 64, 8]
    keys = torch.zeros(1, 1, t, d)
    keys[0, 0, 0], keys[0, 0, 3], keys[0, 0, 6] = 8 * e[0], 8 * e[1], 8 * e[2]
    sizes = (4,) + (1,) * 60
    kept = {}
    for scorer in (InitialRecentScorer(recent=4), BeaconKVScorer(recent=4)):
        *_, (_, state, window) = stream(
            scorer, pre, sizes, pads=(0,), prompt_len=4, kv_heads=1, inv_freq=torch.zeros(d // 2)
        )
        scores, kept[type(scorer).__name__] = kept_by(scorer, state, window, keys, recent=4)
        if isinstance(scorer, InitialRecentScorer):
            torch.testing.assert_close(state.beacons[0, 0], pre[0, 0, 4:20])  # the first 16 generated
            a = math.exp(math.sqrt(8))
            torch.testing.assert_close(scores[0, 0, 3], torch.tensor(a / (a + 11)))
            torch.testing.assert_close(scores[0, 0, 6], torch.tensor(1 / (a + 11)))
    assert kept == {"InitialRecentScorer": [0, 3, 10, 11], "BeaconKVScorer": [0, 6, 10, 11]}


# ------------------------------------------------------------------- knobs and memory
def test_the_set_size_is_beacon_min_and_beacon_max_is_no_knob() -> None:
    model = tiny_model("llama", "sdpa", 2)
    spec = get_method("initial-recent")
    beacon = get_method("beaconkv").knobs()
    assert spec.knobs() == {k: v for k, v in beacon.items() if k != "beacon_max"}  # beaconkv's defaults
    cache = make_cache(model, "initial-recent", 64, beacon_min=40, recent=8, fraction=0.25)
    scorer = cache.policy.scorer
    assert (scorer.beacon_min, scorer.beacon_max, scorer.recent) == (40, 40, 8)  # above beaconkv's 32
    assert cache.policy.schedule.target(64) == 48
    assert (cache.policy.n_sink, cache.policy.n_recent) == (4, 16)
    with pytest.raises(ValueError, match="beacon_max"):
        make_cache(model, "initial-recent", 64, beacon_max=32)
    with pytest.raises(ValueError, match="beacon_min"):
        make_cache(model, "initial-recent", 64, beacon_min=0)


def test_without_eviction_it_equals_the_full_cache_and_holds_16_slots_where_beaconkv_holds_32() -> None:
    """Same run, nothing evicted: the logits and tokens of a DynamicCache; the fixed set full
    (40 generated, 16 recent: 24 left the window); and the caches differ only by beaconkv's 16
    extra slots per query head and layer."""
    model = tiny_model("llama", "sdpa", 2)
    prompt = random_prompt(30, seed=7)
    ref_tokens, ref_logits = greedy_loop(model, prompt, dynamic_cache(), 40)
    caches = {m: make_cache(model, m, 512) for m in ("initial-recent", "beaconkv")}
    for cache in caches.values():
        tokens, logits = greedy_loop(model, prompt, cache, 40)
        torch.testing.assert_close(logits, ref_logits, atol=1e-5, rtol=0)
        assert torch.equal(tokens, ref_tokens) and cache.events == []
    policy = caches["initial-recent"].policy
    extra = 0
    for ours, theirs in zip(caches["initial-recent"].layers, caches["beaconkv"].layers, strict=True):
        policy.scorer.flush(ours.states.scorer, policy.rope_inv_freq, policy.rope_attention_scaling)
        sa, sb = ours.states.scorer, theirs.states.scorer
        assert sa.count.shape == (1, 4) and bool((sa.count == FIXED).all())
        assert sa.beacons.shape[2] == FIXED and sb.beacons.shape[2] == 32
        extra += sb.beacons[:, :, FIXED:].numel() * sb.beacons.element_size()
    physical = {m: c.memory()["physical_bytes"] for m, c in caches.items()}
    assert physical["beaconkv"] - physical["initial-recent"] == extra > 0
