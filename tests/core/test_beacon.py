"""BeaconKV: RoPE round trips against transformers, continual FPS against a loop reference,
the beacon buffer upkeep, the scorer against a loop reference, and the method end to end."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from beacon_helpers import kept_by, stream
from conftest import (
    TEST_DEVICE,
    build_tiny_model,
    dynamic_cache,
    greedy_loop,
    left_pad,
    random_prompt,
    tiny_config,
    tiny_model,
)
from method_helpers import kept_tokens
from reasonkv import CompressedCache, make_cache
from reasonkv.core.hf_compat import cache_arg
from reasonkv.core.models import attention_modules
from reasonkv.core.policy import EMPTY, BeaconKVScorer, Observation, protected_mask, select_tokens
from reasonkv.core.policy.fps import DUPLICATE_EPS, add_points, farthest_point_sample
from reasonkv.core.policy.rope import apply_rope, rerotate, unapply_rope
from reasonkv.core.policy.scorers.beacon import BeaconState
from reasonkv.core.query_window import QueryWindow

D = 16
ROPES = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0},
    "llama3": {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    },
    # YaRN also scales cos/sin (attention_scaling != 1): the round trip must undo it.
    "yarn": {
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 16.0,
        "original_max_position_embeddings": 64,
    },
}


def rope_config(rope: str) -> LlamaConfig:
    return tiny_config("llama", head_dim=D, rope_parameters=dict(ROPES[rope]))


# --------------------------------------------------------------------------- rotation
@pytest.mark.parametrize("rope", ROPES)
def test_rerotated_query_equals_rope_of_its_pre_rope_form(rope: str) -> None:
    rotary = LlamaRotaryEmbedding(rope_config(rope))
    if rope == "yarn":
        assert rotary.attention_scaling != 1.0
    g = torch.Generator().manual_seed(0)
    pre = torch.randn(2, 4, 3, D, generator=g)  # [B, Hq, W, D]
    stored_at = torch.tensor([[3, 40, 517], [0, 9, 1000]])
    target = torch.tensor([[700], [1023]])  # one "now" per row

    def hf_rope(x, positions):
        cos, sin = rotary(x, positions)
        return apply_rotary_pos_emb(x, x, cos, sin)[0]

    post = hf_rope(pre, stored_at)
    inv, scale = rotary.inv_freq, rotary.attention_scaling
    torch.testing.assert_close(unapply_rope(post, stored_at[:, None], inv, scale), pre, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(apply_rope(pre, stored_at[:, None], inv, scale), post, atol=1e-5, rtol=1e-5)
    moved = rerotate(post, stored_at[:, None], target[:, None], inv, scale)
    expected = hf_rope(pre, target.expand(2, 3))
    torch.testing.assert_close(moved, expected, atol=1e-4, rtol=1e-4)


# -------------------------------------------------------------------------------- FPS
def cos_dist(a: list[float], b: list[float]) -> float:
    dot = sum(x * y for x, y in zip(a, b, strict=True))
    na = math.sqrt(sum(x * x for x in a)) or 1e-12
    nb = math.sqrt(sum(x * x for x in b)) or 1e-12
    return 1.0 - dot / (na * nb)


def greedy_fps_reference(points: list[list[float]], m: int, seed: int) -> list[int]:
    """Farthest-point sampling, written out: start at `seed`, then take the point farthest
    from its nearest chosen one (first index on ties); the chosen indices in ascending order."""
    chosen = [seed]
    while len(chosen) < min(m, len(points)):
        best, best_d = None, -1.0
        for i, p in enumerate(points):
            if i in chosen:
                continue
            d = min(cos_dist(p, points[c]) for c in chosen)
            if d > best_d:
                best, best_d = i, d
        chosen.append(best)
    return sorted(chosen)


class ReferenceBuffer:
    """One head's continual FPS, one point at a time: skip a point identical in direction to
    a held one, append, and when `max_size` is reached keep the FPS set seeded with the newest."""

    def __init__(self, max_size: int, min_size: int):
        self.max_size, self.min_size, self.points = max_size, min_size, []

    def add(self, p: list[float]) -> None:
        if any(cos_dist(p, q) <= DUPLICATE_EPS for q in self.points):
            return
        self.points.append(p)
        if len(self.points) == self.max_size:
            keep = greedy_fps_reference(self.points, self.min_size, len(self.points) - 1)
            self.points = [self.points[i] for i in keep]


def assert_buffers_match(
    beacons: torch.Tensor, count: torch.Tensor, refs: list[list[ReferenceBuffer]]
) -> None:
    for b, row in enumerate(refs):
        for h, ref in enumerate(row):
            n = int(count[b, h])
            assert n == len(ref.points)
            if n:
                torch.testing.assert_close(beacons[b, h, :n], torch.tensor(ref.points), atol=1e-6, rtol=0)


def test_fps_selects_the_greedy_farthest_point_set() -> None:
    g = torch.Generator().manual_seed(1)
    points = torch.randn(3, 2, 32, D, generator=g)
    points[0, 0, 5] = -points[0, 0, 31]  # the antipode of the seed is the first pick
    got = farthest_point_sample(points, 16, 31)
    assert got[0, 0].tolist().count(5) == 1
    for b in range(3):
        for h in range(2):
            assert got[b, h].tolist() == greedy_fps_reference(points[b, h].tolist(), 16, 31)
    seeds = torch.tensor([[0, 7], [31, 12], [3, 3]])
    got = farthest_point_sample(points, 5, seeds)
    for b in range(3):
        for h in range(2):
            assert got[b, h].tolist() == greedy_fps_reference(points[b, h].tolist(), 5, int(seeds[b, h]))


@pytest.mark.parametrize("chunks", [[1] * 90, [90], [7, 1, 40, 3, 39]])
def test_continual_fps_equals_adding_points_one_by_one(chunks: list[int]) -> None:
    """Whatever the arrival chunks (a prefill is one big chunk), the buffers equal the
    one-at-a-time reference, and never hold more than beacon_max points."""
    b, h, m_max, m_min = 2, 2, 12, 5
    g = torch.Generator().manual_seed(2)
    points = torch.randn(b, h, sum(chunks), 4, generator=g)
    points[0, 1, 30] = points[0, 1, 29] * 3.0  # same direction: must be skipped
    points[1, 0, 50:60] = points[1, 0, 10]  # a long run of duplicates of an old point
    valid = torch.rand(b, h, sum(chunks), generator=g) > 0.2
    refs = [[ReferenceBuffer(m_max, m_min) for _ in range(h)] for _ in range(b)]
    beacons, count = torch.zeros(b, h, m_max, 4), torch.zeros(b, h, dtype=torch.long)
    start = 0
    for size in chunks:
        sl = slice(start, start + size)
        beacons, count = add_points(beacons, count, points[:, :, sl], valid[:, :, sl], m_min)
        for bi in range(b):
            for hi in range(h):
                for j in range(start, start + size):
                    if valid[bi, hi, j]:
                        refs[bi][hi].add(points[bi, hi, j].tolist())
        assert int(count.max()) < m_max
        assert_buffers_match(beacons, count, refs)
        start += size
    assert int(count.min()) >= m_min  # 90 points went through: every buffer shrank at least once


@pytest.mark.parametrize(("m_max", "m_min"), [(12, 5), (6, 5), (8, 1)])
def test_a_feed_at_mixed_fills_equals_one_point_at_a_time_around_each_shrink(m_max: int, m_min: int) -> None:
    """Buffers at different fills take one feed (a chunk is M - beacon_min points: each buffer
    takes its chunk up to its own fill, shrinks, then takes the rest against what it kept).
    The feed repeats its own points: a repeat after a shrink that dropped the original is new
    again, one whose original was kept is not; the fill point (the FPS seed) is always kept.
    Beacon_min = M - 1 makes chunks of one point."""
    b, h = 3, 4
    g = torch.Generator().manual_seed(7)
    refs = [[ReferenceBuffer(m_max, m_min) for _ in range(h)] for _ in range(b)]
    beacons, count = torch.zeros(b, h, m_max, D), torch.zeros(b, h, dtype=torch.long)
    warm = torch.randn(b, h, 3 * m_max, D, generator=g)
    warm_valid = torch.rand(b, h, 3 * m_max, generator=g) > torch.linspace(0.1, 0.8, b * h).view(b, h, 1)
    feed = torch.randn(b, h, 4 * m_max, D, generator=g)
    for j in range(2, feed.shape[2], 2):  # every other point repeats the one two or three before
        feed[:, :, j] = feed[:, :, j - 2 - j % 3] * 1.5
    feed_valid = torch.ones(b, h, feed.shape[2], dtype=torch.bool)
    readded = 0
    for points, valid in ((warm, warm_valid), (feed, feed_valid)):
        beacons, count = add_points(beacons, count, points, valid, m_min)
        for bi in range(b):
            for hi in range(h):
                ref, seen = refs[bi][hi], []
                for j in range(points.shape[2]):
                    if not valid[bi, hi, j]:
                        continue
                    p = points[bi, hi, j].tolist()
                    was_seen = any(cos_dist(p, q) <= DUPLICATE_EPS for q in seen)
                    held = any(cos_dist(p, q) <= DUPLICATE_EPS for q in ref.points)
                    readded += was_seen and not held  # its original was dropped by a shrink
                    seen.append(p)
                    ref.add(p)
        assert_buffers_match(beacons, count, refs)
        if points is warm and m_max - m_min > 1:  # (with M - 1 every full buffer holds M - 1)
            assert len({int(c) for c in count.flatten()}) > 2, "the feed must find mixed fills"
    assert readded, "no repeat came after its original was dropped: the second round went untested"


def test_a_point_identical_to_a_beacon_is_never_added_twice() -> None:
    beacons, count = torch.zeros(1, 1, 8, D), torch.zeros(1, 1, dtype=torch.long)
    p = torch.randn(D, generator=torch.Generator().manual_seed(3))
    for chunk in ([p], [p, 2 * p, p], [p] * 20):  # alone, repeated in one chunk, a long run
        ones = torch.ones(1, 1, len(chunk), dtype=torch.bool)
        beacons, count = add_points(beacons, count, torch.stack(chunk)[None, None], ones, 4)
        assert int(count) == 1
    q = torch.randn(D, generator=torch.Generator().manual_seed(4))
    ones = torch.ones(1, 1, 3, dtype=torch.bool)
    beacons, count = add_points(beacons, count, torch.stack([q, p, q])[None, None], ones, 4)
    assert int(count) == 2
    torch.testing.assert_close(beacons[0, 0, :2], torch.stack([p, q]))


# ----------------------------------------------------------------------- buffer upkeep
FEEDS = [
    ("query_head", "all", 1),
    ("query_head", "all", 3),
    ("query_head", "all", 32),
    ("kv_head", "all", 1),
    ("kv_head", "all", 32),
    ("query_head", "generated", 3),
    ("query_head", "no_sinks", 3),
]


@pytest.mark.parametrize(("scope", "feed", "upkeep_every"), FEEDS)
@pytest.mark.parametrize(("recent", "b_max", "b_min"), [(5, 10, 4), (1, 10, 5)], ids=["5+4", "1+5"])
def test_queries_enter_the_buffer_when_they_leave_the_recent_window(
    scope, feed, upkeep_every, recent: int, b_max: int, b_min: int
) -> None:
    """Steps of several sizes (a left-padded prefill, single decode steps, a chunk) driven as the
    cache drives them: on_step sees the step's queries with the previous window untouched, then
    the cache's own window update keeps the newest `recent` queries and `query_backlog` before
    them; the older ones (rotated back to pre-RoPE, padding excluded) go through continual FPS
    exactly as a one-buffer-at-a-time reference says: each query head's own queries into its own
    buffer ("query_head"), or the group's G heads as G points per KV head ("kv_head"); under
    "generated" prompt queries never enter, under "no_sinks" the first 3 positions never do.
    Whether they are fed at once or queued and flushed in batches (`upkeep_every`) changes nothing.
    "1+5" is the paper's 1 recent + 31 beacons split (buffer 62 -> 31) in miniature."""
    rotary = LlamaRotaryEmbedding(rope_config("yarn"))
    scorer = BeaconKVScorer(
        beacon_max=b_max,
        beacon_min=b_min,
        recent=recent,
        upkeep_every=upkeep_every,
        beacon_scope=scope,
        beacon_feed=feed,
    )
    b, h, grp = 2, 2, 2
    gen = torch.Generator().manual_seed(5)
    window, group = QueryWindow(), [None]  # the layer's query window; this layer alone in its group
    view = SimpleNamespace(
        shape=(b, h, D, torch.device("cpu")),
        dtype=torch.float32,
        window=window,
        scorer_states=group,
        n_query_heads=h * grp,
        n_sink=3,
    )
    state = group[0] = scorer.new_state(view)
    buffers = h * grp if scope == "query_head" else h
    refs = [[ReferenceBuffer(b_max, b_min) for _ in range(buffers)] for _ in range(b)]
    prompt_len = 12
    history: list[tuple[torch.Tensor, torch.Tensor]] = []  # (pre-RoPE [B, Hq, D], index [B]) per query
    pads = [0, 3]
    seen = 0
    sizes = (12, 1, 1, 1, 7, 1, 1, 20, 1, 1, 1)
    for step_no, q in enumerate(sizes):
        pre = torch.randn(b, h * grp, q, D, generator=gen)
        index = torch.arange(seen, seen + q).expand(b, q).clone()
        positions = index.clone()
        for r, p in enumerate(pads):  # left padding: the first p tokens of row r are not real
            positions[r] -= p
            index[r, : max(0, p - seen)] = -1
        cos, sin = rotary(pre, positions)
        post = apply_rotary_pos_emb(pre, pre, cos, sin)[0]
        step = Observation(
            post,
            index,
            torch.zeros(b, h, 1, dtype=torch.long),
            D**-0.5,
            query_positions=positions,
            rope_inv_freq=rotary.inv_freq,
            rope_attention_scaling=rotary.attention_scaling,
            scorer_state=state,
        )
        if window.prompt_end is None:  # the cache labels the first forward as the prompt
            window.prompt_end = torch.full((b,), prompt_len)
        window_before = (window.queries, window.query_index, window.query_positions)
        scorer.on_step(step, torch.zeros(b, h, 1, D))
        window_after = (window.queries, window.query_index, window.query_positions)
        assert all(a is b_ for a, b_ in zip(window_after, window_before, strict=True))  # read, never trimmed
        keep = scorer.window + scorer.query_backlog
        window.keep(post, index, positions, keep)  # the cache's update
        history += [(pre[:, :, i], index[:, i], positions[:, i]) for i in range(q)]
        seen += q
        leaving = history[: len(history) - recent]
        history = history[len(history) - recent :]
        for vec, idx, pos in leaving:
            for r in range(b):
                if (
                    idx[r] < 0
                    or (feed == "generated" and idx[r] < prompt_len)
                    or (feed == "no_sinks" and pos[r] < 3)
                ):
                    continue
                for head in range(h * grp):  # query heads in order; a KV head's G heads are adjacent
                    refs[r][head if scope == "query_head" else head // grp].add(vec[r, head].tolist())
        assert window.queries.shape[2] == min(seen, keep)
        assert torch.equal(window.query_index[:, -recent:], torch.stack([i for _, i, _ in history], 1))
        assert max(state.pending) <= upkeep_every
        if step_no % 3 != 2 and step_no != len(sizes) - 1:
            continue  # let the queue build up across steps before reading the buffers
        scorer.flush(state, rotary.inv_freq, rotary.attention_scaling)
        assert state.pending == [0] * b
        count = state.count
        for r in range(b):
            for kv in range(buffers):
                assert int(count[r, kv]) == len(refs[r][kv].points)
                if refs[r][kv].points:
                    torch.testing.assert_close(
                        state.beacons[r, kv, : int(count[r, kv])],
                        torch.tensor(refs[r][kv].points),
                        atol=1e-4,
                        rtol=1e-4,
                    )
    assert int(state.count.max()) < b_max


# ----------------------------------------------------------------------------- scorer
def rope_by_hand(v: list[float], pos: int, inv_freq: list[float], scale: float) -> list[float]:
    half = len(v) // 2
    out = [0.0] * len(v)
    for i in range(half):
        a = pos * inv_freq[i]
        out[i] = scale * (v[i] * math.cos(a) - v[i + half] * math.sin(a))
        out[i + half] = scale * (v[i + half] * math.cos(a) + v[i] * math.sin(a))
    return out


def reference_scores(obs: Observation, keys: torch.Tensor, aggregation: str) -> torch.Tensor:
    """Loops: for every (row, KV head, key), over every observation point (each valid recent
    query of each group head; each held beacon rotated to the newest query's position), the
    softmax over the real keys it may see; then max (or mean over the points)."""
    b, hq, w, _ = obs.queries.shape
    h, t = keys.shape[1], keys.shape[2]
    grp = hq // h
    inv = obs.rope_inv_freq.tolist()
    out = torch.zeros(b, h, t)
    for r in range(b):
        now = max(int(obs.query_positions[r, i]) for i in range(w) if obs.query_index[r, i] >= 0)
        for kv in range(h):
            rows = []  # one attention distribution per observation point
            for i in range(w):
                if obs.query_index[r, i] < 0:
                    continue
                for g_ in range(grp):
                    q = obs.queries[r, kv * grp + g_, i].tolist()
                    allowed = [
                        j
                        for j in range(t)
                        if obs.token_index[r, kv, j] != EMPTY
                        and obs.token_index[r, kv, j] <= obs.query_index[r, i]
                    ]
                    rows.append((q, allowed))
            st = obs.scorer_state
            per_query_head = st.beacons.shape[1] == hq  # else one shared buffer per KV head
            for buf in range(kv * grp, (kv + 1) * grp) if per_query_head else [kv]:
                for m in range(int(st.count[r, buf])):
                    q = rope_by_hand(st.beacons[r, buf, m].tolist(), now, inv, obs.rope_attention_scaling)
                    rows.append((q, [j for j in range(t) if obs.token_index[r, kv, j] != EMPTY]))
            for q, allowed in rows:
                logits = {
                    j: sum(x * y for x, y in zip(q, keys[r, kv, j].tolist(), strict=True)) * obs.scaling
                    for j in allowed
                }
                top = max(logits.values())
                z = sum(math.exp(v - top) for v in logits.values())
                for j, v in logits.items():
                    p = math.exp(v - top) / z
                    if aggregation == "max":
                        out[r, kv, j] = max(out[r, kv, j], p)
                    else:
                        out[r, kv, j] += p / len(rows)
    return out


def hand_made_case(seed: int = 6, per_query_head: bool = False) -> tuple[Observation, torch.Tensor]:
    """B=2, H=2, G=2, W=4, T=14, M=6. Row 1: a padding slot in front, a ragged EMPTY tail on
    head 1, its oldest recent query is padding, positions shifted (left padding); the
    buffers (one per KV head, or one per query head) hold different numbers of beacons (one
    holds none)."""
    g = torch.Generator().manual_seed(seed)
    b, h, grp, w, t, m = 2, 2, 2, 4, 14, 6
    index = torch.arange(t).expand(b, h, t).clone()
    index[1, :, 0] = EMPTY
    index[1, 1, 11:] = EMPTY
    q_index = torch.arange(t - w, t).expand(b, w).clone()
    q_index[1, 0] = -1
    positions = q_index.clone()
    positions[1] -= 1
    inv = 1.0 / (10000 ** (torch.arange(0, D, 2).float() / D))
    obs = Observation(
        queries=torch.randn(b, h * grp, w, D, generator=g) * 2,
        query_index=q_index,
        token_index=index,
        scaling=D**-0.5,
        query_positions=positions,
        scorer_state=BeaconState(  # no group: scoring feeds nothing, the buffers are as given
            beacons=torch.randn(b, h * grp if per_query_head else h, m, D, generator=g) * 2,
            count=torch.tensor([[6, 0, 3, 1], [2, 5, 0, 6]] if per_query_head else [[6, 0], [2, 5]]),
            window=QueryWindow(),
            group=[],
        ),
        rope_inv_freq=inv,
        rope_attention_scaling=1.2,
    )
    return obs, torch.randn(b, h, t, D, generator=g)


@pytest.mark.parametrize("aggregation", ["max", "mean"])
@pytest.mark.parametrize("scope", ["query_head", "kv_head"])
def test_beacon_scores_and_kept_tokens_match_the_loop_reference(aggregation: str, scope: str) -> None:
    obs, keys = hand_made_case(per_query_head=scope == "query_head")
    scorer = BeaconKVScorer(aggregation=aggregation, recent=4, beacon_scope=scope)
    got = scorer.score(obs, keys, keys)
    ref = reference_scores(obs, keys, aggregation)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-4)
    protected = protected_mask(obs.token_index, 1, 2)
    keep = torch.tensor([[7, 7], [7, 6]])
    slots, _ = select_tokens(got, obs.token_index, keep, protected)
    for r in range(2):
        for kv in range(2):
            real = [j for j in range(14) if obs.token_index[r, kv, j] != EMPTY]
            forced = [j for j in real if protected[r, kv, j]]
            rest = sorted((j for j in real if j not in forced), key=lambda j: (-float(ref[r, kv, j]), -j))
            expected = sorted(forced + rest[: int(keep[r, kv]) - len(forced)])
            assert [s for s in slots[r, kv].tolist() if s < 14] == expected


@pytest.mark.parametrize(("aggregation", "third"), [("max", 3), ("mean", 6)])
def test_max_keeps_one_query_s_strong_read_where_mean_keeps_a_shared_weak_one(
    aggregation: str, third: int
) -> None:
    """The paper's max-vs-mean argument on hand-made queries. One head, D=8, RoPE with zero
    frequencies. Keys: token 0 = 8·e0 (a sink), token 3 = 8·e1 ("A"), token 6 = 8·e2 ("B"), the
    rest zero. The 20 older generated queries (the beacons) are e3 plus noise outside the keys'
    span: they spread evenly, 1/12 on every token, A and B alike. The 4 recent ones: one 4·e1,
    which puts ≈1 on A; three e2, which put e^√8/(e^√8 + 11) ≈ 0.606 on B and ≈ 0.036 on A.
    Keeping the sink, the 2 newest tokens and one more: max keeps A (≈1 > 0.606); mean keeps B
    (three points of 0.606 outweigh one of 1)."""
    d, t, e = 8, 12, torch.eye(8)
    queries = torch.cat([e[3].expand(24, d), 4 * e[1][None], e[2].expand(3, d)])
    queries[4:24, 4:] += 0.1 * torch.randn(20, 4, generator=torch.Generator().manual_seed(3))
    keys = torch.zeros(1, 1, t, d)
    keys[0, 0, 0], keys[0, 0, 3], keys[0, 0, 6] = 8 * e[0], 8 * e[1], 8 * e[2]
    scorer = BeaconKVScorer(recent=4, aggregation=aggregation)
    *_, (_, state, window) = stream(
        scorer, queries[None, None], (4,) + (1,) * 24, pads=(0,), prompt_len=4, kv_heads=1,
        inv_freq=torch.zeros(d // 2),
    )  # fmt: skip
    assert int(state.count[0, 0]) >= 16  # the older queries are beacons
    assert kept_by(scorer, state, window, keys, recent=4)[1] == [0, third, 10, 11]


def test_beacons_change_the_choice_and_pooling_is_optional() -> None:
    obs, keys = hand_made_case()
    with_beacons = BeaconKVScorer(recent=4).score(obs, keys, keys)
    obs.scorer_state.count = torch.zeros(2, 2, dtype=torch.long)
    recent_only = BeaconKVScorer(recent=4).score(obs, keys, keys)
    assert (with_beacons >= recent_only - 1e-7).all()  # max over a superset of points
    assert not torch.allclose(with_beacons[0, 0], recent_only[0, 0])
    pooled = BeaconKVScorer(recent=4, pooling="max", kernel=3).score(obs, keys, keys)
    window_max = torch.stack([recent_only[..., :-2], recent_only[..., 1:-1], recent_only[..., 2:]]).amax(0)
    assert torch.equal(pooled[..., 1:-1], window_max)


# ------------------------------------------------------------------------ end to end
def test_knobs_reach_the_scorer_and_schedule() -> None:
    model = tiny_model("llama", "sdpa", 2)
    cache = make_cache(
        model,
        "beaconkv",
        64,
        beacon_max=12,
        beacon_min=3,
        recent=8,
        aggregation="mean",
        pooling="avg",
        kernel=5,
        fraction=0.25,
    )
    scorer = cache.policy.scorer
    assert (scorer.beacon_max, scorer.beacon_min, scorer.recent, scorer.aggregation) == (12, 3, 8, "mean")
    assert (scorer.pooling, scorer.kernel) == ("avg", 5)
    assert cache.policy.schedule.target(64) == 48
    assert (cache.policy.n_sink, cache.policy.n_recent) == (4, 16)
    with pytest.raises(ValueError, match="beacon_max"):
        make_cache(model, "beaconkv", 64, beacon_typo=3)
    with pytest.raises(ValueError, match="beacon_min < beacon_max"):
        make_cache(model, "beaconkv", 64, beacon_min=32, beacon_max=32)


def test_beaconkv_without_eviction_equals_dynamic_cache() -> None:
    model = tiny_model("llama", "sdpa", 2)
    prompt = random_prompt(30, seed=7)
    cache = make_cache(model, "beaconkv", 512)
    tokens, logits = greedy_loop(model, prompt, cache, 40)
    ref_tokens, ref_logits = greedy_loop(model, prompt, dynamic_cache(), 40)
    torch.testing.assert_close(logits, ref_logits, atol=1e-5, rtol=0)
    assert torch.equal(tokens, ref_tokens)
    assert cache.events == []
    assert int(cache.layers[0].states.scorer.count.min()) > 0  # the buffers were kept all along


@pytest.mark.parametrize(("scope", "counts"), [("query_head", [[1, 1, 1, 1]]), ("kv_head", [[2, 2]])])
def test_repeated_token_gives_one_beacon_per_query_head(scope: str, counts: list) -> None:
    """Layer 0's pre-RoPE query depends on the token only, so a prompt of one repeated token
    has one pre-RoPE query per query head (G per KV head); recovered from post-RoPE queries at
    60 different positions (rope-scaled model), they must all be recognised as the same: one
    beacon in each query head's buffer, or G in each KV head's shared one."""
    model = build_tiny_model("llama", "sdpa", seed=0, init_range=0.02, rope_parameters=dict(ROPES["yarn"]))
    cache = make_cache(model, "beaconkv", 512, beacon_scope=scope, beacon_feed="all")  # prompt queries too
    with torch.no_grad():
        model(input_ids=torch.full((1, 60), 5, device=TEST_DEVICE), **cache_arg(cache))
        for _ in range(5):
            model(input_ids=torch.full((1, 1), 5, device=TEST_DEVICE), **cache_arg(cache))
    policy = cache.policy
    policy.scorer.flush(cache.layers[0].states.scorer, policy.rope_inv_freq, policy.rope_attention_scaling)
    # Identical tokens give identical values, so every layer sees one hidden state per token.
    for layer in cache.layers:
        assert layer.states.scorer.count.tolist() == counts
        # ... while the post-RoPE queries of those positions are all different directions.
        post = layer.queries[0, 0]  # [recent + backlog, D]
        unit = post / post.norm(dim=-1, keepdim=True)
        dist = 1 - unit @ unit.T
        assert bool((dist + torch.eye(len(post), device=dist.device) > 1e-3).all())


def test_beaconkv_memory_stays_bounded_over_300_steps() -> None:
    model = tiny_model("llama", "sdpa", 2)
    budget = 32
    cache = make_cache(model, "beaconkv", budget)
    ids = random_prompt(20, seed=8)
    caps, physical = [], []
    with torch.no_grad():
        for _ in range(300):
            ids = model(input_ids=ids, **cache_arg(cache)).logits[:, -1:].argmax(-1)
            assert int(cache.memory()["live_tokens"].max()) <= budget - 1  # compressed on reaching B_max
            caps.append(max(layer.keys.shape[2] for layer in cache.layers))
            physical.append(cache.memory()["physical_bytes"])
            for layer in cache.layers:
                scorer = cache.policy.scorer  # the recent queries and the queued ones, nothing more
                assert layer.queries.shape[2] <= scorer.window + scorer.query_backlog
                assert int(layer.states.scorer.count.max()) < 32
    assert max(caps) <= budget
    assert max(physical[150:]) <= max(physical[:150])
    assert len(cache.events) >= 2 * (300 - 20) // 4 - 4  # each layer evicts 4 of 32 every 4 steps


def test_beaconkv_padded_batch_equals_rows_alone() -> None:
    model = tiny_model("llama", "sdpa", 2)
    prompts = [random_prompt(n, seed=20 + n)[0] for n in (40, 22, 31)]
    ids, mask = left_pad(prompts)
    kw = dict(max_new_tokens=40, do_sample=False)
    cache = make_cache(model, "beaconkv", 32)
    batch = model.generate(ids, attention_mask=mask, **cache_arg(cache), **kw)[:, ids.shape[1] :]
    assert len(cache.events) > 10
    for r, p in enumerate(prompts):
        pad = ids.shape[1] - p.numel()
        alone_cache = make_cache(model, "beaconkv", 32)
        alone = model.generate(p[None], **cache_arg(alone_cache), **kw)[:, p.numel() :]
        assert torch.equal(alone[0], batch[r])
        for lb, la in zip(cache.layers, alone_cache.layers, strict=True):
            assert kept_tokens(lb, r, pad) == kept_tokens(la, 0)
            for c, lay in ((cache, lb), (alone_cache, la)):  # feed the queued queries in
                c.policy.scorer.flush(
                    lay.states.scorer, c.policy.rope_inv_freq, c.policy.rope_attention_scaling
                )
            sb, sa = lb.states.scorer, la.states.scorer
            assert torch.equal(sb.count[r], sa.count[0])
            torch.testing.assert_close(sb.beacons[r], sa.beacons[0], atol=1e-4, rtol=1e-4)


def assert_same_kept_slots_and_buffers(grouped: CompressedCache, alone: CompressedCache) -> None:
    """Same kept slots in every layer, and once every queue is fed, the same buffers: the held
    beacons of each row and head (a buffer may be longer than what it holds)."""
    for lg, la in zip(grouped.layers, alone.layers, strict=True):
        assert torch.equal(lg.token_index, la.token_index)
    for c in (grouped, alone):
        for lay in c.layers:
            c.policy.scorer.flush(lay.states.scorer, c.policy.rope_inv_freq, c.policy.rope_attention_scaling)
    for lg, la in zip(grouped.layers, alone.layers, strict=True):
        sg, sa = lg.states.scorer, la.states.scorer
        assert torch.equal(sg.count, sa.count)
        for r in range(sg.count.shape[0]):
            for h in range(sg.count.shape[1]):
                n = int(sg.count[r, h])
                torch.testing.assert_close(sg.beacons[r, h, :n], sa.beacons[r, h, :n], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("upkeep_every", [4, 32])
def test_all_layers_fed_in_one_pass_equal_each_layer_fed_alone(monkeypatch, upkeep_every: int) -> None:
    """Inside a cache the layers' queues are fed together (buffers stacked); a cache whose layers
    are each their own group feeds them one by one. Same tokens, same kept slots, same beacons,
    in a padded GQA batch with eviction, and the queues really wait for the last layer (every
    layer's is empty after a batched pass). A prompt whose leaving queries outnumber the backlog
    is fed at once, alone. Here every stacked queue and buffer has the same length: the padding
    of unequal ones is the next test's."""
    import reasonkv.core.policy.scorers.beacon as beacon

    model = tiny_model("qwen2", "sdpa", 2)
    prompts = [random_prompt(n, seed=60 + n)[0] for n in (50, 27)]
    ids, mask = left_pad(prompts)
    kw = dict(max_new_tokens=70, do_sample=False)
    grouped = make_cache(model, "beaconkv", 32, upkeep_every=upkeep_every)
    alone = make_cache(model, "beaconkv", 32, upkeep_every=upkeep_every)
    for layer in alone.layers:
        layer.scorer_states = [None] * (layer.layer_idx + 1)  # a group of its own
    passes: list[int] = []  # layers fed per pass
    feed = beacon.BeaconKVScorer._feed

    def spy(self, members, queues, *args):
        if members:
            passes.append(len(members))
            assert all(max(m.pending) <= 0 for m in members)  # taken off the queue (< 0: fed ahead)
        return feed(self, members, queues, *args)

    monkeypatch.setattr(beacon.BeaconKVScorer, "_feed", spy)
    out_g = model.generate(ids, attention_mask=mask, **cache_arg(grouped), **kw)
    passes_g, passes[:] = list(passes), []
    out_a = model.generate(ids, attention_mask=mask, **cache_arg(alone), **kw)
    assert torch.equal(out_g, out_a)
    n_layers = len(grouped.layers)
    assert passes_g[:n_layers] == [1] * n_layers  # the prompt's queries, layer by layer
    # then only batched passes: scoring feeds the later layers ahead, so their own scoring
    # finds nothing left to feed
    assert set(passes_g[n_layers:]) == {n_layers}
    assert passes_g.count(n_layers) >= 2 and set(passes) == {1}
    for lay in grouped.layers:
        assert max(lay.states.scorer.pending) <= upkeep_every
    assert len(grouped.events) > 20
    assert_same_kept_slots_and_buffers(grouped, alone)


def per_layer_cache(model, method: str, budgets: list[int], **knobs) -> CompressedCache:
    """make_cache's cache of `method`, but with a budget per layer (as an allocator would give)."""
    base = make_cache(model, method, min(budgets), **knobs)
    heads = model.config.num_key_value_heads
    per_head = torch.tensor(budgets)[:, None].expand(-1, heads).contiguous()
    return CompressedCache(
        per_head,
        base.policy,
        method=base.method,
        attention_modules=attention_modules(model),
        scaling=base.scaling,
    )


@pytest.mark.parametrize(
    ("method", "knobs"),
    [
        ("beaconkv", {}),
        ("beaconkv-all-queries", {"selection": "fps"}),
        ("beaconkv-all-queries", {"selection": "kmeans"}),
    ],
    ids=["beaconkv", "all-queries-fps", "all-queries-kmeans"],
)
def test_unequal_queues_and_buffers_fed_in_one_pass_equal_each_layer_fed_alone(
    monkeypatch, method: str, knobs: dict
) -> None:
    """The stacked feed's padding: a shorter queue ends in invalid points, and (the all-queries
    ablation, whose buffers grow) a shorter buffer is padded to the longest. Plain decoding never
    needs either (every layer's queue and buffer grow in step), so here layer 1 has a budget it
    never reaches and a 24-token chunk arrives mid-generation, the step after layer 0 compressed:
    layer 0 alone scores (and grows) on it, and at its next compression is fed 4 queries, stacked
    with layer 1's 28 in a buffer half as long. Grouped and alone still give the same tokens, kept
    slots and buffers."""
    import reasonkv.core.policy.scorers.beacon as beacon

    model = tiny_model("qwen2", "sdpa", 2)
    prompt, chunk = random_prompt(30, seed=61, batch=2), random_prompt(24, seed=62, batch=2)
    grouped, alone = (per_layer_cache(model, method, [32, 200], upkeep_every=32, **knobs) for _ in range(2))
    for layer in alone.layers:
        layer.scorer_states = [None] * (layer.layer_idx + 1)  # a group of its own
    passes: list[tuple[list[int], list[int]]] = []  # per pass: each layer's buffer and queue lengths
    feed = beacon.BeaconKVScorer._feed

    def spy(self, members, queues, *args):
        passes.append(([m.points().shape[2] for m in members], [q[1].shape[1] for q in queues]))
        return feed(self, members, queues, *args)

    monkeypatch.setattr(beacon.BeaconKVScorer, "_feed", spy)

    @torch.no_grad()
    def run(cache) -> torch.Tensor:
        out, fed = model(input_ids=prompt, **cache_arg(cache)), []
        for step in range(80):
            fed.append(chunk if step == 58 else out.logits[:, -1:].argmax(-1))
            out = model(input_ids=fed[-1], **cache_arg(cache))
        return torch.cat(fed, 1)

    tokens_g = run(grouped)
    passes_g, passes[:] = list(passes), []
    assert torch.equal(run(alone), tokens_g)
    assert all(len(queues) == 1 for _, queues in passes)
    stacked = [p for p in passes_g if len(p[1]) > 1]
    assert any(len(set(queues)) > 1 for _, queues in stacked)  # a shorter queue was padded
    buffers_differ = any(len(set(buffers)) > 1 for buffers, _ in stacked)
    assert buffers_differ == (method == "beaconkv-all-queries")  # BeaconKV's buffers never differ
    assert len(grouped.events) > 15
    assert_same_kept_slots_and_buffers(grouped, alone)


@pytest.mark.parametrize("protect_prompt", [False, True])
def test_prefix_protection_keeps_the_whole_prompt_or_only_the_sinks(protect_prompt: bool) -> None:
    """The paper's "prefix tokens are always kept", two readings (the ablation): with
    protect_prompt every one of the 30 prompt tokens survives 60 steps at budget 24 in every layer
    and head; without it eviction takes all the rest of the prompt here, and only the 4 sinks are
    left. Exact on both sides: a protect_prompt left on would keep more, sinks left unprotected
    fewer (at n_sink=0 this run evicts tokens 0-3 in every head)."""
    model = tiny_model("llama", "sdpa", 2)
    cache = make_cache(model, "beaconkv", 24, protect_prompt=protect_prompt)
    greedy_loop(model, random_prompt(30, seed=9), cache, 60)
    assert cache.events
    expected = set(range(30)) if protect_prompt else set(range(4))
    for layer in cache.layers:
        for head in kept_tokens(layer, 0):
            assert {i for i in head if i < 30} == expected
