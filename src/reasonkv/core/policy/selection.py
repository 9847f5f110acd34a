"""Shared token selection: protected tokens first, the rest by top-k of the score.

Every method goes through this one function, so the protection rules and the ordering
guarantee (kept slots stay in positional order) are the same everywhere.
"""

from __future__ import annotations

import torch

from reasonkv.core.policy.base import EMPTY


def protected_mask(
    token_index: torch.Tensor, n_sink: int, n_recent: int, protect_before: torch.Tensor | None = None
) -> torch.Tensor:
    """[B, H, T] True for tokens that must survive: the first `n_sink` real tokens of each
    row (padding never counts as a sink), the newest `n_recent`, and optionally every token
    whose sequence index is below `protect_before[b]` (the prompt, for RPC)."""
    valid = token_index != EMPTY
    rank = valid.cumsum(-1)  # 1-based rank among real tokens
    n_valid = rank[..., -1:]
    keep = valid & ((rank <= n_sink) | (rank > n_valid - n_recent))
    if protect_before is not None:
        keep |= valid & (token_index < protect_before[:, None, None])
    return keep


def select_tokens(
    scores: torch.Tensor,
    token_index: torch.Tensor,
    keep: torch.Tensor,
    protected: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Choose which slots survive.

    scores [B, H, T] (higher = keep), token_index [B, H, T], keep [B, H] tokens to keep per
    head, protected [B, H, T]. Returns (slots [B, H, K] sorted ascending, padded with T where a
    head keeps fewer than K = max(new_lengths)), and new_lengths [B, H].
    Padding/empty slots are never kept; protected slots always are: a head whose protected
    tokens outnumber `keep` (protect_prompt with a prompt longer than the budget) keeps those
    and nothing else, so the prompt is not cut from its front. Equal scores are broken in favour
    of the newer token.
    """
    valid = token_index != EMPTY
    n_valid = valid.sum(-1)
    new_len = torch.minimum(torch.maximum(keep.to(n_valid.dtype), (protected & valid).sum(-1)), n_valid)
    k = int(new_len.max()) if new_len.numel() else 0
    t = scores.shape[-1]
    # A scorer's own +inf (H2O's recent share) ranks just below protection's, never beside it.
    finite_max = torch.finfo(torch.float32).max
    s = (
        scores.float()
        .clamp(max=finite_max)
        .masked_fill(~valid, float("-inf"))
        .masked_fill(protected, float("inf"))
    )
    # Ties (max-pooling makes plateaus) go to the newer token, deterministically: a stable
    # sort over the reversed slot axis. topk's tie order is unspecified and would let float
    # noise or a different slot count (batch padding) change which token survives.
    order = torch.sort(s.flip(-1), dim=-1, descending=True, stable=True).indices[..., :k]
    top = t - 1 - order  # best first
    rank = torch.arange(k, device=scores.device)
    top = torch.where(rank < new_len[..., None], top, torch.full_like(top, t))
    return top.sort(dim=-1).values, new_len


def evict_one(
    scores: torch.Tensor, token_index: torch.Tensor, protected: torch.Tensor, evict: torch.Tensor
) -> torch.Tensor:
    """The slot [B, H, 1] of the one token each head in `evict` [B, H] gives up: its lowest-
    scoring unprotected real token, the oldest among equals. Heads not in `evict`, or with
    nothing unprotected to give, get slot T.

    What `select_tokens` drops when a head keeps all but one of its tokens (an every-step
    schedule's usual step), without sorting: argmin returns the first minimum, and slots are
    in positional order, so ties go against the older token exactly as there, and a scorer's
    own +inf is given up where nothing else is (protected tokens past `keep`), as there.
    """
    # A scorer's own +inf (H2O's recent share) ranks just below protection's, as in select_tokens.
    s = (
        scores.float()
        .clamp(max=torch.finfo(torch.float32).max)
        .masked_fill(protected | (token_index == EMPTY), float("inf"))
    )
    lowest, victim = s.min(-1, keepdim=True)
    return victim.masked_fill(~evict[..., None] | (lowest == float("inf")), scores.shape[-1])
