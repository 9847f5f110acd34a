"""The basis a quantized cache stores keys and values in (KVFormat.pre_rope, KVFormat.hadamard).

Quantization error depends on how evenly a group's values spread. Two changes of basis help,
and both are undone exactly (up to float rounding) when the codes are read:
- pre_rope: keys are quantized as the model projected them, before RoPE turned each channel
  pair by its position's angle. Storing them needs each token's RoPE position, and reading
  them rotates the dequantized keys back to it.
- hadamard: each token's channels are multiplied by the normalised Hadamard matrix H (keys and
  values), spreading outlier channels over all channels. H is orthonormal and symmetric, so
  multiplying by H again turns them back.

Only the quantized part is stored this way: the full-precision residual and the sinks stay as
the model gave them, so attention and the scorers always read keys and values in the model's
basis.
"""

from __future__ import annotations

import torch

from reasonkv.core.memory_meter import MemoryMeter
from reasonkv.core.policy.rope import apply_rope, unapply_rope
from reasonkv.core.quantize import KVFormat, hadamard_matrix

READ_CHUNK = 128
"""Slots turned back at once when reading: the one extra copy a read makes beside the view
(metered; the arithmetic's own temporaries, like the quantizer's, are not)."""


class QuantizationBasis:
    def __init__(self, fmt: KVFormat, rope_inv_freq: torch.Tensor | None, rope_scaling: float = 1.0):
        if fmt.pre_rope and rope_inv_freq is None:
            raise ValueError(
                "pre_rope quantizes keys before RoPE, so it needs the model's RoPE inverse frequencies; "
                "this model gives none (build the cache with reasonkv.make_cache(model, ...))"
            )
        self.pre_rope, self.hadamard = fmt.pre_rope, fmt.hadamard
        self.inv_freq, self.scaling = rope_inv_freq, rope_scaling

    @property
    def identity(self) -> bool:
        """Are keys and values stored as the model gives them?"""
        return not (self.pre_rope or self.hadamard)

    def _h(self, x: torch.Tensor) -> torch.Tensor:
        return hadamard_matrix(x.shape[-1], x.dtype, x.device)

    def keys_in(self, keys: torch.Tensor, positions: torch.Tensor | None) -> torch.Tensor:
        """Keys [B, H, n, D] as the model gives them -> the basis they are quantized in
        (positions [B, H, n]: each slot's RoPE position, for pre_rope)."""
        if self.pre_rope:
            keys = unapply_rope(keys, positions, self.inv_freq, self.scaling).to(keys.dtype)
        return keys @ self._h(keys) if self.hadamard else keys

    def values_in(self, values: torch.Tensor) -> torch.Tensor:
        return values @ self._h(values) if self.hadamard else values

    def restore_(
        self, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor | None, meter: MemoryMeter
    ) -> None:
        """Dequantized keys and values [B, H, n, D] in the stored basis -> the model's, in place,
        `READ_CHUNK` slots at a time."""
        if self.identity:
            return
        for lo in range(0, keys.shape[2], READ_CHUNK):
            k, v = keys[:, :, lo : lo + READ_CHUNK], values[:, :, lo : lo + READ_CHUNK]
            if self.hadamard:
                k_new, v_new = k @ self._h(k), v @ self._h(v)
            else:
                k_new, v_new = k, None
            if self.pre_rope:
                pos = positions[:, :, lo : lo + READ_CHUNK]
                k_new = apply_rope(k_new, pos, self.inv_freq, self.scaling)
            held = [t for t in (k_new, v_new) if t is not None]
            meter.add(*held)
            k.copy_(k_new)
            if v_new is not None:
                v.copy_(v_new)
            meter.remove(*held)
