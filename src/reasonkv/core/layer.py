"""CompressedLayer: one layer of a compressed cache, and the owner of its decode step.

A forward of one attention layer goes through it three times, in this order:
1. `update` (called by transformers through the cache) appends the new keys and values and
   returns everything stored; nothing is evicted here, so scores later index exactly the
   stored tokens.
2. `before_attention` (reasonkv's attention function) marks this step's padding and returns
   the attention mask, built from the layer's own record of which token each slot holds.
3. `after_attention` (the same function, once attention is done): the scorer sees this
   forward's queries (`on_step`), the query window is updated, and if the schedule fires the
   layer scores, splits the budget between heads, selects and evicts.
So the current step always attends to the pre-eviction cache.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers.cache_utils import CacheLayerMixin

from reasonkv.core.kv_basis import QuantizationBasis
from reasonkv.core.low_tier import LowTier, evicted
from reasonkv.core.memory_meter import MemoryMeter, held_bytes
from reasonkv.core.policy.base import EMPTY, Observation
from reasonkv.core.policy.contract import HeadAllocator, PolicyState, Scorer, SplitRequest
from reasonkv.core.policy.selection import evict_one, protected_mask, select_tokens
from reasonkv.core.quantized_storage import QuantizedKVStorage
from reasonkv.core.query_window import QueryWindow
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


@dataclass
class PolicyStates:
    """The per-layer memory of each policy of a method (None where a policy keeps none)."""

    scorer: PolicyState | None = None
    schedule: PolicyState | None = None
    head_allocator: PolicyState | None = None

    def select_rows(self, rows: torch.Tensor) -> None:
        for state in (self.scorer, self.schedule, self.head_allocator):
            if state is not None:
                state.select_rows(rows)


def layer_observation(layer, queries, index, positions, scaling: float) -> Observation:
    """What a scorer sees of one layer: these queries over the layer's stored tokens. `layer` is a
    CompressedLayer or any layer that keeps the same fields (policy, token_index, token_state,
    layer_idx, window, targets, states): a serving engine's request layer."""
    policy = layer.policy
    return Observation(
        queries=queries,
        query_index=index,
        token_index=layer.token_index,
        scaling=scaling,
        state=layer.token_state,
        layer_idx=layer.layer_idx,
        query_positions=positions,
        rope_inv_freq=policy.rope_inv_freq,
        rope_attention_scaling=policy.rope_attention_scaling,
        prompt_end=layer.window.prompt_end,
        targets=layer.targets,
        scorer_state=layer.states.scorer,
    )


class _View:
    """The read-only `LayerView` policies get: live properties of the layer, no copies. It
    refers to the layer weakly, so layer and view make no reference cycle and a dropped cache
    frees its storage at once instead of at the next garbage collection."""

    def __init__(self, layer: CompressedLayer):
        self._ref = weakref.ref(layer)

    @property
    def _layer(self) -> CompressedLayer:
        return self._ref()

    layer_idx = property(lambda self: self._layer.layer_idx)
    budgets = property(lambda self: self._layer.budgets)
    plan = property(lambda self: self._layer.plan)
    targets = property(lambda self: self._layer.targets)
    token_index = property(lambda self: self._layer.token_index)
    n_valid = property(lambda self: self._layer.n_valid)
    live_upper = property(lambda self: self._layer.live_upper)
    seen = property(lambda self: self._layer.seen)
    n_recent = property(lambda self: self._layer.policy.n_recent)
    n_sink = property(lambda self: self._layer.policy.n_sink)
    n_query_heads = property(lambda self: self._layer.n_query_heads)
    window = property(lambda self: self._layer.window)
    scorer_states = property(lambda self: self._layer.scorer_states)

    @property
    def dtype(self) -> torch.dtype:
        return self._layer.dtype

    @property
    def shape(self) -> tuple[int, int, int, torch.device]:
        storage = self._layer.storage
        b, h = storage.lengths.shape
        return b, h, storage.head_dim, storage.device


class CompressedLayer(CacheLayerMixin):
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
        self.budgets = budgets.clone()  # [H] per-head budget of this layer
        self.policy = policy
        self.plan = policy.schedule.plan([int(b) for b in self.budgets.tolist()])
        self.targets = torch.tensor(self.plan.targets)  # [H], moved to the keys' device when they come
        # Every layer's scorer state, one list per cache: scorers batch work across layers (BeaconKV).
        self.scorer_states = [None] * (layer_idx + 1) if scorer_states is None else scorer_states
        self.timer: StepTimer = NO_TIMER
        self.meter = MemoryMeter() if meter is None else meter  # K/V bytes, shared by the cache's layers
        self.report: Callable[[int, int, torch.Tensor, torch.Tensor], None] | None = None
        self.view = _View(self)
        scorer: Scorer = policy.scorer
        self._window_size = max(scorer.window, 1)
        allocator_backlog = 0 if policy.head_allocator is None else policy.head_allocator.query_backlog
        self._window_keep = max(self._window_size + scorer.query_backlog, allocator_backlog)
        self._observes_steps = type(scorer).on_step is not Scorer.on_step
        allocator = policy.head_allocator
        self._allocator_observes = (
            allocator is not None and type(allocator).on_step is not HeadAllocator.on_step
        )
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
        self.window = QueryWindow(self.policy.scorer.window_bits)
        self.states = PolicyStates()
        self._states_made = False
        self.scorer_states[self.layer_idx] = None
        self.seen = 0  # logical tokens seen, padding included
        self.new_start = 0  # sequence index of the first token of the current step
        self.live_upper = 0  # an upper bound of max_b sum_h n_valid, to skip the trigger check cheaply
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
        self.budgets = self.budgets.to(self.device)
        self.targets = self.targets.to(self.device)
        self.compressions = torch.zeros(b, dtype=torch.long, device=self.device)
        self.is_initialized = True

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
    def token_index(self) -> torch.Tensor | None:
        """[B, H, used] sequence index per stored slot (EMPTY: padding or a hole)."""
        return None if self.storage is None else self.storage.token_index[:, :, : self.storage.used]

    @property
    def window_keep(self) -> int:
        """The most queries the layer's window keeps: what its scorer reads, and its backlog."""
        return self._window_keep

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
        slack = self.policy.schedule.slack(self.view, self.states.schedule)
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
        self.live_upper += q * storage.lengths.shape[1]
        self.new_start, self.seen = self.seen, self.seen + q
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
            self._after_attention(query, positions, scaling)
            self._new_valid = None  # this step's padding, read: not held past the step
            self.storage.settle()
            if self.low_tier is not None:
                self.low_tier.drop_view()
            self._count_beside()

    def _count_beside(self) -> None:
        """Tell the meter what the layer now holds beside K/V (at the end of each step)."""
        self.meter.hold_beside(self.layer_idx, *held_bytes(self.beside_tensors()))

    def _after_attention(self, query: torch.Tensor, positions: torch.Tensor | None, scaling: float) -> None:
        self.pending = False
        policy, storage = self.policy, self.storage
        index, positions = self.window.label(query, self.new_start, self._new_valid, positions)
        storage.record_positions(index, positions)
        if not self._states_made:
            self.n_query_heads = query.shape[1]
            self._new_states()
        keys = storage.read_keys()
        if self._observes_steps or self._allocator_observes:
            step = self._observation(query.detach(), index, positions, scaling)
            if self._observes_steps:
                with self.timer.section("on_step"):
                    policy.scorer.on_step(step, keys)
            if self._allocator_observes:
                with self.timer.section("utility"):
                    policy.head_allocator.on_step(step, keys, self.states.head_allocator)
        self.window.keep(query, index, positions, self._window_keep)
        schedule, view = policy.schedule, self.view
        rows = schedule.rows_to_compress(view, self.states.schedule)
        if rows is None:
            return
        obs = self._observation(*self.window.last(self._window_size), scaling)
        values = storage.read_values()
        with self.timer.section("score"):
            scores = policy.scorer.score(obs, keys, values)
        keep = schedule.keep(view, self.states.schedule)
        if policy.head_allocator is not None:
            request = SplitRequest(
                keep.sum(-1), obs, scores, storage.n_valid, keys, policy.n_sink + policy.n_recent, rows
            )
            with self.timer.section("split"):
                keep = policy.head_allocator.split(request, self.states.head_allocator)
        keep = torch.where(rows[:, None], keep, storage.n_valid)
        with self.timer.section("compress"):
            self.compress(keep, scores)
        self.compressions += rows
        self.n_compressions += 1
        if self.report is not None:
            self.report(self.layer_idx, self.seen, storage.n_valid, rows)

    def _new_states(self) -> None:
        """Each policy's memory for this layer, made once the first forward's queries are labelled."""
        policy = self.policy
        self.states.scorer = policy.scorer.new_state(self.view)
        self.states.schedule = policy.schedule.new_state(self.view)
        if policy.head_allocator is not None:
            self.states.head_allocator = policy.head_allocator.new_state(self.view)
        self.scorer_states[self.layer_idx] = self.states.scorer
        self._states_made = True

    def _observation(self, queries, index, positions, scaling: float) -> Observation:
        return layer_observation(self, queries, index, positions, scaling)

    def steps_until_compress(self) -> int | None:
        """Tokens one forward can take without passing this layer's next compression (None: never)."""
        return self.policy.schedule.steps_until_compress(self.view, self.states.schedule)

    def steps_until_settle(self) -> int | None:
        """Tokens one forward can take before quantized storage moves a group out of its
        full-precision residual (None: full-precision storage, or nothing stored yet)."""
        return None if self.storage is None else self.storage.steps_until_settle()

    # ------------------------------------------------------------- compression
    def compress(self, keep: torch.Tensor, scores: torch.Tensor) -> None:
        """Keep `keep[b, h]` tokens per head chosen by `scores` [B, H, used]; free the rest."""
        policy, storage = self.policy, self.storage
        index = self.token_index
        protected = protected_mask(
            index, policy.n_sink, policy.n_recent, self.window.prompt_end if policy.protect_prompt else None
        )
        hole_slots = self.plan.hole_slots
        room = storage.used + self._slack() <= storage.capacity
        if hole_slots and room:
            # An every-step schedule's usual step: each head drops at most one token, and the
            # holes still fit. Find it by argmin instead of ranking every token.
            # Every protected token stays even past `keep` (select_tokens' rule), so a head whose
            # protected tokens outnumber its budget drops only what is unprotected past them.
            drop = (storage.n_valid - torch.maximum(keep, protected.sum(-1))).clamp(min=0)
            most_dropped, longest = torch.stack([drop.max(), (storage.n_valid - drop).max()]).tolist()
            if most_dropped <= 1 and storage.used - longest <= hole_slots:
                victim = evict_one(scores, index, protected, drop > 0)
                if self.low_tier is not None:
                    self._to_low_tier(index.gather(2, victim.clamp(max=storage.used - 1)), victim, scores)
                with self.timer.section("holes"):
                    storage.evict_slot(victim)
                self.live_upper = int(storage.n_valid.sum(-1).max())
                return
        slots, new_len = select_tokens(scores, index, keep, protected)
        live = (
            None if self.low_tier is None else self._to_low_tier(evicted(index, slots), None, scores, new_len)
        )
        holes = storage.used - slots.shape[-1]  # slots not kept by the longest head
        if holes <= hole_slots and room:
            with self.timer.section("holes"):
                storage.evict_in_place(slots, new_len)
        else:
            capacity = slots.shape[-1] + min(self._slack() + hole_slots, GROWTH_CHUNK)
            with self.timer.section("compact"):
                storage.compact(slots, new_len, capacity)
        self.live_upper = int(new_len.sum(-1).max()) if live is None else live

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
        self.window.select_rows(rows)
        self.states.select_rows(rows)
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
        out = self.window.tensors() + [self.compressions, self.budgets, self.targets]
        for state in (self.states.scorer, self.states.schedule, self.states.head_allocator):
            if state is not None:
                out += [v for v in vars(state).values() if isinstance(v, torch.Tensor)]
        return out
