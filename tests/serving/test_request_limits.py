"""What one request may hold in a fixed-memory engine: each rule at its exact boundary."""

from __future__ import annotations

import pytest

from reasonkv.core.models import ModelShape
from reasonkv.methods.api import build_policy
from reasonkv.methods.knobs import KnobError
from reasonkv.methods.resolved import resolve_method
from reasonkv.serving.request_limits import check_fits

# 4 query heads over 2 KV heads: one uncompressed request of 1024 tokens holds 2 * 2 * 1024 =
# 4096 key and value vectors a layer.
SHAPE = ModelShape("tiny", "llama", n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16)
MAX_LEN = 1024
WAIT = 8


def fits(method: str, budget: int, **knobs) -> None:
    resolved = resolve_method(method, budget, knobs)
    _, policy = build_policy(resolved, SHAPE)
    check_fits(resolved, policy, SHAPE, MAX_LEN, WAIT)


def test_a_token_count_knob_is_at_most_max_model_len() -> None:
    fits("beaconkv", 64, upkeep_every=16)
    with pytest.raises(KnobError, match=r"'beacon_max' of 'beaconkv' counts tokens: .*\(1024\), got 100000"):
        fits("beaconkv", 64, beacon_max=100000)
    with pytest.raises(KnobError, match=r"'interval' of 'snapkv' counts tokens: .*got 1025"):
        fits("snapkv", 64, interval=1025)


def test_vectors_beside_kv_are_at_most_one_uncompressed_requests() -> None:
    # BeaconKV holds beacon_max beacons a query head, and 16 recent + 8 queued + 8 waiting
    # queries a query head: 4 * (beacon_max + 32) <= 4096 while beacon_max <= 992.
    fits("beaconkv", 64, beacon_max=992)
    with pytest.raises(KnobError, match=r"holds 4100 vectors a layer beside its K/V .*\(4096\)"):
        fits("beaconkv", 64, beacon_max=993)
    # One query window a query head: 4 * (window + 8 waiting) <= 4096 while window <= 1016.
    fits("snapkv", 64, window=1016)
    with pytest.raises(KnobError, match="holds 4100 vectors"):
        fits("snapkv", 64, window=1017)


def test_a_budget_that_can_never_evict_is_refused() -> None:
    # A layer holds at most max_model_len - 1 = 1023 tokens: the last sampled token is never fed.
    fits("streaming", 1022)  # evicts one token when a head holds 1023
    with pytest.raises(KnobError, match=r"budget 1023 never evicts .*'streaming'"):
        fits("streaming", 1023)
    fits("snapkv", 895)  # compresses at 895 + 128 = 1023 tokens
    with pytest.raises(KnobError, match="budget 896 never evicts"):
        fits("snapkv", 896)
    # Counted from the prompt's end, it compresses every 128 generated tokens whatever it holds:
    # it evicts while budget + 1 and a one-token prompt + interval fit.
    fits("snapkv", 1022, phase="decode")
    with pytest.raises(KnobError, match="budget 1023 never evicts"):
        fits("snapkv", 1023, phase="decode")
    fits("snapkv", 64, phase="decode", interval=1022)
    with pytest.raises(KnobError, match="budget 64 never evicts"):
        fits("snapkv", 64, phase="decode", interval=1023)
    # Buffered every-step eviction evicts when a head holds budget + evict_every tokens.
    fits("streaming", 959, evict_every=64)
    with pytest.raises(KnobError, match="budget 960 never evicts"):
        fits("streaming", 960, evict_every=64)


def test_rpc_evicts_once_a_prompt_and_one_period_fill_the_context() -> None:
    # RPC's first selection comes after P + R generated tokens (R = 32 recent): with a one-token
    # prompt, 1 + 32 + P <= 1023 while P = 4 * budget <= 990 (or interval <= 990). Its budget is
    # P/c, far below what it keeps, so "budget >= max_model_len" would be the wrong rule.
    fits("rpc", 16)
    fits("rpc", 247)
    with pytest.raises(KnobError, match="budget 248 never evicts"):
        fits("rpc", 248)
    fits("rpc", 16, interval=990)
    with pytest.raises(KnobError, match="budget 16 never evicts"):
        fits("rpc", 16, interval=991)
    with pytest.raises(KnobError, match="budget 16 never evicts"):  # P/c = P: keeps every token
        fits("rpc", 16, ratio=1.0)
