"""One layer's decode step, written once for every engine.

`LayerStep` runs the policy hooks of one layer after its attention, in one order, over rows
`[R, H, T]` (transformers: the batch rows; vLLM: the requests of one pool, at different
positions): label this forward's queries → the scorer's and head allocator's `on_step` → the
query window keeps its newest queries (where decode queries wait, those three run when they
join the window) → `rows_to_compress` → `score` → the schedule's `keep`
(split between heads by a head allocator) → protection and the one token selection
(`select_tokens`, or `evict_one` where a storage can drop one slot per head in place). It is
also the `LayerView` the policies read.

The tokens themselves live in a `StepStorage`, the one thing an engine writes: which token
each slot holds, the per-token scorer state, reading K/V and applying a kept selection.
transformers' `CompressedLayer` is one (over `KVStorage` / `QuantizedKVStorage` / `LowTier`);
requests' slots in vLLM's paged cache are the other (`serving/paged_rows.py`), a `RowsStorage`:
its rows come and go (`join_rows`, `select_rows`), and the rows that compress in a step are
scored apart from the others (`rows_copy`), so a step where one request of many compresses
reads and scores that one.

The prompt's end is the engine's to say (`prompt_end`): a prompt fed in chunks is observed
chunk by chunk, and the schedule's state (its count of tokens from the prompt's end, RPC's
prompt length) starts at the forward that completes the prompt, whatever the chunking. Without
it, the first forward is the prompt (transformers' `generate()`).

Pure torch: nothing here imports transformers or an engine.
"""

from __future__ import annotations

import copy
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from reasonkv.core.policy.base import Observation
from reasonkv.core.policy.contract import BudgetPlan, HeadAllocator, PolicyState, Scorer, SplitRequest
from reasonkv.core.policy.schedules import Schedule
from reasonkv.core.policy.selection import evict_one, protected_mask, select_tokens
from reasonkv.core.query_window import QueryWindow
from reasonkv.core.timing import NO_TIMER, StepTimer

if TYPE_CHECKING:
    from reasonkv.core.quantize import KVFormat


@dataclass
class LayerPolicy:
    """The method, as every layer of one cache applies it: which tokens (scorer), when and
    how many (schedule, head allocator), and what is never evicted (protection)."""

    scorer: Scorer
    schedule: Schedule
    n_sink: int = 4
    n_recent: int = 8
    protect_prompt: bool = False
    head_allocator: HeadAllocator | None = None
    rope_inv_freq: torch.Tensor | None = None
    """The model's RoPE inverse frequencies (rope scaling applied), for scorers that rotate
    queries to another position (BeaconKV)."""
    rope_attention_scaling: float = 1.0
    kv_format: KVFormat | None = None
    """How the layers store K/V (None or kv_bits 16: as the model computes them)."""

    @property
    def protected(self) -> int:
        """The tokens a head always keeps once full: sinks and the newest."""
        return self.n_sink + self.n_recent

    @property
    def joins_rows(self) -> bool:
        """Whether one state of this policy may hold rows at different positions (a serving
        engine's pool of requests): its scorer's and schedule's counters allow it."""
        return self.scorer.joins_rows() and self.schedule.joins_rows()


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

    def join_rows(self, other: PolicyStates) -> None:
        for name in ("scorer", "schedule", "head_allocator"):
            mine, theirs = getattr(self, name), getattr(other, name)
            if (mine is None) != (theirs is None):
                raise ValueError(f"a {name} state joins only another {name} state")
            if mine is not None:
                mine.join_rows(theirs)

    def put_rows(self, rows: list[int], other: PolicyStates, at: torch.Tensor) -> None:
        """Take `other` (a `rows_copy` of rows `rows`, `at` on the device) back in their places."""
        for name in ("scorer", "schedule", "head_allocator"):
            mine, theirs = getattr(self, name), getattr(other, name)
            if mine is not None:
                mine.put_rows(rows, theirs, at)

    def rows_copy(
        self, rows: torch.Tensor, old_window: QueryWindow, window: QueryWindow, layer_states: list
    ) -> PolicyStates:
        """The states of rows `rows` only (copies, pointed at the copy's `window` and its list
        of every layer's scorer states)."""
        out = PolicyStates()
        for name in ("scorer", "schedule", "head_allocator"):
            state = getattr(self, name)
            if state is not None:
                state = copy.copy(state)
                state.rebind(old_window, window, layer_states)
                state.select_rows(rows)
                setattr(out, name, state)
        return out

    def tensors(self) -> list[torch.Tensor]:
        out = []
        for state in (self.scorer, self.schedule, self.head_allocator):
            if state is not None:
                out += [v for v in vars(state).values() if isinstance(v, torch.Tensor)]
        return out


class StepStorage(Protocol):
    """Where one layer's tokens live, as the step reads and changes them."""

    @property
    def token_index(self) -> torch.Tensor: ...  # [R, H, T] sequence index per slot, EMPTY if none
    @property
    def n_valid(self) -> torch.Tensor: ...  # [R, H] real tokens per head
    @property
    def token_state(self) -> dict[str, torch.Tensor]: ...  # the scorer's per-token [R, H, T] tensors
    @property
    def live_upper(self) -> int: ...  # an upper bound of max_r sum_h n_valid (no device sync)
    @property
    def shape(self) -> tuple[int, int, int, torch.device]: ...  # rows, KV heads, head dim, device
    @property
    def dtype(self) -> torch.dtype: ...

    def record_positions(self, index: torch.Tensor, positions: torch.Tensor) -> None:
        """This forward's tokens' sequence indices and RoPE positions [R, q] (pre-RoPE storage)."""

    def read_keys(self) -> torch.Tensor: ...  # [R, H, T, D] in slot order
    def read_values(self) -> torch.Tensor: ...

    def single_evictions(self, keep: torch.Tensor, protected: torch.Tensor) -> torch.Tensor | None:
        """[R, H] bool, the heads that give up one token, when keeping `keep` [R, H] drops at most
        one a head and the storage can then free one slot per head in place; else None."""

    def evict_slot(self, victim: torch.Tensor, scores: torch.Tensor) -> None:
        """Free slot `victim` [R, H, 1] of each head (T: none)."""

    def keep_slots(self, slots: torch.Tensor, new_len: torch.Tensor, scores: torch.Tensor) -> None:
        """Keep slots [R, H, K] (ascending, padded with T), `new_len` [R, H] of them a head."""


class RowsStorage(StepStorage, Protocol):
    """A storage whose rows come and go (a serving engine's requests): the step then scores only
    the rows that compress, apart from the others, and puts them back."""

    def rows_copy(self, rows: torch.Tensor) -> RowsStorage: ...  # rows [R'] only, sharing the K/V
    def put_rows(self, rows: list[int], other: RowsStorage, at: torch.Tensor) -> None: ...  # a rows_copy
    def select_rows(self, rows: torch.Tensor) -> None: ...
    def join_rows(self, other: RowsStorage) -> None: ...


def window_keep(policy: LayerPolicy) -> int:
    """The most queries a layer's window keeps a head: what the scorer reads, and the scorer's
    or the head allocator's backlog."""
    allocator = policy.head_allocator
    allocator_backlog = 0 if allocator is None else allocator.query_backlog
    return max(max(policy.scorer.window, 1) + policy.scorer.query_backlog, allocator_backlog)


class LayerStep:
    """The decode step of one layer, and the read-only `LayerView` its policies get.

    `advance(q)` counts a forward's q new tokens once the engine has stored them;
    `after_attention` then runs the hooks and returns the rows that compressed ([R] bool) or
    None. The storage is held weakly: it owns the step, and a dropped cache frees at once.

    `query_wait` > 0 lets decode queries wait aside (at most that many) until the window is
    read: the window then changes once per that many steps, as an engine that runs this step
    per request wants (a decode step that does not compress then touches no tensor of the
    layer). A scorer that observes every step waits so only where its `on_step` only counts
    queries (`steps_may_wait`, BeaconKV): it then observes the waiting ones as one forward when
    they join the window."""

    def __init__(
        self,
        layer_idx: int,
        budgets: torch.Tensor,
        policy: LayerPolicy,
        scorer_states: list,
        storage: StepStorage,
        *,
        prompt_end: int | None = None,
        query_wait: int = 0,
        timer: StepTimer = NO_TIMER,
    ) -> None:
        self.layer_idx = layer_idx
        self.policy = policy
        self.budgets = budgets  # [H] per-head budget of this layer
        self.plan: BudgetPlan = policy.schedule.plan([int(b) for b in budgets.tolist()])
        self.targets = torch.tensor(self.plan.targets, device=budgets.device)  # [H]
        self.scorer_states = scorer_states  # every layer's, for scorers that batch across layers
        self._storage = weakref.ref(storage)
        self.timer = timer
        self.window = QueryWindow(policy.scorer.window_bits)
        self.states = PolicyStates()
        self.prompt_end = prompt_end
        self.seen = 0  # logical tokens seen, padding included
        self.new_start = 0  # sequence index of this forward's first token
        self.first_index: torch.Tensor | None = None  # [R] the same, rows at different positions
        self.n_query_heads = 0
        self._observers_ready = False  # scorer and head allocator states made (first forward)
        self._schedule_ready = False  # schedule state made (the prompt is complete)
        scorer: Scorer = policy.scorer
        allocator = policy.head_allocator
        self.window_size = max(scorer.window, 1)
        self.window_keep = window_keep(policy)
        self.observes_steps = type(scorer).on_step is not Scorer.on_step
        self.allocator_observes = (
            allocator is not None and type(allocator).on_step is not HeadAllocator.on_step
        )
        # A scorer that observes every forward may still let decode queries wait when it only
        # counts them (`steps_may_wait`): it then sees them as they join the window.
        waits = (not self.observes_steps or scorer.steps_may_wait) and not self.allocator_observes
        self.query_wait = query_wait if waits else 0
        self.scaling = 1.0  # the attention's, for an observation made when waiting queries join
        self._observe_joins()
        scorer_states[layer_idx] = None

    def _observe_joins(self) -> None:
        """Where decode queries wait and the scorer observes forwards, it sees them as they join
        the window, before they are kept (the window calls back; weakly: it must not keep the step)."""
        if not (self.query_wait and self.observes_steps):
            return
        me = weakref.ref(self)

        def observe(query: torch.Tensor, index: torch.Tensor, positions: torch.Tensor) -> None:
            step = me()
            if step is not None:
                obs = step.observation(query.detach(), index, positions, step.scaling, tokens=False)
                with step.timer.section("on_step"):
                    step.policy.scorer.on_step(obs, None)

        self.window.on_join = observe

    @property
    def past_prompt(self) -> bool:
        """Whether the prompt is complete (the schedule's state is made): rows may join."""
        return self._schedule_ready

    # ------------------------------------------------------------ LayerView
    @property
    def storage(self) -> StepStorage:
        return self._storage()

    token_index = property(lambda self: self.storage.token_index)
    n_valid = property(lambda self: self.storage.n_valid)
    live_upper = property(lambda self: self.storage.live_upper)
    shape = property(lambda self: self.storage.shape)
    dtype = property(lambda self: self.storage.dtype)
    n_recent = property(lambda self: self.policy.n_recent)
    n_sink = property(lambda self: self.policy.n_sink)

    def to(self, device: torch.device) -> None:
        """Budgets and targets on the device of the keys (known at the first forward)."""
        self.budgets, self.targets = self.budgets.to(device), self.targets.to(device)

    def observation(self, queries, index, positions, scaling: float, tokens: bool = True) -> Observation:
        """What a scorer sees of this layer: these queries over the stored tokens (without
        `tokens`, none: an `on_step` that reads no stored token, and a storage that makes its
        token index when asked, vLLM's pool, does not make it every step)."""
        policy, storage = self.policy, self.storage
        return Observation(
            queries=queries,
            query_index=index,
            token_index=storage.token_index if tokens else None,
            scaling=scaling,
            state=storage.token_state if tokens else {},
            layer_idx=self.layer_idx,
            query_positions=positions,
            rope_inv_freq=policy.rope_inv_freq,
            rope_attention_scaling=policy.rope_attention_scaling,
            prompt_end=self.window.prompt_end,
            targets=self.targets,
            scorer_state=self.states.scorer,
        )

    # ------------------------------------------------------------ the step
    def advance(self, q: int, first_index: torch.Tensor | None = None) -> int:
        """Count a forward of q new tokens a row (stored by the engine); returns the first one's
        index. Rows at different positions (a serving engine's pool of requests) give each
        row's first index [R]: `seen` then counts the forwards' tokens, the same for every row."""
        self.new_start, self.seen = self.seen, self.seen + q
        self.first_index = first_index
        return self.new_start

    def after_attention(
        self,
        query: torch.Tensor,
        positions: torch.Tensor | None,
        scaling: float,
        new_valid: torch.Tensor | None = None,
    ) -> torch.Tensor | None:
        """This forward's queries [R, Hq, q, D] (post-RoPE, attended already), their RoPE
        positions ([R or 1, q]; None: their sequence indices) and padding (`new_valid` [R, q],
        False: padding). Returns the rows that compressed, or None."""
        policy, storage = self.policy, self.storage
        first = self.new_start if self.first_index is None else self.first_index
        self.scaling = scaling
        if not self._observers_ready:
            self._new_observer_states(query)
        keys = None
        if self.query_wait:
            self.window.wait(query, first, positions, self.window_keep, self.query_wait)
        else:
            index, positions = self.window.label(query, first, new_valid, positions)
            storage.record_positions(index, positions)
            if self.observes_steps or self.allocator_observes:
                tokens = self.allocator_observes or policy.scorer.step_reads_keys
                step = self.observation(query.detach(), index, positions, scaling, tokens)
                needs_keys = self.allocator_observes or policy.scorer.step_needs_keys(
                    self.states.scorer, query.shape[2]
                )
                keys = storage.read_keys() if needs_keys else None
                if self.observes_steps:
                    with self.timer.section("on_step"):
                        policy.scorer.on_step(step, keys)
                if self.allocator_observes:
                    with self.timer.section("utility"):
                        policy.head_allocator.on_step(step, keys, self.states.head_allocator)
            self.window.keep(query, index, positions, self.window_keep)
        if not self._schedule_ready:
            if self.seen < self.prompt_end:  # a prompt chunk before its last: observe only
                return None
            self.states.schedule = policy.schedule.new_state(self)
            self._schedule_ready = True
        rows = policy.schedule.rows_to_compress(self, self.states.schedule)
        if rows is None:
            return None
        if hasattr(storage, "rows_copy") and rows.shape[0] > 1 and not bool(rows.all()):
            return self._compress_apart(rows, scaling, keys)
        self._compress(rows, scaling, keys)
        return rows

    def _compress(self, rows: torch.Tensor, scaling: float, keys: torch.Tensor | None) -> None:
        """Score, split and select the rows `rows` [R] compress (the others keep everything)."""
        policy, storage, schedule = self.policy, self.storage, self.policy.schedule
        keys = storage.read_keys() if keys is None else keys
        obs = self.observation(*self.window.last(self.window_size), scaling)
        values = storage.read_values()
        with self.timer.section("score"):
            scores = policy.scorer.score(obs, keys, values)
        keep = schedule.keep(self, self.states.schedule)
        if policy.head_allocator is not None:
            request = SplitRequest(keep.sum(-1), obs, scores, storage.n_valid, keys, policy.protected, rows)
            with self.timer.section("split"):
                keep = policy.head_allocator.split(request, self.states.head_allocator)
        keep = torch.where(rows[:, None], keep, storage.n_valid)
        with self.timer.section("compress"):
            self.select(keep, scores)

    def _compress_apart(self, rows: torch.Tensor, scaling: float, keys: torch.Tensor | None) -> torch.Tensor:
        """Compress rows `rows` [R] of a storage whose rows come and go (`RowsStorage`) apart
        from the others: they are copied out, compressed, and written back in their place (the
        copies' policy states and slots; scoring reads the window, it does not change it). The
        others are not scored, nor read for it, nor copied (a pool of requests where a few
        compress a step)."""
        storage: RowsStorage = self.storage
        chosen_rows = [r for r, yes in enumerate(rows.tolist()) if yes]  # the one read of the split
        chosen = torch.tensor(chosen_rows, dtype=torch.long, device=rows.device)
        self.settle(chosen_rows)  # every row's waiting queries join; these rows' queues settle
        part = storage.rows_copy(chosen)
        step = self.rows_copy(chosen, part)
        if keys is not None:  # read for on_step: these rows', as wide as their longest
            keys = keys[chosen, :, : part.token_index.shape[-1]]
        step._compress(torch.ones_like(chosen, dtype=torch.bool), scaling, keys)
        self.states.put_rows(chosen_rows, step.states, chosen)
        storage.put_rows(chosen_rows, part, chosen)
        return rows

    def _new_observer_states(self, query: torch.Tensor) -> None:
        """The scorer's and head allocator's memory, made at the first forward (the prompt's
        first chunk: they observe every chunk), and the prompt's end as the window knows it."""
        policy = self.policy
        rows, self.n_query_heads = query.shape[0], query.shape[1]
        if self.prompt_end is None:
            self.prompt_end = self.seen  # the first forward is the whole prompt
        self.window.prompt_end = torch.full((rows,), self.prompt_end, dtype=torch.long, device=query.device)
        self.states.scorer = policy.scorer.new_state(self)
        if policy.head_allocator is not None:
            self.states.head_allocator = policy.head_allocator.new_state(self)
        self.scorer_states[self.layer_idx] = self.states.scorer
        self._observers_ready = True

    def select(self, keep: torch.Tensor, scores: torch.Tensor) -> None:
        """Keep `keep` [R, H] tokens a head chosen by `scores` [R, H, T]: protected first, then
        the top scores (one token selection for every method and engine)."""
        policy, storage = self.policy, self.storage
        index = storage.token_index
        prompt_end = self.window.prompt_end if policy.protect_prompt else None
        protected = protected_mask(index, policy.n_sink, policy.n_recent, prompt_end)
        single = storage.single_evictions(keep, protected)
        if single is not None:
            # An every-step schedule's usual step: argmin instead of ranking every token.
            storage.evict_slot(evict_one(scores, index, protected, single), scores)
            return
        slots, new_len = select_tokens(scores, index, keep, protected)
        storage.keep_slots(slots, new_len, scores)

    # ------------------------------------------------------------ planning
    def steps_until_compress(self) -> int | None:
        """Tokens one forward can take without passing this layer's next compression (None: never)."""
        return self.policy.schedule.steps_until_compress(self, self.states.schedule)

    def slack(self) -> int | None:
        """Tokens a head may gain after a compression before the next one (None: unbounded)."""
        return self.policy.schedule.slack(self, self.states.schedule)

    def select_rows(self, rows: torch.Tensor) -> None:
        """Keep rows `rows` [R'] of the window and the policies' states (beam search; a request
        leaving a serving engine's pool)."""
        self.window.select_rows(rows)
        self.states.select_rows(rows)
        if self.first_index is not None:
            self.first_index = self.first_index.index_select(0, rows.to(self.first_index.device))

    def join_rows(self, other: LayerStep) -> None:
        """Append `other`'s rows (its window and policy states) after this step's: a request
        whose prompt is complete joins a serving engine's pool of requests at other positions.
        Both steps are past their prompts and run the same policy; queued queries are taken in
        first (`Scorer.settle`). The storages join apart (the engine owns them)."""
        policy = self.policy
        if other.policy is not policy:
            raise ValueError("rows join only a step of the same policy")
        if not (self._schedule_ready and other._schedule_ready):
            raise ValueError("rows join once both steps are past their prompts")
        if not policy.joins_rows:
            raise ValueError(f"{policy.scorer.describe()} / {policy.schedule.describe()}: rows cannot join")
        self.settle()
        other.settle()
        self._take_rows(other)

    def _take_rows(self, other: LayerStep) -> None:
        self.window.join_rows(other.window)
        self.states.join_rows(other.states)
        if self.first_index is not None or other.first_index is not None:
            self.first_index = None  # set by the next `advance`

    def settle(self, rows: list[int] | None = None) -> None:
        """Take in what the scorer's state holds back (`Scorer.settle`): before rows join, or
        (`rows` only) before they are scored apart."""
        policy = self.policy
        self.window.join()  # waiting queries first: what the scorer observes of them is held back too
        policy.scorer.settle(self.states.scorer, policy.rope_inv_freq, policy.rope_attention_scaling, rows)

    def rows_copy(
        self, rows: torch.Tensor, storage: StepStorage, scorer_states: list | None = None
    ) -> LayerStep:
        """A step of rows `rows` [R'] only over `storage` (copies of the window and states;
        this step is unchanged). With `scorer_states` (a list of every layer's), the copy's
        scorer state takes its place there: the rows leave for a pool of their own."""
        out = copy.copy(self)
        out._storage = weakref.ref(storage)
        out.window = self.window.rows_copy(rows)
        out._observe_joins()
        out.scorer_states = self.scorer_states if scorer_states is None else scorer_states
        out.states = self.states.rows_copy(rows, self.window, out.window, out.scorer_states)
        if scorer_states is not None:
            scorer_states[self.layer_idx] = out.states.scorer
        if self.first_index is not None:
            out.first_index = self.first_index.index_select(0, rows.to(self.first_index.device))
        return out

    def tensors(self) -> list[torch.Tensor]:
        """What the step holds: the query window, budgets and targets, the policies' states."""
        return self.window.tensors() + [self.budgets, self.targets] + self.states.tensors()
