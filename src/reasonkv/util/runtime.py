"""Process settings for running a model on a CPU: threads, and quiet model loading."""

from __future__ import annotations

import contextlib
import functools
import importlib
import os

import torch

THREADS_ENV = "REASONKV_THREADS"


def env_threads() -> int | None:
    """REASONKV_THREADS as a thread count (None when unset or blank). Anything but a positive
    integer is a one-line ValueError: a typo must not fall back to a default silently."""
    text = os.environ.get(THREADS_ENV, "").strip()
    if not text:
        return None
    if not (text.isascii() and text.isdigit()) or int(text) <= 0:
        raise ValueError(f"{THREADS_ENV} must be a positive integer (torch threads), got {text!r}")
    return int(text)


def set_threads(*, env_only: bool = False) -> int:
    """Set torch's threads to REASONKV_THREADS when set, else to min(4, cores) (the commands'
    default), or, with env_only (load_model's way), leave them as they are. Returns the count
    now in use. Decoding a small model runs many tiny ops, and more threads than free cores
    makes each op wait on the others; on a busy machine REASONKV_THREADS=1 can be several
    times faster."""
    n = env_threads()
    if n is None and not env_only:
        n = min(4, os.cpu_count() or 1)
    if n is not None:
        torch.set_num_threads(n)
    return torch.get_num_threads()


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
