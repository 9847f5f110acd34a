"""Batch capacity at fixed memory: how many sequences' K/V fit, and how fast they decode together.

For each run, the peak K/V bytes of one sequence decoding to the target length are predicted
before anything decodes, from its layers' storage reallocations as the layers themselves make
them over one-byte K/V (`core/slot_count`, no model: `peak_kv_slots`); the batch is
the most sequences whose peaks fit in the given memory (`capacity_batch`). That batch then
decodes the reference tokens, one prompt repeated in every row and the same token fed to every
row at each step, so every row does the same model work as a batch-1 run. What is reported:
aggregate tokens/s (batch × tokens / decode seconds), its ratio to the full cache's, and the
predicted and measured (the cache's meter) peak K/V, checked against the limit.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from reasonkv.core.cache import CompressedCache
from reasonkv.core.hf_compat import cache_arg
from reasonkv.core.low_tier import LowTier
from reasonkv.core.memory_meter import MemoryMeter, held_bytes
from reasonkv.core.models import model_shape
from reasonkv.core.quantize import STORAGE_KNOBS, KVFormat
from reasonkv.core.slot_count import Allocations, count_allocations, per_layer
from reasonkv.harness.bench.decode import Progress, decode_many, eos_ids, reference_tokens
from reasonkv.harness.bench.memory import release_memory
from reasonkv.harness.bench.runs import BenchRun, is_plain_reference, is_reference, reference_method
from reasonkv.methods.api import make_cache
from reasonkv.methods.knobs import storage_knobs
from reasonkv.methods.registry import get_method
from reasonkv.methods.resolved import resolve_method
from reasonkv.util.formatting import format_bytes

MAX_BATCH = 256
"""The largest batch `--batch auto` picks (CPU runs stay bounded)."""


def peak_slots(layers: list[Allocations], since: int = 0) -> int:
    """The most slots the layers hold at once from step `since` on (0: the prefill too; 1: while
    decoding). Within a step the layers run in order, and a reallocating layer holds its old and
    new storage together until the copy is done (the cache's meter counts that moment too)."""
    total = peak = 0
    for step in sorted({step for events in layers for step in events}):
        if step >= since:
            peak = max(peak, total)  # what is held when the step begins
        for events in layers:
            for old, new in events.get(step, ()):
                if step >= since:
                    peak = max(peak, total + new)
                total += new - old
    return max(peak, total)


def peak_held(
    layers: list[Allocations],
    n_steps: int,
    since: int,
    kv_bytes: int,
    beside: list[Callable[[int, int], int]],
) -> int:
    """The most bytes one sequence holds at once from step `since` on, K/V and all beside it, as
    the cache's meter counts them: `kv_bytes` per K/V slot held (`layers`' reallocations, steps 0
    to `n_steps`) and what each layer holds beside K/V as it last recounted it (a layer recounts
    at the end of its step: `beside[i](slots, step)` for layer i of `slots` slots after `step`,
    never less at a later step).

    Only the steps where some layer reallocates, the steps just before them, `since` and the
    last are walked: between them nothing is reallocated and what is beside K/V only grows, so
    the most held over a stretch without reallocations is at its end."""
    total = peak = held_beside = 0  # K/V slots held; the most bytes; all layers' last recounts
    recounted = [0] * len(layers)  # what each layer held beside K/V at its last recount
    capacity = [0] * len(layers)
    moves = {step for events in layers for step in events}
    walked = {0, since, n_steps} | moves | {step - 1 for step in moves}
    for step in sorted(x for x in walked if 0 <= x <= n_steps):
        if 0 < step and since <= step:  # what is held when the step begins
            peak = max(peak, total * kv_bytes + held_beside)
        for i, events in enumerate(layers):
            for old, new in events.get(step, ()):
                if step >= since:  # the old and new storage held together
                    peak = max(peak, (total + new) * kv_bytes + held_beside)
                total += new - old
                capacity[i] = new
            now = beside[i](capacity[i], step)
            held_beside += now - recounted[i]
            recounted[i] = now
            if step >= since:
                peak = max(peak, total * kv_bytes + held_beside)
    return max(peak, total * kv_bytes + held_beside)  # no step from `since` on: what is held


def unpredictable(cache: CompressedCache, compresses: bool) -> str | None:
    """Why `peak_kv_slots` cannot follow this cache's schedule (None: it can)."""
    policy = cache.policy
    for layer in cache.layers:
        plan = layer.plan
        if plan.triggers is None and compresses:
            return "its schedule has no fixed trigger (the cache grows with the sequence)"
        if plan.triggers is not None and (len(set(plan.triggers)) > 1 or len(set(plan.targets)) > 1):
            return "its heads have different budgets within a layer"
    if policy.scorer.state_grows:
        return "its scorer's buffers grow with the sequence (an ablation that holds every past query)"
    if policy.head_allocator is not None:
        return "it re-splits the budget between heads at every compression"
    fmt = policy.kv_format
    if fmt is not None and fmt.quantized:
        return f"its K/V are quantized to {fmt.kv_bits} bits"
    if fmt is not None and fmt.below_model_precision:
        return f"it keeps a low tier of {fmt.low_budget} tokens per head beside its budget"
    return None


def peak_kv_slots(
    cache: CompressedCache, prompt: int, n: int, *, compresses: bool = True, decode_only: bool = False
) -> int:
    """Peak K/V storage slots (summed over layers) of one sequence of `prompt` tokens decoding
    `n` more through a fresh `cache` (built, not yet used); `decode_only`: after the prompt's
    forward (as replay's decode peak). A ValueError says why it cannot be predicted (see
    `unpredictable`)."""
    reason = unpredictable(cache, compresses)
    if reason is not None:
        raise ValueError(f"cannot predict the peak K/V of {cache.method} from its schedule: {reason}")
    return peak_slots(cache_allocations(cache, prompt, n), since=1 if decode_only else 0)


def cache_allocations(cache: CompressedCache, prompt: int, n: int) -> list[Allocations]:
    """Each layer's storage reallocations through a prefill of `prompt` tokens and `n` decode
    steps of one sequence, counted by running the layer (`count_allocations`; layers of the same
    budgets once)."""
    budgets = [layer.budgets for layer in cache.layers]
    return per_layer(budgets, lambda row: count_allocations(cache.policy, row, prompt, n))


@dataclass(frozen=True)
class StateShape:
    """What a cache holds beside K/V for one sequence, per layer, read off a cache that has taken
    one token: bytes a slot of its index and per-token state, bytes a kept query (with its index
    and position), bytes a row that do not grow (policy state, counters), the queries kept at
    most; and what it holds whatever the batch (budgets)."""

    slot: list[int]
    query: list[int]
    other: list[int]
    window: list[int]
    own: int

    def beside(self, layer: int, prompt: int) -> Callable[[int, int], int]:
        """Layer `layer`'s bytes beside K/V, one sequence, at `slots` slots after step `step`."""
        slot, query, other, window = (
            self.slot[layer],
            self.query[layer],
            self.other[layer],
            self.window[layer],
        )
        return lambda slots, step: slots * slot + other + query * min(prompt + step, window)


def state_shape(model, fresh: CompressedCache) -> StateShape:
    """Read a StateShape off `fresh` (a new cache of the method) by feeding it one token."""
    with torch.no_grad():
        model(input_ids=torch.ones(1, 1, dtype=torch.long, device=model.device), **cache_arg(fresh))
    meter = fresh.kv_meter
    slot, query, other, window, own = [], [], [], [], meter.beside_of("cache")
    for layer in fresh.layers:
        storage, shared = layer.storage, held_bytes([layer.budgets, layer.targets])[0]
        slot.append(held_bytes(storage.slot_tensors())[0] // storage.capacity)
        query.append(held_bytes(layer.window.query_tensors())[0])  # the one query kept
        other.append(meter.beside_of(layer.layer_idx) - slot[-1] * storage.capacity - query[-1] - shared)
        window.append(layer.window_keep)
        own += shared
    return StateShape(slot, query, other, window, own)


def peak_state_bytes(
    model,
    cache: CompressedCache,
    fresh: CompressedCache,
    prompt: int,
    n: int,
    *,
    compresses: bool = True,
    decode_only: bool = False,
    beside_only: bool = False,
) -> tuple[int, int]:
    """Peak bytes of everything one sequence of `prompt` tokens decoding `n` more holds (K/V,
    slot indices, query windows, policy state), predicted as `peak_kv_slots` predicts its K/V,
    and what the cache holds whatever its batch: (per sequence, per cache). `cache` and `fresh`
    are two new caches of the method (the second is fed a token to read its shapes).
    `beside_only`: the most held beside the K/V at once instead; it need not fall at the step of
    the K/V's peak, so that and the K/V's peak added bound the peak state from above. A
    ValueError says why it cannot be predicted."""
    layers, beside, own = _state_schedule(model, cache, fresh, prompt, n, compresses)
    per_slot = 0 if beside_only else slot_bytes(model)
    return peak_held(layers, n, 1 if decode_only else 0, per_slot, beside), own


def _state_schedule(
    model, cache: CompressedCache, fresh: CompressedCache, prompt: int, n: int, compresses: bool
) -> tuple[list[Allocations], list[Callable[[int, int], int]], int]:
    """Each layer's reallocations and bytes beside K/V (see `peak_held`), and the cache's own."""
    reason = unpredictable(cache, compresses)
    if reason is not None:
        raise ValueError(f"cannot predict the peak state of {cache.method} from its schedule: {reason}")
    shape = state_shape(model, fresh)
    layers = cache_allocations(cache, prompt, n)
    return layers, [shape.beside(i, prompt) for i in range(len(layers))], shape.own


def slot_bytes(model) -> int:
    """K/V bytes of one slot of one layer (every KV head's key and value) in the model's dtype."""
    shape = model_shape(model)
    dtype = next(model.parameters()).dtype
    return 2 * shape.n_kv_heads * shape.head_dim * torch.empty((), dtype=dtype).element_size()


@dataclass(frozen=True)
class AlonePeaks:
    """Predicted peaks of one sequence alone, in bytes as the model's dtype holds them: its K/V,
    everything it holds (K/V and all beside it), the most it holds beside K/V at once (which
    need not fall at the K/V's peak), and what the cache holds whatever its batch (`own`)."""

    kv: int
    state: int
    beside: int
    own: int


def alone_peaks(
    model, method: str, budget: int | None, knobs: dict, prompt: int, n: int, *, decode_only: bool = True
) -> AlonePeaks:
    """`AlonePeaks` of `method` at `budget` with `knobs` on `model`, one sequence of `prompt`
    tokens decoding `n` more one token a forward (`decode_only`: after the prompt's forward, as
    replay's decode peaks). A replay whose forwards take several tokens can peak elsewhere:
    lower where one forward crosses a point where storage grows (it grows once where this
    grows twice), higher with `phase=decode` and a prompt past the budget (found with blocks
    of 8). A ValueError says why the schedule cannot be followed (see `unpredictable`)."""

    resolved = resolve_method(method, budget, knobs)
    layers, beside_kv, own = _state_schedule(
        model, make_cache(model, resolved), make_cache(model, resolved), prompt, n, not is_reference(method)
    )
    since, per_slot = 1 if decode_only else 0, slot_bytes(model)
    kv = peak_slots(layers, since=since) * per_slot
    state = peak_held(layers, n, since, per_slot, beside_kv)
    beside = peak_held(layers, n, since, 0, beside_kv)
    return AlonePeaks(kv, state, beside, own)


def storage_format(method: str, knobs: dict) -> KVFormat:
    """The storage format of `method` with `knobs` (its defaults under them)."""
    spec = get_method(method)
    mine = storage_knobs(spec)
    mine.update((k, v) for k, v in knobs.items() if k in mine)
    return spec.storage(**mine)


def at_16_bits(method: str, knobs: dict) -> dict:
    """`knobs` with every storage knob removed: K/V at 16 bits, no low tier (quant-int* store
    below 16 by default, so kv_bits=16 is set for them)."""
    plain = {k: v for k, v in knobs.items() if k not in STORAGE_KNOBS}
    if storage_format(method, {}).kv_bits != 16:
        plain["kv_bits"] = 16
    return plain


def storage_extra(model: torch.nn.Module, method: str, knobs: dict) -> int:
    """Bytes the storage of `knobs` holds beside K/V, one sequence, that 16-bit storage without a
    low tier does not (`QuantizedKVStorage.beside_tensors`, `LowTier.beside_tensors`), per layer:
    pre_rope's position offset (an int64) and whether it held (a bool); fp_sinks' sequence
    indices (an int64 a head a sink); a low tier's index and score a slot, counted full
    (`low_budget` a head). Quantized storage's slot indices follow the layer's schedule, as
    16-bit storage's do."""
    fmt, shape = storage_format(method, knobs), model_shape(model)
    per_layer = 0
    if fmt.quantized:
        per_layer += (8 + 1) * fmt.pre_rope + 8 * shape.n_kv_heads * fmt.fp_sinks
    if fmt.low_budget:
        tier = LowTier(1, 1, torch.device("cpu"), KVFormat(low_budget=1), MemoryMeter())
        per_slot = tier.token_index.element_size() + tier.scores.element_size()
        per_layer += fmt.low_budget * shape.n_kv_heads * per_slot
    return per_layer * shape.n_layers


def capacity_batch(memory: int, per_sequence: int, max_batch: int = MAX_BATCH) -> int:
    """Sequences whose peak K/V (`per_sequence` bytes each) fit in `memory` bytes, at most
    `max_batch`; 0 when not even one fits."""
    if per_sequence <= 0 or max_batch <= 0:
        raise ValueError(
            f"per-sequence bytes and max_batch must be positive, got {per_sequence}, {max_batch}"
        )
    return min(memory // per_sequence, max_batch)


@dataclass(frozen=True)
class BatchPlan:
    """One run's batch: the predicted peak of everything one sequence holds (None: not
    predictable), what the cache holds whatever its batch, and the batch."""

    run: BenchRun
    per_sequence: int | None
    batch: int
    per_cache: int = 0

    @property
    def predicted(self) -> int | None:
        """The batch's predicted peak state (None: not predictable)."""
        return None if self.per_sequence is None else self.batch * self.per_sequence + self.per_cache


def plan_batches(
    model,
    runs: list[BenchRun],
    prompt: int,
    n: int,
    *,
    memory: int | None,
    batch: int | None,
    max_batch: int | None = MAX_BATCH,
) -> list[BatchPlan]:
    """Each run's batch: `batch` (fixed), or (batch None) the largest that fits `memory`, at
    most `max_batch` (None: MAX_BATCH).
    A ValueError names the run when its peak cannot be predicted for batch None, or when one
    sequence does not fit."""
    if batch is None and memory is None:
        raise ValueError("batch auto needs a memory limit")
    plans = []
    for run in runs:

        def fresh(run: BenchRun = run) -> CompressedCache:
            return make_cache(model, run.resolved)

        try:
            per_sequence, per_cache = peak_state_bytes(
                model, fresh(), fresh(), prompt, n, compresses=not is_reference(run.method)
            )
        except ValueError as err:
            if batch is None:
                raise ValueError(f"{run.label}: {err}; give a fixed batch instead") from None
            per_sequence, per_cache = None, 0
        chosen = batch
        if chosen is None:
            chosen = capacity_batch(memory - per_cache, per_sequence, max_batch or MAX_BATCH)
            if chosen == 0:
                raise ValueError(
                    f"{run.label}: one sequence holds {format_bytes(per_sequence)} at its peak (K/V and "
                    f"all beside it) at {prompt} + {n} tokens, more than the {format_bytes(memory)} given"
                )
        plans.append(BatchPlan(run, per_sequence, chosen, per_cache))
    return plans


def measure_batches(
    model,
    plans: list[BatchPlan],
    prompt_ids: torch.Tensor,
    tokens: torch.Tensor,
    n: int,
    *,
    memory: int | None = None,
    interleave: bool = False,
    progress: Callable[[str, int], None] | None = None,
    caches: list[CompressedCache] | None = None,
) -> list[dict]:
    """Decode each plan's batch through `tokens` (`prompt_ids` [1, P] repeated in every row);
    one after the other, or all step by step together (interleave). `caches` may be given
    (built for these plans) to inspect them afterwards."""
    suppress = eos_ids(model)
    caches = caches if caches is not None else [None] * len(plans)
    pairs = list(zip(plans, caches, strict=True))
    passes = [("all runs, interleaved", pairs)] if interleave else [(p.run.label, [(p, c)]) for p, c in pairs]
    results = []
    for label, group in passes:
        release_memory()
        built = [c if c is not None else make_cache(model, p.run.resolved) for p, c in group]
        tick = None if progress is None else (lambda k, label=label: progress(label, k))
        traces = decode_many(
            model,
            built,
            [prompt_ids.repeat(p.batch, 1) for p, _ in group],
            n,
            forced=tokens,
            suppress=suppress,
            progress=tick,
        )
        for (plan, _), cache, trace in zip(group, built, traces, strict=True):
            decode_seconds = sum(trace.step_seconds)
            # Every row holds alike: a multiple of the batch, and the cache's own bytes beside.
            measured = cache.kv_meter.peak_state
            predicted = plan.predicted
            rows = trace.predicted_rows
            agree = (trace.predicted[: n - 1] == tokens[1:n].cpu()).double()
            results.append(
                {
                    **plan.run.to_dict(),
                    "label": plan.run.label,
                    "batch": plan.batch,
                    "steps": n,
                    "prefill_seconds": trace.prefill_seconds,
                    "decode_seconds": decode_seconds,
                    "tokens_per_second": n / max(decode_seconds, 1e-12),
                    "aggregate_tokens_per_second": plan.batch * n / max(decode_seconds, 1e-12),
                    "predicted_peak_state_bytes_per_sequence": plan.per_sequence,
                    "predicted_peak_state_bytes": predicted,
                    "peak_state_bytes": measured,
                    "peak_state_bytes_per_sequence": (measured - plan.per_cache) // plan.batch,
                    "peak_kv_bytes": cache.kv_meter.peak,
                    "peak_kv_bytes_per_sequence": cache.kv_meter.peak // plan.batch,
                    "prediction_exact": None if predicted is None else measured == predicted,
                    "kv_memory_bytes": memory,
                    "over_limit": None if memory is None else measured > memory,
                    "rows_agree": bool((rows == rows[:1]).all()),
                    "top1_agreement": float(agree.mean()) if agree.numel() else None,
                    "compressions": cache.n_compressions,
                    "step_seconds": trace.step_seconds,
                }
            )
        del built, traces
    full = next((r for r in results if is_plain_reference(r)), None)
    for r in results:
        if full is not None:
            r["aggregate_ratio"] = r["aggregate_tokens_per_second"] / full["aggregate_tokens_per_second"]
            r["batch_ratio"] = r["batch"] / full["batch"]
    return results


def run_batch_capacity(
    model,
    prompt_ids: torch.Tensor,
    plans: list[BatchPlan],
    n: int,
    *,
    memory: int | None = None,
    batch: int | None = None,
    max_batch: int | None = None,
    interleave: bool = False,
    progress: Callable[[str, int], None] | None = None,
) -> dict:
    """The reference tokens (the full cache's greedy continuation, batch 1), then every plan's
    batch through them (`measure_batches`): the record's `batch_capacity` section, with the
    reference beside it. memory, batch (None: auto) and max_batch are recorded as planned.
    progress(label, k): k more decode steps done in the pass `label`."""

    def tick(label: str) -> Progress | None:
        return None if progress is None else (lambda k: progress(label, k))

    start = time.perf_counter()
    ref = reference_tokens(model, prompt_ids, n, progress=tick(f"reference ({reference_method()}, greedy)"))
    results = measure_batches(
        model, plans, prompt_ids, ref.tokens, n, memory=memory, interleave=interleave, progress=progress
    )
    return {
        "prompt_tokens": int(prompt_ids.shape[1]),
        "reference": {
            "tokens": ref.tokens.tolist(),
            "seconds": ref.prefill_seconds + sum(ref.step_seconds),
            "tokens_per_second": n / max(sum(ref.step_seconds), 1e-12),
        },
        "batch_capacity": {
            "kv_memory_bytes": memory,
            "batch": "auto" if batch is None else batch,
            "max_batch": max_batch if batch is None else None,
            "target_tokens": n,
            "slot_bytes": slot_bytes(model),
            "interleave": interleave,
            "runs": results,
            "over_limit": [r["label"] for r in results if r["over_limit"]],
        },
        "wall_seconds": time.perf_counter() - start,
    }
