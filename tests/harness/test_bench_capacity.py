"""Batch capacity at fixed memory (reasonkv.harness.bench.capacity): the batch arithmetic, the
peak K/V predicted from a schedule against the cache's own meter, and batched decoding that
gives every row exactly what a batch-1 run gives. No timing assertions."""

from __future__ import annotations

import pytest
import torch

from conftest import N_LAYERS, build_tiny_model, greedy_loop, random_prompt, tiny_model
from reasonkv.core import slot_count
from reasonkv.core.memory_meter import MemoryMeter
from reasonkv.harness import bench
from reasonkv.harness.bench.capacity import at_16_bits, storage_extra
from reasonkv.methods.api import make_cache

PROMPT = 10
KNOBS = {"interval": 8}
real_repeated = slot_count._repeated


def run_of(method: str, budget: int | None = 24, **knobs) -> bench.BenchRun:
    return bench.BenchRun(method, None if method == "full" else budget, knobs)


# ------------------------------------------------------------- the arithmetic
@pytest.mark.parametrize(
    ("memory", "per_sequence", "max_batch", "expected"),
    [
        (1000, 300, 256, 3),
        (900, 300, 256, 3),  # exactly three fit
        (899, 300, 256, 2),
        (300, 300, 256, 1),
        (299, 300, 256, 0),  # not even one
        (10**9, 1, 256, 256),  # capped
        (10**9, 1, 5, 5),
        (2 * 1024**3, 30_507_008, 256, 70),  # 2 GiB of 29.1 MiB sequences
    ],
)
def test_capacity_batch_is_the_floor_of_memory_over_the_peak_capped(
    memory: int, per_sequence: int, max_batch: int, expected: int
) -> None:
    assert bench.capacity_batch(memory, per_sequence, max_batch) == expected


def test_capacity_batch_refuses_a_nonpositive_peak_or_cap() -> None:
    with pytest.raises(ValueError, match="must be positive"):
        bench.capacity_batch(1000, 0)
    with pytest.raises(ValueError, match="must be positive"):
        bench.capacity_batch(1000, 10, 0)


def allocations(method: str, budget: int | None, prompt: int, n: int, **knobs) -> list[dict]:
    return bench.cache_allocations(make_cache(tiny_model("llama"), method, budget, **knobs), prompt, n)


def test_allocations_of_a_growing_and_a_buffered_layer() -> None:
    # Never compresses: a chunk (256) past the prompt, then a chunk past what is needed.
    full, *others = allocations("full", None, 10, 300)
    assert full == {0: [(0, 266)], 257: [(266, 523)]} and all(x == full for x in others)
    # Budget 24 + interval 8: room for 32 at once, compacted into 24 + 8 slots at every 32nd token.
    buffered, *others = allocations("snapkv", 24, 10, 40, interval=8)
    assert buffered == {0: [(0, 32)], 22: [(32, 32)], 30: [(32, 32)], 38: [(32, 32)]}
    assert all(x == buffered for x in others)
    # Two alike layers: both at their most, plus the old storage of the last one that grew.
    assert bench.peak_slots([full, full]) == 523 + 523 + 266
    assert bench.peak_slots([buffered, buffered]) == 3 * 32


def test_an_every_step_layer_frees_a_hole_then_compacts() -> None:
    """H2O at budget 16 fires at 17 tokens and has one hole slot: its 18 slots fill at step 8
    (10 + 8), its first eviction (step 7, 17 tokens) is a hole, the next one compacts into
    16 + 1 + 1 slots, and from then on every second step compacts."""
    (h2o, *_) = allocations("h2o", 16, 10, 40)
    assert h2o == {0: [(0, 18)], **{step: [(18, 18)] for step in range(8, 41, 2)}}


@pytest.mark.parametrize(
    ("method", "budget", "knobs", "prompt"),
    [
        ("h2o", 16, {}, 10),
        ("h2o", 16, {}, 60),
        ("tova", 24, {"evict_every": 5}, 10),
        ("streaming", 24, {"compact_every": 1}, 30),
        ("snapkv", 24, KNOBS, 10),
        ("snapkv", 24, KNOBS, 60),
        ("snapkv", 100, {"interval": 300}, 500),  # the prompt past the trigger, slack past a chunk
        ("beaconkv", 32, {}, 10),
        ("pyramidkv", 24, {}, 60),
    ],
)
def test_repeating_the_first_cycle_that_recurs_is_stepping_every_token(
    method: str, budget: int, knobs: dict, prompt: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The counting run stops once a compression leaves the layer where an earlier one did and
    repeats the steps between: the same reallocations as running every step (the meter's peak
    is checked against the real cache's below)."""
    repeats = []
    monkeypatch.setattr(slot_count, "_repeated", lambda *a: repeats.append(a[1:3]) or real_repeated(*a))
    cache = make_cache(tiny_model("llama"), method, budget, **knobs)
    for layer in cache.layers:
        repeated = slot_count.count_allocations(cache.policy, layer.budgets, prompt, 1200)
        assert repeated == slot_count.count_allocations(
            cache.policy, layer.budgets, prompt, 1200, repeat=False
        )
        assert max(repeated) > 1000  # reallocations all along, not only while filling
    assert len(repeats) == len(cache.layers) and all(end < 1000 for _, end in repeats)  # it did stop


def test_slot_counting_refuses_what_it_cannot_count() -> None:
    model = tiny_model("llama")
    for method, knobs, reason in [
        ("snapkv", {"kv_bits": 4, "group_size": 16}, "not quantized"),
        ("adakv-snapkv", {}, "head allocator"),
    ]:
        cache = make_cache(model, method, 64, **knobs)
        with pytest.raises(ValueError, match=reason):
            slot_count.count_allocations(cache.policy, cache.layers[0].budgets, 10, 40)


def test_peak_held_of_no_decode_step_is_what_the_prompt_left() -> None:
    """A decode peak (`since` 1) of a sequence that decodes nothing is what is held after the
    prompt's forward: 10 slots of 2 bytes and 3 bytes beside (it was 0)."""
    from reasonkv.harness.bench.capacity import peak_held

    assert peak_held([{0: [(0, 10)]}], 0, 1, 2, [lambda slots, step: 3]) == 23
    assert peak_held([{0: [(0, 10)]}], 0, 0, 2, [lambda slots, step: 3]) == 23


def test_peak_slots_follows_the_layers_in_order() -> None:
    a = {0: [(0, 10)], 5: [(10, 20)]}
    b = {0: [(0, 30)], 5: [(30, 5)]}
    # Step 5: a grows while b still holds 30 (10 + 20 + 30), then b shrinks after a is done.
    assert bench.peak_slots([a, b]) == 60
    # b first: it compacts (30 + 5) beside a's 10, then a grows beside b's 5 (5 + 10 + 20).
    assert bench.peak_slots([b, a]) == 45
    assert bench.peak_slots([]) == 0


# ---------------------------------------------- the prediction against the meter
@pytest.mark.parametrize("prompt_len", [PROMPT, 30])  # 30: a prompt past the trigger of budget 24
@pytest.mark.parametrize(
    ("method", "knobs"),
    [
        ("full", {}),
        ("streaming", {}),
        ("h2o", {}),
        ("snapkv", KNOBS),
        ("rkv", {}),
        ("beaconkv", {}),
        ("pyramidkv", KNOBS),
        ("snapkv", {**KNOBS, "phase": "decode"}),  # from the prompt's end: the counting run's prompt
        ("snapkv", {**KNOBS, "protect_prompt": True}),  # 30 tokens kept past the budget of 24
    ],
)
def test_predicted_peak_is_what_the_cache_meter_measures(method: str, knobs: dict, prompt_len: int) -> None:
    model = tiny_model("llama")
    prompt = random_prompt(prompt_len, 7)
    n = 45
    tokens = bench.reference_tokens(model, prompt, n).tokens
    run = run_of(method, **knobs)
    cache = make_cache(model, run.method, run.budget, **run.knobs)
    slots = bench.peak_kv_slots(cache, prompt_len, n, compresses=method != "full")
    bench.decode_many(model, [cache], prompt, n, forced=tokens)
    assert slots * bench.slot_bytes(model) == cache.kv_meter.peak == cache.memory()["peak_kv_bytes"]


@pytest.mark.parametrize("method", ["snapkv", "beaconkv", "h2o", "full"])
def test_predicted_decode_peak_is_a_replay_alone(method: str) -> None:
    """A trace replayed alone peaks, while decoding, where the schedule's arithmetic says: the
    per-sequence peak a left-padded batch of other traces cannot give (its rows compress at
    other steps and share their storage). The prompt is longer than the budget, so the prompt's
    own forward peaks higher than decoding."""
    from reasonkv.harness.replay import ReplayRun, replay_methods

    model = tiny_model("llama")
    ids, prompt_len = random_prompt(120, 9), 40
    budget = {"full": None, "beaconkv": 32}.get(method, 16)
    knobs = {"interval": 8} if method == "snapkv" else {}
    result = replay_methods(model, ids, prompt_len, [ReplayRun(method, budget, knobs)], block=64)[0]
    cache = make_cache(model, method, budget, **knobs)
    n = ids.shape[1] - 1 - prompt_len
    slot = bench.slot_bytes(model)
    decode = bench.peak_kv_slots(cache, prompt_len, n, compresses=method != "full", decode_only=True)
    assert decode * slot == result.decode_peak_kv_bytes
    whole = bench.peak_kv_slots(cache, prompt_len, n, compresses=method != "full")
    assert whole * slot == result.peak_kv_bytes and (whole > decode or method == "full")
    alone = bench.alone_peaks(model, method, budget, knobs, prompt_len, n)
    assert alone.kv == result.decode_peak_kv_bytes
    assert alone.state + alone.own == result.decode_peak_state_bytes  # one row: the cache's own bytes too
    assert alone.kv < alone.state <= alone.kv + alone.beside  # the two peaks need not fall together


@pytest.mark.parametrize(
    ("method", "knobs", "reason"),
    [
        ("rpc", {}, "no fixed trigger"),
        ("adakv-snapkv", {}, "re-splits the budget between heads"),
        ("quant-int4", {"group_size": 16}, "quantized to 4 bits"),  # the tiny head dim: 16
        ("snapkv", {"low_budget": 32, "group_size": 16}, "low tier of 32 tokens"),
        ("beaconkv-all-queries", {}, "buffers grow with the sequence"),
    ],
)
def test_a_schedule_the_prediction_cannot_follow_is_named(method: str, knobs: dict, reason: str) -> None:
    model = tiny_model("llama")
    run = bench.BenchRun(method, None if method == "quant-int4" else 64, knobs)
    cache = make_cache(model, run.method, run.budget, **run.knobs)
    with pytest.raises(ValueError, match=reason):
        bench.peak_kv_slots(cache, PROMPT, 40, compresses=not bench.is_reference(method))
    with pytest.raises(ValueError, match=f"{run.label}: .*{reason}.*give a fixed batch"):
        bench.plan_batches(model, [run], PROMPT, 40, memory=10**9, batch=None)
    (plan,) = bench.plan_batches(model, [run], PROMPT, 40, memory=None, batch=3)
    assert plan.batch == 3 and plan.per_sequence is None


def test_plan_batches_fits_the_memory_and_names_a_run_that_does_not_fit() -> None:
    model = tiny_model("llama")
    runs = [run_of("full"), run_of("snapkv", **KNOBS)]
    per_slot = bench.slot_bytes(model)
    assert per_slot == 2 * 2 * 16 * 4  # K and V, 2 KV heads of dim 16, fp32
    full_kv = N_LAYERS * (PROMPT + 256) * per_slot  # prompt 10 + 40: a chunk past the prompt
    # Beside it, a layer holds each slot's index (2 KV heads, int64), its 2 heads' lengths and
    # real-token counts, its one kept query (4 heads x 16, fp32) with its index and position, the
    # prompt's end and its compression count; whatever the batch, the cache holds its budgets
    # [layers, heads] and each layer its heads' budgets and targets (int64).
    beside = (PROMPT + 256) * 2 * 8 + 2 * 2 * 8 + (4 * 16 * 4 + 8 + 8) + 8 + 8
    full_peak, per_cache = full_kv + N_LAYERS * beside, N_LAYERS * 2 * 8 + N_LAYERS * 2 * 2 * 8
    plans = bench.plan_batches(model, runs, PROMPT, 40, memory=2 * full_peak + per_cache, batch=None)
    assert plans[0].per_sequence == full_peak and plans[0].per_cache == per_cache
    snap_kv = (N_LAYERS + 1) * 32 * per_slot  # 24 + 8 slots, one layer twice while compacting
    snap_peak = plans[1].per_sequence
    assert snap_kv < snap_peak  # what it holds beside: its meter and this prediction agree (below)
    assert [p.batch for p in plans] == [2, (2 * full_peak) // snap_peak]
    capped = bench.plan_batches(model, runs, PROMPT, 40, memory=2 * full_peak, batch=None, max_batch=4)
    assert [p.batch for p in capped] == [1, 4]
    with pytest.raises(ValueError, match=r"full: one sequence holds 141.9 KiB at its peak .* at 10 \+ 40"):
        bench.plan_batches(model, runs, PROMPT, 40, memory=full_peak - 1, batch=None)
    with pytest.raises(ValueError, match="needs a memory limit"):
        bench.plan_batches(model, runs, PROMPT, 40, memory=None, batch=None)


# ------------------------------------------------------------- batched decoding
class LogitLog:
    """Every forward's last-position logits, in order."""

    def __init__(self, model):
        self.logits: list[torch.Tensor] = []
        self.handle = model.register_forward_hook(self.hook)

    def hook(self, module, args, output):
        self.logits.append(output.logits[:, -1].detach().clone())


@pytest.mark.parametrize(
    ("method", "knobs"), [("full", {}), ("streaming", {}), ("snapkv", KNOBS), ("beaconkv", {})]
)
def test_every_batched_row_decodes_as_the_batch_of_one(method: str, knobs: dict) -> None:
    model = tiny_model("llama")
    prompt = random_prompt(PROMPT, 8)
    n = 40
    tokens = bench.reference_tokens(model, prompt, n).tokens
    run = run_of(method, **knobs)
    one = make_cache(model, run.method, run.budget, **run.knobs)
    many = make_cache(model, run.method, run.budget, **run.knobs)
    log = LogitLog(model)
    try:
        (alone,) = bench.decode_many(model, [one], prompt, n, forced=tokens)
        split = len(log.logits)
        (batched,) = bench.decode_many(model, [many], prompt.repeat(3, 1), n, forced=tokens)
    finally:
        log.handle.remove()
    assert batched.batch == 3 and alone.batch == 1
    for row in range(3):
        assert torch.equal(batched.predicted_rows[row], alone.predicted)
    for single, rows in zip(log.logits[:split], log.logits[split:], strict=True):
        assert torch.allclose(rows, single.expand_as(rows), atol=1e-5, rtol=1e-5)
    for a, b in zip(one.layers, many.layers, strict=True):  # the same tokens kept, in every row
        assert torch.equal(b.token_index, a.token_index.expand_as(b.token_index))
    assert many.kv_meter.peak == 3 * one.kv_meter.peak


def test_a_batch_capacity_run_fits_its_memory_and_reports_each_run() -> None:
    model = tiny_model("llama")
    prompt = random_prompt(PROMPT, 9)
    n = 40
    runs = [run_of("full"), run_of("snapkv", **KNOBS), run_of("streaming"), run_of("beaconkv")]
    full_peak = N_LAYERS * (PROMPT + 256) * bench.slot_bytes(model)  # its K/V; it holds more beside
    memory = 2 * full_peak + full_peak // 2  # full fits twice
    plans = bench.plan_batches(model, runs, PROMPT, n, memory=memory, batch=None)
    record = bench.run_batch_capacity(model, prompt, plans, n, memory=memory, max_batch=bench.MAX_BATCH)
    section = record["batch_capacity"]
    assert section["kv_memory_bytes"] == memory and section["batch"] == "auto"
    assert section["target_tokens"] == n and section["over_limit"] == []
    results = section["runs"]
    assert [r["label"] for r in results] == ["full", "snapkv@24", "streaming@24", "beaconkv@24"]
    assert results[0]["batch"] == 2 and all(r["batch"] > 2 for r in results[1:])
    for r in results:
        assert r["peak_kv_bytes"] < r["peak_state_bytes"] <= memory and r["over_limit"] is False
        assert r["peak_state_bytes"] == r["predicted_peak_state_bytes"] and r["prediction_exact"] is True
        assert r["peak_kv_bytes_per_sequence"] * r["batch"] == r["peak_kv_bytes"]
        assert r["peak_state_bytes_per_sequence"] == r["predicted_peak_state_bytes_per_sequence"]
        assert r["rows_agree"] is True and len(r["step_seconds"]) == n
        assert r["aggregate_tokens_per_second"] == pytest.approx(r["batch"] * r["tokens_per_second"])
        assert r["batch_ratio"] == r["batch"] / 2
    assert results[0]["top1_agreement"] == 1.0 and results[0]["aggregate_ratio"] == 1.0
    assert len(record["reference"]["tokens"]) == n and record["prompt_tokens"] == PROMPT


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("prompt", [10, 40], ids=["prompt-below-trigger", "prompt-past-trigger"])
@pytest.mark.parametrize(
    ("method", "knobs"),
    [
        ("streaming", {}),
        ("h2o", {}),
        ("snapkv", KNOBS),
        ("beaconkv", {}),
        ("beaconkv", {"beacon_bits": 8, "window_bits": 8, "upkeep_every": 1}),
        ("initial-recent", {"beacon_bits": 8}),
        ("snapkv", {**KNOBS, "phase": "decode"}),
        ("snapkv", {**KNOBS, "protect_prompt": True}),
    ],
    ids=[
        "streaming",
        "h2o",
        "snapkv",
        "beaconkv",
        "beaconkv-8bit",
        "initial-recent-8bit",
        "snapkv-decode-phase",
        "snapkv-kept-prompt",
    ],
)
def test_the_predicted_state_peak_is_the_meters(method: str, knobs: dict, prompt: int, dtype) -> None:
    """One sequence through a prompt and 40 tokens: the predicted peak of everything it holds
    (and what the cache holds whatever its batch) is what the meter saw, byte for byte, in fp32
    and bf16, whether the peak falls while decoding or in a prompt past the trigger."""
    model = build_tiny_model("llama").to(dtype)

    def fresh():
        return make_cache(model, method, 24, **knobs)

    per_sequence, per_cache = bench.peak_state_bytes(model, fresh(), fresh(), prompt, 40)
    cache = fresh()
    greedy_loop(model, random_prompt(prompt, 5), cache, 40)
    assert cache.kv_meter.peak_state == per_sequence + per_cache


def beside_counts(monkeypatch) -> list[int]:
    """What every meter holds beside K/V after each of its counts, from now on."""
    seen: list[int] = []
    count = MemoryMeter.hold_beside

    def hold_beside(meter, owner, n_bytes, n_bytes_16bit):
        count(meter, owner, n_bytes, n_bytes_16bit)
        seen.append(meter.beside)

    monkeypatch.setattr(MemoryMeter, "hold_beside", hold_beside)
    return seen


@pytest.mark.parametrize(
    ("method", "knobs"),
    [("h2o", {}), ("snapkv", KNOBS), ("beaconkv", {}), ("beaconkv", {"beacon_bits": 8, "upkeep_every": 1})],
    ids=["h2o", "snapkv", "beaconkv", "beaconkv-8bit"],
)
def test_the_predicted_beside_peak_is_the_meters(monkeypatch, method: str, knobs: dict) -> None:
    """The most one sequence holds beside its K/V at once (what `bytes_plot.py --state` adds to a
    quantized unit's metered K/V) is the meter's largest beside count over a prompt past the
    trigger and 40 tokens, byte for byte; and it is at least peak state less peak K/V."""
    model = build_tiny_model("llama")
    most = beside_counts(monkeypatch)

    def fresh():
        return make_cache(model, method, 24, **knobs)

    per_sequence, per_cache = bench.peak_state_bytes(model, fresh(), fresh(), 40, 40, beside_only=True)
    state, _ = bench.peak_state_bytes(model, fresh(), fresh(), 40, 40)
    most.clear()
    cache = fresh()
    greedy_loop(model, random_prompt(40, 5), cache, 40)
    assert max(most) == per_sequence + per_cache
    assert per_sequence >= state - bench.peak_kv_slots(fresh(), 40, 40) * bench.slot_bytes(model)


@pytest.mark.parametrize(
    "storage",
    [
        {"kv_bits": 4, "group_size": 8, "residual": 4},
        {"kv_bits": 4, "group_size": 8, "residual": 0, "fp_sinks": 1, "pre_rope": True, "hadamard": True},
        {"low_budget": 16, "low_bits": 4, "group_size": 16},
    ],
    ids=["4-bit", "4-bit-sink-prerope-hadamard", "two-tier"],
)
@pytest.mark.parametrize("method", ["h2o", "beaconkv"])
def test_a_low_bit_cache_holds_beside_its_kv_at_most_its_16_bit_twin_and_the_storage_extra(
    monkeypatch, method: str, storage: dict
) -> None:
    """The bound `scripts/bytes_plot.py --state` puts on a low-bit unit's state rests on this: at
    every count, what a low-bit cache holds beside its K/V is at most the predicted beside peak of
    the same method with the storage knobs removed plus `storage_extra` (for quantized storage
    exactly that at its peak: it holds what the 16-bit schedule holds, plus the extra)."""
    model = build_tiny_model("llama", num_hidden_layers=8)  # one layer read dequantized: a small share
    plain = at_16_bits(method, storage)
    assert plain == {}
    twin = [make_cache(model, method, 96, **plain) for _ in range(2)]
    per_sequence, per_cache = bench.peak_state_bytes(model, *twin, 40, 120, beside_only=True)
    bound = per_sequence + per_cache + storage_extra(model, method, storage)
    most = beside_counts(monkeypatch)
    greedy_loop(model, random_prompt(40, 5), make_cache(model, method, 96, **storage), 120)
    assert max(most) <= bound
    if "low_budget" not in storage:
        assert max(most) == bound
