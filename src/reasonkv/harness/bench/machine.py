"""Machine facts saved with every benchmark: numbers from different machines stay apart."""

from __future__ import annotations

import contextlib
import os
import platform
from pathlib import Path

import torch


def machine_info() -> dict:
    """Where the numbers come from: CPU, cores, load, threads, versions."""
    import transformers

    cpu = platform.processor()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    mem_total = None
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal"):
                mem_total = int(line.split()[1]) * 1024
    try:
        from importlib.metadata import version

        ours = version("reasonkv")
    except Exception:  # running from a source tree without metadata
        ours = None
    return {
        "platform": platform.platform(),
        "cpu": cpu,
        "cores": os.cpu_count(),
        "memory_bytes": mem_total,
        "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "reasonkv": ours,
    }
