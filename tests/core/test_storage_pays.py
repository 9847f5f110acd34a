"""Quantized storage that cannot pay is refused by make_cache: the rule against the meter.

Each setting decodes a short prompt through at least two compressions of every layer (the
steady state), once as make_cache would build it at kv_bits=16 and once quantized (a refused
setting is built anyway, under `unchecked_storage`, to see what it would have held). Every
setting make_cache accepts must peak at no more `peak_kv_bytes_16bit` than the same cache at
16 bits, fed the same tokens; every one it refuses must quantize nothing ("quantizes
nothing") or hold more (with a head allocator: save less than its margin, see
`storage_pays.HEAD_SPLIT_MARGIN`). Where heads share their layer's budget, `core.storage_peak`
(one layer of each budget row, run alone) predicts both peaks byte for byte, so that is checked too.

The model is the tiny llama with head_dim 64 (the default model's), so group sizes 16, 32 and
64 all divide it. It has two layers: one layer's dequantized copy, which a quantized cache
reads every step, is half of what the rest holds, and quantizing pays at fewer settings than
on a real model (the rule is the same arithmetic, with the model's layer count).
The default run takes a spread of the settings; REASONKV_SLOW=1 runs every combination.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools

import pytest
import torch

from conftest import build_tiny_model, random_prompt
from reasonkv.core.hf_compat import cache_arg
from reasonkv.core.storage_pays import HEAD_SPLIT_MARGIN
from reasonkv.core.storage_peak import measure_layer, peak
from reasonkv.methods.api import make_cache, unchecked_storage
from reasonkv.methods.knobs import KnobError

PROMPT = 4
METHODS = {  # buffer schedules compress every 16 tokens here (their default 128 only costs steps)
    "streaming": {},
    "h2o": {},
    "tova": {},
    "snapkv": {"interval": 16},
    "rkv": {"interval": 16},
    "beaconkv": {},
    "recent-query": {},
    "random": {},
    "pyramidkv": {"interval": 16},  # layers of different budgets
    "adakv-snapkv": {"interval": 16},  # heads of different lengths
}
BUDGETS = (8, 16, 24, 32, 48, 64, 128)
SETTINGS = [
    {"kv_bits": b, "group_size": g, "residual": r}
    for b, g, r in itertools.product((4, 2), (16, 32, 64), (0, 8, 32, 200))
]
FAST = {  # (budget, settings by index into SETTINGS) per method: each crosses the line
    "streaming": ((8, (23,)), (64, (0, 2, 3, 16))),
    "h2o": ((32, (7, 12, 13)), (128, (8, 21))),
    "tova": ((48, (1, 3, 14)),),
    "snapkv": ((32, (0, 2, 12)), (64, (4, 5))),
    "rkv": ((24, (2, 12, 13)),),
    "beaconkv": ((64, (0, 2, 3)), (128, (5,))),
    "recent-query": ((48, (0, 12, 14)),),
    "random": ((128, (11, 16, 22)),),
    "pyramidkv": ((32, (0, 12)), (64, (3, 13))),
    "adakv-snapkv": ((16, (2,)), (128, (12, 13))),
}


@functools.cache
def model():
    return build_tiny_model("llama", head_dim=64)


def tokens() -> torch.Tensor:
    return random_prompt(PROMPT + 400, 7)


def steps_for(cache) -> int:
    """Decode steps after the prompt that reach every layer's trigger and pass two more of its
    compactions (an every-step schedule compacts each hole_slots + 1 steps)."""
    most = 0
    for layer in cache.layers:
        plan = layer.plan
        trigger, target = plan.trigger_max, min(plan.targets)
        cycle = max(trigger - target, plan.hole_slots + 1)
        most = max(most, trigger - PROMPT + 2 * cycle + 2)
    return most


@torch.no_grad()
def decode(cache) -> tuple[int, int]:
    """(peak_kv_bytes_16bit, the most slots any layer ever quantized) over the run."""
    ids, quantized = tokens(), 0
    model()(input_ids=ids[:, :PROMPT], **cache_arg(cache))
    for i in range(PROMPT, PROMPT + steps_for(cache)):
        model()(input_ids=ids[:, i : i + 1], **cache_arg(cache))
        quantized = max(quantized, *(getattr(layer.storage, "q_used", 0) for layer in cache.layers))
    return cache.memory()["peak_kv_bytes_16bit"], quantized


def predicted(cache) -> tuple[int, int] | None:
    """core.storage_peak's (16-bit, quantized) peaks for this cache, from one run of a layer of
    each budget row (None: heads of a layer at different lengths, which it does not follow)."""
    policy, head_dim = cache.policy, model().config.head_dim
    if policy.head_allocator is not None:
        return None
    plain = dataclasses.replace(policy, kv_format=None)
    full = [measure_layer(plain, layer.budgets, head_dim) for layer in cache.layers]
    quantized = [measure_layer(policy, layer.budgets, head_dim) for layer in cache.layers]
    return peak(full), peak(quantized)


@functools.cache
def at_16(method: str, budget: int, low_tier: tuple = ()) -> int | None:
    """The 16-bit run's peak, with the same low tier (None: the budget is refused at 16 bits
    too, e.g. below the protected window)."""
    try:
        cache = make_cache(model(), method, budget, **METHODS[method], **dict(low_tier))
    except KnobError:
        return None
    peak, _ = decode(cache)
    expected = predicted(cache)
    assert expected is None or low_tier or peak == expected[0], (method, budget)
    return peak


def check(method: str, budget: int, setting: dict) -> str:
    low_tier = tuple(sorted((k, v) for k, v in setting.items() if k.startswith("low_")))
    base = at_16(method, budget, low_tier)
    if base is None:
        return "no budget"
    knobs = {**METHODS[method], **setting}
    try:
        make_cache(model(), method, budget, **knobs)
        refusal = None
    except KnobError as err:
        refusal = str(err)
        assert "\n" not in refusal and f"kv_bits={setting['kv_bits']}" in refusal
    with unchecked_storage():
        cache = make_cache(model(), method, budget, **knobs)
    peak, quantized = decode(cache)
    expected = None if low_tier else predicted(cache)  # the low tier is beside the arithmetic
    if expected is not None and quantized:
        assert peak == expected[1], (method, budget, setting)
    label = (method, budget, setting, peak / base, refusal)
    if refusal is None:
        assert quantized and peak <= base, label
        return "accepted"
    if "quantizes nothing" in refusal:
        assert not quantized, label
        return "never quantizes"
    if "head allocator" in refusal:  # saves less than the margin, if anything
        assert peak > base * (1 - HEAD_SPLIT_MARGIN), label
        return "within the head split's margin"
    assert peak > base, label
    return "holds more"


@pytest.mark.parametrize("method", sorted(FAST))
def test_accepted_storage_never_holds_more_and_refused_storage_never_pays(method) -> None:
    seen = set()
    for budget, picks in FAST[method]:
        seen |= {check(method, budget, SETTINGS[i]) for i in picks}
    assert "accepted" in seen and len(seen) >= 3, seen


@pytest.mark.parametrize(
    "method,budget,setting,verdict",
    [  # the peaks follow the sinks, the bases' read chunk and the values' own groups
        ("streaming", 64, {**SETTINGS[0], "pre_rope": True, "hadamard": True, "fp_sinks": 1}, "holds more"),
        ("beaconkv", 128, {**SETTINGS[17], "hadamard": True}, "accepted"),
        ("snapkv", 64, {**SETTINGS[0], "value_group_size": 64}, "accepted"),
        ("h2o", 128, {**SETTINGS[8], "value_group_size": 32}, "holds more"),
        # One layer quantizes, the other never does but keeps its sinks from its first compaction.
        ("pyramidkv", 64, {**SETTINGS[5], "fp_sinks": 4, "pre_rope": True}, "holds more"),
        # A low tier is the same at both widths: the rule holds beside it, compared with it.
        ("streaming", 64, {**SETTINGS[17], "low_budget": 16}, "holds more"),
        ("h2o", 128, {**SETTINGS[0], "low_budget": 32, "low_bits": 2}, "accepted"),
    ],
)
def test_the_rule_holds_with_the_other_storage_knobs(method, budget, setting, verdict) -> None:
    assert check(method, budget, setting) == verdict


@pytest.mark.slow
@pytest.mark.parametrize("method", sorted(METHODS))
def test_every_setting_at_every_budget(method) -> None:
    seen = {check(method, budget, setting) for budget in BUDGETS for setting in SETTINGS}
    assert {"accepted", "never quantizes"} <= seen, seen


def test_a_setting_that_never_quantizes_is_one_line_naming_its_knobs() -> None:
    with pytest.raises(KnobError) as err:
        make_cache(model(), "streaming", 8, kv_bits=4, group_size=64)
    assert str(err.value) == (
        "kv_bits=4 quantizes nothing at budget 8: a head of 'streaming' holds at most 8 tokens here, "
        "and a group of group_size=64 leaves the full-precision residual (residual=2, the default at "
        "budget 8) only at 66; lower group_size or residual, raise the budget, or use kv_bits=16"
    )
    with pytest.raises(KnobError, match=r"holds at most 191 tokens .*\(residual=200\) only at 216"):
        make_cache(model(), "snapkv", 64, kv_bits=4, group_size=16, residual=200)  # 64 + 127 at most


def test_a_setting_that_holds_more_says_by_how_much_and_on_how_many_layers() -> None:
    with pytest.raises(KnobError) as err:
        make_cache(model(), "h2o", 32, kv_bits=4, group_size=16, residual=0)
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith("kv_bits=4 holds more than kv_bits=16 at budget 32 on this model: 'h2o' ")
    assert "group_size=16, residual=0 peaks at" in message and "2 layers, 16 tokens a head" in message
    with unchecked_storage():
        cache = make_cache(model(), "h2o", 32, kv_bits=4, group_size=16, residual=0)
    at_16, quantized = predicted(cache)
    assert f"({quantized / at_16:.3f}x;" in message and quantized > at_16


def test_what_a_cache_without_a_budget_or_with_the_prompt_on_top_holds_is_not_refused() -> None:
    make_cache(model(), "quant-int4", None, group_size=64)  # no budget: it quantizes what comes
    # The prompt is kept on top of the budget: how much there is to quantize is the prompt's.
    make_cache(model(), "snapkv", 8, kv_bits=4, group_size=64, protect_prompt=True)
    make_cache(model(), "snapkv", 8, kv_bits=4, group_size=64, phase="decode")
    with pytest.raises(KnobError, match=r"group_size=64, residual=2 \(the default at budget 8\) peaks"):
        make_cache(model(), "snapkv", 8, kv_bits=4, group_size=64)


def test_the_default_residual_is_a_quarter_of_the_budget_up_to_32() -> None:
    def residual(method, budget, **knobs) -> int:
        with unchecked_storage():
            return make_cache(model(), method, budget, kv_bits=4, **knobs).policy.kv_format.residual

    assert [residual("snapkv", b) for b in (8, 32, 100, 127, 128, 1024)] == [2, 8, 25, 31, 32, 32]
    assert residual("snapkv", 32, residual=32) == 32 and residual("snapkv", 512, residual=0) == 0
    assert residual("beaconkv", 64) == residual("h2o", 64) == 16
    assert residual("quant-int4", None) == residual("full", None) == 32  # no budget: 32
