"""Budget allocators: how many tokens each (layer, KV head) may keep. Pure torch."""

from reasonkv.budgets.uniform import Allocator, UniformAllocator

__all__ = ["Allocator", "UniformAllocator"]
