"""bfloat16 and float16: with a budget no run reaches, every method's generate() equals
transformers' default cache (DynamicCache) on a stock model, token for token."""

from __future__ import annotations

import functools

import pytest
import torch
from transformers import DynamicCache

import reasonkv
from conftest import build_tiny_model, random_prompt
from method_helpers import profile_knobs, tiny_group
from reasonkv.core.hf_compat import cache_arg

METHODS = sorted(reasonkv.available_methods())
NEW_TOKENS = 24


@functools.cache
def half_model(dtype: torch.dtype, stock: bool):
    """The tiny Llama in `dtype`; the stock one never gets reasonkv's attention."""
    return build_tiny_model("llama", "sdpa", kv_heads=2, seed=3).to(dtype)


def greedy(model, prompt, cache):
    with torch.no_grad():
        return model.generate(
            input_ids=prompt,
            attention_mask=torch.ones_like(prompt),
            **cache_arg(cache),
            max_new_tokens=NEW_TOKENS,
            do_sample=False,
            pad_token_id=0,
            eos_token_id=None,
        )


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("method", METHODS)
def test_no_eviction_in_half_precision_equals_dynamic_cache(method: str, dtype: torch.dtype) -> None:
    stock, model = half_model(dtype, True), half_model(dtype, False)
    prompt = random_prompt(12, seed=8)
    reference = greedy(stock, prompt, DynamicCache(config=stock.config))
    budget = 4096 if reasonkv.get_method(method).compresses else None
    cache = reasonkv.make_cache(
        model, method, budget, **profile_knobs(model, method), **tiny_group(model, method)
    )
    out = greedy(model, prompt, cache)
    assert cache.n_compressions == 0
    assert torch.equal(out, reference), (out[0, 12:].tolist(), reference[0, 12:].tolist())
    assert cache.layers[0].storage.keys.dtype == dtype or "quant" in method
