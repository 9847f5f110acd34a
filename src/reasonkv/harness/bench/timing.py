"""Timing the cache's own work: a `StepTimer` that adds up the sections the cache opens."""

from __future__ import annotations

import contextlib
import functools
import time
from collections import defaultdict
from collections.abc import Callable, Iterable

import torch

from reasonkv.core.cache import CompressedCache, StepTimer

SCORING = ("score", "on_step", "split")
"""Timed sections that rank tokens (the scorer and the per-head split)."""
SELECTION = ("compress",)
"""Timed sections that choose and move tokens (`compress` includes the compaction)."""


class SectionTimer(StepTimer):
    """Wall time and call counts of named sections: the cache's own (it opens `section(name)`
    around each part of a step) and any callable wrapped with `wrap`.

    Nested sections each count their own inclusive time (`compress` contains `compact`,
    `after_attention` contains score/on_step/split/compress). With `label=True` each call
    also opens a `torch.profiler.record_function("reasonkv::NAME")`, so a profile shows them.
    """

    def __init__(self, sync: Callable[[], None] | None = None, label: bool = False):
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self.sync = sync
        self.label = label

    @contextlib.contextmanager
    def section(self, name: str):
        ctx = torch.profiler.record_function(f"reasonkv::{name}") if self.label else _NULL
        with ctx:
            start = time.perf_counter()
            try:
                yield
            finally:
                if self.sync is not None:
                    self.sync()
                self.seconds[name] += time.perf_counter() - start
                self.calls[name] += 1

    def wrap(self, name: str, fn: Callable) -> Callable:
        @functools.wraps(fn)
        def timed(*args, **kwargs):
            with self.section(name):
                return fn(*args, **kwargs)

        return timed

    def reset(self) -> None:
        self.seconds.clear()
        self.calls.clear()

    def as_dict(self) -> dict[str, dict]:
        return {k: {"seconds": self.seconds[k], "calls": self.calls[k]} for k in sorted(self.seconds)}

    def total(self, names: Iterable[str]) -> float:
        return sum(self.seconds.get(n, 0.0) for n in names)


_NULL = contextlib.nullcontext()


def instrument(cache: CompressedCache, timer: SectionTimer) -> None:
    """Time the cache's own work through its timer hook."""
    cache.timer = timer
