"""With a small budget the cache really evicts: bounded live tokens, smaller storage,
protected tokens kept, logical positions, memory released, sampling works."""

from __future__ import annotations

import copy
import gc
import weakref

import pytest
import torch

import reasonkv
from conftest import HEAD_DIM, N_LAYERS, greedy_loop, random_prompt, tiny_model
from reasonkv.core.hf_compat import cache_arg
from reasonkv.core.policy.base import EMPTY

PROMPT, NEW = 10, 48
BUDGET = 16
# Small intervals so that compressions happen many times in a short run.
METHODS = {
    "streaming": dict(budget=BUDGET),
    "tova": dict(budget=BUDGET),
    "snapkv": dict(budget=BUDGET, interval=4),
}
# Expected live-token bound per head: every-step methods hold `budget` after each step,
# the buffer schedule lets a head grow to budget + interval - 1 before compressing.
EXPECTED_BOUND = {"streaming": BUDGET, "tova": BUDGET, "snapkv": BUDGET + 4 - 1}
MODELS = [("llama", "sdpa", 2), ("qwen3", "eager", 4), ("mistral", "sdpa", 1)]


def live_positions(layer, row: int, head: int) -> list[int]:
    """Sequence indices of the real tokens a head holds, in slot order."""
    n = int(layer.lengths[row, head])
    index = layer.token_index[row, head, :n]
    return index[index != EMPTY].tolist()


def storage_bytes(batch: int, kv_heads: int, capacity: int) -> int:
    """What K and V storage of `capacity` slots per head must cost in fp32, all layers."""
    return N_LAYERS * 2 * batch * kv_heads * capacity * HEAD_DIM * 4


@pytest.mark.parametrize("arch,attn,kv_heads", MODELS)
@pytest.mark.parametrize("method", METHODS)
def test_live_tokens_never_exceed_the_schedule_bound(
    method: str, arch: str, attn: str, kv_heads: int
) -> None:
    model = tiny_model(arch, attn, kv_heads)
    cache = reasonkv.make_cache(model, method, **METHODS[method])
    bound = cache.live_token_bound()
    assert bound == EXPECTED_BOUND[method]
    # Storage is preallocated up to the compression trigger, plus the slots every-step
    # schedules may leave as holes between compactions.
    capacity = bound + 1 + cache.policy.schedule.hole_slots(BUDGET)

    def check(c, fed: int) -> None:
        assert c.get_seq_length() == fed
        mem = c.memory()
        assert int(mem["live_tokens"].max()) <= bound
        assert mem["seen_tokens"] == fed
        for layer in c.layers:
            assert int(layer.n_valid.max()) <= bound
            assert layer.keys.shape[2] == capacity
            assert layer.used <= capacity
            real = (layer.token_index[:, :, : layer.used] != EMPTY).sum(-1)
            assert torch.equal(real, layer.n_valid), "n_valid must count the real stored tokens"
        assert mem["kv_bytes"] == storage_bytes(1, kv_heads, capacity)

    greedy_loop(model, random_prompt(PROMPT, seed=7), cache, NEW, after_step=check)
    assert len(cache.events) >= N_LAYERS * 3, "the run must have compressed repeatedly"

    full = reasonkv.make_cache(model, "full")
    greedy_loop(model, random_prompt(PROMPT, seed=7), full, NEW)
    full_mem, mem = full.memory(), cache.memory()
    assert full_mem["kv_bytes"] >= storage_bytes(1, kv_heads, PROMPT + NEW)
    assert mem["kv_bytes"] < full_mem["kv_bytes"]
    assert mem["physical_bytes"] < full_mem["physical_bytes"]
    assert torch.all(full_mem["live_tokens"] == PROMPT + NEW)


def test_streaming_keeps_exactly_the_sinks_and_the_newest_tokens() -> None:
    model = tiny_model("llama", "sdpa", 2)
    n_sink = 4
    cache = reasonkv.make_cache(model, "streaming", BUDGET, n_sink=n_sink)

    def check(c, fed: int) -> None:
        expected = (
            list(range(min(fed, BUDGET)))
            if fed <= BUDGET
            else (list(range(n_sink)) + list(range(fed - (BUDGET - n_sink), fed)))
        )
        for layer in c.layers:
            for head in range(2):
                assert live_positions(layer, 0, head) == expected

    greedy_loop(model, random_prompt(PROMPT, seed=8), cache, NEW, after_step=check)


def test_buffered_every_step_eviction_drops_evict_every_tokens_at_budget_plus_that() -> None:
    """`evict_every=n`: a head grows to budget + n, then keeps exactly the sinks and the newest
    budget - sinks tokens (StreamingLLM's choice), so its live tokens cycle budget .. budget + n
    and the layer compresses once per n steps, not at every step."""
    model = tiny_model("llama", "sdpa", 2)
    n, n_sink = 4, 4
    cache = reasonkv.make_cache(model, "streaming", BUDGET, n_sink=n_sink, evict_every=n)
    assert cache.live_token_bound() == BUDGET + n - 1

    def check(c, fed: int) -> None:
        held = fed if fed < BUDGET + n else BUDGET + (fed - BUDGET) % n
        expected = (
            list(range(n_sink)) + list(range(fed - (held - n_sink), fed)) if held < fed else list(range(fed))
        )
        for layer in c.layers:
            for head in range(2):
                assert live_positions(layer, 0, head) == expected, fed

    greedy_loop(model, random_prompt(PROMPT, seed=8), cache, NEW, after_step=check)
    assert int(cache.layers[0].n_compressions) == (PROMPT + NEW - BUDGET) // n


@pytest.mark.parametrize("method", ("tova", "snapkv"))
def test_sinks_and_recent_window_survive_every_eviction(method: str) -> None:
    model = tiny_model("qwen2", "sdpa", 2)
    n_sink, n_recent = 3, 5
    cache = reasonkv.make_cache(model, method, n_sink=n_sink, n_recent=n_recent, **METHODS[method])

    def check(c, fed: int) -> None:
        for layer in c.layers:
            for head in range(2):
                kept = live_positions(layer, 0, head)
                assert kept == sorted(kept), "kept tokens stay in positional order"
                assert kept[:n_sink] == list(range(n_sink))
                assert kept[-n_recent:] == list(range(fed - n_recent, fed))

    greedy_loop(model, random_prompt(PROMPT, seed=9), cache, NEW, after_step=check)
    assert cache.events


def test_scored_methods_evict_different_tokens_per_head() -> None:
    """Per-head selection is real: TOVA's heads end up keeping different middle tokens."""
    model = tiny_model("llama", "sdpa", 4)
    cache = reasonkv.make_cache(model, "tova", BUDGET)
    greedy_loop(model, random_prompt(PROMPT, seed=10), cache, NEW)
    kept = {tuple(live_positions(layer, 0, h)) for layer in cache.layers for h in range(4)}
    assert len(kept) > 1


@pytest.mark.parametrize("method", METHODS)
def test_positions_stay_logical_after_eviction(method: str) -> None:
    """Without position_ids the model takes the position from get_seq_length(): it must be
    the number of tokens fed (RoPE at the logical position), not the physical length."""
    model = tiny_model("llama", "sdpa", 2)
    cache = reasonkv.make_cache(model, method, **METHODS[method])
    prompt = random_prompt(PROMPT, seed=11)
    checked = 0
    with torch.no_grad():
        out = model(input_ids=prompt, **cache_arg(cache))
        fed = PROMPT
        for step in range(NEW):
            token = out.logits[:, -1].argmax(-1, keepdim=True)
            physical = int(cache.layers[0].n_valid.max())  # tokens actually held
            check_now = fed > BUDGET + 4 and step % 5 == 0
            if check_now:
                assert physical < fed, "the check needs a cache that has evicted"
                explicit = model(
                    input_ids=token,
                    **cache_arg(copy.deepcopy(cache)),
                    position_ids=torch.tensor([[fed]], device=token.device),
                ).logits
                wrong = model(
                    input_ids=token,
                    **cache_arg(copy.deepcopy(cache)),
                    position_ids=torch.tensor([[physical]], device=token.device),
                ).logits
            out = model(input_ids=token, **cache_arg(cache))
            fed += 1
            assert cache.get_seq_length() == fed
            if check_now:
                torch.testing.assert_close(out.logits, explicit, atol=1e-5, rtol=0)
                assert not torch.allclose(out.logits, wrong, atol=1e-3), "the test must tell positions apart"
                checked += 1
    assert checked >= 5


@pytest.mark.parametrize("attn", ("sdpa", "eager"))
@pytest.mark.parametrize("method", METHODS)
def test_generate_with_eviction_equals_manual_greedy_loop(method: str, attn: str) -> None:
    model = tiny_model("qwen3", attn, 2)
    prompt = random_prompt(PROMPT, seed=12)
    loop_cache = reasonkv.make_cache(model, method, **METHODS[method])
    gen_cache = reasonkv.make_cache(model, method, **METHODS[method])

    tokens, _ = greedy_loop(model, prompt, loop_cache, NEW)
    # generate feeds back all but its last token: NEW + 1 new tokens feed the same NEW.
    out = model.generate(prompt, **cache_arg(gen_cache), max_new_tokens=NEW + 1, do_sample=False)

    assert torch.equal(out[:, PROMPT : PROMPT + NEW], tokens)
    assert gen_cache.get_seq_length() == loop_cache.get_seq_length() == PROMPT + NEW
    for a, b in zip(gen_cache.layers, loop_cache.layers, strict=True):
        assert torch.equal(a.lengths, b.lengths)
        assert torch.equal(a.token_index[:, :, : a.used], b.token_index[:, :, : b.used])


def test_eviction_changes_the_output() -> None:
    """Sanity of the fixtures: a small budget does change greedy tokens on these models,
    so equalities elsewhere are not vacuous."""
    model = tiny_model("llama", "sdpa", 2)
    prompt = random_prompt(PROMPT, seed=13)
    full, _ = greedy_loop(model, prompt, reasonkv.make_cache(model, "full"), NEW)
    small, _ = greedy_loop(model, prompt, reasonkv.make_cache(model, "streaming", 6, n_sink=2), NEW)
    assert not torch.equal(full, small)


@pytest.mark.parametrize("method", ("snapkv", "tova"))
def test_compression_releases_the_old_storage(method: str) -> None:
    """Compaction gathers the kept tokens into fresh storage and the old storage is freed at
    once; between compactions decoding writes in place (TOVA evicts every step into holes and
    compacts every `compact_every` = 4 steps)."""
    model = tiny_model("llama", "sdpa", 2)
    knobs = dict(METHODS[method], **({"compact_every": 4} if method == "tova" else {}))
    cache = reasonkv.make_cache(model, method, **knobs)
    capacity = cache.live_token_bound() + 1 + cache.policy.schedule.hole_slots(BUDGET)
    prompt = random_prompt(PROMPT, seed=14)
    compactions = writes_in_place = 0
    gc.disable()  # the release must come from reference counting, not from a later collection
    try:
        with torch.no_grad():
            out = model(input_ids=prompt, **cache_arg(cache))
            for _ in range(NEW):
                layer = cache.layers[0]
                old_keys, old_ptr = weakref.ref(layer.keys), layer.keys.data_ptr()
                out = model(input_ids=out.logits[:, -1].argmax(-1, keepdim=True), **cache_arg(cache))
                if old_keys() is not layer.keys:
                    compactions += 1
                    assert old_keys() is None, "the pre-compaction storage must be unreferenced"
                    assert layer.keys.shape[2] == capacity  # the kept budget + the schedule's slack
                    assert layer.keys.untyped_storage().nbytes() == 2 * capacity * HEAD_DIM * 4
                    assert layer.values.untyped_storage().nbytes() == layer.keys.untyped_storage().nbytes()
                else:
                    # Between compactions decoding writes into the preallocated storage.
                    assert layer.keys.data_ptr() == old_ptr
                    writes_in_place += 1
    finally:
        gc.enable()
    assert compactions >= 3
    assert writes_in_place >= 3
    assert len([e for e in cache.events if e.layer == 0]) >= compactions


@pytest.mark.parametrize("method", METHODS)
def test_sampling_with_eviction_produces_the_requested_tokens(method: str) -> None:
    model = tiny_model("mistral", "sdpa", 2)
    prompt = random_prompt(PROMPT, seed=15, batch=2)
    kwargs = dict(max_new_tokens=NEW, min_new_tokens=NEW, do_sample=True, top_p=0.9, temperature=0.8)
    runs = []
    for _ in range(2):
        cache = reasonkv.make_cache(model, method, **METHODS[method])
        torch.manual_seed(0)
        out = model.generate(prompt, **cache_arg(cache), **kwargs)
        assert out.shape == (2, PROMPT + NEW)
        assert cache.events, "sampling must run through evictions"
        assert int(cache.memory()["live_tokens"].max()) <= cache.live_token_bound()
        runs.append(out)
    assert torch.equal(runs[0], runs[1]), "the cache adds no randomness of its own"


@pytest.mark.parametrize("method", ("streaming", "h2o", "tova"))
def test_every_step_eviction_leaves_holes_and_compacts_every_k_steps(method: str) -> None:
    """Every-step methods evict every step but compact every `compact_every` steps: in between,
    evicted slots are holes (EMPTY, never attended). The same tokens survive, the same tokens
    are generated and the logits match compacting at every step; storage is replaced once per
    `compact_every` steps and never holds more than budget + compact_every slots."""
    budget = 32  # compact every min(compact_every, budget // 8) = 4 steps
    model = tiny_model("qwen3", "sdpa", 2)
    prompt = random_prompt(PROMPT, seed=12)

    def kept(c) -> list[list[list[int]]]:
        return [
            [[i for i in layer.token_index[0, h, : layer.used].tolist() if i != EMPTY] for h in range(2)]
            for layer in c.layers
        ]

    survivors: list = []
    every = reasonkv.make_cache(model, method, budget, compact_every=1)
    tokens_every, logits_every = greedy_loop(
        model, prompt, every, NEW, after_step=lambda c, fed: survivors.append(kept(c))
    )
    storage_ids: list[int] = []
    holes_seen = []

    def check(c, fed: int) -> None:
        layer = c.layers[0]
        storage_ids.append(id(layer.keys))
        assert layer.keys.shape[2] <= budget + 4
        holes_seen.append(bool((layer.token_index[0, :, : layer.used] == EMPTY).any()))
        assert kept(c) == survivors[len(storage_ids) - 1]

    lazy = reasonkv.make_cache(model, method, budget, compact_every=4)
    tokens_lazy, logits_lazy = greedy_loop(model, prompt, lazy, NEW, after_step=check)
    assert torch.equal(tokens_every, tokens_lazy)
    torch.testing.assert_close(logits_lazy, logits_every, atol=1e-5, rtol=1e-4)
    assert any(holes_seen)
    # The cache first compresses after decode step 23 (10 + 23 = budget + 1); from then on
    # the storage is replaced every 4th step only.
    tail = storage_ids[23:]
    changes = sum(a != b for a, b in zip(tail, tail[1:], strict=False))
    assert (len(tail) - 1) // 4 <= changes <= (len(tail) - 1) // 4 + 1


def test_the_live_token_bound_counts_a_protected_prompt() -> None:
    """protect_prompt may keep prompt tokens beyond the budget: the bound allows the prompt."""
    model = tiny_model("llama", "sdpa", 2)
    cache = reasonkv.make_cache(model, "streaming", 16, protect_prompt=True)
    assert cache.live_token_bound() == 16  # before the prompt: the budget (trigger 17, minus 1)
    model.generate(
        input_ids=random_prompt(24, seed=3), **cache_arg(cache), max_new_tokens=20, do_sample=False
    )
    live = int(cache.memory()["live_tokens"].max())
    assert cache.live_token_bound() == 16 + 24 and live <= cache.live_token_bound()
