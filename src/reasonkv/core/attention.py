"""reasonkv's attention functions, registered with transformers' AttentionInterface.

Why a custom attention function: it is the one place that sees the queries (scorers need
them) and it lets the cache mask by its own per-slot record. After eviction, physical
slots no longer line up with the logical 2-D attention mask that `generate()` hands over,
so the stock masks would be wrong (a left pad could become attendable). Here:

- the registered *mask* function passes the 2-D padding mask through untouched;
- the attention function uses only its last q columns (are this step's tokens real?) and
  hands them to the cache layer, which builds the mask from its own `token_index`;
- after attention it hands the queries to the layer, which may compress.

Two backends: "reasonkv_sdpa" (torch SDPA) and "reasonkv_eager" (explicit softmax, can
return attention weights). Without a CompressedCache (no cache, or a DynamicCache) they
behave as plain causal attention with padding, so the model stays usable.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from reasonkv.core.hf_compat import handed_cache
from reasonkv.core.layer import another_sequence

SDPA, EAGER = "reasonkv_sdpa", "reasonkv_eager"
BACKENDS = {"sdpa": SDPA, "eager": EAGER}


def _padding_mask_passthrough(batch_size, q_length, kv_length, *args, attention_mask=None, **kwargs):
    """Mask function: hand the 2-D padding mask [B, seen + q] (bool) on as it is, or None.

    generate() hands over the mask of the whole sequence and feeds only the tokens past the
    cache's length, so a mask of any other length than seen + q means the cache holds another
    sequence (a new, shorter prompt would otherwise fail opaquely or run on the old context)."""
    if attention_mask is not None and attention_mask.dim() == 2 and attention_mask.shape[-1] != kv_length:
        held, given = int(kv_length) - q_length, attention_mask.shape[-1]
        raise another_sequence(
            held, f"the new input's attention mask covers {given} tokens, not {held} + {q_length}"
        )
    if attention_mask is None:
        return None
    if attention_mask.dim() != 2:  # refused by the attention function unless it masks nothing
        return None if bool(attention_mask.all()) else attention_mask
    # One host read per forward answers both questions: is there padding at all, and is there
    # any among this forward's tokens? The answer rides on a view of the mask, so the attention
    # of every layer knows it without reading the mask again.
    padded, new_padded = (~torch.stack([attention_mask.all(), attention_mask[:, -q_length:].all()])).tolist()
    if not padded:
        return None
    mask = attention_mask.view(attention_mask.shape)
    mask.reasonkv_new_padded = new_padded
    return mask


def _new_token_validity(attention_mask: torch.Tensor | None, q_len: int) -> torch.Tensor | None:
    """[B, q] True where this step's tokens are real (not padding), or None if all are."""
    if attention_mask is None:
        return None
    if attention_mask.dim() != 2:
        raise ValueError(
            "reasonkv attention takes a 2-D padding mask (batch, tokens); a prepared 4-D mask was given"
        )
    if getattr(attention_mask, "reasonkv_new_padded", True) is False:  # known from the mask function
        return None
    valid = attention_mask[:, -q_len:].bool()
    return None if bool(valid.all()) else valid


def _grouped_eager(query, key, value, mask, scaling, is_causal):
    """Eager attention without repeating K/V: [B, Hq, q, D] x [B, H, T, D]."""
    b, hq, q, d = query.shape
    h, t = key.shape[1], key.shape[2]
    g = hq // h
    qg = query.reshape(b, h, g, q, d)
    logits = torch.matmul(qg, key[:, :, None].transpose(-1, -2)) * scaling  # [B, H, G, q, T]
    if mask is not None:
        logits = logits.masked_fill(~mask[:, :, None], float("-inf"))
    elif is_causal:
        causal = torch.ones(q, t, dtype=torch.bool, device=query.device).tril(t - q)
        logits = logits.masked_fill(~causal, float("-inf"))
    weights = torch.softmax(logits, dim=-1, dtype=torch.float32).to(query.dtype)
    out = torch.matmul(weights, value[:, :, None])  # [B, H, G, q, D]
    return out.reshape(b, hq, q, -1), weights.reshape(b, hq, q, t)


def _sdpa(query, key, value, mask, scaling, is_causal):
    h, hq = key.shape[1], query.shape[1]
    if mask is not None and mask.shape[1] not in (1, hq):
        mask = mask.repeat_interleave(hq // h, dim=1)  # per-KV-head mask -> per query head
    out = F.scaled_dot_product_attention(
        query,
        key,
        value,
        attn_mask=mask,
        is_causal=is_causal and mask is None,
        scale=scaling,
        enable_gqa=hq != h,
    )
    return out, None


def _plain_mask(attention_mask, q_len: int, kv_len: int, device) -> torch.Tensor | None:
    """Causal + padding mask [B, 1, q, T] for attention without a CompressedCache."""
    causal = torch.ones(q_len, kv_len, dtype=torch.bool, device=device).tril(kv_len - q_len)
    if attention_mask is None:
        return None if q_len == 1 else causal[None, None]
    pad = attention_mask[:, -kv_len:].bool()
    allowed = causal[None, None] & pad[:, None, None, :]
    return allowed | ~allowed.any(-1, keepdim=True)


def _make_attention(kernel):
    def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        if scaling is None:
            scaling = query.shape[-1] ** -0.5
        q_len = query.shape[2]
        cache = kwargs.get("reasonkv_cache")
        if cache is None:
            cache = handed_cache(key)  # transformers < 5.20
        if cache is None:
            mask = _plain_mask(attention_mask, q_len, key.shape[2], query.device)
            out, weights = kernel(query, key, value, mask, scaling, is_causal=mask is None and q_len > 1)
            return out.transpose(1, 2).contiguous(), weights

        cache.check_module(module)
        if module.layer_idx == 0:
            cache.check_continues(q_len, kwargs.get("position_ids"), attention_mask is not None)
        layer = cache.layers[module.layer_idx]
        mask, causal = layer.before_attention(_new_token_validity(attention_mask, q_len))
        out, weights = kernel(query, key, value, mask, scaling, is_causal=causal)
        del key, value  # the step's view of the storage; compression may replace it
        layer.after_attention(query, kwargs.get("position_ids"), scaling)
        return out.transpose(1, 2).contiguous(), weights

    return attention


reasonkv_sdpa_attention = _make_attention(_sdpa)
reasonkv_eager_attention = _make_attention(_grouped_eager)


def register() -> None:
    """Register both backends and their mask function (idempotent)."""
    AttentionInterface.register(SDPA, reasonkv_sdpa_attention)
    AttentionInterface.register(EAGER, reasonkv_eager_attention)
    AttentionMaskInterface.register(SDPA, _padding_mask_passthrough)
    AttentionMaskInterface.register(EAGER, _padding_mask_passthrough)


register()
