"""What a record of a run keeps of its knobs: as given, with the tier width of a two-tier unit
and the group size of a unit stored below 16 bits spelt out (a unit's key is made from them).
The published units' side of it: tests/methods/test_presets.py."""

from __future__ import annotations

import json

import pytest

from reasonkv.cli.common import build_runs
from reasonkv.harness.record_knobs import record_knobs, recorded
from reasonkv.harness.sweep.grid import parse_grid
from reasonkv.methods.knobs import knobs_for_methods
from reasonkv.methods.resolved import resolve_method


def test_a_unit_stored_below_16_bits_records_its_group_and_a_two_tier_unit_its_width() -> None:
    knobs = knobs_for_methods(["snapkv", "quant-int4", "h2o"], {}, {"snapkv": {"kv_bits": 4}})
    assert knobs == {"snapkv": {"kv_bits": 4}, "quant-int4": {}, "h2o": {}}  # as given: checked only
    recorded = {name: record_knobs(name, k) for name, k in knobs.items()}
    assert recorded == {
        "snapkv": {"kv_bits": 4, "group_size": 32},
        "quant-int4": {"group_size": 32},
        "h2o": {},
    }
    two_tier = record_knobs("snapkv", {"low_budget": 8, "group_size": 16})
    assert two_tier == {"low_budget": 8, "group_size": 16, "low_bits": 4}
    assert record_knobs("snapkv", {"kv_bits": 4, "group_size": 16}) == {"kv_bits": 4, "group_size": 16}


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
    ("method", "budget", "knobs"),
    [
        ("snapkv", 64, {"kv_bits": 4}),
        ("snapkv", 64, {"low_budget": 8, "group_size": 16}),
        ("snapkv", 64, {"kv_bits": 4, "group_size": 16}),
        ("quant-int4", None, {}),
        ("h2o", 64, {"recent_ratio": 1}),  # an int for a float knob: recorded as checked (1.0)
        ("beaconkv-int4", 64, {}),
        ("full", None, {}),
    ],
)
def test_a_resolved_value_records_what_the_record_rule_says(method: str, budget, knobs: dict) -> None:
    """`recorded` (from a resolved value's spec and storage format) spells out what
    `record_knobs` (from the registry) does, and keeps the parts the value was built with."""
    value = resolve_method(method, budget, knobs)
    kept = recorded(value)
    assert dict(kept.knobs) == record_knobs(method, dict(value.knobs))
    assert kept.policy is value.policy and kept.spec is value.spec and kept.budget == value.budget
