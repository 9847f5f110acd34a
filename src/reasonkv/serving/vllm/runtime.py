"""The adapter's state in one vLLM process, built from the engine's own config on first use.

vLLM loads the plugin in every process (front end, engine core, worker); only a worker's model
runner holds request state. `worker_state(runner)` is None when the adapter is off, so every
hook passes straight through.
"""

from __future__ import annotations

import logging

import torch

from reasonkv.core.models import ModelShape
from reasonkv.methods.api import build_policy
from reasonkv.methods.knobs import KnobError
from reasonkv.serving.vllm.settings import CONFIG_KEY, read_settings, request_settings
from reasonkv.serving.vllm.worker_state import WorkerState

# A child of vLLM's logger: its lines come out in vLLM's format, beside vLLM's own.
logger = logging.getLogger("vllm.plugins.reasonkv")
_STATES: dict[int, WorkerState | None] = {}
_ACTIVE: list[WorkerState] = []


def worker_state(runner) -> WorkerState | None:
    """The adapter's state for this model runner (None: off)."""
    key = id(runner)
    if key not in _STATES:
        _STATES[key] = _build(runner.vllm_config)
        if _STATES[key] is not None:
            _ACTIVE[:] = [_STATES[key]]
    return _STATES[key]


def check_request(vllm_config, params) -> None:
    """A request's own settings (`SamplingParams.extra_args["reasonkv"]`), checked where vLLM
    checks its parameters (the front end): a bad one is refused as that request's error."""
    extra_args = getattr(params, "extra_args", None)
    if not isinstance(extra_args, dict) or CONFIG_KEY not in extra_args:
        return
    settings = request_settings(read_settings(vllm_config.additional_config), extra_args)
    if settings is not None:
        build_policy(settings.method, settings.budget, model_shape_of(vllm_config.model_config.hf_config),
                     None, 1.0, **settings.knobs)  # fmt: skip


def is_on(vllm_config) -> bool:
    """Whether the engine runs with the adapter (its settings were checked at start)."""
    extra = vllm_config.additional_config
    return isinstance(extra, dict) and CONFIG_KEY in extra


def active() -> WorkerState | None:
    """The state the attention backend feeds (one model runner a worker process)."""
    return _ACTIVE[0] if _ACTIVE else None


def model_shape_of(hf_config) -> ModelShape:
    text = getattr(hf_config, "text_config", None) or hf_config
    n_heads = text.num_attention_heads
    return ModelShape(
        name=getattr(text, "name_or_path", "") or text.model_type,
        model_type=text.model_type,
        n_layers=text.num_hidden_layers,
        n_heads=n_heads,
        n_kv_heads=getattr(text, "num_key_value_heads", None) or n_heads,
        head_dim=getattr(text, "head_dim", None) or text.hidden_size // n_heads,
    )


def rope_of(hf_config) -> tuple[torch.Tensor, float]:
    """The model's RoPE inverse frequencies and attention scaling, as transformers computes them."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    text = getattr(hf_config, "text_config", None) or hf_config
    params = getattr(text, "rope_parameters", None) or {}
    rope_type = params.get("rope_type", "default")
    if rope_type == "default":
        inv_freq, scaling = LlamaRotaryEmbedding.compute_default_rope_parameters(text)
    else:
        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](text, None)
    return inv_freq.float(), float(scaling)


def _build(vllm_config) -> WorkerState | None:
    settings = read_settings(vllm_config.additional_config)
    if settings is None:
        return None
    hf_config = vllm_config.model_config.hf_config
    return WorkerState(
        settings, model_shape_of(hf_config), rope_of(hf_config), vllm_config.cache_config.block_size
    )


def check_engine(vllm_config) -> None:
    """Refuse what the adapter cannot run (one line each) and turn off what it replaces."""
    settings = read_settings(vllm_config.additional_config)
    if settings is None:
        return
    parallel = vllm_config.parallel_config
    if parallel.tensor_parallel_size * parallel.pipeline_parallel_size > 1:
        raise KnobError(
            "reasonkv in vLLM runs one worker: set tensor_parallel_size=1, pipeline_parallel_size=1"
        )
    cache = vllm_config.cache_config
    if cache.cache_dtype != "auto":
        raise KnobError(
            f"reasonkv in vLLM reads the cache as the model's dtype: kv_cache_dtype {cache.cache_dtype!r}"
        )
    if vllm_config.speculative_config is not None:
        raise KnobError("reasonkv in vLLM does not run with speculative decoding")
    if cache.enable_prefix_caching:
        # Compacted blocks no longer hold the tokens their hashes name.
        logger.warning("reasonkv: prefix caching is turned off (compressed blocks cannot be shared)")
        cache.enable_prefix_caching = False
    build_policy(
        settings.method,
        settings.budget,
        model_shape_of(vllm_config.model_config.hf_config),
        None,
        1.0,
        **settings.knobs,
    )
