"""R-KV: the scorer against a loop reference, the redundancy rule, and the method end to end."""

from __future__ import annotations

import math

import pytest
import torch

from conftest import TEST_DEVICE
from method_helpers import assert_no_eviction_matches_stock, flat_llama, greedy, kept_tokens, padded_prompts
from reasonkv import make_cache
from reasonkv.core.hf_compat import cache_arg
from reasonkv.core.policy import EMPTY, Observation, RKVScorer, protected_mask, select_tokens


# ----------------------------------------------------------------------------- helpers
def random_obs(window: int, seed: int = 0) -> tuple[Observation, torch.Tensor]:
    """B=2, H=2, G=2, T=14, D=8: row 1 has a padding slot at the front and, on head 1, a ragged
    EMPTY tail; its first window query is a padding query (query_index -1)."""
    g = torch.Generator().manual_seed(seed)
    b, h, grp, t, d = 2, 2, 2, 14, 8
    index = torch.arange(t).expand(b, h, t).clone()
    index[1, :, 0] = EMPTY
    index[1, 1, 12:] = EMPTY
    index[1, 1, 3:12] = torch.arange(4, 13)  # head 1 evicted token 3 earlier: a different layout
    q_index = torch.arange(t - window, t).expand(b, window).clone()
    q_index[1, 0] = -1
    obs = Observation(
        queries=torch.randn(b, h * grp, window, d, generator=g),
        query_index=q_index,
        token_index=index,
        scaling=d**-0.5,
    )
    keys = torch.randn(b, h, t, d, generator=g)
    keys[0, 0, 9] = keys[0, 0, 2] * 2  # an exact duplicate direction (cosine 1)
    keys[1, 1, 6] = keys[1, 1, 4] + 0.1 * keys[1, 1, 5]
    return obs, keys


def reference_rkv(obs: Observation, keys: torch.Tensor, window: int, kernel: int, lam: float, tau: float):
    """R-KV written out with plain loops (methods.md §4), clean 'no similar token' behaviour."""
    b_n, h_n, t_n, _ = keys.shape
    grp = obs.queries.shape[1] // h_n
    out = torch.zeros(b_n, h_n, t_n, dtype=torch.float64)
    for b in range(b_n):
        for h in range(h_n):
            idx = [int(x) for x in obs.token_index[b, h]]
            real = [j for j in range(t_n) if idx[j] != EMPTY]
            newest = set(real[-window:])
            # importance
            a = [0.0] * t_n
            valid_q = [i for i in range(obs.queries.shape[2]) if obs.query_index[b, i] >= 0]
            for i in valid_q:
                cand = [j for j in real if j not in newest and idx[j] <= obs.query_index[b, i]]
                logit = {}
                for j in cand:
                    logit[j] = max(
                        float(obs.queries[b, h * grp + g, i].double() @ keys[b, h, j].double()) * obs.scaling
                        for g in range(grp)
                    )
                z = sum(math.exp(v) for v in logit.values())
                for j in cand:
                    a[j] += math.exp(logit[j]) / z / len(valid_q)
            pooled = [max(a[max(0, j - kernel // 2) : j + kernel // 2 + 1]) for j in range(t_n)]
            # redundancy
            kn = {j: keys[b, h, j].double() / (keys[b, h, j].double().norm() + 1e-8) for j in real}
            s = {(i, j): float(kn[i] @ kn[j]) if i != j else 0.0 for i in real for j in real}
            for i in real:
                similar = [j for j in real if j != i and s[(i, j)] > tau]
                if similar:
                    s[(i, max(similar))] = 0.0
            mean = {j: sum(s[(i, j)] for i in real) / len(real) for j in real}
            z = sum(math.exp(v) for v in mean.values())
            for j in range(t_n):
                red = math.exp(mean[j]) / z if j in mean else 0.0
                out[b, h, j] = lam * pooled[j] - (1 - lam) * red
                if j in newest:  # left out of the scoring window, so kept: the top score
                    out[b, h, j] = torch.finfo(torch.float32).max
    return out


def reference_select(scores, index, keep: int, n_recent: int) -> list[list[list[int]]]:
    """Newest n_recent real slots, then the best scores (ties: newer slot), sorted."""
    out = []
    for b in range(scores.shape[0]):
        rows = []
        for h in range(scores.shape[1]):
            real = [j for j in range(scores.shape[2]) if index[b, h, j] != EMPTY]
            kept = set(real[len(real) - n_recent :]) if n_recent else set()
            rest = sorted((j for j in real if j not in kept), key=lambda j: (-float(scores[b, h, j]), -j))
            kept |= set(rest[: max(0, min(keep, len(real)) - len(kept))])
            rows.append(sorted(kept))
        out.append(rows)
    return out


def kept_slots(slots: torch.Tensor, lengths: torch.Tensor) -> list[list[list[int]]]:
    b_n, h_n = slots.shape[:2]
    return [[slots[b, h, : lengths[b, h]].tolist() for h in range(h_n)] for b in range(b_n)]


# ------------------------------------------------------------------------------ scorer
# A threshold of 0 or below also lets the zeros (EMPTY keys, the diagonal) pass the test.
@pytest.mark.parametrize(("seed", "threshold"), [(0, 0.5), (1, 0.5), (2, 0.5), (3, 0.0), (4, -0.3)])
def test_rkv_matches_loop_reference(seed, threshold):
    window = 3
    scorer = RKVScorer(window=window, kernel=5, mix_lambda=0.3, sim_threshold=threshold)
    obs, keys = random_obs(window, seed)
    got = scorer.score(obs, keys, keys)
    ref = reference_rkv(obs, keys, window, 5, 0.3, threshold)
    valid = obs.key_valid
    assert torch.allclose(got.double()[valid], ref[valid], atol=1e-6)

    keep = 8
    prot = protected_mask(obs.token_index, 0, window)
    slots, new_len = select_tokens(got, obs.token_index, torch.full((2, 2), keep), prot)
    assert kept_slots(slots, new_len) == reference_select(ref, obs.token_index, keep, window)


def test_rkv_padding_slots_change_nothing():
    """A row scored with extra EMPTY slots (left padding, ragged tail) scores exactly as alone."""
    scorer = RKVScorer(window=3)
    obs, keys = random_obs(3, seed=4)
    alone = Observation(obs.queries[:1], obs.query_index[:1], obs.token_index[:1], obs.scaling)
    pad = torch.full((1, 2, 3), EMPTY)
    padded = Observation(
        obs.queries[:1],
        obs.query_index[:1],
        torch.cat([pad, obs.token_index[:1], pad[..., :2]], dim=-1),
        obs.scaling,
    )
    padded_keys = torch.cat([torch.randn(1, 2, 3, 8), keys[:1], torch.randn(1, 2, 2, 8)], dim=2)
    a = scorer.score(alone, keys[:1], keys[:1])
    p = scorer.score(padded, padded_keys, padded_keys)[..., 3:-2]
    assert torch.allclose(a, p, atol=1e-7)


def test_rkv_redundancy_spares_the_newest_duplicate():
    # slots: a, b, a, c, a, d with a..d orthogonal: three exact copies of a.
    e = torch.eye(4)
    keys = torch.stack([e[0], e[1], 3 * e[0], e[2], 0.5 * e[0], e[3]])[None, None]
    obs = Observation(
        queries=torch.zeros(1, 1, 1, 4),
        query_index=torch.tensor([[5]]),
        token_index=torch.arange(6)[None, None],
        scaling=0.5,
    )
    red = RKVScorer().redundancy(obs, keys)[0, 0]
    # Row a0 forgets a4 (its newest copy), a2 forgets a4, a4 forgets a2 -> column sums 2, 1, 0.
    expected = torch.softmax(torch.tensor([2.0, 0, 1, 0, 0, 0]) / 6, dim=0)
    assert torch.allclose(red, expected, atol=1e-6)
    assert red[0] > red[2] > red[4] == red[1]
    # window=1 keeps d (slot 5), the smallest window the knob allows; the other 5 are scored.
    scores = RKVScorer(mix_lambda=0.0, window=1).score(obs, keys, keys)
    assert scores[0, 0, 5] == torch.finfo(scores.dtype).max
    none = torch.zeros(1, 1, 6, dtype=torch.bool)
    slots, _ = select_tokens(scores, obs.token_index, torch.tensor([[4]]), none)
    assert slots[0, 0].tolist() == [1, 3, 4, 5]  # the two older copies go


def test_rkv_row_without_similar_token_zeroes_nothing():
    """The reference code's argmax fallback would zero S[i, 0] for a row with no similar token."""
    # cosines: (k0, k1) = 0.3, (k0, k2) = -1, (k1, k2) = -0.3: nothing above the threshold.
    keys = torch.tensor([[1.0, 0.0], [0.3, math.sqrt(0.91)], [-1.0, 0.0]])[None, None]
    obs = Observation(
        queries=torch.zeros(1, 1, 1, 2),
        query_index=torch.tensor([[2]]),
        token_index=torch.arange(3)[None, None],
        scaling=1.0,
    )
    red = RKVScorer().redundancy(obs, keys)[0, 0]
    s = torch.tensor([[0, 0.3, -1.0], [0.3, 0, -0.3], [-1.0, -0.3, 0]])
    assert torch.allclose(red, torch.softmax(s.sum(0) / 3, dim=0), atol=1e-6)


@pytest.mark.parametrize("heads_per_pass", [1, 3])
def test_rkv_redundancy_in_passes_equals_one_pass(monkeypatch, heads_per_pass):
    """The similarities go a few heads at a time (B x H = 4, not a multiple of 3: a short last
    pass); the scores are those of one pass over every head."""
    import reasonkv.core.policy.scorers.rkv as rkv

    obs, keys = random_obs(3, seed=5)
    whole = RKVScorer().redundancy(obs, keys)
    t = keys.shape[2]
    monkeypatch.setattr(rkv, "_CPU_SIM_ELEMENTS", heads_per_pass * t * t)
    assert torch.equal(RKVScorer().redundancy(obs, keys), whole)


# ------------------------------------------------------------------------------ method
@pytest.fixture(scope="module")
def model():
    return flat_llama()


def test_rkv_without_eviction_equals_dynamic_cache(model):
    assert_no_eviction_matches_stock(model, "rkv", 4096)


def test_rkv_memory_stays_bounded_over_300_steps(model):
    budget, interval = 12, 6
    cache = make_cache(model, "rkv", budget=budget, interval=interval)
    ids = torch.randint(1, 128, (1, 10), generator=torch.Generator().manual_seed(3)).to(TEST_DEVICE)
    caps, physical = [], []
    with torch.no_grad():
        for _ in range(300):
            logits = model(input_ids=ids, **cache_arg(cache), use_cache=True).logits
            ids = logits[:, -1:].argmax(-1)
            live = cache.memory()["live_tokens"]
            assert int(live.max()) <= budget + interval - 1
            caps.append(max(layer.keys.shape[2] for layer in cache.layers))
            physical.append(cache.memory()["physical_bytes"])
    assert max(caps) <= budget + interval
    assert max(physical[150:]) <= max(physical[:150])
    assert len(cache.events) >= 2 * (300 // interval) - 2  # both layers compress every `interval` steps


def test_rkv_padded_batch_equals_rows_alone(model):
    ids, mask, pads = padded_prompts(seed=5)
    kw = dict(budget=8, interval=4)
    cache = make_cache(model, "rkv", **kw)
    batch = greedy(model, ids, mask, cache, 40).sequences[:, ids.shape[1] :]
    assert len(cache.events) > 10
    for r, p in enumerate(pads):
        alone_cache = make_cache(model, "rkv", **kw)
        alone = greedy(model, ids[r : r + 1, p:], None, alone_cache, 40).sequences[:, ids.shape[1] - p :]
        assert torch.equal(alone[0], batch[r])
        for lb, la in zip(cache.layers, alone_cache.layers, strict=True):
            assert kept_tokens(lb, r, p) == kept_tokens(la, 0)
