"""The attention sinks of a quantized cache, kept in full precision (KVFormat.fp_sinks).

The first real tokens of a sequence draw much of every head's attention, and their keys are
outliers: quantized with the tokens of their key group (keys are grouped per channel over
tokens), they widen that group's scale for all of them. So a quantized storage captures the
first `n` real tokens of each head in full precision before it quantizes anything, leaves them
out of their key group's range (their codes are clamped into it, never read), and writes
their exact keys and values over their rows of every dequantized view.

Sinks are found by sequence index, so they survive holes, padding and compaction; a compaction
keeps slots in order, so in the usual layout they hold the first `n` slots and the view is
patched with one copy.
"""

from __future__ import annotations

import torch

from reasonkv.core.policy.base import EMPTY
from reasonkv.core.policy.selection import protected_mask


class FullPrecisionSinks:
    def __init__(self, n: int, token_index: torch.Tensor, keys: torch.Tensor, values: torch.Tensor):
        """Capture the first `n` real tokens of each head from `token_index` [B, H, used] and
        the full-precision `keys`/`values` [B, H, >= used, D] of the same slots (before
        anything is quantized)."""
        used = token_index.shape[-1]
        first = protected_mask(token_index, n, 0)  # the eviction policies' sinks: same tokens
        k = min(n, used)
        order = torch.sort((~first).to(torch.uint8), dim=-1, stable=True).indices[..., :k]
        slot = torch.full((*token_index.shape[:2], n), used, dtype=torch.long, device=token_index.device)
        slot[..., :k] = torch.where(first.gather(2, order), order, used)  # `used`: fewer real tokens
        present = slot < used
        safe = slot.clamp(max=used - 1)
        self.index = torch.where(present, token_index.gather(2, safe), -1)  # [B, H, n], -1: none
        self.keys = keys.gather(2, safe[..., None].expand(-1, -1, -1, keys.shape[-1]))
        self.values = values.gather(2, safe[..., None].expand(-1, -1, -1, values.shape[-1]))
        self._in_front: bool | None = None

    def tensors(self) -> list[torch.Tensor]:
        """What they hold (for the memory meter): their keys and values."""
        return [self.keys, self.values]

    def holds(self, index: torch.Tensor) -> torch.Tensor:
        """[B, H, m] True where sequence indices `index` [B, H, m] are sinks."""
        return (index[..., None] == self.index[:, :, None, :]).any(-1) & (index != EMPTY)

    def moved(self) -> None:
        """The storage's slots changed (a compaction): find the sinks again at the next read."""
        self._in_front = None

    def restore(self, keys: torch.Tensor, values: torch.Tensor, token_index: torch.Tensor) -> None:
        """Write the sinks' keys and values over their rows of a view [B, H, used, D]."""
        n = self.index.shape[-1]
        if self._in_front is None:
            used = token_index.shape[-1]
            self._in_front = used >= n and bool((token_index[:, :, :n] == self.index).all())
        if self._in_front:  # the usual layout: the first n slots, in order
            keys[:, :, :n] = self.keys
            values[:, :, :n] = self.values
            return
        for j in range(n):  # each sink where it is now, if it is still held: a row per head
            at = (token_index == self.index[:, :, j, None]) & (token_index != EMPTY)
            b, h, slot = at.nonzero(as_tuple=True)
            keys[b, h, slot] = self.keys[b, h, j]
            values[b, h, slot] = self.values[b, h, j]

    def select_rows(self, rows: torch.Tensor) -> FullPrecisionSinks:
        """The same sinks for batch rows `rows` (beam search reorders, a finished row leaves)."""
        out = object.__new__(FullPrecisionSinks)
        idx = rows.to(self.index.device)
        out.index = self.index.index_select(0, idx)
        out.keys, out.values = self.keys.index_select(0, idx), self.values.index_select(0, idx)
        out._in_front = None
        return out
