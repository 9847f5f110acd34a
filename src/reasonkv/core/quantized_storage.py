"""KV storage that holds the keys and values it keeps quantized (KVFormat.kv_bits 8, 4 or 2).

Slots keep their meaning from `KVStorage` (token_index, per-head lengths, holes, padding,
per-token state are the same); only where K/V live changes. Slots `[0, q_used)` are
quantized: keys per channel over groups of `group_size` slots, values per token over groups
of `value_group_size` channels (`group_size` unless set), codes packed into uint8 with a scale
and a zero per group. Slots from `q_used` on are the residual, in the model's dtype. `q_used`
is a multiple of `group_size` and never passes the shortest head, so every quantized slot
belongs to every head and a new token (written after its head's last slot) always lands in
the residual.

At the end of each forward (`settle`, after any compression) whole groups of the oldest
residual slots move to the quantized part while at least `residual` tokens of the shortest
head stay behind. Reads (`read_keys`, attention and the scorers) dequantize the quantized part
and append the residual: a transient full-precision copy of one layer, alive from `update`
to the end of the layer's step, and counted in the peak of the memory meter.

The residual holds `residual + group_size` slots (more only while heads are ragged, or for a
forward of more tokens): decoding adds one token a step and `settle` moves a group out as soon
as the shortest head has `residual + group_size`, so every slot is written by then (unless a
compaction comes first). It is that size from the first token on, so it is never reallocated
on the way there (it grew a group at a time before, to up to a group more).

Holes and padding only change `token_index`, so they need nothing here. A compaction keeps
what it can in codes: values (one token, one group) are gathered as they are stored, codes,
scale and zero; keys, whose groups run over tokens, are gathered from the step's view a few
groups at a time and quantized over their new groups, which costs at most half a new group's
scale per compaction a token survives. No full-precision copy of the kept tokens is made: a
compaction holds the old storage, the step's view and the new storage, and on top of the new
quantized part either a copy of the layer's value codes or one chunk of keys in full precision.
"""

from __future__ import annotations

import sys
from typing import NamedTuple

import torch

from reasonkv.core.kv_basis import QuantizationBasis
from reasonkv.core.memory_meter import MemoryMeter, tensor_bytes, tensor_bytes_16bit
from reasonkv.core.policy.base import EMPTY
from reasonkv.core.quantize import (
    KVFormat,
    QuantizedTensor,
    quantize,
    scale_channel_groups_,
    unpack_wide_,
    unpack_wide_dtype,
)
from reasonkv.core.quantized_slots import cat_slots, grown, head_slots, parts, put, rows_of, token_slots
from reasonkv.core.sinks import FullPrecisionSinks
from reasonkv.core.storage import KVStorage

KEY_CHUNK = 128
"""Kept keys a compaction gathers and quantizes at once (rounded to whole groups): the only
full-precision copy it makes, so a bounded part of a layer however many tokens it keeps."""

QUANT_CHUNK = 256
"""The quantized part grows by its own size, at most this many slots (rounded up to whole
groups) past what it needs, so a short run holds little spare room and a long one reallocates
rarely."""


class _ReadPlan(NamedTuple):
    """Views of the stored tensors that a read needs, made once per layout (no copies): the
    quantized part's codes and the scales and zeros shaped to broadcast over their groups."""

    q_used: int
    kq: QuantizedTensor
    vq: QuantizedTensor
    codes: tuple[torch.Tensor, torch.Tensor]
    k_scale: torch.Tensor
    k_zero: torch.Tensor
    v_scale_zero: tuple[torch.Tensor, torch.Tensor]


def _read_plan(
    kq: QuantizedTensor, vq: QuantizedTensor, q_used: int, k_res: torch.Tensor, v_res: torch.Tensor
) -> _ReadPlan | None:
    """The plan of `QuantizedKVStorage._dequantize` or, where it does not apply (keys and values
    of other head dims or dtypes, scales in another dtype, a big-endian machine), None."""
    dtypes = {kq.scale.dtype, kq.zero.dtype, vq.scale.dtype, vq.zero.dtype, k_res.dtype, v_res.dtype}
    same = len(dtypes) == 1 and k_res.shape[-1] == v_res.shape[-1]
    if not same or (kq.bits != 8 and sys.byteorder != "little"):
        return None
    m = q_used // kq.group_size
    return _ReadPlan(
        q_used,
        kq,
        vq,
        (kq.codes[:, :, :q_used], vq.codes[:, :, :q_used]),
        kq.scale[:, :, :m].unsqueeze(3),
        kq.zero[:, :, :m].unsqueeze(3),
        (vq.scale[:, :, :q_used, :, None], vq.zero[:, :, :q_used, :, None]),
    )


class QuantizedKVStorage(KVStorage):
    def __init__(
        self,
        batch: int,
        heads: int,
        device: torch.device,
        fmt: KVFormat,
        state_names: tuple[str, ...] = (),
        meter: MemoryMeter | None = None,
        basis: QuantizationBasis | None = None,
    ):
        self.fmt = fmt
        self.basis = QuantizationBasis(fmt, None) if basis is None else basis  # pre_rope, hadamard
        # pre_rope: each row's sequence index less RoPE position, the same for all its real
        # tokens (left padding shifts a row's positions by its pads), and whether it stayed so.
        self.position_offset: torch.Tensor | None = None  # [B]
        self._offsets_hold: torch.Tensor | None = None  # bool, on the device: checked when quantizing
        self.kq: QuantizedTensor | None = None  # slots [0, q_cap): codes [B, H, q_cap, D*bits/8]
        self.vq: QuantizedTensor | None = None
        self.k_res: torch.Tensor | None = None  # slots [q_used, q_used + r_cap), the model's dtype
        self.v_res: torch.Tensor | None = None
        self.q_used = 0  # quantized slots (a multiple of group_size)
        self.min_len = 0  # a lower bound of the shortest head's length (a python int)
        self._view: tuple[torch.Tensor, torch.Tensor] | None = None
        self._view_owned = False  # is the view a dequantized copy (metered), not residual slices?
        self._stale: tuple[torch.Tensor, torch.Tensor] | None = None  # a retired view, still held
        self._index_cap = 0
        self._plan: _ReadPlan | None = None  # views for reads, made once per layout (`_dequantize`)
        self.sinks: FullPrecisionSinks | None = None  # fp_sinks > 0, from the first quantization
        super().__init__(batch, heads, device, state_names, meter)

    # K/V are not held as such: `keys` and `values` read (dequantize) them.
    keys = property(lambda self: None if self.k_res is None else self.read_keys(), lambda self, v: None)
    values = property(lambda self: None if self.k_res is None else self.read_values(), lambda self, v: None)

    @property
    def capacity(self) -> int:
        return self._index_cap

    @property
    def allocated(self) -> bool:
        return self.k_res is not None

    @property
    def head_dim(self) -> int:
        return self.k_res.shape[-1]

    # ------------------------------------------------------------- reading
    def _read(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._view is None:
            n = self.used - self.q_used
            k_res, v_res = self.k_res[:, :, :n], self.v_res[:, :, :n]
            if self.q_used == 0:
                self._view = (k_res, v_res)
            else:
                keys, values = self._dequantize(k_res, v_res)
                self.meter.add(keys, values)
                q = self.q_used
                self.basis.restore_(keys[:, :, :q], values[:, :, :q], self._positions(0, q), self.meter)
                if self.sinks is not None:
                    self.sinks.restore(keys, values, self.token_index[:, :, : self.used])
                self._view = (keys, values)
                self._view_owned = True
        return self._view

    def _dequantize(self, k_res: torch.Tensor, v_res: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[dequantized part ; residual] keys and values, exactly `dequantize` of each part.

        Decoding pays this for every layer at every step, on tensors small enough (a few
        hundred tokens of a few heads) that each op's fixed cost counts as much as its work.
        So: keys and values share one fresh buffer [2B, H, used, D] (both halves are the
        step's view, metered as before: the same bytes as two tensors); their codes are
        widened in one copy, unpacked with whole-tensor shifts and masks (`unpack_wide_`),
        converted into the buffer in one copy, scaled there in place (the arithmetic of
        `dequantize`: one addcmul for the keys, `scale_channel_groups_` for the values), and the
        residuals copied in after them in one more."""
        plan = self._plan
        if plan is None or plan.q_used != self.q_used or plan.kq is not self.kq or plan.vq is not self.vq:
            plan = self._plan = _read_plan(self.kq, self.vq, self.q_used, self.k_res, self.v_res)
        if plan is None:
            dtype = self.k_res.dtype
            keys = torch.cat([head_slots(self.kq, self.q_used).dequantize(dtype), k_res], dim=2)
            values = torch.cat([head_slots(self.vq, self.q_used).dequantize(dtype), v_res], dim=2)
            return keys, values
        b, h, n, d = k_res.shape
        q, g, bits = self.q_used, self.fmt.group_size, self.kq.bits
        out = k_res.new_empty(2 * b, h, q + n, d)
        quantized = out[:, :, :q]
        if bits == 8:
            torch.cat(plan.codes, out=quantized)
        else:
            wide = torch.empty(2 * b, h, q, d * bits // 8, dtype=unpack_wide_dtype(bits), device=out.device)
            torch.cat(plan.codes, out=wide)
            quantized.copy_(unpack_wide_(wide, bits).view(2 * b, h, q, d))
        keys = quantized[:b].unflatten(2, (q // g, g))
        torch.addcmul(plan.k_zero, keys, plan.k_scale, out=keys)
        gv = self.fmt.value_group
        scale_channel_groups_(quantized[b:].unflatten(3, (d // gv, gv)), *plan.v_scale_zero)
        torch.cat([k_res, v_res], out=out[:, :, q:])
        return out[:b], out[b:]

    def _positions(self, lo: int, hi: int) -> torch.Tensor | None:
        """The RoPE positions [B, H, hi - lo] of slots [lo, hi) (pre_rope; else None): each
        slot's sequence index less its row's offset (0 for padding and holes)."""
        if not self.fmt.pre_rope:
            return None
        index = self.token_index[:, :, lo:hi]
        return torch.where(index == EMPTY, 0, index - self.position_offset[:, None, None])

    def record_positions(self, index: torch.Tensor, positions: torch.Tensor) -> None:
        """A forward's sequence indices [B, q] (-1: padding) and RoPE positions [B, q], before
        anything quantizes its tokens: pre_rope keeps each row's offset between the two (no
        state per slot) and notes whether this forward's real tokens kept it."""
        if not self.fmt.pre_rope:
            return
        offset = index - positions
        if self.position_offset is None:  # the first forward: its last token is real (left padding)
            self.position_offset = offset[:, -1].clone()
            self._offsets_hold = torch.ones((), dtype=torch.bool, device=offset.device)
        same = (offset == self.position_offset[:, None]) | (index < 0)
        self._offsets_hold &= same.all()

    def _check_positions(self) -> None:
        """Before keys are quantized before RoPE: their positions must follow the sequence."""
        if self.fmt.pre_rope and not bool(self._offsets_hold):
            raise ValueError(
                "pre_rope stores keys at each row's RoPE positions, which it takes to be the sequence "
                "indices less the row's left padding; this sequence's positions do not follow that "
                "(padding after real tokens, or position_ids of your own): use the cache without pre_rope"
            )

    def _capture_sinks(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Before the first token is quantized (by `settle` or by a compaction): keep the
        sinks from the full-precision `keys`/`values` of slots [0, used)."""
        assert self.q_used == 0, "the sinks must be captured before anything is quantized"
        index = self.token_index[:, :, : self.used]
        self.sinks = FullPrecisionSinks(self.fmt.fp_sinks, index, keys, values)
        self.meter.add(*self.sinks.tensors())

    def _key_codes(self, keys: torch.Tensor, lo: int) -> QuantizedTensor:
        """Keys of slots [lo, lo + n) (whole groups), as the model gives them, quantized as
        stored: in the storage's basis, per channel over their groups, the range taken over
        the real tokens that are not sinks."""
        hi = lo + keys.shape[2]
        real = self._key_range_slots(self.token_index[:, :, lo:hi])
        stored = self.basis.keys_in(keys, self._positions(lo, hi))
        return quantize(stored, self.fmt.kv_bits, self.fmt.group_size, 2, valid=real)

    def _value_codes(self, values: torch.Tensor) -> QuantizedTensor:
        """Values as the model gives them, quantized as stored (per token, in the storage's basis)."""
        return quantize(self.basis.values_in(values), self.fmt.kv_bits, self.fmt.value_group, 3)

    def _key_range_slots(self, index: torch.Tensor) -> torch.Tensor:
        """[B, H, n, 1] True for slots (sequence indices `index` [B, H, n]) that a key group's
        range is taken over: real tokens, sinks kept in full precision left out."""
        real = index != EMPTY
        if self.sinks is not None:
            real &= ~self.sinks.holds(index)
        return real[..., None]

    def read_keys(self) -> torch.Tensor:
        return self._read()[0]

    def read_values(self) -> torch.Tensor:
        return self._read()[1]

    def _drop_view(self) -> None:
        """End of a step (or a new write): the dequantized views go."""
        self._retire_view()
        if self._stale is not None:
            self.meter.remove(*self._stale)
            self._stale = None

    def _retire_view(self) -> None:
        """Reads stop using the view (the layout changes), but this step's attention and scorer
        still hold its tensors until the step ends: it stays in the meter until `_drop_view`."""
        if self._view is not None and self._view_owned:  # a view of the residual alone is no copy
            if self._stale is not None:
                self.meter.remove(*self._stale)
            self._stale = self._view
        self._view = None
        self._view_owned = False

    def token_bytes(self) -> float:
        d, g, gv = self.head_dim, self.fmt.group_size, self.fmt.value_group
        packed = 2 * d * self.fmt.kv_bits / 8
        esz = self.kq.scale.element_size()
        return packed + 2 * esz * (d / g + d / gv)  # keys: D scales per g tokens; values: D/gv per token

    def live_kv_bytes(self) -> float:
        """Real tokens in the quantized part at `token_bytes`, the rest at full precision."""
        quantized = int((self.token_index[:, :, : self.q_used] != EMPTY).sum())
        full = (
            self.k_res.shape[-1] * self.k_res.element_size()
            + self.v_res.shape[-1] * self.v_res.element_size()
        )
        sinks = sum(map(tensor_bytes, self._sink_tensors()))  # beside their codes
        return quantized * self.token_bytes() + (float(self.n_valid.sum()) - quantized) * full + sinks

    # ------------------------------------------------------------- writing
    def ensure_capacity(self, needed: int, capacity: int, like: torch.Tensor, v_like: torch.Tensor) -> None:
        self._add_state()
        if self.k_res is None:
            self.fmt.check_head_dim(like.shape[-1])
            self.fmt.check_head_dim(v_like.shape[-1])
            self._set(self._empty(like, 2), self._empty(v_like, 3), like[:, :, :0], v_like[:, :, :0])
        if needed > self._index_cap:
            self._grow_index(capacity)
            self._index_cap = capacity
        if needed - self.q_used > self.k_res.shape[2]:
            # What the heads hold until `settle` next moves a group out (what it would shrink
            # back to), or this forward's tokens if more: not a group of spare slots on top.
            self._resize_residual(max(needed - self.q_used, self._residual_room()))

    def _residual_room(self) -> int:
        """Residual slots that hold every head's tokens until the next `settle` moves a group:
        the shortest head reaches `residual + group_size` first, the others are longer by
        `used - min_len`. Always more than the residual holds after a settle or compaction."""
        return self.fmt.residual + self.fmt.group_size + max(self.used - self.min_len, 0)

    def _empty(self, like: torch.Tensor, dim: int) -> QuantizedTensor:
        return quantize(like[:, :, :0], self.fmt.kv_bits, self._group(dim), dim)

    def _group(self, dim: int) -> int:
        """Keys (dim 2): tokens per group; values (dim 3): channels per group."""
        return self.fmt.group_size if dim == 2 else self.fmt.value_group

    def _resize_residual(self, slots: int) -> None:
        n = self.used - self.q_used
        k_res = self.k_res.new_zeros(*self.k_res.shape[:2], slots, self.k_res.shape[-1])
        v_res = self.v_res.new_zeros(*self.v_res.shape[:2], slots, self.v_res.shape[-1])
        k_res[:, :, :n] = self.k_res[:, :, :n]
        v_res[:, :, :n] = self.v_res[:, :, :n]
        self._set(self.kq, self.vq, k_res, v_res)

    def _write_kv(
        self, key_states: torch.Tensor, value_states: torch.Tensor, slots: torch.Tensor | None
    ) -> None:
        self._drop_view()
        q = key_states.shape[2]
        if slots is None:
            start = self.used - self.q_used
            self.k_res[:, :, start : start + q] = key_states
            self.v_res[:, :, start : start + q] = value_states
        else:
            rel = slots - self.q_used
            self.k_res.scatter_(2, rel[..., None].expand(-1, -1, -1, key_states.shape[-1]), key_states)
            self.v_res.scatter_(2, rel[..., None].expand(-1, -1, -1, value_states.shape[-1]), value_states)
        self.min_len += q

    def steps_until_settle(self) -> int | None:
        """Tokens one forward can take before `settle` quantizes a group: token-by-token decoding
        settles once the residual holds `residual + group_size` tokens, and the tokens after that
        see the group quantized, so a chunked replay must end its forward there to read what
        decoding reads."""
        if self.k_res is None:
            return None
        return max(1, self.fmt.group_size + self.fmt.residual + self.q_used - self.min_len)

    def settle(self) -> None:
        """Move whole groups of the oldest residual slots to the quantized part, keeping at
        least `residual` tokens of the shortest head in full precision. The step's dequantized
        view is dropped: between steps only the stored form is held."""
        self._drop_view()
        g = self.fmt.group_size
        m = (self.min_len - self.q_used - self.fmt.residual) // g * g
        if m <= 0:
            return
        if self.fmt.fp_sinks and self.sinks is None:  # nothing is quantized yet: all in the residual
            self._capture_sinks(self.k_res, self.v_res)
        self._check_positions()
        k_new = self._key_codes(self.k_res[:, :, :m], self.q_used)
        v_new = self._value_codes(self.v_res[:, :, :m])
        kq, vq = self.kq, self.vq
        if self.q_used + m > kq.codes.shape[2]:
            more = min(QUANT_CHUNK, self.q_used + m)  # doubling, at most a chunk past what it needs
            room = self.q_used + m + -(-more // g) * g
            # Never past what the layer's slots can hold: a bounded cache grows to its size once.
            room = max(self.q_used + m, min(room, (self._index_cap - self.fmt.residual) // g * g))
            kq, vq = grown(kq, self.q_used, room), grown(vq, self.q_used, room)
        put(kq, k_new, self.q_used)
        put(vq, v_new, self.q_used)
        rest = self.used - self.q_used - m
        keep = self._residual_room()
        if self.k_res.shape[2] > keep:  # a prefill's residual shrinks back
            k_res = self.k_res.new_zeros(*self.k_res.shape[:2], keep, self.k_res.shape[-1])
            v_res = self.v_res.new_zeros(*self.v_res.shape[:2], keep, self.v_res.shape[-1])
        else:
            k_res, v_res = self.k_res, self.v_res
        k_tail, v_tail = self.k_res[:, :, m : m + rest].clone(), self.v_res[:, :, m : m + rest].clone()
        k_res[:, :, rest:] = 0
        v_res[:, :, rest:] = 0
        k_res[:, :, :rest] = k_tail
        v_res[:, :, :rest] = v_tail
        self.q_used += m
        self._set(kq, vq, k_res, v_res)

    # ---------------------------------------------------------- tokens leave
    def compact(self, slots: torch.Tensor, new_len: torch.Tensor, capacity: int) -> None:
        """Lay the kept slots out anew: values gathered as codes, keys re-quantized from the
        step's view a chunk of groups at a time (see the module doc)."""
        b, h, k = slots.shape
        safe = slots.clamp(max=max(self.used - 1, 0))
        present = slots < self.used
        keys, values = self.read_keys(), self.read_values()  # this step's view (already read)
        self._check_positions()
        if self.fmt.fp_sinks and self.sinks is None and self.used:  # it may quantize first
            self._capture_sinks(keys, values)
        values_q = self._values_by_slot(self.used)

        def gather(src: torch.Tensor, fill) -> torch.Tensor:
            out = src.new_full((b, h, capacity), fill)
            out[:, :, :k] = src.gather(2, safe)
            return out

        index = gather(self.token_index[:, :, : self.used], EMPTY)
        index[:, :, :k].masked_fill_(~present, EMPTY)
        self.token_state = {n: gather(t[:, :, : self.used], 0) for n, t in self.token_state.items()}
        self.token_index = index
        self._index_cap = capacity
        self.lengths = new_len.clone()
        self.n_valid = new_len.clone()
        self.used = k
        self.min_len = int(new_len.min()) if new_len.numel() else 0
        self.ragged = self.min_len != k or bool((new_len != k).any())
        self.holes = False
        self.padded = False
        self._retire_view()  # the step's attention still holds it: metered until `settle`

        g = self.fmt.group_size
        q_new = max(self.min_len - self.fmt.residual, 0) // g * g
        room = max(q_new, (capacity - self.fmt.residual) // g * g)
        kq = grown(self._empty(keys, 2), 0, room)
        vq = grown(self._empty(values, 3), 0, room)
        self.meter.add(*parts(kq), *parts(vq))  # the new storage is held from here on
        put(vq, token_slots(values_q, safe[:, :, :q_new]), 0)
        self.meter.remove(*parts(values_q))
        chunk = max(KEY_CHUNK // g, 1) * g
        for lo in range(0, q_new, chunk):
            hi = min(lo + chunk, q_new)
            part = keys.gather(2, safe[:, :, lo:hi, None].expand(-1, -1, -1, keys.shape[-1]))
            self.meter.add(part)
            put(kq, self._key_codes(part, lo), lo)
            self.meter.remove(part)
        n = k - q_new
        k_res = keys.new_zeros(b, h, self._residual_room(), keys.shape[-1])
        v_res = values.new_zeros(b, h, k_res.shape[2], values.shape[-1])
        self.meter.add(k_res, v_res)
        tail = safe[:, :, q_new:, None]
        k_res[:, :, :n] = keys.gather(2, tail.expand(-1, -1, -1, keys.shape[-1]))
        v_res[:, :, :n] = values.gather(2, tail.expand(-1, -1, -1, values.shape[-1]))
        self.q_used = q_new
        self._set(kq, vq, k_res, v_res, metered=True)
        if self.sinks is not None:
            self.sinks.moved()

    def _values_by_slot(self, used: int) -> QuantizedTensor:
        """Every slot's values [0, used) quantized per token: the stored codes of the quantized
        part, then the residual's, quantized now (a token's values are one group, so this is
        what `settle` would store: values are quantized per token). A copy, a few bytes a token;
        metered while it lives."""
        vq = head_slots(self.vq, self.q_used)
        out = cat_slots(vq, self._value_codes(self.v_res[:, :, : used - self.q_used]))
        self.meter.add(*parts(out))
        return out

    # ---------------------------------------------------------- bookkeeping
    def _set(
        self,
        kq: QuantizedTensor,
        vq: QuantizedTensor,
        k_res: torch.Tensor,
        v_res: torch.Tensor,
        metered: bool = False,
    ) -> None:
        """Swap in new K/V tensors; the meter sees the new ones before the old ones go
        (`metered`: the caller counted them as it built them)."""
        new = [kq.codes, kq.scale, kq.zero, vq.codes, vq.scale, vq.zero, k_res, v_res]
        held = self._kv_tensors()
        self._plan = None
        if not metered:
            self.meter.add(*[t for t in new if not any(t is x for x in held)])
        self.meter.remove(*[t for t in held if not any(t is x for x in new)])
        self.kq, self.vq, self.k_res, self.v_res = kq, vq, k_res, v_res

    def _kv_tensors(self) -> list[torch.Tensor]:
        if self.k_res is None:
            return []
        return [
            self.kq.codes,
            self.kq.scale,
            self.kq.zero,
            self.vq.codes,
            self.vq.scale,
            self.vq.zero,
            self.k_res,
            self.v_res,
        ]

    def select_rows(self, rows: torch.Tensor) -> None:
        if self.position_offset is not None:
            self.position_offset = self.position_offset.index_select(0, rows.to(self.position_offset.device))
        if self.sinks is not None:
            self.meter.remove(*self.sinks.tensors())
            self.sinks = self.sinks.select_rows(rows)
            self.meter.add(*self.sinks.tensors())
        if self.k_res is not None:
            self._drop_view()
            idx = rows.to(self.k_res.device)
            self._set(
                rows_of(self.kq, idx),
                rows_of(self.vq, idx),
                self.k_res.index_select(0, idx),
                self.v_res.index_select(0, idx),
            )
        for name in ("token_index", "lengths", "n_valid"):
            t = getattr(self, name)
            if t is not None:
                setattr(self, name, t.index_select(0, rows.to(t.device)))
        self.token_state = {n: t.index_select(0, rows.to(t.device)) for n, t in self.token_state.items()}

    def _sink_tensors(self) -> list[torch.Tensor]:
        return [] if self.sinks is None else self.sinks.tensors()

    def kv_bytes(self) -> int:
        return super().kv_bytes() + sum(map(tensor_bytes, self._sink_tensors()))

    def kv_bytes_16bit(self) -> int:
        return super().kv_bytes_16bit() + sum(map(tensor_bytes_16bit, self._sink_tensors()))

    def tensors(self) -> list[torch.Tensor]:
        return [*self._kv_tensors(), *self._sink_tensors(), *self.beside_tensors()]

    def beside_tensors(self) -> list[torch.Tensor]:
        extra = [t for t in (self.position_offset, self._offsets_hold) if t is not None]
        sinks = [] if self.sinks is None else [self.sinks.index]  # their K/V are metered as K/V
        return super().beside_tensors() + extra + sinks

    def release(self) -> None:
        self._drop_view()
        self.meter.remove(*self._kv_tensors())
        if self.sinks is not None:
            self.meter.remove(*self.sinks.tensors())
        self.sinks = None
        self.kq = self.vq = self.k_res = self.v_res = None
        self._plan = None
        self.position_offset = self._offsets_hold = None
        self.token_index = None
