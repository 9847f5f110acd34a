"""reasonkv: keep the KV cache of a reasoning LLM small while it writes a long chain of thought."""

from reasonkv.core.cache import CompressedCache
from reasonkv.core.models import DEFAULT_MODEL, UnsupportedModelError, load_model
from reasonkv.methods.api import CacheFactory, compressed_pipeline, generate, install_attention, make_cache
from reasonkv.methods.registry import available_methods, get_method
from reasonkv.methods.resolved import ResolvedMethod, resolve_method
from reasonkv.util.version import package_version

__version__ = package_version()

__all__ = [
    "DEFAULT_MODEL",
    "CacheFactory",
    "CompressedCache",
    "ResolvedMethod",
    "UnsupportedModelError",
    "available_methods",
    "compressed_pipeline",
    "generate",
    "get_method",
    "install_attention",
    "load_model",
    "make_cache",
    "resolve_method",
]
