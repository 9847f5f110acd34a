"""A dropped cache frees its K/V storage at once (no reference cycle waits for the garbage
collector: replay and sweeps build one cache after another, and on a GPU the old storage would
pile up), and a reset cache reports the new run's peak."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from conftest import random_prompt, tiny_model
from reasonkv import make_cache
from reasonkv.core.hf_compat import cache_arg


@pytest.mark.parametrize("method", ["snapkv", "h2o", "reasonalloc-head-rkv", "rpc", "beaconkv"])
def test_a_dropped_cache_frees_its_storage_without_the_garbage_collector(method: str) -> None:
    model = tiny_model("llama", "sdpa", 2)
    knobs = {"interval": 8} if method in ("snapkv", "reasonalloc-head-rkv") else {}
    cache = make_cache(model, method, {"rpc": 4, "beaconkv": 24}.get(method, 16), **knobs)
    gc.disable()
    try:
        with torch.no_grad():
            model(input_ids=random_prompt(40, seed=1), **cache_arg(cache))
        keys = weakref.ref(cache.layers[0].keys)
        del cache
        assert keys() is None, "something still refers to the cache: its storage waits for gc"
    finally:
        gc.enable()


def test_a_reset_cache_reports_its_new_runs_peak() -> None:
    model = tiny_model("llama", "sdpa", 2)
    cache = make_cache(model, "full", None)
    with torch.no_grad():
        model(input_ids=random_prompt(30, seed=2), **cache_arg(cache))
        first = cache.memory()["peak_kv_bytes"]
        cache.reset()
        assert cache.kv_meter.current == 0 and cache.kv_meter.peak == 0
        model(input_ids=random_prompt(5, seed=3), **cache_arg(cache))
    assert 0 < cache.memory()["peak_kv_bytes"] < first
