"""Presets (methods/presets.py): a name for a (method, knobs) that docs/results.md recommends,
accepted wherever a method's name is. A preset's cache is the cache of its method with its knobs
spelled out; the caller's knobs override the preset's; bad names and knobs are the methods' own
one-line errors; each preset's numbers are the records it names. Also the group_size default
(32) and the published records that keep meaning 16."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

import reasonkv
from conftest import build_tiny_model, greedy_loop, random_prompt, tiny_model
from reasonkv.cli import common
from reasonkv.core.quantize import KVFormat
from reasonkv.harness.sweep.grid import parse_grid
from reasonkv.harness.sweep.units import unit_key
from reasonkv.methods.knobs import KnobError, check_knobs, stores_quantized
from reasonkv.methods.presets import PRESETS
from reasonkv.methods.registry import METHODS, get_method, register, resolve
from reasonkv.methods.resolved import resolve_method

ROOT = Path(__file__).resolve().parents[2]
RESULTS = sorted((ROOT / "docs" / "results").glob("*.jsonl"))


@pytest.fixture(scope="module")
def model64():
    """A tiny Llama with the default model's head dim (64): the presets' groups need it."""
    return build_tiny_model("llama", head_dim=64)


def _policy_parts(cache) -> tuple:
    p = cache.policy
    freq = None if p.rope_inv_freq is None else p.rope_inv_freq.tolist()
    parts = (p.scorer, p.schedule, p.head_allocator, p.kv_format, p.n_sink, p.n_recent, p.protect_prompt)
    return (*parts, freq, p.rope_attention_scaling)


def test_presets_name_registered_methods_with_knobs_they_accept() -> None:
    assert PRESETS and not set(PRESETS) & set(METHODS)
    for name, preset in PRESETS.items():
        base = METHODS[preset.method]
        assert check_knobs(base, dict(preset.knobs)) == dict(preset.knobs)
        spec = get_method(name)
        assert spec.preset_of == preset.method and spec.compresses == base.compresses
        assert spec.knobs() == {**base.knobs(), **preset.knobs}
        assert resolve(name, {"n_sink": 2}) == (preset.method, {**preset.knobs, "n_sink": 2})
    assert resolve("snapkv", {"window": 4}) == ("snapkv", {"window": 4})


def test_the_top_1_goal_preset_is_the_eight_knobs_of_results_md() -> None:
    assert resolve("beaconkv-int4") == (
        "beaconkv",
        {
            "kv_bits": 4,
            "group_size": 32,
            "value_group_size": 64,
            "residual": 0,
            "fp_sinks": 1,
            "pre_rope": True,
            "hadamard": True,
            "fraction": 0.0625,
        },
    )


@pytest.mark.usefixtures("toy_storage")  # 4 bits on a two-layer model: more than 16 bits would hold
@pytest.mark.parametrize("name", list(PRESETS))
def test_a_preset_builds_the_cache_of_its_knobs_spelled_out(model64, name: str) -> None:
    preset = PRESETS[name]
    by_name = reasonkv.make_cache(model64, name, 64)
    spelled = reasonkv.make_cache(model64, preset.method, 64, **preset.knobs)
    assert by_name.method == spelled.method == preset.method
    assert _policy_parts(by_name) == _policy_parts(spelled)
    assert torch.equal(by_name.budgets, spelled.budgets)
    prompt = random_prompt(40, seed=11)
    tokens, logits = greedy_loop(model64, prompt, by_name, 60)
    tokens_spelled, logits_spelled = greedy_loop(model64, prompt, spelled, 60)
    assert by_name.n_compressions > 0  # past several compressions: the kept tokens are chosen
    assert torch.equal(tokens, tokens_spelled) and torch.equal(logits, logits_spelled)
    for mine, theirs in zip(by_name.layers, spelled.layers, strict=True):
        assert torch.equal(mine.token_index, theirs.token_index)


@pytest.mark.usefixtures("toy_storage")
def test_the_callers_knobs_override_the_presets(model64) -> None:
    preset = PRESETS["beaconkv-int4"]
    mine = {"fraction": 0.125, "kv_bits": 8, "n_sink": 2}
    by_name = reasonkv.make_cache(model64, "beaconkv-int4", 64, **mine)
    spelled = reasonkv.make_cache(model64, "beaconkv", 64, **{**preset.knobs, **mine})
    assert _policy_parts(by_name) == _policy_parts(spelled)
    fmt = by_name.policy.kv_format
    assert (fmt.kv_bits, fmt.group_size, fmt.hadamard, by_name.policy.n_sink) == (8, 32, True, 2)
    assert by_name.policy.schedule.fraction == 0.125
    # a record of it (the CLI's and sweeps' checked knobs) spells out what ran
    assert check_knobs(get_method("beaconkv-int4"), {"fraction": 0.125}) == {
        **preset.knobs,
        "fraction": 0.125,
    }


def _one_line(err: pytest.ExceptionInfo) -> str:
    text = str(err.value)
    assert "\n" not in text
    return text


def test_bad_knobs_and_names_are_the_methods_one_line_errors(model64) -> None:
    with pytest.raises(KnobError) as preset_err:
        reasonkv.make_cache(model64, "beaconkv-int4", 671, no_such_knob=1)
    with pytest.raises(KnobError) as method_err:
        reasonkv.make_cache(model64, "beaconkv", 671, no_such_knob=1)
    assert _one_line(preset_err) == _one_line(method_err).replace("'beaconkv'", "'beaconkv-int4'")
    with pytest.raises(KnobError) as err:
        reasonkv.make_cache(model64, "beaconkv-int4", 671, fraction=2)
    assert _one_line(err) == "parameter 'fraction' of 'beaconkv-int4' must be in (0, 1), got 2.0"
    with pytest.raises(ValueError) as err:
        reasonkv.make_cache(model64, "beaconkv-int5", 671)
    assert _one_line(err).startswith("unknown method 'beaconkv-int5'; available: full, ")
    assert "; presets: beaconkv-int4, " in str(err.value)
    with pytest.raises(ValueError, match="'beaconkv-int4' is already registered as a preset"):
        register(dataclasses.replace(METHODS["beaconkv"], name="beaconkv-int4"))


def test_a_preset_whose_groups_do_not_fit_the_head_dim_says_so_in_one_line() -> None:
    with pytest.raises(KnobError) as err:
        reasonkv.make_cache(tiny_model("llama"), "beaconkv-int4", 64)  # head dim 16
    assert _one_line(err) == (
        "parameters of 'beaconkv-int4' do not fit the model: value_group_size 64 must divide the model's "
        "head dim (16): values are quantized per token in groups of value_group_size channels; set "
        "value_group_size to a power of two up to 16"
    )


def test_the_cli_and_sweeps_take_a_preset_as_a_method() -> None:
    (run,) = common.build_runs(["beaconkv-int4"], [671], {"n_sink": 2})
    assert (run.method, run.budget) == ("beaconkv-int4", 671)
    assert run.knobs == {**PRESETS["beaconkv-int4"].knobs, "n_sink": 2}
    grid = parse_grid(
        {"kind": "replay", "models": ["tiny"], "methods": ["beaconkv-lean", "snapkv"], "budgets": [64],
         "knobs": {"window": 4}, "datasets": [{"traces": "t.jsonl"}]}
    )  # fmt: skip
    assert grid.knobs["beaconkv-lean"] == {**PRESETS["beaconkv-lean"].knobs}  # beaconkv has no `window`
    assert grid.knobs["snapkv"] == {"window": 4}
    assert grid.runs[("beaconkv-lean", 64)] == resolve_method("beaconkv-lean", 64)


def _pooled(rows: list[dict]) -> tuple[float, float]:
    sums = [r["metrics"]["sums"] for r in rows]
    n = sum(s["n"] for s in sums)
    return sum(s["kl"] for s in sums) / n, sum(s["top1"] for s in sums) / n


@pytest.mark.parametrize("name", list(PRESETS))
def test_each_presets_numbers_are_the_records_it_names(name: str) -> None:
    preset = PRESETS[name]
    assert (ROOT / preset.grid).is_file()
    assert f"\n## {preset.section}\n" in (ROOT / "docs" / "results.md").read_text()
    rows = [json.loads(line) for line in (ROOT / preset.records).read_text().splitlines() if line.strip()]
    mine = [
        r for r in rows if r["config"]["method"] == preset.method and r["config"]["knobs"] == preset.knobs
    ]
    budgets = sorted({r["config"]["budget"] for r in mine})
    assert preset.budget in budgets
    for budget in budgets:
        at = [r for r in mine if r["config"]["budget"] == budget]
        assert len(at) == 12 and {r["config"]["dataset"] for r in at} == {"mip-math500-12"}  # the tuning set
        kl, top1 = _pooled(at)
        assert f"budget {budget}: KL {kl:.4f}, top-1 {top1:.3f}" in preset.measured


def test_the_default_group_is_32_and_too_big_a_group_says_so_in_one_line() -> None:
    assert KVFormat().group_size == 32
    with pytest.raises(KnobError) as err:
        reasonkv.make_cache(tiny_model("llama"), "quant-int4")
    assert _one_line(err).endswith(
        "group_size 32 must divide the model's head dim (16): values are quantized per token in groups "
        "of group_size channels; set group_size to a power of two up to 16"
    )
    reasonkv.make_cache(tiny_model("llama"), "quant-int4", group_size=16)  # the tests set their own


@pytest.mark.parametrize("path", RESULTS, ids=[p.name for p in RESULTS])
def test_every_published_unit_below_16_bits_spells_its_group(path: Path) -> None:
    """The default group moved 16 -> 32: every published unit that ran at 16 says so, and keeps
    the key its grid (which spells it too) gives it, so a rerun skips it."""
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        row = json.loads(line)
        config = row["config"]
        assert row["key"] == unit_key(config)
        if stores_quantized(config["method"], config.get("knobs") or {}):
            assert "group_size" in config["knobs"], (path.name, row["key"])
