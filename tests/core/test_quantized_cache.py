"""Quantized KV storage (kv_bits 8/4/2) under every method: exact at 16 bits, close at 8,
budgets, padding, ragged heads and compaction unchanged, bytes counted from what is held."""

from __future__ import annotations

import pytest
import torch

from conftest import HEAD_DIM, left_pad, random_prompt, tiny_model
from reasonkv.core.hf_compat import cache_arg
from reasonkv.core.memory_meter import MemoryMeter
from reasonkv.core.quantize import KVFormat, dequantize, quantize
from reasonkv.core.quantized_storage import QuantizedKVStorage
from reasonkv.methods.api import make_cache
from reasonkv.methods.knobs import KnobError, check_knobs
from reasonkv.methods.registry import get_method

SMALL = {"group_size": 8, "residual": 8}

# Small budgets on the tiny two-layer model, where make_cache would refuse most quantized
# settings as holding more than 16 bits (test_storage_pays): these test the code paths.
pytestmark = pytest.mark.usefixtures("toy_storage")


@torch.no_grad()
def forced_logits(model, ids, mask, cache, tokens: torch.Tensor) -> torch.Tensor:
    """Logits [B, n, V] of a prefill then one forced token per step (no argmax divergence)."""
    out = model(input_ids=ids, attention_mask=mask, **cache_arg(cache), use_cache=True)
    logits = [out.logits[:, -1].float()]
    for i in range(tokens.shape[1]):
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], 1)
        out = model(input_ids=tokens[:, i : i + 1], attention_mask=mask, **cache_arg(cache), use_cache=True)
        logits.append(out.logits[:, -1].float())
    return torch.stack(logits, 1)


def _run(method: str, budget=None, batch: int = 1, steps: int = 40, prompt: int = 30, **knobs):
    model = tiny_model("llama")
    ids = random_prompt(prompt, 3, batch)
    mask = torch.ones_like(ids)
    tokens = random_prompt(steps, 4, batch)
    cache = make_cache(model, method, budget=budget, **knobs)
    return forced_logits(model, ids, mask, cache, tokens), cache


def test_kv_bits_16_is_todays_path_bit_for_bit() -> None:
    for method, budget in (("full", None), ("snapkv", 24)):
        plain, cache = _run(method, budget, interval=8) if method == "snapkv" else _run(method)
        again, cache16 = (
            _run(method, budget, interval=8, kv_bits=16, group_size=8, residual=0)
            if method == "snapkv"
            else _run(method, kv_bits=16)
        )
        assert torch.equal(plain, again)
        assert type(cache16.layers[0].storage) is type(cache.layers[0].storage)


@pytest.mark.parametrize(
    "method,budget,knobs",
    [
        ("quant-int8", None, {}),
        ("snapkv", 24, {"interval": 8, "kv_bits": 8}),  # compacts: keys are re-quantized
        ("h2o", 24, {"kv_bits": 8}),  # every step: holes
        ("adakv-snapkv", 24, {"interval": 8, "kv_bits": 8}),  # ragged heads
    ],
)
def test_int8_logits_stay_close_to_full_precision(method, budget, knobs) -> None:
    full, _ = _run(
        method if "quant" not in method else "full",
        budget,
        **{k: v for k, v in knobs.items() if k != "kv_bits"},
    )
    quant, cache = _run(method, budget, **knobs, **SMALL)
    storage = cache.layers[0].storage
    assert isinstance(storage, QuantizedKVStorage) and storage.q_used > 0
    scale = full.abs().max()
    assert float((quant - full).abs().max()) < 0.02 * float(scale)


def test_lower_bits_cost_more_error_than_higher_bits() -> None:
    full, _ = _run("full")
    errs = [float((_run(f"quant-int{b}", **SMALL)[0] - full).abs().mean()) for b in (8, 4, 2)]
    assert errs[0] < errs[1] < errs[2]


@pytest.mark.parametrize(
    "method,knobs",
    [
        ("quant-int8", {}),
        ("snapkv", {"interval": 8, "kv_bits": 8}),
        ("snapkv", {"interval": 8, "kv_bits": 8, "fp_sinks": 2}),  # the padded row's sinks move
    ],
)
def test_rows_alone_match_the_left_padded_batch(method, knobs) -> None:
    """Bit for bit for the unpadded row and the prefill (which attends in full precision); close
    for the padded row, whose slots (padding included) group and flush differently."""
    model = tiny_model("llama")
    prompts = [random_prompt(30, 5)[0], random_prompt(22, 6)[0]]
    tokens = random_prompt(30, 7, 2)
    ids, mask = left_pad(prompts)
    budget = 24 if method == "snapkv" else None
    batch = forced_logits(
        model, ids, mask, make_cache(model, method, budget=budget, **knobs, **SMALL), tokens
    )
    for row, p in enumerate(prompts):
        one = p[None]
        alone = forced_logits(
            model,
            one,
            torch.ones_like(one),
            make_cache(model, method, budget=budget, **knobs, **SMALL),
            tokens[row : row + 1],
        )
        gap = (alone[0] - batch[row]).abs()
        assert float(gap[0].max()) < 1e-4
        assert float(gap.max()) < (1e-4 if row == 0 else 0.05 * float(alone.abs().max()))


@pytest.mark.parametrize("method", ["snapkv", "h2o", "adakv-snapkv"])
def test_budgets_still_hold(method) -> None:
    budget, interval = 24, 8
    knobs = {"kv_bits": 4, **SMALL} | ({} if method == "h2o" else {"interval": interval})
    _, cache = _run(method, budget, batch=2, steps=60, **knobs)
    slack = 1 if method == "h2o" else interval
    for layer in cache.layers:
        assert int(layer.n_valid.sum(-1).max()) <= (budget + slack) * layer.n_valid.shape[1]
        assert layer.storage.q_used <= int(layer.lengths.min())


def test_a_bounded_cache_never_allocates_quantized_room_past_its_slots() -> None:
    """The quantized part grows by its own size, but never past the layer's slots less the
    residual: a cache with a fixed budget holds no spare quantized room it can never use."""
    g, residual = SMALL["group_size"], SMALL["residual"]
    model = tiny_model("llama")
    cache = make_cache(model, "beaconkv", 48, kv_bits=4, **SMALL)
    ids, peak_room = random_prompt(20, 3, 1), 0
    with torch.no_grad():
        model(input_ids=ids, **cache_arg(cache))
        for token in random_prompt(120, 4, 1)[0]:
            model(input_ids=token.view(1, 1), **cache_arg(cache))
            for layer in cache.layers:
                s = layer.storage
                room = s.kq.codes.shape[2]
                assert room <= max(s.q_used, (s.capacity - residual) // g * g), (room, s.capacity)
                peak_room = max(peak_room, room)
                # The residual buffer: what the heads hold until the next group leaves, no more.
                assert s.used - s.q_used <= s.k_res.shape[2] == residual + g + s.used - s.min_len
    assert peak_room == (48 - residual) // g * g  # it did grow to what the budget needs


def test_memory_counts_packed_codes_scales_zeros_and_residual_exactly() -> None:
    _, cache = _run("quant-int4", steps=50, prompt=40, **SMALL)
    expected = expected_16bit = 0
    for layer in cache.layers:
        s = layer.storage
        b, h = s.lengths.shape
        q_cap, r_cap = s.kq.codes.shape[2], s.k_res.shape[2]
        assert s.kq.codes.shape == s.vq.codes.shape == (b, h, q_cap, HEAD_DIM * 4 // 8)
        assert s.kq.scale.shape == (b, h, q_cap // 8, HEAD_DIM)  # keys: per channel, per 8 tokens
        assert s.vq.scale.shape == (b, h, q_cap, HEAD_DIM // 8)  # values: per token, per 8 channels
        packed = 2 * b * h * q_cap * HEAD_DIM // 2  # int4: two codes a byte
        scales = (
            2 * 4 * (b * h * (q_cap // 8) * HEAD_DIM + b * h * q_cap * (HEAD_DIM // 8))
        )  # scale + zero, fp32
        residual = 2 * b * h * r_cap * HEAD_DIM * 4
        expected += packed + scales + residual
        expected_16bit += packed + scales // 2 + residual // 2  # codes as they are, floats at 2 bytes
        assert s.q_used == (91 - 8) // 8 * 8  # 90 tokens + 1 forced: all but >= 8 newest, in groups of 8
    assert cache.memory()["kv_bytes"] == expected == cache.kv_meter.current  # no dequantized view held
    assert cache.memory()["peak_kv_bytes"] > expected  # the transient view of a step is in the peak
    assert cache.memory()["kv_bytes_16bit"] == expected_16bit == cache.kv_meter.current_16bit
    full = _run("full", steps=50, prompt=40)[1].memory()["kv_bytes"]
    assert expected < full / 2


def test_the_dequantized_read_is_what_is_stored() -> None:
    _, cache = _run("quant-int4", **SMALL)
    s = cache.layers[1].storage
    keys = s.read_keys()
    n = s.q_used
    assert torch.equal(
        keys[:, :, :n],
        dequantize(
            type(s.kq)(s.kq.codes[:, :, :n], s.kq.scale[:, :, : n // 8], s.kq.zero[:, :, : n // 8], 4, 8, 2)
        ),
    )
    assert torch.equal(keys[:, :, n:], s.k_res[:, :, : s.used - n])


def test_a_value_group_of_its_own_sets_the_values_scales_and_bytes() -> None:
    _, cache = _run("quant-int4", value_group_size=HEAD_DIM, **SMALL)
    _, same = _run("quant-int4", **SMALL)
    s, t = cache.layers[1].storage, same.layers[1].storage
    b, h, q_cap = s.vq.codes.shape[:3]
    assert s.vq.scale.shape == (b, h, q_cap, 1) and t.vq.scale.shape == (b, h, q_cap, HEAD_DIM // 8)
    assert s.kq.scale.shape == t.kq.scale.shape and q_cap == t.vq.codes.shape[2]  # keys as before
    assert t.kv_bytes() - s.kv_bytes() == 2 * 4 * b * h * q_cap * (HEAD_DIM // 8 - 1)  # fp32 scale + zero
    n = s.q_used
    stored = type(s.vq)(s.vq.codes[:, :, :n], s.vq.scale[:, :, :n], s.vq.zero[:, :, :n], 4, HEAD_DIM, 3)
    assert torch.equal(s.read_values()[:, :, :n], dequantize(stored))


@pytest.mark.parametrize(
    "knobs,match",
    [
        ({"kv_bits": 3}, "kv_bits"),
        ({"kv_bits": 4, "value_group_size": 12}, "power of two"),
        ({"kv_bits": 4, "value_group_size": 2048}, "value_group_size"),
        ({"kv_bits": 4, "group_size": 12}, "power of two"),
        ({"kv_bits": 4, "group_size": 0}, "group_size"),
        ({"kv_bits": 4, "residual": -1}, "residual"),
        ({"kv_bits": 4, "fp_sinks": -1}, "fp_sinks"),
        ({"kv_bits": 4, "fp_sinks": 65}, "fp_sinks"),
        ({"fp_sinks": 1}, "fp_sinks"),  # nothing quantized: nothing to keep exact
    ],
)
def test_bad_storage_knobs_are_one_clear_error_before_the_model_loads(knobs, match) -> None:
    with pytest.raises(KnobError, match=match):
        check_knobs(get_method("snapkv"), knobs)
    with pytest.raises(KnobError, match=match):
        check_knobs(get_method("full"), knobs)


def test_a_group_size_that_does_not_divide_the_head_dim_is_refused_by_make_cache() -> None:
    model = tiny_model("llama")
    with pytest.raises(KnobError, match="divide the model's head dim"):
        make_cache(model, "quant-int4", group_size=32)  # HEAD_DIM is 16
    with pytest.raises(KnobError, match="value_group_size 32 must divide"):
        make_cache(model, "quant-int4", value_group_size=32)
    make_cache(model, "quant-int4", group_size=32, value_group_size=16)  # keys' groups run over tokens


def test_the_baselines_never_evict_and_store_every_token_at_their_bits() -> None:
    for bits in (8, 4, 2):
        spec = get_method(f"quant-int{bits}")
        assert not spec.compresses and spec.knobs()["kv_bits"] == bits
    _, cache = _run("quant-int2", **SMALL)
    assert cache.layers[0].storage.kq.bits == 2
    assert int(cache.layers[0].n_valid.min()) == 30 + 40


def test_a_quantized_compaction_peaks_at_old_storage_view_and_new_storage_with_no_full_copy() -> None:
    """Compaction holds, at once: the old storage, the dequantized view this step read (its
    attention still holds it) and the new storage; the kept tokens are never copied whole in
    full precision (values move as codes, keys a chunk of groups at a time; here both
    temporaries are smaller than the new residual, allocated after them), and the new
    residual is `residual + group_size` slots."""
    meter = MemoryMeter()
    s = QuantizedKVStorage(
        1, 2, torch.device("cpu"), KVFormat(kv_bits=4, group_size=8, residual=8), meter=meter
    )
    k, v = torch.randn(1, 2, 40, HEAD_DIM), torch.randn(1, 2, 40, HEAD_DIM)
    s.ensure_capacity(40, 64, k, v)
    s.append(k, v, 0)
    s.settle()
    assert s.q_used == 32
    # Live bytes: 2 heads x 32 quantized tokens at 4-bit codes (D/2 bytes each for K and V) plus
    # fp32 scale and zero per group (K: per channel per 8 tokens, V: per 8 channels) = 3D bytes;
    # the 8 newest tokens per head in the fp32 residual, 8D bytes each.
    assert s.live_kv_bytes() == 2 * 32 * 3 * HEAD_DIM + 2 * 8 * 8 * HEAD_DIM
    held = meter.current
    assert held == s.kv_bytes()
    meter.restart_peak()
    view = 2 * 2 * 40 * HEAD_DIM * 4  # K and V, 2 heads, 40 slots, fp32
    s.read_keys()  # the step's attention read it
    kept = torch.arange(0, 40, 2).expand(1, 2, 20)
    s.compact(kept, torch.full((1, 2), 20), 24)
    new = s.kv_bytes()
    assert s.q_used == 8 and s.k_res.shape[2] == 8 + 8  # (20 - 8) // 8 groups; residual + group
    # The step's attention still holds the view it read until the step ends (settle).
    assert meter.peak == held + view + new
    assert meter.current == new + view
    s.settle()
    assert meter.current == new == s.kv_bytes()


def test_a_quantized_compaction_moves_values_as_codes_and_requantizes_keys_within_the_bound() -> None:
    """Kept values come out as they were stored (quantized ones bit for bit, residual ones as
    `settle` would quantize them); kept keys within half their new group's scale of the view."""
    fmt = KVFormat(kv_bits=4, group_size=8, residual=8)
    s = QuantizedKVStorage(1, 2, torch.device("cpu"), fmt, meter=MemoryMeter())
    k, v = torch.randn(1, 2, 44, HEAD_DIM), torch.randn(1, 2, 44, HEAD_DIM)
    s.ensure_capacity(44, 64, k, v)
    s.append(k, v, 0)
    s.settle()
    assert s.q_used == 32  # slots 32..43 are the residual
    keys, values = s.read_keys().clone(), s.read_values().clone()
    kept = torch.tensor([[[5, 20, 25, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40, 41, 42, 43]]])  # 32..: residual
    kept = kept.expand(1, 2, -1)
    s.compact(kept, torch.full((1, 2), 16), 24)
    assert s.q_used == 8
    pick = kept[..., None].expand(-1, -1, -1, HEAD_DIM)
    want_v = values.gather(2, pick)
    residual_values = dequantize(quantize(v[:, :, 32:], 4, 8, 3))  # what `settle` would store
    want_v[:, :, 4:8] = residual_values[:, :, :4]
    got_v = s.read_values()
    assert torch.equal(got_v[:, :, :8], want_v[:, :, :8])  # the new quantized part: stored codes
    assert torch.equal(got_v[:, :, 8:], values.gather(2, pick)[:, :, 8:])  # the residual: the view
    got_k, want_k = s.read_keys(), keys.gather(2, pick)
    assert torch.equal(got_k[:, :, 8:], want_k[:, :, 8:])
    bound = s.kq.scale[:, :, :1].repeat_interleave(8, 2) / 2 * (1 + 1e-5)
    assert bool(((got_k[:, :, :8] - want_k[:, :, :8]).abs() <= bound).all())


def _sink_storage(fp_sinks: int, pad: int = 0) -> tuple[QuantizedKVStorage, torch.Tensor, torch.Tensor]:
    """A layer of 2 heads holding 40 tokens (the first `pad` of them padding) whose first real
    token's keys are outliers (x50), settled at 4 bits, group 8, no residual."""
    fmt = KVFormat(kv_bits=4, group_size=8, residual=0, fp_sinks=fp_sinks)
    s = QuantizedKVStorage(1, 2, torch.device("cpu"), fmt, meter=MemoryMeter())
    gen = torch.Generator().manual_seed(3)
    k, v = torch.randn(1, 2, 40, HEAD_DIM, generator=gen), torch.randn(1, 2, 40, HEAD_DIM, generator=gen)
    k[:, :, pad] *= 50
    s.ensure_capacity(40, 48, k, v)
    s.append(k, v, 0)
    if pad:
        s.mark_padding(torch.arange(40)[None] >= pad, 0)
    s.settle()
    return s, k, v


def test_sinks_in_full_precision_are_read_exactly_and_leave_their_key_group_alone() -> None:
    plain, k, v = _sink_storage(0)
    sinks, _, _ = _sink_storage(1)
    assert plain.q_used == sinks.q_used == 40
    assert torch.equal(sinks.read_keys()[:, :, 0], k[:, :, 0])
    assert torch.equal(sinks.read_values()[:, :, 0], v[:, :, 0])
    assert not torch.equal(plain.read_keys()[:, :, 0], k[:, :, 0])
    # The sink's outlier keys set group 0's range without fp_sinks: its other 7 tokens lose
    # several times more than with the sink left out of the range.
    err_plain = (plain.read_keys()[:, :, 1:8] - k[:, :, 1:8]).abs().max()
    err_sinks = (sinks.read_keys()[:, :, 1:8] - k[:, :, 1:8]).abs().max()
    assert err_sinks * 5 < err_plain
    bound = sinks.kq.scale[:, :, :1] / 2 * (1 + 1e-5)
    assert bool(((sinks.read_keys()[:, :, 1:8] - k[:, :, 1:8]).abs() <= bound).all())
    # Its bytes: one token's K and V per head in fp32, beside its codes, in kv_bytes and the meter.
    assert sinks.kv_bytes() - plain.kv_bytes() == 2 * 2 * HEAD_DIM * 4
    sinks._drop_view()
    assert sinks.meter.current == sinks.kv_bytes()


def test_sinks_survive_padding_compaction_and_row_selection() -> None:
    s, k, v = _sink_storage(2, pad=3)  # the sinks are tokens 3 and 4, behind 3 padding slots
    assert torch.equal(s.read_keys()[:, :, 3:5], k[:, :, 3:5])
    assert torch.equal(s.read_values()[:, :, 3:5], v[:, :, 3:5])
    kept = torch.tensor([[[3, 4, 9, 17, 20, 25, 33, 39]]]).expand(1, 2, -1)
    s.compact(kept, torch.full((1, 2), 8), 8)
    s.settle()
    assert s.q_used == 8  # everything kept is quantized again; the sinks now hold slots 0 and 1
    assert torch.equal(s.read_keys()[:, :, :2], k[:, :, 3:5])
    assert torch.equal(s.read_values()[:, :, :2], v[:, :, 3:5])
    s.compact(torch.tensor([[[1, 2, 3, 4, 5, 6, 7, 8]]]).expand(1, 2, -1), torch.full((1, 2), 7), 8)
    assert torch.equal(s.read_keys()[:, :, 0], k[:, :, 4])  # the first sink is gone, not the second
    s.select_rows(torch.tensor([0]))
    s.settle()
    assert torch.equal(s.read_keys()[:, :, 0], k[:, :, 4])
    s.release()
    assert s.meter.current == 0


@pytest.mark.parametrize("method,knobs", [("snapkv", {"interval": 32}), ("h2o", {}), ("beaconkv", {})])
def test_sinks_are_kept_when_a_prompt_longer_than_the_budget_is_compacted_before_any_settle(
    method, knobs
) -> None:
    """The prefill's compaction quantizes before the first settle: the sinks are captured there."""
    model = tiny_model("llama")
    ids = random_prompt(60, 3)
    cache = make_cache(model, method, budget=24, kv_bits=4, group_size=8, residual=0, fp_sinks=1, **knobs)
    with torch.no_grad():
        out = model(input_ids=ids, **cache_arg(cache), use_cache=True)
        exact = {i: layer.storage.sinks for i, layer in enumerate(cache.layers)}
        assert all(s is not None and bool((s.index == 0).all()) for s in exact.values())
        for i in range(30):
            out = model(input_ids=random_prompt(1, 10 + i), **cache_arg(cache), use_cache=True)
    assert torch.isfinite(out.logits).all()
    for layer in cache.layers:
        s = layer.storage
        assert s.q_used > 0 and s.sinks is not None
        keys = s.read_keys()
        at = s.token_index[:, :, : s.used] == 0  # the sink, if this head still holds it
        b, h, slot = at.nonzero(as_tuple=True)
        assert torch.equal(keys[b, h, slot], s.sinks.keys[b, h, 0])
