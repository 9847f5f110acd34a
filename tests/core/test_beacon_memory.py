"""What BeaconKV holds beside its K/V: beacon buffers in the model's dtype or as 8-bit codes,
and a query window of the recent queries plus the backlog not yet fed to the buffers."""

from __future__ import annotations

import torch

import reasonkv
from conftest import build_tiny_model, greedy_loop, random_prompt, tiny_model
from reasonkv.core.policy.fps import add_points
from reasonkv.core.policy.scorers.beacon import BeaconState
from reasonkv.core.policy.vector_codes import decode_vectors, encode_vectors

HQ, D = 4, 16


def test_vector_codes_round_each_element_to_half_a_scale() -> None:
    x = torch.randn(3, 5, 7, D) * torch.logspace(-3, 2, 7)[:, None]
    x[0, 0, 0] = 0  # a zero vector codes as zeros
    codes, scale = encode_vectors(x)
    assert codes.dtype == torch.int8 and scale.shape == (3, 5, 7, 1) and scale.dtype == x.dtype
    back = decode_vectors(codes, scale)
    assert bool(((back - x).abs() <= scale / 2 + 1e-7 * x.abs()).all())
    assert torch.equal(back[0, 0, 0], torch.zeros(D)) and int(codes.abs().amax()) == 127
    again, scale_again = encode_vectors(back)  # codes of codes: the same codes
    assert torch.equal(again, codes)
    assert torch.allclose(scale_again, scale)


def test_beacons_as_codes_choose_the_same_points_as_full_precision_where_they_are_far_apart() -> None:
    """Continual FPS over well-separated directions: held as 8-bit codes, the buffer keeps the
    same points in the same slots, each within half a scale of the full-precision one."""
    gen = torch.Generator().manual_seed(0)
    points = torch.nn.functional.normalize(torch.randn(1, 2, 40, D, generator=gen), dim=-1) * 3
    valid = torch.ones(1, 2, 40, dtype=torch.bool)
    full, count = add_points(torch.zeros(1, 2, 10, D), torch.zeros(1, 2, dtype=torch.long), points, valid, 4)
    codes, scale = encode_vectors(torch.zeros(1, 2, 10, D))
    state = BeaconState(codes, torch.zeros(1, 2, dtype=torch.long), None, [], scale=scale)
    for chunk in points.split(7, dim=2):  # fed a chunk at a time, through the codes
        buf, cnt = add_points(
            state.points(), state.count, chunk, torch.ones(chunk.shape[:3], dtype=torch.bool), 4
        )
        state.hold(buf, cnt)
    assert torch.equal(state.count, count)
    held = state.points()
    assert bool(((held - full).abs() <= state.scale / 2 + 1e-6).all())
    assert state.beacons.dtype == torch.int8


def _beside(cache) -> int:
    mem = cache.memory()
    return mem["state_bytes"] - mem["kv_bytes"]


def test_beacon_buffers_follow_the_model_dtype_or_are_held_as_codes() -> None:
    """fp32 model: 4 bytes an element; bf16: 2; beacon_bits=8: 1, and a scale a beacon. The
    state beside K/V differs by exactly that, every other tensor alike."""
    prompt = random_prompt(12, seed=2)
    model = tiny_model("llama", "sdpa", 2)
    caches = {bits: reasonkv.make_cache(model, "beaconkv", 32, beacon_bits=bits) for bits in (16, 8)}
    for cache in caches.values():
        greedy_loop(model, prompt, cache, 50)
    layers, m = len(model.model.layers), 32
    st16, st8 = caches[16].layers[0].states.scorer, caches[8].layers[0].states.scorer
    assert st16.beacons.dtype == torch.float32 and st8.beacons.dtype == torch.int8
    assert st8.scale.shape == (1, HQ, m, 1) and st8.scale.dtype == torch.float32
    per_layer = HQ * m * (D * 4 - D * 1 - 4)
    assert _beside(caches[16]) - _beside(caches[8]) == layers * per_layer
    half = build_tiny_model("llama").to(torch.bfloat16)
    cache = reasonkv.make_cache(half, "beaconkv", 32)
    greedy_loop(half, prompt, cache, 50)
    assert cache.layers[0].states.scorer.beacons.dtype == torch.bfloat16


def test_the_query_window_holds_the_recent_queries_and_the_backlog_not_yet_fed() -> None:
    model = tiny_model("llama", "sdpa", 2)
    for upkeep in (1, 8):
        cache = reasonkv.make_cache(model, "beaconkv", 32, upkeep_every=upkeep)
        greedy_loop(model, random_prompt(12, seed=2), cache, 60)
        assert cache.layers[0].window.queries.shape[2] == 16 + upkeep


def test_the_query_window_as_codes_holds_a_quarter_of_the_bytes_and_decodes_within_half_a_scale() -> None:
    """window_bits=8: the same queries kept (their indices), as int8 codes and a scale each (fp32
    here): D + 4 bytes a query and head instead of 4 D; read back within half a scale. The
    meter still equals a walk of every tensor (both 8-bit knobs on)."""
    from test_state_meter import walk_tensors

    from reasonkv.core.memory_meter import held_bytes

    model = tiny_model("llama", "sdpa", 2)
    prompt = random_prompt(12, seed=2)
    caches = {bits: reasonkv.make_cache(model, "beaconkv", 64, window_bits=bits) for bits in (16, 8)}
    for cache in caches.values():
        greedy_loop(model, prompt, cache, 20)  # below the budget: nothing evicted, same queries
    for a, b in zip(caches[16].layers, caches[8].layers, strict=True):
        assert torch.equal(a.window.query_index, b.window.query_index)
        assert b.window._held.dtype == torch.int8
        exact, decoded = a.window.queries, b.window.queries
        assert decoded.dtype == exact.dtype
        assert bool(((decoded - exact).abs() <= b.window._scale / 2 + 1e-6).all())
    kept = caches[16].layers[0].window.size
    per_layer = HQ * kept * (D * 4 - D - 4)
    assert _beside(caches[16]) - _beside(caches[8]) == len(model.model.layers) * per_layer
    both = reasonkv.make_cache(model, "beaconkv", 24, window_bits=8, beacon_bits=8, upkeep_every=1)
    greedy_loop(model, prompt, both, 60)
    assert both.n_compressions > 0
    assert both.memory()["state_bytes"] == held_bytes(walk_tensors(both))[0]


def test_codes_keep_their_bound_and_the_model_dtype_on_a_bf16_model() -> None:
    """bf16: the scale is rounded to bf16 before the codes are taken (half a scale still holds),
    and beacon scales stay in the model's dtype after the buffers are fed."""
    x = torch.randn(4, 6, 9, D).to(torch.bfloat16) * 3
    codes, scale = encode_vectors(x)
    assert scale.dtype == torch.bfloat16
    err = (decode_vectors(codes, scale) - x.float()).abs() / scale.float().clamp(min=1e-30)
    assert float(err.max()) <= 0.5 + 1e-3
    half = build_tiny_model("llama").to(torch.bfloat16)
    cache = reasonkv.make_cache(half, "beaconkv", 24, beacon_bits=8, window_bits=8)
    greedy_loop(half, random_prompt(10, seed=2), cache, 60)
    st = cache.layers[0].states.scorer
    assert int(st.count.max()) > 0 and st.scale.dtype == torch.bfloat16
    assert cache.layers[0].window._scale.dtype == torch.bfloat16


def test_with_codes_the_beacons_do_not_depend_on_how_many_arrive_at_once() -> None:
    """beacon_bits=8: each query is rounded to its codes before FPS sees it, so feeding one at a
    time or eight at a time keeps the same beacons, as at 16 bits."""
    model = tiny_model("llama", "sdpa", 2)
    prompt = random_prompt(10, seed=7)
    caches = [reasonkv.make_cache(model, "beaconkv", 24, beacon_bits=8, upkeep_every=u) for u in (1, 8)]
    for cache in caches:
        greedy_loop(model, prompt, cache, 90)
        cache.policy.scorer.flush(cache.layers[0].states.scorer, cache.policy.rope_inv_freq)  # the queue too
    for a, b in zip(caches[0].layers, caches[1].layers, strict=True):
        sa, sb = a.states.scorer, b.states.scorer
        assert int(sa.count.min()) > 0
        assert torch.equal(sa.count, sb.count) and torch.equal(sa.beacons, sb.beacons)
        assert torch.equal(a.token_index, b.token_index)
