"""The papers' comparators: `recent-query` (BeaconKV without beacons) and `random` (the floor
every scoring evictor must clear), each against a loop reference, end to end in a cache."""

from __future__ import annotations

import math

import pytest
import torch

from conftest import greedy_loop, left_pad, random_prompt, tiny_model
from method_helpers import kept_tokens
from reasonkv import make_cache
from reasonkv.core.hf_compat import cache_arg
from reasonkv.core.policy import EMPTY, BeaconKVScorer, Observation, protected_mask, select_tokens
from reasonkv.core.policy.scorers.random import MODULUS, RandomScorer
from reasonkv.core.policy.scorers.recent_query import RecentQueryScorer

D = 8


def hand_made_obs(seed: int = 3) -> tuple[Observation, torch.Tensor]:
    """B=2, H=2, G=2, W=4, T=12: row 1 has a padding slot and a padding query (left padding,
    positions shifted by one), head 1 of row 0 lost token 5 earlier."""
    g = torch.Generator().manual_seed(seed)
    b, h, grp, w, t = 2, 2, 2, 4, 12
    index = torch.arange(t).expand(b, h, t).clone()
    index[1, :, 0] = EMPTY
    index[0, 1, 5:] = torch.cat([torch.arange(6, 12), torch.tensor([EMPTY])])
    q_index = torch.arange(t - w, t).expand(b, w).clone()
    q_index[1, 0] = -1
    positions = q_index.clone()
    positions[1] -= 1
    obs = Observation(
        queries=torch.randn(b, h * grp, w, D, generator=g) * 2,
        query_index=q_index,
        token_index=index,
        scaling=D**-0.5,
        query_positions=positions,
        layer_idx=1,
    )
    return obs, torch.randn(b, h, t, D, generator=g)


def recent_by_loop(obs: Observation, keys: torch.Tensor, aggregation: str) -> torch.Tensor:
    b_n, hq, w, _ = obs.queries.shape
    h_n, t = keys.shape[1], keys.shape[2]
    grp = hq // h_n
    out = torch.zeros(b_n, h_n, t)
    for b in range(b_n):
        points = [i for i in range(w) if obs.query_index[b, i] >= 0]
        for h in range(h_n):
            for i in points:
                qi = int(obs.query_index[b, i])
                seen = [
                    j
                    for j in range(t)
                    if obs.token_index[b, h, j] != EMPTY and obs.token_index[b, h, j] <= qi
                ]
                for g in range(grp):
                    q = obs.queries[b, h * grp + g, i].double()
                    logits = {j: float(q @ keys[b, h, j].double()) * obs.scaling for j in seen}
                    top = max(logits.values())
                    z = sum(math.exp(v - top) for v in logits.values())
                    for j, v in logits.items():
                        p = math.exp(v - top) / z
                        if aggregation == "max":
                            out[b, h, j] = max(float(out[b, h, j]), p)
                        else:
                            out[b, h, j] += p / (len(points) * grp)
    return out


@pytest.mark.parametrize("aggregation", ["max", "mean"])
def test_recent_query_scores_match_the_loop_and_beaconkv_without_beacons(aggregation: str) -> None:
    obs, keys = hand_made_obs()
    got = RecentQueryScorer(window=4, aggregation=aggregation).score(obs, keys, keys)
    torch.testing.assert_close(got, recent_by_loop(obs, keys, aggregation), atol=1e-6, rtol=1e-5)
    beacon = BeaconKVScorer(recent=4, aggregation=aggregation).score(obs, keys, keys)  # no state: no beacons
    torch.testing.assert_close(got, beacon, atol=1e-7, rtol=1e-6)


def random_by_loop(obs: Observation, seed: int) -> list[list[list[int | None]]]:
    """The hash of random.py in Python integers: (seed, layer, head, token position, now)."""

    def mix(x: int) -> int:
        for _ in range(3):
            x = (x * 1103515245 + 12345) % MODULUS
            x ^= x >> 13
        return x

    out = []
    for b in range(obs.token_index.shape[0]):
        valid = [i for i in range(obs.query_index.shape[1]) if obs.query_index[b, i] >= 0]
        newest = max(valid, key=lambda i: int(obs.query_index[b, i]))
        now = int(obs.query_positions[b, newest])
        offset = int(obs.query_index[b, newest]) - now
        rows = []
        for h in range(obs.token_index.shape[1]):
            row = []
            for tok in obs.token_index[b, h].tolist():
                if tok == EMPTY:
                    row.append(None)
                    continue
                x = (tok - offset) * 73856093 % MODULUS
                x ^= now * 19349663 % MODULUS
                x ^= (h * 83492791 % MODULUS) ^ (obs.layer_idx * 2654435 % MODULUS) ^ seed
                row.append(mix(x) >> 7)
            rows.append(row)
        out.append(rows)
    return out


def test_random_priorities_match_the_loop_and_select_the_highest() -> None:
    obs, keys = hand_made_obs()
    scores = RandomScorer(seed=7).score(obs, keys, keys)
    ref = random_by_loop(obs, 7)
    for b in range(2):
        for h in range(2):
            for j, want in enumerate(ref[b][h]):
                if want is not None:
                    assert int(scores[b, h, j]) == want
    protected = protected_mask(obs.token_index, 1, 2)
    keep = torch.tensor([[6, 6], [7, 5]])
    slots, _ = select_tokens(scores, obs.token_index, keep, protected)
    for b in range(2):
        for h in range(2):
            real = [j for j, v in enumerate(ref[b][h]) if v is not None]
            forced = [j for j in real if protected[b, h, j]]
            rest = sorted((j for j in real if j not in forced), key=lambda j: (-ref[b][h][j], -j))
            assert [s for s in slots[b, h].tolist() if s < 12] == sorted(
                forced + rest[: int(keep[b, h]) - len(forced)]
            )


def test_random_is_seeded_reproducible_and_fresh_at_each_compression() -> None:
    model = tiny_model("llama", "sdpa", 2)
    prompt = random_prompt(12, seed=9)

    def kept(seed: int) -> list[list[int]]:
        cache = make_cache(model, "random", 32, seed=seed)
        greedy_loop(model, prompt, cache, 60)
        return [[int(i) for i in row if i != EMPTY] for layer in cache.layers for row in layer.token_index[0]]

    first = kept(1)
    assert kept(1) == first
    assert kept(2) != first
    # A fresh draw at each compression: no token's priority is fixed for good, so survivors of
    # one compression can be evicted by the next (a fixed priority would favour old tokens).
    obs, keys = hand_made_obs()
    later = Observation(**{**obs.__dict__, "query_positions": obs.query_positions + 1})
    a, b = RandomScorer().score(obs, keys, keys), RandomScorer().score(later, keys, keys)
    assert not torch.equal(a[obs.key_valid], b[obs.key_valid])


def test_random_in_a_padded_batch_keeps_what_each_row_keeps_alone() -> None:
    model = tiny_model("qwen2", "sdpa", 2)
    prompts = [random_prompt(14, seed=11)[0], random_prompt(6, seed=12)[0]]
    ids, mask = left_pad(prompts)
    batch = make_cache(model, "random", 24)
    model.generate(ids, attention_mask=mask, **cache_arg(batch), max_new_tokens=40, do_sample=False)
    for r, p in enumerate(prompts):
        alone = make_cache(model, "random", 24)
        model.generate(p[None], **cache_arg(alone), max_new_tokens=40, do_sample=False)
        pad = ids.shape[1] - len(p)
        for lb, la in zip(batch.layers, alone.layers, strict=True):
            assert kept_tokens(lb, r, pad) == kept_tokens(la, 0)
