"""Operations on the slot axis (axis 2) of a quantized K or V tensor [B, H, slots, ...].

Keys (`dim` 2) share a scale and a zero among `group_size` slots, so their scales index
groups of slots; values (`dim` 3) have one scale per slot and channel group. These helpers
cut, grow, write, gather and join `QuantizedTensor`s along that axis without re-quantizing.
"""

from __future__ import annotations

import torch

from reasonkv.core.quantize import QuantizedTensor


def head_slots(q: QuantizedTensor, slots: int) -> QuantizedTensor:
    """The first `slots` slots (axis 2) of a quantized K or V tensor."""
    per = slots // q.group_size if q.dim == 2 else slots
    return QuantizedTensor(
        q.codes[:, :, :slots], q.scale[:, :, :per], q.zero[:, :, :per], q.bits, q.group_size, q.dim
    )


def grown(q: QuantizedTensor, used: int, slots: int) -> QuantizedTensor:
    """A copy of `q` with room for `slots` slots, its first `used` slots copied."""

    def grow(t: torch.Tensor, n_used: int, n: int) -> torch.Tensor:
        out = t.new_zeros(t.shape[0], t.shape[1], n, *t.shape[3:])
        out[:, :, :n_used] = t[:, :, :n_used]
        return out

    g = q.group_size if q.dim == 2 else 1
    return QuantizedTensor(
        grow(q.codes, used, slots),
        grow(q.scale, used // g, slots // g),
        grow(q.zero, used // g, slots // g),
        q.bits,
        q.group_size,
        q.dim,
    )


def put(dst: QuantizedTensor, src: QuantizedTensor, start: int) -> None:
    """Write `src` into `dst` from slot `start` (a group boundary)."""
    n = src.codes.shape[2]
    dst.codes[:, :, start : start + n] = src.codes
    g = dst.group_size if dst.dim == 2 else 1
    dst.scale[:, :, start // g : (start + n) // g] = src.scale
    dst.zero[:, :, start // g : (start + n) // g] = src.zero


def token_slots(q: QuantizedTensor, slots: torch.Tensor) -> QuantizedTensor:
    """Slots `slots` [B, H, k] (axis 2) of a per-token quantized tensor (values): codes, scales
    and zeros as they are, nothing re-quantized."""

    def pick(t: torch.Tensor) -> torch.Tensor:
        return t.gather(2, slots[..., None].expand(-1, -1, -1, t.shape[-1]))

    return QuantizedTensor(pick(q.codes), pick(q.scale), pick(q.zero), q.bits, q.group_size, q.dim)


def parts(q: QuantizedTensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return q.codes, q.scale, q.zero


def cat_slots(a: QuantizedTensor, b: QuantizedTensor) -> QuantizedTensor:
    """Per-token quantized tensors `a` then `b` along the slot axis."""
    return QuantizedTensor(
        *(torch.cat([x, y], 2) for x, y in ((a.codes, b.codes), (a.scale, b.scale), (a.zero, b.zero))),
        a.bits,
        a.group_size,
        a.dim,
    )


def rows_of(q: QuantizedTensor, rows: torch.Tensor) -> QuantizedTensor:
    """Batch rows `rows` of `q` (axis 0)."""
    pick = [t.index_select(0, rows.to(t.device)) for t in (q.codes, q.scale, q.zero)]
    return QuantizedTensor(*pick, q.bits, q.group_size, q.dim)
