"""FixedBuffer's phase: compress at budget + interval tokens ("budget", the default) or every
`interval` tokens counted from the prompt's end ("decode", as kvpress's DecodingPress)."""

from __future__ import annotations

import pytest
import torch

import reasonkv
from conftest import greedy_loop, random_prompt, tiny_model
from reasonkv.core.hf_compat import cache_arg
from reasonkv.core.policy.base import EMPTY

BUDGET, INTERVAL = 16, 8


def kept(cache) -> list[list[list[int]]]:
    """Per layer, per head: the sequence indices held, sorted (batch row 0)."""
    out = []
    for layer in cache.layers:
        index = layer.token_index[0]
        out.append([sorted(i for i in head.tolist() if i != EMPTY) for head in index])
    return out


def trace(cache, prompt: int, steps: int, model):
    """(fed, kept) after every forward in which a layer compressed."""
    points = []

    def after(c, fed: int) -> None:
        if c.n_compressions > len(points) * len(c.layers):
            points.append((fed, kept(c)))

    greedy_loop(model, random_prompt(prompt, seed=3), cache, steps, after_step=after)
    return points


@pytest.mark.parametrize(
    "phase,prompt,points",
    [
        # The default: a head compresses on reaching budget + interval = 24 real tokens.
        ("budget", 12, [24, 32, 40]),
        ("budget", 30, [30, 38, 46]),  # a prompt past the trigger is compressed at prefill
        # kvpress's phase: every 8 tokens after the prompt's end, the prompt kept whole till then.
        ("decode", 12, [20, 28, 36, 44]),
        ("decode", 30, [38, 46]),
    ],
)
def test_compression_points_and_exact_survivors(phase: str, prompt: int, points: list[int]) -> None:
    """n_recent = budget: the survivors are exactly the newest 16 tokens, whatever the
    scores, so the kept indices pin down where each compression happened."""
    model = tiny_model("llama", "sdpa", 2)
    cache = reasonkv.make_cache(model, "snapkv", BUDGET, interval=INTERVAL, n_recent=BUDGET, phase=phase)
    got = trace(cache, prompt, 46 - prompt, model)
    assert [fed for fed, _ in got] == points
    for fed, layers in got:
        newest = list(range(fed - BUDGET, fed))
        assert layers == [[newest, newest]] * len(cache.layers)


def test_decode_phase_holds_the_prompt_until_the_first_compression() -> None:
    model = tiny_model("llama", "sdpa", 2)
    cache = reasonkv.make_cache(model, "snapkv", BUDGET, interval=INTERVAL, phase="decode")
    seen = []

    def after(c, fed: int) -> None:
        seen.append((fed, int(c.memory()["live_tokens"].max()), c.live_token_bound()))

    greedy_loop(model, random_prompt(30, seed=5), cache, 20, after_step=after)
    assert seen[0] == (30, 30, 30 + INTERVAL - 1)  # not compressed at prefill
    assert seen[7] == (37, 37, 37)  # the whole prompt and 7 new tokens
    assert seen[8][:2] == (38, BUDGET)  # then back to the budget, every 8 tokens
    assert all(live <= bound for _, live, bound in seen)
    assert cache.policy.schedule.describe() == "buffer(every 8, counted from the prompt's end)"


def test_chunks_of_steps_until_compress_replay_the_decode_phase_exactly() -> None:
    """Feeding `steps_until_compress()` tokens at a time (what replay does) compresses at the
    same points, on the same tokens, as feeding one token per forward."""
    model = tiny_model("llama", "sdpa", 2)
    ids = random_prompt(70, seed=11)
    prompt = 13

    def run(chunked: bool):
        cache = reasonkv.make_cache(model, "snapkv", BUDGET, interval=INTERVAL, phase="decode")
        states, start = [], 0
        with torch.no_grad():
            model(input_ids=ids[:, :prompt], **cache_arg(cache))
            start = prompt
            while start < ids.shape[1]:
                q = min(cache.steps_until_compress(), ids.shape[1] - start) if chunked else 1
                model(input_ids=ids[:, start : start + q], **cache_arg(cache))
                start += q
                states.append((start, cache.n_compressions, kept(cache)))
        return cache, states

    stepped, by_step = run(False)
    chunked, by_chunk = run(True)
    expected = len(stepped.layers) * ((70 - prompt) // INTERVAL)
    assert chunked.n_compressions == stepped.n_compressions == expected
    at = {fed: (n, k) for fed, n, k in by_step}
    assert len(by_chunk) < len(by_step)
    for fed, n, k in by_chunk:
        assert (n, k) == at[fed]
