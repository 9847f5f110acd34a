"""The low tier of a two-tier cache: where the tokens eviction drops go, at a few bits each.

With `KVFormat.low_budget > 0` every layer keeps, beside its main storage, a `LowTier`: up
to `low_budget` tokens per KV head that the scorer evicted from the main tier. A token
leaves the cache only when it falls out of this tier. The main tier keeps its budgets,
scorers and schedule; past layer 0 it keeps other tokens than without a low tier, since
attention now reads the low tier too and deeper layers see other inputs.

- **What comes in.** At each compression the layer hands over the evicted tokens' keys and
  values as the main tier holds them (full precision, or dequantized when kv_bits < 16),
  their sequence indices and the score each had at that compression. Every-step schedules
  hand over their one evicted token per head at the step they make it a hole, so no token
  goes unattended between its eviction and the next compaction.
- **How it is stored.** Keys and values alike per token, in groups of `low_group_size`
  channels, at `low_bits` (`core/quantize.quantize` along the channel axis). Per-channel key
  groups (what the main tier uses) would span tokens that arrive at different compressions
  and in different numbers per head; per token, a token's codes never change after it
  arrives, and merging is a gather of codes.
- **Who stays.** When a head holds more than `low_budget` tokens, the ones with the
  highest eviction score stay (ties: the newer token), the rest leave for good. Scores from
  different compressions are compared as they are. Slots are kept in positional order; a
  head holding fewer tokens than the longest head has EMPTY slots at its end.
- **Attention.** `attended` returns [main ; low] along the slot axis (the low tier
  dequantized, a transient copy counted by the memory meter until the layer's step ends),
  and `attention_mask` extends the main mask over the low slots: every low-tier token is
  older than any query, so it is attendable unless EMPTY. Scorers never see the low tier.
  A token is never promoted back.
"""

from __future__ import annotations

import torch

from reasonkv.core.memory_meter import MemoryMeter, tensor_bytes, tensor_bytes_16bit
from reasonkv.core.policy.base import EMPTY
from reasonkv.core.quantize import KVFormat, QuantizedTensor, dequantize, quantize


def rank(scores: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Slots [..., T] best first: real tokens (index not EMPTY) before EMPTY ones, then the
    higher score, then the newer token (the larger index)."""
    real = index != EMPTY
    order = index.masked_fill(~real, -1).argsort(dim=-1, descending=True, stable=True)
    s = scores.float().masked_fill(~real, float("-inf")).gather(-1, order)
    order = order.gather(-1, s.argsort(dim=-1, descending=True, stable=True))
    first = real.gather(-1, order).to(torch.int8)
    return order.gather(-1, first.argsort(dim=-1, descending=True, stable=True))


def evicted(index: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """The sequence indices [B, H, used] of the real tokens not in the kept `slots` [B, H, K]
    (sorted, padded with `used`), EMPTY elsewhere."""
    b, h, used = index.shape
    kept = torch.zeros(b, h, used + 1, dtype=torch.bool, device=index.device)
    kept.scatter_(2, slots, True)
    return index.masked_fill(kept[:, :, :used], EMPTY)


def _parts(q: QuantizedTensor) -> list[torch.Tensor]:
    return [q.codes, q.scale, q.zero]


def _qt(codes, scale, zero, like: QuantizedTensor) -> QuantizedTensor:
    return QuantizedTensor(codes, scale, zero, like.bits, like.group_size, like.dim)


def _gather(q: QuantizedTensor, slots: torch.Tensor) -> QuantizedTensor:
    """Slots [B, H, n] of a per-token quantized tensor (groups along the last axis)."""

    def pick(t: torch.Tensor) -> torch.Tensor:
        return t.gather(2, slots[..., None].expand(-1, -1, -1, t.shape[-1]))

    return _qt(pick(q.codes), pick(q.scale), pick(q.zero), q)


def _cat(a: QuantizedTensor, b: QuantizedTensor) -> QuantizedTensor:
    return _qt(*(torch.cat([x, y], 2) for x, y in zip(_parts(a), _parts(b), strict=True)), a)


class LowTier:
    def __init__(self, batch: int, heads: int, device: torch.device, fmt: KVFormat, meter: MemoryMeter):
        self.budget, self.bits, self.group = fmt.low_budget, fmt.low_bits, fmt.low_group
        self.meter = meter
        # codes [B, H, slots, D * bits / 8]; scale and zero [B, H, slots, D / group]
        self.kq: QuantizedTensor | None = None
        self.vq: QuantizedTensor | None = None
        self.token_index = torch.full((batch, heads, 0), EMPTY, dtype=torch.long, device=device)
        self.scores = torch.zeros(batch, heads, 0, device=device)  # each token's score at its eviction
        self._view: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def slots(self) -> int:
        """Slots per head (a python int: the longest head; no sync to read)."""
        return self.token_index.shape[2]

    @property
    def n_tokens(self) -> torch.Tensor:
        """[B, H] real tokens per head."""
        return (self.token_index != EMPTY).sum(-1)

    # ------------------------------------------------------------- tokens come in
    def feed(
        self,
        keys: torch.Tensor,
        values: torch.Tensor,
        index: torch.Tensor,
        scores: torch.Tensor,
        fill: int | None = None,
    ) -> None:
        """Take the tokens of `index` [B, H, E] (EMPTY: not one) with their keys and values
        [B, H, E, D] and eviction scores [B, H, E]; keep the best `budget` per head. `fill`
        (the most real tokens a head holds after the merge, read by the caller) trims the
        slots to it; None keeps all slots up to `budget` and reads nothing (every-step
        schedules feed one token a step: the slots grow by one until the budget)."""
        if index.shape[2] == 0:
            return
        if index.shape[2] > self.budget:
            # A newcomer that `budget` other newcomers outrank cannot stay: quantize only the
            # best `budget` (a compaction hands over every slot, most of them kept, i.e. EMPTY).
            pre = rank(scores, index)[..., : self.budget]

            def pick(t: torch.Tensor) -> torch.Tensor:
                return t.gather(2, pre[..., None].expand(-1, -1, -1, t.shape[-1]))

            keys, values, index, scores = (
                pick(keys),
                pick(values),
                index.gather(2, pre),
                scores.gather(2, pre),
            )
        new_k = quantize(keys, self.bits, self.group, 3)
        new_v = quantize(values, self.bits, self.group, 3)
        transient = [*_parts(new_k), *_parts(new_v)]  # counted until the merge is stored
        self.meter.add(*transient)
        if self.kq is not None:
            new_k, new_v = _cat(self.kq, new_k), _cat(self.vq, new_v)
            self.meter.add(*_parts(new_k), *_parts(new_v))
            transient += [*_parts(new_k), *_parts(new_v)]
        all_index = torch.cat([self.token_index, index], 2)
        all_scores = torch.cat([self.scores, scores.float()], 2)
        n = min(self.budget, all_index.shape[2], all_index.shape[2] if fill is None else fill)
        top = rank(all_scores, all_index)[..., :n]
        top = top.gather(-1, all_index.gather(-1, top).argsort(dim=-1, stable=True))  # positional order
        self._set(_gather(new_k, top), _gather(new_v, top))
        self.meter.remove(*transient)
        self.token_index, self.scores = all_index.gather(-1, top), all_scores.gather(-1, top)

    # ------------------------------------------------------------- attention
    def attended(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[main ; low] keys and values [B, H, used + slots, D] for this step's attention (the
        main tier's as given when the low tier is empty)."""
        self.drop_view()
        if self.slots == 0:
            return keys, values
        low_k, low_v = dequantize(self.kq, keys.dtype), dequantize(self.vq, values.dtype)
        self.meter.add(low_k, low_v)
        joined = torch.cat([keys, low_k], 2), torch.cat([values, low_v], 2)
        self.meter.add(*joined)
        self.meter.remove(low_k, low_v)
        self._view = joined
        return joined

    def drop_view(self) -> None:
        """The end of a step: the joined copy goes (its bytes leave the meter)."""
        if self._view is not None:
            self.meter.remove(*self._view)
            self._view = None

    def attention_mask(
        self, main: torch.Tensor | None, main_index: torch.Tensor, query_index: torch.Tensor
    ) -> torch.Tensor | None:
        """The mask [B, 1 or H, q, used + slots] over both tiers: the main tier's mask `main`
        (None: built from `main_index` [B, H, used]), then the low tier's real tokens."""
        if self.slots == 0:
            return main
        if main is None:
            main = main_index[:, :, None, :] <= query_index[:, None, :, None]
        b, h, _ = self.token_index.shape
        q = query_index.shape[-1]
        low = (self.token_index != EMPTY)[:, :, None, :].expand(-1, -1, q, -1)
        allowed = torch.cat([main.expand(b, h, q, -1), low], -1)
        return allowed | ~allowed.any(-1, keepdim=True)  # a padding query: see KVStorage.attention_mask

    # ------------------------------------------------------------- bookkeeping
    def _kv_tensors(self) -> list[torch.Tensor]:
        return [] if self.kq is None else [*_parts(self.kq), *_parts(self.vq)]

    def _set(self, kq: QuantizedTensor, vq: QuantizedTensor) -> None:
        self.meter.add(*_parts(kq), *_parts(vq))
        self.meter.remove(*self._kv_tensors())
        self.kq, self.vq = kq, vq

    def kv_bytes(self) -> int:
        """Bytes of the packed codes, scales and zeros held (no transient view)."""
        return sum(map(tensor_bytes, self._kv_tensors()))

    def kv_bytes_16bit(self) -> int:
        return sum(map(tensor_bytes_16bit, self._kv_tensors()))

    def token_bytes(self) -> float:
        """Bytes one stored token costs in K and V, per head."""
        if self.kq is None:
            return 0.0
        return sum(t.shape[-1] * t.element_size() for t in self._kv_tensors())

    def live_kv_bytes(self) -> float:
        return float(self.n_tokens.sum()) * self.token_bytes()

    def select_rows(self, rows: torch.Tensor) -> None:
        self.drop_view()
        rows = rows.to(self.token_index.device)
        if self.kq is not None:
            self._set(*(_qt(*(t.index_select(0, rows) for t in _parts(q)), q) for q in (self.kq, self.vq)))
        self.token_index = self.token_index.index_select(0, rows)
        self.scores = self.scores.index_select(0, rows)

    def tensors(self) -> list[torch.Tensor]:
        return [*self._kv_tensors(), *self.beside_tensors()]

    def beside_tensors(self) -> list[torch.Tensor]:
        """What the tier holds beside its codes: each slot's sequence index and score."""
        return [self.token_index, self.scores]

    def release(self) -> None:
        self.drop_view()
        self.meter.remove(*self._kv_tensors())
        self.kq = self.vq = None
        self.token_index = self.token_index[:, :, :0]
        self.scores = self.scores[:, :, :0]
