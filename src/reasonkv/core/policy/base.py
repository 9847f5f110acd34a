"""What a scorer sees, and the attention arithmetic most scorers share.

Pure torch: nothing here imports transformers. Shapes use
B = batch, H = KV heads, G = query heads per KV head (GQA group), W = observed queries,
T = cache slots of the layer, D = head dim.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.nn.functional as F

EMPTY = torch.iinfo(torch.int64).max
"""`token_index` of a slot that holds no real token (padding or unused capacity)."""


@dataclass
class Observation:
    """Everything a scorer may read about one layer: the observed queries and the stored tokens."""

    queries: torch.Tensor
    """[B, H*G, W, D] the last W queries, post-RoPE, oldest first (in `on_step`'s step
    observation: all W = q queries of the current forward)."""
    query_index: torch.Tensor
    """[B, W] sequence index of each observed query; -1 where there is none (padding, short prompt)."""
    token_index: torch.Tensor | None
    """[B, H, T] sequence index of each cached key; EMPTY for slots without a real token. None
    (and `state` empty) in the step observation of a scorer that reads no stored token in
    `on_step` (`Scorer.step_reads_keys` false)."""
    scaling: float
    """The model's attention scale (1/sqrt(D) for the supported models)."""
    state: dict[str, torch.Tensor] = field(default_factory=dict)
    """Per-token scorer state, [B, H, T] each, gathered along with the keys at every eviction."""
    layer_idx: int = 0
    query_positions: torch.Tensor | None = None
    """[B, W] RoPE position of each observed query (differs from query_index under left padding)."""
    rope_inv_freq: torch.Tensor | None = None
    """[D/2] the model's RoPE inverse frequencies (scaling applied): rotate a query to any position."""
    rope_attention_scaling: float = 1.0
    prompt_end: torch.Tensor | None = None
    """[B] sequence index where generation starts (the prompt is everything before it)."""
    targets: torch.Tensor | None = None
    """[H] tokens each head keeps after a compression (the schedule's target for its budget)."""
    scorer_state: object | None = None
    """The scorer's own per-layer state (`Scorer.new_state`), or None."""

    @property
    def key_valid(self) -> torch.Tensor:
        return self.token_index != EMPTY

    @property
    def query_valid(self) -> torch.Tensor:
        return self.query_index >= 0

    @property
    def group_size(self) -> int:
        return self.queries.shape[1] // self.token_index.shape[1]


def grouped_logits(queries: torch.Tensor, keys: torch.Tensor, scaling: float) -> torch.Tensor:
    """[B, H*G, W, D] x [B, H, T, D] -> [B, H, G, W, T] fp32 logits, without repeating keys."""
    b, hq, w, d = queries.shape
    h = keys.shape[1]
    q = queries.reshape(b, h, hq // h, w, d).float()
    return torch.einsum("bhgwd,bhtd->bhgwt", q, keys.float()) * scaling


def newest_mask(obs: Observation, n: int) -> torch.Tensor:
    """[B, H, T] the `n` newest real tokens of each head."""
    valid = obs.key_valid
    rank_from_end = valid.flip(-1).cumsum(-1).flip(-1)  # 1 for the newest real token
    return valid & (rank_from_end <= n)


def keep_newest(scores: torch.Tensor, obs: Observation, n: int) -> torch.Tensor:
    """`scores` with the `n` newest real tokens of each head at the top (the largest finite
    value): what a scorer leaves out of its own scoring window must survive, even where the
    method protects fewer (n_recent < window)."""
    return scores.masked_fill(newest_mask(obs, n), torch.finfo(scores.dtype).max)


def candidate_mask(obs: Observation, exclude_last: int = 0) -> torch.Tensor:
    """[B, 1, 1, W, T] keys a window query may attend for scoring: real tokens, causally
    before it, and not among the `exclude_last` newest real tokens of the head (the recent
    window that is kept anyway: R-KV, SnapKV and RPC take the softmax over the rest only)."""
    valid = obs.key_valid
    if exclude_last > 0:
        valid = valid & ~newest_mask(obs, exclude_last)
    causal = obs.token_index[:, :, None, :] <= obs.query_index[:, None, :, None]  # [B,H,W,T]
    allowed = valid[:, :, None, :] & causal & obs.query_valid[:, None, :, None]
    return allowed[:, :, None]  # broadcast over the group


def masked_softmax(logits: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """Softmax over the last dim restricted to `allowed`; rows with nothing allowed are all zero."""
    logits = logits.masked_fill(~allowed, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    return torch.nan_to_num(probs, nan=0.0)


GqaReduce = Literal["max_logit", "mean", "max", "sum"]


def window_attention(
    obs: Observation,
    keys: torch.Tensor,
    *,
    exclude_last: int = 0,
    gqa: GqaReduce = "mean",
    softmax_over: Literal["candidates", "all"] = "candidates",
) -> torch.Tensor:
    """Attention probabilities of the observed queries, one row per KV head: [B, H, W, T].

    gqa: how the G query heads of a group become one row. "max_logit" takes the max of the
    logits before one softmax (R-KV); "mean"/"max"/"sum" reduce per-head probabilities.
    softmax_over: "candidates" normalises over the keys left after `exclude_last`; "all" over
    every key the query attends (the newest included, as kvpress's SnapKV does), then zeroes
    the excluded ones, so a query that looks mostly at the newest tokens weighs little.
    """
    logits = grouped_logits(obs.queries, keys, obs.scaling)
    allowed = candidate_mask(obs, exclude_last)
    norm = allowed if softmax_over == "candidates" or not exclude_last else candidate_mask(obs, 0)
    if gqa == "max_logit":
        return masked_softmax(logits.amax(dim=2), norm[:, :, 0]) * allowed[:, :, 0]
    probs = masked_softmax(logits, norm) * allowed
    return {"mean": probs.mean, "max": lambda dim: probs.amax(dim=dim), "sum": probs.sum}[gqa](dim=2)


def reduce_queries(probs: torch.Tensor, obs: Observation, how: Literal["mean", "sum", "max"]) -> torch.Tensor:
    """[B, H, W, T] -> [B, H, T] over the valid observed queries (padding queries never count)."""
    if how == "max":
        return probs.amax(dim=2)
    total = probs.sum(dim=2)
    if how == "sum":
        return total
    n = obs.query_valid.sum(-1).clamp(min=1).to(total.dtype)
    return total / n[:, None, None]


MAX_KERNEL = 1024
"""The widest pooling kernel a scorer accepts (pooling costs kernel x tokens per head)."""


def pool_tokens(scores: torch.Tensor, kernel: int, how: Literal["max", "avg", "none"]) -> torch.Tensor:
    """Smooth [B, H, T] scores along tokens (stride 1, same length), as SnapKV/R-KV/RPC do.

    Any kernel >= 1 works (1 = no pooling). An odd kernel is centred on each token; an even
    one covers kernel/2 tokens before it and kernel/2 - 1 after it."""
    if how == "none" or kernel <= 1:
        return scores
    b, h, t = scores.shape
    x = scores.reshape(b * h, 1, t)
    if how == "max":
        x = F.max_pool1d(x, kernel, stride=1, padding=kernel // 2)
    else:
        x = F.avg_pool1d(x, kernel, stride=1, padding=kernel // 2, count_include_pad=True)
    return x.reshape(b, h, -1)[..., :t]
