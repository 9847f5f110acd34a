"""vLLM's CPU attention backend, keeping each decoder layer's queries for reasonkv's step.

The plugin registers this class in place of CPU_ATTN (the CPU platform always asks for it).
Attention itself is vLLM's kernel, unchanged; after it, the layer's queries are copied into the
adapter's buffer for this step (`WorkerState.hold_queries`): one device copy, no host sync, no
policy. The policy runs after the model's forward, for every layer and request
(`WorkerState.after_forward`, called from the runner's `execute_model`).
"""

from __future__ import annotations

from vllm.model_executor.models.utils import extract_layer_index
from vllm.v1.attention.backend import AttentionType
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend, CPUAttentionBackendImpl

from reasonkv.serving.vllm import runtime


class ReasonKVAttentionImpl(CPUAttentionBackendImpl):
    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs):
        out = super().forward(layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs)
        state = runtime.active()
        if state is not None and attn_metadata is not None and self.attn_type == AttentionType.DECODER:
            n = attn_metadata.num_actual_tokens
            q = query[:n].view(n, self.num_heads, self.head_size)
            state.hold_queries(extract_layer_index(layer.layer_name), layer, q, kv_cache, self.scale)
        return out


class ReasonKVAttentionBackend(CPUAttentionBackend):
    @staticmethod
    def get_impl_cls() -> type[CPUAttentionBackendImpl]:
        return ReasonKVAttentionImpl
