"""Every registered method, present and future (parametrized over available_methods()):
exact when nothing is evicted, bounded memory over a long decode, padding-safe batches."""

from __future__ import annotations

import pytest
import torch

import reasonkv
from conftest import HEAD_DIM, N_LAYERS, dynamic_cache, greedy_loop, left_pad, random_prompt, tiny_model
from method_helpers import profile_knobs, tiny_group
from reasonkv.core.hf_compat import cache_arg

METHODS = sorted(reasonkv.available_methods())
PROMPT = 10
BUDGET = 32
SMALL_INTERVAL = 16  # schedules with an `interval` knob compress often in short runs


def small_cache(model, method: str):
    """`method` at a budget well below the runs of these tests."""
    spec = reasonkv.get_method(method)
    if not spec.compresses:
        return reasonkv.make_cache(model, method, None, **tiny_group(model, method))
    knobs = {"interval": SMALL_INTERVAL} if "interval" in spec.knobs() else {}
    return reasonkv.make_cache(model, method, BUDGET, **knobs, **profile_knobs(model, method))


@pytest.mark.parametrize("arch,attn,kv_heads", [("llama", "sdpa", 2), ("qwen3", "eager", 4)])
@pytest.mark.parametrize("method", METHODS)
def test_no_eviction_equals_dynamic_cache(method: str, arch: str, attn: str, kv_heads: int) -> None:
    model = tiny_model(arch, attn, kv_heads)
    prompt = random_prompt(PROMPT, seed=21)
    budget = None if not reasonkv.get_method(method).compresses else 4096
    cache = reasonkv.make_cache(
        model, method, budget, **profile_knobs(model, method), **tiny_group(model, method)
    )

    tokens, logits = greedy_loop(model, prompt, cache, 30)
    ref_tokens, ref_logits = greedy_loop(model, prompt, dynamic_cache(), 30)

    torch.testing.assert_close(logits, ref_logits, atol=1e-5, rtol=0)
    assert torch.equal(tokens, ref_tokens)
    assert cache.events == []
    assert torch.all(cache.memory()["live_tokens"] == PROMPT + 30)


def _layer_trigger_totals(cache) -> list[int] | None:
    """Per layer, the real tokens (summed over heads) at which a budget schedule compresses,
    or None for schedules with no fixed trigger (RPC's, which decides from its own counters)."""
    totals = [layer.plan.trigger_total for layer in cache.layers]
    return None if any(t is None for t in totals) else totals


@pytest.mark.parametrize("method", METHODS)
def test_memory_stays_bounded_over_300_decode_steps(method: str) -> None:
    model = tiny_model("llama", "sdpa", 2)
    cache = small_cache(model, method)
    compresses = reasonkv.get_method(method).compresses
    head_bound = cache.live_token_bound()
    layer_bounds = _layer_trigger_totals(cache)
    steps = 300
    peak = 0

    def check(c, fed: int) -> None:
        nonlocal peak
        live = c.memory()["live_tokens"]  # [L, H]
        peak = max(peak, int(live.max()))
        assert c.get_seq_length() == fed
        if not compresses:
            assert torch.all(live == fed)
            return
        if head_bound is not None:
            assert int(live.max()) <= head_bound
        if layer_bounds is not None:
            for layer, total in enumerate(live.sum(-1).tolist()):
                # A layer compresses when its heads together reach the sum of their triggers.
                assert total < layer_bounds[layer]

    greedy_loop(model, random_prompt(PROMPT, seed=22), cache, steps, after_step=check)
    if not compresses:
        assert head_bound is None
        return
    seen = PROMPT + steps
    assert len(cache.events) >= 2 * N_LAYERS, "the method must compress repeatedly"
    final = cache.memory()
    # Bounded, or (a periodic ratio like RPC) growing at a fraction of the decoded length.
    assert int(final["live_tokens"].max()) <= seen // 2
    if head_bound is None and layer_bounds is None:
        assert peak <= 3 * seen // 4
    full_storage = N_LAYERS * 2 * 2 * seen * HEAD_DIM * 4  # what keeping every token must cost
    assert final["kv_bytes"] < full_storage


# Quantized storage groups slots, and left padding shifts a row's slots, so a padded row is
# quantized in other groups than alone: close, not token for token (tests/core/test_quantized_cache).
UNQUANTIZED = [m for m in METHODS if reasonkv.get_method(m).knobs().get("kv_bits", 16) == 16]


@pytest.mark.parametrize("attn", ("sdpa", "eager"))
@pytest.mark.parametrize("method", UNQUANTIZED)
def test_left_padded_batch_equals_rows_alone(method: str, attn: str) -> None:
    model = tiny_model("qwen2", attn, 2)
    rows = [random_prompt(n, seed=30 + n)[0] for n in (5, 17, 11)]
    ids, mask = left_pad(rows)
    kwargs = dict(max_new_tokens=64, min_new_tokens=64, do_sample=False)

    cache = small_cache(model, method)
    batch = model.generate(ids, attention_mask=mask, **cache_arg(cache), **kwargs)[:, ids.shape[1] :]
    if reasonkv.get_method(method).compresses:
        assert cache.events, "the batch run must evict"

    for row, prompt in enumerate(rows):
        alone = model.generate(prompt[None], **cache_arg(small_cache(model, method)), **kwargs)[
            0, prompt.numel() :
        ]
        assert torch.equal(batch[row], alone), f"row {row} (prompt of {prompt.numel()} tokens) diverged"
