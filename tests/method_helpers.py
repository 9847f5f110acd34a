"""Helpers shared by the per-method test files (h2o, rkv, rpc): conftest's tiny Llama at the
default init (its attention is flatter than the wide-init models, and these tests were tuned on
it), a greedy generate that keeps the scores, and two left-padded prompts."""

from __future__ import annotations

import signal
import tempfile
from contextlib import contextmanager
from pathlib import Path

import torch
from transformers import LlamaForCausalLM

import reasonkv
from conftest import TEST_DEVICE, build_tiny_model
from reasonkv.core.hf_compat import cache_arg
from reasonkv.core.policy.base import EMPTY


def flat_llama(attn: str = "sdpa", seed: int = 0) -> LlamaForCausalLM:
    """conftest's tiny Llama (2 layers, 4 query heads over 2 KV heads) at init range 0.02."""
    return build_tiny_model("llama", attn, kv_heads=2, seed=seed, init_range=0.02)


def greedy(model, ids, mask, cache, n: int):
    return model.generate(
        input_ids=ids,
        attention_mask=mask,
        **cache_arg(cache),
        max_new_tokens=n,
        do_sample=False,
        pad_token_id=0,
        eos_token_id=None,
        output_scores=True,
        return_dict_in_generate=True,
    )


def padded_prompts(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """Two prompts of 14 and 10 tokens, left-padded to 14, on TEST_DEVICE."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 128, (2, 14), generator=g)
    pads = [0, 4]
    mask = torch.ones_like(ids)
    for r, p in enumerate(pads):
        ids[r, :p] = 0
        mask[r, :p] = 0
    return ids.to(TEST_DEVICE), mask.to(TEST_DEVICE), pads


def assert_no_eviction_matches_stock(model, method: str, budget: int) -> None:
    """With a budget no prompt + 24 tokens can reach, `method` on `model` decodes exactly like
    a fresh stock model with a DynamicCache: same tokens, same scores, no compression."""
    from transformers import DynamicCache

    from reasonkv import make_cache

    stock = flat_llama()
    ids, mask, _ = padded_prompts()
    ref = greedy(stock, ids, mask, DynamicCache(config=stock.config), 24)
    cache = make_cache(model, method, budget=budget)
    out = greedy(model, ids, mask, cache, 24)
    assert torch.equal(out.sequences, ref.sequences)
    for a, b in zip(out.scores, ref.scores, strict=True):
        assert torch.allclose(a, b, atol=1e-5)
    assert cache.events == []


def tiny_group(model, method: str) -> dict:
    """`group_size` for a method that quantizes by default (quant-int*) on a tiny model: the
    default group (32) does not divide the tiny models' head dim (16), so they set their own."""
    if reasonkv.get_method(method).knobs()["kv_bits"] == 16:
        return {}
    return {"group_size": model.config.head_dim}


def profile_knobs(model, method: str) -> dict:
    """Profile-driven methods (ReasonAlloc) need a profile of the model: give the tiny model
    one with a non-flat demand curve, so layers really get different budgets."""
    if "profile" not in reasonkv.get_method(method).knobs():
        return {}
    from reasonkv.methods.profiles import config_hash, save_profile

    n = model.config.num_hidden_layers
    folder = Path(tempfile.gettempdir()) / "reasonkv-test-profiles"
    path = folder / f"{config_hash(model.config)}.json"
    if not path.exists():
        demand = [1.0 + (i % 2) for i in range(n)]  # 1, 2, 1, 2, ... : layer budgets 2:1 apart
        save_profile({"model": "tiny", "config_hash": config_hash(model.config), "demand": demand}, path)
    return {"profile": str(path)}


def kept_tokens(layer, row: int, shift: int = 0) -> list[list[int]]:
    """Per KV head, the sequence indices a cache layer keeps for batch row `row`, minus `shift`
    (a row's left padding: the same tokens alone have indices smaller by it)."""
    index = layer.token_index
    return [[int(i) - shift for i in index[row, h] if i != EMPTY] for h in range(index.shape[1])]


@contextmanager
def time_limit(seconds: float):
    """Fail instead of hanging: SIGALRM raises in the main thread after `seconds`."""

    def expire(signum, frame):
        raise TimeoutError(f"still running after {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
