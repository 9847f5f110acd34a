"""Budget allocators: how many tokens each (layer, KV head) may keep. Pure torch."""

from reasonkv.budgets.adakv import AdaKVHeadAllocator
from reasonkv.budgets.pyramid import PyramidAllocator
from reasonkv.budgets.uniform import Allocator, UniformAllocator

__all__ = ["AdaKVHeadAllocator", "Allocator", "PyramidAllocator", "UniformAllocator"]
