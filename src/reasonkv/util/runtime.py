"""Process settings for running a model on a CPU: threads, and quiet model loading."""

from __future__ import annotations

import contextlib
import functools
import importlib
import os

import torch


def set_threads() -> int:
    """Use min(4, cores) threads, or REASONKV_THREADS when set. Decoding a small model runs
    many tiny ops, and more threads than free cores makes each op wait on the others; on a
    busy machine REASONKV_THREADS=1 can be several times faster."""
    env = os.environ.get("REASONKV_THREADS", "").strip()
    n = int(env) if env.isdigit() and int(env) > 0 else min(4, os.cpu_count() or 1)
    torch.set_num_threads(n)
    return n


@contextlib.contextmanager
def quiet_loading():
    """Hide transformers' progress bars while a model loads (the GGUF de-quantisation bar is a
    bare tqdm, reachable only through that module's name), so the CLI's own output stays readable."""
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        gguf_utils = importlib.import_module("transformers.modeling_gguf_pytorch_utils")
    except ImportError:  # pragma: no cover - gguf support absent: nothing to hide
        gguf_utils = None
    original = getattr(gguf_utils, "tqdm", None)
    if original is not None:
        gguf_utils.tqdm = functools.partial(original, disable=True)
    try:
        yield
    finally:
        if original is not None:
            gguf_utils.tqdm = original
        if was_enabled:
            hf_logging.enable_progress_bar()
