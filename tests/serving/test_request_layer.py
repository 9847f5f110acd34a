"""`RequestLayer` (the engine side of the policy contract) keeps exactly what `CompressedLayer`
keeps in transformers, fed the same queries, keys and values: the vLLM adapter's decisions are
the HF path's, and what differs between the two engines is only where K/V live.

The HF run is recorded layer by layer (each forward's new keys and values, its queries and
positions, and the tokens each head holds afterwards); the same forwards are then replayed into
one RequestLayer per layer over a plain contiguous store that compacts to the slots it returns.
"""

from __future__ import annotations

import pytest
import torch

import reasonkv
from conftest import greedy_loop, random_prompt, tiny_model
from reasonkv.core.layer import CompressedLayer
from reasonkv.core.policy.base import EMPTY
from reasonkv.serving.request_layer import RequestLayer

METHODS = [
    ("streaming", 24, {}),
    ("h2o", 24, {}),
    ("tova", 24, {}),
    ("snapkv", 16, {"interval": 8}),
    ("rkv", 16, {"interval": 8}),
    ("random", 32, {}),
    ("recent-query", 32, {}),
    ("beaconkv", 32, {}),
    ("initial-recent", 32, {}),
    ("rpc", 8, {"ratio": 2.0}),
    ("snapkv", 16, {"interval": 8, "phase": "decode"}),
]


def record(monkeypatch, model, method, budget, knobs, prompt_len=20, steps=60):
    """Each layer's forwards: (keys, values, query, positions, held index per head)."""
    forwards: dict[int, list] = {}
    pending: dict[int, list] = {}
    update, after = CompressedLayer.update, CompressedLayer.after_attention

    def spy_update(self, key_states, value_states, *args, **kwargs):
        pending[self.layer_idx] = [key_states.clone(), value_states.clone()]
        return update(self, key_states, value_states, *args, **kwargs)

    def spy_after(self, query, positions, scaling):
        after(self, query, positions, scaling)
        index = self.token_index[0]
        held = [sorted(int(i) for i in row if i != EMPTY) for row in index]
        pos = positions if positions is not None else torch.arange(self.new_start, self.seen)[None]
        forwards.setdefault(self.layer_idx, []).append(
            (*pending.pop(self.layer_idx), query.clone(), pos[0].clone(), held, scaling)
        )

    monkeypatch.setattr(CompressedLayer, "update", spy_update)
    monkeypatch.setattr(CompressedLayer, "after_attention", spy_after)
    cache = reasonkv.make_cache(model, method, budget, **knobs)
    greedy_loop(model, random_prompt(prompt_len, seed=3), cache, steps)
    monkeypatch.undo()
    return cache, forwards


@pytest.mark.parametrize(("method", "budget", "knobs"), METHODS, ids=lambda v: str(v))
def test_request_layers_keep_what_the_cache_keeps(monkeypatch, method, budget, knobs) -> None:
    model = tiny_model("llama")
    cache, forwards = record(monkeypatch, model, method, budget, knobs)
    policy, budgets = cache.policy, cache.budgets
    states = [None] * len(forwards)
    compressions = 0
    for layer_idx, steps in forwards.items():
        layer = RequestLayer(
            layer_idx, budgets[layer_idx], policy, states, prompt_end=20, head_dim=16,
            dtype=torch.float32, device=torch.device("cpu"),
        )  # fmt: skip
        compressions += replay(layer, steps)
    assert compressions > 0, "the run never compressed: the comparison would prove nothing"


def replay(layer: RequestLayer, steps: list) -> int:
    """Feed a recorded layer's forwards to `layer` over a contiguous store that compacts to the
    slots it returns, asserting after each that it holds what the HF cache held; compressions."""
    keys = values = None
    compressions = 0
    for new_k, new_v, query, positions, held, scaling in steps:
        keys = new_k if keys is None else torch.cat([keys, new_k], dim=2)
        values = new_v if values is None else torch.cat([values, new_v], dim=2)
        slots = layer.step(query, positions, lambda with_values, k=keys, v=values: (k, v), scaling)
        if slots is not None:
            index = slots[None, :, :, None].expand(-1, -1, -1, keys.shape[-1])
            keys, values = keys.gather(2, index), values.gather(2, index)
            compressions += 1
        mine = [sorted(row) for row in layer.token_index[0].tolist()]
        assert mine == held, f"layer {layer.layer_idx} after token {layer.seen}"
    assert layer.length == keys.shape[2]
    return compressions


def test_a_head_allocator_is_refused() -> None:
    model = tiny_model("llama")
    cache = reasonkv.make_cache(model, "adakv-snapkv", 16)
    with pytest.raises(ValueError, match="one budget a head"):
        RequestLayer(0, cache.budgets[0], cache.policy, [None], 4, 16, torch.float32, torch.device("cpu"))


TIES = [("tova", 24, {}), ("snapkv", 16, {"interval": 8}), ("beaconkv", 32, {})]
"""(H2O is not here: its sums over different numbers of steps do not tie. A tie-break reversed in
`RequestLayer` fails all three.)"""


@pytest.mark.parametrize(("method", "budget", "knobs"), TIES, ids=lambda v: str(v))
def test_on_exact_ties_request_layers_keep_what_the_cache_keeps(monkeypatch, method, budget, knobs) -> None:
    """Zero queries make every attention weight equal, so every score ties exactly: which of the
    tied tokens survive is then decided by tie-breaking alone. The HF path evicts every-step
    methods one slot at a time into holes (`evict_one`) where the request layer selects and
    compacts (`select_tokens`); both must break ties the same way."""
    model = tiny_model("llama")
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.zero_()
    cache, forwards = record(monkeypatch, model, method, budget, knobs)
    first = forwards[0][-1][2]  # the last forward's query of layer 0: all zero
    assert not first.any(), "the queries must be zero for every score to tie"
    layer_idx, steps = 1, forwards[1]
    layer = RequestLayer(
        layer_idx, cache.budgets[layer_idx], cache.policy, [None] * len(forwards), prompt_end=20, head_dim=16,
        dtype=torch.float32, device=torch.device("cpu"),
    )  # fmt: skip
    assert replay(layer, steps) > 0


def test_waiting_decode_queries_join_the_window_as_step_by_step_keeps_would() -> None:
    """A scorer that does not observe steps (SnapKV) lets decode queries wait before they join the
    window; what the window then holds (queries, indices, positions) is what a window fed one
    query a step holds, whenever it is read, and no more than PENDING_QUERIES wait. The engine may
    reuse its tensors after the step: what waits must not change with them."""
    from reasonkv.core.query_window import QueryWindow
    from reasonkv.serving.request_layer import PENDING_QUERIES

    model = tiny_model("llama")
    cache = reasonkv.make_cache(model, "snapkv", 512, window=5)
    layer = RequestLayer(0, cache.budgets[0], cache.policy, [None], 6, 16, torch.float32, torch.device("cpu"))
    reference = QueryWindow()
    size = layer._window_keep
    torch.manual_seed(0)
    keys = torch.randn(1, 2, 0, 16)
    waited = 0
    for step in range(3 * PENDING_QUERIES + 3):
        q = 6 if step == 0 else 1  # the prompt, then one token a step
        first = layer.seen
        query = torch.randn(1, 4, q, 16)
        positions = torch.arange(first, first + q) + 100  # positions need not equal indices
        keys = torch.cat([keys, torch.randn(1, 2, q, 16)], dim=2)
        engine_query, engine_positions = query.clone(), positions.clone()
        assert layer.step(engine_query, engine_positions, lambda v, k=keys: (k, k), 0.25) is None
        engine_query.zero_(), engine_positions.zero_()  # the engine's buffers, reused for the next step
        index, pos = reference.label(query, first, None, positions[None])
        reference.keep(query, index, pos, size)
        assert len(layer._pending) < PENDING_QUERIES
        waited = max(waited, len(layer._pending))
        if step % 11 == 10:  # now and then, more than PENDING_QUERIES steps apart: reading joins what waits
            window = layer.window
            assert torch.equal(window.queries, reference.queries)
            assert torch.equal(window.query_index, reference.query_index)
            assert torch.equal(window.query_positions, reference.query_positions)
            assert layer._pending == []
    assert waited == PENDING_QUERIES - 1  # the cap was reached and joined, not only read away
    assert layer.length == layer.seen == keys.shape[2]
    assert torch.equal(layer.token_index[0], torch.arange(layer.seen).expand(2, -1))
