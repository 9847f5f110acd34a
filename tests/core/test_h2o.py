"""H2O: cumulative attention against a loop reference, scores following tokens through every
eviction (checked against the model's own attention weights), and the method end to end."""

from __future__ import annotations

import math
from collections import defaultdict

import pytest
import torch

from conftest import TEST_DEVICE
from method_helpers import assert_no_eviction_matches_stock, flat_llama, greedy, padded_prompts
from reasonkv import make_cache
from reasonkv.core.hf_compat import cache_arg
from reasonkv.core.models import attention_modules
from reasonkv.core.policy import EMPTY, H2OScorer, Observation, protected_mask, select_tokens
from reasonkv.core.policy.scorers import h2o as h2o_module


# ------------------------------------------------------------------------------ scorer
@pytest.mark.parametrize("seed,chunk", [(0, 256), (1, 3)])
def test_h2o_accumulation_and_scores_match_loop_reference(seed, chunk, monkeypatch):
    """A prefill-like step of 4 queries (one is padding) over 12 slots with EMPTY slots and a
    per-head layout: the accumulated state, the scores and the kept slots match plain loops
    (also when the step's queries are processed in blocks of 3)."""
    monkeypatch.setattr(h2o_module, "QUERY_CHUNK", chunk)
    g = torch.Generator().manual_seed(seed)
    b_n, h_n, grp, t_n, d, q = 2, 2, 2, 12, 8, 4
    index = torch.arange(t_n).expand(b_n, h_n, t_n).clone()
    index[1, :, :2] = EMPTY  # left padding
    index[1, 1, 2:11] = torch.arange(3, 12)  # head 1 lost token 2 earlier
    index[1, 1, 11] = EMPTY
    q_index = torch.arange(t_n - q, t_n).expand(b_n, q).clone()
    q_index[1, 0] = -1  # a padding query
    obs = Observation(  # the step: this forward's queries only
        queries=torch.randn(b_n, h_n * grp, q, d, generator=g),
        query_index=q_index,
        token_index=index,
        scaling=d**-0.5,
    )
    keys = torch.randn(b_n, h_n, t_n, d, generator=g)
    start = torch.rand(b_n, h_n, t_n, generator=g)
    acc = start.clone()
    scorer = H2OScorer(recent_ratio=0.5)
    assert scorer.window == 1  # H2O scores from its state; every query reaches on_step anyway
    obs.state = {"h2o_acc": acc}  # the cache's per-token state: on_step adds to it in place
    scorer.on_step(obs, keys)

    ref = start.double().clone()
    for b in range(b_n):
        for h in range(h_n):
            for i in range(q):  # the step's queries only, not the older one of the window
                qi = int(obs.query_index[b, i])
                if qi < 0:
                    continue
                for gg in range(grp):
                    allowed = [j for j in range(t_n) if index[b, h, j] != EMPTY and index[b, h, j] <= qi]
                    logit = {
                        j: float(obs.queries[b, h * grp + gg, i].double() @ keys[b, h, j].double())
                        * obs.scaling
                        for j in allowed
                    }
                    z = sum(math.exp(v) for v in logit.values())
                    for j in allowed:
                        ref[b, h, j] += math.exp(logit[j]) / z
    assert torch.allclose(acc.double(), ref, atol=1e-6)

    obs.targets = torch.tensor([6, 7])  # every-step budgets 6 and 7: recent 3 and 3 (floor of half)
    scores = scorer.score(obs, keys, keys)
    keep = torch.tensor([[6, 7], [6, 7]])
    slots, new_len = select_tokens(scores, index, keep, protected_mask(index, 0, 0))
    for b in range(b_n):
        for h in range(h_n):
            real = [j for j in range(t_n) if index[b, h, j] != EMPTY]
            recent = real[-3:]
            for j in real:
                expect = math.inf if j in recent else float(ref[b, h, j])
                assert scores[b, h, j] == expect or math.isclose(scores[b, h, j], expect, abs_tol=1e-6)
            heavy = sorted((j for j in real if j not in recent), key=lambda j: (-float(ref[b, h, j]), -j))
            expected = sorted(recent + heavy[: int(keep[b, h]) - 3])
            assert slots[b, h, : new_len[b, h]].tolist() == expected


# ------------------------------------------------------------------------------ method
def test_h2o_scores_follow_the_kept_tokens_through_every_eviction():
    """At every step and layer, each surviving token's h2o_acc equals the sum of the attention the
    model actually gave it (eager weights, all query heads of its group, every query since it
    entered), looked up by token identity: any mis-gathered state would break the equality."""
    model = flat_llama("eager", seed=2)
    budget = 6
    cache = make_cache(model, "h2o", budget=budget)
    g = model.config.num_attention_heads // model.config.num_key_value_heads
    at_attention: dict[int, torch.Tensor] = {}
    for layer in cache.layers:

        def spy(*args, layer=layer, original=layer.after_attention):
            at_attention[layer.layer_idx] = layer.token_index.clone()  # before eviction
            original(*args)

        layer.after_attention = spy
    weights: dict[int, torch.Tensor] = {}
    hooks = [
        m.register_forward_hook(lambda mod, args, out, i=i: weights.__setitem__(i, out[1]))
        for i, m in enumerate(attention_modules(model))
    ]
    received = [defaultdict(float) for _ in cache.layers]  # (row, head, token) -> total attention
    ids = torch.randint(1, 128, (2, 9), generator=torch.Generator().manual_seed(0)).to(TEST_DEVICE)
    old_survivors = 0
    try:
        with torch.no_grad():
            for _ in range(30):
                logits = model(input_ids=ids, **cache_arg(cache), use_cache=True).logits
                ids = logits[:, -1:].argmax(-1)
                for li, layer in enumerate(cache.layers):
                    w, idx = weights[li].double(), at_attention[li]
                    for b, h, s in (idx != EMPTY).nonzero().tolist():
                        received[li][(b, h, int(idx[b, h, s]))] += float(
                            w[b, h * g : (h + 1) * g, :, s].sum()
                        )
                    acc = layer.token_state["h2o_acc"]
                    for b, h, s in (layer.token_index[:, :, : layer.used] != EMPTY).nonzero().tolist():
                        tok = int(layer.token_index[b, h, s])
                        assert math.isclose(
                            float(acc[b, h, s]), received[li][(b, h, tok)], rel_tol=1e-5, abs_tol=1e-6
                        ), (li, b, h, tok)
                        old_survivors += tok < 9
                    assert int(layer.n_valid.max()) == budget
    finally:
        for hk in hooks:
            hk.remove()
    assert len(cache.events) == 2 * 30  # every layer evicts at every step (prefill included)
    assert old_survivors > 0  # heavy hitters from the prompt survive many evictions


def test_h2o_keeps_the_recent_half_and_heavy_hitters():
    model = flat_llama(seed=3)
    cache = make_cache(model, "h2o", budget=8)
    ids = torch.randint(1, 128, (1, 12), generator=torch.Generator().manual_seed(1)).to(TEST_DEVICE)
    greedy(model, ids, None, cache, 10)
    seen = cache.layers[0].seen
    for layer in cache.layers:
        index = layer.token_index[0, :, : layer.used]
        # recent half: the newest budget/2 = 4 tokens fed to the cache are all there
        assert (index[:, -4:] == torch.arange(seen - 4, seen, device=index.device)).all()
        assert layer.n_valid.tolist() == [[8, 8]]


@pytest.fixture(scope="module")
def model():
    return flat_llama()


def test_h2o_without_eviction_equals_dynamic_cache(model):
    assert_no_eviction_matches_stock(model, "h2o", 4096)


def test_h2o_memory_stays_bounded_over_300_steps(model):
    budget = 10
    cache = make_cache(model, "h2o", budget=budget)
    ids = torch.randint(1, 128, (1, 16), generator=torch.Generator().manual_seed(3)).to(TEST_DEVICE)
    physical = []
    with torch.no_grad():
        for _ in range(300):
            logits = model(input_ids=ids, **cache_arg(cache), use_cache=True).logits
            ids = logits[:, -1:].argmax(-1)
            mem = cache.memory()
            assert int(mem["live_tokens"].max()) == budget
            for layer in cache.layers:
                # budget 10 < 16: no holes (k = budget // 8 = 1), storage is exactly budget + 1
                assert (
                    layer.keys.shape[2] <= budget + 1 and layer.token_state["h2o_acc"].shape[2] <= budget + 1
                )
                assert layer.queries.shape[2] == 1
            physical.append(mem["physical_bytes"])
    assert max(physical[150:]) <= max(physical[:150])


def test_h2o_padded_batch_equals_rows_alone(model):
    ids, mask, pads = padded_prompts(seed=5)
    cache = make_cache(model, "h2o", budget=8)
    batch = greedy(model, ids, mask, cache, 30).sequences[:, ids.shape[1] :]
    for r, p in enumerate(pads):
        alone_cache = make_cache(model, "h2o", budget=8)
        alone = greedy(model, ids[r : r + 1, p:], None, alone_cache, 30).sequences[:, ids.shape[1] - p :]
        assert torch.equal(alone[0], batch[r])
        for lb, la in zip(cache.layers, alone_cache.layers, strict=True):
            for h in range(lb.token_index.shape[1]):
                kept_b = [int(i) - p for i in lb.token_index[r, h] if i != EMPTY]
                kept_a = [int(i) for i in la.token_index[0, h] if i != EMPTY]
                assert kept_b == kept_a
                live = lb.token_index[r, h] != EMPTY
                live_a = la.token_index[0, h] != EMPTY
                assert torch.allclose(
                    lb.token_state["h2o_acc"][r, h][live], la.token_state["h2o_acc"][0, h][live_a], atol=1e-5
                )


@pytest.mark.parametrize("evict_every", [1, 4])
def test_sums_folded_every_few_steps_equal_sums_made_every_step(evict_every):
    """fold_every=3: decode queries wait in the window and their attention is summed three at a
    time or before scoring. Nothing is evicted while they wait, so after each fold the sums equal
    those made at every step and every eviction keeps the same tokens, with every-step and with
    buffered eviction, in a left-padded batch (a padding query never counts)."""
    model = flat_llama()
    ids, mask, _ = padded_prompts(seed=5)
    caches = [make_cache(model, "h2o", budget=8, evict_every=evict_every, fold_every=n) for n in (1, 3)]
    folds = 0
    with torch.no_grad():
        feeds = [ids.to(TEST_DEVICE)] * 2
        masks = [mask.to(TEST_DEVICE)] * 2
        for _ in range(25):
            for i, cache in enumerate(caches):
                logits = model(
                    input_ids=feeds[i], attention_mask=masks[i], **cache_arg(cache), use_cache=True
                ).logits
                feeds[i] = logits[:, -1:].argmax(-1)
                masks[i] = torch.cat([masks[i], torch.ones_like(feeds[i])], dim=1)
            assert torch.equal(feeds[0], feeds[1])
            for every, folded in zip(caches[0].layers, caches[1].layers, strict=True):
                assert torch.equal(every.token_index, folded.token_index)
                assert folded.states.scorer.pending < 3
                if folded.states.scorer.pending == 0:
                    folds += 1
                    live = every.token_index != EMPTY
                    torch.testing.assert_close(
                        every.token_state["h2o_acc"][live],
                        folded.token_state["h2o_acc"][live],
                        rtol=1e-5,
                        atol=1e-6,
                    )
    assert folds >= 10
    assert caches[1].layers[0].window.size == 3  # the scored query and the two that may wait
