"""With a budget no smaller than the sequence, a CompressedCache is exactly a DynamicCache.

Covers every supported architecture (Llama, Qwen2, Qwen3 with q_norm/k_norm, Mistral
without a sliding window), GQA and MHA, sdpa and eager, through generate() and through a
manual forward loop that passes no position_ids.
"""

from __future__ import annotations

import pytest
import torch

import reasonkv
from conftest import ARCHS, build_tiny_model, dynamic_cache, greedy_loop, left_pad, random_prompt, tiny_model
from reasonkv.core.hf_compat import cache_arg

ATTNS = ("sdpa", "eager")
KV_HEADS = (2, 4)  # GQA (group of 2) and MHA
COMPRESSING = ("streaming", "tova", "snapkv")
PROMPT, NEW = 12, 24
ATOL = 1e-5


def big_cache(model, method: str):
    """A cache of `method` whose budget exceeds every sequence of these tests."""
    return reasonkv.make_cache(model, method, None if method == "full" else 4096)


@pytest.mark.parametrize("kv_heads", KV_HEADS)
@pytest.mark.parametrize("attn", ATTNS)
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("method", ("full",) + COMPRESSING)
def test_manual_loop_logits_equal_dynamic_cache(method: str, arch: str, attn: str, kv_heads: int) -> None:
    model = tiny_model(arch, attn, kv_heads)
    prompt = random_prompt(PROMPT, seed=1)
    cache = big_cache(model, method)

    tokens, logits = greedy_loop(model, prompt, cache, NEW)
    ref_tokens, ref_logits = greedy_loop(model, prompt, dynamic_cache(), NEW)

    torch.testing.assert_close(logits, ref_logits, atol=ATOL, rtol=0)
    assert torch.equal(tokens, ref_tokens)
    assert cache.events == [], "nothing may be evicted below the budget"
    assert cache.get_seq_length() == PROMPT + NEW
    live = cache.memory()["live_tokens"]
    assert live.shape == (2, kv_heads)
    assert torch.all(live == PROMPT + NEW)


@pytest.mark.parametrize("kv_heads", KV_HEADS)
@pytest.mark.parametrize("attn", ATTNS)
@pytest.mark.parametrize("arch", ARCHS)
def test_generate_tokens_and_logits_equal_dynamic_cache(arch: str, attn: str, kv_heads: int) -> None:
    model = tiny_model(arch, attn, kv_heads)
    prompt = random_prompt(PROMPT, seed=2)
    kwargs = dict(max_new_tokens=NEW, do_sample=False, return_dict_in_generate=True, output_logits=True)

    ref = model.generate(prompt, **cache_arg(dynamic_cache()), **kwargs)
    for method in ("full", "snapkv"):
        cache = big_cache(model, method)
        out = model.generate(prompt, **cache_arg(cache), **kwargs)
        assert torch.equal(out.sequences, ref.sequences), method
        torch.testing.assert_close(torch.stack(out.logits), torch.stack(ref.logits), atol=ATOL, rtol=0)
        assert cache.get_seq_length() == PROMPT + NEW - 1  # the last token is never fed back


@pytest.mark.parametrize("attn", ATTNS)
@pytest.mark.parametrize("arch", ARCHS)
def test_reasonkv_attention_without_compressed_cache_equals_stock_attention(arch: str, attn: str) -> None:
    """make_cache swaps the model's attention; used with a DynamicCache (or none) the
    swapped-in attention must be the stock one, padding included, so the DynamicCache
    references in this suite are the real thing."""
    stock = build_tiny_model(arch, attn)
    swapped = build_tiny_model(arch, attn)
    reasonkv.make_cache(swapped, "snapkv", 64)
    assert swapped.config._attn_implementation.startswith("reasonkv_")
    assert stock.config._attn_implementation == attn

    prompt = random_prompt(PROMPT, seed=3)
    ref_tokens, ref_logits = greedy_loop(stock, prompt, dynamic_cache(), NEW)
    tokens, logits = greedy_loop(swapped, prompt, dynamic_cache(), NEW)
    torch.testing.assert_close(logits, ref_logits, atol=ATOL, rtol=0)
    assert torch.equal(tokens, ref_tokens)

    # Left-padded batch, no cache at all: real positions agree.
    ids, mask = left_pad([random_prompt(n, seed=n)[0] for n in (4, 9, 7)])
    with torch.no_grad():
        ref = stock(input_ids=ids, attention_mask=mask, use_cache=False).logits
        got = swapped(input_ids=ids, attention_mask=mask, use_cache=False).logits
    real = mask.bool()
    torch.testing.assert_close(got[real], ref[real], atol=ATOL, rtol=0)


@pytest.mark.parametrize("attn", ATTNS)
@pytest.mark.parametrize("arch", ARCHS)
def test_full_cache_generate_equals_stock_model(arch: str, attn: str) -> None:
    stock = build_tiny_model(arch, attn, kv_heads=2)
    model = build_tiny_model(arch, attn, kv_heads=2)
    prompt = random_prompt(PROMPT, seed=4)

    ref = stock.generate(prompt, max_new_tokens=NEW, do_sample=False)
    out = model.generate(
        prompt, max_new_tokens=NEW, do_sample=False, **cache_arg(reasonkv.make_cache(model, "full"))
    )
    assert torch.equal(out, ref)


@pytest.mark.parametrize("attn", ATTNS)
@pytest.mark.parametrize("arch", ARCHS)
def test_chunked_prefill_equals_dynamic_cache(arch: str, attn: str) -> None:
    """Several tokens per forward on a non-empty cache (trace replay in chunks) use the
    cache's own causal mask; it must equal the stock causal attention."""
    model = tiny_model(arch, attn, 2)
    seq = random_prompt(30, seed=5)
    cache, ref_cache = big_cache(model, "snapkv"), dynamic_cache()
    with torch.no_grad():
        for start, stop in ((0, 7), (7, 8), (8, 19), (19, 30)):
            chunk = seq[:, start:stop]
            got = model(input_ids=chunk, **cache_arg(cache)).logits
            ref = model(input_ids=chunk, **cache_arg(ref_cache)).logits
            torch.testing.assert_close(got, ref, atol=ATOL, rtol=0)
    assert cache.get_seq_length() == 30


@pytest.mark.parametrize("attn", ATTNS)
def test_padded_batch_with_full_budget_equals_dynamic_cache(attn: str) -> None:
    model = tiny_model("qwen3", attn, 2)
    ids, mask = left_pad([random_prompt(n, seed=10 + n)[0] for n in (5, 13, 9)])
    kwargs = dict(attention_mask=mask, max_new_tokens=NEW, do_sample=False)

    ref = model.generate(ids, **cache_arg(dynamic_cache()), **kwargs)
    out = model.generate(ids, **cache_arg(big_cache(model, "tova")), **kwargs)
    assert torch.equal(out, ref)
