"""When to compress. Pure arithmetic on per-head budgets; no tensors of the model.

A schedule maps a head's budget b to two lengths:
- trigger(b): once a head holds this many real tokens, the layer compresses;
- target(b):  how many tokens it keeps after compressing.
So a head never holds more than trigger(b) tokens, and storage for trigger(b) slots is
enough until the next compression (the cache preallocates exactly that).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Schedule:
    name: str = "never"

    def trigger(self, budget: int) -> int | None:
        """Real tokens per head at which to compress; None = never compress."""
        return None

    def target(self, budget: int) -> int:
        return budget

    def describe(self) -> str:
        return self.name


@dataclass(frozen=True)
class EveryStep(Schedule):
    """Keep exactly `budget` after every step (H2O, TOVA, StreamingLLM)."""

    name: str = "every-step"

    def trigger(self, budget: int) -> int:
        return budget + 1


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
