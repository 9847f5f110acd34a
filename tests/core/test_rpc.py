"""RPC: the scorer against a loop reference, the periodic schedule's steps and counts on a
tiny model, and the method end to end."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch

from conftest import TEST_DEVICE
from method_helpers import assert_no_eviction_matches_stock, flat_llama, greedy, kept_tokens, padded_prompts
from reasonkv import make_cache
from reasonkv.core.hf_compat import cache_arg
from reasonkv.core.policy import EMPTY, Observation, RPCScorer, protected_mask, select_tokens
from reasonkv.core.policy.contract import PolicyState
from reasonkv.core.policy.schedules import PeriodicRatio, PeriodicState

P, R, C = 16, 4, 4  # small paper hyper-parameters: every 16 tokens keep 16/4 = 4, 4 selectors
RPC_KNOBS = dict(budget=P // C, ratio=C, window=R, n_recent=R)


# ----------------------------------------------------------------------------- helpers
def expected_generated(steps: int, period: int, per_period: int, recent: int) -> list[int]:
    """Generated tokens held after each decode step under the paper's rule, one step at a time."""
    held, done, out = 0, 0, []
    for _ in range(steps):
        held += 1
        if held >= done * per_period + recent + period:
            done += 1
            held = done * per_period + recent
        out.append(held)
    return out


# ------------------------------------------------------------------------------ scorer
def reference_rpc(obs: Observation, keys: torch.Tensor, prompt_end: list[int], window: int, kernel: int):
    """Loops: per query head softmax over the generated candidates (not the newest `window`),
    summed over the valid selectors, averaged over every query head, avg-pooled (zero padding)."""
    b_n, h_n, t_n, _ = keys.shape
    hq = obs.queries.shape[1]
    grp = hq // h_n
    out = torch.zeros(b_n, h_n, t_n, dtype=torch.float64)
    for b in range(b_n):
        s = [0.0] * t_n
        for head in range(hq):
            h = head // grp
            idx = [int(x) for x in obs.token_index[b, h]]
            real = [j for j in range(t_n) if idx[j] != EMPTY]
            newest = set(real[-window:])
            for i in range(obs.queries.shape[2]):
                qi = int(obs.query_index[b, i])
                if qi < 0:
                    continue
                cand = [j for j in real if j not in newest and prompt_end[b] <= idx[j] <= qi]
                logit = {
                    j: float(obs.queries[b, head, i].double() @ keys[b, h, j].double()) * obs.scaling
                    for j in cand
                }
                z = sum(math.exp(v) for v in logit.values())
                for j in cand:
                    s[j] += math.exp(logit[j]) / z / hq
        for j in range(t_n):
            lo, hi = max(0, j - kernel // 2), min(t_n, j + kernel // 2 + 1)
            out[b, :, j] = sum(s[lo:hi]) / kernel
    return out


def rpc_obs(seed: int) -> tuple[Observation, torch.Tensor, list[int]]:
    """B=2, H=2, G=3, T=16, W=4: row 1 is left-padded by 2 and its first selector is padding;
    both heads share one layout (as under RPC). Prompt = sequence indices below 5."""
    g = torch.Generator().manual_seed(seed)
    b_n, h_n, grp, t_n, d, w = 2, 2, 3, 16, 8, 4
    index = torch.arange(t_n).expand(b_n, h_n, t_n).clone()
    index[1, :, :2] = EMPTY
    index[0, :, 8:] = torch.arange(9, 17)  # token 8 of row 0 evicted earlier
    q_index = index[:, 0, -w:].clone()
    q_index[1, 0] = -1
    prompt_end = [5, 5]
    obs = Observation(
        queries=torch.randn(b_n, h_n * grp, w, d, generator=g),
        query_index=q_index,
        token_index=index,
        scaling=d**-0.5,
        prompt_end=torch.tensor(prompt_end),
    )
    return obs, torch.randn(b_n, h_n, t_n, d, generator=g), prompt_end


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_rpc_matches_loop_reference(seed):
    obs, keys, prompt_end = rpc_obs(seed)
    scorer = RPCScorer(window=4, kernel=5)
    got = scorer.score(obs, keys, keys)
    ref = reference_rpc(obs, keys, prompt_end, window=4, kernel=5)
    valid = obs.key_valid
    assert torch.allclose(got.double()[valid], ref[valid], atol=1e-6)

    # Keep the prompt, the newest 4 and 5 more per head: the same tokens on both heads.
    prot = protected_mask(obs.token_index, 0, 4, torch.tensor(prompt_end))
    n_prot = prot.sum(-1)
    slots, new_len = select_tokens(got, obs.token_index, n_prot + 5, prot)
    for b in range(2):
        real = [j for j in range(16) if obs.token_index[b, 0, j] != EMPTY]
        keep = [j for j in real if prot[b, 0, j]]
        rest = sorted((j for j in real if j not in keep), key=lambda j: (-float(ref[b, 0, j]), -j))
        expected = sorted(keep + rest[:5])
        for h in range(2):
            assert slots[b, h, : new_len[b, h]].tolist() == expected


def test_rpc_group_aggregation_and_layout_check():
    obs, keys, _ = rpc_obs(0)
    group = RPCScorer(window=4, aggregation="group").score(obs, keys, keys)
    shared = RPCScorer(window=4).score(obs, keys, keys)
    assert not torch.allclose(group[:, 0], group[:, 1])
    assert torch.allclose(group.mean(1), shared[:, 0], atol=1e-6)  # "all" = mean over KV heads
    obs.token_index[0, 1, 3] = EMPTY
    with pytest.raises(ValueError, match="aggregation='group'"):
        RPCScorer().score(obs, keys, keys)


def test_periodic_ratio_budget_meaning():
    assert PeriodicRatio(ratio=4).period(256) == (1024, 256)  # budget = P/c, P = budget * c
    assert PeriodicRatio(interval=4096, ratio=4).period(7) == (4096, 1024)
    with pytest.raises(ValueError):
        PeriodicRatio(interval=8, ratio=16).period(1)
    assert PeriodicRatio().trigger(64) is None


# ------------------------------------------------------------------------------ method
@pytest.fixture(scope="module")
def model():
    return flat_llama()


def test_rpc_fires_at_the_papers_steps_and_keeps_the_papers_counts(model):
    """Prompts of 14 and 10 real tokens (left padding), P=16, R=4, c=4: the first compression when
    P + R = 20 generated tokens are held, then every 16 tokens; after m+1 compressions each row
    holds prompt + 4(m+1) selected + 4 recent, and between compressions it grows by one a step."""
    ids, mask, pads = padded_prompts()
    prompt = [ids.shape[1] - p for p in pads]
    cache = make_cache(model, "rpc", **RPC_KNOBS)
    steps = 70
    expected = expected_generated(steps, P, P // C, R)
    out = ids
    with torch.no_grad():
        for t in range(steps + 1):
            logits = model(input_ids=out, attention_mask=mask, **cache_arg(cache), use_cache=True).logits
            out = logits[:, -1:].argmax(-1)
            mask = torch.cat([mask, torch.ones(2, 1, dtype=mask.dtype, device=mask.device)], dim=1)
            fired = sum(e.seen - ids.shape[1] == t for e in cache.events)
            assert fired == (2 if t in (20, 36, 52, 68) else 0), t  # both layers, at these steps only
            m = sum(t >= f for f in (20, 36, 52, 68))  # compressions so far
            for layer in cache.layers:
                held = [prompt[b] + (expected[t - 1] if t else 0) for b in range(2)]
                assert layer.n_valid.tolist() == [[n, n] for n in held], t
                if fired:  # right after the (m)-th compression: prompt + m·P/c + R
                    assert held == [n + m * (P // C) + R for n in prompt]
    assert len(cache.events) == 2 * 4
    for layer in cache.layers:  # the prompt is whole, the newest R are the last R generated
        for b, p in enumerate(pads):
            index = layer.token_index[b, 0, : layer.n_valid[b, 0]]
            assert index[: prompt[b]].tolist() == list(range(p, ids.shape[1]))
            assert index[-R:].tolist() == list(range(layer.seen - R, layer.seen))


def test_rpc_without_eviction_equals_dynamic_cache(model):
    assert_no_eviction_matches_stock(model, "rpc", 1024)


def test_rpc_memory_follows_the_ratio_over_300_steps(model):
    """RPC's cache is not bounded by a budget: it holds prompt + ~t/c + R + (up to P) tokens.
    Storage never exceeds what is live plus the next period, and it is released at compaction."""
    cache = make_cache(model, "rpc", **RPC_KNOBS)
    ids = torch.randint(1, 128, (1, 10), generator=torch.Generator().manual_seed(3)).to(TEST_DEVICE)
    expected = expected_generated(300, P, P // C, R)
    with torch.no_grad():
        for t in range(301):
            logits = model(input_ids=ids, **cache_arg(cache), use_cache=True).logits
            ids = logits[:, -1:].argmax(-1)
            live = cache.memory()["live_tokens"]
            held = 10 + (expected[t - 1] if t else 0)
            assert live.tolist() == [[held, held]] * 2
            for layer in cache.layers:
                assert layer.keys.shape[2] <= held + P + R
    assert held == 10 + (300 - R) // P * (P // C) + R + (300 - R) % P


def test_rpc_padded_batch_equals_rows_alone(model):
    ids, mask, pads = padded_prompts(seed=5)
    cache = make_cache(model, "rpc", **RPC_KNOBS)
    batch = greedy(model, ids, mask, cache, 60).sequences[:, ids.shape[1] :]
    assert len(cache.events) >= 2 * 3
    for r, p in enumerate(pads):
        alone_cache = make_cache(model, "rpc", **RPC_KNOBS)
        alone = greedy(model, ids[r : r + 1, p:], None, alone_cache, 60).sequences[:, ids.shape[1] - p :]
        assert torch.equal(alone[0], batch[r])
        for lb, la in zip(cache.layers, alone_cache.layers, strict=True):
            assert kept_tokens(lb, r, p) == kept_tokens(la, 0)


def test_rows_compressed_apart_go_back_with_host_bounds_that_still_hold() -> None:
    """A pool's rows copied out, compressed and written back (`put_rows`): their counters take
    their places, the others' stay, the largest generated count stays a bound and the fewest
    compressions is read again."""

    def state(prompt, done, gen_upper, min_done):
        return PeriodicState(8, 4, torch.tensor(prompt), torch.tensor(done), 40, gen_upper, min_done)

    pool = state([10, 11, 12], [0, 1, 2], gen_upper=30, min_done=0)
    part = state([12, 10], [3, 1], gen_upper=35, min_done=1)
    pool.put_rows([2, 0], part, torch.tensor([2, 0]))
    assert pool.prompt.tolist() == [10, 11, 12] and pool.done.tolist() == [1, 1, 3]
    assert (pool.gen_upper, pool.min_done, pool.rows) == (35, 1, None)  # every row compressed now
    with pytest.raises(ValueError, match="another period"):
        other = PeriodicState(16, 4, torch.tensor([11]), torch.tensor([1]), 40, 30, 0)
        pool.put_rows([1], other, torch.tensor([1]))


def test_a_state_s_rows_go_back_in_place_and_its_shared_counts_must_agree() -> None:
    """`PolicyState.put_rows`: tensor and list row fields take the copy's rows in their places;
    a count that is one for every row must be the same in the copy."""

    @dataclass
    class Counts(PolicyState):
        mass: torch.Tensor
        queued: list
        forwards: int
        ROW_FIELDS = ("mass", "queued")

    pool = Counts(torch.tensor([[1.0], [2.0], [3.0]]), [0, 0, 0], forwards=7)
    pool.put_rows([1], Counts(torch.tensor([[9.0]]), [-2], forwards=7), torch.tensor([1]))
    assert pool.mass.flatten().tolist() == [1.0, 9.0, 3.0] and pool.queued == [0, -2, 0]
    with pytest.raises(ValueError, match="forwards = 8 cannot go back to 7"):
        pool.put_rows([0], Counts(torch.tensor([[5.0]]), [0], forwards=8), torch.tensor([0]))
