"""Real model shapes with random weights: `random:<name>` and `random:<name>:key=value,...`.

A random model has the architecture of a published model (its layers, widths, heads, KV heads,
head dim, vocabulary, RoPE) built from the table below, with seeded random weights and nothing
downloaded. Its outputs are noise: it is for speed and memory work (what a cache of that shape
costs on a device), and meaningless for fidelity.

Overrides shrink a shape for tests and CPU toy runs, e.g.
`random:qwen3-0.6b:layers=2,hidden=64,heads=4,kv_heads=2,intermediate=128`. Keys: layers, hidden,
intermediate, heads, kv_heads, head_dim, vocab. The head dim stays the model's own (128 for all four
shipped shapes) unless `head_dim=` is given; `heads` must be a multiple of `kv_heads`.
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass

import torch

RANDOM_PREFIX = "random:"

TOKENIZER_VOCAB = 49_152
"""The vocabulary of the tokenizer random models use (the bundled default model's): every
random model's vocabulary must hold its ids."""


@dataclass(frozen=True)
class RandomShape:
    """One architecture: the fields of its config.json that the model's tensors depend on."""

    source: str  # the Hugging Face id whose config.json the numbers come from
    model_type: str
    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    rope_theta: float
    max_positions: int
    tie_embeddings: bool
    rms_norm_eps: float
    rope_scaling: tuple[tuple[str, float], ...] = ()  # extra rope_parameters (llama3 scaling)

    @property
    def display(self) -> str:
        return f"{self.source.rpartition('/')[2]}'s shape"


# From each model's config.json on the Hugging Face hub (the id in `source`), sliding window off.
# Qwen3 (q_norm/k_norm before RoPE) and Llama carry head_dim in their config; Qwen2 derives it
# (3584 / 28 = 128). Llama 3.1 keeps its llama3 RoPE scaling (factor 8 over 8,192 positions).
RANDOM_MODELS: dict[str, RandomShape] = {
    "qwen3-0.6b": RandomShape(
        "Qwen/Qwen3-0.6B", "qwen3", layers=28, hidden=1024, intermediate=3072, heads=16, kv_heads=8,
        head_dim=128, vocab=151_936, rope_theta=1_000_000.0, max_positions=40_960,
        tie_embeddings=True, rms_norm_eps=1e-6,
    ),
    "qwen3-8b": RandomShape(
        "Qwen/Qwen3-8B", "qwen3", layers=36, hidden=4096, intermediate=12_288, heads=32, kv_heads=8,
        head_dim=128, vocab=151_936, rope_theta=1_000_000.0, max_positions=40_960,
        tie_embeddings=False, rms_norm_eps=1e-6,
    ),
    "r1-distill-qwen-7b": RandomShape(
        "deepseek-ai/DeepSeek-R1-Distill-Qwen-7B", "qwen2", layers=28, hidden=3584, intermediate=18_944,
        heads=28, kv_heads=4, head_dim=128, vocab=152_064, rope_theta=10_000.0, max_positions=131_072,
        tie_embeddings=False, rms_norm_eps=1e-6,
    ),
    "llama-3.1-8b": RandomShape(
        "meta-llama/Llama-3.1-8B", "llama", layers=32, hidden=4096, intermediate=14_336, heads=32,
        kv_heads=8, head_dim=128, vocab=128_256, rope_theta=500_000.0, max_positions=131_072,
        tie_embeddings=False, rms_norm_eps=1e-5,
        rope_scaling=(
            ("rope_type", "llama3"), ("factor", 8.0), ("low_freq_factor", 1.0),
            ("high_freq_factor", 4.0), ("original_max_position_embeddings", 8192),
        ),
    ),
}  # fmt: skip

OVERRIDES = ("layers", "hidden", "intermediate", "heads", "kv_heads", "head_dim", "vocab")
"""The keys `random:<name>:key=value,...` accepts (fields of RandomShape)."""


def is_random_model(name: object) -> bool:
    """Does this model argument name a random-weight model (`random:...`)?"""
    return isinstance(name, str) and name.startswith(RANDOM_PREFIX)


def random_shape(name: str) -> RandomShape:
    """The shape `random:<name>[:key=value,...]` names, overrides applied. An unknown name lists
    the known ones; an unknown or repeated key, a value that is not a positive integer, heads that
    are not a multiple of kv_heads, an odd head_dim or a vocab below the tokenizer's is a one-line
    ValueError. Nothing is built."""
    base, _, overrides = name.removeprefix(RANDOM_PREFIX).partition(":")
    if base not in RANDOM_MODELS:
        raise ValueError(f"unknown random model {base!r}; known: {', '.join(RANDOM_MODELS)}")
    shape = RANDOM_MODELS[base]
    changes: dict[str, int] = {}
    for item in overrides.split(",") if overrides else []:
        key, eq, value = (part.strip() for part in item.partition("="))
        if key not in OVERRIDES:
            raise ValueError(
                f"{name}: unknown override {key!r}; use key=value with keys {', '.join(OVERRIDES)}"
            )
        if not eq or not (value.isascii() and value.isdigit()) or int(value) <= 0:
            raise ValueError(f"{name}: {key} must be a positive integer, got {value!r}")
        if key in changes:
            raise ValueError(f"{name}: {key} is given twice")
        changes[key] = int(value)
    shape = dataclasses.replace(shape, **changes)
    if shape.heads % shape.kv_heads:
        raise ValueError(f"{name}: heads ({shape.heads}) must be a multiple of kv_heads ({shape.kv_heads})")
    if shape.head_dim % 2:
        raise ValueError(f"{name}: head_dim must be even (RoPE rotates pairs), got {shape.head_dim}")
    if shape.vocab < TOKENIZER_VOCAB:
        raise ValueError(
            f"{name}: vocab must be at least {TOKENIZER_VOCAB} (the tokenizer's), got {shape.vocab}"
        )
    return shape


def random_config(name: str):
    """The transformers config of `random:<name>[:overrides]` (sliding window off)."""
    from transformers import AutoConfig

    shape = random_shape(name)
    rope = {"rope_theta": shape.rope_theta, "rope_type": "default", **dict(shape.rope_scaling)}
    return AutoConfig.for_model(
        shape.model_type,
        num_hidden_layers=shape.layers,
        hidden_size=shape.hidden,
        intermediate_size=shape.intermediate,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        head_dim=shape.head_dim,
        vocab_size=shape.vocab,
        max_position_embeddings=shape.max_positions,
        rms_norm_eps=shape.rms_norm_eps,
        tie_word_embeddings=shape.tie_embeddings,
        rope_parameters=rope,
        use_sliding_window=False,
        sliding_window=None,
    )


def _no_init_weights():
    """transformers' switch that skips the weight init done while modules are built (both torch's
    per-module init and its own), or nothing where this transformers lacks it (only slower)."""
    try:
        from transformers.initialization import no_init_weights
    except ImportError:
        return contextlib.nullcontext()
    return no_init_weights()


def build_random_model(
    config,
    device: torch.device,
    dtype: torch.dtype,
    attn_implementation: str = "sdpa",
    seed: int = 0,
):
    """A causal LM of `config` with seeded random weights, built directly on `device` in `dtype`.

    The modules are allocated uninitialised on the device, then transformers' own init (normal
    with the config's initializer_range, norms at one, tied embeddings) runs once, seeded, on the
    device: an 8B model in bfloat16 on a GPU takes seconds. The same seed on the same device and
    dtype gives the same weights; the global RNG is left as it was."""
    from transformers import AutoModelForCausalLM

    devices = [device.index or 0] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        with torch.device(device), _no_init_weights():
            model = AutoModelForCausalLM.from_config(
                config, dtype=dtype, attn_implementation=attn_implementation
            )
        model.init_weights()
    return model.eval()
