"""A fresh cache per call: CacheFactory and compressed_pipeline against the transformers
text-generation pipeline, the misuse they replace (one cache for several prompts), and the
decoding modes a reasonkv cache cannot serve (assisted and prompt-lookup decoding crop it)."""

from __future__ import annotations

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, pipeline

import reasonkv
from conftest import VOCAB, build_tiny_model, random_prompt
from reasonkv.core.hf_compat import CACHE_KWARG, NEW_CACHE_API, cache_arg
from reasonkv.methods.knobs import KnobError

PROMPTS = ["what is two plus two?", "hello", "name a prime number, then another one."]
NEW = 24  # prompt + 24 tokens pass snapkv's budget 16 + interval 8: every run compresses
METHOD = dict(method="snapkv", budget=16, interval=8)


def char_tokenizer() -> PreTrainedTokenizerFast:
    """A real (fast) tokenizer built offline: one token per character, every one of the tiny
    models' 128 ids decodes to a character (so no output is empty by accident), pad id 0."""
    chars = [chr(c) for c in range(ord("a"), ord("z") + 1)] + list(" .,?!0123456789")
    chars += [chr(0x400 + i) for i in range(VOCAB - 1 - len(chars))]
    vocab = {"<pad>": 0, **{c: i + 1 for i, c in enumerate(chars)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="?"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", padding_side="left")


@pytest.fixture(scope="module")
def model_and_tokenizer():
    return build_tiny_model("llama"), char_tokenizer()


def generate_alone(model, tokenizer, prompt: str) -> list[int]:
    """The reference: one generate() call with its own new cache; the generated ids."""
    inputs = tokenizer(prompt, return_tensors="pt")
    cache = reasonkv.make_cache(model, **METHOD)
    out = model.generate(**inputs, **cache_arg(cache), max_new_tokens=NEW, do_sample=False)
    assert cache.n_compressions > 0
    return out[0, inputs["input_ids"].shape[1] :].tolist()


@pytest.mark.parametrize("batch_size", [1, 2])
def test_pipeline_with_a_fresh_cache_per_batch_equals_separate_generate_calls(
    model_and_tokenizer, batch_size
) -> None:
    model, tokenizer = model_and_tokenizer
    caches = reasonkv.CacheFactory(model, **METHOD)
    pipe = reasonkv.compressed_pipeline(caches, tokenizer, device="cpu")
    kwargs = dict(max_new_tokens=NEW, do_sample=False, batch_size=batch_size)
    texts = pipe(PROMPTS, return_full_text=False, **kwargs)
    ids = pipe(PROMPTS, return_tensors=True, **kwargs)

    batches = -(-len(PROMPTS) // batch_size)
    assert caches.made == 2 * batches, "one new cache per generate() call, i.e. per batch"
    assert caches.last.n_compressions > 0 and caches.last.memory()["seen_tokens"] > NEW
    for prompt, text, row in zip(PROMPTS, texts, ids, strict=True):
        want = generate_alone(model, tokenizer, prompt)
        assert row[0]["generated_token_ids"][-NEW:] == want  # prompt (left-padded in a batch), then NEW
        assert text[0]["generated_text"] == tokenizer.decode(want)
        assert len(text[0]["generated_text"]) == NEW, "every id decodes to one character: never empty"


@pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated:FutureWarning")
def test_one_cache_for_several_prompts_is_refused_not_silently_empty(model_and_tokenizer) -> None:
    model, tokenizer = model_and_tokenizer
    pipe = pipeline("text-generation", model=model, tokenizer=tokenizer, device="cpu")
    # 5.20+: the current keyword and the deprecated one; before, only past_key_values.
    for name in dict.fromkeys((CACHE_KWARG, "past_key_values")):
        cache = reasonkv.make_cache(model, **METHOD)
        with pytest.raises(ValueError, match="holds .* tokens of another sequence") as err:
            pipe(PROMPTS, max_new_tokens=NEW, do_sample=False, **{name: cache})
        assert "make a new cache" in str(err.value)


def test_compressed_pipeline_refuses_a_cache_of_its_own(model_and_tokenizer) -> None:
    model, tokenizer = model_and_tokenizer
    caches = reasonkv.CacheFactory(model, **METHOD)
    pipe = reasonkv.compressed_pipeline(caches, tokenizer, device="cpu")
    with pytest.raises(ValueError, match="fresh reasonkv cache for every batch; do not pass cache="):
        pipe(PROMPTS[:1], cache=reasonkv.make_cache(model, **METHOD), max_new_tokens=2)
    with pytest.raises(TypeError, match="needs a reasonkv.CacheFactory"):
        reasonkv.compressed_pipeline(reasonkv.make_cache(model, **METHOD), tokenizer)


def test_cache_factory_checks_its_knobs_at_once_and_makes_independent_caches() -> None:
    model = build_tiny_model("llama")
    with pytest.raises(KnobError, match="windw"):
        reasonkv.CacheFactory(model, "snapkv", 16, windw=4)
    with pytest.raises(KnobError, match="budget"):
        reasonkv.CacheFactory(model, "snapkv", 0)
    caches = reasonkv.CacheFactory(model, "snapkv", 16, interval=8)
    assert caches.made == 0 and caches.last is None
    first, second = caches(), caches()
    assert first is not second and caches.last is second and caches.made == 2
    assert first.method == "snapkv" and torch.equal(first.budgets, second.budgets)
    assert repr(caches) == "CacheFactory('snapkv', budget=16, interval=8; 2 made)"
    # A loop of generate() calls on different prompts, one new cache each: every call runs.
    for seed, length in ((0, 20), (1, 9)):
        out = model.generate(
            random_prompt(length, seed), **cache_arg(caches()), max_new_tokens=4, do_sample=False
        )
        assert out.shape == (1, length + 4)


@pytest.mark.parametrize("mode", ["prompt_lookup", "assistant"])
def test_assisted_and_prompt_lookup_decoding_are_refused(mode) -> None:
    """Both verify draft tokens and crop the rejected ones off the cache; a reasonkv cache
    cannot be cropped (is_croppable is False), and transformers refuses before any crop."""
    model = build_tiny_model("llama")
    extra = (
        {"prompt_lookup_num_tokens": 3}
        if mode == "prompt_lookup"
        else {"assistant_model": build_tiny_model("llama", seed=1)}
    )
    cache = reasonkv.make_cache(model, **METHOD)
    assert not cache.is_croppable
    # transformers 5.20+ refuses by itself (is_croppable); before, generate() crops and the cache refuses.
    refusal = (
        "Assisted decoding requires a cache that can be cropped" if NEW_CACHE_API else "cannot be cropped"
    )
    with pytest.raises(ValueError if NEW_CACHE_API else NotImplementedError, match=refusal):
        model.generate(random_prompt(12, 0), **cache_arg(cache), max_new_tokens=8, do_sample=False, **extra)
