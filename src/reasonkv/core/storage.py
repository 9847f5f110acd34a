"""One layer's K/V storage: slots, their tokens, and how tokens leave.

Keys and values are `[B, H, capacity, D]`, with a per-slot `token_index` (the token's sequence
index, EMPTY for padding, holes and unused slots) and per-head `lengths`: head (b, h) owns
slots `[0, lengths[b, h])`, in positional order. Tokens leave in one of three ways: a hole
(the slot's index becomes EMPTY; storage stays put), or a compaction (the kept slots are
gathered into fresh, smaller tensors and the old ones are released). Per-token scorer state
(`token_state`) moves with the keys.
"""

from __future__ import annotations

import torch

from reasonkv.core.memory_meter import MemoryMeter, tensor_bytes, tensor_bytes_16bit
from reasonkv.core.policy.base import EMPTY


def gather_slots(kv: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """kv [H, T, D] at slots [H, K] -> [H, K, D], by one flat `index_select` (an expanded
    `gather` over the same rows is several times slower on CPU)."""
    h, t, d = kv.shape
    flat = (slots + torch.arange(h, device=slots.device)[:, None] * t).reshape(-1)
    return kv.reshape(h * t, d).index_select(0, flat).view(h, -1, d)


class KVStorage:
    def __init__(
        self,
        batch: int,
        heads: int,
        device: torch.device,
        state_names: tuple[str, ...] = (),
        meter: MemoryMeter | None = None,
    ):
        self.keys: torch.Tensor | None = None  # [B, H, capacity, D]
        self.values: torch.Tensor | None = None
        self.token_index: torch.Tensor | None = None  # [B, H, capacity]
        self.lengths = torch.zeros(batch, heads, dtype=torch.long, device=device)  # slots in use per head
        self.n_valid = torch.zeros_like(self.lengths)  # real tokens per head
        self.token_state: dict[str, torch.Tensor] = {}  # [B, H, capacity] each
        self.state_names = state_names
        self.device = device
        self.used = 0  # max over heads of lengths (a python int: no sync to slice)
        self.ragged = False  # do heads/rows use different numbers of slots?
        self.holes = False  # are there evicted-but-not-compacted slots (a per-head layout)?
        self.padded = False  # is there padding among the stored slots?
        self.meter = MemoryMeter() if meter is None else meter  # K/V bytes allocated, now and at most

    @property
    def capacity(self) -> int:
        return 0 if self.keys is None else self.keys.shape[2]

    @property
    def dense(self) -> bool:
        """Are all slots in [0, used) real tokens, in the same layout for every head?"""
        return not (self.ragged or self.holes or self.padded)

    @property
    def allocated(self) -> bool:
        return self.keys is not None

    @property
    def head_dim(self) -> int:
        return self.keys.shape[-1]

    def read_keys(self) -> torch.Tensor:
        """The stored keys [B, H, used, D], as attention and the scorers read them."""
        return self.keys[:, :, : self.used]

    def read_values(self) -> torch.Tensor:
        return self.values[:, :, : self.used]

    def settle(self) -> None:
        """End of a forward, after any compression: nothing to do for full-precision storage."""

    def record_positions(self, index: torch.Tensor, positions: torch.Tensor) -> None:
        """A forward's sequence indices and RoPE positions [B, q]: full-precision storage needs none."""

    def steps_until_settle(self) -> int | None:
        """Tokens one forward can take before `settle` would change what is stored (None: never)."""
        return None

    def token_bytes(self) -> float:
        """Bytes one stored token costs in K and V, per head."""
        return (
            self.keys.shape[-1] * self.keys.element_size()
            + self.values.shape[-1] * self.values.element_size()
        )

    def live_kv_bytes(self) -> float:
        """Bytes of the real tokens held (all rows and heads), at what each one costs stored."""
        return float(self.n_valid.sum()) * self.token_bytes()

    def ensure_capacity(self, needed: int, capacity: int, like: torch.Tensor, v_like: torch.Tensor) -> None:
        """Grow to `capacity` slots (copying what is stored) unless `needed` already fit."""
        self._add_state()
        if self.keys is not None and needed <= self.keys.shape[2]:
            return
        b, h = self.lengths.shape
        # Zeros, not empty: masked slots still enter the attention matmuls, and 0 x NaN from
        # uninitialised memory would poison real outputs.
        keys = like.new_zeros(b, h, capacity, like.shape[-1])
        values = v_like.new_zeros(b, h, capacity, v_like.shape[-1])
        if self.used:
            keys[:, :, : self.used] = self.keys[:, :, : self.used]
            values[:, :, : self.used] = self.values[:, :, : self.used]
        self._grow_index(capacity)
        self._replace_kv(keys, values)

    def _add_state(self) -> None:
        for name in self.state_names:
            if name not in self.token_state:
                self.token_state[name] = torch.zeros(*self.lengths.shape, self.capacity, device=self.device)

    def _grow_index(self, capacity: int) -> None:
        """token_index and the per-token state, grown to `capacity` slots."""
        b, h = self.lengths.shape
        index = torch.full((b, h, capacity), EMPTY, dtype=torch.long, device=self.device)
        if self.used:
            index[:, :, : self.used] = self.token_index[:, :, : self.used]
        for name, tensor in self.token_state.items():
            grown = tensor.new_zeros(b, h, capacity)
            grown[:, :, : self.used] = tensor[:, :, : self.used]
            self.token_state[name] = grown
        self.token_index = index

    def _write_kv(
        self, key_states: torch.Tensor, value_states: torch.Tensor, slots: torch.Tensor | None
    ) -> None:
        """Write this step's K/V at slots `used...` (slots None) or at `slots` [B, H, q]."""
        if slots is None:
            sl = slice(self.used, self.used + key_states.shape[2])
            self.keys[:, :, sl] = key_states
            self.values[:, :, sl] = value_states
        else:
            self.keys.scatter_(2, slots[..., None].expand(-1, -1, -1, key_states.shape[-1]), key_states)
            self.values.scatter_(2, slots[..., None].expand(-1, -1, -1, value_states.shape[-1]), value_states)

    def append(self, key_states: torch.Tensor, value_states: torch.Tensor, first_index: int) -> None:
        """Write q new tokens (sequence indices first_index...) after each head's last slot."""
        q = key_states.shape[2]
        new_index = torch.arange(first_index, first_index + q, device=self.device)
        if not self.ragged:
            self._write_kv(key_states, value_states, None)
            self.token_index[:, :, self.used : self.used + q] = new_index
        else:
            slots = self.lengths[..., None] + torch.arange(q, device=self.device)  # [B, H, q]
            self._write_kv(key_states, value_states, slots)
            self.token_index.scatter_(2, slots, new_index.expand_as(slots).contiguous())
        for tensor in self.token_state.values():  # new tokens start with zero accumulated state
            if not self.ragged:
                tensor[:, :, self.used : self.used + q] = 0
            else:
                tensor.scatter_(2, slots, 0.0)
        self.lengths += q
        self.n_valid += q
        self.used += q

    def mark_padding(self, new_valid: torch.Tensor, first_index: int) -> None:
        """Mark this step's padding tokens (new_valid [B, q] False, first sequence index
        `first_index`) as EMPTY, so they are never attended, scored or sinks."""
        q = new_valid.shape[1]
        index = self.token_index[:, :, : self.used]
        rel = index - first_index  # EMPTY stays huge
        in_step = (rel >= 0) & (rel < q)
        pad = in_step & ~new_valid[:, None, :].expand(-1, index.shape[1], -1).gather(2, rel.clamp(0, q - 1))
        index.masked_fill_(pad, EMPTY)
        self.n_valid -= (~new_valid).sum(-1, keepdim=True)
        self.padded = True

    def attention_mask(self, query_index: torch.Tensor) -> torch.Tensor | None:
        """Boolean mask [B, 1 or H, q, used] for queries with sequence indices [B, q], or None
        when every stored token may be attended (decode) or plain causal applies (fresh prefill)."""
        q = query_index.shape[-1]
        if self.dense and (q == 1 or q == self.used):
            return None
        index = self.token_index[:, :, : self.used]
        if not self.ragged and not self.holes:
            index = index[:, :1]  # heads share slot layout, so one mask row serves all
        allowed = index[:, :, None, :] <= query_index[:, None, :, None]
        # A padding query attends nothing; give it everything so no NaN leaks into its
        # (never attended) key/value at the next layer.
        return allowed | ~allowed.any(-1, keepdim=True)

    # ------------------------------------------------------------ tokens leave
    def evict_slot(self, victim: torch.Tensor) -> None:
        """Make slot victim[b, h, 0] of each head a hole (victim = used: none)."""
        self.token_index.scatter_(2, victim, EMPTY)  # slot `used` is spare capacity, EMPTY already
        self.n_valid = self.n_valid - (victim[..., 0] < self.used).long()
        self.holes = True

    def evict_in_place(self, slots: torch.Tensor, new_len: torch.Tensor) -> None:
        """Make every slot not in `slots` [B, H, K] a hole; storage and the other slots stay put."""
        b, h = self.lengths.shape
        kept = torch.zeros(b, h, self.used + 1, dtype=torch.bool, device=self.device)
        kept.scatter_(2, slots, True)  # padding entries (= used) land in the extra column
        self.token_index[:, :, : self.used].masked_fill_(~kept[:, :, : self.used], EMPTY)
        self.n_valid = new_len.clone()
        self.holes = True

    def compact(self, slots: torch.Tensor, new_len: torch.Tensor, capacity: int) -> None:
        """Gather the kept slots [B, H, K] (sorted, padded with `used`) into fresh storage of
        `capacity` slots; the old tensors are released."""
        b, h, k = slots.shape
        safe = slots.clamp(max=max(self.used - 1, 0))
        present = slots < self.used

        def gather(src: torch.Tensor, fill) -> torch.Tensor:
            out = src.new_full((b, h, capacity) + src.shape[3:], fill)  # finite filler, see ensure_capacity
            if src.dim() == 4 and src.is_contiguous():
                t, d = src.shape[2], src.shape[3]
                rows = gather_slots(src.view(b * h, t, d), safe.reshape(b * h, k))
                out[:, :, :k] = rows.view(b, h, k, d)
            else:
                idx = safe if src.dim() == 3 else safe[..., None].expand(-1, -1, -1, src.shape[-1])
                out[:, :, :k] = src[:, :, : self.used].gather(2, idx)
            return out

        keys = gather(self.keys, 0)  # whole tensors: the kept slots are all below `used`
        values = gather(self.values, 0)
        index = gather(self.token_index, EMPTY)
        index[:, :, :k].masked_fill_(~present, EMPTY)
        state = {n: gather(t, 0) for n, t in self.token_state.items()}
        self._replace_kv(keys, values)
        self.token_index, self.token_state = index, state
        self.lengths = new_len.clone()
        self.n_valid = new_len.clone()
        self.used = k
        self.ragged = bool((new_len != k).any())
        self.holes = False
        self.padded = False

    # ------------------------------------------------------------- bookkeeping
    def _replace_kv(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Swap in new K/V tensors: both sets are alive until the old ones are dropped."""
        self.meter.add(keys, values)
        old = self._kv_tensors()
        self.keys, self.values = keys, values
        self.meter.remove(*old)

    def select_rows(self, rows: torch.Tensor) -> None:
        if self.keys is not None:
            self._replace_kv(
                self.keys.index_select(0, rows.to(self.keys.device)),
                self.values.index_select(0, rows.to(self.values.device)),
            )
        for name in ("token_index", "lengths", "n_valid"):
            t = getattr(self, name)
            if t is not None:
                setattr(self, name, t.index_select(0, rows.to(t.device)))
        self.token_state = {n: t.index_select(0, rows.to(t.device)) for n, t in self.token_state.items()}

    def tensors(self) -> list[torch.Tensor]:
        return self._kv_tensors() + self.beside_tensors()

    def beside_tensors(self) -> list[torch.Tensor]:
        """What the storage holds beside K/V: each slot's sequence index, per-token state, and the
        per-head counts."""
        return self.slot_tensors() + [self.lengths, self.n_valid]

    def slot_tensors(self) -> list[torch.Tensor]:
        """What the storage holds a slot beside K/V: the slot's sequence index and per-token state."""
        ts = [self.token_index, *self.token_state.values()]
        return [t for t in ts if t is not None]

    def _kv_tensors(self) -> list[torch.Tensor]:
        return [] if self.keys is None else [self.keys, self.values]

    def kv_bytes(self) -> int:
        return sum(map(tensor_bytes, self._kv_tensors()))

    def kv_bytes_16bit(self) -> int:
        """kv_bytes with floating-point elements at 16 bits (see core/memory_meter)."""
        return sum(map(tensor_bytes_16bit, self._kv_tensors()))

    def release(self) -> None:
        """Drop the storage (a reset): its bytes leave the meter."""
        self.meter.remove(*self._kv_tensors())
        self.keys = self.values = self.token_index = None
