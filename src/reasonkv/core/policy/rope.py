"""Rotary position embedding, undone and redone in pure torch (BeaconKV needs both).

The models store q·R(p)·s: the query rotated by the angles p·inv_freq (rotate-half layout,
as in Llama/Qwen) and multiplied by the RoPE attention scaling s (1 except for YaRN-like
types). `inv_freq` is the model's own (rope scaling already applied), so llama3, linear,
yarn... all reduce to the same two formulas. Angles are computed in fp32 like transformers
does, so a round trip reproduces its rotation to float rounding.
"""

from __future__ import annotations

import torch


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    freqs = positions[..., None].float() * inv_freq.to(device=positions.device, dtype=torch.float32)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def apply_rope(
    x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, scaling: float = 1.0
) -> torch.Tensor:
    """Rotate pre-RoPE vectors x [..., D] to `positions` (broadcastable to x.shape[:-1]); fp32."""
    cos, sin = _cos_sin(positions, inv_freq)
    x = x.float()
    return (x * cos + _rotate_half(x) * sin) * scaling


def unapply_rope(
    x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, scaling: float = 1.0
) -> torch.Tensor:
    """Recover pre-RoPE vectors from post-RoPE x [..., D] rotated at `positions`; fp32."""
    cos, sin = _cos_sin(positions, inv_freq)
    x = x.float()
    return (x * cos - _rotate_half(x) * sin) / scaling  # R(-p) = R(p) with sin negated


def rerotate(
    x: torch.Tensor,
    from_positions: torch.Tensor,
    to_positions: torch.Tensor,
    inv_freq: torch.Tensor,
    scaling: float = 1.0,
) -> torch.Tensor:
    """Move post-RoPE vectors from one position to another (what a query would be at `to`)."""
    pre = unapply_rope(x, from_positions, inv_freq, scaling)
    return apply_rope(pre, to_positions, inv_freq, scaling)
