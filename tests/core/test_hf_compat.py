"""transformers 5.19 beside 5.20+: the cache keyword by version, and the hand-over from
`CompressedCache.update` to the attention function where no forward kwargs arrive (the whole
core suite runs on 5.19 in `make test-vllm`)."""

from __future__ import annotations

import torch
import transformers
from packaging.version import Version

from reasonkv.core import hf_compat


def test_the_cache_keyword_follows_the_installed_version() -> None:
    new = Version(transformers.__version__).release >= (5, 20)
    assert hf_compat.NEW_CACHE_API is new
    cache = object()
    assert hf_compat.cache_arg(cache) == {("cache" if new else "past_key_values"): cache}


def test_a_hand_over_is_taken_once_and_only_with_the_keys_update_returned() -> None:
    cache, keys, other = object(), torch.zeros(1), torch.zeros(1)
    hf_compat.hand_over(cache, keys)
    assert hf_compat.handed_cache(keys) is cache
    assert hf_compat.handed_cache(keys) is None  # taken: a later call with the same keys gets none
    hf_compat.hand_over(cache, keys)  # left by a forward that failed before its attention call
    assert hf_compat.handed_cache(other) is None  # an equal tensor, not the one returned ...
    assert hf_compat.handed_cache(keys) is None  # ... and the stale hand-over is dropped
