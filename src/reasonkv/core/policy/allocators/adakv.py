"""AdaKV head allocation (Feng et al., 2024, arXiv 2407.11550): a layer's heads share one pool.

At every compression of a layer, per batch row, with the layer total L (Σ of the head
budgets) and p_h the protected tokens of head h (sinks + recent window, kept anyway):
1. pool = L − Σ p_h; the global top-`pool` scores over all heads' non-protected real tokens
   land n_h in head h (scores must be comparable across heads: SnapKV's window mean is);
2. floor: share_h = n_h·(1 − α) + α·pool/H, so every head keeps at least α of a fair share;
3. head h keeps p_h + share_h, rounded by largest remainder so the row sums to L exactly;
   a head never keeps more than it holds: the excess goes to the heads that have room.
Heads then have really different lengths: the cache stores them ragged.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from reasonkv.core.policy.contract import HeadAllocator, PolicyState, SplitRequest
from reasonkv.core.policy.knob import tokens, unit
from reasonkv.core.policy.rounding import fill_to_caps, largest_remainder
from reasonkv.core.policy.selection import protected_mask


def _fix_integer_sum(
    out: torch.Tensor, total: torch.Tensor, cap: torch.Tensor, pref: torch.Tensor
) -> torch.Tensor:
    """Move single units until each row sums to `total` [B] with 0 <= out <= cap
    (additions to the heads with the largest `pref` among those with room)."""
    out = torch.minimum(out, cap).clamp(min=0)
    for _ in range(int((total - out.sum(-1)).abs().max()) if out.numel() else 0):
        diff = total - out.sum(-1)
        if not bool((diff != 0).any()):
            break
        grow = torch.where(out < cap, pref, float("-inf")).argmax(-1, keepdim=True)
        shrink = torch.where(out > 0, -pref, float("-inf")).argmax(-1, keepdim=True)
        out = out.scatter_add(-1, grow, (diff > 0).long()[:, None])
        out = out.scatter_add(-1, shrink, -(diff < 0).long()[:, None])
    return out


@dataclass
class AdaKVHeadAllocator(HeadAllocator):
    """A layer's heads share one pool, filled by the global top scores (see the module doc).

    n_sink / n_recent / protect_prompt are the method's protection knobs (make_cache passes the
    same values the cache uses), so the allocator knows what each head keeps regardless.
    """

    floor_alpha: float = unit(0.2)
    n_sink: int = tokens(0, minimum=0)
    n_recent: int = tokens(8, minimum=0)
    protect_prompt: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.protect_prompt:
            raise ValueError(
                "the AdaKV head split does not support protect_prompt (it cannot see the prompt end)"
            )

    def split(self, request: SplitRequest, state: PolicyState | None = None) -> torch.Tensor:
        obs, scores = request.obs, request.scores
        b, h, t = scores.shape
        valid = obs.key_valid
        protected = protected_mask(obs.token_index, self.n_sink, self.n_recent)
        n_protected = protected.sum(-1)  # [B, H]
        candidates = valid & ~protected
        cap = candidates.sum(-1)  # what each head can give beyond its protected tokens
        total = request.layer_total.long().to(scores.device)
        pool = torch.minimum((total - n_protected.sum(-1)).clamp(min=0), cap.sum(-1))  # [B]

        # 1. global top-`pool` over the row's heads (ties: lower head, older slot; only counts matter)
        flat = scores.float().masked_fill(~candidates, float("-inf")).reshape(b, h * t)
        order = torch.sort(flat, dim=-1, descending=True, stable=True).indices
        chosen = torch.arange(h * t, device=scores.device)[None, :] < pool[:, None]
        n_h = torch.zeros(b, h, dtype=torch.long, device=scores.device)
        n_h.scatter_add_(1, order // t, chosen.long())

        # 2. floor, then 3. exact integers within the caps
        share = n_h.double() * (1 - self.floor_alpha) + self.floor_alpha * pool.double()[:, None] / h
        share = fill_to_caps(share, cap, tolerance=1e-9)
        out = _fix_integer_sum(largest_remainder(share, pool), pool, cap, share)
        return n_protected + out
