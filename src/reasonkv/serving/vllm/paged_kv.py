"""Reading and compacting one request's K/V in vLLM's CPU paged cache.

The CPU backend keeps one tensor per layer, [blocks, KV heads, block size, 2 x head dim], viewed
as a key half and a value half of [blocks, KV heads, block size, head dim] each. Inside one
(block, head) tile the kernels may store a token's channels in their own order (the `vec`
kernels keep keys transposed, [head dim, block size]; AMX and NEON builds differ again), so the
order is not assumed: `TileLayout` learns it once by writing probe values with vLLM's own write
op and reading where they landed. Reads go through that map; writes go through the op itself.
"""

from __future__ import annotations

import torch
from vllm import _custom_ops as ops

PROBE_RADIX = 64
"""Probe values are digits below this, exact in every float type the cache may hold."""


def split_cache(kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The key and value halves of one layer's CPU cache, as the backend views them."""
    blocks, heads, block_size, _ = kv_cache.shape
    return kv_cache.view(blocks, heads, 2 * block_size, -1).chunk(2, dim=2)


class TileLayout:
    """Where token t's channel d of one (block, head) tile lies, for keys and for values."""

    def __init__(self, block_size: int, head_dim: int, dtype: torch.dtype, isa: str) -> None:
        self.block_size, self.head_dim, self.isa = block_size, head_dim, isa
        n = block_size * head_dim
        token = torch.arange(block_size)[:, None].expand(block_size, head_dim).reshape(-1)
        channel = torch.arange(head_dim)[None, :].expand(block_size, head_dim).reshape(-1)
        found = []
        for half in (0, 1):  # keys, values
            source = torch.zeros(n, dtype=torch.long)
            for index, weight in ((token, head_dim), (channel, 1)):
                for digit in range(2):
                    value = (index // PROBE_RADIX**digit) % PROBE_RADIX
                    landed = self._probe(value.view(block_size, head_dim).to(dtype), half)
                    source += landed.round().long() * PROBE_RADIX**digit * weight
            if not torch.equal(source.sort().values, torch.arange(n)):
                raise RuntimeError(
                    f"vLLM's CPU cache layout (isa {isa!r}) could not be read: not a permutation"
                )
            found.append(source.argsort())  # tile position of logical element t * D + d
        self.key_order, self.value_order = found
        # The common tile orders read as a strided view instead of a gather over every element.
        self.key_view, self.value_view = (self._view_kind(order) for order in found)

    def _view_kind(self, order: torch.Tensor) -> str:
        """'tokens' ([block, D] in the tile), 'channels' ([D, block]) or 'gather' (any other)."""
        n = self.block_size * self.head_dim
        if torch.equal(order, torch.arange(n)):
            return "tokens"
        if torch.equal(order, torch.arange(n).view(self.head_dim, self.block_size).t().reshape(-1)):
            return "channels"
        return "gather"

    def _probe(self, tile: torch.Tensor, half: int) -> torch.Tensor:
        """Write `tile` [block size, head dim] as one block of keys (half 0) or values (1) of
        one head and return the tile's storage, flat, as floats."""
        cache = torch.zeros(1, 1, self.block_size, 2 * self.head_dim, dtype=tile.dtype)
        keys, values = split_cache(cache)
        zeros = torch.zeros_like(tile)
        k, v = (tile, zeros) if half == 0 else (zeros, tile)
        slots = torch.arange(self.block_size)
        ops.cpu_attn_reshape_and_cache(
            k[:, None],
            v[:, None],
            keys,
            values,
            slots,
            self.isa,
            k_scale=1.0,
            v_scale=1.0,
            kv_cache_dtype="auto",
        )
        return (keys if half == 0 else values).reshape(-1).float()

    def read(
        self, kv_cache: torch.Tensor, blocks: torch.Tensor, length: int, values: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The first `length` slots of a request whose block ids are `blocks`: keys and values
        [1, KV heads, length, head dim], copies in slot order (values None unless asked)."""
        key_half, value_half = split_cache(kv_cache)
        n = (length + self.block_size - 1) // self.block_size
        keys = self._read_half(key_half, blocks[:n], length, self.key_order, self.key_view)
        return keys, (self.read_values(kv_cache, blocks, length) if values else None)

    def read_values(self, kv_cache: torch.Tensor, blocks: torch.Tensor, length: int) -> torch.Tensor:
        """The values alone, as `read` gives them (for a step that has read the keys already)."""
        n = (length + self.block_size - 1) // self.block_size
        value_half = split_cache(kv_cache)[1]
        return self._read_half(value_half, blocks[:n], length, self.value_order, self.value_view)

    def _read_half(
        self, half: torch.Tensor, blocks: torch.Tensor, length: int, order: torch.Tensor, kind: str
    ) -> torch.Tensor:
        n, heads, bs, d = blocks.numel(), half.shape[1], self.block_size, self.head_dim
        tiles = half[blocks]  # [n, H, bs, D] as stored (a copy)
        if kind == "channels":
            tiles = tiles.reshape(n, heads, d, bs).transpose(-1, -2)
        elif kind == "gather":
            tiles = tiles.reshape(n, heads, -1)[..., order].view(n, heads, bs, d)
        flat = tiles.transpose(0, 1).reshape(heads, n * bs, d)  # [H, n * bs, D] in slot order
        return flat[None, :, :length]

    def write(
        self, kv_cache: torch.Tensor, blocks: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, layer
    ) -> None:
        """Write keys and values [KV heads, K, head dim] into the request's first K slots."""
        key_half, value_half = split_cache(kv_cache)
        k = keys.shape[1]
        j = torch.arange(k)
        slots = blocks[j // self.block_size].long() * self.block_size + j % self.block_size
        ops.cpu_attn_reshape_and_cache(
            keys.transpose(0, 1).contiguous(),
            values.transpose(0, 1).contiguous(),
            key_half,
            value_half,
            slots,
            self.isa,
            k_scale=layer._k_scale_float,
            v_scale=layer._v_scale_float,
            kv_cache_dtype="auto",
        )
