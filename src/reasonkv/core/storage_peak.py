"""One sequence's K/V peak while it decodes, at a storage setting, before anything runs: the
bytes are metered on the real layer and its real storage, not modelled beside them.

How `make_cache` tells a quantized setting that can never quantize a token, or that holds more
than kv_bits=16 would (`core/storage_pays`). For each distinct row of per-head budgets, one
`CompressedLayer` of the method's schedule, protection and storage (`KVStorage`, or
`QuantizedKVStorage` with its residual, groups, sinks and basis) takes a one-token prompt and
decode steps of zero keys and values of the model's KV heads and head dim (one sequence, no
model), with a meter of its own, counting bytes as the cache's `peak_kv_bytes_16bit` does.

From its first compaction on the layer is in its steady state: `held` is the most it holds
between steps, `excess` the most one of its steps holds above what it held before (the step's
dequantized copy, a compaction's new storage beside the old, a chunk of keys or of a basis's
read). Layers step one after another, so the model's peak is every layer's holding and one
layer's excess at once (`peak`). That is exact for layers whose storage keeps one size once
it compacts (`LayerPeak.steady`); for the others it is an upper bound.

As in `core/slot_count`, which tokens a compression keeps does not change how many, so
StreamingLLM's scorer stands in for the method's. The way to the first compaction is one
forward (what that compaction lays out does not depend on it); after it a forward takes as many
tokens as reach the next compression, the next group leaving the residual or the storage's
room, where the steps' peak falls (one token at a time reaches the same sizes there, and
smaller ones before). Heads of one budget run as one head, their bytes times the heads (every
tensor a storage holds is per head). The prompt's forward, the low tier (the same at both
widths) and left padding are left out. `tests/core/test_storage_pays.py` checks these peaks
against real caches' meters, byte for byte.

A run costs what its quantizations and compactions cost: tens of milliseconds a budget row at
budget 512 (`benchmarks/storage_check_speed.py`), so each is kept for the process.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from reasonkv.core.layer import GROWTH_CHUNK, CompressedLayer
from reasonkv.core.memory_meter import MemoryMeter
from reasonkv.core.policy.scorers.streaming import StreamingScorer
from reasonkv.core.quantize import KVFormat
from reasonkv.core.step import LayerPolicy

NO_LOW_TIER = KVFormat()
LOW_TIER_KNOBS = ("low_budget", "low_bits", "low_group_size")

COMPACTIONS = 2
"""Compactions a run passes: the first ends the growth, the steps up to the second (and its
own) are the steady state."""


@dataclass(frozen=True)
class LayerPeak:
    """One layer's K/V bytes (floats at 16 bits) in its steady state, as metered."""

    held: int
    """The most the layer holds between steps."""
    excess: int
    """The most one step holds above what the layer held before it."""
    steady: bool
    """Whether the layer held one size between every step (its storage keeps its size)."""
    quantizes: bool
    """Whether a token ever left the full-precision residual (always False at 16 bits)."""


_MEASURED: dict[str, LayerPeak | None] = {}
"""Runs already made in this process, by what they read: a cache made again (`CacheFactory`,
a sweep's units) is judged without running again."""


def measure_layer(policy: LayerPolicy, budgets: torch.Tensor, head_dim: int) -> LayerPeak | None:
    """The steady state of one layer of per-head `budgets` [H] under `policy`, its storage's
    bytes metered over a run of zero K/V of `head_dim` (see the module doc); None for a layer
    that never compacts. The policy's head allocator and low tier are left out: every head keeps
    its budget, and what eviction drops is not held here."""
    budgets, fmt = budgets.cpu(), policy.kv_format  # the run is on the CPU, whatever the cache's device
    if fmt is not None:  # no low tier: its knobs back to their defaults, so they do not split the key
        fmt = dataclasses.replace(fmt, **{name: getattr(NO_LOW_TIER, name) for name in LOW_TIER_KNOBS})
    # What the run reads, as field listings (the schedule and the format are plain dataclasses).
    key = repr((policy.schedule, policy.n_sink, policy.n_recent, policy.protect_prompt, fmt))
    key += f"{budgets.tolist()} {head_dim}"
    if key not in _MEASURED:
        # The rest of the run's policy is its own: StreamingLLM's scorer, no head allocator,
        # and for pre_rope a CPU stand-in for RoPE (zero keys turn to zero keys at any angle).
        inv_freq = torch.ones(head_dim // 2) if fmt is not None and fmt.pre_rope else None
        policy = dataclasses.replace(
            policy,
            scorer=StreamingScorer(),
            head_allocator=None,
            kv_format=fmt,
            rope_inv_freq=inv_freq,
            rope_attention_scaling=1.0,
        )
        if bool((budgets == budgets[0]).all()):  # alike heads: one runs, every tensor is per head
            one, n = _run(policy, budgets[:1], head_dim), budgets.numel()
            scaled = (
                None if one is None else dataclasses.replace(one, held=one.held * n, excess=one.excess * n)
            )
            _MEASURED[key] = scaled
        else:
            _MEASURED[key] = _run(policy, budgets, head_dim)
    return _MEASURED[key]


def _run(policy: LayerPolicy, budgets: torch.Tensor, head_dim: int) -> LayerPeak | None:
    plan = policy.schedule.plan([int(b) for b in budgets.tolist()])
    if plan.triggers is None:
        return None
    cycle = max(plan.trigger_max - min(plan.targets), plan.hole_slots + 1)
    n = plan.trigger_max + plan.hole_slots + COMPACTIONS * cycle + GROWTH_CHUNK
    meter = MemoryMeter()
    layer = CompressedLayer(0, budgets, policy, meter=meter)
    heads, seen, compactions = budgets.numel(), 0, 0
    held, excess, quantizes = [], [], False
    while seen <= n and compactions < COMPACTIONS:
        q = 1
        if layer.storage is not None:
            limits = [n - seen, layer.steps_until_compress()]
            if compactions:  # what the first compaction lays out does not depend on the way there
                limits += [layer.storage.capacity - layer.storage.used, layer.steps_until_settle()]
            q = max(1, min(x for x in limits if x is not None))
        before, used = meter.current_16bit, 0 if layer.storage is None else layer.storage.used
        meter.restart_peak()
        kv = torch.zeros(1, heads, q, head_dim)
        positions = torch.arange(seen, seen + q)[None]
        layer.update(kv, kv)
        layer.after_attention(torch.zeros(1, heads, q, head_dim), positions, 1.0)
        seen += q
        storage = layer.storage
        quantizes = quantizes or getattr(storage, "q_used", 0) > 0
        if compactions:
            held.append(meter.current_16bit)
            excess.append(meter.peak_16bit - before)
        compactions += storage.used < used + q  # tokens left the storage's slots
    if compactions < COMPACTIONS:
        return None
    return LayerPeak(max(held), max(excess), min(held) == max(held), quantizes)


def peak(layers: list[LayerPeak]) -> int:
    """The model's K/V peak while decoding: every layer's holding and the largest step's excess."""
    return sum(x.held for x in layers) + max(x.excess for x in layers)
