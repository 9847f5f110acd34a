"""What one sequence's K/V peak is while it decodes, at 16 bits and with quantized storage,
before anything runs: how `make_cache` tells a storage setting that can never quantize a
token, or that holds more than kv_bits=16 would.

Bytes are counted as the meter's `peak_kv_bytes_16bit` counts them (every float at 2 bytes,
codes as they are), for one batch row whose heads share their layer's budget, decoding long
enough to compress at least twice (the steady state). How many slots a layer allocates, as
it grows and as it compacts, is counted by running the layer itself (`LayerSlots.counted`,
`core/slot_count`); what those slots cost is `QuantizedKVStorage`'s format, below:

- At 16 bits a layer holds its `capacity` (`trigger + hole_slots` slots); a compaction makes
  new storage of `compacted` slots (`target + slack + hole_slots`) while the old is still held
  (the peak: every layer's storage and one new one).
- Quantized, a layer holds a quantized part of `(slots - residual)` rounded down to whole
  groups (a compaction makes it that big at once) and a full-precision residual buffer of
  `residual + group_size` slots. Each step reads one layer's dequantized copy of every slot
  it holds, and a compaction holds, beside every layer's storage and that copy, the new
  quantized part and the largest of: every slot's value codes, one chunk of keys in full
  precision, the new residual buffer. A read in another basis (pre_rope, hadamard) holds one
  chunk beside the copy. Sinks kept in full precision (fp_sinks) are held beside the codes.
- A head quantizes a group only once it holds `residual + group_size` slots; a layer whose
  heads never hold that many holds every token in full precision, in that buffer, beside a
  quantized part it never fills.

The prompt's forward peaks below these while the prompt is shorter than the trigger (the
residual then holds no more than the step's copy will). A longer prompt is held whole, in full
precision, until it is compressed, quantized or not: its length is not known here, so that
peak is left out, as are the low tier (the same at both widths) and left padding.
`tests/core/test_storage_pays.py` checks these numbers against the meter, byte for byte, over
methods, budgets and settings.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from reasonkv.core.kv_basis import READ_CHUNK
from reasonkv.core.layer import GROWTH_CHUNK
from reasonkv.core.quantize import KVFormat
from reasonkv.core.quantized_storage import KEY_CHUNK
from reasonkv.core.slot_count import count_allocations
from reasonkv.core.step import LayerPolicy

FLOAT_BYTES = 2
"""A float's bytes at serving precision, as `peak_kv_bytes_16bit` counts them."""


@dataclass(frozen=True)
class LayerSlots:
    """One layer's slots as its storage sees them: the schedule's arithmetic (see `BudgetPlan`)
    and the two sizes the layer allocates, counted by running it (`core/slot_count`)."""

    trigger: int  # the largest head's trigger
    target: int  # the smallest head's target
    hole_slots: int
    capacity: int
    """Slots `update` allocates once a head is on its way to the trigger (the most it holds)."""
    compacted: int
    """Slots a compaction allocates: the kept tokens, the slack until the next one, the holes."""

    @classmethod
    def counted(cls, policy: LayerPolicy, budgets: torch.Tensor) -> LayerSlots | None:
        """The layer of per-head `budgets` [H] under `policy`, its sizes those of a run of the
        layer itself from a one-token prompt through two compactions at least (K/V as the model
        computes them and heads that keep their budgets: what is counted is slots, the same
        for quantized storage). None for a layer that never compresses."""
        plan = policy.schedule.plan([int(b) for b in budgets.tolist()])
        if plan.triggers is None:
            return None
        plain = replace(policy, kv_format=None, head_allocator=None)
        cycle = max(plan.trigger_max - min(plan.targets), plan.hole_slots + 1)
        events = count_allocations(
            plain, budgets, 1, plan.trigger_max + plan.hole_slots + 3 * cycle + GROWTH_CHUNK
        )
        moves = [move for step in sorted(events) for move in events[step]]
        shrinks = [new for old, new in moves if new <= old]  # compactions; growth only grows
        if not shrinks:
            return None
        return cls(
            plan.trigger_max, min(plan.targets), plan.hole_slots, max(n for _, n in moves), shrinks[-1]
        )

    @property
    def most_slots(self) -> int:
        """The most slots a head holds after a step (real tokens and holes): where quantizing
        is decided. Below the trigger, or the layer would have compressed."""
        return self.trigger - 1 + self.hole_slots


def quantizes(layer: LayerSlots, fmt: KVFormat) -> bool:
    """Whether the layer's heads ever hold enough slots for a group to leave the residual."""
    return layer.most_slots >= fmt.residual + fmt.group_size


@dataclass(frozen=True)
class SlotBytes:
    """Bytes of one slot of one layer (every KV head), at 16 bits and as stored quantized."""

    heads: int
    head_dim: int
    fmt: KVFormat

    @property
    def full(self) -> int:
        """A slot's keys and values in full precision."""
        return 2 * self.heads * self.head_dim * FLOAT_BYTES

    @property
    def keys(self) -> int:
        return self.heads * self.head_dim * FLOAT_BYTES

    def quantized(self, slots: int) -> int:
        """`slots` quantized slots (a whole number of key groups): codes, scales and zeros."""
        codes = 2 * self.heads * slots * self.head_dim * self.fmt.kv_bits // 8
        key_scales = 2 * self.heads * (slots // self.fmt.group_size) * self.head_dim * FLOAT_BYTES
        return codes + key_scales + self.values(slots) - self.value_codes(slots)

    def value_codes(self, slots: int) -> int:
        return self.heads * slots * self.head_dim * self.fmt.kv_bits // 8

    def values(self, slots: int) -> int:
        """`slots` slots' value codes, scales and zeros (values are quantized per token)."""
        scales = 2 * self.heads * slots * (self.head_dim // self.fmt.value_group) * FLOAT_BYTES
        return self.value_codes(slots) + scales


def steady(layers: list[LayerSlots]) -> bool:
    """Whether the layers' storage keeps one size once they compress (a compaction allocates
    what `update` grows to): else storage grows a chunk at a time and is not predicted here."""
    return all(layer.compacted == layer.capacity for layer in layers)


def peak_16bit(layers: list[LayerSlots], slot: SlotBytes) -> int:
    """Every layer's storage, and the new storage of the largest compacting layer."""
    return sum(x.capacity for x in layers) * slot.full + max(x.compacted for x in layers) * slot.full


def peak_quantized(layers: list[LayerSlots], slot: SlotBytes) -> int:
    """Every layer's stored form, and at the costliest moment of one layer its transients: a
    compaction (the step's dequantized copy, the new quantized part and the largest of the
    value codes, a key chunk and the new residual), or a read in another basis (the copy and
    one chunk)."""
    fmt, g, r = slot.fmt, slot.fmt.group_size, slot.fmt.residual
    held, moments = 0, []
    for x in layers:
        room = max(0, (x.compacted - r) // g * g)
        new = slot.quantized(room)
        if not quantizes(x, fmt):  # all in the residual: the step reads it as it is, no copy
            held += new + (r + g) * slot.full
            moments.append(new + max(slot.values(x.capacity), (r + g) * slot.full))
            continue
        held += new + (r + g + fmt.fp_sinks) * slot.full
        view = x.capacity * slot.full
        kept = max(x.target - r, 0) // g * g
        chunk = min(max(KEY_CHUNK // g, 1) * g, kept) * slot.keys
        moments.append(view + new + max(slot.values(x.capacity), chunk, (r + g) * slot.full))
        if fmt.pre_rope or fmt.hadamard:
            read = min(READ_CHUNK, (x.most_slots - r) // g * g) * slot.keys * (2 if fmt.hadamard else 1)
            moments.append(view + read)
    return held + max(moments)
