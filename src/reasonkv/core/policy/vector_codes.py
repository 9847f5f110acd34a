"""Vectors as 8-bit codes: int8 per element and one scale per vector (symmetric, absmax / 127).

For query-like state kept beside the cache (BeaconKV's beacon buffers): a beacon is compared by
direction (cosine distance) and rotated before it scores, both of which a per-vector scale
leaves as they are, so the codes cost only the rounding of each element, |x - x̂| <= scale / 2.
Pure torch.
"""

from __future__ import annotations

import torch

LEVELS = 127


def encode_vectors(
    x: torch.Tensor, scale_dtype: torch.dtype | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] -> (codes [..., D] int8, scale [..., 1] in `scale_dtype`, x's by default). The
    scale is rounded to its dtype before the codes are taken against it, so |x - x̂| <= scale / 2
    holds for the scale as stored (up to its own rounding for the largest element, which clamps
    at 127). A zero vector codes as zeros with scale 0."""
    dtype = x.dtype if scale_dtype is None else scale_dtype
    scale = (x.abs().amax(-1, keepdim=True).float() / LEVELS).to(dtype).float()
    codes = torch.where(scale > 0, x.float() / scale.clamp(min=torch.finfo(torch.float32).tiny), 0.0)
    return codes.round().clamp(-LEVELS, LEVELS).to(torch.int8), scale.to(dtype)


def decode_vectors(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The vectors back, in fp32: codes [..., D] times scale [..., 1]."""
    return codes.float() * scale.float()
