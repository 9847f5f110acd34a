"""Memory readings: the process's RSS and the bytes a cache holds."""

from __future__ import annotations

import contextlib
import ctypes
import gc
import os
import resource
import sys

from reasonkv.core.cache import CompressedCache


def current_rss() -> int | None:
    """Resident set size of this process now, in bytes (None where it cannot be read)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        pass
    try:
        import psutil

        return int(psutil.Process().memory_info().rss)
    except Exception:  # psutil missing or unsupported: RSS is optional
        return None


def max_rss() -> int:
    """The process's RSS high-water mark since it started, in bytes (Linux reports KiB)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


def release_memory() -> None:
    """Free what the previous run left: garbage, then glibc's free lists back to the OS, so
    the next run's RSS is measured from a clean baseline."""
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def cache_bytes(cache: CompressedCache) -> tuple[int, int]:
    """(K/V bytes, everything the cache holds), exactly as cache.memory() counts them, without
    its per-head live counts (cheap enough to call between steps)."""
    kv = sum(layer.kv_bytes() for layer in cache.layers if layer.is_initialized and layer.storage.allocated)
    return kv, cache.kv_meter.state
