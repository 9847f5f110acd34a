"""A layer's storage reallocations, counted by running the real layer over K/V of one byte.

Memory planning (`harness/bench/capacity`) needs to know when a layer's storage grows and
compacts, and to what size. Those rules live in `CompressedLayer` (growth towards the trigger,
holes, compaction into the kept tokens plus slack) and the schedule decides when they apply, so
the plan is taken from them rather than from a second model of them: a `CompressedLayer` of the
method's schedule and protection takes a prompt and decode steps of one-byte keys and values
(one sequence, no model), and a meter that counts slots records each reallocation.

Which tokens a compression keeps does not change how many it keeps (the schedule's `keep`,
protection, one budget a head), so StreamingLLM's scorer, which reads no K/V, stands in for
the method's. Forwards are as long as the schedule allows (`steps_until_compress`) and
storage has room, so a method that compresses every few hundred tokens takes a few forwards.
And once a compression leaves the layer where an earlier one left it (its storage's slots,
per-head counts and holes, the schedule's distance to the next compression), the steps after
it repeat those since that earlier one, so the run stops there: a method that evicts at every
token runs one cycle of holes and compaction, not the whole sequence.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from typing import TypeVar

import torch

from reasonkv.core.layer import CompressedLayer
from reasonkv.core.memory_meter import MemoryMeter
from reasonkv.core.policy.scorers.streaming import StreamingScorer
from reasonkv.core.step import LayerPolicy

T = TypeVar("T")

Allocations = dict[int, list[tuple[int, int]]]
"""One layer's storage reallocations: step (0 the prefill, i the i-th decode step) -> the
(old, new) slot counts of each, in order (a growth in `update`, then a compaction)."""


class SlotCounter(MemoryMeter):
    """A meter that records each storage reallocation as (old, new) slots at the current step."""

    def __init__(self) -> None:
        super().__init__()
        self.events: Allocations = {}
        self.step = 0
        self.slots = 0

    def add(self, *tensors: torch.Tensor) -> None:
        super().add(*tensors)
        new = tensors[0].shape[2]  # keys [B, H, capacity, D]: the storage's new slots
        self.events.setdefault(self.step, []).append((self.slots, new))
        self.slots = new


def count_allocations(
    policy: LayerPolicy, budgets: torch.Tensor, prompt: int, n: int, *, repeat: bool = True
) -> Allocations:
    """Storage reallocations of one layer with per-head `budgets` [H] under `policy` (its
    schedule and protection) through a prefill of `prompt` tokens and `n` decode steps of one
    token, one sequence. `repeat` False steps every cycle instead of repeating the first that
    recurs. The layer's K/V must be stored as the model computes them, and how many tokens a
    head keeps must not depend on which (no head allocator): a ValueError says which is not so
    (`harness/bench/capacity.unpredictable` names every setting the planner cannot follow)."""
    fmt = policy.kv_format
    if fmt is not None and fmt.below_model_precision:
        raise ValueError(
            "slot counting follows K/V stored as the model computes them, not quantized or tiered"
        )
    if policy.head_allocator is not None:
        raise ValueError(
            "slot counting needs heads whose budgets do not move with their scores (a head allocator)"
        )
    counter = SlotCounter()
    layer = CompressedLayer(0, budgets, dataclasses.replace(policy, scorer=StreamingScorer()), meter=counter)
    heads = budgets.numel()

    def forward(q: int) -> None:
        kv = torch.zeros(1, heads, q, 1, dtype=torch.uint8)
        layer.update(kv, kv)
        layer.after_attention(torch.zeros(1, heads, q, 1), None, 1.0)

    forward(prompt)
    step, compressed, cycles = 0, layer.n_compressions, {}
    while step < n:
        # As far as the next compression and the storage's room go (one token to grow), so
        # every reallocation falls at the step it falls at one token a forward.
        until, room = layer.steps_until_compress(), layer.storage.capacity - layer.storage.used
        q = max(1, min(n - step, room, n if until is None else until))
        step = counter.step = step + q
        forward(q)
        compressed_now = layer.n_compressions > compressed
        compressed = layer.n_compressions
        if not (repeat and compressed_now):
            continue
        state = _state(layer)
        if state in cycles:
            return _repeated(counter.events, cycles[state], step, n)
        cycles[state] = step
    return counter.events


def per_layer(budgets: Iterable[torch.Tensor], count: Callable[[torch.Tensor], T]) -> list[T]:
    """`count(row)` for each layer's per-head budgets, run once per distinct row: alike layers
    (every layer of a uniform allocator) count once."""
    rows = [tuple(row.tolist()) for row in budgets]
    counted = {row: count(torch.tensor(row)) for row in dict.fromkeys(rows)}
    return [counted[row] for row in rows]


def _state(layer: CompressedLayer) -> tuple:
    """What the next steps of `layer` depend on: its storage's shape and layout and the
    schedule's distance to its next compression (not the sequence's length)."""
    s = layer.storage
    counts = tuple(torch.cat([s.lengths, s.n_valid]).flatten().tolist())
    return (s.used, s.capacity, s.holes, s.ragged, counts, layer.steps_until_compress())


def _repeated(events: Allocations, start: int, end: int, n: int) -> Allocations:
    """`events` up to step `end`, and those of steps (start, end] repeated every `end - start`
    steps up to step `n`: the layer was at `end` where it was at `start`."""
    period, out = end - start, dict(events)
    cycle = {t: e for t, e in events.items() if start < t <= end}
    for offset in range(period, n - start, period):
        for t, e in cycle.items():
            if t + offset <= n:
                out[t + offset] = list(e)
    return out
