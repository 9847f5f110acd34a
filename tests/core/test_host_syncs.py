"""No host syncs on a decode step that does not compress, for every registered method (BeaconKV's
backlog feed aside: one sync once every `upkeep_every` steps).

`SyncRecorder` (tests/sync_helpers.py) records the calls that would make the host wait for a
GPU (a value read on the host, a value-shaped op, a copy to the CPU). A decode step that does
not compress makes none: the layers decide from host integers (tokens seen, the schedule's
plan) when to look at the device. A step that compresses makes a fixed small number per
layer that compresses (`PER_COMPRESSION`, the table in docs/performance.md).

Without an attention mask a decode step syncs nowhere; with generate()'s 2-D mask reasonkv's
mask function reads it once per forward (is there padding, and among the new tokens?), as
transformers' own SDPA mask does.
"""

from __future__ import annotations

import pytest
import torch

import reasonkv
from conftest import left_pad, random_prompt, tiny_model
from method_helpers import profile_knobs, tiny_group
from reasonkv.core.hf_compat import cache_arg
from sync_helpers import SyncRecorder

METHODS = sorted(reasonkv.available_methods())
STEPS = 90

PER_COMPRESSION = {
    # The most syncs per layer that compresses, as measured (docs/performance.md explains each).
    "streaming": 5,
    "tova": 5,
    "h2o": 5,
    "snapkv": 5,
    "pyramidkv": 5,
    "rkv": 5,
    "pyramid-rkv": 5,
    "recent-query": 5,
    "random": 5,
    "reasonalloc-layer-rkv": 5,
    "adakv-snapkv": 7,
    "adakv-rkv": 7,
    "reasonalloc-rkv": 6,
    "reasonalloc-snapkv": 6,
    "reasonalloc-head-rkv": 6,
    "beaconkv": 6.5,  # 13 in a step where both layers compress (one feed of both)
    "initial-recent": 6,
    "beaconkv-all-queries": 6.5,  # 13 in a step where both layers compress (the feed's growth once)
    "reasonalloc-beaconkv": 8,
    "rpc": 8,
}


BACKLOG_FEEDS = {"beaconkv": 1, "initial-recent": 2, "reasonalloc-beaconkv": 1, "beaconkv-all-queries": 3}
"""Methods whose queue of queries leaving the recent window (`upkeep_every`, default 8) feeds the
beacon buffers when it is full, on whatever step that is: one sync (which buffers filled; two
for initial-recent's fixed set), at most once every `upkeep_every` steps, also when nothing
compresses. The all-queries ablation's feed reads one more: how far its buffers must grow."""
FEEDERS = (" add_points", " keep_first_points", "all_queries.py")


def backlog_feed(calls: list, method: str) -> bool:
    """Are `calls` exactly one feed of `method`'s beacon buffers?"""
    return len(calls) <= BACKLOG_FEEDS[method] and all(any(f in where for f in FEEDERS) for _, where in calls)


def bound_for(method: str) -> int:
    """A method not in the table (a new one) gets the most of any: add it when you measure it."""
    return PER_COMPRESSION.get(method, max(PER_COMPRESSION.values()))


def small_cache(model, method: str):
    spec = reasonkv.get_method(method)
    if not spec.compresses:
        return reasonkv.make_cache(model, method, None, **tiny_group(model, method))
    knobs = {"interval": 16} if "interval" in spec.knobs() else {}
    return reasonkv.make_cache(model, method, 32, **knobs, **profile_knobs(model, method))


def decode_syncs(model, cache, ids, mask, steps: int) -> list[tuple[int, list]]:
    """(layer compressions, syncs recorded) of each of `steps` greedy decode forwards."""
    out = []
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, **cache_arg(cache), use_cache=True).logits
        for _ in range(steps):
            token = logits[:, -1].argmax(-1, keepdim=True)
            if mask is not None:
                mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], 1)
            before = cache.n_compressions
            with SyncRecorder() as rec:
                logits = model(
                    input_ids=token, attention_mask=mask, **cache_arg(cache), use_cache=True
                ).logits
            out.append((cache.n_compressions - before, rec.calls))
    return out


@pytest.mark.parametrize("method", METHODS)
def test_a_decode_step_syncs_only_when_it_compresses(method: str) -> None:
    model = tiny_model("llama", "sdpa", 2)
    cache = small_cache(model, method)
    steps = decode_syncs(model, cache, random_prompt(10, seed=3), None, STEPS)
    quiet = [calls for n, calls in steps if n == 0]
    if method in BACKLOG_FEEDS:  # the backlog's feed, at most once in upkeep_every steps
        feeds = [calls for calls in quiet if calls]
        assert all(backlog_feed(calls, method) for calls in feeds), feeds[:1]
        assert len(feeds) <= STEPS // cache.policy.scorer.upkeep_every
        quiet = [calls for calls in quiet if not calls]
    assert quiet and all(calls == [] for calls in quiet), [c for c in quiet if c][:1]
    loud = [(n, calls) for n, calls in steps if n]
    assert bool(loud) == reasonkv.get_method(method).compresses
    worst = max((len(calls) / n for n, calls in loud), default=0)
    assert worst <= bound_for(method), (worst, loud[0][1])
    if loud:  # the table is tight: a fix that saves a sync lowers it
        assert worst == bound_for(method) or method not in PER_COMPRESSION, worst


@pytest.mark.parametrize("method", METHODS)
def test_with_a_padded_batch_the_mask_is_read_once_per_forward(method: str) -> None:
    model = tiny_model("llama", "sdpa", 2)
    cache = small_cache(model, method)
    ids, mask = left_pad([random_prompt(12, seed=3)[0], random_prompt(7, seed=4)[0]])
    for n, calls in decode_syncs(model, cache, ids, mask, 40):
        if n == 0:
            if method in BACKLOG_FEEDS and backlog_feed(calls[1:], method):
                calls = calls[:1]  # and the backlog's feed (above)
            assert [name for name, _ in calls] == ["tolist"], calls
            assert "_padding_mask_passthrough" in calls[0][1]


def test_the_recorder_sees_what_would_sync() -> None:
    x = torch.arange(6)
    with SyncRecorder() as rec:
        bool(x.any()), int(x.max()), float(x.sum()), x[0].item(), x.tolist()
        x[x > 2], x.nonzero(), torch.equal(x, x), x.cpu(), x.to("cpu")
        x + 1, x.to(x.device), x.sum(-1), torch.where(x > 2, x, 0)  # none of these
    names = [name for name, _ in rec.calls]
    assert names == [
        "__bool__", "__int__", "__float__", "item", "tolist", "__getitem__", "nonzero", "equal", "cpu", "to"
    ]  # fmt: skip
