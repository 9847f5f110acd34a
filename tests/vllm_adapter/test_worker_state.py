"""The worker's own state, without an engine: what it keeps per setting stays bounded."""

from __future__ import annotations

import gc
import tracemalloc
import zlib

import pytest

pytest.importorskip("vllm", reason="the vLLM adapter's tests run in .venv-vllm: make test-vllm")

import torch  # noqa: E402

from reasonkv.core.models import ModelShape  # noqa: E402
from reasonkv.core.policy.base import EMPTY  # noqa: E402
from reasonkv.methods.resolved import ResolvedMethod, resolve_method  # noqa: E402
from reasonkv.serving.vllm.worker_state import POLICIES_HELD, StepBatch, WorkerState  # noqa: E402
from sync_helpers import SyncRecorder  # noqa: E402

SHAPE = ModelShape("tiny", "llama", n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16)


def test_ten_thousand_distinct_settings_hold_the_workers_memory_flat() -> None:
    """Every request may bring its own budget: the worker reuses the policies of recent settings
    and forgets the least recently used, so 10,000 distinct ones hold what 1,000 do."""
    rope = (1.0 / (10000 ** (torch.arange(0, 16, 2).float() / 16)), 1.0)
    state = WorkerState(resolve_method("snapkv", 64, {"interval": 16}), SHAPE, rope, block_size=16)
    engine = state.policy_for(resolve_method("snapkv", 64, {"interval": 16}))
    tracemalloc.start()
    try:
        for i in range(10_000):
            if i == 1_000:
                gc.collect()
                after_1k = tracemalloc.get_traced_memory()[0]
            state.policy_for(resolve_method("snapkv", 64 + i, {"interval": 16}))
            assert len(state.policy_for) <= POLICIES_HELD
        gc.collect()
        after_10k = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert after_10k - after_1k < 256 * 1024, (after_1k, after_10k)  # flat: not 9,000 more policies
    # The same setting is the same policy while held, and a fresh build (an equal one) after.
    again = state.policy_for(resolve_method("snapkv", 64 + 9_999, {"interval": 16}))
    assert again is state.policy_for(resolve_method("snapkv", 64 + 9_999, {"interval": 16}))
    rebuilt = state.policy_for(resolve_method("snapkv", 64, {"interval": 16}))
    assert rebuilt is not engine and torch.equal(rebuilt[0], engine[0])


def test_the_attention_call_only_copies_the_queries() -> None:
    """Inside vLLM's attention call the adapter copies the layer's queries and does nothing
    else: no policy runs, nothing waits for the device; the policy runs after the forward, over
    the copy (the engine may reuse its query buffer), and a layer whose count is not the step's
    is an error, never a silent skip."""
    rope = (1.0 / (10000 ** (torch.arange(0, 16, 2).float() / 16)), 1.0)
    state = WorkerState(resolve_method("snapkv", 64, {"interval": 16}), SHAPE, rope, block_size=16)
    blocks = [torch.tensor([0]), torch.tensor([1])]
    state.begin_step(StepBatch(["a", "b"], [0, 0], [3, 1], [3, 1], [None, None], blocks, torch.arange(4)))
    query = torch.randn(4, 4, 16)
    expected = query.clone()
    with SyncRecorder() as recorder:
        state.hold_queries(0, None, query, torch.empty(0), 0.25)
        state.hold_queries(1, None, query, torch.empty(0), 0.25)
    assert recorder.calls == []
    assert state.requests == {}
    query.add_(1.0)
    assert torch.equal(state.held[0].queries[:4], expected)
    state.held[0].tokens = 3
    with pytest.raises(RuntimeError, match="layer 0 held 3 queries, the step has 4"):
        state.after_forward()
    # A layer that held nothing of this step (a stale count from the last one is cleared).
    state.begin_step(state.batch)
    state.hold_queries(0, None, query, torch.empty(0), 0.25)
    with pytest.raises(RuntimeError, match="1 of 2 layers held this step's queries"):
        state.after_forward()


BLOCK, HEAD_DIM = 16, 32  # a head size vLLM's CPU kernels take
POOL_SHAPE = ModelShape("tiny", "llama", n_layers=2, n_heads=4, n_kv_heads=2, head_dim=HEAD_DIM)
POOLED = [
    ("snapkv", 16, {"interval": 8}),
    ("beaconkv", 32, {}),
    ("h2o", 24, {}),
    ("rpc", 8, {"ratio": 2.0, "window": 8, "n_recent": 8}),
]
SCHEDULE = {"a": (0, 20), "b": (3, 26), "c": (7, 12)}
"""request -> (the step it arrives at, its prompt's length). "b" takes no token at steps 15 and 16
(vLLM's token budget ran out for it): it leaves the pool for one of its own, which joins the
shared pool again after the step."""
SKIPPED = {("b", 15), ("b", 16)}
MORE = {("a", 22): 3}
"""At step 22 "a" takes 3 tokens (a streaming session's next input): in a pool of its own for the step."""


class Paged:
    """A worker over a real vLLM CPU paged cache a layer: each step writes the new tokens' K/V
    with vLLM's own op at their physical slots, as the runner does, then runs the adapter."""

    def __init__(self, settings: ResolvedMethod, requests: list[str]) -> None:
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        rope = (1.0 / (10000 ** (torch.arange(0, HEAD_DIM, 2).float() / HEAD_DIM)), 1.0)
        self.isa = _get_attn_isa(torch.float32, BLOCK, HEAD_DIM)
        self.state = WorkerState(settings, POOL_SHAPE, rope, block_size=BLOCK)
        self.layer = type(
            "Layer", (), dict(isa=self.isa, kv_cache_dtype="auto", _k_scale_float=1.0, _v_scale_float=1.0)
        )
        names = sorted(SCHEDULE)
        self.blocks = {
            rid: torch.arange(6 * names.index(rid), 6 * names.index(rid) + 6, dtype=torch.int32)
            for rid in requests
        }
        self.caches = [
            torch.zeros(6 * len(names), POOL_SHAPE.n_kv_heads, BLOCK, 2 * HEAD_DIM)
            for _ in range(POOL_SHAPE.n_layers)
        ]
        self.logical = dict.fromkeys(requests, 0)
        self.physical = dict.fromkeys(requests, 0)

    def step(self, work: dict[str, tuple[int, int]], data) -> None:
        """`work`: request -> (tokens this step, prompt length); `data(rid, layer)` its new
        keys, values [q, H, D] and queries [q, Hq, D]."""
        from vllm import _custom_ops as ops

        from reasonkv.serving.vllm.paged_kv import split_cache

        ids = list(work)
        first = [self.logical[r] for r in ids]
        positions = torch.cat([torch.arange(self.logical[r], self.logical[r] + work[r][0]) for r in ids])
        batch = StepBatch(
            ids, first, [work[r][0] for r in ids], [work[r][1] for r in ids], [None] * len(ids),
            [self.blocks[r] for r in ids], positions,
        )  # fmt: skip
        self.state.begin_step(batch)
        for layer_idx, cache in enumerate(self.caches):
            queries = []
            for rid in ids:
                q = work[rid][0]
                keys, values, query = data(rid, layer_idx)
                slots = torch.arange(self.physical[rid], self.physical[rid] + q)
                slots = self.blocks[rid][slots // BLOCK].long() * BLOCK + slots % BLOCK
                k_half, v_half = split_cache(cache)
                ops.cpu_attn_reshape_and_cache(
                    keys,
                    values,
                    k_half,
                    v_half,
                    slots,
                    self.isa,
                    k_scale=1.0,
                    v_scale=1.0,
                    kv_cache_dtype="auto",
                )
                queries.append(query)
            self.state.hold_queries(layer_idx, self.layer, torch.cat(queries), cache, HEAD_DIM**-0.5)
        self.state.after_forward()
        lengths = self.state.end_step()
        self.state.batch = None
        for rid in ids:
            self.logical[rid] += work[rid][0]
            self.physical[rid] = lengths.get(rid, self.physical[rid] + work[rid][0])

    def held(self, rid: str, layer_idx: int) -> list[list[int]]:
        pool = self.state.requests[rid].pool
        storage = pool.storages[layer_idx]
        row = storage.token_index[storage.ids.index(rid)].tolist()
        return [sorted(i for i in head if i != EMPTY) for head in row]


@pytest.mark.parametrize(("method", "budget", "knobs"), POOLED, ids=lambda v: str(v))
def test_a_pool_of_requests_keeps_what_each_request_keeps_alone(method, budget, knobs) -> None:
    """The worker runs a layer's step once for a pool of requests at different positions: each
    request's prompt runs alone, then joins the pool; a request that takes no token in a step
    leaves the pool and joins it again, as does one that takes more than one token; the rows that
    compress are scored apart. Every request
    keeps, at every step and layer, what it keeps run alone by its own worker, and its blocks
    hold the same bytes."""
    settings = resolve_method(method, budget, knobs)
    pooled = Paged(settings, sorted(SCHEDULE))
    alone = {rid: Paged(settings, [rid]) for rid in SCHEDULE}
    steps, compressed, split = 34, set(), 0
    for t in range(steps):
        work = {
            rid: (prompt if t == start else MORE.get((rid, t), 1), prompt)
            for rid, (start, prompt) in SCHEDULE.items()
            if t >= start and (rid, t) not in SKIPPED
        }

        def data(rid, layer_idx, t=t, work=work):
            gen = torch.Generator().manual_seed(zlib.crc32(f"{rid} {t} {layer_idx}".encode()))
            q = work[rid][0]
            shape = (q, POOL_SHAPE.n_kv_heads, HEAD_DIM)
            return (
                torch.randn(*shape, generator=gen),
                torch.randn(*shape, generator=gen),
                torch.randn(q, POOL_SHAPE.n_heads, HEAD_DIM, generator=gen),
            )

        if ("b", t) in SKIPPED:  # the split below is taken only from a shared pool
            split += len(pooled.state.requests["b"].pool.ids) > 1
        pooled.step(work, data)
        for rid in work:
            alone[rid].step({rid: work[rid]}, data)
            for layer_idx in range(POOL_SHAPE.n_layers):
                assert pooled.held(rid, layer_idx) == alone[rid].held(rid, layer_idx), (rid, t, layer_idx)
            assert pooled.physical[rid] == alone[rid].physical[rid]
            if pooled.physical[rid] < pooled.logical[rid]:
                compressed.add(rid)
            blocks = pooled.blocks[rid].long()  # the same writes went to them: the same bytes
            for mine, theirs in zip(pooled.caches, alone[rid].caches, strict=True):
                assert torch.equal(mine[blocks], theirs[blocks]), (rid, t)
    assert compressed == set(SCHEDULE), f"every request must compress: {compressed}"
    assert split == len(SKIPPED), "the request that took no token must have been in the shared pool"
    assert len(pooled.state.pools) == 1, "and joined it again"
