"""ReasonAlloc end to end: profiles (made, saved, refused for another model), profiled
layer budgets in the cache, and per-head lengths that really follow the online split."""

from __future__ import annotations

import json
import math

import pytest
import torch

import reasonkv
from conftest import N_LAYERS, build_tiny_model, greedy_loop, random_prompt, tiny_model
from reasonkv.core.hf_compat import cache_arg
from reasonkv.core.policy.allocators.reasonalloc import EntropyHeadSplit, layer_budgets
from reasonkv.core.policy.base import Observation
from reasonkv.harness.profile import curve_agreement, plot_wave, profile_trace
from reasonkv.methods.profiles import config_hash, find_profile, load_profile, save_profile


def _profile_for(model, demand: list[float], path) -> str:
    save_profile({"model": "tiny", "config_hash": config_hash(model.config), "demand": demand}, path)
    return str(path)


def test_profile_trace_records_every_stride_position_of_the_trace() -> None:
    model = tiny_model("llama", "sdpa", 2)
    ids = random_prompt(70, seed=3)  # 6 prompt tokens + 64 trace tokens
    stats = profile_trace(model, ids, prompt_len=6, chunk=16, stride=8, topk=4)
    assert stats["entropy"].shape == (8, N_LAYERS, 2)  # positions 6, 14, ..., 62
    assert bool(((stats["entropy"] >= 0) & (stats["entropy"] <= 1 + 1e-6)).all())
    assert bool(((stats["topk_mass"] > 0) & (stats["topk_mass"] <= 1 + 1e-6)).all())


def test_profile_entropy_does_not_depend_on_the_chunk_size() -> None:
    """Chunked replay sees, for each profiled query, the same keys as token-by-token decoding."""
    model = tiny_model("qwen3", "eager", 4)
    ids = random_prompt(40, seed=4)
    a = profile_trace(model, ids, prompt_len=4, chunk=1, stride=4, topk=8)
    b = profile_trace(model, ids, prompt_len=4, chunk=12, stride=4, topk=8)
    torch.testing.assert_close(a["entropy"], b["entropy"], atol=1e-5, rtol=0)
    torch.testing.assert_close(a["topk_mass"], b["topk_mass"], atol=1e-5, rtol=0)


def test_profile_round_trips_and_is_refused_for_another_model(tmp_path) -> None:
    model = tiny_model("llama", "sdpa", 2)
    other = build_tiny_model("qwen2", "sdpa", 2)
    path = _profile_for(model, [0.8, 0.3], tmp_path / "p.json")
    assert load_profile(path, model.config)["demand"] == [0.8, 0.3]
    assert json.loads((tmp_path / "p.json").read_text())["config_hash"] == config_hash(model.config)
    with pytest.raises(ValueError, match="was made for"):
        load_profile(path, other.config)
    with pytest.raises(ValueError, match="was made for"):
        reasonkv.make_cache(other, "reasonalloc-rkv", 64, profile=path)
    assert find_profile(model.config, [tmp_path]) == tmp_path / "p.json"
    assert find_profile(other.config, [tmp_path]) is None


def test_missing_profile_says_how_to_make_one() -> None:
    model = build_tiny_model("llama", "sdpa", 2, seed=7)
    with pytest.raises(FileNotFoundError, match="reasonkv profile --model"):
        reasonkv.make_cache(model, "reasonalloc-rkv", 64)


def test_cache_layer_budgets_follow_the_profile(tmp_path) -> None:
    model = tiny_model("llama", "sdpa", 2)
    path = _profile_for(model, [3.0, 1.0], tmp_path / "p.json")
    cache = reasonkv.make_cache(model, "reasonalloc-layer-rkv", 64, profile=path)
    expected = layer_budgets(torch.tensor([3.0, 1.0]), 2, 64, tau=1.0, lo=8)
    assert torch.equal(cache.budgets, expected)
    assert cache.budgets[:, 0].tolist() == [96, 32] and int(cache.budgets.sum()) == 2 * 2 * 64
    flat = reasonkv.make_cache(model, "reasonalloc-layer-rkv", 64, profile=path, tau=float("inf"))
    assert torch.equal(flat.budgets, torch.full((2, 2), 64))
    head_only = reasonkv.make_cache(model, "reasonalloc-head-rkv", 64, profile=path)
    assert torch.equal(head_only.budgets, torch.full((2, 2), 64))


def test_physical_head_lengths_equal_the_split_after_every_compression(tmp_path, monkeypatch) -> None:
    model = tiny_model("llama", "sdpa", 2)
    path = _profile_for(model, [2.0, 1.0], tmp_path / "p.json")
    splits: list[torch.Tensor] = []
    original = EntropyHeadSplit.split

    def recording(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        splits.append(out.clone())
        return out

    monkeypatch.setattr(EntropyHeadSplit, "split", recording)
    cache = reasonkv.make_cache(model, "reasonalloc-rkv", 24, profile=path, interval=8, floor_ratio=0.5)
    greedy_loop(model, random_prompt(12, seed=5), cache, 90)
    assert len(cache.events) == len(splits) > 4
    differing = 0
    for event, split in zip(cache.events, splits, strict=True):
        layer_total = int(cache.budgets[event.layer].sum())
        assert torch.equal(event.lengths, split.cpu())  # what was allocated is what is stored (events: host)
        assert int(split.sum()) == layer_total  # the layer total is fixed
        assert int(split.min()) >= max(8, int(0.5 * layer_total / 2))  # floor: protected window, ratio
        differing += int(split.min() != split.max())
    assert differing > 0, "the online split never moved budget between heads"
    for layer in cache.layers:
        last = [e for e in cache.events if e.layer == layer.layer_idx][-1].lengths
        # Storage follows the longest head (+ the 8 steps to the next compression), not a
        # uniform block with masks; since then every head grew by the same number of tokens.
        assert layer.keys.shape[2] == int(last.max()) + 8
        grown = layer.lengths.cpu() - last
        assert bool((grown == grown.flatten()[0]).all())
        assert torch.equal(layer.n_valid, layer.lengths)


def test_diffuse_preference_reverses_the_split(tmp_path) -> None:
    model = tiny_model("llama", "sdpa", 2)
    path = _profile_for(model, [1.0, 1.0], tmp_path / "p.json")
    lengths = {}
    for prefer in ("focused", "diffuse"):
        cache = reasonkv.make_cache(
            model, "reasonalloc-head-rkv", 24, profile=path, interval=8, prefer=prefer
        )
        greedy_loop(model, random_prompt(12, seed=5), cache, 20)
        lengths[prefer] = cache.events[0].lengths
    f, d = lengths["focused"][0], lengths["diffuse"][0]
    assert int(f.sum()) == int(d.sum())
    assert (f[0] > f[1]) == (d[0] < d[1])


def test_wave_plot_and_curve_agreement(tmp_path) -> None:
    pytest.importorskip("matplotlib", reason="plots need the eval extra: pip install 'reasonkv[eval]'")
    profile = {
        "model": "tiny",
        "traces": ["a", "b"],
        "tokens_seen": 10,
        "per_trace_demand": [[0.9, 0.5, 0.7], [0.8, 0.4, 0.8]],
    }
    out = plot_wave(profile, tmp_path / "wave.png")
    assert out.stat().st_size > 5000
    same = curve_agreement([0.9, 0.5, 0.7], [0.9, 0.5, 0.7])
    assert same["pearson_r"] == pytest.approx(1.0) and same["max_relative_gap"] == 0.0
    assert curve_agreement([1, 2, 3], [3, 2, 1])["pearson_r"] == pytest.approx(-1.0)


def _entropy_by_loop(queries, query_index, token_index, keys, scaling: float) -> list[list[list[float]]]:
    """[B][H][q] normalised entropy of each valid query (None for padding), group-averaged, by loops."""
    b_n, hq, q_n, _ = queries.shape
    h_n = keys.shape[1]
    g_n = hq // h_n
    out = []
    for b in range(b_n):
        rows = []
        for h in range(h_n):
            per_query = []
            for i in range(q_n):
                qi = int(query_index[b, i])
                if qi < 0:
                    per_query.append(None)
                    continue
                seen = [j for j in range(keys.shape[2]) if 0 <= int(token_index[b, h, j]) <= qi]
                total = 0.0
                for g in range(g_n):
                    q = queries[b, h * g_n + g, i].double()
                    logits = [float(q @ keys[b, h, j].double()) * scaling for j in seen]
                    top = max(logits)
                    z = sum(math.exp(v - top) for v in logits)
                    p = [math.exp(v - top) / z for v in logits]
                    ent = -sum(x * math.log(max(x, 1e-30)) for x in p)
                    total += ent / math.log(len(seen)) if len(seen) > 1 else 0.0
                per_query.append(total / g_n)
            rows.append(per_query)
        out.append(rows)
    return out


@pytest.mark.parametrize("entropy_every", [1, 5])
def test_step_utility_is_a_running_mean_over_every_query(monkeypatch, entropy_every: int) -> None:
    """The head split's utility="step" entropy equals a loop over every forward's queries (a
    left-padded prompt, then decode steps): each valid query's normalised entropy over the keys
    it saw at its own step, averaged over the group, folded in one at a time with step_ema,
    whether each step is folded in at once or queued and folded in batches of 5 (before every
    compression, so the keys a queued query saw are all still there)."""
    model = tiny_model("llama", "sdpa", 2)
    prompts = [random_prompt(9, seed=40)[0], random_prompt(5, seed=41)[0]]
    ids = torch.zeros(2, 9, dtype=torch.long)
    mask = torch.zeros(2, 9, dtype=torch.long)
    for r, p in enumerate(prompts):
        ids[r, 9 - len(p) :], mask[r, 9 - len(p) :] = p, 1
    cache = reasonkv.make_cache(
        model, "reasonalloc-head-rkv", 12, interval=4, step_ema=0.8, entropy_every=entropy_every
    )
    calls: dict[int, list] = {}
    original = EntropyHeadSplit.on_step

    def spy(self, step, keys, state):
        calls.setdefault(step.layer_idx, []).append(
            (
                step.queries.clone(),
                step.query_index.clone(),
                step.token_index.clone(),
                keys.clone(),
                step.scaling,
            )
        )
        return original(self, step, keys, state)

    monkeypatch.setattr(EntropyHeadSplit, "on_step", spy)
    model.generate(ids, attention_mask=mask, **cache_arg(cache), max_new_tokens=14, do_sample=False)
    assert len(cache.events) > 0  # it compressed along the way (the split read the entropy)
    for layer_idx, layer_calls in calls.items():
        running = [[None, None], [None, None]]
        for queries, query_index, token_index, keys, scaling in layer_calls:
            ent = _entropy_by_loop(queries, query_index, token_index, keys, scaling)
            for b in range(2):
                for h in range(2):
                    for e in ent[b][h]:
                        if e is not None:
                            r = running[b][h]
                            running[b][h] = e if r is None else 0.8 * r + 0.2 * e
        layer = cache.layers[layer_idx]
        state = layer.states.head_allocator
        now = Observation(layer.queries, layer.query_index, layer.token_index, cache.scaling)
        cache.policy.head_allocator.flush(now, layer.keys[:, :, : layer.used], state)  # the queue's tail
        got = state.entropy
        want = torch.tensor([[float(x) for x in row] for row in running], dtype=torch.float64)
        torch.testing.assert_close(got.double().cpu(), want, atol=1e-5, rtol=0)
