"""The worker's own state, without an engine: what it keeps per setting stays bounded."""

from __future__ import annotations

import gc
import tracemalloc

import pytest

pytest.importorskip("vllm", reason="the vLLM adapter's tests run in .venv-vllm: make test-vllm")

import torch  # noqa: E402

from reasonkv.core.models import ModelShape  # noqa: E402
from reasonkv.serving.vllm.settings import ServingSettings  # noqa: E402
from reasonkv.serving.vllm.worker_state import POLICIES_HELD, StepBatch, WorkerState  # noqa: E402
from sync_helpers import SyncRecorder  # noqa: E402

SHAPE = ModelShape("tiny", "llama", n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16)


def test_ten_thousand_distinct_settings_hold_the_workers_memory_flat() -> None:
    """Every request may bring its own budget: the worker reuses the policies of recent settings
    and forgets the least recently used, so 10,000 distinct ones hold what 1,000 do."""
    rope = (1.0 / (10000 ** (torch.arange(0, 16, 2).float() / 16)), 1.0)
    state = WorkerState(ServingSettings("snapkv", 64, {"interval": 16}), SHAPE, rope, block_size=16)
    engine = state.policy_for(ServingSettings("snapkv", 64, {"interval": 16}))
    tracemalloc.start()
    try:
        for i in range(10_000):
            if i == 1_000:
                gc.collect()
                after_1k = tracemalloc.get_traced_memory()[0]
            state.policy_for(ServingSettings("snapkv", 64 + i, {"interval": 16}))
            assert len(state.policy_for) <= POLICIES_HELD
        gc.collect()
        after_10k = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert after_10k - after_1k < 256 * 1024, (after_1k, after_10k)  # flat: not 9,000 more policies
    # The same setting is the same policy while held, and a fresh build (an equal one) after.
    again = state.policy_for(ServingSettings("snapkv", 64 + 9_999, {"interval": 16}))
    assert again is state.policy_for(ServingSettings("snapkv", 64 + 9_999, {"interval": 16}))
    rebuilt = state.policy_for(ServingSettings("snapkv", 64, {"interval": 16}))
    assert rebuilt is not engine and torch.equal(rebuilt[0], engine[0])


def test_the_attention_call_only_copies_the_queries() -> None:
    """Inside vLLM's attention call the adapter copies the layer's queries and does nothing
    else: no policy runs, nothing waits for the device; the policy runs after the forward, over
    the copy (the engine may reuse its query buffer), and a layer whose count is not the step's
    is an error, never a silent skip."""
    rope = (1.0 / (10000 ** (torch.arange(0, 16, 2).float() / 16)), 1.0)
    state = WorkerState(ServingSettings("snapkv", 64, {"interval": 16}), SHAPE, rope, block_size=16)
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
