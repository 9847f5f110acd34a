"""vLLM's CPU attention backend with reasonkv's step after each decoder layer's attention.

The plugin registers this class in place of CPU_ATTN (the CPU platform always asks for it).
Attention itself is vLLM's kernel, unchanged; after it, the layer's queries go to the
adapter (`WorkerState.after_attention`), which may compact the request's slots.
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
            index = extract_layer_index(layer.layer_name)
            state.after_attention(index, layer, q, kv_cache, attn_metadata.query_start_loc, self.scale)
        return out


class ReasonKVAttentionBackend(CPUAttentionBackend):
    @staticmethod
    def get_impl_cls() -> type[CPUAttentionBackendImpl]:
        return ReasonKVAttentionImpl
