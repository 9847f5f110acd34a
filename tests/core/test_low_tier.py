"""The two-tier cache (KVFormat.low_budget > 0): what eviction drops goes to a low-bit tier
that attention reads, within its own budget; the main tier and low_budget=0 are unchanged."""

from __future__ import annotations

import pytest
import torch

from conftest import HEAD_DIM, left_pad, random_prompt, tiny_model
from reasonkv.core.hf_compat import cache_arg
from reasonkv.core.low_tier import LowTier, rank
from reasonkv.core.memory_meter import MemoryMeter
from reasonkv.core.policy.base import EMPTY
from reasonkv.core.quantize import KVFormat, dequantize, quantize
from reasonkv.methods.api import make_cache
from reasonkv.methods.knobs import KnobError, check_knobs
from reasonkv.methods.registry import get_method
from sync_helpers import SyncRecorder

GROUP = {"group_size": HEAD_DIM}
"""The tiny models' head dim: the default group (32) does not divide it, and the low tier's
group is the values' group unless low_group_size is set."""
BUDGETS = {"snapkv": (24, {"interval": 8, **GROUP}), "h2o": (24, GROUP), "beaconkv": (40, GROUP)}


@torch.no_grad()
def forced(model, ids, mask, cache, tokens: torch.Tensor, after_step=None) -> torch.Tensor:
    """Logits [B, n + 1, V] of a prefill then one forced token per step (no argmax divergence),
    at the positions generate() gives (a left-padded row's first real token at 0);
    `after_step(cache)` runs after every forward."""
    positions = (mask.long().cumsum(-1) - 1).clamp(min=0)
    out = model(
        input_ids=ids, attention_mask=mask, position_ids=positions, **cache_arg(cache), use_cache=True
    )
    logits = [out.logits[:, -1].float()]
    for i in range(tokens.shape[1]):
        if after_step is not None:
            after_step(cache)
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], 1)
        step = mask.long().sum(-1, keepdim=True) - 1
        out = model(
            input_ids=tokens[:, i : i + 1],
            attention_mask=mask,
            position_ids=step,
            **cache_arg(cache),
            use_cache=True,
        )
        logits.append(out.logits[:, -1].float())
    if after_step is not None:
        after_step(cache)
    return torch.stack(logits, 1)


def run(method: str, budget=None, batch: int = 1, steps: int = 40, after_step=None, **knobs):
    model = tiny_model("llama")
    ids = random_prompt(30, 3, batch)
    cache = make_cache(model, method, budget=budget, **knobs)
    logits = forced(model, ids, torch.ones_like(ids), cache, random_prompt(steps, 4, batch), after_step)
    return logits, cache


def low_tier(keys, values, index, scores, budget, bits=8, group=4, meter=None) -> LowTier:
    b, h = index.shape[:2]
    tier = LowTier(
        b,
        h,
        keys.device,
        KVFormat(low_budget=budget, low_bits=bits, low_group_size=group),
        meter or MemoryMeter(),
    )
    tier.feed(keys, values, index, scores)
    return tier


# ---------------------------------------------------------------- the store itself
def test_the_store_keeps_the_highest_eviction_scores_ties_to_the_newer_token() -> None:
    # Head 0 gets five tokens, head 1 three (EMPTY pads its entries): ragged, as evictions are.
    index = torch.tensor([[[3, 7, 9, 12, 15], [2, 5, 8, EMPTY, EMPTY]]])
    scores = torch.tensor([[[0.5, 0.9, 0.5, 0.1, 0.7], [0.3, 0.2, 0.1, 9.0, 9.0]]])
    kv = torch.randn(1, 2, 5, HEAD_DIM)
    tier = low_tier(kv, kv, index, scores, budget=3)
    # Head 0: 0.9 (7), 0.7 (15), then 0.5 for 3 and 9: the newer, 9. Kept in positional order.
    assert tier.token_index.tolist() == [[[7, 9, 15], [2, 5, 8]]]
    assert tier.scores.flatten().tolist() == pytest.approx([0.9, 0.5, 0.7, 0.3, 0.2, 0.1])
    # Each kept token's K/V came with it (8 bits: within a few percent of its own vector).
    stored = dequantize(tier.kq, torch.float32)
    for h, picks in enumerate([[1, 2, 4], [0, 1, 2]]):
        assert torch.allclose(stored[0, h], kv[0, h, picks], atol=0.05)
    # A second eviction: 4 (0.6) beats 9 (0.5) on head 0; on head 1 one newcomer, 1 (0.25),
    # beats 8 (0.1); EMPTY entries never come in.
    more = torch.tensor([[[4, 20], [1, EMPTY]]])
    tier.feed(kv[:, :, :2], kv[:, :, :2], more, torch.tensor([[[0.6, 0.05], [0.25, 5.0]]]))
    assert tier.token_index.tolist() == [[[4, 7, 15], [1, 2, 5]]]
    assert tier.n_tokens.tolist() == [[3, 3]]


def test_the_store_trims_to_the_fullest_head_it_is_told_and_pads_the_others_with_empty() -> None:
    index = torch.tensor([[[3, 9, EMPTY, EMPTY], [EMPTY, 4, EMPTY, EMPTY]]])
    kv = torch.randn(1, 2, 4, HEAD_DIM)
    untrimmed = low_tier(kv, kv, index, torch.zeros(1, 2, 4), budget=100)
    assert untrimmed.token_index.tolist() == [[[3, 9, EMPTY, EMPTY], [4, EMPTY, EMPTY, EMPTY]]]
    tier = LowTier(1, 2, kv.device, KVFormat(low_budget=100, low_group_size=4), MemoryMeter())
    tier.feed(kv, kv, index, torch.zeros(1, 2, 4), fill=2)
    assert tier.slots == 2
    assert tier.token_index.tolist() == [[[3, 9], [4, EMPTY]]]


def test_rank_puts_real_tokens_first_even_at_minus_infinity() -> None:
    index = torch.tensor([EMPTY, 1, 2, 3])
    scores = torch.tensor([5.0, float("-inf"), 1.0, 1.0])
    assert rank(scores, index).tolist() == [3, 2, 1, 0]


@pytest.mark.parametrize("bits", [8, 4, 2])
def test_dequantized_low_tier_keys_and_values_are_within_the_format_bound(bits) -> None:
    """Per token, groups of 4 channels: |x - x_hat| <= scale / 2, scale = group range / (2^bits - 1)."""
    gen = torch.Generator().manual_seed(0)
    keys = torch.randn(2, 2, 12, HEAD_DIM, generator=gen)
    keys[..., 3] *= 20  # an outlier channel, as real keys have
    values = torch.randn(2, 2, 12, HEAD_DIM, generator=gen)
    index = torch.arange(12).expand(2, 2, 12).contiguous()
    tier = low_tier(keys, values, index, torch.randn(2, 2, 12, generator=gen), budget=12, bits=bits)
    main = torch.zeros(2, 2, 0, HEAD_DIM)
    got_k, got_v = tier.attended(main, main)
    for got, x in ((got_k, keys), (got_v, values)):
        g = x.unflatten(-1, (HEAD_DIM // 4, 4))
        bound = (g.amax(-1) - g.amin(-1)) / (2**bits - 1) / 2
        err = (got - x).abs().unflatten(-1, (HEAD_DIM // 4, 4)).amax(-1)
        assert bool((err <= bound * (1 + 1e-5) + 1e-6).all())
    # What per-token key groups cost: the channels that share a group with the outlier lose
    # its range. Measured on the other channels, against per-channel groups of 4 tokens (the
    # main tier's layout): 0.8% vs 0.2% at 8 bits, 13% vs 3% at 4, 43% vs 15% at 2.
    normal = torch.arange(HEAD_DIM) != 3
    per_channel = dequantize(quantize(keys, bits, 4, 2))

    def rel(x: torch.Tensor) -> float:
        return float((x - keys)[..., normal].norm() / keys[..., normal].norm())

    assert rel(per_channel) < rel(got_k) < {8: 0.01, 4: 0.15, 2: 0.5}[bits]


# ---------------------------------------------------------------- in a cache
@pytest.mark.parametrize("method", ["snapkv", "h2o"])
def test_low_budget_0_is_todays_path_bit_for_bit(method) -> None:
    budget, knobs = BUDGETS[method]
    plain, _ = run(method, budget, **knobs)
    again, cache = run(method, budget, low_budget=0, low_bits=8, low_group_size=4, **knobs)
    assert torch.equal(plain, again)
    assert all(layer.low_tier is None for layer in cache.layers)
    assert cache.memory()["low_tier_tokens"] is None


@pytest.mark.parametrize("method", ["snapkv", "h2o", "beaconkv"])
def test_both_tiers_keep_their_budgets_and_every_token_its_position(method) -> None:
    """After every step: the low tier holds at most low_budget real tokens per head, the main
    tier what it holds without one; no token is in both; every token held is at its sequence
    index: layer 0's keys (which do not depend on the cache) are the full cache's keys of that
    index, exactly in the main tier and within 8-bit error in the low tier."""
    budget, knobs = BUDGETS[method]
    low_budget = 6
    full_keys = run("full")[1].layers[0].storage.read_keys()  # [1, H, 70 + 1, D]: slot = token
    mains = []
    lows = []

    def check(cache) -> None:
        bound = cache.live_token_bound()
        for layer in cache.layers:
            assert int(layer.n_valid.max()) <= bound
            tier = layer.low_tier
            assert int(tier.n_tokens.max()) <= low_budget and tier.slots <= low_budget
            main, low = layer.token_index, tier.token_index
            for h in range(main.shape[1]):
                held = [i for i in main[0, h].tolist() + low[0, h].tolist() if i != EMPTY]
                assert len(held) == len(set(held)) and all(0 <= i < layer.seen for i in held)
        layer = cache.layers[0]
        main, low = layer.token_index[0], layer.low_tier.token_index[0]
        keys = layer.storage.read_keys()[0]
        real = main != EMPTY
        want = full_keys[0].gather(
            1, main.clamp(max=full_keys.shape[2] - 1)[..., None].expand(-1, -1, HEAD_DIM)
        )
        assert torch.equal(keys[real], want[real])
        mains.append(int(real.sum()))
        if layer.low_tier.slots:
            got = layer.low_tier.attended(keys[None], keys[None])[0][0, :, keys.shape[1] :]
            layer.low_tier.drop_view()
            real = low != EMPTY
            want = full_keys[0].gather(
                1, low.clamp(max=full_keys.shape[2] - 1)[..., None].expand(-1, -1, HEAD_DIM)
            )
            err = (got - want).abs()[real]
            assert float(err.max()) < 0.02 * float(want.abs().max())
            lows.append(int(real.sum()))

    _, cache = run(method, budget, steps=40, after_step=check, low_budget=low_budget, low_bits=8, **knobs)
    assert max(lows) == low_budget * 2  # filled, on both heads
    plain_cache = run(method, budget, **knobs)[1]
    assert torch.equal(
        cache.layers[0].token_index, plain_cache.layers[0].token_index
    )  # the main tier as without


@pytest.mark.usefixtures("toy_storage")  # a quantized cache the tiny model cannot pay for
@pytest.mark.parametrize(
    "method,arch,attn,kv_heads,extra",
    [
        ("snapkv", "llama", "sdpa", 2, {}),
        ("h2o", "llama", "eager", 2, {}),  # every step: holes, then compactions
        ("adakv-snapkv", "mistral", "sdpa", 4, {}),  # ragged heads, MHA
        ("snapkv", "qwen3", "eager", 1, {"kv_bits": 8, "group_size": 8, "residual": 8}),  # quantized main
    ],
)
def test_a_large_8_bit_low_tier_brings_logits_back_to_the_full_cache(
    method, arch, attn, kv_heads, extra
) -> None:
    """The behavioural check that the low tier is attended: with room for every evicted token
    at 8 bits, logits are many times closer to the full cache's than with eviction alone
    (measured: about 7 against 0.03-0.12 on these models)."""
    budget, knobs = BUDGETS.get(method, BUDGETS["snapkv"])
    model = tiny_model(arch, attn, kv_heads)
    ids, tokens = random_prompt(30, 3), random_prompt(40, 4)

    def logits(name, budget=None, **knobs):
        cache = make_cache(model, name, budget=budget, **knobs)
        return forced(model, ids, torch.ones_like(ids), cache, tokens), cache

    full, _ = logits("full")
    evicting, _ = logits(method, budget, **{**knobs, **extra})
    two_tier, cache = logits(method, budget, low_budget=10**6, low_bits=8, **{**knobs, **extra})
    assert int(cache.memory()["low_tier_tokens"].min()) > 0
    gap_evicting = float((evicting - full).abs().max())
    gap_two_tier = float((two_tier - full).abs().max())
    assert gap_two_tier * 10 < gap_evicting, (gap_two_tier, gap_evicting)


@torch.no_grad()
@pytest.mark.parametrize("low_bits", [4, 2])
def test_a_chunked_replay_attends_the_low_tier_as_token_by_token_decoding_does(low_bits: int) -> None:
    """Forwards of several tokens (replay's chunks, cut at the next compression) see the low
    tier through a causal mask built from both tiers' indices, as single steps do."""
    model = tiny_model("llama")
    ids, tokens = random_prompt(30, 3), random_prompt(60, 4)
    knobs = {"interval": 8, "low_budget": 20, "low_bits": low_bits, **GROUP}
    stepwise = forced(model, ids, torch.ones_like(ids), make_cache(model, "snapkv", 24, **knobs), tokens)
    cache = make_cache(model, "snapkv", 24, **knobs)
    out = model(input_ids=ids, **cache_arg(cache), use_cache=True)
    fed = chunks = 0
    while fed < tokens.shape[1]:
        n = min(cache.steps_until_compress(), tokens.shape[1] - fed)
        out = model(input_ids=tokens[:, fed : fed + n], **cache_arg(cache), use_cache=True)
        fed, chunks = fed + n, chunks + 1
    assert chunks < tokens.shape[1] // 4 and int(cache.memory()["low_tier_tokens"].min()) == 20
    assert float((out.logits[:, -1] - stepwise[:, -1]).abs().max()) < 1e-4


def test_rows_alone_match_the_left_padded_batch() -> None:
    """At generate()'s positions a padded row's keys are rotated as alone, so its low tier
    holds the same codes (per token: the slot layout does not matter) and logits agree up to
    float noise. (At positions shifted by the padding, RoPE-rotated keys quantize differently.)"""
    model = tiny_model("llama")
    prompts = [random_prompt(30, 5)[0], random_prompt(22, 6)[0]]
    tokens = random_prompt(30, 7, 2)
    ids, mask = left_pad(prompts)
    knobs = {"interval": 8, "low_budget": 12, "low_bits": 4, **GROUP}
    batch = forced(model, ids, mask, make_cache(model, "snapkv", budget=16, **knobs), tokens)
    for row, p in enumerate(prompts):
        one = p[None]
        cache = make_cache(model, "snapkv", budget=16, **knobs)
        alone = forced(model, one, torch.ones_like(one), cache, tokens[row : row + 1])
        assert int(cache.memory()["low_tier_tokens"].min()) > 0
        assert float((alone[0] - batch[row]).abs().max()) < 1e-4


def test_memory_counts_the_low_tier_exactly() -> None:
    # int4 codes of 16 channels = 8 bytes for K and for V; fp32 scale and zero per 8 channels.
    _, cache = run("snapkv", 24, steps=40, interval=8, low_budget=10, low_bits=4, low_group_size=8)
    low = low_16bit = 0
    for layer in cache.layers:
        tier = layer.low_tier
        b, h = tier.token_index.shape[:2]
        assert tier.slots == 10
        codes = 2 * (HEAD_DIM * 4 // 8)
        scales = 2 * 2 * (HEAD_DIM // 8)  # scale and zero, K and V
        low += b * h * tier.slots * (codes + 4 * scales)
        low_16bit += b * h * tier.slots * (codes + 2 * scales)  # codes as they are, floats at 2 bytes
        assert tier.kv_bytes() == b * h * 10 * (codes + 4 * scales)
    main = sum(layer.storage.kv_bytes() for layer in cache.layers)
    mem = cache.memory()
    assert mem["kv_bytes"] == main + low == cache.kv_meter.current  # the step's joined view is gone
    assert mem["kv_bytes_16bit"] == main // 2 + low_16bit
    assert mem["low_tier_tokens"].tolist() == [[10, 10], [10, 10]]
    assert mem["peak_kv_bytes"] >= main + low + 2 * 2 * 2 * 10 * HEAD_DIM * 4  # the joined view of a step


def test_rows_reorder_and_reset_cover_the_low_tier() -> None:
    _, cache = run("snapkv", 24, batch=2, interval=8, low_budget=8, **GROUP)
    layer = cache.layers[0]
    before = layer.low_tier.token_index.clone(), layer.low_tier.kq.codes.clone()
    layer.select_rows(torch.tensor([1, 0]))
    assert torch.equal(layer.low_tier.token_index, before[0].flip(0))
    assert torch.equal(layer.low_tier.kq.codes, before[1].flip(0))
    cache.batch_repeat_interleave(2)
    assert layer.low_tier.token_index.shape[0] == 4
    assert cache.kv_meter.current == cache.memory()["kv_bytes"]
    cache.reset()
    assert all(layer.low_tier is None for layer in cache.layers)


@pytest.mark.parametrize("method", ["snapkv", "h2o", "beaconkv"])
def test_a_low_tier_adds_no_host_syncs(method) -> None:
    """Quiet steps stay sync-free, and a compression makes as many as without a low tier: a
    compaction's trim reads the fullest head in the read the layer makes anyway; an
    every-step eviction reads nothing (the tier grows by a slot until its budget)."""
    model = tiny_model("llama")
    budget, knobs = BUDGETS[method]
    counts, quiet = {}, {}
    for low in (0, 8):
        cache = make_cache(model, method, budget=budget, low_budget=low, **knobs)
        ids = random_prompt(10, 3)
        steps = []
        with torch.no_grad():
            out = model(input_ids=ids, **cache_arg(cache), use_cache=True)
            for _ in range(40):
                token = out.logits[:, -1].argmax(-1, keepdim=True)
                before = cache.n_compressions
                with SyncRecorder() as rec:
                    out = model(input_ids=token, **cache_arg(cache), use_cache=True)
                steps.append((cache.n_compressions - before, len(rec.calls)))
        quiet[low] = [n_calls for n, n_calls in steps if n == 0]
        if not method.startswith("beaconkv"):  # BeaconKV's backlog feeds on a quiet step (test_host_syncs)
            assert all(n_calls == 0 for n_calls in quiet[low])
        assert low == 0 or int(cache.memory()["low_tier_tokens"].min()) > 0
        counts[low] = max(n_calls / n for n, n_calls in steps if n)
    assert counts[8] == counts[0], counts
    assert quiet[8] == quiet[0]  # the tier adds none to a quiet step


@pytest.mark.parametrize(
    "knobs,match",
    [
        ({"low_bits": 3}, "low_bits"),
        ({"low_budget": -1}, "low_budget"),
        ({"low_budget": 8, "low_group_size": 12}, "power of two"),
        ({"low_group_size": 0}, "low_group_size"),
    ],
)
def test_bad_low_tier_knobs_are_one_clear_error_before_the_model_loads(knobs, match) -> None:
    for method in ("snapkv", "h2o", "full"):
        with pytest.raises(KnobError, match=match):
            check_knobs(get_method(method), knobs)


def test_a_low_group_size_that_does_not_divide_the_head_dim_is_refused_by_make_cache() -> None:
    with pytest.raises(KnobError, match="low_group_size 32 must divide the model's head dim"):
        make_cache(tiny_model("llama"), "snapkv", 24, low_budget=8, low_group_size=32)
