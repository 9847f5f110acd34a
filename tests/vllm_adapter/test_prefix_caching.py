"""Prefix caching with the adapter on: a compressed request that keeps its prompt whole
(`protect_prompt`) shares its prompt's blocks; one that may evict from its prompt shares
nothing; requests that opt out keep vLLM's own rules (serving/prefix_sharing.py)."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="the vLLM adapter's tests run in .venv-vllm: make test-vllm")

from vllm_helpers import BLOCK, prompts, run_engine, save_tiny_model  # noqa: E402

SYSTEM = 8 * BLOCK  # a shared system prompt of 8 whole blocks
OWN = (40, 48)  # the two requests' own parts after it: prompts of 296 and 304 tokens
TOKENS = 96
NUM_BLOCKS = 96
SHARING = [  # method, budget, knobs, the first request's hit when it comes again
    ("rpc", 16, {"ratio": 2.0}, 256),  # (296 - its 32-query window) in whole blocks; vLLM alone: 288
    ("snapkv", 64, {"interval": 16, "protect_prompt": True}, 288),  # window 8: the limit is vLLM's own
    ("beaconkv", 64, {"protect_prompt": True}, 256),  # 16 recent + 8 waiting queries
]


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory) -> str:
    return save_tiny_model(tmp_path_factory)


def shared_prompts(own: tuple[int, ...]) -> list[list[int]]:
    """One prompt per entry of `own`: one system prompt, then that many tokens of its own."""
    (system,) = prompts([SYSTEM], seed=1)
    return [system + mine for mine in prompts(list(own), seed=2)]


def both_running(trace: list[dict], wave: int) -> dict:
    """The scheduler's first step of a wave with both its requests running (both allocated; the
    engine core may take the second a step after the first)."""
    start = next(i for i, e in enumerate(trace) if e["kind"] == "wave" and e["wave"] == wave)
    return next(e for e in trace[start:] if e["kind"] == "step" and e["running"] == 2)


@pytest.mark.parametrize(("method", "budget", "knobs", "again"), SHARING, ids=[s[0] for s in SHARING])
def test_compressed_requests_share_a_kept_system_prompt(
    tiny_model_dir, tmp_path, method, budget, knobs, again
) -> None:
    """Two compressed requests after one system prompt: the second finds its blocks cached and
    holds them once, and each generates what it generates alone without prefix caching, with
    the same kept tokens at every compression. The first one again finds its own prompt's
    blocks only up to its method's limit, and still generates the same. A later request that
    reads the first one's prompt and 64 of its generated tokens finds only the prompt's blocks
    cached: the blocks compaction rewrote were never named for reuse."""
    a, b = shared_prompts(OWN)
    base = {
        "model": tiny_model_dir, "reasonkv": {"method": method, "budget": budget, **knobs}, "prompts": [a, b],
        "max_tokens": TOKENS, "num_blocks": NUM_BLOCKS,
        "continuation": {"from": 0, "take": 64, "max_tokens": 16, "extra_args": {"reasonkv": False}},
    }  # fmt: skip
    off = run_engine({**base, "enable_prefix_caching": False, "waves": [[0], [1], [0, 1]]}, tmp_path, "off")
    on = run_engine({**base, "enable_prefix_caching": True, "waves": [[0, 1], [0]]}, tmp_path, "on")
    alone = [off["waves"][0]["tokens"][0], off["waves"][1]["tokens"][0]]
    assert on["waves"][0]["tokens"] == alone
    assert off["waves"][2]["tokens"] == alone
    assert on["waves"][0]["cached"] == [0, SYSTEM]  # the second starts after the system prompt
    assert off["waves"][2]["cached"] == [0, 0]
    assert on["waves"][1] == {"tokens": alone[:1], "cached": [again]}
    # The system prompt's 8 blocks are held once: 8 more blocks free than without sharing.
    assert both_running(on["trace"], 0)["free_blocks"] - both_running(off["trace"], 2)["free_blocks"] == 8
    # Both compressed, with the same kept tokens as alone (every (request, seen, layer) event).
    kept = [
        {(e["prompt_len"], e["seen"], e["layer"], str(e["kept"])) for e in r["trace"] if e["kind"] == "kept"}
        for r in (on, off)
    ]
    assert kept[0] == kept[1] and {k[0] for k in kept[0]} == {len(a), len(b)}
    # Only the first request's prompt blocks were named: 9 whole blocks of its 296 tokens.
    assert on["waves"][2]["cached"] == [len(a) // BLOCK * BLOCK]
    assert on["waves"][2]["tokens"] == off["waves"][3]["tokens"]


def test_a_method_that_evicts_from_the_prompt_shares_nothing_and_opted_out_requests_do(
    tiny_model_dir, tmp_path
) -> None:
    """SnapKV may evict prompt tokens, so its requests neither find nor name cached blocks;
    requests that opt out keep vLLM's prefix caching, among themselves."""
    a, b, c = shared_prompts((40, 40, 40))
    out = {"reasonkv": False}
    spec = {
        "model": tiny_model_dir, "reasonkv": {"method": "snapkv", "budget": 64, "interval": 16},
        "prompts": [a, b, c], "max_tokens": TOKENS, "num_blocks": NUM_BLOCKS,
        "extra_args": [{"reasonkv": {}}, out, out], "waves": [[0], [1], [0], [2]],
    }  # fmt: skip
    run = run_engine(spec, tmp_path, "evicting")
    cached = [w["cached"][0] for w in run["waves"]]
    # The compressed request named nothing, so the opted-out one finds nothing; the compressed
    # one run again does not find the opted-out one's blocks; the next opted-out one does.
    assert cached == [0, 0, 0, SYSTEM]
    assert any(e["kind"] == "kept" for e in run["trace"])


class _Rules:
    def __init__(self, sharing) -> None:
        self.sharing = sharing

    def of(self, request):
        return self.sharing


class _Manager:
    """A KV-cache manager's lookup and registration as `_share_kept_prompts` wraps them: the
    lookup finds `found` tokens whatever the request's length (a lookup that overshoots)."""

    empty_kv_cache_blocks = "no blocks"

    def __init__(self, found: int) -> None:
        self.found, self.looked_up, self.registered = found, [], []
        self.coordinator = self

    def get_computed_blocks(self, request):
        self.looked_up.append(request.num_tokens)
        return "blocks", self.found, 0

    def cache_blocks(self, request, num_computed_tokens: int) -> None:
        self.registered.append(num_computed_tokens)


class _Request:
    request_id, num_tokens = "r", 300


@pytest.mark.parametrize(("found", "expected"), [(256, 256), (288, 0)])
def test_the_scheduler_never_hands_a_request_more_than_its_limit(found, expected) -> None:
    """The lookup sees the request cut to its limit + 1 tokens, and a result past the limit is
    dropped (no hit) rather than reaching the worker, whose check would stop the engine."""
    from reasonkv.serving.prefix_sharing import PromptSharing
    from reasonkv.serving.vllm.hooks import _share_kept_prompts

    manager = _Manager(found)
    _share_kept_prompts(manager, _Rules(PromptSharing(hit=256, named=288)))
    blocks, hit, _ = manager.get_computed_blocks(_Request())
    assert manager.looked_up == [257]
    assert hit == expected and blocks == ("blocks" if expected else "no blocks")
    manager.coordinator.cache_blocks(_Request(), 300)
    assert manager.registered == [288]
    # Not compressed: vLLM's own lookup and registration, untouched.
    plain = _Manager(found)
    _share_kept_prompts(plain, _Rules(None))
    assert plain.get_computed_blocks(_Request())[1] == found and plain.looked_up == [300]
    plain.coordinator.cache_blocks(_Request(), 300)
    assert plain.registered == [300]
