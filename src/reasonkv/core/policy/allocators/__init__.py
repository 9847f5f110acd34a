"""Budget allocators: how many tokens each (layer, KV head) may keep. Pure torch."""

from reasonkv.core.policy.allocators.adakv import AdaKVHeadAllocator
from reasonkv.core.policy.allocators.pyramid import PyramidAllocator
from reasonkv.core.policy.allocators.uniform import UniformAllocator
from reasonkv.core.policy.contract import Allocator

__all__ = ["AdaKVHeadAllocator", "Allocator", "PyramidAllocator", "UniformAllocator"]
