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
from reasonkv.core.storage_pays import storage_refusal
from reasonkv.methods.knobs import KnobError
from reasonkv.methods.profiles import find_profile, load_profile
from reasonkv.methods.resolved import ResolvedMethod, resolve_method


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


def _resolved(caller: str, method: str | ResolvedMethod, budget: object, knobs: dict) -> ResolvedMethod:
    """`method` resolved with `budget` and `knobs`, or a resolved value as it is (knobs beside it
    are refused: they would be silently ignored)."""
    if not isinstance(method, ResolvedMethod):
        return resolve_method(method, budget, knobs)
    if knobs:
        names = ", ".join(knobs)
        raise TypeError(f"{caller} got a resolved method and knobs ({names}): put them in resolve_method")
    return method


def make_cache(
    model, method: str | ResolvedMethod = "snapkv", budget: int | None = 128, **overrides
) -> CompressedCache:
    """A transformers Cache that compresses with `method` at `budget` tokens per KV head.

    Also installs reasonkv's attention function on `model` (same backend as before; it
    behaves exactly like the stock one when used without a CompressedCache). Parameters of
    the method (see `reasonkv methods`) are set by keyword, e.g. `window=16`. `method` may be
    a preset (`beaconkv-int4`, methods/presets.py): its method with its knobs, yours over them;
    or a value of `resolve_method`, which holds its budget and knobs (`budget` is then not read,
    and knobs given here are refused).

    Quantized storage (kv_bits < 16) that would never quantize a token at this budget, or that
    would hold more K/V while decoding than the same cache at 16 bits, is refused (a KnobError
    that says what to change; `core.storage_pays`; `unchecked_storage` lifts that). Left
    unset, `residual` is a quarter of the budget, at most 32 (`quantize.default_residual`).
    """
    resolved = _resolved("make_cache", method, budget, overrides)
    rotary = getattr(getattr(model, "model", model), "rotary_emb", None)
    budgets, policy = build_policy(
        resolved,
        model_shape(model),
        getattr(rotary, "inv_freq", None),
        float(getattr(rotary, "attention_scaling", 1.0)),
        _demand_loader(model),
    )
    install_attention(model)
    modules = attention_modules(model)
    return CompressedCache(
        budgets, policy, method=resolved.method, attention_modules=modules, scaling=float(modules[0].scaling)
    )


def build_policy(
    resolved: ResolvedMethod,
    shape: ModelShape,
    rope_inv_freq: torch.Tensor | None = None,
    rope_attention_scaling: float = 1.0,
    load_demand: Callable[[str | None], list[float]] | None = None,
) -> tuple[torch.Tensor, LayerPolicy]:
    """The budgets [layers, KV heads] and the `LayerPolicy` of a resolved method for a model of
    `shape`: what `make_cache` builds its cache from, and what a serving engine's adapter runs.
    Only what needs the model is checked here (a KnobError in one line): each layer's budget
    against the protected window, the head dim, RoPE, whether quantized storage pays."""
    spec, budget, policy, knobs = resolved.spec, resolved.budget, resolved.policy, resolved.knobs
    budgets = resolved.layer_budgets(shape.n_layers, shape.n_kv_heads, load_demand)
    storage = policy.kv_format
    try:
        storage.check_head_dim(shape.head_dim)
    except ValueError as err:
        raise KnobError(f"parameters of {resolved.name!r} do not fit the model: {err}") from None
    if storage.pre_rope and rope_inv_freq is None:
        raise KnobError(
            f"parameters of {resolved.name!r} do not fit the model: pre_rope needs its RoPE inverse "
            "frequencies (model.model.rotary_emb.inv_freq), and it has none"
        )
    # Where the budget does not say what a head holds (a schedule counted from the prompt's
    # end, a kept prompt) the storage cannot be judged from it.
    judged = storage.quantized and not (policy.schedule.from_prompt_end or policy.protect_prompt)
    if budget is not None and _STORAGE_CHECKED.get() and judged:
        given = "residual" in knobs
        why = storage_refusal(spec.name, budget, policy, budgets, shape.head_dim, residual_given=given)
        if why is not None:
            raise KnobError(why)
    return budgets, resolved.with_rope(rope_inv_freq, rope_attention_scaling)


class CacheFactory:
    """Makes a fresh CompressedCache at every call: `model.generate(**inputs, cache=caches())`.

    A cache serves one sequence (another prompt is refused), so a loop of generate() calls or
    a pipeline over several prompts needs a new cache each time; this holds the method, budget
    and knobs once. They are checked here, before any prompt runs (a KnobError). `last` is the
    cache of the latest call (for `memory()` or `events` after it ran), `made` how many were made.
    """

    def __init__(
        self, model, method: str | ResolvedMethod = "snapkv", budget: int | None = 128, **knobs: Any
    ) -> None:
        resolved = _resolved("CacheFactory", method, budget, knobs)
        self.model, self.resolved = model, resolved
        self.method, self.budget, self.knobs = resolved.name, resolved.budget, dict(resolved.knobs)
        make_cache(model, self.resolved)  # raises now on what needs the model (e.g. a layer's budget)
        self.last: CompressedCache | None = None
        self.made = 0

    def __call__(self) -> CompressedCache:
        self.last = None  # the previous cache's storage goes before the next one fills
        self.last = make_cache(self.model, self.resolved)
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
