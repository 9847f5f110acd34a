"""ReasonAlloc's budget arithmetic: exact totals, bounds, the uniform special case, entropy."""

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import reasonkv
from conftest import greedy_loop, random_prompt, tiny_model
from method_helpers import profile_knobs
from reasonkv.core.policy.allocators.reasonalloc import (
    largest_remainder,
    layer_budgets,
    normalised_entropy,
    split_by_utility,
    water_fill,
)
from reasonkv.core.policy.base import EMPTY, Observation


@settings(max_examples=200, deadline=None)
@given(
    demand=st.lists(st.floats(0.01, 10.0), min_size=1, max_size=40),
    budget=st.integers(16, 4096),
    heads=st.integers(1, 8),
    tau=st.sampled_from([0.25, 0.5, 1.0, 2.0, 8.0]),
)
def test_layer_budget_totals_are_exact(demand, budget, heads, tau):
    out = layer_budgets(torch.tensor(demand), heads, budget, tau=tau, lo=8)
    assert out.shape == (len(demand), heads)
    assert int(out.sum()) == len(demand) * heads * budget
    assert int(out.min()) >= 8
    assert bool((out == out[:, :1]).all())  # heads of a layer share the layer budget


@settings(max_examples=50, deadline=None)
@given(n=st.integers(1, 40), budget=st.integers(1, 3000), heads=st.integers(1, 8), level=st.floats(0.1, 5))
def test_flat_profile_and_infinite_tau_give_uniform(n, budget, heads, level):
    uniform = torch.full((n, heads), budget)
    assert torch.equal(layer_budgets(torch.full((n,), level), heads, budget), uniform)
    wavy = torch.rand(n) + 0.1
    assert torch.equal(layer_budgets(wavy, heads, budget, tau=math.inf), uniform)


def test_higher_demand_gets_more_and_bounds_hold():
    demand = torch.tensor([4.0, 1.0, 1.0, 2.0])
    out = layer_budgets(demand, 1, 100, tau=1.0, lo=20, hi=150)[:, 0]
    # 4:1:1:2 of 400 = 200/50/50/100; 200 is capped at 150 and the other 250 go 1:1:2 = 62.5/62.5/125,
    # the half unit going to the lower index.
    assert out.tolist() == [150, 63, 62, 125]
    assert int(out.sum()) == 400


def test_water_fill_refuses_impossible_bounds():
    try:
        water_fill(torch.ones(3), 10, lo=4)
    except ValueError as err:
        assert "cannot split" in str(err)
    else:
        raise AssertionError("expected ValueError")


@settings(max_examples=200, deadline=None)
@given(shares=st.lists(st.floats(0, 100), min_size=1, max_size=20))
def test_largest_remainder_sums_exactly_and_moves_each_by_less_than_one(shares):
    s = torch.tensor(shares, dtype=torch.float64)
    total = int(round(float(s.sum())))
    s = s * (total / float(s.sum())) if float(s.sum()) > 0 else s
    total = total if float(s.sum()) > 0 else 0
    out = largest_remainder(s, total)
    assert int(out.sum()) == total
    assert bool(((out - s).abs() < 1 + 1e-9).all())


@settings(max_examples=200, deadline=None)
@given(
    heads=st.integers(1, 8),
    rows=st.integers(1, 3),
    floor=st.integers(0, 20),
    per_head=st.integers(20, 200),
    seed=st.integers(0, 10_000),
)
def test_head_split_is_exact_and_respects_floor(heads, rows, floor, per_head, seed):
    g = torch.Generator().manual_seed(seed)
    utility = torch.rand(rows, heads, generator=g)
    cap = torch.randint(floor + 1, 3 * per_head, (rows, heads), generator=g)
    total = torch.full((rows,), heads * per_head)
    out = split_by_utility(total, utility, torch.tensor(floor), cap)
    assert torch.equal(out.sum(-1), torch.minimum(total, cap.sum(-1)))
    assert bool((out >= torch.minimum(torch.tensor(floor), cap)).all())
    assert bool((out <= cap).all())


def test_focused_heads_get_more():
    out = split_by_utility(
        torch.tensor([300]), torch.tensor([[0.9, 0.1, 0.5]]), torch.tensor(20), torch.full((1, 3), 1000)
    )
    assert int(out.sum()) == 300
    assert out[0, 0] > out[0, 2] > out[0, 1] >= 20


def _obs_from_probs_target(keys_per_head: int) -> tuple[Observation, torch.Tensor]:
    # One query head per KV head, D = 1: logits = q * k, so a query of 0 gives a uniform row.
    keys = torch.ones(1, 2, keys_per_head, 1)
    queries = torch.tensor([0.0, 50.0]).reshape(1, 2, 1, 1)  # head 0 uniform, head 1 peaked
    keys[0, 1, -1, 0] = 2.0  # head 1's last key dominates
    index = torch.arange(keys_per_head).expand(1, 2, -1).clone()
    obs = Observation(
        queries=queries, query_index=torch.tensor([[keys_per_head - 1]]), token_index=index, scaling=1.0
    )
    return obs, keys


def test_normalised_entropy_matches_closed_form():
    obs, keys = _obs_from_probs_target(8)
    ent = normalised_entropy(obs, keys)
    assert torch.allclose(ent[0, 0], torch.tensor(1.0), atol=1e-6)  # uniform over 8 -> log 8 / log 8
    # head 1: logits 50 (x7) and 100 (x1): p = softmax, H / log 8 by hand
    logits = torch.tensor([50.0] * 7 + [100.0])
    p = torch.softmax(logits, 0)
    expected = -(p * p.clamp(min=1e-30).log()).sum() / math.log(8)
    assert torch.allclose(ent[0, 1], expected, atol=1e-6)


def test_normalised_entropy_ignores_padding_slots():
    obs, keys = _obs_from_probs_target(8)
    padded_keys = torch.cat([torch.zeros(1, 2, 3, 1), keys], dim=2)
    padded_index = torch.cat([torch.full((1, 2, 3), EMPTY), obs.token_index], dim=2)
    padded = Observation(
        queries=obs.queries, query_index=obs.query_index, token_index=padded_index, scaling=1.0
    )
    assert torch.allclose(normalised_entropy(padded, padded_keys), normalised_entropy(obs, keys), atol=1e-6)


def test_a_budget_above_the_run_still_compresses_the_layers_given_less() -> None:
    """`budget` is the mean over layers: with the layers 2:1 apart, a run longer than the
    smaller share compresses that layer and leaves the other whole (docs/reasonalloc.md)."""
    model = tiny_model("llama", "sdpa", 2)
    cache = reasonkv.make_cache(
        model, "reasonalloc-rkv", 96, interval=8, **profile_knobs(model, "reasonalloc-rkv")
    )
    shares = cache.budgets.sum(-1).tolist()
    assert shares[0] < 2 * 90 < shares[1]  # layer 0 gets less than the 90 tokens run, layer 1 more
    greedy_loop(model, random_prompt(10, seed=2), cache, 80)
    assert cache.layers[0].n_compressions > 0 and cache.layers[1].n_compressions == 0
    assert cache.memory()["live_tokens"][1].tolist() == [90, 90]
