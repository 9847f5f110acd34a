"""vLLM's fp8 KV cache with the adapter on: the step scores on the keys dequantised as the kernel
reads them and compacts by moving the stored bytes (test_paged_kv.py checks both op by op)."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="the vLLM adapter's tests run in .venv-vllm: make test-vllm")

import torch  # noqa: E402
from vllm_helpers import prompts, run_engine, run_hf, save_tiny_model  # noqa: E402

pytestmark = pytest.mark.skipif(
    not (torch.cpu._is_avx512_supported() or torch.cpu._is_amx_tile_supported()),
    reason="vLLM's CPU backend stores an fp8 KV cache only on x86 with AVX-512 or AMX",
)

TOKENS = 100
LENGTHS = [40, 47, 54]
MIN_OVERLAP = 0.93
"""Mean share of the HF path's kept tokens the fp8 engine keeps too, per KV head at each request's
first compression of each layer (the last point where both saw the same tokens). The HF path
scores full-precision keys and the engine keys rounded to e4m3, so decisions near a tie go either
way. Measured here: snapkv 0.964 and beaconkv 0.984 (8 and 6 of 12 heads identical); with the
keys read as raw bytes instead of dequantised, 0.711 and 0.867 (no head identical)."""


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory) -> str:
    return save_tiny_model(tmp_path_factory)


def spec(model: str, reasonkv: dict | None, kv: str = "fp8", **extra) -> dict:
    return {"model": model, "reasonkv": reasonkv, "prompts": prompts(LENGTHS), "max_tokens": TOKENS,
            "kv_cache_dtype": kv, **extra}  # fmt: skip


@pytest.mark.parametrize("kv", ["fp8", "fp8_e5m2"])
def test_fp8_above_the_length_and_opted_out_are_plain_vllm_with_fp8(tiny_model_dir, tmp_path, kv) -> None:
    plain = run_engine(spec(tiny_model_dir, None, kv), tmp_path, f"plain-{kv}", env={"VLLM_PLUGINS": "none"})
    wide = run_engine(spec(tiny_model_dir, {"method": "snapkv", "budget": 512}, kv), tmp_path, f"wide-{kv}")
    assert wide["tokens"] == plain["tokens"] and all(len(t) == TOKENS for t in plain["tokens"])
    assert {e["kind"] for e in wide["trace"]} == {"step"}  # nothing compressed
    # Per-request settings: the second request opts out, the third brings its own budget.
    own = [None, {"reasonkv": False}, {"reasonkv": {"budget": 48}}]
    mixed = run_engine(
        {**spec(tiny_model_dir, {"method": "snapkv", "budget": 32, "interval": 16}, kv), "extra_args": own},
        tmp_path,
        f"own-{kv}",
    )
    assert mixed["tokens"][1] == plain["tokens"][1]
    kept = [e for e in mixed["trace"] if e["kind"] == "kept"]
    assert {e["prompt_len"]: {len(h) for h in e["kept"]} for e in kept} == {40: {32}, 54: {48}}


EVICTING = [("snapkv", 32, {"interval": 16}), ("beaconkv", 48, {})]


@pytest.mark.parametrize(("method", "budget", "knobs"), EVICTING, ids=[m for m, _, _ in EVICTING])
def test_fp8_eviction_keeps_nearly_what_the_hf_path_keeps(tiny_model_dir, tmp_path, method, budget, knobs):
    settings = {"method": method, "budget": budget, **knobs}
    engine = run_engine(spec(tiny_model_dir, settings), tmp_path, method)
    reference = {**spec(tiny_model_dir, None), "method": method, "budget": budget, "knobs": knobs}
    hf = run_hf(reference, tmp_path, method)
    mine = {
        (e["prompt_len"], e["seen"], e["layer"]): e["kept"] for e in engine["trace"] if e["kind"] == "kept"
    }
    first = {}
    for e in sorted(hf["kept"], key=lambda e: e["seen"]):
        first.setdefault((LENGTHS[e["prompt"]], e["layer"]), (e["seen"], e["kept"]))
    overlaps, identical = [], 0
    for (n, layer), (seen, kept) in first.items():
        got = mine.get((n, seen, layer))
        assert got is not None, (
            f"request of {n} tokens, layer {layer}: the HF path compressed at {seen}, vLLM not"
        )
        for a, b in zip(got, kept, strict=True):
            assert len(a) == len(b) <= budget  # BeaconKV keeps 7/8 of its budget after evicting
            overlaps.append(len(set(a) & set(b)) / len(b))
            identical += a == b
    assert len(overlaps) == len(LENGTHS) * 2 * 2  # requests x layers x KV heads
    assert sum(overlaps) / len(overlaps) >= MIN_OVERLAP, overlaps
    assert identical >= len(overlaps) // 3, identical
