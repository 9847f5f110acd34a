"""make_cache: turn a method name and a budget into a ready CompressedCache for a model;
CacheFactory and compressed_pipeline: a fresh one for every generate() call or pipeline batch."""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Callable, Iterator
from types import MappingProxyType
from typing import Any

import torch

from reasonkv.core import attention
from reasonkv.core.cache import CompressedCache, LayerPolicy
from reasonkv.core.hf_compat import cache_arg
from reasonkv.core.models import ModelShape, attention_modules, model_shape
from reasonkv.core.policy.knob import MAX_TOKENS
from reasonkv.core.storage_pays import storage_refusal
from reasonkv.methods.knobs import (
    KnobError,
    at_budget,
    build_parts,
    check_budget,
    check_knobs,
    check_protected_window,
)
from reasonkv.methods.profiles import find_profile, load_profile
from reasonkv.methods.registry import get_method


def install_attention(model) -> str:
    """Switch the model to reasonkv's attention of the same backend (sdpa or eager)."""
    current = model.config._attn_implementation
    if current in attention.BACKENDS.values():
        _guard_generation(model)
        return current
    if current not in attention.BACKENDS:
        raise ValueError(
            f"attention implementation {current!r} is not supported; load the model with "
            "attn_implementation='sdpa' or 'eager'"
        )
    name = attention.BACKENDS[current]
    model.set_attn_implementation(name)
    _guard_generation(model)
    return name


def _guard_generation(model) -> None:
    """generate() passes the whole sequence to prepare_inputs_for_generation at every step (and
    only the new tokens to the model): that is where a CompressedCache can see whether a call
    continues the sequence it holds."""
    prepare = getattr(model, "prepare_inputs_for_generation", None)
    if prepare is None or getattr(prepare, "reasonkv_guard", False):
        return

    # wraps: transformers reads this function's signature (e.g. whether it takes inputs_embeds).
    @functools.wraps(prepare)
    def guarded(input_ids, *args, **kwargs):
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        embeds = kwargs.get("inputs_embeds") is not None  # then input_ids holds generated tokens only
        if isinstance(cache, CompressedCache) and isinstance(input_ids, torch.Tensor) and not embeds:
            cache.check_input_ids(input_ids)
        return prepare(input_ids, *args, **kwargs)

    guarded.reasonkv_guard = True
    model.prepare_inputs_for_generation = guarded


def _demand_loader(model):
    """For profile-driven allocators: path (None = the packaged profile) -> demand curve."""

    def load(path: str | None) -> list[float]:
        if path is None:
            path = find_profile(model.config)
        if path is None:
            name = model_shape(model).name
            raise FileNotFoundError(
                f"no ReasonAlloc profile ships for model {name!r}; make one with "
                f"`reasonkv profile --model {name} --traces TRACES.jsonl --out {name}.json` and pass "
                "profile=PATH (CLI: --set profile=PATH)"
            )
        return load_profile(path, model.config)["demand"]

    return load


def _min_budget(schedule, protected: int) -> int:
    """The smallest per-head budget whose post-compression size still holds the protected
    window (allocators that move budget between layers must not go below it). A bounded
    search (targets do not shrink as budgets grow: doubling, then halving the gap), so a
    schedule that never keeps enough is an error, not a hang."""
    low = high = max(protected, 1)
    while schedule.target(high) < protected:
        if high >= MAX_TOKENS:
            raise KnobError(
                f"no budget up to 10^9 tokens keeps the protected window of {protected} tokens "
                f"after compressing with {schedule.describe()}"
            )
        low, high = high + 1, min(2 * high, MAX_TOKENS)
    while low < high:  # target(high) >= protected; the answer is in [low, high]
        mid = (low + high) // 2
        low, high = (low, mid) if schedule.target(mid) >= protected else (mid + 1, high)
    return high


_STORAGE_CHECKED = contextvars.ContextVar("reasonkv_storage_checked", default=True)


@contextlib.contextmanager
def unchecked_storage() -> Iterator[None]:
    """Within it, `make_cache` builds quantized storage it would refuse (one that quantizes
    nothing at its budget, or holds more K/V than at 16 bits) instead of raising. For tests and
    studies of the quantized code paths on toy models: on a model of two layers one layer's
    dequantized copy outweighs what quantizing saves at almost any budget. Nothing else changes."""
    token = _STORAGE_CHECKED.set(False)
    try:
        yield
    finally:
        _STORAGE_CHECKED.reset(token)


def make_cache(model, method: str = "snapkv", budget: int | None = 128, **overrides) -> CompressedCache:
    """A transformers Cache that compresses with `method` at `budget` tokens per KV head.

    Also installs reasonkv's attention function on `model` (same backend as before; it
    behaves exactly like the stock one when used without a CompressedCache). Parameters of
    the method (see `reasonkv methods`) are set by keyword, e.g. `window=16`. `method` may be
    a preset (`beaconkv-int4`, methods/presets.py): its method with its knobs, yours over them.

    Quantized storage (kv_bits < 16) that would never quantize a token at this budget, or that
    would hold more K/V while decoding than the same cache at 16 bits, is refused (a KnobError
    that says what to change; `core.storage_pays`; `unchecked_storage` lifts that). Left
    unset, `residual` is a quarter of the budget, at most 32 (`quantize.default_residual`).
    """
    rotary = getattr(getattr(model, "model", model), "rotary_emb", None)
    budgets, policy = build_policy(
        method,
        budget,
        model_shape(model),
        getattr(rotary, "inv_freq", None),
        float(getattr(rotary, "attention_scaling", 1.0)),
        _demand_loader(model),
        **overrides,
    )
    install_attention(model)
    modules = attention_modules(model)
    name = get_method(method).preset_of or method  # a preset's cache is its method's
    return CompressedCache(
        budgets, policy, method=name, attention_modules=modules, scaling=float(modules[0].scaling)
    )


def build_policy(
    method: str,
    budget: int | None,
    shape: ModelShape,
    rope_inv_freq: torch.Tensor | None,
    rope_attention_scaling: float = 1.0,
    load_demand: Callable[[str | None], list[float]] | None = None,
    **overrides: Any,
) -> tuple[torch.Tensor, LayerPolicy]:
    """The budgets [layers, KV heads] and the checked `LayerPolicy` of `method` for a model of
    `shape`: what `make_cache` builds its cache from, and what a serving engine's adapter runs.
    Knobs are checked as everywhere else (a KnobError in one line)."""
    spec = get_method(method)
    knobs = check_knobs(spec, overrides)  # a preset's knobs under the caller's, errors naming it
    if spec.preset_of is not None:  # then the very cache its method with those knobs builds
        spec = get_method(spec.preset_of)
    budget = check_budget(spec, budget, knobs)
    parts = build_parts(spec, at_budget(spec, budget, knobs))
    protected = parts.protected
    stats = {"min_budget": _min_budget(parts.schedule, protected), "load_demand": load_demand}
    budgets = parts.allocator.allocate(shape.n_layers, shape.n_kv_heads, budget, stats).long()
    if spec.compresses:
        smallest = min(parts.schedule.target(int(b)) for b in budgets.flatten().tolist())
        check_protected_window(spec, budget, smallest, protected)
    try:
        parts.storage.check_head_dim(shape.head_dim)
    except ValueError as err:
        raise KnobError(f"parameters of {method!r} do not fit the model: {err}") from None
    if spec.compresses and _STORAGE_CHECKED.get():
        plans = [parts.schedule.plan([int(b) for b in layer.tolist()]) for layer in budgets]
        heads = (shape.n_kv_heads, shape.head_dim)
        # Where the budget does not say what a head holds (a schedule counted from the
        # prompt's end, a kept prompt) the storage cannot be judged from it.
        if not (parts.schedule.from_prompt_end or parts.protection["protect_prompt"]):
            split, given = parts.head_allocator is not None, "residual" in knobs
            why = storage_refusal(
                spec.name, budget, parts.storage, plans, heads, head_split=split, residual_given=given
            )
            if why is not None:
                raise KnobError(why)
    if parts.storage.pre_rope and rope_inv_freq is None:
        raise KnobError(
            f"parameters of {method!r} do not fit the model: pre_rope needs its RoPE inverse "
            "frequencies (model.model.rotary_emb.inv_freq), and it has none"
        )
    policy = LayerPolicy(
        scorer=parts.scorer,
        schedule=parts.schedule,
        head_allocator=parts.head_allocator,
        rope_inv_freq=rope_inv_freq,
        rope_attention_scaling=rope_attention_scaling,
        kv_format=parts.storage,
        **parts.protection,
    )
    return budgets, policy


class CacheFactory:
    """Makes a fresh CompressedCache at every call: `model.generate(**inputs, cache=caches())`.

    A cache serves one sequence (another prompt is refused), so a loop of generate() calls or
    a pipeline over several prompts needs a new cache each time; this holds the method, budget
    and knobs once. They are checked here, before any prompt runs (a KnobError). `last` is the
    cache of the latest call (for `memory()` or `events` after it ran), `made` how many were made.
    """

    def __init__(self, model, method: str = "snapkv", budget: int | None = 128, **knobs: Any) -> None:
        self.model, self.method, self.budget, self.knobs = model, method, budget, dict(knobs)
        make_cache(model, method, budget, **self.knobs)  # raises now on a bad method, budget or knob
        self.last: CompressedCache | None = None
        self.made = 0

    def __call__(self) -> CompressedCache:
        self.last = None  # the previous cache's storage goes before the next one fills
        self.last = make_cache(self.model, self.method, self.budget, **self.knobs)
        self.made += 1
        return self.last

    def __repr__(self) -> str:
        knobs = "".join(f", {k}={v!r}" for k, v in self.knobs.items())
        return f"CacheFactory({self.method!r}, budget={self.budget}{knobs}; {self.made} made)"


def compressed_pipeline(caches: CacheFactory, tokenizer, **pipeline_kwargs: Any):
    """A transformers text-generation pipeline over `caches.model` that decodes every batch
    with a fresh cache from `caches`: `pipe(["prompt 1", "prompt 2"], max_new_tokens=256)`.
    `pipeline_kwargs` go to `transformers.pipeline` (e.g. device, batch_size). Passing `cache`
    or `past_key_values` to the pipeline is refused: one cache cannot serve several prompts."""
    from transformers import pipeline

    if not isinstance(caches, CacheFactory):
        raise TypeError(f"compressed_pipeline needs a reasonkv.CacheFactory, got {type(caches).__name__}")
    return pipeline(
        "text-generation",
        model=caches.model,
        tokenizer=tokenizer,
        pipeline_class=_pipeline_class(),
        cache_factory=caches,
        **pipeline_kwargs,
    )


@functools.cache
def _pipeline_class() -> type:
    """Built on first use: importing transformers' pipelines takes seconds."""
    from transformers import TextGenerationPipeline

    class CompressedTextGenerationPipeline(TextGenerationPipeline):
        """transformers' text-generation pipeline; each batch's generate() gets a new cache."""

        def __init__(self, *args, cache_factory: CacheFactory, **kwargs) -> None:
            self.cache_factory = cache_factory
            super().__init__(*args, **kwargs)

        def _forward(self, model_inputs, **generate_kwargs):
            given = sorted({"cache", "past_key_values"} & set(generate_kwargs))
            if given:
                raise ValueError(
                    f"this pipeline makes a fresh reasonkv cache for every batch; do not pass {given[0]}= "
                    "(one cache serves one sequence)"
                )
            return super()._forward(model_inputs, **cache_arg(self.cache_factory()), **generate_kwargs)

    return CompressedTextGenerationPipeline


GREEDY = MappingProxyType({"do_sample": False, "temperature": None, "top_p": None, "top_k": None})
"""`generate` keywords for greedy decoding: the None values override a sampling setup in the
model's own generation config (which would otherwise warn that it is ignored)."""


def generate(
    model,
    tokenizer,
    prompt: str | list[str],
    cache: CompressedCache | None = None,
    chat: bool = True,
    **generate_kwargs,
) -> tuple[list[str], torch.Tensor]:
    """Convenience: tokenize (chat template when the tokenizer has one), generate, decode."""
    prompts = [prompt] if isinstance(prompt, str) else list(prompt)
    if chat and getattr(tokenizer, "chat_template", None):
        prompts = [
            tokenizer.apply_chat_template(
                [{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True
            )
            for p in prompts
        ]
    inputs = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=not chat)
    inputs = {k: v.to(model.device) for k, v in inputs.items()}
    generate_kwargs.setdefault("pad_token_id", tokenizer.pad_token_id)
    out = model.generate(**inputs, **cache_arg(cache), **generate_kwargs)
    new = out[:, inputs["input_ids"].shape[1] :]
    return tokenizer.batch_decode(new, skip_special_tokens=True), new
