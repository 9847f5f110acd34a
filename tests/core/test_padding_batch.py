"""Left padding: a batch decodes exactly like its rows alone, and a pad never becomes
attendable or a sink, however many evictions happen."""

from __future__ import annotations

import pytest
import torch
from transformers import LogitsProcessor, LogitsProcessorList

import reasonkv
from conftest import left_pad, random_prompt, tiny_model
from reasonkv.core.hf_compat import cache_arg
from reasonkv.core.policy.base import EMPTY

NEW = 48
LENGTHS = (5, 17, 11)  # the 17-token row compresses already at prefill for the every-step methods
METHODS = {
    "full": dict(budget=None),
    "streaming": dict(budget=12),
    "tova": dict(budget=12),
    "snapkv": dict(budget=12, interval=8),
}


class InspectCache(LogitsProcessor):
    """Runs `check(cache, step)` after every forward of generate() (a logits processor is
    called once per step, after the model saw the step's tokens)."""

    def __init__(self, cache, check):
        self.cache, self.check, self.step = cache, check, 0

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self.check(self.cache, self.step)
        self.step += 1
        return scores


def prompts(seed: int) -> list[torch.Tensor]:
    return [random_prompt(n, seed=seed + n)[0] for n in LENGTHS]


@pytest.mark.parametrize(
    "arch,attn,kv_heads",
    [("llama", "sdpa", 2), ("llama", "eager", 2), ("qwen3", "sdpa", 4), ("qwen3", "eager", 4)],
)
@pytest.mark.parametrize("method", METHODS)
def test_left_padded_batch_gives_the_tokens_of_each_prompt_alone(
    method: str, arch: str, attn: str, kv_heads: int
) -> None:
    model = tiny_model(arch, attn, kv_heads)
    rows = prompts(seed=100)
    ids, mask = left_pad(rows)
    kwargs = dict(max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)

    cache = reasonkv.make_cache(model, method, **METHODS[method])
    batch = model.generate(ids, attention_mask=mask, **cache_arg(cache), **kwargs)[:, ids.shape[1] :]

    for row, prompt in enumerate(rows):
        alone_cache = reasonkv.make_cache(model, method, **METHODS[method])
        alone = model.generate(prompt[None], **cache_arg(alone_cache), **kwargs)[0, prompt.numel() :]
        assert torch.equal(batch[row], alone), f"row {row} (prompt of {prompt.numel()} tokens) diverged"
        if method != "full":
            assert alone_cache.events, "the run must evict"
    if method != "full":
        assert cache.events, "the batch run must evict"
        live = cache.memory()["live_tokens"]  # [B, L, H] for a batch
        assert live.shape == (3, 2, kv_heads)
        assert int(live.max()) <= cache.live_token_bound()


@pytest.mark.parametrize("attn", ("sdpa", "eager"))
@pytest.mark.parametrize("method", ("streaming", "tova", "snapkv"))
def test_pads_are_never_live_and_sinks_are_the_first_real_tokens(method: str, attn: str) -> None:
    model = tiny_model("mistral", attn, 2)
    rows = prompts(seed=200)
    ids, mask = left_pad(rows)
    pads = [ids.shape[1] - p.numel() for p in rows]
    n_sink = 3
    cache = reasonkv.make_cache(model, method, n_sink=n_sink, **METHODS[method])
    seen_eviction = [False] * len(rows)

    def check(c, step: int) -> None:
        for layer in c.layers:
            index = layer.token_index[:, :, : layer.used]
            for row, pad in enumerate(pads):
                real = index[row][index[row] != EMPTY]
                assert not (real < pad).any(), f"a pad of row {row} is stored as a real token"
                # n_valid (what memory() reports) counts real tokens only.
                assert torch.equal(layer.n_valid[row], (index[row] != EMPTY).sum(-1))
                evicted = int(layer.n_valid[row].max()) < layer.seen - pad
                seen_eviction[row] |= evicted
                for head in range(index.shape[1]):
                    n = int(layer.lengths[row, head])
                    kept = index[row, head, :n]
                    kept = kept[kept != EMPTY].tolist()
                    assert kept[:n_sink] == list(range(pad, pad + n_sink)), "sinks are the first real tokens"
                    assert kept == sorted(kept)

    inspector = InspectCache(cache, check)
    out = model.generate(
        ids,
        attention_mask=mask,
        **cache_arg(cache),
        max_new_tokens=NEW,
        min_new_tokens=NEW,
        do_sample=False,
        logits_processor=LogitsProcessorList([inspector]),
    )
    assert out.shape == (3, ids.shape[1] + NEW)
    assert inspector.step == NEW
    assert all(seen_eviction), "every row, padded or not, must have gone through evictions"


def test_padding_is_dropped_from_storage_at_the_first_compression() -> None:
    """Pads take slots only until the first compaction; afterwards every stored slot of a
    head is a real token (a pad never costs memory for the rest of the run)."""
    model = tiny_model("llama", "sdpa", 2)
    rows = prompts(seed=300)
    ids, mask = left_pad(rows)
    cache = reasonkv.make_cache(model, "snapkv", 12, interval=8)
    model.generate(ids, attention_mask=mask, **cache_arg(cache), max_new_tokens=NEW, do_sample=False)
    for layer in cache.layers:
        for row in range(3):
            for head in range(2):
                n = int(layer.lengths[row, head])
                assert not (layer.token_index[row, head, :n] == EMPTY).any()
