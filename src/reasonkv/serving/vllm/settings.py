"""What a vLLM user asks for, checked before the engine starts.

The adapter is on only when the engine's `additional_config` has a "reasonkv" entry:

    vllm.LLM(model=..., additional_config={"reasonkv": {"method": "snapkv", "budget": 512}})
    python -m vllm.entrypoints.openai.api_server --model MODEL \\
        --additional-config '{"reasonkv": {"method": "beaconkv", "budget": 1024}}'

Every other key of the entry is a knob of the method: the entry is resolved once, by the same
`resolve_method` as `make_cache` and the CLI, with the same one-line errors, and the resolved
value (`ResolvedMethod`) is what the adapter passes on. Methods that need a budget per layer
or per head, quantized storage or the two-tier cache are refused by name (`unsupported`): one
block table, shared by every layer and KV head of a request, holds one length for all of them.
A request may bring its own entry in `SamplingParams.extra_args` (`request_settings`).
"""

from __future__ import annotations

import json

from reasonkv.core.policy.allocators import UniformAllocator
from reasonkv.methods.knobs import KnobError
from reasonkv.methods.resolved import ResolvedMethod, resolve_method

CONFIG_KEY = "reasonkv"
"""The key of vLLM's `additional_config` that turns the adapter on."""


def unsupported(resolved: ResolvedMethod) -> str | None:
    """Why this method setting cannot run in vLLM (one sentence), or None when it can."""
    spec, method, fmt = resolved.spec, resolved.name, resolved.policy.kv_format
    if not spec.compresses:
        return f"{method!r} never evicts; serve without reasonkv (vLLM's own cache is the full cache)"
    if spec.allocator is not UniformAllocator:
        return (
            f"{method!r} gives each layer its own budget, and vLLM keeps one block table for every "
            "layer of a request: use a method with one budget for all layers (e.g. snapkv, rkv, beaconkv)"
        )
    if spec.head_allocator is not None:
        return (
            f"{method!r} moves the budget between KV heads, and vLLM's block table holds one length "
            "for every head of a layer: use its base method (e.g. snapkv instead of adakv-snapkv)"
        )
    if spec.scorer.state_grows:
        return (
            f"{method!r} is an ablation whose buffers grow with the sequence (they hold every past "
            "query): it is for trace replay, not serving; use beaconkv"
        )
    if fmt.quantized or fmt.low_budget > 0:
        return (
            "quantized storage (kv_bits < 16) and the two-tier cache (low_budget) are reasonkv's own "
            "storage, not vLLM's: for a quantized KV cache use vLLM's own, kv_cache_dtype='fp8'"
        )
    return None


def read_settings(additional_config: object) -> ResolvedMethod | None:
    """The adapter's settings from vLLM's `additional_config`, or None when it is off.
    Raises KnobError (a ValueError) in one line for anything it cannot run."""
    if not isinstance(additional_config, dict) or CONFIG_KEY not in additional_config:
        return None
    return _checked(additional_config[CONFIG_KEY], f'additional_config["{CONFIG_KEY}"]')


def request_settings(engine: ResolvedMethod | None, extra_args: object) -> ResolvedMethod | None:
    """One request's settings: the engine's, with the keys of `SamplingParams.extra_args
    ["reasonkv"]` over them (another method, budget or knob), or None for `"reasonkv": false`
    (this request is not compressed). The entry may also be that object as a JSON string (the
    OpenAI server's `vllm_xargs` takes flat values only). Raises KnobError in one line."""
    if not isinstance(extra_args, dict) or CONFIG_KEY not in extra_args:
        return engine
    entry = extra_args[CONFIG_KEY]
    where = f'SamplingParams.extra_args["{CONFIG_KEY}"]'
    if engine is None:
        raise KnobError(f"{where} needs the engine to run reasonkv: start it with additional_config "
                        f'{{"{CONFIG_KEY}": {{"method": ..., "budget": ...}}}}')  # fmt: skip
    if isinstance(entry, str):  # the OpenAI server's vllm_xargs holds flat values: the entry as JSON
        try:
            entry = json.loads(entry)
        except json.JSONDecodeError:
            raise KnobError(f"{where} is a string, so it must be JSON, got {entry!r}") from None
    if entry is False:
        return None
    if not isinstance(entry, dict):
        raise KnobError(f'{where} must be false or an object such as {{"budget": 256}}, got {entry!r}')
    if "method" in entry and entry["method"] != engine.name:
        merged = dict(entry)  # another method: the engine's knobs may not be its knobs
    else:
        merged = {"method": engine.name, "budget": engine.budget, **engine.knobs, **entry}
    merged.setdefault("budget", engine.budget)
    return _checked(merged, where)


def _checked(entry: object, where: str) -> ResolvedMethod:
    if not isinstance(entry, dict):
        raise KnobError(
            f'{where} must be an object such as {{"method": "snapkv", "budget": 512}}, got {entry!r}'
        )
    knobs = dict(entry)
    method = knobs.pop("method", None)
    if not isinstance(method, str):
        raise KnobError(f'{where} needs "method" (a method name), got {method!r}')
    resolved = resolve_method(method, knobs.pop("budget", None), knobs)
    why = unsupported(resolved)
    if why is not None:
        raise KnobError(f"reasonkv in vLLM: {why}")
    return resolved
