"""The contract between the cache and its policies: what a policy may read, and what it answers.

A method is a scorer (which tokens), a schedule (when, and how many), an allocator (budgets
per layer and head, once) and optionally a head allocator (budgets per head, at every
compression). The cache calls the hooks below and nothing else; every hook has a default, so
a policy defines only what it needs. A policy never receives the cache or its layers: it
reads a `LayerView` and keeps whatever it must remember in its own `PolicyState`, which the
cache stores per layer, reorders with the batch rows and drops on reset.

Pure torch: nothing here imports transformers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Protocol

import torch

from reasonkv.core.policy.base import Observation
from reasonkv.core.policy.knob import Declared


class PolicyState:
    """Per-layer memory of one policy. `ROW_FIELDS` names the tensors (or host lists) whose first
    axis is the batch row: they follow the rows when beam search reorders or repeats them."""

    ROW_FIELDS: ClassVar[tuple[str, ...]] = ()

    def select_rows(self, rows: torch.Tensor) -> None:
        picked = None
        for name in self.ROW_FIELDS:
            value = getattr(self, name)
            if isinstance(value, torch.Tensor):
                setattr(self, name, value.index_select(0, rows.to(value.device)))
            elif isinstance(value, list):  # a new list: a copy of these rows never shares it
                if len(set(value)) <= 1:  # one value for every row (lock-step): no read of `rows`
                    setattr(self, name, value[:1] * rows.shape[0])
                    continue
                picked = rows.tolist() if picked is None else picked
                setattr(self, name, [value[r] for r in picked])

    def rebind(self, old_window: QueryWindowView, window: QueryWindowView, layer_states: list) -> None:
        """Point this state (a copy of some rows of another's) at its own layer's query window
        (where it held `old_window`) and its own list of every layer's scorer states."""
        for name, value in vars(self).items():
            if value is old_window:
                setattr(self, name, window)

    def put_rows(self, rows: list[int], other: PolicyState, at: torch.Tensor) -> None:
        """Write `other` back as rows `rows` of this state (`at`: the same rows as a tensor on
        the state's device): `other` is a copy of those rows (`select_rows`), changed apart (a
        pool's rows that compress in a step). The row fields take its rows in place of theirs,
        in place; a number or string must agree, as in `join_rows` (a subclass whose counters
        can be reconciled says how)."""
        for name, mine in vars(self).items():
            theirs = getattr(other, name)
            if name in self.ROW_FIELDS:
                if isinstance(mine, torch.Tensor):
                    mine.index_copy_(0, at, theirs.to(mine.device))
                elif isinstance(mine, list):
                    mine = list(mine)  # a new list: a copy of these rows may share the old one
                    for r, value in zip(rows, theirs, strict=True):
                        mine[r] = value
                    setattr(self, name, mine)
            elif isinstance(mine, (int, float, str)) and mine != theirs:
                kind = type(self).__name__
                raise ValueError(f"{kind}: rows with {name} = {theirs} cannot go back to {mine}")

    def join_rows(self, other: PolicyState) -> None:
        """Append `other`'s rows after this state's (a serving engine's pool of requests: a
        request joins the pool when its prompt is complete). The row fields are concatenated;
        every other field must agree, as it is one value for all rows (a subclass whose
        counters can be reconciled says how, or settles them first: `Scorer.settle`)."""
        for name, mine in vars(self).items():
            theirs = getattr(other, name)
            if name in self.ROW_FIELDS:
                if isinstance(mine, torch.Tensor):
                    setattr(self, name, torch.cat([mine, theirs.to(mine.device)]))
                elif isinstance(mine, list):
                    setattr(self, name, mine + theirs)
            elif isinstance(mine, torch.Tensor):
                raise TypeError(f"{type(self).__name__}.{name}: a tensor that is not a row field")
            elif isinstance(mine, (int, float, str)) and mine != theirs:
                raise ValueError(f"{type(self).__name__}: rows with {name} = {mine} and {theirs} cannot join")


@dataclass(frozen=True)
class BudgetPlan:
    """One layer's schedule arithmetic, computed once from its per-head budgets."""

    triggers: tuple[int, ...] | None
    """Real tokens per head at which the layer compresses; None = never."""
    targets: tuple[int, ...]
    """Tokens each head keeps after compressing."""
    hole_slots: int
    """Evicted slots that may stay as holes before the layer is compacted (0 = compact each time)."""

    @property
    def trigger_max(self) -> int | None:
        return None if self.triggers is None else max(self.triggers)

    @property
    def trigger_total(self) -> int | None:
        return None if self.triggers is None else sum(self.triggers)


class QueryWindowView(Protocol):
    """The layer's recent queries: the window `score` reads plus the scorer's backlog."""

    queries: torch.Tensor | None  # [B, Hq, W, D], post-RoPE, oldest first
    query_index: torch.Tensor | None  # [B, W] sequence index, -1 for padding
    query_positions: torch.Tensor | None  # [B, W] RoPE position
    prompt_end: torch.Tensor | None  # [B] sequence index where generation starts

    @property
    def size(self) -> int: ...  # queries kept (decode queries waiting to join, joined first)
    @property
    def joined_size(self) -> int: ...  # queries kept, leaving any waiting ones waiting

    def span(
        self, start: int, end: int, *, join: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]: ...  # join=False: of the joined ones


class LayerView(Protocol):
    """What a policy may read about one layer (read-only: policies write only their state)."""

    @property
    def layer_idx(self) -> int: ...
    @property
    def budgets(self) -> torch.Tensor: ...  # [H] per-head budget
    @property
    def plan(self) -> BudgetPlan: ...
    @property
    def targets(self) -> torch.Tensor: ...  # [H] plan.targets on the layer's device
    @property
    def token_index(self) -> torch.Tensor: ...  # [B, H, T] sequence index per slot, EMPTY if none
    @property
    def n_valid(self) -> torch.Tensor: ...  # [B, H] real tokens per head
    @property
    def live_upper(self) -> int: ...  # an upper bound of max_b sum_h n_valid (no device sync)
    @property
    def seen(self) -> int: ...  # tokens fed so far, padding included
    @property
    def n_recent(self) -> int: ...  # the protected recent window
    @property
    def n_sink(self) -> int: ...  # the protected first real tokens
    @property
    def n_query_heads(self) -> int: ...  # attention heads (H * G)
    @property
    def shape(self) -> tuple[int, int, int, torch.device]: ...  # batch, KV heads, head dim, device
    @property
    def dtype(self) -> torch.dtype: ...  # the model's: of its keys, values and queries
    @property
    def window(self) -> QueryWindowView: ...
    @property
    def scorer_states(self) -> list: ...  # every layer's scorer state, for work batched across layers


class Scorer(Declared):
    """Which tokens to keep: higher score = keep. A scorer never decides how many.

    Hooks, in the order the cache calls them once per forward of a layer, after attention:
    `on_step(step, keys)` with THIS forward's queries (all of them) before anything is
    evicted; then, when the schedule fires, `score(obs, keys, values)` with the last `window`
    queries. The cache keeps `window` queries (at least 1) plus `query_backlog` older ones
    that `score` does not see, and per-token tensors named in `state_names` ([B, H, T] in
    `obs.state`, zero for new tokens, gathered with the keys at every eviction).
    """

    window: int = 1
    query_backlog: int = 0
    window_bits: int = 16
    """How the cache holds the queries it keeps for this scorer: in the model's dtype (16), or as
    8-bit codes with a scale a query (8), decoded when read."""
    state_names: ClassVar[tuple[str, ...]] = ()
    steps_may_wait: ClassVar[bool] = False
    """Whether `on_step` may see several decode forwards at once, as one forward of all their
    queries, when those join the window: an engine that lets decode queries wait
    (`LayerStep(query_wait=...)`) then runs it at the join instead of at every step. True for a
    scorer whose `on_step` reads no stored token and only counts or queues the queries, and
    which reads other layers' windows only as joined (`joined_size`, `span(join=False)`)."""
    step_reads_keys: ClassVar[bool] = True
    """Whether `on_step` reads the stored tokens: `keys`, and the observation's `token_index` and
    `state`. An engine whose K/V are not at hand (vLLM's paged cache) reads them for `on_step`
    only when this is true, and passes None otherwise (the observation's `token_index` too)."""
    state_grows: ClassVar[bool] = False
    """Whether this scorer's own memory grows with the sequence instead of being bounded by its
    settings (an ablation's unbounded buffers): no fixed-memory engine (vLLM) can host it, and
    no planner can predict its peak from one step."""

    def new_state(self, view: LayerView) -> PolicyState | None:
        """This scorer's memory for one layer (None = it needs none); made at the layer's first forward."""
        return None

    def state_vectors(self, n_query_heads: int, n_kv_heads: int) -> int:
        """Head-dim vectors this scorer's state holds per layer and sequence beside the query
        window (0: none): what its knobs make it hold, for an engine that bounds it up front."""
        return 0

    def step_needs_keys(self, state: PolicyState | None, q: int) -> bool:
        """Whether this forward's `on_step` (q queries) reads `keys`: an engine whose K/V are not
        at hand reads them only then (a scorer that sums its queries now and then says when)."""
        return self.step_reads_keys

    def keeps_old_prompt_queries(self) -> bool:
        """Whether this scorer's state may keep something of prompt queries older than the
        window (beacons fed by the prompt). A serving engine that skips the forward of a prompt
        prefix it shares with another request (prefix caching) never shows it those queries:
        such a scorer cannot start after a shared prefix. Default: a scorer that observes every
        forward (`on_step`) may; one that reads only its window does not. A scorer whose
        observations cannot matter after a shared prefix says so by overriding this."""
        return type(self).on_step is not Scorer.on_step

    def joins_rows(self) -> bool:
        """Whether one state of this scorer may hold rows at different positions, joined and
        split as a serving engine's requests come and go (`PolicyState.join_rows`). False where
        a counter shared by the rows cannot be settled without the keys (H2O's waiting sums)."""
        return True

    def settle(
        self,
        state: PolicyState | None,
        rope_inv_freq: torch.Tensor | None,
        attention_scaling: float,
        rows: list[int] | None = None,
    ) -> None:
        """Take in whatever `state` holds back for later (queued queries), so that its rows can
        join or leave another state's (`PolicyState.join_rows`). With `rows`, only those rows,
        which are about to be scored apart from the others (their scoring then finds nothing
        held back). Default: nothing is held back."""

    def on_step(self, step: Observation, keys: torch.Tensor | None) -> None:
        """See every query of this forward ([B, Hq, q, D] in `step`) over the stored keys [B, H, T, D]
        (None where `step_needs_keys` is false and the engine does not have them at hand)."""

    def score(self, obs: Observation, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """[B, H, T] scores for the stored keys [B, H, T, D]."""
        raise NotImplementedError


@dataclass(frozen=True)
class SplitRequest:
    """What a head allocator sees at one compression of one layer."""

    layer_total: torch.Tensor  # [B] tokens the layer keeps, summed over heads
    obs: Observation
    scores: torch.Tensor  # [B, H, T] the scorer's scores
    n_valid: torch.Tensor  # [B, H] real tokens per head now
    keys: torch.Tensor | None = None  # [B, H, T, D]
    min_tokens: int = 0  # no head below this (the protected window) unless it holds fewer
    rows: torch.Tensor | None = None  # [B] bool: the rows compressing now (others are discarded)


class HeadAllocator(Declared):
    """Moves a layer's budget between its heads at every compression (AdaKV, ReasonAlloc).
    `split` must keep each row's total exactly and give no head fewer than `min_tokens`."""

    query_backlog: int = 0  # queries the layer's window must hold for this allocator

    def new_state(self, view: LayerView) -> PolicyState | None:
        return None

    def on_step(self, step: Observation, keys: torch.Tensor, state: PolicyState | None) -> None:
        """See every query of this forward, as the scorer's `on_step` does (a per-step utility)."""

    def split(self, request: SplitRequest, state: PolicyState | None = None) -> torch.Tensor:
        """[B, H] tokens each head keeps."""
        raise NotImplementedError


class Allocator(Declared):
    """Budgets per (layer, KV head), set once when the cache is built."""

    def allocate(
        self, n_layers: int, n_kv_heads: int, budget: int, stats: dict | None = None
    ) -> torch.Tensor:
        """[n_layers, n_kv_heads] integers; sums exactly n_layers * n_kv_heads * budget."""
        raise NotImplementedError
