"""CompressedCache: a transformers Cache that really evicts tokens during decoding.

A thin container: one `CompressedLayer` per model layer (each owns its storage, its query
window and its decode step), the method's policies, the record of compressions, and what
users ask of a cache as a whole (memory, the logical length).

Logical vs physical: `get_seq_length()` is the number of tokens seen (RoPE positions and the
2-D attention mask of `generate()` are logical); `memory()` reports what is stored. Keys are
stored post-RoPE and never re-rotated.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache

from reasonkv.core.hf_compat import NEW_CACHE_API, hand_over
from reasonkv.core.layer import GROWTH_CHUNK, CompressedLayer, another_sequence
from reasonkv.core.memory_meter import MemoryMeter, held_bytes
from reasonkv.core.step import LayerPolicy
from reasonkv.core.timing import NO_TIMER, StepTimer

__all__ = [
    "GROWTH_CHUNK",
    "CompressedCache",
    "CompressionEvent",
    "LayerPolicy",
    "StepTimer",
    "default_scaling",
]


@dataclass
class CompressionEvent:
    """One compression of one layer, kept for plots (head budgets over decode steps)."""

    layer: int
    seen: int
    lengths: torch.Tensor  # [B, H] live tokens per head after the compression
    rows: torch.Tensor | None = None  # [B] bool: the batch rows that compressed


class ScorerStates(list):
    """Every layer's scorer state, one list per cache. A list subclass, so that states which
    batch work across layers (BeaconKV) can refer to it weakly and make no reference cycle."""


RECENT_EVENTS = 256
"""Events a cache keeps by default: the most recent ones (per-layer, per-row counts are always
kept whole, in the layers). Every-step methods compress every layer at every token, so a record
of all events would grow with the sequence; `keep_all_events` opts in to it."""

EVENT_OVERHEAD_BYTES = 1200
"""Host memory one event costs beyond its tensors' data (a dataclass and two small CPU tensors:
about 1.2 KB of RSS each, measured), so `memory()` can count what the record holds."""


class EventLog:
    """The record of compressions, shared by a cache and its layers (the layers write to it;
    it refers to neither, so dropping a cache frees its storage at once). Keeps the last
    `RECENT_EVENTS` events, or every event with `keep_all`."""

    def __init__(self, recent: int = RECENT_EVENTS) -> None:
        self.enabled = True
        self._events: deque[CompressionEvent] | list[CompressionEvent] = deque(maxlen=recent)
        self._recent = recent
        self._data_bytes = 0  # tensor data of the events held

    @property
    def keep_all(self) -> bool:
        return isinstance(self._events, list)

    @keep_all.setter
    def keep_all(self, keep: bool) -> None:
        events = list(self._events)
        self._events = events if keep else deque(events, maxlen=self._recent)
        self._data_bytes = sum(_event_data_bytes(e) for e in self._events)

    @property
    def events(self) -> list[CompressionEvent]:
        return list(self._events)

    @events.setter
    def events(self, events: list[CompressionEvent]) -> None:
        self._events = list(events) if self.keep_all else deque(events, maxlen=self._recent)
        self._data_bytes = sum(_event_data_bytes(e) for e in self._events)

    def add(self, layer_idx: int, seen: int, lengths: torch.Tensor, rows: torch.Tensor) -> None:
        if not self.enabled:
            return
        # One copy to the host for both (each copy waits for the device); on CPU .cpu() is the
        # live tensor, which later steps change in place, hence the clone.
        both = torch.cat([lengths, rows[:, None].to(lengths.dtype)], dim=1).cpu()
        event = CompressionEvent(layer_idx, seen, both[:, :-1].clone(), both[:, -1].bool())
        if not self.keep_all and len(self._events) == self._recent:
            self._data_bytes -= _event_data_bytes(self._events[0])
        self._events.append(event)
        self._data_bytes += _event_data_bytes(event)

    def clear(self) -> None:
        self._events.clear()
        self._data_bytes = 0

    def nbytes(self) -> int:
        """Host memory the record holds (an estimate: the tensors' data plus a measured overhead)."""
        return self._data_bytes + EVENT_OVERHEAD_BYTES * len(self._events)


def _event_data_bytes(event: CompressionEvent) -> int:
    tensors = [event.lengths] + ([] if event.rows is None else [event.rows])
    return sum(t.numel() * t.element_size() for t in tensors)


FED_TAIL = 16
"""Token ids kept per row to recognise the sequence a cache holds (check_input_ids)."""


class CompressedCache(Cache):
    """A `transformers.Cache` whose layers evict tokens by a scorer, a schedule and budgets.

    Build it with `reasonkv.make_cache(model, method=..., budget=...)`, which also installs
    reasonkv's attention function on the model (it drives each layer's step; without it the
    cache refuses to run).
    """

    def __init__(
        self,
        budgets: torch.Tensor,
        policy: LayerPolicy,
        *,
        method: str = "custom",
        attention_modules: list[torch.nn.Module] | None = None,
        scaling: float | None = None,
    ):
        if budgets.dim() != 2:
            raise ValueError(f"budgets must be [layers, kv_heads], got shape {tuple(budgets.shape)}")
        scorer_states = ScorerStates([None] * budgets.shape[0])
        self.kv_meter = MemoryMeter()  # K/V bytes of all layers: now, and the most at once
        layers = [
            CompressedLayer(i, budgets[i], policy, scorer_states, self.kv_meter)
            for i in range(budgets.shape[0])
        ]
        super().__init__(layers=layers)
        self.policy = policy
        self.method = method
        self.budgets = budgets.clone()
        self.scaling = scaling
        self._module_ids = [id(m) for m in attention_modules] if attention_modules else None
        self.event_log = EventLog()
        self.timer = NO_TIMER
        self._user_defined = False
        self._new_call = False  # a generate() call began: check that it continues this sequence
        self._ids_call = False  # the same, for the token ids check (see check_input_ids)
        self._fed_tail: torch.Tensor | None = None  # the last FED_TAIL token ids of each row fed
        self._fed_end = 0  # the sequence length they end at
        for layer in layers:
            layer.report = self.event_log.add
        self._count_own()

    def _count_own(self) -> None:
        """What the cache itself holds beside its layers (budgets, the fed token ids), for the meter."""
        own = [self.budgets] + ([] if self._fed_tail is None else [self._fed_tail])
        self.kv_meter.hold_beside("cache", *held_bytes(own))

    @property
    def events(self) -> list[CompressionEvent]:
        """The recorded compressions, one CompressionEvent per layer per compression, oldest
        first: the last `RECENT_EVENTS` (all of them with `keep_all_events`). To count
        compressions use `n_compressions` and `row_compressions()`, which are never cut short."""
        return self.event_log.events

    @events.setter
    def events(self, events: list[CompressionEvent]) -> None:
        self.event_log.events = events

    @property
    def record_events(self) -> bool:
        return self.event_log.enabled

    @record_events.setter
    def record_events(self, enabled: bool) -> None:
        self.event_log.enabled = enabled

    @property
    def keep_all_events(self) -> bool:
        """Keep every event, not only the last `RECENT_EVENTS` (for plots of a whole run); the
        record then grows with the sequence, and `memory()['event_bytes']` shows by how much."""
        return self.event_log.keep_all

    @keep_all_events.setter
    def keep_all_events(self, keep: bool) -> None:
        self.event_log.keep_all = keep

    @property
    def n_compressions(self) -> int:
        """Compressions so far, one per layer per compression (every one, recorded or not)."""
        return sum(layer.n_compressions for layer in self.layers)

    def row_compressions(self) -> torch.Tensor:
        """[B] (CPU) compressions each batch row took part in, summed over the layers."""
        counts = [layer.compressions.cpu() for layer in self.layers if layer.compressions is not None]
        return sum(counts[1:], counts[0]) if counts else torch.zeros(0, dtype=torch.long)

    def reset(self) -> None:
        super().reset()
        self.kv_meter.reset()  # a reused cache reports its new run's peak, not the last one's
        self.event_log.clear()  # and its own compressions
        self._fed_tail, self._fed_end = None, 0
        self._count_own()
        for layer in self.layers:  # what each still holds (its budgets), counted again
            layer._count_beside()

    @property
    def timer(self) -> StepTimer:
        """Times the cache's own work (see StepTimer); set it to measure, e.g. in a benchmark."""
        return self._timer

    @timer.setter
    def timer(self, timer: StepTimer) -> None:
        self._timer = timer
        for layer in self.layers:
            layer.timer = timer

    # generate() sets this on a cache it is given, once per call: the next forward is checked
    # to continue the sequence the cache holds.
    @property
    def _is_user_defined(self) -> bool:
        return self._user_defined

    @_is_user_defined.setter
    def _is_user_defined(self, value: bool) -> None:
        self._user_defined = value
        self._new_call = self._ids_call = True

    # transformers (5.20+) calls this from every attention module, passing its forward kwargs
    # (the very dict that then goes to the attention function); earlier versions pass none.
    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        forward_kwargs = kwargs.get("kwargs")
        if isinstance(forward_kwargs, dict):
            forward_kwargs["reasonkv_cache"] = self
        elif NEW_CACHE_API:
            raise RuntimeError(
                "this model's attention does not pass its kwargs to cache.update(); reasonkv needs them "
                "to hand the cache to its attention function (supported: Llama, Qwen2, Qwen3, Mistral)"
            )
        with self._timer.section("update"):
            keys, values = self.layers[layer_idx].update(key_states, value_states)
        if not isinstance(forward_kwargs, dict):
            hand_over(self, keys)
        return keys, values

    def check_input_ids(self, input_ids: torch.Tensor) -> None:
        """generate() hands each step the whole sequence so far. At a call's first step it must
        begin with the tokens this cache was fed: the last FED_TAIL of them are kept to compare,
        which catches a new prompt longer than the held sequence (positions alone cannot: they
        would continue). Later steps only keep the tail: a slice on the device, no host sync."""
        check, self._ids_call = self._ids_call, False
        tail, end = self._fed_tail, self._fed_end
        if check and tail is not None and self.get_seq_length() > 0:
            held = self.get_seq_length()
            if input_ids.shape[0] != tail.shape[0]:
                raise another_sequence(held, f"batch of {tail.shape[0]}, given {input_ids.shape[0]} rows")
            same = input_ids.shape[1] >= end and torch.equal(
                input_ids[:, end - tail.shape[1] : end], tail.to(input_ids.device)
            )
            if not same:
                raise another_sequence(held, "the new input does not begin with the tokens it was fed")
        self._fed_tail, self._fed_end = input_ids[:, -FED_TAIL:].clone(), input_ids.shape[1]
        if tail is None or tail.shape != self._fed_tail.shape:
            self._count_own()

    def check_continues(self, q: int, positions: torch.Tensor | None, padded: bool) -> None:
        """Called by layer 0's attention: this forward's tokens must continue the held sequence.
        generate() derives positions from the whole new sequence's padding mask, so without
        padding (`padded` False: that mask is all ones) the tokens past the cache's length start
        at its length exactly when the sequence is the one held; with padding the mask function
        checks the mask's length instead. Checked at each generate() call and each multi-token
        forward (a decode step skips the device sync)."""
        check, self._new_call = self._new_call or q > 1, False
        start = self.layers[0].new_start
        if not check or padded or positions is None or start == 0:
            return
        first = int(positions[..., 0].max())
        if first != start:
            raise another_sequence(start, f"the new tokens start at position {first}, not {start}")

    def check_module(self, module: torch.nn.Module) -> None:
        idx = module.layer_idx
        if self._module_ids is not None and (
            idx >= len(self._module_ids) or self._module_ids[idx] != id(module)
        ):
            raise RuntimeError(
                "this CompressedCache was made for another model; build one cache per model with "
                "reasonkv.make_cache(model, ...)"
            )

    def steps_until_compress(self) -> int | None:
        """The most tokens one forward can take without passing a compression point of any
        layer or row (None = the cache never compresses). Feeding exactly this many ends the
        chunk where token-by-token decoding would compress, and the cache compresses after the
        chunk's attention, as it would then; a chunked replay is therefore exact."""
        steps = None
        for layer in self.layers:
            layer_steps = layer.steps_until_compress()
            if layer_steps is None:
                return None
            steps = layer_steps if steps is None else min(steps, layer_steps)
        return steps

    def steps_until_settle(self) -> int | None:
        """The most tokens one forward can take before a layer's quantized storage would move a
        group of tokens out of its full-precision residual (None: nothing is quantized). Token by
        token, the tokens after that point read the group quantized; a chunk that passed it
        would read it in full precision."""
        steps = [s for s in (layer.steps_until_settle() for layer in self.layers) if s is not None]
        return min(steps) if steps else None

    # ------------------------------------------------------------- reporting
    def memory(self) -> dict:
        """What the cache holds, for the whole batch:

        - state_bytes: everything held now, K/V and all beside it (slot indices, query windows,
          beacon buffers, per-token scores, policy states, counters); peak_state_bytes: the most
          at once so far (what decides how many sequences fit); both also `_16bit`, with
          floating-point elements at 16 bits, as served in bf16/fp16. physical_bytes is
          state_bytes (its older name).
        - kv_bytes (K and V storage, both tiers), peak_kv_bytes (the most K/V storage held at once
          so far, moments when a layer holds old and new storage included), and both `_16bit`.
        - event_bytes (host memory of the recorded events, an estimate), total_bytes
          (state_bytes + event_bytes: the cache's whole footprint).
        - live_tokens [layers, kv_heads] (per batch row, [B, L, H], when B > 1), low_tier_tokens
          (the same for the low tier; None without one), seen_tokens.
        """
        events = self.event_log.nbytes()
        meter = self.kv_meter
        held = {
            "state_bytes": meter.state,
            "state_bytes_16bit": meter.state_16bit,
            "peak_state_bytes": meter.peak_state,
            "peak_state_bytes_16bit": meter.peak_state_16bit,
            "physical_bytes": meter.state,
            "total_bytes": meter.state + events,
            "event_bytes": events,
        }
        layers = [layer for layer in self.layers if layer.is_initialized and layer.storage.allocated]
        if not layers:
            return {
                **held,
                "kv_bytes": 0,
                "peak_kv_bytes": 0,
                "kv_bytes_16bit": 0,
                "peak_kv_bytes_16bit": 0,
                "live_tokens": None,
                "low_tier_tokens": None,
                "seen_tokens": 0,
            }
        kv = sum(layer.kv_bytes() for layer in layers)
        kv_16bit = sum(layer.kv_bytes(at_16bit=True) for layer in layers)
        live = torch.stack([layer.n_valid.cpu() for layer in layers], dim=1)  # [B, L, H]
        low = [layer.low_tier_tokens for layer in layers]
        low = None if low[0] is None else torch.stack([n.cpu() for n in low], dim=1)
        return {
            **held,
            "kv_bytes": kv,
            "peak_kv_bytes": meter.peak,
            "kv_bytes_16bit": kv_16bit,
            "peak_kv_bytes_16bit": meter.peak_16bit,
            "live_tokens": live[0] if live.shape[0] == 1 else live,
            "low_tier_tokens": None if low is None else low[0] if low.shape[0] == 1 else low,
            "seen_tokens": layers[0].seen,
        }

    def live_token_bound(self) -> int | None:
        """The most real tokens any head can hold after a step (None = unbounded). With
        protect_prompt the whole prompt is kept even past the budget (with the recent window
        beside it), so the bound grows by the longest prompt once the cache has seen it. Under
        a schedule that counts from the prompt's end (phase=decode) it grows by what the prompt
        exceeds the budget."""
        if self.policy.head_allocator is not None:
            return None
        tops = [layer.plan.trigger_max for layer in self.layers]
        if tops[0] is None:
            return None
        prompt_end = self.layers[0].window.prompt_end
        extra = int(prompt_end.max()) if self.policy.protect_prompt and prompt_end is not None else 0
        if self.policy.schedule.from_prompt_end and prompt_end is not None:
            # The whole prompt stays until the first compression, `interval` tokens after it.
            smallest = min(min(layer.plan.targets) for layer in self.layers)
            extra = max(extra, int(prompt_end.max()) - smallest)
        return max(tops) - 1 + extra

    def __repr__(self) -> str:
        seen = self.get_seq_length()
        return f"CompressedCache(method={self.method!r}, layers={len(self.layers)}, seen={seen})"


def default_scaling(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)
