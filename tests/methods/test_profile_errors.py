"""A Reasoning Wave profile that is not a usable demand curve is refused with one sentence that
names the file and the bad value, before any budget is computed from it."""

from __future__ import annotations

import json

import pytest

import reasonkv
from conftest import tiny_model
from reasonkv.methods.profiles import config_hash, find_profile, load_profile
from reasonkv.util.records import RecordError


def _write(path, demand_text: str, model=None) -> str:
    model = model or tiny_model("llama", "sdpa", 2)
    config = config_hash(model.config)
    path.write_text(f'{{"model": "tiny", "config_hash": "{config}", "demand": {demand_text}}}')
    return str(path)


@pytest.mark.parametrize(
    ("demand", "message"),
    [
        ("null", "`demand` must be a non-empty list of numbers (one per layer), got null"),
        ("3", "`demand` must be a non-empty list of numbers (one per layer), got a number"),
        ("[]", "got an empty list"),
        ("[NaN, 1.0]", "`demand` of layer 0 must be a finite number >= 0, got nan"),
        ("[1.0, Infinity]", "`demand` of layer 1 must be a finite number >= 0, got inf"),
        ("[0.5, -0.2]", "`demand` of layer 1 must be a finite number >= 0, got -0.2"),
        ('[0.5, "high"]', "`demand` of layer 1 must be a finite number >= 0, got a string"),
        ("[true, 1]", "`demand` of layer 0 must be a finite number >= 0, got true/false"),
        ("[null, 1]", "`demand` of layer 0 must be a finite number >= 0, got null"),
        ("[0, 0.0]", "`demand` is zero on every layer"),
        ("[1.0, 2.0, 3.0]", "`demand` has 3 values, one per layer, but the model has 2 layers"),
        ("[1.0]", "`demand` has 1 values, one per layer, but the model has 2 layers"),
    ],
)
def test_a_bad_demand_curve_names_the_file_and_the_value(tmp_path, demand, message) -> None:
    model = tiny_model("llama", "sdpa", 2)
    path = _write(tmp_path / "wave.json", demand, model)
    with pytest.raises(RecordError) as err:
        load_profile(path, model.config)
    assert str(err.value).startswith(f"{path}: ") and message in str(err.value)
    with pytest.raises(ValueError, match="wave.json: `demand`"):  # the cache never sees it
        reasonkv.make_cache(model, "reasonalloc-layer-rkv", 64, profile=path)


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"3", "a profile must be a JSON object ({...}), got a number"),
        (b"[0.5, 0.5]", "a profile must be a JSON object ({...}), got a list"),
        (b'{"config_hash": "x", "demand": [0.5, 0.', ":1: not JSON (Expecting"),
        (b"\x89PNG\r\n\x1a\n\x00\x00\x00", "not UTF-8 text (byte 0x89 at offset 0; a binary file?)"),
        (b'{"demand": [1.0, 2.0]}', "is not a reasonkv profile (no demand curve / config hash)"),
    ],
)
def test_a_profile_file_that_is_not_a_profile_is_named(tmp_path, data, message) -> None:
    path = tmp_path / "wave.json"
    path.write_bytes(data)
    with pytest.raises(ValueError) as err:
        load_profile(path)
    assert str(err.value).startswith(str(path)) and message in str(err.value)


def test_a_good_profile_without_a_model_is_read_and_bad_files_are_skipped_when_searching(tmp_path) -> None:
    model = tiny_model("llama", "sdpa", 2)
    (tmp_path / "a-number.json").write_text("3")
    (tmp_path / "b-broken.json").write_text('{"config_hash": ')
    good = _write(tmp_path / "c-good.json", "[0.0, 0.5]", model)  # one quiet layer is fine
    assert load_profile(good)["demand"] == [0.0, 0.5]
    assert find_profile(model.config, [tmp_path]) == tmp_path / "c-good.json"
    assert json.loads((tmp_path / "c-good.json").read_text())["model"] == "tiny"
