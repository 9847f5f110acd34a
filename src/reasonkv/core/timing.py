"""A hook for timing the cache's own work, so a benchmark measures without wrapping internals."""

from __future__ import annotations

import contextlib

_NULL = contextlib.nullcontext()


class StepTimer:
    """The cache opens `section(name)` around each part of a step: update, mask,
    after_attention, on_step, utility, score, split, compress, compact, holes, low_tier
    (sections nest: compress contains compact or holes, and low_tier with a two-tier cache).
    This default times nothing; a benchmark sets its own on the cache (`cache.timer = ...`)."""

    def section(self, name: str) -> contextlib.AbstractContextManager:
        return _NULL


NO_TIMER = StepTimer()
