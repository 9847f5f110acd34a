"""What a cache costs, all of it: K/V storage that grows only as tokens arrive (never more than
a DynamicCache of the same length plus one growth chunk, whatever the budget), and a record of
compressions that stays bounded however long the run."""

from __future__ import annotations

import pytest
import torch

import reasonkv
from conftest import HEAD_DIM, N_LAYERS, greedy_loop, left_pad, random_prompt, tiny_model
from method_helpers import profile_knobs, tiny_group
from reasonkv.core.cache import RECENT_EVENTS
from reasonkv.core.hf_compat import cache_arg
from reasonkv.core.layer import GROWTH_CHUNK

METHODS = sorted(reasonkv.available_methods())
KV_HEADS = 2
SLOT_BYTES = 2 * KV_HEADS * HEAD_DIM * 4  # K and V of one token, one layer, batch 1, fp32


def _cache(model, method: str, budget: int, **knobs):
    spec = reasonkv.get_method(method)
    if not spec.compresses:
        return reasonkv.make_cache(model, method, None, **tiny_group(model, method))
    return reasonkv.make_cache(model, method, budget, **knobs, **profile_knobs(model, method))


# ------------------------------------------------------------------ the event record
def test_an_every_step_run_keeps_a_footprint_that_does_not_grow_with_its_length() -> None:
    """H2O at budget 16 compresses both layers at every token: 4,000 events over 2,000 tokens.
    The cache's whole footprint (K/V, index, scorer state, window, events) is the same after
    500 tokens and after 2,000, and the counters still count every compression."""
    model = tiny_model("llama", "sdpa", KV_HEADS)
    cache = reasonkv.make_cache(model, "h2o", 16)
    prompt = 8
    footprint: dict[int, dict] = {}

    def sample(_cache, fed: int) -> None:
        if fed in (500, 2000):
            footprint[fed] = cache.memory()

    greedy_loop(model, random_prompt(prompt, seed=4), cache, 2000 - prompt, after_step=sample)
    early, late = footprint[500], footprint[2000]
    assert late["seen_tokens"] == 2000
    assert late["total_bytes"] == early["total_bytes"] == late["physical_bytes"] + late["event_bytes"]
    assert 0 < late["event_bytes"] < 512 * 1024  # the last RECENT_EVENTS events, not 4,000
    assert late["total_bytes"] < 1024 * 1024
    # Every token past the budget made each layer compress (the prefill did not reach it).
    assert cache.n_compressions == N_LAYERS * (2000 - 16)
    assert cache.row_compressions().tolist() == [N_LAYERS * (2000 - 16)]
    events = cache.events
    assert len(events) == RECENT_EVENTS and events[-1].seen == 2000  # the newest ones, in order


def test_keep_all_events_keeps_every_event_and_counts_their_memory() -> None:
    model = tiny_model("llama", "sdpa", KV_HEADS)
    cache = reasonkv.make_cache(model, "h2o", 16)
    cache.keep_all_events = True
    footprint = {}

    def sample(_cache, fed: int) -> None:
        if fed in (300, 600):
            footprint[fed] = cache.memory()["event_bytes"]

    greedy_loop(model, random_prompt(8, seed=4), cache, 600 - 8, after_step=sample)
    assert len(cache.events) == cache.n_compressions == N_LAYERS * (600 - 16)
    assert footprint[600] > 2 * footprint[300] * 0.9  # it grows with the run, and memory() shows it
    cache.keep_all_events = False  # back to the last ones: the memory is returned
    assert len(cache.events) == RECENT_EVENTS
    assert cache.memory()["event_bytes"] < footprint[300]
    cache.reset()
    assert cache.events == [] and cache.n_compressions == 0 and cache.memory()["event_bytes"] == 0


def test_row_counters_equal_the_full_record_per_batch_row() -> None:
    """Rows of a padded batch compress at different steps; the per-row counters (what replay
    reports) equal the count over every recorded event, row by row."""
    model = tiny_model("llama", "sdpa", KV_HEADS)
    ids, mask = left_pad([random_prompt(30, seed=1)[0], random_prompt(6, seed=2)[0]])
    cache = reasonkv.make_cache(model, "snapkv", 16, interval=8)
    cache.keep_all_events = True
    model.generate(input_ids=ids, attention_mask=mask, **cache_arg(cache), max_new_tokens=40, do_sample=False)
    events = cache.events
    from_events = [sum(int(e.rows[r]) for e in events) for r in range(2)]
    assert from_events[0] != from_events[1]  # the rows really compressed at different times
    assert cache.row_compressions().tolist() == from_events
    assert cache.n_compressions == len(events)


# ------------------------------------------------------------------ lazy K/V storage
def _check_against_dynamic(cache, batch: int = 1) -> None:
    """Each layer's K/V bytes at most a DynamicCache's at the same length plus one chunk."""
    for layer in cache.layers:
        dynamic = layer.seen * SLOT_BYTES * batch
        assert layer.storage.kv_bytes() <= dynamic + GROWTH_CHUNK * SLOT_BYTES * batch, (
            layer.layer_idx,
            layer.seen,
            layer.storage.capacity,
        )


@pytest.mark.parametrize("budget", [32, 200, 5000])
@pytest.mark.parametrize("method", METHODS)
def test_storage_never_exceeds_a_dynamic_cache_by_more_than_a_chunk(method: str, budget: int) -> None:
    """Checked after the prefill and every decode step, for budgets below and far above the run
    (5000: a preallocating cache would hold 5000+ slots per layer from the first token)."""
    model = tiny_model("llama", "sdpa", KV_HEADS)
    cache = _cache(model, method, budget)
    greedy_loop(
        model, random_prompt(40, seed=3), cache, 300, after_step=lambda c, _fed: _check_against_dynamic(c)
    )
    assert cache.kv_meter.current == cache.memory()["kv_bytes"]  # every growth went through the meter
    if budget == 5000:  # nothing was evicted: the run held all 340 tokens, in 2 chunks at most
        assert cache.memory()["kv_bytes"] <= N_LAYERS * (340 + GROWTH_CHUNK) * SLOT_BYTES


def test_a_huge_budget_on_a_short_prompt_grows_lazily() -> None:
    """Budget 100,000,000: a preallocating cache asked for ~77 GB here; a lazy one holds the
    tokens seen plus one chunk, and its peak meter agrees."""
    model = tiny_model("llama", "sdpa", KV_HEADS)
    for method in ("snapkv", "h2o", "beaconkv"):
        cache = reasonkv.make_cache(model, method, 100_000_000)
        tokens, _ = greedy_loop(model, random_prompt(5, seed=0), cache, 20)
        mem = cache.memory()
        assert tokens.shape == (1, 20) and mem["seen_tokens"] == 25
        assert mem["kv_bytes"] == N_LAYERS * (5 + GROWTH_CHUNK) * SLOT_BYTES
        assert mem["peak_kv_bytes"] == mem["kv_bytes"]


def test_growth_is_in_chunks_and_the_peak_meter_sees_old_and_new_storage() -> None:
    """The full cache over 600 tokens grows twice after the prefill (not per token), and the
    peak is the moment one layer holds its old and its grown storage."""
    model = tiny_model("llama", "sdpa", KV_HEADS)
    cache = reasonkv.make_cache(model, "full", None)
    capacities = []

    def sample(_cache, _fed: int) -> None:
        capacity = cache.layers[0].storage.capacity
        if not capacities or capacities[-1] != capacity:
            capacities.append(capacity)

    greedy_loop(model, random_prompt(10, seed=0), cache, 590, after_step=sample)
    assert capacities == [10 + GROWTH_CHUNK, 10 + 2 * GROWTH_CHUNK + 1, 10 + 3 * GROWTH_CHUNK + 2]
    last = capacities[-1] * SLOT_BYTES
    assert cache.memory()["peak_kv_bytes"] == N_LAYERS * last + capacities[-2] * SLOT_BYTES


@pytest.mark.parametrize("method", ["snapkv", "h2o", "rpc"])
def test_lazy_growth_decodes_exactly_like_before(method: str) -> None:
    """The same tokens and logits with a budget above the run as with the full cache."""
    model = tiny_model("llama", "sdpa", KV_HEADS)
    prompt = random_prompt(12, seed=8)
    ref_tokens, ref_logits = greedy_loop(model, prompt, reasonkv.make_cache(model, "full", None), 300)
    tokens, logits = greedy_loop(model, prompt, _cache(model, method, 100_000), 300)
    assert torch.equal(tokens, ref_tokens)
    torch.testing.assert_close(logits, ref_logits, atol=1e-5, rtol=0)
