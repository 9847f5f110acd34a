"""Peak K/V bytes, the number that decides how many sequences fit: counted from every
allocation and release, including the moment a layer holds its old and new storage."""

from __future__ import annotations

import torch

from conftest import HEAD_DIM, N_LAYERS, greedy_loop, random_prompt, tiny_model
from reasonkv import make_cache
from reasonkv.core.hf_compat import cache_arg


def test_snapkv_peaks_at_one_layer_compacting_while_the_others_are_full() -> None:
    """SnapKV at budget B, interval I: every layer holds B + I slots until it compresses; then
    it gathers its kept tokens into fresh storage of B + I slots (K + slack) while the old is
    still alive. The peak is (layers + 1) x (B + I) slots, not layers x B."""
    model = tiny_model("llama", "sdpa", 2)
    budget, interval = 16, 8
    cache = make_cache(model, "snapkv", budget, interval=interval)
    per_slot = 2 * 1 * 2 * HEAD_DIM * 4  # K and V, batch 1, 2 KV heads, fp32
    seen_peak = 0

    def sample(_cache, _fed: int) -> None:
        nonlocal seen_peak
        seen_peak = max(seen_peak, cache.memory()["kv_bytes"])

    greedy_loop(model, random_prompt(6, seed=1), cache, 40, after_step=sample)
    assert cache.events, "it must have compressed"
    mem = cache.memory()
    assert mem["peak_kv_bytes"] == (N_LAYERS + 1) * (budget + interval) * per_slot
    assert seen_peak == mem["kv_bytes"] == N_LAYERS * (budget + interval) * per_slot < mem["peak_kv_bytes"]
    assert cache.kv_meter.current == mem["kv_bytes"]  # every release was counted
    # fp32 storage at 16 bits costs exactly half, now and at the peak.
    assert (
        2 * mem["kv_bytes_16bit"] == mem["kv_bytes"]
        and 2 * mem["peak_kv_bytes_16bit"] == mem["peak_kv_bytes"]
    )


def test_the_meter_follows_growth_reorders_and_resets() -> None:
    model = tiny_model("llama", "sdpa", 2)
    cache = make_cache(model, "full", None)
    with torch.no_grad():
        model(input_ids=random_prompt(5, seed=2, batch=2), **cache_arg(cache))
    grown = cache.memory()["kv_bytes"]
    assert cache.kv_meter.current == grown and cache.kv_meter.peak == grown
    cache.reorder_cache(torch.tensor([1, 1, 0]))  # beam search: three rows now
    assert cache.kv_meter.current == grown * 3 // 2
    # Layer by layer: the last layer holds its old and its new rows while the first already
    # holds its new ones (g = one layer's bytes): 1.5g + g + 1.5g.
    assert cache.kv_meter.peak == 2 * grown
    cache.reset()
    assert cache.kv_meter.current == 0
