"""Everything a sequence holds: `memory()['state_bytes']` (and its peak) counts K/V and every
tensor beside it (slot indices, query windows, beacon buffers, per-token scores, policy states,
counters). The meter is held equal to an independent walk of every tensor the cache refers to,
for every method and storage setting, at every step of a run with compressions."""

from __future__ import annotations

import weakref
from collections import deque

import pytest
import torch

import reasonkv
from conftest import greedy_loop, left_pad, random_prompt, tiny_model
from method_helpers import profile_knobs, tiny_group
from reasonkv.core.cache import EventLog, LayerPolicy
from reasonkv.core.hf_compat import cache_arg
from reasonkv.core.memory_meter import held_bytes
from reasonkv.core.policy.contract import Allocator, HeadAllocator, Scorer
from reasonkv.core.policy.schedules import Schedule
from reasonkv.core.timing import StepTimer
from reasonkv.methods.knobs import KnobError

METHODS = sorted(reasonkv.available_methods())
STORAGE = {
    "16-bit": {},
    "4-bit": {"kv_bits": 4, "group_size": 4, "residual": 4},
    "4-bit, sink, pre-RoPE, Hadamard": {
        "kv_bits": 4,
        "group_size": 4,
        "residual": 0,
        "fp_sinks": 1,
        "pre_rope": True,
        "hadamard": True,
    },
    "two-tier": {"low_budget": 16, "low_bits": 4, "group_size": 16},  # the low tier's: the head dim
}
SHARED = (LayerPolicy, Scorer, Schedule, Allocator, HeadAllocator, EventLog, StepTimer, torch.nn.Module)
"""What a cache shares with other caches or reports apart: the method's parts (the model's RoPE
frequencies among them), the event record (memory()['event_bytes']), the timer, the model."""


def walk_tensors(cache) -> list[torch.Tensor]:
    """Every tensor reachable from `cache` through reasonkv's objects and plain containers,
    except what SHARED names and any tensor on the storage of one of the method's (the model's
    RoPE frequencies, which quantized storage also refers to); weak references are not followed."""
    policy = {t.untyped_storage().data_ptr() for t in _reachable([vars(cache.policy)], ())}
    return [t for t in _reachable([cache], SHARED) if t.untyped_storage().data_ptr() not in policy]


def _reachable(start: list[object], skip: tuple[type, ...]) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []
    seen: set[int] = set()
    stack: list[object] = list(start)
    while stack:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, skip) or isinstance(obj, weakref.ProxyTypes):
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            found.append(obj)
        elif isinstance(obj, (list, tuple, set, deque)):
            stack.extend(obj)
        elif isinstance(obj, dict):
            stack.extend(obj.values())
        elif type(obj).__module__.startswith("reasonkv") and hasattr(obj, "__dict__"):
            stack.extend(v for v in vars(obj).values() if not callable(v) or isinstance(v, torch.Tensor))
    return found


def _cache(model, method: str, budget: int, **knobs):
    spec = reasonkv.get_method(method)
    if not spec.compresses:
        return reasonkv.make_cache(model, method, None, **{**tiny_group(model, method), **knobs})
    if "interval" in spec.knobs():  # compress within the test's 40 steps
        knobs = {"interval": 8, **knobs}
    return reasonkv.make_cache(model, method, budget, **knobs, **profile_knobs(model, method))


@pytest.mark.usefixtures("toy_storage")  # 4 bits at budget 24: more than 16 bits on the tiny model
@pytest.mark.parametrize("storage", list(STORAGE))
@pytest.mark.parametrize("method", METHODS)
def test_the_meter_counts_every_tensor_the_cache_holds(method: str, storage: str) -> None:
    """At every step of a run past several compressions (a left-padded batch of two, so padding
    and ragged rows are in it), state_bytes equals the walk's bytes, by the storage each tensor
    holds, as held and priced at 16 bits; the peak is at least every value seen."""
    model = tiny_model("llama", "sdpa", 2)
    try:
        cache = _cache(model, method, 24, **STORAGE[storage])
    except KnobError as err:  # a setting the method refuses (said so, in one line)
        pytest.skip(f"{method} refuses {storage}: {err}")
    ids, mask = left_pad([random_prompt(20, seed=3)[0], random_prompt(13, seed=4)[0]])
    seen = []

    def check(c, fed: int) -> None:
        mem = c.memory()
        walked = held_bytes(walk_tensors(c))
        assert (mem["state_bytes"], mem["state_bytes_16bit"]) == walked, f"after {fed} tokens"
        seen.append(mem["state_bytes"])
        assert mem["peak_state_bytes"] >= max(seen)
        assert mem["state_bytes"] >= mem["kv_bytes"] and mem["peak_state_bytes"] >= mem["peak_kv_bytes"]

    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, **cache_arg(cache), use_cache=True)
        check(cache, ids.shape[1])
        token = out.logits[:, -1:].argmax(-1)
        for _ in range(40):
            mask = torch.cat([mask, torch.ones_like(token)], dim=1)
            out = model(input_ids=token, attention_mask=mask, **cache_arg(cache), use_cache=True)
            check(cache, mask.shape[1])
            token = out.logits[:, -1:].argmax(-1)
    if reasonkv.get_method(method).compresses:
        assert cache.n_compressions > 0


def test_state_beside_kv_is_what_the_parts_hold() -> None:
    """BeaconKV on the tiny model, one sequence: what state_bytes holds beside K/V is the query
    window (16 recent queries and the backlog not yet fed to the beacons), the beacon buffers,
    and the slot indices, by hand from the shapes."""
    model = tiny_model("llama", "sdpa", 2)
    cache = reasonkv.make_cache(model, "beaconkv", 32)
    greedy_loop(model, random_prompt(10, seed=5), cache, 60)
    layer = cache.layers[0]
    hq, d = 4, 16
    window = layer.window.queries.shape[2]
    scorer = cache.policy.scorer
    assert window == scorer.recent + scorer.query_backlog
    beacons = layer.states.scorer.beacons
    expected_layer = (
        window * hq * d * 4  # queries, fp32
        + 2 * window * 8  # their sequence indices and positions
        + beacons.numel() * beacons.element_size()
        + hq * 8  # beacon counts
        + 2 * layer.storage.capacity * 8  # token_index of two KV heads
        + 2 * 2 * 8  # lengths, n_valid
        + 8
        + 8
        + 2 * 8
        + 2 * 8  # prompt_end, compressions, budgets, targets
    )
    mem = cache.memory()
    budgets = cache.budgets.numel() * 8  # the cache's own: greedy_loop feeds no token-id check
    assert mem["state_bytes"] - mem["kv_bytes"] == expected_layer * len(cache.layers) + budgets
