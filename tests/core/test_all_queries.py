"""The all-queries ablation of BeaconKV (its Figure 7 alternatives to continual FPS): the buffers
hold every admitted query, naive FPS or K-means picks the scoring set from all of them, and the
method runs end to end and is metered."""

from __future__ import annotations

import math

import pytest
import torch

from beacon_helpers import default_inv_freq, stream
from conftest import TEST_DEVICE, dynamic_cache, greedy_loop, random_prompt, tiny_model
from reasonkv import get_method, make_cache
from reasonkv.core.hf_compat import cache_arg
from reasonkv.core.policy import AllQueriesScorer, BeaconKVScorer
from reasonkv.core.policy.fps import farthest_point_sample

E = torch.eye(4)
# Six admitted queries, one head, D=4 (zero RoPE frequencies: they stay as written).
POINTS = torch.stack([E[0], E[1], E[2], E[0] + 0.1 * E[1], E[1] + 0.1 * E[0], E[3]])


def fed(scorer: BeaconKVScorer, points: torch.Tensor):
    """Feed `points` [N, D] to one head as generated queries, one a forward, then one more so all
    N have left a recent window of 1; the state after the last forward."""
    pre = torch.cat([points, torch.zeros(1, points.shape[-1])])[None, None]
    inv = torch.zeros(points.shape[-1] // 2)
    *_, (_, state, _) = stream(
        scorer, pre, (1,) * pre.shape[2], pads=(0,), prompt_len=0, kv_heads=1, inv_freq=inv
    )
    return state


def test_every_admitted_query_is_held_in_order_and_the_buffer_grows() -> None:
    """Two rows (row 1 left-padded by 3), 2 KV heads of 2 query heads, a 12-slot prompt, recent 4:
    after each forward every buffer holds all generated queries that have left the recent window,
    in order (60 of them at the end: no bound, no duplicate skipping)."""
    b, hq, n, d = 2, 4, 76, 16
    pre = torch.randn(b, hq, n, d, generator=torch.Generator().manual_seed(3))
    scorer = AllQueriesScorer(recent=4, upkeep_every=3)
    sizes = (12, 1, 1, 7, 1, 5, *(1,) * 8, 20, *(1,) * 21)
    for seen, state, _ in stream(
        scorer, pre, sizes, pads=(0, 3), prompt_len=12, kv_heads=2, inv_freq=default_inv_freq(d)
    ):
        left = max(seen - 4 - 12, 0)
        assert state.count.tolist() == [[left] * hq] * b
        assert state.beacons.shape[2] >= left
        torch.testing.assert_close(state.beacons[:, :, :left], pre[:, :, 12 : 12 + left], atol=2e-5, rtol=0)
    assert left == 60


def test_naive_fps_picks_from_all_queries_seeded_with_the_newest() -> None:
    """FPS from the newest (e3): every other point is at cosine distance 1, the tie goes to the
    oldest, e0; then e1 and e2 are at distance 1 from both, e0+0.1e1 at 0.005 and e1+0.1e0 at
    0.90: e1 (the older of the tie). So the set is {e0, e1, e3}, in index order."""
    state = fed(AllQueriesScorer(recent=1, upkeep_every=1, beacon_min=3, beacon_feed="all"), POINTS)
    points, count = AllQueriesScorer(beacon_min=3)._scoring_points(state)
    assert count.tolist() == [[3]]
    torch.testing.assert_close(points[0, 0], POINTS[[0, 1, 5]])
    # Continual FPS over the same stream (a buffer of 4 shrunk to 3) holds another set: the
    # ablation is not BeaconKV by another name.
    continual = fed(
        BeaconKVScorer(recent=1, upkeep_every=1, beacon_max=4, beacon_min=3, beacon_feed="all"), POINTS
    )
    held = continual.beacons[0, 0, : int(continual.count[0, 0])]
    assert not (held.shape == points[0, 0].shape and torch.allclose(held, points[0, 0]))


def test_fps_with_invalid_points_never_picks_them() -> None:
    """Padding slots (zero vectors, at cosine distance 1 from everything) are never chosen; a row
    with fewer valid points than m ends in index N."""
    pts = torch.stack([POINTS, torch.cat([POINTS[:2], torch.zeros(4, 4)])])  # row 1: 2 real points
    valid = torch.tensor([[True] * 6, [True, True, False, False, False, False]])
    chosen = farthest_point_sample(pts, 3, torch.tensor([5, 1]), valid)
    assert chosen.tolist() == [[0, 1, 5], [0, 1, 6]]


def test_kmeans_centres_are_the_cluster_means() -> None:
    """Three queries near e0 and three near e2, two centres: FPS starts them at the newest (an
    e2 one) and an e0 one, and Lloyd's iterations move each to its cluster's mean."""
    near0 = torch.stack([E[0] + 0.2 * E[1], E[0] - 0.1 * E[1], E[0] + 0.05 * E[3]])
    near2 = torch.stack([E[2] + 0.3 * E[3], E[2] - 0.2 * E[1], E[2]])
    stream_points = torch.stack([near0[0], near2[0], near0[1], near2[1], near0[2], near2[2]])
    state = fed(AllQueriesScorer(recent=1, upkeep_every=1, beacon_feed="all"), stream_points)
    points, count = AllQueriesScorer(beacon_min=2, selection="kmeans")._scoring_points(state)
    assert count.tolist() == [[2]]
    torch.testing.assert_close(points[0, 0], torch.stack([near0.mean(0), near2.mean(0)]))


def test_fewer_queries_than_the_set_score_with_what_there_is() -> None:
    state = fed(AllQueriesScorer(recent=1, upkeep_every=1, beacon_feed="all"), POINTS[:2])
    for selection in ("fps", "kmeans"):
        points, count = AllQueriesScorer(beacon_min=16, selection=selection)._scoring_points(state)
        assert count.tolist() == [[2]]
        torch.testing.assert_close(points[0, 0, :2], POINTS[:2])


def test_the_method_end_to_end_and_its_knobs() -> None:
    """Registered, evicts to its budget, holds more state than BeaconKV as it goes (every query),
    and equals the full cache while nothing is evicted."""
    model = tiny_model("llama", "sdpa", 2)
    spec = get_method("beaconkv-all-queries")
    assert spec.knobs()["selection"] == "fps" and "beacon_max" not in spec.knobs()
    prompt = random_prompt(20, seed=5, batch=2)
    ref_tokens, ref_logits = greedy_loop(model, prompt, dynamic_cache(), 24)
    tokens, logits = greedy_loop(model, prompt, make_cache(model, "beaconkv-all-queries", 512), 24)
    torch.testing.assert_close(logits, ref_logits, atol=1e-5, rtol=0)
    assert torch.equal(tokens, ref_tokens)
    states = {}
    for method, knobs in (("beaconkv", {}), ("beaconkv-all-queries", {"selection": "kmeans"})):
        cache = make_cache(model, method, 24, **knobs)
        greedy_loop(model, prompt, cache, 60)
        assert int(cache.layers[0].n_valid.max()) <= 24 and cache.events
        states[method] = cache.memory()["peak_state_bytes"]
    assert states["beaconkv-all-queries"] > states["beaconkv"]
    with pytest.raises(ValueError, match="selection"):
        make_cache(model, "beaconkv-all-queries", 64, selection="median")
    with pytest.raises(ValueError, match="beacon_max"):
        make_cache(model, "beaconkv-all-queries", 64, beacon_max=32)


def naive_fps(points: list[list[float]], m: int) -> list[int]:
    """Naive FPS written out, the ablation's selection: cosine distance, seeded with the newest
    point, then the point farthest from its nearest chosen one (the lowest index on ties); the
    chosen indices in ascending order."""
    norms = [math.sqrt(sum(x * x for x in p)) or 1e-12 for p in points]

    def dist(i: int, j: int) -> float:
        return 1.0 - sum(a * b for a, b in zip(points[i], points[j], strict=True)) / (norms[i] * norms[j])

    n = len(points)
    chosen = [n - 1]
    nearest = [dist(i, n - 1) for i in range(n)]
    while len(chosen) < min(m, n):
        best = max((i for i in range(n) if i not in chosen), key=lambda i: (nearest[i], -i))
        chosen.append(best)
        nearest = [min(d, dist(i, best)) for i, d in enumerate(nearest)]
    return sorted(chosen)


def test_fps_inside_an_evicting_cache_scores_with_naive_fps_over_every_held_query(monkeypatch) -> None:
    """End to end with selection="fps" (the default) at a budget that evicts: at every compression
    each query head's buffer holds every generated query that has left the recent window, and
    the scoring set is exactly naive FPS over all of them (the loop reference above), for every
    row and query head; a bounded buffer, or another seed or distance, picks other points. The
    80 tokens of a row are distinct and fed one a forward: a repeated token repeats layer 0's
    pre-RoPE query, and FPS ties between identical directions are broken by fp32 rounding."""
    model = tiny_model("llama", "sdpa", 2)
    g = torch.Generator().manual_seed(0)
    ids = torch.stack([torch.randperm(127, generator=g)[:80] + 1 for _ in range(2)]).to(TEST_DEVICE)
    cache = make_cache(model, "beaconkv-all-queries", 24)
    scorer = cache.policy.scorer
    assert scorer.selection == "fps"
    calls = []
    scoring_points = AllQueriesScorer._scoring_points
    fed = 20  # tokens fed once the forward in progress ends

    def spy(self, st):
        points, picked = scoring_points(self, st)
        calls.append((fed, st.points().clone(), st.count.clone(), points, picked))
        return points, picked

    monkeypatch.setattr(AllQueriesScorer, "_scoring_points", spy)
    with torch.no_grad():
        model(input_ids=ids[:, :fed], **cache_arg(cache))
        for fed in range(21, 81):
            model(input_ids=ids[:, fed - 1 : fed], **cache_arg(cache))
    assert int(cache.layers[0].n_valid.max()) <= 24 and cache.events
    assert len(calls) >= 20
    b, x = 2, model.config.num_attention_heads
    for seen, held, count, points, picked in calls:
        left = seen - scorer.recent - 20  # generated queries out of the recent window
        assert count.tolist() == [[left] * x] * b
        assert picked.tolist() == [[min(left, scorer.beacon_min)] * x] * b
        for r in range(b):
            for h in range(x):
                ref = naive_fps(held[r, h, :left].tolist(), scorer.beacon_min)
                assert torch.equal(points[r, h, : len(ref)], held[r, h, ref]), (seen, r, h, ref)
    assert max(c[0] for c in calls) - scorer.recent - 20 > 2 * scorer.beacon_min  # FPS really chose
