"""The adapter under vLLM's scheduler: continuous batching, memory given back and reused,
preemption, chunked prefill. Tiny random Llama, fp32, greedy (see vllm_helpers.py)."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="no vLLM here: the adapter's tests run in .venv-vllm (make test-vllm)")

from vllm_helpers import BLOCK, assert_same_kept, prompts, run_engine, run_hf, save_tiny_model  # noqa: E402


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    return save_tiny_model(tmp_path_factory)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


SNAPKV = {"method": "snapkv", "budget": 64, "interval": 32}


def events(run: dict, kind: str) -> list[dict]:
    return [e for e in run["trace"] if e["kind"] == kind]


def test_sixteen_requests_batched_equal_each_alone_and_free_what_the_budget_says(
    tiny_model_dir, tmp_path
) -> None:
    """16 requests of 20 to 155 prompt tokens and 40 to 115 new ones, submitted together (the
    pool admits them as blocks allow, and they finish at different steps): each one's tokens
    equal that request run alone, and every compression leaves it exactly the blocks SnapKV's
    budget needs."""
    lengths = [20 + 9 * i for i in range(16)]
    new = [40 + 5 * ((7 * i) % 16) for i in range(16)]
    spec = {
        "model": tiny_model_dir,
        "reasonkv": SNAPKV,
        "prompts": prompts(lengths, seed=1),
        "max_tokens": new,
    }
    batched = run_engine({**spec, "max_num_seqs": 16}, tmp_path, "batched")
    alone = run_engine({**spec, "max_num_seqs": 1}, tmp_path, "alone")
    assert [len(t) for t in batched["tokens"]] == new
    assert batched["tokens"] == alone["tokens"]
    assert max(e["running"] for e in events(batched, "step")) >= 12  # as many as the pool admits
    assert max(e["running"] for e in events(alone, "step")) == 1
    releases = events(batched, "release")
    assert len({e["request"] for e in releases}) >= 12  # most requests compressed
    for event in releases:
        assert event["length"] == 64 and event["blocks"] == cdiv(64, BLOCK)
    # A decode-time compression frees the one block past 64 of 96; one at the prompt's end (a
    # prompt of 96 or more) frees all the prompt's blocks past the first two.
    freed = sorted(e["freed"] for e in releases)
    prompt_blocks = {cdiv(n, BLOCK) - 2 for n in lengths if n >= 96}
    assert set(freed) <= {1} | prompt_blocks
    assert freed.count(1) > len(freed) // 2


def test_given_back_blocks_let_more_requests_run_at_once(tiny_model_dir, tmp_path) -> None:
    """A pool of 24 blocks (768 token slots) and 12 requests of 40 + 200 tokens: uncompressed,
    each grows to 8 blocks and vLLM preempts; with SnapKV at 32 (interval 32) none holds more than
    2, so the 11 that vLLM admits at once all finish without a preemption, in fewer steps."""
    spec = {
        "model": tiny_model_dir,
        "prompts": prompts([40] * 12, seed=2),
        "max_tokens": 200,
        "num_blocks": 24,
        "max_model_len": 512,  # vLLM wants one request of max_model_len to fit in the pool
    }
    # The adapter on with a budget above every request's 240 tokens is plain vLLM (test_adapter
    # proves the tokens equal) and records the scheduler's steps the same way; a budget at or
    # above max_model_len would be refused (it never evicts).
    wide = run_engine({**spec, "reasonkv": {"method": "snapkv", "budget": 256}}, tmp_path, "wide")
    tight = run_engine(
        {**spec, "reasonkv": {"method": "snapkv", "budget": 32, "interval": 32}}, tmp_path, "tight"
    )
    summary = {}
    for name, run in (("wide", wide), ("tight", tight)):
        steps = events(run, "step")
        summary[name] = {
            "steps": len(steps),
            "most_running": max(e["running"] for e in steps),
            "preemptions": len(events(run, "preempt")),
            # vLLM's own KV-usage figure, per running request
            "usage_each": sum(e["usage"] / max(e["running"], 1) for e in steps) / len(steps),
        }
    wide_run, tight_run = summary["wide"], summary["tight"]
    # Seen: wide 632 steps, 17 preemptions, 0.239 of the pool a request; tight 401, 0, 0.085.
    assert wide_run["preemptions"] > 0 and tight_run["preemptions"] == 0, summary
    assert tight_run["most_running"] >= 10, summary
    assert tight_run["steps"] <= 0.75 * wide_run["steps"], summary
    assert tight_run["usage_each"] <= wide_run["usage_each"] / 2, summary
    assert all(len(t) == 200 for t in tight["tokens"])


def test_a_preempted_request_starts_again_from_its_tokens(tiny_model_dir, tmp_path) -> None:
    """vLLM recomputes a preempted request from its prompt and the tokens it emitted; the adapter
    drops the request's state and compresses that recomputed prefill as a new prompt (what the
    HF path does for a sequence given as a prompt, except that the prompt's end stays where the
    request's prompt ended). Every request still finishes; one never preempted equals its run
    alone, and a preempted one does up to its first preemption."""
    lengths = [40, 48, 56, 64, 72, 80]
    spec = {
        "model": tiny_model_dir, "reasonkv": {"method": "snapkv", "budget": 128, "interval": 64},
        "prompts": prompts(lengths, seed=3), "max_tokens": 260, "num_blocks": 14,
        "max_model_len": 384,
    }  # fmt: skip
    squeezed = run_engine(spec, tmp_path, "squeezed")
    alone = run_engine({**spec, "max_num_seqs": 1, "num_blocks": 64}, tmp_path, "roomy")
    preempted = events(squeezed, "preempt")
    assert preempted, "no request was preempted: the pool is too large for this test"
    assert all(len(t) == 260 for t in squeezed["tokens"])
    prompt_of = {e["request"]: e["prompt_len"] for e in events(squeezed, "kept")}
    first_preempt: dict[int, int] = {}  # prompt length -> tokens computed at its first preemption
    for event in preempted:
        n = prompt_of[event["request"]]
        first_preempt[n] = min(first_preempt.get(n, event["computed"]), event["computed"])
    for n, mine, theirs in zip(lengths, squeezed["tokens"], alone["tokens"], strict=True):
        if n not in first_preempt:
            assert mine == theirs, f"request of {n} prompt tokens was never preempted"
        else:  # the tokens it emitted before its first preemption are the uninterrupted run's
            emitted = max(first_preempt[n] - n, 0)
            assert mine[:emitted] == theirs[:emitted], f"request of {n} prompt tokens"


CHUNKED = [
    ("snapkv", 64, {"interval": 32}),
    ("snapkv-decode", 64, {"interval": 32, "phase": "decode"}),
    ("rpc", 8, {"ratio": 2.0}),  # P = 16: first compression after 32 recent + 16 generated
    ("rkv", 64, {"interval": 32}),
    ("streaming", 64, {}),
    ("h2o", 48, {}),
    ("beaconkv", 64, {}),
]
"""Every schedule that counts from the prompt's end (SnapKV with phase="decode", RPC's prompt
length) is here: before the step took the prompt's end from the engine, both counted from the
first chunk's end. All methods, chunked, against one prefill: tests/serving/test_paged_rows.py."""

FIRST_COMPRESSION = {"snapkv": 0, "snapkv-decode": 32, "rpc": 48}
"""Tokens past the prompt's end at a request's first compression: SnapKV compresses the prompt
(longer than its budget) at its end; with phase="decode" one interval later; RPC after its 32
recent and one period of 16 generated tokens."""


@pytest.mark.parametrize(("method", "budget", "knobs"), CHUNKED, ids=[c[0] for c in CHUNKED])
def test_chunked_prefill_keeps_what_one_prefill_keeps(
    tiny_model_dir, tmp_path, method, budget, knobs
) -> None:
    """Prompts of 150 to 230 tokens prefilled 64 tokens a step: compression waits for the prompt's
    last chunk, and the kept tokens and outputs equal the HF path's one-forward prefill."""
    lengths = [150, 190, 230]
    case, method = method, method.removesuffix("-decode")
    settings = {"method": method, "budget": budget, **knobs}
    spec = {"model": tiny_model_dir, "prompts": prompts(lengths, seed=4), "max_tokens": 60}
    engine = run_engine({**spec, "reasonkv": settings, "max_num_batched_tokens": 64}, tmp_path, method)
    hf = run_hf({**spec, "method": method, "budget": budget, "knobs": knobs}, tmp_path, method)
    assert engine["tokens"] == hf["tokens"]
    assert_same_kept(engine, hf, lengths)
    if case in FIRST_COMPRESSION:  # counted from the prompt's true end, not the first chunk's
        first = {}
        for e in events(engine, "kept"):
            first[e["prompt_len"]] = min(first.get(e["prompt_len"], e["seen"]), e["seen"])
        assert first == {n: n + FIRST_COMPRESSION[case] for n in lengths}


def test_a_method_that_may_evict_its_prompt_shares_no_block(tiny_model_dir, tmp_path) -> None:
    """vLLM's prefix caching stays on with the adapter; SnapKV may evict from its prompt, so two
    requests with the same prompt share no block (one of them would compact it): each equals
    its run alone, and neither finds a cached block (test_prefix_caching.py has the rest)."""
    same = prompts([70], seed=5)[0]
    spec = {
        "model": tiny_model_dir, "reasonkv": SNAPKV, "prompts": [same, same, prompts([75], seed=6)[0]],
        "max_tokens": 100, "enable_prefix_caching": True,
    }  # fmt: skip
    together = run_engine(spec, tmp_path, "together")
    alone = run_engine({**spec, "max_num_seqs": 1}, tmp_path, "apart")
    assert together["tokens"] == alone["tokens"]
    assert together["tokens"][0] == together["tokens"][1]
    again = run_engine({**spec, "waves": [[0], [1]]}, tmp_path, "again")
    assert [w["cached"] for w in again["waves"]] == [[0], [0]]
    assert [w["tokens"][0] for w in again["waves"]] == alone["tokens"][:2]


def test_vllm_refuses_a_pool_smaller_than_one_uncompressed_request(tiny_model_dir, tmp_path) -> None:
    """The limit docs/serving.md states, as vLLM 0.32 enforces it with the adapter on: a pool of
    16 blocks of 32 (512 slots) cannot start an engine whose max_model_len is 1024, though SnapKV
    at 64 would never let a request hold more than 3 blocks after its prompt."""
    spec = {
        "model": tiny_model_dir, "reasonkv": {"method": "snapkv", "budget": 64, "interval": 32},
        "prompts": prompts([40]), "max_tokens": 8, "num_blocks": 16, "max_model_len": 1024,
    }  # fmt: skip
    with pytest.raises(AssertionError) as refused:
        run_engine(spec, tmp_path, "small-pool")
    assert "max seq len (1024)" in str(refused.value)
    assert "estimated maximum model length is 480" in str(refused.value)
    assert run_engine({**spec, "max_model_len": 480}, tmp_path, "fits")["tokens"][0]  # 15 usable blocks
