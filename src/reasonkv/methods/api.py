"""make_cache: turn a method name and a budget into a ready CompressedCache for a model."""

from __future__ import annotations

from types import MappingProxyType

import torch

from reasonkv.core import attention
from reasonkv.core.cache import CompressedCache, LayerPolicy
from reasonkv.core.models import attention_modules, model_shape
from reasonkv.methods.knobs import route_knobs
from reasonkv.methods.profiles import find_profile, load_profile
from reasonkv.methods.registry import get_method


def install_attention(model) -> str:
    """Switch the model to reasonkv's attention of the same backend (sdpa or eager)."""
    current = model.config._attn_implementation
    if current in attention.BACKENDS.values():
        return current
    if current not in attention.BACKENDS:
        raise ValueError(
            f"attention implementation {current!r} is not supported; load the model with "
            "attn_implementation='sdpa' or 'eager'"
        )
    name = attention.BACKENDS[current]
    model.set_attn_implementation(name)
    return name


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
    window (allocators that move budget between layers must not go below it)."""
    budget = max(protected, 1)
    while schedule.target(budget) < protected:
        budget += 1
    return budget


def make_cache(model, method: str = "snapkv", budget: int | None = 128, **overrides) -> CompressedCache:
    """A transformers Cache that compresses with `method` at `budget` tokens per KV head.

    Also installs reasonkv's attention function on `model` (same backend as before; it
    behaves exactly like the stock one when used without a CompressedCache). Parameters of
    the method (see `reasonkv methods`) are set by keyword, e.g. `window=16`.
    """
    spec = get_method(method)
    shape = model_shape(model)
    parts = route_knobs(spec, overrides)
    protection = parts["protection"]
    scorer = spec.scorer(**parts["scorer"])
    schedule = spec.schedule(**parts["schedule"]) if isinstance(spec.schedule, type) else spec.schedule
    if spec.compresses:
        if isinstance(budget, bool) or not isinstance(budget, int) or budget <= 0:
            raise ValueError(f"budget must be a positive number of tokens per KV head, got {budget!r}")
    budget = budget if spec.compresses else 1
    allocator = spec.allocator(**parts["allocator"])
    head_allocator = spec.head_allocator(**parts["head_allocator"]) if spec.head_allocator else None
    protected = protection["n_sink"] + protection["n_recent"]
    stats = {"min_budget": _min_budget(schedule, protected), "load_demand": _demand_loader(model)}
    budgets = allocator.allocate(shape.n_layers, shape.n_kv_heads, budget, stats).long()
    if spec.compresses:
        smallest = min(schedule.target(int(b)) for b in budgets.flatten().tolist())
        if smallest < protected:
            raise ValueError(
                f"budget {budget} is below the protected window: method {method!r} keeps at least "
                f"n_sink + n_recent = {protected} tokens per head (after compressing it keeps {smallest})"
            )
    install_attention(model)
    modules = attention_modules(model)
    rotary = getattr(getattr(model, "model", model), "rotary_emb", None)
    policy = LayerPolicy(
        scorer=scorer,
        schedule=schedule,
        head_allocator=head_allocator,
        rope_inv_freq=getattr(rotary, "inv_freq", None),
        rope_attention_scaling=float(getattr(rotary, "attention_scaling", 1.0)),
        **protection,
    )
    return CompressedCache(
        budgets, policy, method=method, attention_modules=modules, scaling=float(modules[0].scaling)
    )


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
    out = model.generate(**inputs, cache=cache, **generate_kwargs)
    new = out[:, inputs["input_ids"].shape[1] :]
    return tokenizer.batch_decode(new, skip_special_tokens=True), new
