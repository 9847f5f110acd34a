"""Bad input fails early with an error that says what is wrong and what would be right."""

from __future__ import annotations

import pytest
import torch
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

import reasonkv
from conftest import build_tiny_model, dynamic_cache, greedy_loop, random_prompt, tiny_model
from reasonkv.core.hf_compat import cache_arg
from reasonkv.core.models import check_supported

SMALL = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2)


def test_unknown_method_names_the_available_ones() -> None:
    with pytest.raises(ValueError, match="unknown method 'nope'") as err:
        reasonkv.make_cache(tiny_model("llama"), "nope", 64)
    for name in reasonkv.available_methods():
        assert name in str(err.value)


@pytest.mark.parametrize("method", ("streaming", "tova", "snapkv"))
def test_budget_below_the_protected_window_is_refused(method: str) -> None:
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="below the protected window"):
        reasonkv.make_cache(model, method, 9, n_sink=4, n_recent=6)
    reasonkv.make_cache(model, method, 10, n_sink=4, n_recent=6)  # exactly the window is fine


@pytest.mark.parametrize("budget", [0, -5, 16.0, "128", None, True])
@pytest.mark.parametrize("method", ("streaming", "snapkv"))
def test_budget_must_be_a_positive_int(method: str, budget) -> None:
    with pytest.raises(ValueError, match="budget must be a positive number of tokens"):
        reasonkv.make_cache(tiny_model("llama"), method, budget)


def test_full_cache_needs_no_budget() -> None:
    cache = reasonkv.make_cache(tiny_model("llama"), "full", None)
    assert cache.live_token_bound() is None


def test_unknown_knob_lists_the_valid_knobs() -> None:
    with pytest.raises(ValueError, match="unknown parameter") as err:
        reasonkv.make_cache(tiny_model("llama"), "snapkv", 64, windw=4)
    message = str(err.value)
    assert "windw" in message
    for knob in reasonkv.get_method("snapkv").knobs():
        assert knob in message


def test_a_knob_of_another_method_is_unknown() -> None:
    # `interval` belongs to the buffer schedule of snapkv, not to every-step tova.
    with pytest.raises(ValueError, match="interval"):
        reasonkv.make_cache(tiny_model("llama"), "tova", 64, interval=4)


def unsupported_models() -> dict[str, torch.nn.Module]:
    return {
        "gpt2": GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64)),
        # Mistral's default config has a 4096-token sliding window on every layer.
        "mistral-sliding": MistralForCausalLM(
            MistralConfig(**SMALL, num_key_value_heads=1, sliding_window=4096)
        ),
        "qwen2-sliding": Qwen2ForCausalLM(
            Qwen2Config(
                **SMALL,
                num_key_value_heads=1,
                use_sliding_window=True,
                sliding_window=16,
                max_window_layers=1,
            )
        ),
    }


@pytest.mark.parametrize("name", ["gpt2", "mistral-sliding", "qwen2-sliding"])
def test_unsupported_architecture_is_refused(name: str) -> None:
    model = unsupported_models()[name]
    attn_before = model.config._attn_implementation
    with pytest.raises(reasonkv.UnsupportedModelError) as err:
        reasonkv.make_cache(model, "snapkv", 64)
    message = str(err.value)
    assert ("not supported" in message) if name == "gpt2" else ("sliding-window" in message)
    assert isinstance(err.value, ValueError)
    assert model.config._attn_implementation == attn_before, "a refused model is left untouched"


@pytest.mark.parametrize(("method", "budget"), [("full", None), ("snapkv", 64)])
def test_qwen2_with_the_window_switched_off_is_supported(method: str, budget: int | None) -> None:
    """Qwen2 checkpoints carry sliding_window (4096) with use_sliding_window=False: the window is
    off, so reasonkv takes the model and decodes exactly like a stock model with a DynamicCache
    (a budget above the length never evicts). The window here is 4, far below the 28 tokens
    seen, so attention that honoured it would change the outputs."""
    model, stock = build_tiny_model("qwen2", seed=5), build_tiny_model("qwen2", seed=5)
    for m in (model, stock):
        # Qwen2Config drops the window when it is off; a config read from a checkpoint may keep it.
        m.config.sliding_window = 4
        assert m.config.use_sliding_window is False
    check_supported(model.config)
    prompt = random_prompt(12, seed=3)
    ref_tokens, ref_logits = greedy_loop(stock, prompt, dynamic_cache(), 16)
    cache = reasonkv.make_cache(model, method, budget)
    tokens, logits = greedy_loop(model, prompt, cache, 16)
    assert torch.equal(tokens, ref_tokens)
    torch.testing.assert_close(logits, ref_logits, atol=1e-5, rtol=0)
    assert cache.get_seq_length() == 12 + 16
    assert cache.events == []


def test_a_cache_used_with_another_model_of_the_same_shape_is_refused() -> None:
    first, second = build_tiny_model("llama", seed=0), build_tiny_model("llama", seed=1)
    cache = reasonkv.make_cache(first, "snapkv", 16)
    reasonkv.install_attention(second)
    prompt = random_prompt(6, seed=0)
    with pytest.raises(RuntimeError, match="made for another model"):
        second(input_ids=prompt, **cache_arg(cache))

    cache = reasonkv.make_cache(first, "snapkv", 16)
    first(input_ids=prompt, **cache_arg(cache))
    with pytest.raises(RuntimeError, match="made for another model"):
        second(input_ids=prompt[:, :1], **cache_arg(cache))


def test_a_cache_used_with_a_model_of_another_shape_is_refused() -> None:
    gqa, mha = build_tiny_model("llama", kv_heads=2), build_tiny_model("llama", kv_heads=4, seed=1)
    reasonkv.install_attention(mha)
    prompt = random_prompt(6, seed=0)

    cache = reasonkv.make_cache(gqa, "snapkv", 16)
    with pytest.raises((RuntimeError, ValueError), match="model"):
        mha(input_ids=prompt, **cache_arg(cache))

    cache = reasonkv.make_cache(gqa, "snapkv", 16)
    gqa(input_ids=prompt, **cache_arg(cache))
    with pytest.raises(RuntimeError, match="another model"):
        mha(input_ids=prompt[:, :1], **cache_arg(cache))


def test_a_model_without_reasonkv_attention_is_refused_at_the_next_step() -> None:
    """A CompressedCache never runs silently under stock attention (it would see no queries
    and no padding): the first forward cannot tell, the second one raises."""
    owner, stock = build_tiny_model("llama", seed=0), build_tiny_model("llama", seed=0)
    cache = reasonkv.make_cache(owner, "snapkv", 16)
    assert stock.config._attn_implementation == "sdpa"
    prompt = random_prompt(6, seed=0)
    stock(input_ids=prompt, **cache_arg(cache))
    with pytest.raises(RuntimeError, match="attention function did not run"):
        stock(input_ids=prompt[:, :1], **cache_arg(cache))


def test_an_unsupported_attention_backend_is_refused() -> None:
    model = build_tiny_model("llama")
    model.config._attn_implementation = "flash_attention_2"
    with pytest.raises(ValueError, match="'sdpa' or 'eager'"):
        reasonkv.make_cache(model, "snapkv", 64)


def test_a_compressed_cache_cannot_be_cropped() -> None:
    model = tiny_model("llama")
    cache = reasonkv.make_cache(model, "snapkv", 16)
    model(input_ids=random_prompt(6, seed=0), **cache_arg(cache))
    with pytest.raises(NotImplementedError, match="cannot be cropped") as err:
        cache.crop(-3)
    assert "assisted decoding and prompt lookup" in str(err.value)


def test_load_model_of_a_missing_name_says_how_to_get_it() -> None:
    with pytest.raises(FileNotFoundError, match="bundled name"):
        reasonkv.load_model("no-such-model")
    with pytest.raises(FileNotFoundError, match="no GGUF file"):
        reasonkv.load_model("/nonexistent/model.gguf")
