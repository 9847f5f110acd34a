"""Properties of the policy math over random inputs (hypothesis): token selection and every
budget allocator keep their contracts for any layout of empty slots, scores and budgets.

Selection: kept slots are real, protected ones always kept, exactly min(keep, n_valid) per
head, in ascending order with T as padding, and no dropped token outscores a kept one;
evict_one gives up an unprotected real token of minimum score (or T). Allocators: exact
sums, every value within its floor and cap, never negative.
"""

from __future__ import annotations

import math

import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from reasonkv.core.policy.allocators import AdaKVHeadAllocator, PyramidAllocator, UniformAllocator
from reasonkv.core.policy.allocators.reasonalloc import (
    EntropyHeadSplit,
    ReasonAllocAllocator,
    UtilityState,
    layer_budgets,
    split_by_utility,
)
from reasonkv.core.policy.base import EMPTY, Observation
from reasonkv.core.policy.contract import SplitRequest
from reasonkv.core.policy.rounding import fill_to_caps, largest_remainder, water_fill
from reasonkv.core.policy.selection import evict_one, protected_mask, select_tokens

SETTINGS = settings(max_examples=80, deadline=None)


# ------------------------------------------------------------------------ strategies
score_values = st.one_of(
    st.sampled_from([0.0, 1.0, 2.0]),  # ties, which the selection must break deterministically
    st.floats(-100, 100, allow_nan=False, width=32),
)


def draw_layout(data, max_b: int = 2, max_h: int = 3, max_t: int = 16) -> torch.Tensor:
    """token_index [B, H, T]: increasing sequence indices (with gaps) in positional order,
    EMPTY in random slots (left padding, ragged tails, holes)."""
    b = data.draw(st.integers(1, max_b), label="B")
    h = data.draw(st.integers(1, max_h), label="H")
    t = data.draw(st.integers(1, max_t), label="T")
    n = b * h * t
    real = data.draw(st.lists(st.integers(0, 3).map(bool), min_size=n, max_size=n), label="real")
    steps = data.draw(st.lists(st.integers(1, 3), min_size=n, max_size=n), label="steps")
    index = torch.tensor(steps).reshape(b, h, t).cumsum(-1) - 1
    return torch.where(torch.tensor(real).reshape(b, h, t), index, torch.full_like(index, EMPTY))


def draw_scores(data, shape: torch.Size) -> torch.Tensor:
    n = math.prod(shape)
    values = data.draw(st.lists(score_values, min_size=n, max_size=n), label="scores")
    return torch.tensor(values, dtype=torch.float32).reshape(shape)


def draw_protection(data, index: torch.Tensor) -> torch.Tensor:
    n_sink = data.draw(st.integers(0, 3), label="n_sink")
    n_recent = data.draw(st.integers(0, 4), label="n_recent")
    protect_before = None
    if data.draw(st.booleans(), label="protect a prompt"):
        cut = data.draw(st.lists(st.integers(0, 8), min_size=index.shape[0], max_size=index.shape[0]))
        protect_before = torch.tensor(cut)
    return protected_mask(index, n_sink, n_recent, protect_before)


# ------------------------------------------------------------------------- selection
@SETTINGS
@given(data=st.data())
def test_select_tokens_keeps_exactly_the_best_real_tokens_in_order(data) -> None:
    index = draw_layout(data)
    b, h, t = index.shape
    scores = draw_scores(data, index.shape)
    protected = draw_protection(data, index)
    valid = index != EMPTY
    assert not bool((protected & ~valid).any()), "protected_mask marked an empty slot"
    extra = data.draw(st.lists(st.integers(0, t + 2), min_size=b * h, max_size=b * h), label="extra")
    keep = protected.sum(-1) + torch.tensor(extra).reshape(b, h)  # the caller's guarantee: keep >= protected

    slots, new_len = select_tokens(scores, index, keep, protected)

    n_valid = valid.sum(-1)
    assert torch.equal(new_len, torch.minimum(keep, n_valid))
    assert slots.shape == (b, h, int(new_len.max()) if b * h else 0)
    for r in range(b):
        for kv in range(h):
            n = int(new_len[r, kv])
            row = slots[r, kv].tolist()
            real, pad = row[:n], row[n:]
            assert real == sorted(set(real)), "kept slots must be distinct and ascending"
            assert pad == [t] * len(pad), "padding is T, after the real slots"
            assert all(bool(valid[r, kv, s]) for s in real), "an empty slot was kept"
            kept = set(real)
            assert {s for s in range(t) if protected[r, kv, s]} <= kept, "a protected slot was dropped"
            dropped = [s for s in range(t) if valid[r, kv, s] and s not in kept]
            free = [s for s in real if not protected[r, kv, s]]
            for s in free:  # top-k: no dropped token beats a kept one; ties go to the newer token
                for d in dropped:
                    assert scores[r, kv, s] > scores[r, kv, d] or (
                        scores[r, kv, s] == scores[r, kv, d] and s > d
                    )


@SETTINGS
@given(data=st.data())
def test_evict_one_gives_up_the_lowest_unprotected_real_token(data) -> None:
    index = draw_layout(data)
    b, h, t = index.shape
    scores = draw_scores(data, index.shape)
    protected = draw_protection(data, index)
    evict = torch.tensor(data.draw(st.lists(st.booleans(), min_size=b * h, max_size=b * h))).reshape(b, h)

    victim = evict_one(scores, index, protected, evict)

    assert victim.shape == (b, h, 1)
    for r in range(b):
        for kv in range(h):
            candidates = [s for s in range(t) if index[r, kv, s] != EMPTY and not protected[r, kv, s]]
            slot = int(victim[r, kv, 0])
            if not evict[r, kv] or not candidates:
                assert slot == t
                continue
            lowest = min(float(scores[r, kv, s]) for s in candidates)
            assert slot in candidates and float(scores[r, kv, slot]) == lowest
            assert slot == min(s for s in candidates if float(scores[r, kv, s]) == lowest)  # the oldest


@SETTINGS
@given(data=st.data())
def test_evict_one_drops_what_select_tokens_drops_at_one_below(data) -> None:
    """A head keeping all but one token loses the same token through either path."""
    index = draw_layout(data)
    scores = draw_scores(data, index.shape)
    protected = draw_protection(data, index)
    n_valid = (index != EMPTY).sum(-1)
    can_give = n_valid > protected.sum(-1)
    keep = torch.where(can_give, n_valid - 1, n_valid)
    slots, _ = select_tokens(scores, index, keep, protected)
    victim = evict_one(scores, index, protected, can_give)
    t = index.shape[-1]
    for r in range(index.shape[0]):
        for kv in range(index.shape[1]):
            kept = {s for s in slots[r, kv].tolist() if s < t}
            real = {s for s in range(t) if index[r, kv, s] != EMPTY}
            assert real - kept == ({int(victim[r, kv, 0])} if can_give[r, kv] else set())


# ----------------------------------------------------------------------- rounding
@SETTINGS
@given(data=st.data())
def test_largest_remainder_sums_exactly_with_floor_or_floor_plus_one(data) -> None:
    rows = data.draw(st.integers(1, 3))
    n = data.draw(st.integers(1, 12))
    values = data.draw(st.lists(st.floats(0, 1000, allow_nan=False), min_size=rows * n, max_size=rows * n))
    shares = torch.tensor(values, dtype=torch.float64).reshape(rows, n)
    floor = shares.floor().long()
    extra = torch.tensor(data.draw(st.lists(st.integers(0, n), min_size=rows, max_size=rows)))
    total = floor.sum(-1) + extra

    out = largest_remainder(shares, total)

    assert out.dtype == torch.long and out.shape == shares.shape
    assert torch.equal(out.sum(-1), total)
    plus = out - floor
    assert bool(((plus == 0) | (plus == 1)).all()) and bool((out >= 0).all())
    frac = shares - floor
    for r in range(rows):  # the extra units go to the largest fractional parts (ties: lower index)
        for i in range(n):
            for j in range(n):
                if plus[r, i] == 1 and plus[r, j] == 0:
                    assert frac[r, i] > frac[r, j] or (frac[r, i] == frac[r, j] and i < j)


# ------------------------------------------------------------------- layer budgets
@SETTINGS
@given(n_layers=st.integers(1, 40), n_heads=st.integers(1, 8), budget=st.integers(1, 5000))
def test_uniform_gives_every_head_the_budget(n_layers, n_heads, budget) -> None:
    out = UniformAllocator().allocate(n_layers, n_heads, budget)
    assert out.shape == (n_layers, n_heads)
    assert bool((out == budget).all()) and int(out.sum()) == n_layers * n_heads * budget


@SETTINGS
@given(
    n_layers=st.integers(1, 48),
    n_heads=st.integers(1, 8),
    budget=st.integers(1, 5000),
    beta=st.floats(1.0, 50.0),
    window=st.integers(0, 64),
)
def test_pyramid_is_exact_within_its_schedule_and_decreasing(n_layers, n_heads, budget, beta, window) -> None:
    out = PyramidAllocator(beta=beta, window=window).allocate(n_layers, n_heads, budget)
    assert out.shape == (n_layers, n_heads) and bool((out == out[:, :1]).all())
    assert int(out.sum()) == n_layers * n_heads * budget
    per_layer = out[:, 0].tolist()
    assert min(per_layer) >= min(window, budget) >= 0  # never below the window it keeps anyway
    assert all(a >= b for a, b in zip(per_layer, per_layer[1:], strict=False))
    scored = budget - window
    if n_layers > 1 and scored > 0:  # each layer is its real share rounded down or up
        lo, hi = scored / beta, 2 * scored - scored / beta
        for layer, got in enumerate(per_layer):
            share = window + hi - layer * (hi - lo) / (n_layers - 1)
            assert math.floor(share) - 1e-9 <= got <= math.ceil(share) + 1e-9


def check_water_fill(weights: list[float], lo: int, hi: int | None, total: int) -> None:
    out = water_fill(torch.tensor(weights), total, lo, hi)
    assert out.shape == (len(weights),)
    assert int(out.sum()) == total, f"sum {int(out.sum())} != {total}: {out.tolist()}"
    assert int(out.min()) >= lo and (hi is None or int(out.max()) <= hi)


water_weights = st.lists(st.floats(0, 100), min_size=1, max_size=30)


@SETTINGS
@given(weights=water_weights, lo=st.integers(0, 50), fill=st.floats(0, 1))
def test_water_fill_with_a_floor_is_exact_and_within_bounds(weights, lo, fill) -> None:
    """The way ReasonAllocAllocator uses it: a floor (min_budget), no cap."""
    n = len(weights)
    check_water_fill(weights, lo, None, n * lo + round(fill * n * 300))


@SETTINGS
@given(weights=water_weights, lo=st.integers(0, 50), span=st.integers(0, 200), fill=st.floats(0, 1))
@example(weights=[0.0] * 8 + [1.0], lo=1, span=1, fill=0.0)
def test_water_fill_with_floor_and_cap_is_exact_and_within_bounds(weights, lo, span, fill) -> None:
    n = len(weights)
    check_water_fill(weights, lo, lo + span, n * lo + round(fill * n * span))


@SETTINGS
@given(
    demand=st.lists(st.floats(0.01, 100.0), min_size=1, max_size=40),
    n_heads=st.integers(1, 8),
    budget=st.integers(1, 4096),
    tau=st.one_of(st.sampled_from([math.inf]), st.floats(0.1, 10.0)),
    lo_fraction=st.floats(0, 1),
)
def test_reasonalloc_layers_are_exact_and_floored(demand, n_heads, budget, tau, lo_fraction) -> None:
    lo = int(lo_fraction * budget)  # the floor make_cache passes is at most the budget
    direct = layer_budgets(torch.tensor(demand), n_heads, budget, tau=tau, lo=lo)
    allocator = ReasonAllocAllocator(tau=tau)
    stats = {"load_demand": lambda profile: demand, "min_budget": lo}
    for out in (direct, allocator.allocate(len(demand), n_heads, budget, stats)):
        assert out.shape == (len(demand), n_heads) and bool((out == out[:, :1]).all())
        assert int(out.sum()) == len(demand) * n_heads * budget
        assert int(out.min()) >= lo >= 0
    flat = ReasonAllocAllocator(tau=tau, layer_level=False).allocate(len(demand), n_heads, budget, {})
    assert bool((flat == budget).all())


# -------------------------------------------------------------------- head splits
@SETTINGS
@given(data=st.data())
def test_fill_to_caps_clips_and_keeps_the_row_sums(data) -> None:
    rows = data.draw(st.integers(1, 3), label="rows")
    h = data.draw(st.integers(1, 8), label="H")
    n = rows * h
    shares = torch.tensor(data.draw(st.lists(st.floats(0, 500), min_size=n, max_size=n)), dtype=torch.float64)
    cap = torch.tensor(data.draw(st.lists(st.integers(0, 300), min_size=n, max_size=n)))
    shares, cap = shares.reshape(rows, h), cap.reshape(rows, h)
    weights = None  # None: in proportion to the shares; else float32, like ReasonAlloc's utility
    if data.draw(st.booleans(), label="weights"):
        weights = torch.tensor(data.draw(st.lists(st.floats(1e-3, 1), min_size=n, max_size=n)))
        weights = weights.reshape(rows, h)

    out = fill_to_caps(shares, cap, weights=weights)

    assert bool((out <= cap).all()) and bool((out >= 0).all())
    target = torch.minimum(shares.sum(-1), cap.sum(-1).double())  # all of it, where the caps allow
    torch.testing.assert_close(out.sum(-1), target, rtol=1e-6, atol=1e-6)


@SETTINGS
@given(data=st.data())
def test_split_by_utility_is_exact_floored_and_capped(data) -> None:
    rows = data.draw(st.integers(1, 3))
    h = data.draw(st.integers(1, 8))
    cap = torch.tensor(data.draw(st.lists(st.integers(0, 300), min_size=rows * h, max_size=rows * h)))
    cap = cap.reshape(rows, h)
    utility = torch.tensor(data.draw(st.lists(st.floats(0, 1), min_size=rows * h, max_size=rows * h)))
    utility = utility.reshape(rows, h)
    floor = torch.tensor(data.draw(st.integers(0, 40)))
    floored = torch.minimum(floor, cap)
    # The caller's guarantee: the total covers every head's floor.
    extra = torch.tensor(data.draw(st.lists(st.integers(0, 2000), min_size=rows, max_size=rows)))
    total = floored.sum(-1) + extra

    out = split_by_utility(total, utility, floor, cap)

    assert out.shape == (rows, h) and out.dtype == torch.long
    assert torch.equal(out.sum(-1), torch.minimum(total, cap.sum(-1)))
    assert bool((out >= floored).all()) and bool((out <= cap).all()) and bool((out >= 0).all())


def draw_head_split_case(data) -> tuple[Observation, torch.Tensor, torch.Tensor, torch.Tensor]:
    """An observation (G = 2 query heads per KV head, W = 2 queries after every key), keys,
    scores and each head's real-token count."""
    index = draw_layout(data, max_h=4, max_t=14)
    b, h, t = index.shape
    d = 4
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16), label="seed"))
    keys = torch.randn(b, h, t, d, generator=g)
    real_max = torch.where(index != EMPTY, index, torch.zeros_like(index)).amax((1, 2))
    query_index = torch.stack([real_max + 1, real_max + 2], dim=-1)  # [B, W]
    obs = Observation(torch.randn(b, 2 * h, 2, d, generator=g), query_index, index, d**-0.5)
    scores = draw_scores(data, index.shape)
    return obs, keys, scores, (index != EMPTY).sum(-1)


@SETTINGS
@given(data=st.data())
def test_adakv_split_is_exact_and_within_each_head(data) -> None:
    obs, keys, scores, n_valid = draw_head_split_case(data)
    n_sink = data.draw(st.integers(0, 2))
    n_recent = data.draw(st.integers(0, 4))
    alpha = data.draw(st.floats(0.0, 1.0))
    protected = protected_mask(obs.token_index, n_sink, n_recent).sum(-1)
    # The cache's guarantee: a layer total between what is protected and what is held.
    room = (n_valid - protected).sum(-1)
    extra = torch.tensor([data.draw(st.integers(0, int(r))) for r in room])
    total = protected.sum(-1) + extra

    split = AdaKVHeadAllocator(floor_alpha=alpha, n_sink=n_sink, n_recent=n_recent)
    keep = split.split(SplitRequest(total, obs, scores, n_valid))

    assert keep.shape == n_valid.shape
    assert torch.equal(keep.sum(-1), total)
    assert bool((keep >= protected).all()) and bool((keep <= n_valid).all())


@SETTINGS
@given(data=st.data())
def test_entropy_head_split_is_exact_floored_and_capped(data) -> None:
    obs, keys, scores, n_valid = draw_head_split_case(data)
    b, h = n_valid.shape
    floor_ratio = data.draw(st.floats(0.0, 1.0))
    prefer = data.draw(st.sampled_from(["focused", "diffuse"]))
    min_tokens = data.draw(st.integers(0, 4))
    total = torch.tensor([data.draw(st.integers(h * min_tokens, h * min_tokens + 60)) for _ in range(b)])
    utility = data.draw(st.sampled_from(["step", "compression"]))
    split = EntropyHeadSplit(floor_ratio=floor_ratio, ema=0.5, prefer=prefer, utility=utility)
    state = UtilityState(torch.full((b, h), -1.0), torch.full((b, h), -1.0))
    request = SplitRequest(total, obs, scores, n_valid, keys=keys, min_tokens=min_tokens)

    for _ in range(2):  # the second call blends in the first call's utility (EMA)
        keep = split.split(request, state)
        assert keep.shape == (b, h)
        assert torch.equal(keep.sum(-1), torch.minimum(total, n_valid.sum(-1)))
        assert bool((keep <= n_valid).all()) and bool((keep >= 0).all())
        floor = torch.clamp((floor_ratio * total.double() / h).floor().long(), min=min_tokens)
        assert bool((keep >= torch.minimum(floor[:, None], n_valid)).all())
        assert bool((state.utility >= 0).all())  # every row compressed: its utility is recorded
