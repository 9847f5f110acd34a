"""What a record of a run keeps of its knobs: as given, with the tier width of a two-tier unit
and the group size of a unit stored below 16 bits spelt out (a unit's key is made from them).
The published units' side of it: tests/methods/test_presets.py."""

from __future__ import annotations

import json

import pytest

from reasonkv.cli.common import build_runs
from reasonkv.harness.record_knobs import recorded
from reasonkv.harness.sweep.grid import parse_grid
from reasonkv.methods.presets import PRESETS
from reasonkv.methods.resolved import resolve_method


def test_sweep_grids_and_cli_runs_record_the_same_knobs(tmp_path) -> None:
    (tmp_path / "traces.jsonl").write_text(
        json.dumps({"id": "a", "problem": "1+1?", "trace": "2" * 40}) + "\n"
    )
    grid = parse_grid(
        {"kind": "replay", "models": ["tiny"], "methods": ["snapkv", "quant-int4"], "budgets": [64],
         "datasets": [{"traces": "traces.jsonl"}], "knobs": {"snapkv": {"kv_bits": 4}}},
        tmp_path,
    )  # fmt: skip
    assert grid.knobs == {"snapkv": {"kv_bits": 4, "group_size": 32}, "quant-int4": {"group_size": 32}}
    runs = build_runs(["snapkv:kv_bits=4", "quant-int4"], [64], {})
    assert {r.method: r.knobs for r in runs} == grid.knobs


@pytest.mark.parametrize(
    ("method", "budget", "knobs", "record"),
    [
        ("snapkv", 64, {"kv_bits": 4}, {"kv_bits": 4, "group_size": 32}),
        (
            "snapkv",
            64,
            {"low_budget": 8, "group_size": 16},
            {"low_budget": 8, "group_size": 16, "low_bits": 4},
        ),
        ("snapkv", 64, {"kv_bits": 4, "group_size": 16}, {"kv_bits": 4, "group_size": 16}),
        ("snapkv", 64, {"low_bits": 8, "low_budget": 8}, {"low_bits": 8, "low_budget": 8, "group_size": 32}),
        ("quant-int4", None, {}, {"group_size": 32}),
        ("h2o", 64, {"recent_ratio": 1}, {"recent_ratio": 1.0}),  # an int for a float knob: as checked
        ("h2o", 64, {}, {}),
        ("beaconkv-int4", 64, {}, dict(PRESETS["beaconkv-int4"].knobs)),  # spelt out by the preset
        ("full", None, {}, {}),
    ],
)
def test_a_record_spells_the_group_below_16_bits_and_a_two_tier_width(
    method: str, budget, knobs: dict, record: dict
) -> None:
    """A record keeps the knobs as given, plus the group size of a setting stored below 16 bits
    and the tier width of a two-tier one, and the value keeps the parts it was built with."""
    value = resolve_method(method, budget, knobs)
    kept = recorded(value)
    assert dict(kept.knobs) == record
    assert kept.policy is value.policy and kept.spec is value.spec and kept.budget == value.budget
