"""PyramidKV layer budgets and the AdaKV head split: exact sums, the paper's shapes, and the
methods built on them (pyramidkv, adakv-snapkv) end to end on tiny models."""

from __future__ import annotations

import math

import pytest
import torch

from conftest import HEAD_DIM, dynamic_cache, greedy_loop, left_pad, random_prompt, tiny_model
from method_helpers import kept_tokens
from reasonkv import make_cache
from reasonkv.core.hf_compat import cache_arg
from reasonkv.core.policy import EMPTY, Observation, SplitRequest, protected_mask
from reasonkv.core.policy.allocators import AdaKVHeadAllocator, PyramidAllocator
from reasonkv.core.policy.allocators.pyramid import pyramid_layer_budgets

# ----------------------------------------------------------------------------- pyramid


def pyramid_shares(n_layers: int, budget: int, beta: float, window: int) -> list[float]:
    """PyramidKV's real-valued schedule, term by term."""
    scored = budget - window
    if n_layers == 1 or scored <= 0:
        return [float(budget)] * n_layers
    lo = scored / beta
    hi = 2 * scored - lo
    return [window + hi - layer * (hi - lo) / (n_layers - 1) for layer in range(n_layers)]


@pytest.mark.parametrize("window", [0, 8, 32])
@pytest.mark.parametrize("beta", [1.0, 20.0, 7.5])
def test_pyramid_budgets_sum_exactly_decrease_and_follow_the_formula(beta: float, window: int) -> None:
    for n_layers in (1, 2, 3, 7, 28, 30, 48):
        for budget in (1, 5, 8, 9, 16, 33, 100, 128, 1000, 2048, 4097):
            got = pyramid_layer_budgets(n_layers, budget, beta, window).tolist()
            shares = pyramid_shares(n_layers, budget, beta, window)
            assert sum(got) == n_layers * budget
            assert all(a >= b for a, b in zip(got, got[1:], strict=False))  # layer 0 largest
            assert all(abs(g - s) < 1 for g, s in zip(got, shares, strict=True))
            assert min(got) >= min(window, budget)  # never below the kept window
            if n_layers > 1 and budget - window >= 2 * n_layers and beta > 1:
                assert got[0] > got[-1]


def test_pyramid_hand_computed_example() -> None:
    # C' = 80, min = 4, max = 156, step = 152/3: 164, 113.33, 62.67, 12 -> the missing unit
    # goes to the largest fractional part.
    assert pyramid_layer_budgets(4, 88, 20.0, 8).tolist() == [164, 113, 63, 12]
    table = PyramidAllocator(beta=20, window=8).allocate(4, 3, 88)
    assert table.shape == (4, 3) and bool((table == table[:, :1]).all())
    assert int(table.sum()) == 4 * 3 * 88


# ------------------------------------------------------------------------------- AdaKV
def random_case(seed: int, b: int = 2, h: int = 3, t: int = 20) -> tuple[Observation, torch.Tensor]:
    """Scores with left padding on row 1 and ragged EMPTY tails (heads hold different counts)."""
    g = torch.Generator().manual_seed(seed)
    index = torch.arange(t).expand(b, h, t).clone()
    index[1, :, :2] = EMPTY
    index[0, 2, 15:] = EMPTY
    index[1, 0, 12:] = EMPTY
    obs = Observation(torch.zeros(b, h, 1, 4), torch.full((b, 1), t - 1), index, 0.5)
    scores = torch.rand(b, h, t, generator=g) ** 3  # skewed, so heads differ in mass
    return obs, scores


def global_topk_reference(
    obs: Observation, scores: torch.Tensor, pool: list[int], n_sink: int, n_recent: int
) -> tuple[list[list[int]], list[int]]:
    """Loops: per row, sort every (score, head, slot) of non-protected real tokens, best
    first (ties: lower head, then older slot), and count the first `pool` per head."""
    protected = protected_mask(obs.token_index, n_sink, n_recent)
    b, h, t = scores.shape
    counts = []
    for r in range(b):
        items = [
            (-float(scores[r, kv, j]), kv, j)
            for kv in range(h)
            for j in range(t)
            if obs.token_index[r, kv, j] != EMPTY and not protected[r, kv, j]
        ]
        items.sort()
        row = [0] * h
        for _, kv, _ in items[: pool[r]]:
            row[kv] += 1
        counts.append(row)
    return counts, protected.sum(-1).tolist()


@pytest.mark.parametrize("seed", range(6))
def test_adakv_without_floor_keeps_the_global_topk_counts(seed: int) -> None:
    obs, scores = random_case(seed)
    split = AdaKVHeadAllocator(floor_alpha=0.0, n_sink=1, n_recent=3)
    total = torch.tensor([27, 21])
    keep = split.split(SplitRequest(total, obs, scores, obs.key_valid.sum(-1)))
    protected = protected_mask(obs.token_index, 1, 3).sum(-1)
    counts, prot = global_topk_reference(obs, scores, (total - protected.sum(-1)).tolist(), 1, 3)
    assert (keep - protected).tolist() == counts
    assert keep.sum(-1).tolist() == [27, 21]


@pytest.mark.parametrize("alpha", [0.0, 0.2, 0.5, 1.0])
def test_adakv_split_is_exact_floored_and_within_each_head(alpha: float) -> None:
    split = AdaKVHeadAllocator(floor_alpha=alpha, n_sink=2, n_recent=4)
    for seed in range(25):
        obs, scores = random_case(seed, h=4, t=24)
        n_valid = obs.key_valid.sum(-1)
        protected = protected_mask(obs.token_index, 2, 4).sum(-1)
        g = torch.Generator().manual_seed(100 + seed)
        total = protected.sum(-1) + torch.randint(0, 40, (2,), generator=g)
        total = torch.minimum(total, n_valid.sum(-1))
        keep = split.split(SplitRequest(total, obs, scores, n_valid))
        pool = (total - protected.sum(-1)).tolist()
        counts, _ = global_topk_reference(obs, scores, pool, 2, 4)
        assert torch.equal(keep.sum(-1), total)  # exact per row
        assert bool((keep >= protected).all()) and bool((keep <= n_valid).all())
        cap = n_valid - protected
        for r in range(2):
            floor = math.floor(alpha * pool[r] / 4)
            shares = [c * (1 - alpha) + alpha * pool[r] / 4 for c in counts[r]]
            for kv in range(4):
                extra = int(keep[r, kv] - protected[r, kv])
                assert extra >= min(int(cap[r, kv]), floor)
                if all(s <= int(c) for s, c in zip(shares, cap[r], strict=True)):  # no head capped
                    assert abs(extra - shares[kv]) < 1


def test_adakv_a_short_head_passes_its_share_to_the_others() -> None:
    """α = 1 asks for equal shares of the pool (10 each), but head 0 holds only 2 tokens
    beyond its protected ones: its excess 8 is split over the heads that have room."""
    obs, scores = random_case(0, b=2, h=3, t=20)
    obs.token_index[0, 0, 5:] = EMPTY  # head 0: 5 real tokens, 3 protected, 2 candidates
    obs.token_index[0, 2] = torch.arange(20)  # heads 1 and 2: 17 candidates each, room for 14
    split = AdaKVHeadAllocator(floor_alpha=1.0, n_sink=1, n_recent=2)
    protected = protected_mask(obs.token_index, 1, 2).sum(-1)
    keep = split.split(SplitRequest(protected.sum(-1) + 30, obs, scores, obs.key_valid.sum(-1)))
    assert (keep - protected)[0].tolist() == [2, 14, 14]


def test_adakv_rejects_what_it_cannot_honour() -> None:
    with pytest.raises(ValueError, match="floor_alpha"):
        AdaKVHeadAllocator(floor_alpha=1.5)
    with pytest.raises(ValueError, match="protect_prompt"):
        make_cache(tiny_model("llama", "sdpa", 2), "adakv-snapkv", 32, protect_prompt=True)


# -------------------------------------------------------------------------- end to end
METHODS = ("pyramidkv", "adakv-snapkv")


def test_knobs_reach_the_allocators() -> None:
    model = tiny_model("llama", "sdpa", 2)
    cache = make_cache(model, "adakv-snapkv", 32, floor_alpha=0.5, n_recent=6, interval=8)
    head = cache.policy.head_allocator
    assert isinstance(head, AdaKVHeadAllocator)
    assert (head.floor_alpha, head.n_sink, head.n_recent) == (0.5, 0, 6)  # protection shared with the cache
    cache = make_cache(model, "pyramidkv", 40, beta=4, window=8)
    assert cache.budgets[:, 0].tolist() == pyramid_layer_budgets(2, 40, 4, 8).tolist() == [64, 16]
    assert make_cache(model, "pyramidkv", 40).policy.head_allocator is None
    with pytest.raises(ValueError, match="floor_alpha"):
        make_cache(model, "pyramidkv", 40, floor_alpha=0.3)


@pytest.mark.parametrize("method", METHODS)
def test_without_eviction_equals_dynamic_cache(method: str) -> None:
    model = tiny_model("qwen3", "sdpa", 2)
    prompt = random_prompt(20, seed=3)
    cache = make_cache(model, method, 1024)
    tokens, logits = greedy_loop(model, prompt, cache, 30)
    ref_tokens, ref_logits = greedy_loop(model, prompt, dynamic_cache(), 30)
    torch.testing.assert_close(logits, ref_logits, atol=1e-5, rtol=0)
    assert torch.equal(tokens, ref_tokens) and cache.events == []


@pytest.mark.parametrize("method", METHODS)
def test_memory_stays_bounded_over_300_steps(method: str) -> None:
    model = tiny_model("llama", "sdpa", 2)
    budget, interval = 16, 8
    cache = make_cache(model, method, budget, interval=interval)
    layer_totals = cache.budgets.sum(-1)  # [L]
    ids = random_prompt(10, seed=4)
    physical = []
    with torch.no_grad():
        for _ in range(300):
            ids = model(input_ids=ids, **cache_arg(cache)).logits[:, -1:].argmax(-1)
            for i, layer in enumerate(cache.layers):
                heads = layer.n_valid.shape[1]
                assert int(layer.n_valid.sum(-1).max()) <= int(layer_totals[i]) + heads * (interval - 1)
                # storage: up to the trigger before the first compression, then longest head + buffer
                longest = max(int(layer.budgets.max()), int(layer.lengths.max()))
                assert layer.keys.shape[2] <= longest + interval
            mem = cache.memory()
            # K and V of a head never exceed its layer's total plus one buffer (AdaKV may give a
            # head most of its layer); what is not per-slot storage (queries...) does not grow.
            assert mem["kv_bytes"] <= sum(2 * 2 * (int(t) + interval) * HEAD_DIM * 4 for t in layer_totals)
            index_bytes = sum(layer.token_index.numel() * 8 for layer in cache.layers)
            physical.append(mem["physical_bytes"] - mem["kv_bytes"] - index_bytes)
    assert max(physical[150:]) <= max(physical[:150])
    assert len(cache.events) >= 2 * (300 // interval) - 2


def test_pyramid_layers_really_hold_different_budgets() -> None:
    model = tiny_model("llama", "sdpa", 2)
    cache = make_cache(model, "pyramidkv", 24, interval=4)
    assert cache.budgets[:, 0].tolist() == [39, 9]
    greedy_loop(model, random_prompt(12, seed=5), cache, 60)
    last = {e.layer: e.lengths for e in cache.events}
    assert last[0].tolist() == [[39, 39]] and last[1].tolist() == [[9, 9]]


def test_adakv_heads_hold_real_different_lengths() -> None:
    """After every compression the row's heads hold different numbers of tokens that sum to the
    layer budget, each at least its floor; storage is sized by the longest head plus the
    buffer (not the layer total), and every stored slot below a head's length is a real token."""
    model = tiny_model("llama", "sdpa", 2)
    budget, interval, alpha, n_recent = 24, 8, 0.2, 8
    cache = make_cache(model, "adakv-snapkv", budget, interval=interval, floor_alpha=alpha)
    pool = 2 * budget - 2 * n_recent
    floor = n_recent + math.floor(alpha * pool / 2)
    checked = []

    def after_step(c, fed):
        if not c.events or c.events[-1].seen != fed:
            return
        for event in c.events:
            if event.seen != fed:
                continue
            layer = c.layers[event.layer]
            lengths = layer.lengths[0]
            assert int(lengths.sum()) == 2 * budget
            assert int(lengths.min()) >= floor
            assert layer.keys.shape[2] == int(lengths.max()) + interval  # physical, not a mask
            for h in range(2):
                real = layer.token_index[0, h] != EMPTY
                assert bool(real[: lengths[h]].all()) and not bool(real[lengths[h] :].any())
            assert c.memory()["live_tokens"][event.layer].tolist() == lengths.tolist()
            checked.append(lengths.tolist())

    greedy_loop(model, random_prompt(10, seed=6), cache, 150, after_step)
    assert len(checked) >= 2 * (150 // interval) - 2
    assert any(a != b for a, b in checked)  # heads really differ
    kv = cache.memory()["kv_bytes"]
    assert kv == sum(2 * 2 * layer.keys.shape[2] * HEAD_DIM * 4 for layer in cache.layers)


@pytest.mark.parametrize("method", METHODS)
def test_padded_batch_equals_rows_alone(method: str) -> None:
    model = tiny_model("llama", "sdpa", 2)
    prompts = [random_prompt(n, seed=30 + n)[0] for n in (30, 12, 21)]
    ids, mask = left_pad(prompts)
    kw = dict(max_new_tokens=40, do_sample=False)
    knobs = dict(interval=4)
    cache = make_cache(model, method, 16, **knobs)
    batch = model.generate(ids, attention_mask=mask, **cache_arg(cache), **kw)[:, ids.shape[1] :]
    assert len(cache.events) > 10
    for r, p in enumerate(prompts):
        pad = ids.shape[1] - p.numel()
        alone_cache = make_cache(model, method, 16, **knobs)
        alone = model.generate(p[None], **cache_arg(alone_cache), **kw)[:, p.numel() :]
        assert torch.equal(alone[0], batch[r])
        for lb, la in zip(cache.layers, alone_cache.layers, strict=True):
            assert kept_tokens(lb, r, pad) == kept_tokens(la, 0)
