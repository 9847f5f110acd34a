"""CompressedCache: a transformers Cache that really evicts tokens during decoding.

Storage per layer is `[B, H, capacity, D]` for keys and values, with a per-slot
`token_index` (the token's sequence index, EMPTY for padding and unused slots) and a
per-head `lengths`. Each head's live slots are `[0, lengths[b, h])`, kept in positional
order. Capacity is allocated for exactly what the schedule can need before the next
compression, so decoding writes in place; compaction (a gather into fresh, smaller
storage) happens only when the schedule fires, and the old storage is released.
Schedules that evict every step (`hole_slots() > 0`) leave evicted tokens as holes
(EMPTY slots) and compact only when the holes fill the slack they were given.

Logical vs physical: `get_seq_length()` is the number of tokens seen (RoPE positions and
the 2-D attention mask of `generate()` are logical); `memory()` reports what is stored.
Keys are stored post-RoPE and never re-rotated.

The layer does not evict inside `update()`: `update()` appends and returns everything
stored, the attention function (reasonkv.core.attention) computes attention with the cache's
own mask, then calls `after_attention()`, which hands the forward's queries to the
scorer's `on_step` hook, records them in the query window, and compresses.
So scores always index exactly the stored tokens, and the current step sees the
pre-eviction cache.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from reasonkv.core.policy.base import EMPTY, Observation, Scorer
from reasonkv.core.policy.schedules import Schedule
from reasonkv.core.policy.selection import evict_one, protected_mask, select_tokens

GROWTH_CHUNK = 256
"""Slack added when storage must grow outside the schedule (prefill, the full cache)."""

_NULL = contextlib.nullcontext()


class StepTimer:
    """Where a benchmark hooks in to time the cache's own work. The cache opens
    `section(name)` around each part of a step: update, mask, after_attention, on_step, score,
    split, compress, compact, holes (sections nest: compress contains compact). This default
    times nothing."""

    def section(self, name: str) -> contextlib.AbstractContextManager:
        return _NULL


NO_TIMER = StepTimer()


@dataclass
class CompressionEvent:
    """One compression of one layer, kept for plots (head budgets over decode steps)."""

    layer: int
    seen: int
    lengths: torch.Tensor  # [B, H] live tokens per head after the compression
    rows: torch.Tensor | None = None  # [B] bool: the batch rows that compressed


@dataclass
class LayerPolicy:
    """What the cache needs to know to compress: shared by all layers of one cache.

    The scorer's contract with the cache (see `CompressedCache.after_attention`):
    - `window`: the cache keeps the last `window` queries of the layer (at least 1) in
      `layer.queries/query_index/query_positions`; `score` sees them as `obs.queries`.
    - `query_backlog` (optional, default 0): the cache keeps this many queries older than the
      window as well (`score` does not see them), so `on_step` can queue work on queries that
      left the window by counting them instead of copying them (BeaconKV).
    - `state_names` (optional): per-token state tensors [B, H, capacity] the cache allocates
      (zero for new tokens) and gathers along with the keys at every eviction.
    - `on_step(step, keys, layer)` (optional): called once per forward of each layer, after
      attention and before the window is updated or anything is evicted. `step` holds THIS
      forward's queries only (every one of them, whatever `window` is); `layer.queries` etc.
      still hold the previous window (with its backlog). A scorer that must see every query
      (H2O, BeaconKV) does so here, never by asking for a huge window; it must not modify the
      window itself. `layer.shared` is one dict for all layers of the cache (cleared on
      reset), for work batched across layers.
    - `select_rows(extras, rows)` (optional, on the scorer, the schedule and the head
      allocator): reorder/duplicate the per-row state each keeps in `layer.extras` to the
      batch rows `rows` [B'] (beam search, `batch_select_indices`); the cache reorders its own.
    """

    scorer: Scorer
    schedule: Schedule
    n_sink: int = 4
    n_recent: int = 8
    protect_prompt: bool = False
    head_allocator: object | None = None
    """Optional `split(layer_total [B], obs, scores, n_valid, keys=, min_tokens=, rows=) -> [B, H]` for
    per-head reallocation at each compression (AdaKV, ReasonAlloc); totals must be kept exactly
    and no head may get fewer than `min_tokens` (the protected window) unless it has fewer.
    `rows` [B] marks the rows that compress now; the others' results are discarded.
    None = the static budgets."""
    rope_inv_freq: torch.Tensor | None = None
    """The model's RoPE inverse frequencies (rope scaling already applied), for scorers
    that rotate queries to another position (BeaconKV)."""
    rope_attention_scaling: float = 1.0


class CompressedLayer(CacheLayerMixin):
    """One layer's compressed K/V storage and the per-layer observation state."""

    is_sliding = False
    is_compileable = False
    is_croppable = False

    def __init__(
        self, layer_idx: int, budgets: torch.Tensor, policy: LayerPolicy, shared: dict | None = None
    ):
        super().__init__()
        self.layer_idx = layer_idx
        self.budgets = budgets.clone()  # [H] per-head budget of this layer
        self.policy = policy
        # One dict for all layers of a cache: scorers batch work across layers through it
        # (BeaconKV feeds every layer's beacon buffers in one pass).
        self.shared = {} if shared is None else shared
        self.timer: StepTimer = NO_TIMER
        self._reset_state()

    # ------------------------------------------------------------------ state
    def _reset_state(self) -> None:
        self.keys = self.values = None  # [B, H, capacity, D]
        self.token_index: torch.Tensor | None = None  # [B, H, capacity]
        self.lengths: torch.Tensor | None = None  # [B, H] slots in use per head
        self.n_valid: torch.Tensor | None = None  # [B, H] real tokens per head
        self.used = 0  # max over heads of lengths (a python int: no sync to slice)
        self.ragged = False  # do heads/rows use different numbers of slots?
        self.holes = False  # do heads have evicted-but-not-compacted slots (per-head layout)?
        self.dense = True  # are all slots in [0, used) real tokens (no padding, no holes)?
        self.seen = 0  # logical tokens seen, padding included
        self.new_start = 0  # sequence index of the first token of the current step
        self.state: dict[str, torch.Tensor] = {}
        self.queries: torch.Tensor | None = None  # [B, Hq, W, D]
        self.query_index: torch.Tensor | None = None  # [B, W]
        self.query_positions: torch.Tensor | None = None  # [B, W]
        self.prompt_end: torch.Tensor | None = None  # [B] sequence index where generation starts
        self.extras: dict[str, object] = {}
        self.pending = False
        self.is_initialized = False

    def reset(self) -> None:
        self._reset_state()
        self.shared.clear()  # it refers to the layers' old extras

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        b, h, _, d = key_states.shape
        if h != self.budgets.numel():
            raise ValueError(
                f"layer {self.layer_idx}: the cache was built for {self.budgets.numel()} KV heads, "
                f"the model gives {h}; a cache belongs to the model it was made for"
            )
        self.device, self.dtype, self.batch_size = key_states.device, key_states.dtype, b
        self.lengths = torch.zeros(b, h, dtype=torch.long, device=self.device)
        self.n_valid = torch.zeros_like(self.lengths)
        self.budgets = self.budgets.to(self.device)
        schedule = self.policy.schedule
        triggers = [schedule.trigger(b) for b in self.budgets.tolist()]
        # Per-layer constants of the schedule, computed once (the decode path reads python ints).
        self._trigger = None if triggers[0] is None else max(triggers)
        self._trigger_total = None if triggers[0] is None else sum(triggers)
        self._targets = torch.tensor([schedule.target(b) for b in self.budgets.tolist()], device=self.device)
        self._hole_slots = schedule.hole_slots(int(self.budgets.min())) if self._trigger is not None else 0
        self.valid_upper = 0  # an upper bound of max_b sum_h n_valid[b, h], to skip the check cheaply
        self.is_initialized = True

    # ----------------------------------------------------------------- sizing
    def _slack(self) -> int:
        """Tokens a head may gain after a compression before the next one fires."""
        custom = getattr(self.policy.schedule, "slack", None)
        if custom is not None:
            return custom(self)
        if self._trigger is None:
            return GROWTH_CHUNK
        return max(1, self._trigger - int(self._targets.min()))

    def _ensure_capacity(self, needed: int, like: torch.Tensor, v_like: torch.Tensor) -> None:
        for name in getattr(self.policy.scorer, "state_names", ()):
            if name not in self.state:
                self.state[name] = torch.zeros(
                    *self.lengths.shape, 0 if self.keys is None else self.keys.shape[2], device=self.device
                )
        if self.keys is not None and needed <= self.keys.shape[2]:
            return
        b, h = self.lengths.shape
        # Room up to the schedule's trigger, so decoding writes in place until it compresses.
        if self._trigger is not None and needed <= self._trigger:
            cap = self._trigger + self._hole_slots
        else:
            cap = needed + self._slack()
        # Zeros, not empty: masked slots still enter the attention matmuls, and 0 x NaN from
        # uninitialised memory would poison real outputs.
        keys = like.new_zeros(b, h, cap, like.shape[-1])
        values = v_like.new_zeros(b, h, cap, v_like.shape[-1])
        index = torch.full((b, h, cap), EMPTY, dtype=torch.long, device=self.device)
        if self.used:
            keys[:, :, : self.used] = self.keys[:, :, : self.used]
            values[:, :, : self.used] = self.values[:, :, : self.used]
            index[:, :, : self.used] = self.token_index[:, :, : self.used]
        for name, tensor in self.state.items():
            grown = tensor.new_zeros(b, h, cap)
            grown[:, :, : self.used] = tensor[:, :, : self.used]
            self.state[name] = grown
        self.keys, self.values, self.token_index = keys, values, index

    # ---------------------------------------------------------------- update
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        elif key_states.shape[:2] != self.lengths.shape:
            # Caught here, before the write would fail with an opaque shape error.
            raise RuntimeError(
                f"layer {self.layer_idx}: this CompressedCache holds {tuple(self.lengths.shape)} "
                f"(batch, KV heads), the model gives {tuple(key_states.shape[:2])}: it was made for "
                "another model or another batch; build one cache per model and generation with "
                "reasonkv.make_cache(model, ...)"
            )
        if self.pending:
            raise RuntimeError(
                "reasonkv's attention function did not run for the previous step: the model is not set up "
                "for this cache. Build it with reasonkv.make_cache(model, ...), which installs it."
            )
        q = key_states.shape[2]
        self._ensure_capacity(self.used + q, key_states, value_states)
        new_index = torch.arange(self.seen, self.seen + q, device=self.device)
        if not self.ragged:
            sl = slice(self.used, self.used + q)
            self.keys[:, :, sl] = key_states
            self.values[:, :, sl] = value_states
            self.token_index[:, :, sl] = new_index
        else:
            slots = self.lengths[..., None] + torch.arange(q, device=self.device)  # [B, H, q]
            d = key_states.shape[-1]
            self.keys.scatter_(2, slots[..., None].expand(-1, -1, -1, d), key_states)
            self.values.scatter_(2, slots[..., None].expand(-1, -1, -1, value_states.shape[-1]), value_states)
            self.token_index.scatter_(2, slots, new_index.expand_as(slots).contiguous())
        for tensor in self.state.values():  # new tokens start with zero accumulated state
            if not self.ragged:
                tensor[:, :, self.used : self.used + q] = 0
            else:
                tensor.scatter_(2, slots, 0.0)
        self.lengths += q
        self.n_valid += q
        self.valid_upper += q * self.lengths.shape[1]
        self.used += q
        self.new_start, self.seen = self.seen, self.seen + q
        self.pending = True
        return self.keys[:, :, : self.used], self.values[:, :, : self.used]

    def mark_padding(self, new_valid: torch.Tensor | None) -> None:
        """Mark the current step's padding tokens (new_valid [B, q] False) as EMPTY, so they
        are never attended, never scored, never sinks, and dropped at the next compaction."""
        if new_valid is None or bool(new_valid.all()):
            return
        q = new_valid.shape[1]
        index = self.token_index[:, :, : self.used]
        rel = index - self.new_start  # EMPTY stays huge
        in_step = (rel >= 0) & (rel < q)
        pad = in_step & ~new_valid[:, None, :].expand(-1, index.shape[1], -1).gather(2, rel.clamp(0, q - 1))
        index.masked_fill_(pad, EMPTY)
        self.n_valid -= (~new_valid).sum(-1, keepdim=True)
        self.dense = False

    def attention_mask(self, query_index: torch.Tensor) -> torch.Tensor | None:
        """Boolean mask [B, 1 or H, q, used] for the current step, or None when every stored
        token may be attended by every query (decode with no padding)."""
        q = query_index.shape[-1]
        if self.dense and not self.ragged and (q == 1 or q == self.used):
            return None  # decode (attend all) or a fresh prefill (plain causal)
        index = self.token_index[:, :, : self.used]
        if not self.ragged and not self.holes:
            index = index[:, :1]  # heads share slot layout, so one mask row serves all
        allowed = index[:, :, None, :] <= query_index[:, None, :, None]
        # A padding query attends nothing; give it everything so no NaN leaks into its
        # (never attended) key/value at the next layer.
        return allowed | ~allowed.any(-1, keepdim=True)

    # ----------------------------------------------------------- observation
    def step_queries(
        self, query: torch.Tensor, new_valid: torch.Tensor | None, positions: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Sequence indices [B, q] (-1 for padding) and RoPE positions [B, q] of the current
        forward's queries (positions = indices when the model passes no position_ids).
        The first forward is the prompt: it also records `prompt_end`."""
        b, q = query.shape[0], query.shape[2]
        index = torch.arange(self.new_start, self.seen, device=query.device).expand(b, q)
        if new_valid is not None:
            index = index.masked_fill(~new_valid, -1)
        positions = index if positions is None else positions.expand(b, -1).to(index.dtype)
        if self.prompt_end is None:
            self.prompt_end = torch.full((b,), self.seen, dtype=torch.long, device=query.device)
        return index, positions

    def observe(self, query: torch.Tensor, index: torch.Tensor, positions: torch.Tensor, window: int) -> None:
        """Keep the last `window` queries of (the previous window, this forward's queries);
        `index`/`positions` [B, q] come from `step_queries`."""
        if window <= 0:
            return
        if self.queries is None or query.shape[2] >= window:
            # Copies: a slice of a long prefill would keep all its queries alive.
            self.queries = query[:, :, -window:].detach().clone()
            self.query_index = index[:, -window:].clone()
            self.query_positions = positions[:, -window:].clone()
        else:
            self.queries = torch.cat([self.queries, query.detach()], dim=2)[:, :, -window:]
            self.query_index = torch.cat([self.query_index, index], dim=1)[:, -window:]
            self.query_positions = torch.cat([self.query_positions, positions], dim=1)[:, -window:]

    def observation(self, scaling: float, window: int | None = None) -> Observation:
        """The last `window` kept queries (all of them by default) and the stored tokens, as
        `score` sees them."""
        if window is None or self.queries is None or self.queries.shape[2] <= window:
            return self._observation(self.queries, self.query_index, self.query_positions, scaling)
        q, index, positions = self.queries, self.query_index, self.query_positions
        return self._observation(q[:, :, -window:], index[:, -window:], positions[:, -window:], scaling)

    def step_observation(
        self, query: torch.Tensor, index: torch.Tensor, positions: torch.Tensor, scaling: float
    ) -> Observation:
        """This forward's queries only ([B, Hq, q, D], all of them) and the stored tokens, for `on_step`."""
        return self._observation(query.detach(), index, positions, scaling)

    def _observation(
        self,
        queries: torch.Tensor | None,
        index: torch.Tensor | None,
        positions: torch.Tensor | None,
        scaling: float,
    ) -> Observation:
        return Observation(
            queries=queries,
            query_index=index,
            token_index=self.token_index[:, :, : self.used],
            scaling=scaling,
            state={k: v[:, :, : self.used] for k, v in self.state.items()},
            layer_idx=self.layer_idx,
            query_positions=positions,
            extras=self.extras,
            rope_inv_freq=self.policy.rope_inv_freq,
            rope_attention_scaling=self.policy.rope_attention_scaling,
        )

    # ------------------------------------------------------------ compression
    def rows_to_compress(self) -> torch.Tensor | None:
        """[B] bool: rows whose real tokens reached the schedule's trigger, or None."""
        custom = getattr(self.policy.schedule, "rows_to_compress", None)
        if custom is not None:  # stateful schedules (RPC) decide from the layer itself
            return custom(self)
        if self._trigger_total is None or self.valid_upper < self._trigger_total:
            return None
        rows = self.n_valid.sum(-1) >= self._trigger_total
        return rows if bool(rows.any()) else None

    def compress(self, keep: torch.Tensor, scores: torch.Tensor) -> None:
        """Keep `keep[b, h]` tokens per head chosen by `scores` [B, H, used]; free the rest."""
        policy = self.policy
        index = self.token_index[:, :, : self.used]
        protected = protected_mask(
            index, policy.n_sink, policy.n_recent, self.prompt_end if policy.protect_prompt else None
        )
        room = self.used + self._slack() <= self.keys.shape[2]
        if self._hole_slots and room:
            # An every-step schedule's usual step: each head drops at most one token, and the
            # holes still fit. Find it by argmin instead of ranking every token.
            drop = (self.n_valid - keep).clamp(min=0)
            most_dropped, longest = torch.stack([drop.max(), (self.n_valid - drop).max()]).tolist()
            if most_dropped <= 1 and self.used - longest <= self._hole_slots:
                victim = evict_one(scores, index, protected, drop > 0)
                with self.timer.section("holes"):
                    self._evict_slot(victim)
                return
        slots, new_len = select_tokens(scores, index, keep, protected)
        holes = self.used - slots.shape[-1]  # slots not kept by the longest head
        if holes <= self._hole_slots and room:
            with self.timer.section("holes"):
                self._evict_in_place(slots, new_len)
        else:
            with self.timer.section("compact"):
                self._compact(slots, new_len)

    def _evict_slot(self, victim: torch.Tensor) -> None:
        """Make slot victim[b, h, 0] of each head a hole (victim = used: none)."""
        self.token_index.scatter_(2, victim, EMPTY)  # slot `used` is spare capacity, EMPTY already
        self.n_valid = self.n_valid - (victim[..., 0] < self.used).long()
        self.valid_upper = int(self.n_valid.sum(-1).max())
        self.holes = True
        self.dense = False

    def _evict_in_place(self, slots: torch.Tensor, new_len: torch.Tensor) -> None:
        """Make every slot not in `slots` a hole (EMPTY); storage and the other slots stay put."""
        b, h = self.lengths.shape
        kept = torch.zeros(b, h, self.used + 1, dtype=torch.bool, device=self.device)
        kept.scatter_(2, slots, True)  # padding entries (= used) land in the extra column
        self.token_index[:, :, : self.used].masked_fill_(~kept[:, :, : self.used], EMPTY)
        self.n_valid = new_len.clone()
        self.valid_upper = int(new_len.sum(-1).max())
        self.holes = True
        self.dense = False

    def _compact(self, slots: torch.Tensor, new_len: torch.Tensor) -> None:
        """Gather the kept slots [B, H, K] (sorted, padded with `used`) into fresh storage."""
        b, h, k = slots.shape
        cap = k + self._slack() + self._hole_slots
        safe = slots.clamp(max=max(self.used - 1, 0))
        present = slots < self.used

        def gather(src: torch.Tensor, fill) -> torch.Tensor:
            out = src.new_full((b, h, cap) + src.shape[3:], fill)  # finite filler, see _ensure_capacity
            idx = safe if src.dim() == 3 else safe[..., None].expand(-1, -1, -1, src.shape[-1])
            out[:, :, :k] = src.gather(2, idx)
            return out

        keys = gather(self.keys[:, :, : self.used], 0)
        values = gather(self.values[:, :, : self.used], 0)
        index = gather(self.token_index[:, :, : self.used], EMPTY)
        index[:, :, :k].masked_fill_(~present, EMPTY)
        state = {n: gather(t[:, :, : self.used], 0) for n, t in self.state.items()}
        self.keys, self.values, self.token_index, self.state = keys, values, index, state
        self.lengths = new_len.clone()
        self.n_valid = new_len.clone()
        self.used = k
        self.valid_upper = int(new_len.sum(-1).max())
        self.ragged = bool((new_len != k).any())
        self.holes = False
        self.dense = not self.ragged

    # ----------------------------------------------------------- bookkeeping
    def get_seq_length(self) -> int:
        return self.seen

    def get_mask_sizes(self, query_length) -> tuple[int, int]:
        # reasonkv's mask function builds its mask from `token_index`, not from these sizes;
        # they describe the logical sequence so a stock mask function would stay consistent.
        q = query_length if isinstance(query_length, int) else int(query_length.shape[0])
        return self.seen + q, 0

    def get_max_length(self) -> int:
        return -1

    def _select_rows(self, rows: torch.Tensor) -> None:
        for name in (
            "keys",
            "values",
            "token_index",
            "lengths",
            "n_valid",
            "queries",
            "query_index",
            "query_positions",
            "prompt_end",
        ):
            t = getattr(self, name)
            if t is not None:
                setattr(self, name, t.index_select(0, rows.to(t.device)))
        self.state = {n: t.index_select(0, rows.to(t.device)) for n, t in self.state.items()}
        # Per-row scorer/schedule/allocator state in `extras` is theirs to reorder (some of it
        # is per head, not per row, so the cache cannot tell which tensors to index).
        for part in (self.policy.scorer, self.policy.schedule, self.policy.head_allocator):
            select = getattr(part, "select_rows", None)
            if select is not None:
                select(self.extras, rows.to(self.device))
        if self.lengths is not None:
            self.batch_size = self.lengths.shape[0]

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if self.is_initialized:
            self._select_rows(beam_idx)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.is_initialized:
            self._select_rows(torch.as_tensor(indices, device=self.device).flatten())

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.is_initialized:
            rows = torch.arange(self.batch_size, device=self.device).repeat_interleave(repeats)
            self._select_rows(rows)

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("a compressed cache cannot be cropped: evicted tokens are gone")

    def tensors(self) -> list[torch.Tensor]:
        ts = [self.keys, self.values, self.token_index, self.queries, self.query_index, self.query_positions]
        ts += list(self.state.values())
        ts += [t for t in self.extras.values() if isinstance(t, torch.Tensor)]
        return [t for t in ts if t is not None]


class CompressedCache(Cache):
    """A `transformers.Cache` whose layers evict tokens by a scorer, a schedule and budgets.

    Build it with `reasonkv.make_cache(model, method=..., budget=...)`, which also installs
    reasonkv's attention function on the model (it feeds the cache the queries and the
    padding information; without it the cache refuses to run).

    Per forward of a layer, after attention (`after_attention`): the scorer's optional
    `on_step(step, keys, layer)` sees this forward's queries while `layer.queries` still holds
    the previous window; then the window is updated to the last `scorer.window` queries
    (plus the scorer's `query_backlog`);
    then, if the schedule fires, `score` ranks the stored tokens and the layer compacts.
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
        shared: dict = {}
        layers = [CompressedLayer(i, budgets[i], policy, shared) for i in range(budgets.shape[0])]
        super().__init__(layers=layers)
        self.policy = policy
        self.method = method
        self.budgets = budgets.clone()
        self.scaling = scaling
        self._module_ids = [id(m) for m in attention_modules] if attention_modules else None
        self.events: list[CompressionEvent] = []
        self.record_events = True
        self.timer = NO_TIMER

    @property
    def timer(self) -> StepTimer:
        """Times the cache's own work (see StepTimer); set it to measure, e.g. in a benchmark."""
        return self._timer

    @timer.setter
    def timer(self, timer: StepTimer) -> None:
        self._timer = timer
        for layer in self.layers:
            layer.timer = timer

    def steps_until_compress(self) -> int | None:
        """The most tokens one forward can take without passing a compression point of any
        layer or row (None = the cache never compresses). Feeding exactly this many ends the
        chunk where token-by-token decoding would compress, and the cache compresses after the
        chunk's attention, as it would then; a chunked replay is therefore exact."""
        steps = None
        for layer in self.layers:
            layer_steps = self.policy.schedule.steps_until_compress(layer)
            if layer_steps is None:
                return None
            steps = layer_steps if steps is None else min(steps, layer_steps)
        return steps

    # transformers calls this from every attention module, passing its forward kwargs
    # (the very dict that then goes to the attention function).
    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        forward_kwargs = kwargs.get("kwargs")
        if not isinstance(forward_kwargs, dict):
            raise RuntimeError(
                "this model's attention does not pass its kwargs to cache.update(); reasonkv needs them "
                "to hand the cache to its attention function (supported: Llama, Qwen2, Qwen3, Mistral)"
            )
        forward_kwargs["reasonkv_cache"] = self
        with self._timer.section("update"):
            return self.layers[layer_idx].update(key_states, value_states)

    def check_module(self, module: torch.nn.Module) -> None:
        idx = module.layer_idx
        if self._module_ids is not None and (
            idx >= len(self._module_ids) or self._module_ids[idx] != id(module)
        ):
            raise RuntimeError(
                "this CompressedCache was made for another model; build one cache per model with "
                "reasonkv.make_cache(model, ...)"
            )

    def after_attention(
        self,
        layer_idx: int,
        query: torch.Tensor,
        new_valid: torch.Tensor | None,
        positions: torch.Tensor | None,
        scaling: float,
    ) -> None:
        """Hand this forward's queries to the scorer, keep its window, then compress the layer
        if its schedule says so.

        1. `scorer.on_step(step, keys, layer)`, if defined: `step` is an Observation of THIS
           forward's queries only (queries [B, Hq, q, D], query_index [B, q] with -1 for padding,
           query_positions [B, q]) with the layer's stored tokens, state, extras and RoPE data;
           `keys` [B, H, used, D]. `layer.queries/query_index/query_positions` still hold the
           previous window and its backlog (None at the first forward); `layer.state`/`layer.extras`
           are the scorer's to update. Nothing has been evicted yet.
        2. The layer keeps the last `max(scorer.window, 1) + scorer.query_backlog` queries of
           (previous ones, step).
        3. If rows reach the schedule's trigger: `scorer.score(obs, ...)` with the last
           `max(scorer.window, 1)` queries as `obs.queries`, and compaction.
        """
        with self._timer.section("after_attention"):
            self._after_attention(layer_idx, query, new_valid, positions, scaling)

    def _after_attention(self, layer_idx, query, new_valid, positions, scaling) -> None:
        layer: CompressedLayer = self.layers[layer_idx]
        layer.pending = False
        scorer = self.policy.scorer
        index, positions = layer.step_queries(query, new_valid, positions)
        on_step = getattr(scorer, "on_step", None)
        if on_step is not None:
            step = layer.step_observation(query, index, positions, scaling)
            with self._timer.section("on_step"):
                on_step(step, layer.keys[:, :, : layer.used], layer)
        window = max(getattr(scorer, "window", 0), 1)
        layer.observe(query, index, positions, window + getattr(scorer, "query_backlog", 0))
        rows = layer.rows_to_compress()
        if rows is None:
            return
        obs = layer.observation(scaling, window)
        keys, values = layer.keys[:, :, : layer.used], layer.values[:, :, : layer.used]
        with self._timer.section("score"):
            scores = scorer.score(obs, keys, values)
        custom_keep = getattr(self.policy.schedule, "keep", None)
        if custom_keep is not None:  # stateful schedules (RPC) size the cache themselves
            keep = custom_keep(layer)
        else:
            keep = layer._targets.expand_as(layer.n_valid)
        if self.policy.head_allocator is not None:
            with self._timer.section("split"):
                keep = self.policy.head_allocator.split(
                    keep.sum(-1),
                    obs,
                    scores,
                    layer.n_valid,
                    keys=keys,
                    min_tokens=self.policy.n_sink + self.policy.n_recent,
                    rows=rows,
                )
        keep = torch.where(rows[:, None], keep, layer.n_valid)
        with self._timer.section("compress"):
            layer.compress(keep, scores)
        if self.record_events:
            # A copy: on CPU .cpu() is the live tensor, which later steps change in place.
            self.events.append(
                CompressionEvent(layer_idx, layer.seen, layer.n_valid.cpu().clone(), rows.cpu().clone())
            )

    # ------------------------------------------------------------- reporting
    def memory(self) -> dict:
        """physical_bytes (all cache tensors), kv_bytes (K and V storage), live_tokens
        [layers, kv_heads] (per batch row, [B, L, H], when B > 1), seen_tokens."""
        layers = [layer for layer in self.layers if layer.is_initialized and layer.keys is not None]
        if not layers:
            return {"physical_bytes": 0, "kv_bytes": 0, "live_tokens": None, "seen_tokens": 0}
        kv = sum(t.numel() * t.element_size() for layer in layers for t in (layer.keys, layer.values))
        total = sum(t.numel() * t.element_size() for layer in layers for t in layer.tensors())
        live = torch.stack([layer.n_valid.cpu() for layer in layers], dim=1)  # [B, L, H]
        return {
            "physical_bytes": total,
            "kv_bytes": kv,
            "live_tokens": live[0] if live.shape[0] == 1 else live,
            "seen_tokens": layers[0].seen,
        }

    def live_token_bound(self) -> int | None:
        """The most real tokens any head can hold after a step (None = unbounded)."""
        schedule = self.policy.schedule
        trig = [schedule.trigger(int(b)) for b in self.budgets.flatten().tolist()]
        if trig[0] is None:
            return None
        return max(trig) - 1 if self.policy.head_allocator is None else None

    def __repr__(self) -> str:
        seen = self.get_seq_length()
        return f"CompressedCache(method={self.method!r}, layers={len(self.layers)}, seen={seen})"


def default_scaling(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)
