"""reasonkv: keep the KV cache of a reasoning LLM small while it writes a long chain of thought."""

from importlib import metadata as _metadata

from reasonkv.core.cache import CompressedCache
from reasonkv.core.models import DEFAULT_MODEL, UnsupportedModelError, load_model
from reasonkv.methods.api import generate, install_attention, make_cache
from reasonkv.methods.registry import available_methods, get_method

try:  # one source of truth: the version pyproject.toml gave the installed package
    __version__ = _metadata.version("reasonkv")
except _metadata.PackageNotFoundError:  # imported from a source tree that was never installed
    __version__ = "0+unknown"

__all__ = [
    "DEFAULT_MODEL",
    "CompressedCache",
    "UnsupportedModelError",
    "available_methods",
    "generate",
    "get_method",
    "install_attention",
    "load_model",
    "make_cache",
]
