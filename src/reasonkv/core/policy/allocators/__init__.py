"""Budget allocators: how many tokens each (layer, KV head) may keep. Pure torch."""

from reasonkv.core.policy.allocators.adakv import AdaKVHeadAllocator
from reasonkv.core.policy.allocators.pyramid import PyramidAllocator
from reasonkv.core.policy.allocators.uniform import Allocator, UniformAllocator

__all__ = ["AdaKVHeadAllocator", "Allocator", "PyramidAllocator", "UniformAllocator"]
