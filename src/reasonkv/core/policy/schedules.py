"""When to compress. Pure arithmetic on per-head budgets; no tensors of the model.

A schedule maps a head's budget b to two lengths:
- trigger(b): once a head holds this many real tokens, the layer compresses;
- target(b):  how many tokens it keeps after compressing.
So a head never holds more than trigger(b) tokens, and storage for trigger(b) slots is
enough until the next compression (the cache preallocates exactly that).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

import torch

from reasonkv.core.policy.base import EMPTY
from reasonkv.core.policy.contract import BudgetPlan, LayerView, PolicyState
from reasonkv.core.policy.knob import Declared, knob, tokens, unit

MAX_RATIO = 10**6
"""The largest compression ratio c of RPC's schedule (it keeps P/c of every P tokens)."""


@dataclass(frozen=True)
class Schedule(Declared):
    """Never compresses (the full cache); the base of every schedule.

    A budget schedule only defines `trigger`, `target` and `hole_slots`; the hooks below follow
    from them. A stateful schedule (RPC's) overrides the hooks and keeps its per-layer memory
    in its own `PolicyState`.
    """

    name: str = "never"
    evicts_every_step: ClassVar[bool] = False
    """True when the cache is full after every step (so a chunked replay goes token by token)."""

    def trigger(self, budget: int) -> int | None:
        """Real tokens per head at which to compress; None = never compress."""
        return None

    def target(self, budget: int) -> int:
        return budget

    def first_eviction(self, budget: int, n_recent: int) -> int | None:
        """The fewest tokens a request holds when it first loses one (None: never), for a
        serving engine to refuse a budget its longest request can never reach."""
        trigger, target = self.trigger(budget), self.target(budget)
        if trigger is None:
            return None
        if self.from_prompt_end:  # every trigger - target tokens after the prompt, whatever it holds
            return max(target + 1, 1 + trigger - target)
        return max(trigger, target + 1)

    def hole_slots(self, budget: int) -> int:
        """Evicted tokens that may stay in storage as holes (masked, never attended or scored)
        before a layer whose smallest head budget is `budget` is compacted; 0 = compact at
        every compression."""
        return 0

    def describe(self) -> str:
        return self.name

    @property
    def from_prompt_end(self) -> bool:
        """True when the layer compresses every `trigger - target` tokens counted from the
        prompt's end instead of at `trigger`: a head then holds up to max(prompt, target) +
        that many - 1 tokens, and the peak storage depends on the prompt's length."""
        return False

    def plan(self, budgets: list[int]) -> BudgetPlan:
        """A layer's triggers, targets and hole slots for its head budgets (computed once)."""
        triggers = [self.trigger(b) for b in budgets]
        never = triggers[0] is None
        return BudgetPlan(
            triggers=None if never else tuple(triggers),
            targets=tuple(self.target(b) for b in budgets),
            hole_slots=0 if never else self.hole_slots(min(budgets)),
        )

    # --------------------------------------------------------- hooks of the cache
    def new_state(self, view: LayerView) -> PolicyState | None:
        return None

    def rows_to_compress(self, view: LayerView, state: PolicyState | None) -> torch.Tensor | None:
        """[B] bool: the rows whose real tokens (summed over heads) reached the trigger, or None."""
        total = view.plan.trigger_total
        if total is None or view.live_upper < total:  # a python bound: no device sync
            return None
        rows = view.n_valid.sum(-1) >= total
        return rows if bool(rows.any()) else None

    def keep(self, view: LayerView, state: PolicyState | None) -> torch.Tensor:
        """[B, H] tokens each head keeps when its row compresses."""
        return view.targets.expand_as(view.n_valid)

    def slack(self, view: LayerView, state: PolicyState | None) -> int | None:
        """Tokens a head may gain after a compression before the next one (None = unbounded)."""
        plan = view.plan
        return None if plan.triggers is None else max(1, plan.trigger_max - min(plan.targets))

    def joins_rows(self) -> bool:
        """Whether one state may hold rows at different positions (`PolicyState.join_rows`):
        false where the schedule counts one number for every row (a count from the prompt's end)."""
        return True

    def steps_until_compress(self, view: LayerView, state: PolicyState | None) -> int | None:
        """The most tokens the layer can take in one forward without passing a compression
        point (None = never): each token adds one per head, so ceil((trigger_total - live) / H)
        tokens to go, the fewest over batch rows."""
        total = view.plan.trigger_total
        if total is None:
            return None
        if view.n_valid is None:  # before the layer's first forward
            return 1
        heads = view.n_valid.shape[1]
        to_go = total - view.n_valid.sum(-1)  # [B]
        return max(1, int(((to_go + heads - 1) // heads).min()))


@dataclass(frozen=True)
class EveryStep(Schedule):
    """Keep exactly `budget` after every step (H2O, TOVA, StreamingLLM).

    Eviction is every step, compaction every k = min(`compact_every`, budget // 8) steps
    (at least 1): in between, an evicted token's slot becomes a hole (EMPTY: never attended,
    scored or kept), so a decode step does not gather the whole cache into fresh storage.
    Storage holds at most budget + k slots (≤ 1/8 more); every head attends to exactly
    `budget` tokens either way.

    `evict_every` = n > 1 buffers the eviction, as BeaconKV's paper does at B_max: a head
    grows to budget + n tokens, then n go at once (one scoring and one selection every n steps
    instead of every step). It attends to up to n more tokens than the budget and holds them:
    an engine without holes (vLLM's block table) rewrites its cache once per n steps instead
    of at every step."""

    name: str = "every-step"
    compact_every: int = tokens(16)
    evict_every: int = tokens(1)
    evicts_every_step: ClassVar[bool] = True

    def trigger(self, budget: int) -> int:
        return budget + self.evict_every

    def hole_slots(self, budget: int) -> int:
        return max(1, min(self.compact_every, budget // 8)) - 1

    def describe(self) -> str:
        base = "every-step" if self.compact_every == 1 else f"every-step (compact every {self.compact_every})"
        return (
            base
            if self.evict_every == 1
            else f"{base}, evicting {self.evict_every} at budget + {self.evict_every}"
        )


@dataclass
class DecodeCountState(PolicyState):
    """One layer's next compression point under `FixedBuffer(phase="decode")`: a count of
    tokens fed, the same for every batch row (each forward adds its q tokens to every row)."""

    next_at: int  # `seen` at which the layer compresses next


@dataclass(frozen=True)
class FixedBuffer(Schedule):
    """Let the cache grow by `interval` tokens, then compress back to the budget
    (R-KV, decode-time SnapKV: compress to B every 128 steps)."""

    name: str = "buffer"
    interval: int = tokens(128)
    phase: Literal["budget", "decode"] = "budget"
    """When the compressions fall. "budget": whenever a head holds budget + interval real
    tokens (a longer prompt is compressed at prefill, by its own last queries). "decode":
    every `interval` tokens counted from the prompt's end, whatever the heads hold, as
    kvpress's DecodingPress does: the whole prompt stays until prompt + interval tokens, and
    the peak then depends on the prompt's length, not on the budget alone. The count is of
    forwarded columns, one for every row: in a left-padded batch every row compresses when
    the longest prompt's row would, so a row's numbers differ from its run alone."""

    def trigger(self, budget: int) -> int:
        return budget + self.interval

    def describe(self) -> str:
        start = ", counted from the prompt's end" if self.phase == "decode" else ""
        return f"buffer(every {self.interval}{start})"

    @property
    def from_prompt_end(self) -> bool:
        return self.phase == "decode"

    def joins_rows(self) -> bool:
        return self.phase == "budget"  # "decode": one count from the prompt's end for every row

    def new_state(self, view: LayerView) -> DecodeCountState | None:
        # Made at the layer's first forward (the prompt), once `seen` is the prompt's end.
        return DecodeCountState(view.seen + self.interval) if self.phase == "decode" else None

    def rows_to_compress(self, view: LayerView, state: DecodeCountState | None) -> torch.Tensor | None:
        if state is None:
            return super().rows_to_compress(view, state)
        if view.seen < state.next_at:
            return None
        return torch.ones(view.n_valid.shape[0], dtype=torch.bool, device=view.n_valid.device)

    def keep(self, view: LayerView, state: DecodeCountState | None) -> torch.Tensor:
        if state is not None:
            state.next_at = view.seen + self.interval
        return super().keep(view, state)

    def steps_until_compress(self, view: LayerView, state: DecodeCountState | None) -> int | None:
        if self.phase == "budget":
            return super().steps_until_compress(view, state)
        if state is None:  # before the layer's first forward
            return 1
        return max(1, state.next_at - view.seen)


@dataclass(frozen=True)
class MaxMinThreshold(Schedule):
    """The budget is B_max; on reaching it, evict `fraction`·B_max tokens at once (BeaconKV)."""

    name: str = "threshold"
    fraction: float = unit(1 / 8, open_low=True, open_high=True)

    def trigger(self, budget: int) -> int:
        return budget

    def target(self, budget: int) -> int:
        return budget - max(1, int(budget * self.fraction))

    def describe(self) -> str:
        return f"max/min threshold (evict {self.fraction:g} at B_max)"


NEVER = Schedule()


@dataclass
class PeriodicState(PolicyState):
    """One layer's RPC counters, per batch row (rows may be at different compression counts)."""

    period: int  # P
    per_period: int  # P/c
    prompt: torch.Tensor  # [B] real prompt tokens per row (never evicted: protect_prompt)
    done: torch.Tensor  # [B] compressions so far per row (m)
    seen: int  # tokens seen at the last check
    gen_upper: int  # python upper bound of max_b generated tokens held, to skip the check cheaply
    min_done: int = 0
    rows: torch.Tensor | None = None  # [B] bool: the rows firing now
    ROW_FIELDS = ("prompt", "done", "rows")

    def select_rows(self, rows: torch.Tensor) -> None:
        super().select_rows(rows)
        # gen_upper, a max over rows, stays an upper bound
        self.min_done = int(self.done.min()) if self.done.numel() else 0

    def put_rows(self, rows: list[int], other: PeriodicState, at: torch.Tensor) -> None:
        """The largest generated count stays an upper bound; the fewest compressions is read
        again (one sync), as when rows are selected: the rows written back have compressed, so
        a bound kept from before would only let more steps pass the cheap check."""
        if (self.period, self.per_period) != (other.period, other.per_period):
            raise ValueError("periodic schedule: rows of another period cannot return")
        self.prompt.index_copy_(0, at, other.prompt)
        self.done.index_copy_(0, at, other.done)
        self.rows = None  # set again at the next check
        self.gen_upper = max(self.gen_upper, other.gen_upper)
        self.min_done = int(self.done.min())

    def join_rows(self, other: PeriodicState) -> None:
        """The host bounds hold for both: the largest generated count, the fewest compressions."""
        if (self.period, self.per_period) != (other.period, other.per_period):
            raise ValueError("periodic schedule: rows of another period cannot join")
        self.prompt, self.done = torch.cat([self.prompt, other.prompt]), torch.cat([self.done, other.done])
        self.rows = None  # set again at the next check
        self.gen_upper = max(self.gen_upper, other.gen_upper)
        self.min_done = min(self.min_done, other.min_done)


@dataclass(frozen=True)
class PeriodicRatio(Schedule):
    """RPC's schedule: every P generated tokens, keep P/c of them (Song et al., arXiv 2505.13866).

    A row compresses when the generated tokens it holds reach m·P/c + R + P (m = compressions so
    far, R = the protected recent window), and keeps its prompt + (m+1)·P/c selected generated
    tokens + R: the cache grows by P/c per period, unbounded by the budget. budget = P/c, and
    P = budget·ratio unless `interval` sets P (then P/c = interval // ratio). One P per layer
    (its largest head budget); counts assume the prompt is kept (protect_prompt).
    """

    name: str = "periodic"
    interval: int | None = tokens(None)
    ratio: float = knob(4.0, ge=1.0, le=MAX_RATIO)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.interval is not None and self.interval // self.ratio < 1:  # no budget helps
            raise ValueError(
                f"interval {self.interval} keeps interval // ratio = 0 tokens a period at ratio "
                f"{self.ratio}: set interval >= ratio"
            )

    def period(self, budget: int) -> tuple[int, int]:
        """(P, P/c) for a head budget."""
        if self.interval is None:
            p, t = int(budget * self.ratio), budget
        else:
            p, t = self.interval, int(self.interval // self.ratio)
        if not 1 <= t <= p:
            raise ValueError(
                f"periodic schedule: keeping P/c = {t} tokens of every P = {p} needs ratio >= 1 and P/c >= 1"
            )
        return p, t

    def target(self, budget: int) -> int:
        # Only make_cache's check reads this (keep() sizes the cache): the prompt and the recent
        # window are kept on top of the selected tokens, so no budget is below the protected set.
        self.period(budget)
        return 1 << 62

    def first_eviction(self, budget: int, n_recent: int) -> int | None:
        """A one-token prompt and P + R generated tokens: the first period's selection (none
        where it keeps every token of the period, P/c = P)."""
        p, t = self.period(budget)
        return None if t >= p else 1 + n_recent + p

    def describe(self) -> str:
        p = "budget·ratio" if self.interval is None else str(self.interval)
        return f"periodic(every P={p} tokens keep P/{self.ratio:g})"

    def new_state(self, view: LayerView) -> PeriodicState:
        p, t = self.period(int(view.budgets.max()))
        index = view.token_index
        prompt_end = view.window.prompt_end
        prompt = ((index < prompt_end[:, None, None]) & (index != EMPTY)).sum(-1).amax(-1)
        gen = view.n_valid.amax(-1) - prompt
        return PeriodicState(p, t, prompt, torch.zeros_like(prompt), view.seen, int(gen.max()))

    def rows_to_compress(self, view: LayerView, state: PeriodicState) -> torch.Tensor | None:
        if state.prompt.shape[0] != view.n_valid.shape[0]:
            raise RuntimeError("periodic schedule: the batch changed size mid-generation; start a new cache")
        state.gen_upper += view.seen - state.seen
        state.seen = view.seen
        if state.gen_upper < state.min_done * state.per_period + view.n_recent + state.period:
            return None
        gen = view.n_valid.amax(-1) - state.prompt
        state.rows = gen >= state.done * state.per_period + view.n_recent + state.period
        return state.rows if bool(state.rows.any()) else None

    def keep(self, view: LayerView, state: PeriodicState) -> torch.Tensor:
        state.done = state.done + state.rows.long()
        kept_gen = state.done * state.per_period + view.n_recent
        gen = view.n_valid.amax(-1) - state.prompt
        state.gen_upper = int(gen.where(~state.rows, kept_gen).max())
        state.min_done = int(state.done.min())
        return (state.prompt + kept_gen)[:, None].expand_as(view.n_valid)

    def slack(self, view: LayerView, state: PeriodicState | None) -> int:
        """Tokens a head gains before the next compression: P + R before the first one, then P."""
        if state is None:
            return self.period(int(view.budgets.max()))[0] + view.n_recent
        return state.period + (view.n_recent if state.min_done == 0 else 0)

    def steps_until_compress(self, view: LayerView, state: PeriodicState | None) -> int:
        """Generated tokens until `done·P/c + R + P` (the fewest over rows); 1 before the state exists."""
        if state is None:
            return 1
        gen = view.n_valid.amax(-1) - state.prompt  # [B] generated tokens held (the largest head)
        threshold = state.done * state.per_period + view.n_recent + state.period
        return max(1, int((threshold - gen).min()))
