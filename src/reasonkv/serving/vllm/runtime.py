"""The adapter's state in one vLLM process, built from the engine's own config on first use.

vLLM loads the plugin in every process (front end, engine core, worker); only a worker's model
runner holds request state. `worker_state(runner)` is None when the adapter is off, so every
hook passes straight through.
"""

from __future__ import annotations

import logging
import sys
from types import SimpleNamespace

import torch
from vllm.exceptions import VLLMValidationError

from reasonkv.core.models import ModelShape, model_shape
from reasonkv.methods.api import build_policy
from reasonkv.methods.knobs import KnobError
from reasonkv.serving.paged_rows import PENDING_QUERIES
from reasonkv.serving.prefix_sharing import PromptSharing, prompt_sharing
from reasonkv.serving.request_limits import check_fits
from reasonkv.serving.vllm.paged_kv import FP8_FORMATS
from reasonkv.serving.vllm.settings import CONFIG_KEY, read_settings, request_settings
from reasonkv.serving.vllm.worker_state import BuiltPolicies, WorkerState

# A child of vLLM's logger: its lines come out in vLLM's format, beside vLLM's own.
logger = logging.getLogger("vllm.plugins.reasonkv")
STATE_ATTR = "_reasonkv_state"
_ACTIVE: list[WorkerState] = []


def worker_state(runner) -> WorkerState | None:
    """The adapter's state for this model runner (None: off), kept on the runner itself."""
    if not hasattr(runner, STATE_ATTR):
        state = _build(runner.vllm_config)
        setattr(runner, STATE_ATTR, state)
        _ACTIVE[:] = [] if state is None else [state]
    return getattr(runner, STATE_ATTR)


def check_request(vllm_config, params) -> None:
    """A request's own settings (`SamplingParams.extra_args["reasonkv"]`), checked where vLLM
    checks its parameters (the front end): a bad one is refused as that request's error, a
    `VLLMValidationError` (the type vLLM's OpenAI server answers with HTTP 400 and its message)."""
    extra_args = getattr(params, "extra_args", None)
    if not isinstance(extra_args, dict) or CONFIG_KEY not in extra_args:
        return
    engine = read_settings(vllm_config.additional_config)
    if engine is None:  # off: vLLM ignores what it does not know, and so does the plugin
        return
    try:
        settings = request_settings(engine, extra_args)
        if settings is not None:
            _check_policy(settings, vllm_config)
    except KnobError as err:
        raise VLLMValidationError(f"reasonkv: {err}") from None


def is_on(vllm_config) -> bool:
    """Whether the engine runs with the adapter (its settings were checked at start)."""
    extra = vllm_config.additional_config
    return isinstance(extra, dict) and CONFIG_KEY in extra


def active() -> WorkerState | None:
    """The state the attention backend feeds: the latest model runner's in this process (a
    worker process holds one; the backend has no handle on its runner)."""
    return _ACTIVE[0] if _ACTIVE else None


def model_shape_of(hf_config) -> ModelShape:
    """The model's attention shape, with transformers' checks of what reasonkv can compress."""
    return model_shape(SimpleNamespace(config=getattr(hf_config, "text_config", None) or hf_config))


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
    """Refuse what the adapter cannot run (one line each).

    vLLM checks its config inside pydantic, which wraps the refusal in a ValidationError and its
    traceback; where nothing catches it (`vllm serve`), the process ends printing only
    `reasonkv: <reason>` (a caller in Python still gets the ValueError)."""
    try:
        _check_engine(vllm_config)
    except KnobError as err:
        logger.error("reasonkv: %s", err)
        _end_in_one_line(str(err))
        raise


def _end_in_one_line(reason: str) -> None:
    """If an uncaught exception carrying `reason` ends this process, print one line for it."""
    previous = sys.excepthook

    def hook(kind, value, traceback) -> None:
        if reason in str(value):
            print(f"reasonkv: {reason}", file=sys.stderr)
        else:
            previous(kind, value, traceback)

    sys.excepthook = hook


def _check_engine(vllm_config) -> None:
    settings = read_settings(vllm_config.additional_config)
    if settings is None:
        return
    parallel = vllm_config.parallel_config
    if parallel.tensor_parallel_size * parallel.pipeline_parallel_size > 1:
        raise KnobError(
            "reasonkv in vLLM runs one worker: set tensor_parallel_size=1, pipeline_parallel_size=1"
        )
    cache = vllm_config.cache_config
    if cache.cache_dtype != "auto" and cache.cache_dtype not in FP8_FORMATS:
        raise KnobError(
            f"reasonkv in vLLM reads kv_cache_dtype 'auto' or {', '.join(map(repr, FP8_FORMATS))}, "
            f"not {cache.cache_dtype!r}"
        )
    if vllm_config.speculative_config is not None:
        raise KnobError("reasonkv in vLLM does not run with speculative decoding")
    if getattr(vllm_config, "kv_transfer_config", None) is not None:
        # A connector saves and loads blocks by the tokens their hashes name (and saves each
        # layer before the adapter's step has compacted it).
        raise KnobError("reasonkv in vLLM does not run with a KV connector (kv_transfer_config)")
    if getattr(cache, "kv_offloading_size", None) is not None:
        # vLLM makes this a connector only after the platform's check has run (VllmConfig's
        # _post_init_kv_transfer_config), so the connector rule above would not see it.
        raise KnobError("reasonkv in vLLM does not run with KV offloading (kv_offloading_size)")
    if not vllm_config.model_config.enforce_eager:
        # Not run: torch.compile of the model around the backend's query copy, or CUDA graphs
        # (a graph replay would skip the copy and hand the step stale queries).
        raise KnobError(
            "reasonkv in vLLM runs the model eagerly: set enforce_eager=True (--enforce-eager); "
            "a compiled model or CUDA graphs have not been run with it"
        )
    if vllm_config.scheduler_config.async_scheduling:
        # The step after the forward needs this step's lengths, and a block it releases must
        # not be in use by a step already scheduled.
        raise KnobError("reasonkv in vLLM does not run with async scheduling (async_scheduling=False)")
    why = _unsupported_model(vllm_config.model_config)
    if why is not None:
        raise KnobError(f"reasonkv in vLLM serves decoder-only models with full attention only: {why}")
    _check_policy(settings, vllm_config)


def _check_policy(settings, vllm_config) -> None:
    """Build the policy once where the config is read, so its own checks run there, and check
    that the engine can hold what it makes a request hold (KnobError)."""
    shape = model_shape_of(vllm_config.model_config.hf_config)
    _, policy = build_policy(settings, shape)
    check_fits(settings, policy, shape, vllm_config.model_config.max_model_len, PENDING_QUERIES)


class PrefixRules:
    """The scheduler's side of prefix caching with the adapter on: how much of each compressed
    request's prompt the prefix cache may share (serving/prefix_sharing.py), decided once a
    request; None for a request that is not compressed (vLLM's own rules)."""

    def __init__(self, vllm_config) -> None:
        self.settings = read_settings(vllm_config.additional_config)
        self.block_size = vllm_config.cache_config.block_size
        self.policies = BuiltPolicies(model_shape_of(vllm_config.model_config.hf_config), (None, 1.0))
        self._decided: dict[str, PromptSharing | None] = {}

    def of(self, request) -> PromptSharing | None:
        rid = request.request_id
        if rid not in self._decided:
            extra_args = getattr(request.sampling_params, "extra_args", None)
            settings = request_settings(self.settings, extra_args)  # checked at the front end
            self._decided[rid] = (
                None
                if settings is None
                else prompt_sharing(self.policies(settings)[1], request.num_prompt_tokens, self.block_size)
            )
        return self._decided[rid]

    def forget(self, rid: str) -> None:
        self._decided.pop(rid, None)


def _unsupported_model(model) -> str | None:
    """Why the adapter cannot serve this model (one clause), or None."""
    if model.runner_type != "generate":
        return f"runner {model.runner_type!r}"
    if model.use_mla:
        return "it uses multi-head latent attention (another backend)"
    if model.is_hybrid or model.is_attention_free:
        return "it has layers of other kinds (one KV-cache group is needed)"
    if model.get_sliding_window() is not None:
        return "it has sliding-window layers (their window would count physical slots)"
    if model.uses_mrope or model.is_multimodal_model:
        return "it is multimodal (M-RoPE positions are not followed)"
    return None
