"""When to compress. Pure arithmetic on per-head budgets; no tensors of the model.

A schedule maps a head's budget b to two lengths:
- trigger(b): once a head holds this many real tokens, the layer compresses;
- target(b):  how many tokens it keeps after compressing.
So a head never holds more than trigger(b) tokens, and storage for trigger(b) slots is
enough until the next compression (the cache preallocates exactly that).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from reasonkv.core.policy.base import EMPTY


@dataclass(frozen=True)
class Schedule:
    name: str = "never"
    evicts_every_step: ClassVar[bool] = False
    """True when the cache is full after every step (so a chunked replay goes token by token)."""

    def trigger(self, budget: int) -> int | None:
        """Real tokens per head at which to compress; None = never compress."""
        return None

    def target(self, budget: int) -> int:
        return budget

    def hole_slots(self, budget: int) -> int:
        """Evicted tokens that may stay in storage as holes (masked, never attended or scored)
        before a layer whose smallest head budget is `budget` is compacted; 0 = compact at
        every compression."""
        return 0

    def describe(self) -> str:
        return self.name

    def steps_until_compress(self, layer) -> int | None:
        """The most tokens the layer can take in one forward without passing a compression
        point (None = never compresses): a layer compresses when its real tokens summed over
        heads reach sum_h trigger(b_h), and each token adds one per head, so it has
        ceil((trigger_total - live) / H) tokens to go (the fewest over batch rows)."""
        triggers = [self.trigger(int(b)) for b in layer.budgets.tolist()]
        if triggers[0] is None:
            return None
        if not layer.is_initialized:
            return 1
        to_go = sum(triggers) - layer.n_valid.sum(-1)  # [B]
        heads = layer.n_valid.shape[1]
        return max(1, int(((to_go + heads - 1) // heads).min()))


@dataclass(frozen=True)
class EveryStep(Schedule):
    """Keep exactly `budget` after every step (H2O, TOVA, StreamingLLM).

    Eviction is every step, compaction every k = min(`compact_every`, budget // 8) steps
    (at least 1): in between, an evicted token's slot becomes a hole (EMPTY: never attended,
    scored or kept), so a decode step does not gather the whole cache into fresh storage.
    Storage holds at most budget + k slots (≤ 1/8 more); every head attends to exactly
    `budget` tokens either way."""

    name: str = "every-step"
    compact_every: int = 16
    evicts_every_step: ClassVar[bool] = True

    def __post_init__(self) -> None:
        if self.compact_every < 1:
            raise ValueError(f"compact_every must be at least 1, got {self.compact_every}")

    def trigger(self, budget: int) -> int:
        return budget + 1

    def hole_slots(self, budget: int) -> int:
        return max(1, min(self.compact_every, budget // 8)) - 1

    def describe(self) -> str:
        return "every-step" if self.compact_every == 1 else f"every-step (compact every {self.compact_every})"


@dataclass(frozen=True)
class FixedBuffer(Schedule):
    """Let the cache grow by `interval` tokens, then compress back to the budget
    (R-KV, decode-time SnapKV: compress to B every 128 steps)."""

    name: str = "buffer"
    interval: int = 128

    def trigger(self, budget: int) -> int:
        return budget + self.interval

    def describe(self) -> str:
        return f"buffer(every {self.interval})"


@dataclass(frozen=True)
class MaxMinThreshold(Schedule):
    """The budget is B_max; on reaching it, evict `fraction`·B_max tokens at once (BeaconKV)."""

    name: str = "threshold"
    fraction: float = 1 / 8

    def trigger(self, budget: int) -> int:
        return budget

    def target(self, budget: int) -> int:
        return budget - max(1, int(budget * self.fraction))

    def describe(self) -> str:
        return f"max/min threshold (evict {self.fraction:g} at B_max)"


NEVER = Schedule()


@dataclass
class _PeriodicState:
    """Per-layer bookkeeping of PeriodicRatio (lives in `layer.extras`, never in the schedule,
    which all layers share)."""

    period: int  # P
    per_period: int  # T = P / c
    prompt: torch.Tensor  # [B] real prompt tokens per row (never evicted: protect_prompt)
    done: torch.Tensor  # [B] compressions so far per row (m)
    seen: int  # layer.seen at the last check
    gen_upper: int  # python upper bound of max_b generated tokens held, to skip the check cheaply
    min_done: int = 0
    rows: torch.Tensor | None = None  # [B] bool: the rows firing now


@dataclass(frozen=True)
class PeriodicRatio(Schedule):
    """RPC's schedule: every P generated tokens, keep P/c of them (Song et al., arXiv 2505.13866).

    With R = the protected recent window (`n_recent`) and m = compressions so far, a row
    compresses when the generated tokens it holds reach m·P/c + R + P, i.e. the first time
    at P + R generated tokens and then every P tokens, and keeps its prompt +
    (m+1)·P/c selected generated tokens + R. The cache therefore grows by P/c per period
    (overall ≈ 1/c of the generated tokens), it is not bounded by the budget.

    budget = P/c, the tokens retained per period; P = budget·ratio unless `interval` is set,
    in which case P = interval and P/c = interval // ratio (the budget then only needs to be
    positive). One P per layer (its largest head budget). Counts assume the prompt is kept
    (protect_prompt, the rpc default); per-row state lives in `layer.extras`, so rows may be
    at different compression counts, and follows the rows when beam search reorders them.
    """

    name: str = "periodic"
    interval: int | None = None
    ratio: float = 4.0

    _KEY = "periodic_ratio"

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

    def trigger(self, budget: int) -> None:
        return None  # no fixed size: rows_to_compress decides from the layer

    def target(self, budget: int) -> int:
        # Only make_cache's check reads this (keep() sizes the cache): the prompt and the recent
        # window are kept on top of the selected tokens, so no budget is below the protected set.
        self.period(budget)
        return 1 << 62

    def describe(self) -> str:
        p = "budget·ratio" if self.interval is None else str(self.interval)
        return f"periodic(every P={p} tokens keep P/{self.ratio:g})"

    def select_rows(self, extras: dict, rows: torch.Tensor) -> None:
        st = extras.get(self._KEY)
        if st is None:
            return
        st.prompt, st.done = st.prompt.index_select(0, rows), st.done.index_select(0, rows)
        st.rows = None if st.rows is None else st.rows.index_select(0, rows)
        st.min_done = int(st.done.min())  # gen_upper, a max over rows, stays an upper bound

    def _state(self, layer) -> _PeriodicState:
        st = layer.extras.get(self._KEY)
        if st is None:
            p, t = self.period(int(layer.budgets.max()))
            index = layer.token_index[:, :, : layer.used]
            prompt = ((index < layer.prompt_end[:, None, None]) & (index != EMPTY)).sum(-1).amax(-1)
            gen = layer.n_valid.amax(-1) - prompt
            st = _PeriodicState(p, t, prompt, torch.zeros_like(prompt), layer.seen, int(gen.max()))
            layer.extras[self._KEY] = st
        elif st.prompt.shape[0] != layer.n_valid.shape[0]:
            raise RuntimeError("periodic schedule: the batch changed size mid-generation; start a new cache")
        return st

    def rows_to_compress(self, layer) -> torch.Tensor | None:
        st = self._state(layer)
        st.gen_upper += layer.seen - st.seen
        st.seen = layer.seen
        recent = layer.policy.n_recent
        if st.gen_upper < st.min_done * st.per_period + recent + st.period:
            return None
        gen = layer.n_valid.amax(-1) - st.prompt
        st.rows = gen >= st.done * st.per_period + recent + st.period
        return st.rows if bool(st.rows.any()) else None

    def keep(self, layer) -> torch.Tensor:
        st = self._state(layer)
        recent = layer.policy.n_recent
        st.done = st.done + st.rows.long()
        kept_gen = st.done * st.per_period + recent
        gen = layer.n_valid.amax(-1) - st.prompt
        st.gen_upper = int(gen.where(~st.rows, kept_gen).max())
        st.min_done = int(st.done.min())
        return (st.prompt + kept_gen)[:, None].expand_as(layer.n_valid)

    def steps_until_compress(self, layer) -> int:
        """Generated tokens until `done·P/c + R + P` (the fewest over rows); 1 before the
        layer's state exists."""
        st = layer.extras.get(self._KEY) if layer.is_initialized else None
        if st is None:
            return 1
        gen = layer.n_valid.amax(-1) - st.prompt  # [B] generated tokens held (the largest head)
        threshold = st.done * st.per_period + layer.policy.n_recent + st.period
        return max(1, int((threshold - gen).min()))

    def slack(self, layer) -> int:
        """Tokens a head gains before the next compression: P + R before the first one, then P."""
        st = layer.extras.get(self._KEY)
        if st is None:
            return self.period(int(layer.budgets.max()))[0] + layer.policy.n_recent
        return st.period + (layer.policy.n_recent if st.min_done == 0 else 0)
