"""The vLLM adapter's settings: what turns it on, what it refuses, and a request's own entry.
Pure Python (settings.py imports no vLLM), so these run in the main venv."""

from __future__ import annotations

import pytest

from reasonkv.methods.knobs import KnobError
from reasonkv.methods.resolved import resolve_method
from reasonkv.serving.vllm.settings import read_settings, request_settings


def test_no_entry_is_off_and_an_entry_is_checked() -> None:
    assert read_settings({}) is None and read_settings(None) is None
    got = read_settings({"reasonkv": {"method": "snapkv", "budget": 64, "interval": 32}})
    assert got == resolve_method("snapkv", 64, {"interval": 32})


@pytest.mark.parametrize(
    ("entry", "words"),
    [
        ({"method": "pyramidkv", "budget": 64}, "gives each layer its own budget"),
        ({"method": "adakv-snapkv", "budget": 64}, "moves the budget between KV heads"),
        ({"method": "reasonalloc-rkv", "budget": 64}, "own budget"),
        ({"method": "snapkv", "budget": 64, "kv_bits": 4}, "quantized storage"),
        ({"method": "snapkv", "budget": 64, "low_budget": 32}, "two-tier"),
        ({"method": "full", "budget": 64}, "never evicts"),
        ({"method": "beaconkv-all-queries", "budget": 64}, "not serving"),
        ({"method": "snapkv", "budget": 64, "windw": 8}, "unknown parameter(s) windw"),
        ({"method": "nope", "budget": 64}, "unknown method 'nope'"),
        ({"budget": 64}, 'needs "method"'),
        ({"method": "snapkv", "budget": 0}, "budget"),
        ("snapkv", "must be an object"),
    ],
)
def test_what_it_cannot_run_is_one_line(entry, words: str) -> None:
    with pytest.raises(KnobError) as err:
        read_settings({"reasonkv": entry})
    assert words in str(err.value)
    assert "\n" not in str(err.value)


ENGINE = resolve_method("snapkv", 64, {"interval": 32})


def test_a_request_entry_goes_over_the_engine_settings() -> None:
    assert request_settings(ENGINE, None) is ENGINE
    assert request_settings(ENGINE, {"other": 1}) is ENGINE
    assert request_settings(ENGINE, {"reasonkv": {"budget": 128}}) == resolve_method(
        "snapkv", 128, {"interval": 32}
    )
    other = request_settings(ENGINE, {"reasonkv": {"method": "streaming", "budget": 32}})
    assert other == resolve_method("streaming", 32, {})  # another method: the engine's knobs stay behind
    assert request_settings(ENGINE, {"reasonkv": False}) is None
    assert request_settings(ENGINE, {"reasonkv": '{"budget": 96}'}) == resolve_method(
        "snapkv", 96, {"interval": 32}
    )


@pytest.mark.parametrize(
    ("engine", "entry", "words"),
    [
        (None, {"budget": 64}, "needs the engine to run reasonkv"),
        (ENGINE, {"windw": 3}, "unknown parameter(s) windw"),
        (ENGINE, {"method": "pyramidkv"}, "gives each layer its own budget"),
        (ENGINE, "{budget: 3}", "must be JSON"),
        (ENGINE, 7, "must be false or an object"),
    ],
)
def test_a_bad_request_entry_is_one_line(engine, entry, words: str) -> None:
    with pytest.raises(KnobError) as err:
        request_settings(engine, {"reasonkv": entry})
    assert words in str(err.value)
