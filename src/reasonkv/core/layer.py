"""CompressedLayer: one layer of a compressed cache, the transformers storage under the one step.

A forward of one attention layer goes through it three times, in this order:
1. `update` (called by transformers through the cache) appends the new keys and values and
   returns everything stored; nothing is evicted here, so scores later index exactly the
   stored tokens.
2. `before_attention` (reasonkv's attention function) marks this step's padding and returns
   the attention mask, built from the layer's own record of which token each slot holds.
3. `after_attention` (the same function, once attention is done) runs the layer's
   `LayerStep` (core/step.py, the step every engine shares): the policies observe, the query
   window is updated, and if the schedule fires the step scores, selects and hands the kept
   selection back to this layer (`StepStorage`), which frees slots as holes or compacts.
So the current step always attends to the pre-eviction cache.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from transformers.cache_utils import CacheLayerMixin

from reasonkv.core.kv_basis import QuantizationBasis
from reasonkv.core.low_tier import LowTier, evicted
from reasonkv.core.memory_meter import MemoryMeter, held_bytes
from reasonkv.core.policy.base import EMPTY
from reasonkv.core.quantized_storage import QuantizedKVStorage
from reasonkv.core.step import LayerStep
from reasonkv.core.storage import KVStorage
from reasonkv.core.timing import NO_TIMER, StepTimer

GROWTH_CHUNK = 256
"""Storage grows in chunks of this many slots, up to what the schedule needs (its trigger plus
hole slots, or the kept tokens plus slack after a compaction), so a layer never holds more than
the tokens it has seen plus one chunk: a budget far above the sequence costs nothing."""


def another_sequence(held: int, detail: str) -> ValueError:
    """The error for a cache handed a sequence other than the one it holds."""
    return ValueError(
        f"this cache holds {held} tokens of another sequence ({detail}); a cache serves one sequence "
        "(a later generate() call may continue it with the whole sequence so far): make a new cache with "
        "reasonkv.make_cache(model, ...) for a new prompt, or call cache.reset() first"
    )


class CompressedLayer(CacheLayerMixin):
    """One layer of a `CompressedCache`: its K/V storage (and low tier), growth, padding and
    mask, and the `StepStorage` its `LayerStep` selects through."""

    is_sliding = False
    is_compileable = False
    is_croppable = False

    def __init__(
        self,
        layer_idx: int,
        budgets: torch.Tensor,
        policy,
        scorer_states: list | None = None,
        meter: MemoryMeter | None = None,
    ):
        super().__init__()
        self.layer_idx = layer_idx
        self._budgets = budgets.clone()  # [H] per-head budget of this layer
        self.policy = policy
        # Every layer's scorer state, one list per cache: scorers batch work across layers (BeaconKV).
        self.scorer_states = [None] * (layer_idx + 1) if scorer_states is None else scorer_states
        self._timer: StepTimer = NO_TIMER
        self.meter = MemoryMeter() if meter is None else meter  # K/V bytes, shared by the cache's layers
        self.report: Callable[[int, int, torch.Tensor, torch.Tensor], None] | None = None
        self._reset_state()

    # transformers' CacheLayerMixin sets these to None; the storage owns them.
    keys = property(lambda self: None if self.storage is None else self.storage.keys, lambda self, v: None)
    values = property(
        lambda self: None if self.storage is None else self.storage.values, lambda self, v: None
    )

    def _reset_state(self) -> None:
        if getattr(self, "storage", None) is not None:
            self.storage.release()
        if getattr(self, "low_tier", None) is not None:
            self.low_tier.release()
        self.storage: KVStorage | None = None
        self.low_tier: LowTier | None = None  # what eviction drops, at low_bits (KVFormat.low_budget)
        budgets = getattr(self, "step", None)
        budgets = self._budgets if budgets is None else budgets.budgets
        self.step = LayerStep(
            self.layer_idx, budgets, self.policy, self.scorer_states, self, timer=self._timer
        )
        self._live_upper = 0  # an upper bound of max_b sum_h n_valid, to skip the trigger check cheaply
        self.pending = False  # update() ran, after_attention() not yet
        self._new_valid: torch.Tensor | None = None
        self.compressions: torch.Tensor | None = None  # [B] compressions each row took part in
        self.n_compressions = 0  # compressions of this layer (any rows)
        self.is_initialized = False
        self._count_beside()  # its budgets and targets, held from the start

    def reset(self) -> None:
        self._reset_state()

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        b, h, _, _ = key_states.shape
        if h != self.budgets.numel():
            raise ValueError(
                f"layer {self.layer_idx}: the cache was built for {self.budgets.numel()} KV heads, "
                f"the model gives {h}; a cache belongs to the model it was made for"
            )
        self.device, self.dtype = key_states.device, key_states.dtype
        names, fmt = tuple(self.policy.scorer.state_names), self.policy.kv_format
        if fmt is not None and fmt.quantized:
            basis = QuantizationBasis(fmt, self.policy.rope_inv_freq, self.policy.rope_attention_scaling)
            self.storage = QuantizedKVStorage(b, h, self.device, fmt, names, self.meter, basis)
        else:
            self.storage = KVStorage(b, h, self.device, names, self.meter)
        if fmt is not None and fmt.low_budget:
            self.low_tier = LowTier(b, h, self.device, fmt, self.meter)
        self.step.to(self.device)
        self.compressions = torch.zeros(b, dtype=torch.long, device=self.device)
        self.is_initialized = True

    # ------------------------------------------------------------ the step's state, as read
    budgets = property(lambda self: self.step.budgets)
    plan = property(lambda self: self.step.plan)
    targets = property(lambda self: self.step.targets)
    view = property(lambda self: self.step)  # the LayerView the policies read
    window = property(lambda self: self.step.window)
    states = property(lambda self: self.step.states)
    seen = property(lambda self: self.step.seen)
    new_start = property(lambda self: self.step.new_start)
    n_query_heads = property(lambda self: self.step.n_query_heads)
    window_keep = property(lambda self: self.step.window_keep)
    """The most queries the layer's window keeps: what its scorer reads, and its backlog."""

    @property
    def scorer_states(self) -> list:
        """Every layer's scorer state, one list per cache (scorers batch work across layers)."""
        return self._scorer_states

    @scorer_states.setter
    def scorer_states(self, states: list) -> None:
        self._scorer_states = states
        if getattr(self, "step", None) is not None:
            self.step.scorer_states = states
            states[self.layer_idx] = self.step.states.scorer

    @property
    def timer(self) -> StepTimer:
        return self._timer

    @timer.setter
    def timer(self, timer: StepTimer) -> None:
        self._timer = self.step.timer = timer

    # ------------------------------------------------------------ what it holds
    @property
    def batch_size(self) -> int:
        return self.storage.lengths.shape[0]

    @property
    def used(self) -> int:
        return 0 if self.storage is None else self.storage.used

    @property
    def lengths(self) -> torch.Tensor | None:
        return None if self.storage is None else self.storage.lengths

    @property
    def n_valid(self) -> torch.Tensor | None:
        return None if self.storage is None else self.storage.n_valid

    @property
    def live_upper(self) -> int:
        return self._live_upper

    @property
    def token_index(self) -> torch.Tensor | None:
        """[B, H, used] sequence index per stored slot (EMPTY: padding or a hole)."""
        return None if self.storage is None else self.storage.token_index[:, :, : self.storage.used]

    @property
    def shape(self) -> tuple[int, int, int, torch.device]:
        storage = self.storage
        b, h = storage.lengths.shape
        return b, h, storage.head_dim, storage.device

    # The query window, as earlier code and tests read it.
    queries = property(lambda self: self.window.queries)
    query_index = property(lambda self: self.window.query_index)
    query_positions = property(lambda self: self.window.query_positions)
    prompt_end = property(lambda self: self.window.prompt_end)

    @property
    def token_state(self) -> dict[str, torch.Tensor]:
        """The scorer's per-token tensors, [B, H, used] views of the storage."""
        used = self.used
        return (
            {} if self.storage is None else {k: v[:, :, :used] for k, v in self.storage.token_state.items()}
        )

    def _slack(self) -> int:
        """Tokens a head may gain after a compression before the next one fires."""
        slack = self.step.slack()
        return GROWTH_CHUNK if slack is None else slack

    # ------------------------------------------------------- 1. update (append)
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        elif key_states.shape[0] != self.batch_size and key_states.shape[1] == self.budgets.numel():
            raise another_sequence(self.seen, f"batch of {self.batch_size}, given {key_states.shape[0]} rows")
        elif key_states.shape[:2] != self.storage.lengths.shape:
            # Caught here, before the write would fail with an opaque shape error.
            raise RuntimeError(
                f"layer {self.layer_idx}: this CompressedCache holds {tuple(self.storage.lengths.shape)} "
                f"(batch, KV heads), the model gives {tuple(key_states.shape[:2])}: it was made for "
                "another model or another batch; build one cache per model and generation with "
                "reasonkv.make_cache(model, ...)"
            )
        if self.pending:
            raise RuntimeError(
                "reasonkv's attention function did not run for the previous step: the model is not set up "
                "for this cache. Build it with reasonkv.make_cache(model, ...), which installs it."
            )
        storage, q = self.storage, key_states.shape[2]
        needed = storage.used + q
        trigger = self.plan.trigger_max
        # Room up to the schedule's trigger, so decoding writes in place until it compresses;
        # reached one chunk at a time, so storage never exceeds the tokens seen by more than a chunk.
        if trigger is not None and needed <= trigger:
            capacity = trigger + self.plan.hole_slots
        else:
            capacity = needed + self._slack()
        storage.ensure_capacity(needed, min(capacity, needed + GROWTH_CHUNK), key_states, value_states)
        storage.append(key_states, value_states, self.seen)
        self._live_upper += q * storage.lengths.shape[1]
        self.step.advance(q)
        self.pending = True
        if self.low_tier is not None:  # attention reads both tiers; the scorers, the main one
            return self.low_tier.attended(storage.read_keys(), storage.read_values())
        return storage.read_keys(), storage.read_values()

    # --------------------------------------------------------- 2. before attention
    def before_attention(self, new_valid: torch.Tensor | None) -> tuple[torch.Tensor | None, bool]:
        """Mark this step's padding (new_valid [B, q] False: padding) and return the attention
        mask ([B, 1 or H, q, used] bool, or None) and whether attention is plain causal."""
        storage = self.storage
        q = self.seen - self.new_start
        if new_valid is not None and not bool(new_valid.all()):
            storage.mark_padding(new_valid, self.new_start)
        self._new_valid = new_valid
        query_index = torch.arange(self.new_start, self.seen, device=storage.device).expand(
            storage.lengths.shape[0], -1
        )
        with self.timer.section("mask"):
            mask = storage.attention_mask(query_index)
            if self.low_tier is not None:
                mask = self.low_tier.attention_mask(mask, self.token_index, query_index)
        return mask, mask is None and q == storage.used and q > 1  # a fresh prefill

    # ---------------------------------------------------------- 3. after attention
    def after_attention(self, query: torch.Tensor, positions: torch.Tensor | None, scaling: float) -> None:
        with self.timer.section("after_attention"):
            self.pending = False
            rows = self.step.after_attention(query, positions, scaling, self._new_valid)
            if rows is not None:
                self.compressions += rows
                self.n_compressions += 1
                if self.report is not None:
                    self.report(self.layer_idx, self.seen, self.storage.n_valid, rows)
            self._new_valid = None  # this step's padding, read: not held past the step
            self.storage.settle()
            if self.low_tier is not None:
                self.low_tier.drop_view()
            self._count_beside()

    def _count_beside(self) -> None:
        """Tell the meter what the layer now holds beside K/V (at the end of each step)."""
        self.meter.hold_beside(self.layer_idx, *held_bytes(self.beside_tensors()))

    def steps_until_compress(self) -> int | None:
        """Tokens one forward can take without passing this layer's next compression (None: never)."""
        return self.step.steps_until_compress()

    def steps_until_settle(self) -> int | None:
        """Tokens one forward can take before quantized storage moves a group out of its
        full-precision residual (None: full-precision storage, or nothing stored yet)."""
        return None if self.storage is None else self.storage.steps_until_settle()

    # ------------------------------------------------- the step's storage (StepStorage)
    def record_positions(self, index: torch.Tensor, positions: torch.Tensor) -> None:
        self.storage.record_positions(index, positions)

    def read_keys(self) -> torch.Tensor:
        return self.storage.read_keys()

    def read_values(self) -> torch.Tensor:
        return self.storage.read_values()

    def _room(self) -> bool:
        """Whether the slack still fits after this step's tokens (else compact to make it)."""
        return self.storage.used + self._slack() <= self.storage.capacity

    def single_evictions(self, keep: torch.Tensor, protected: torch.Tensor) -> torch.Tensor | None:
        storage, hole_slots = self.storage, self.plan.hole_slots
        if not (hole_slots and self._room()):
            return None
        # Every protected token stays even past `keep` (select_tokens' rule), so a head whose
        # protected tokens outnumber its budget drops only what is unprotected past them.
        drop = (storage.n_valid - torch.maximum(keep, protected.sum(-1))).clamp(min=0)
        most_dropped, longest = torch.stack([drop.max(), (storage.n_valid - drop).max()]).tolist()
        if most_dropped <= 1 and storage.used - longest <= hole_slots:
            return drop > 0
        return None

    def evict_slot(self, victim: torch.Tensor, scores: torch.Tensor) -> None:
        storage = self.storage
        if self.low_tier is not None:
            index = self.token_index
            self._to_low_tier(index.gather(2, victim.clamp(max=storage.used - 1)), victim, scores)
        with self.timer.section("holes"):
            storage.evict_slot(victim)
        self._live_upper = int(storage.n_valid.sum(-1).max())

    def keep_slots(self, slots: torch.Tensor, new_len: torch.Tensor, scores: torch.Tensor) -> None:
        storage = self.storage
        live = (
            None
            if self.low_tier is None
            else self._to_low_tier(evicted(self.token_index, slots), None, scores, new_len)
        )
        holes = storage.used - slots.shape[-1]  # slots not kept by the longest head
        if holes <= self.plan.hole_slots and self._room():
            with self.timer.section("holes"):
                storage.evict_in_place(slots, new_len)
        else:
            capacity = slots.shape[-1] + min(self._slack() + self.plan.hole_slots, GROWTH_CHUNK)
            with self.timer.section("compact"):
                storage.compact(slots, new_len, capacity)
        self._live_upper = int(new_len.sum(-1).max()) if live is None else live

    def _to_low_tier(
        self, index: torch.Tensor, victim: torch.Tensor | None, scores: torch.Tensor, new_len=None
    ) -> int | None:
        """Hand the evicted tokens `index` [B, H, E] (EMPTY: none) to the low tier, before the
        storage drops them: with `victim` [B, H, 1] (an every-step eviction, slot `used` =
        none) that one slot per head; else every slot (E = used), and the tier is trimmed to
        its fullest head, read in the same host read as the main tier's live bound (returned)."""
        storage, tier = self.storage, self.low_tier
        keys, values = storage.read_keys(), storage.read_values()
        with self.timer.section("low_tier"):
            if victim is None:
                fullest = (tier.n_tokens + (index != EMPTY).sum(-1)).max()
                fill, live = torch.stack([fullest, new_len.sum(-1).max()]).tolist()
                tier.feed(keys, values, index, scores, fill=fill)
                return live
            index = index.masked_fill(victim >= storage.used, EMPTY)
            slot = victim.clamp(max=storage.used - 1)

            def pick(t: torch.Tensor) -> torch.Tensor:
                return t.gather(2, slot[..., None].expand(-1, -1, -1, t.shape[-1]))

            tier.feed(pick(keys), pick(values), index, scores.gather(2, slot))
            return None

    def kv_bytes(self, at_16bit: bool = False) -> int:
        """K/V bytes held between steps: the main storage's and the low tier's."""
        tiers = [self.storage] + ([] if self.low_tier is None else [self.low_tier])
        return sum(t.kv_bytes_16bit() if at_16bit else t.kv_bytes() for t in tiers)

    def live_kv_bytes(self) -> float:
        """Bytes of the real tokens held, both tiers, at what each one costs stored."""
        low = 0.0 if self.low_tier is None else self.low_tier.live_kv_bytes()
        return self.storage.live_kv_bytes() + low

    @property
    def low_tier_tokens(self) -> torch.Tensor | None:
        """[B, H] real tokens in the low tier (None without one)."""
        return None if self.low_tier is None else self.low_tier.n_tokens

    # ----------------------------------------------------------- bookkeeping
    def get_seq_length(self) -> int:
        return self.seen

    def get_mask_sizes(self, query_length) -> tuple[int, int]:
        # reasonkv's mask function builds its mask from `token_index`, not from these sizes;
        # they describe the logical sequence so a stock mask function would stay consistent.
        q = query_length if isinstance(query_length, int) else int(query_length.shape[0])
        if q == 0 and self.seen:  # generate() given a prompt much shorter than the sequence held
            raise another_sequence(self.seen, "the new input has no tokens past them")
        return self.seen + q, 0

    def get_max_length(self) -> int:
        return -1

    def select_rows(self, rows: torch.Tensor) -> None:
        """Keep batch rows `rows` [B'] (beam search reorders, repeats or drops them)."""
        rows = rows.to(self.device)
        self.storage.select_rows(rows)
        if self.low_tier is not None:
            self.low_tier.select_rows(rows)
        self.compressions = self.compressions.index_select(0, rows)
        self.step.select_rows(rows)
        self._count_beside()

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if self.is_initialized:
            self.select_rows(beam_idx)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.is_initialized:
            self.select_rows(torch.as_tensor(indices, device=self.device).flatten())

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.is_initialized:
            self.select_rows(torch.arange(self.batch_size, device=self.device).repeat_interleave(repeats))

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError(
            "a reasonkv cache cannot be cropped (evicted tokens are gone), so assisted decoding and "
            "prompt lookup decoding (assistant_model=, prompt_lookup_num_tokens=) are not supported with it"
        )

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor the layer holds: K/V of both tiers and everything beside them."""
        if self.storage is None:
            return []
        low = [] if self.low_tier is None else self.low_tier.tensors()
        return self.storage.tensors() + low + self._own_tensors()

    def beside_tensors(self) -> list[torch.Tensor]:
        """What the layer holds beside K/V: slot indices, per-token state and counts (both tiers),
        the query window, its budgets and counters, and its policies' states."""
        if self.storage is None:
            return [self.budgets, self.targets]
        low = [] if self.low_tier is None else self.low_tier.beside_tensors()
        return self.storage.beside_tensors() + low + self._own_tensors()

    def _own_tensors(self) -> list[torch.Tensor]:
        return self.step.tensors() + [self.compressions]
