"""`random:<name>` models: published shapes with seeded random weights, nothing downloaded.

The expected numbers below are written by hand from the models' published config.json and
parameter counts, not read from the table they check.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForCausalLM

import reasonkv
from reasonkv.core import models
from reasonkv.core.hf_compat import cache_arg
from reasonkv.core.models import check_supported, model_note, model_shape
from reasonkv.core.random_models import (
    RANDOM_MODELS,
    TOKENIZER_VOCAB,
    build_random_model,
    random_config,
    random_shape,
)

# name: (model_type, layers, heads, kv_heads, head_dim, hidden, intermediate, vocab, tied, params in B)
EXPECTED = {
    "qwen3-0.6b": ("qwen3", 28, 16, 8, 128, 1024, 3072, 151_936, True, 0.60),
    "qwen3-8b": ("qwen3", 36, 32, 8, 128, 4096, 12_288, 151_936, False, 8.19),
    "r1-distill-qwen-7b": ("qwen2", 28, 28, 4, 128, 3584, 18_944, 152_064, False, 7.62),
    "llama-3.1-8b": ("llama", 32, 32, 8, 128, 4096, 14_336, 128_256, False, 8.03),
}
SMALL = "layers=2,hidden=64,heads=4,kv_heads=2,intermediate=128,head_dim=16"
CPU = torch.device("cpu")


def small(name: str = "qwen3-0.6b", extra: str = "") -> str:
    return f"random:{name}:{SMALL}{extra}"


def test_every_shipped_name_is_expected() -> None:
    assert set(RANDOM_MODELS) == set(EXPECTED)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_the_config_has_the_published_shape(name: str) -> None:
    model_type, layers, heads, kv_heads, head_dim, hidden, inter, vocab, tied, billions = EXPECTED[name]
    config = random_config(f"random:{name}")
    check_supported(config)  # full attention on every layer, RoPE
    shape = model_shape(SimpleNamespace(config=config))  # what the cache reads
    assert (shape.model_type, shape.n_layers) == (model_type, layers)
    assert (shape.n_heads, shape.n_kv_heads, shape.head_dim) == (heads, kv_heads, head_dim)
    assert (config.hidden_size, config.intermediate_size, config.vocab_size) == (hidden, inter, vocab)
    assert config.tie_word_embeddings is tied
    assert not getattr(config, "use_sliding_window", False) and config.sliding_window is None
    with torch.device("meta"):  # the whole model's tensors, without memory
        meta = AutoModelForCausalLM.from_config(config)
    assert sum(p.numel() for p in meta.parameters()) / 1e9 == pytest.approx(billions, abs=0.005)
    if model_type == "qwen3":
        assert meta.model.layers[0].self_attn.q_norm.weight.shape == (head_dim,)


def test_rope_of_each_shape() -> None:
    rope = {n: random_config(f"random:{n}").rope_parameters for n in EXPECTED}
    assert rope["qwen3-8b"]["rope_theta"] == rope["qwen3-0.6b"]["rope_theta"] == 1_000_000
    assert rope["r1-distill-qwen-7b"]["rope_theta"] == 10_000
    llama = rope["llama-3.1-8b"]
    assert llama["rope_theta"] == 500_000 and llama["rope_type"] == "llama3" and llama["factor"] == 8
    assert llama["original_max_position_embeddings"] == 8192


def test_overrides_shrink_the_shape() -> None:
    shape = random_shape(small("r1-distill-qwen-7b", ",vocab=50000"))
    assert (shape.layers, shape.hidden, shape.heads, shape.kv_heads, shape.head_dim) == (2, 64, 4, 2, 16)
    assert (shape.intermediate, shape.vocab, shape.model_type) == (128, 50_000, "qwen2")
    assert random_shape("random:qwen3-8b:layers=3").head_dim == 128  # the model's own unless given


@pytest.mark.parametrize(
    "name,message",
    [
        ("random:qwen9", "unknown random model 'qwen9'; known: qwen3-0.6b, qwen3-8b"),
        ("random:qwen3-8b:depth=2", "unknown override 'depth'"),
        ("random:qwen3-8b:layers", "layers must be a positive integer"),
        ("random:qwen3-8b:layers=two", "layers must be a positive integer, got 'two'"),
        ("random:qwen3-8b:layers=0", "layers must be a positive integer"),
        ("random:qwen3-8b:layers=-1", "layers must be a positive integer"),
        ("random:qwen3-8b:layers=\u00b2", "layers must be a positive integer"),
        ("random:qwen3-8b:layers=2,layers=3", "layers is given twice"),
        ("random:qwen3-8b:heads=6,kv_heads=4", r"heads \(6\) must be a multiple of kv_heads \(4\)"),
        ("random:qwen3-8b:head_dim=15", "head_dim must be even"),
        ("random:qwen3-8b:vocab=1000", f"vocab must be at least {TOKENIZER_VOCAB}"),
    ],
)
def test_a_bad_name_is_one_line_before_anything_loads(monkeypatch, name: str, message: str) -> None:
    def no_tokenizer(*args, **kwargs):
        raise AssertionError("the tokenizer was loaded although the name was invalid")

    monkeypatch.setattr(models, "bundled_gguf_path", no_tokenizer)
    with pytest.raises(ValueError, match=message) as err:
        reasonkv.load_model(name, device="cpu")
    assert "\n" not in str(err.value)


def test_the_same_seed_gives_the_same_weights() -> None:
    config = random_config(small())
    a, b = (build_random_model(config, CPU, torch.float32, seed=3) for _ in range(2))
    c = build_random_model(config, CPU, torch.float32, seed=4)
    before = torch.random.get_rng_state()
    build_random_model(config, CPU, torch.float32, seed=3)
    assert torch.equal(torch.random.get_rng_state(), before)  # the global RNG is left alone
    states = a.state_dict().items(), b.state_dict().values(), c.state_dict().values()
    for (name, pa), pb, pc in zip(*states, strict=True):
        assert torch.equal(pa, pb), name
        if name.endswith("proj.weight"):
            assert not torch.equal(pa, pc), name


def test_weights_follow_the_config_init() -> None:
    model = build_random_model(random_config(small()), CPU, torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.lm_head.weight is model.model.embed_tokens.weight  # qwen3-0.6b ties them
    q_proj = model.model.layers[0].self_attn.q_proj.weight.float()
    assert q_proj.std().item() == pytest.approx(0.02, rel=0.1)
    assert bool((model.model.norm.weight == 1).all())
    assert not model.training


@pytest.mark.parametrize("name", sorted(EXPECTED))
@pytest.mark.parametrize("method,budget,knobs", [("snapkv", 24, {"interval": 8}), ("h2o", 24, {})])
def test_a_small_random_model_compresses(name: str, method: str, budget: int, knobs: dict) -> None:
    model = build_random_model(random_config(small(name)), CPU, torch.float32)
    check_supported(model.config)
    cache = reasonkv.make_cache(model, method, budget, **knobs)
    prompt = torch.randint(3, 1000, (1, 16), generator=torch.Generator().manual_seed(0))
    out = model.generate(input_ids=prompt, **cache_arg(cache), max_new_tokens=40, do_sample=False)
    assert out.shape == (1, 56)
    assert cache.n_compressions > 0
    memory = cache.memory()
    assert memory["seen_tokens"] == 55  # the last token is never fed back
    assert int(memory["live_tokens"].max()) <= budget + knobs.get("interval", 0)


def test_model_note_says_random_weights() -> None:
    note = model_note("random:qwen3-8b:layers=2")
    assert note is not None and "random weights" in note and "Qwen3-8B" in note
    assert "meaningless for fidelity" in note and "speed and memory" in note
    assert "random weights" in (model_note("random:unknown") or "")
    assert model_note("Qwen/Qwen3-8B") is None


@pytest.mark.model
def test_load_model_builds_on_the_device_with_the_default_tokenizer() -> None:
    model, tokenizer = reasonkv.load_model(small("llama-3.1-8b"), device="cpu", dtype="bfloat16")
    assert model.config.name_or_path == small("llama-3.1-8b")
    assert next(model.parameters()).dtype == torch.bfloat16
    assert next(model.parameters()).device.type == "cpu"
    assert len(tokenizer) == TOKENIZER_VOCAB and tokenizer.padding_side == "left"
    assert model.config.eos_token_id == tokenizer.eos_token_id
    assert model.generation_config.pad_token_id == tokenizer.pad_token_id
    assert model_shape(model).n_layers == 2


@pytest.mark.model
def test_a_saved_tokenizer_stands_in_for_the_bundled_model(tmp_path, monkeypatch) -> None:
    from reasonkv.core.models import TOKENIZER_ENV, random_model_tokenizer

    monkeypatch.delenv(TOKENIZER_ENV, raising=False)
    bundled = random_model_tokenizer()
    bundled.save_pretrained(tmp_path / "tok")
    monkeypatch.setenv(TOKENIZER_ENV, str(tmp_path / "tok"))
    saved = random_model_tokenizer()
    text = "Why is 17 * 23 = 391? Think step by step."
    assert saved(text).input_ids == bundled(text).input_ids and saved.padding_side == "left"
    model, tokenizer = reasonkv.load_model(small("qwen3-0.6b"), device="cpu", dtype="float32")
    assert tokenizer(text).input_ids == bundled(text).input_ids
    monkeypatch.setenv(TOKENIZER_ENV, str(tmp_path))
    with pytest.raises(FileNotFoundError, match="no tokenizer saved there"):
        random_model_tokenizer()
