"""Reading and compacting one request's K/V in vLLM's CPU paged cache.

The CPU backend keeps one tensor per layer, [blocks, KV heads, block size, 2 x head dim], viewed
as a key half and a value half of [blocks, KV heads, block size, head dim] each. Inside one
(block, head) tile the kernels may store a token's channels in their own order (the `vec`
kernels keep keys transposed, [head dim, block size]; AMX and NEON builds differ again), so the
order is not assumed: `TileLayout` learns it once by writing probe values with vLLM's own write
op and reading where they landed. Reads go through that map (dequantised from an fp8 cache by
the layer's scale); compaction moves the stored elements through it, so an fp8 cache's bytes
move unchanged (no second rounding) and a 16/32-bit one's values move exactly too.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from vllm import _custom_ops as ops

FP8_FORMATS = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
"""vLLM's fp8 KV cache dtypes and the format of the bytes the CPU backend stores (uint8 tensors)."""

# Probe values are digits below this, exact in the type the cache holds: integers to 255 in
# bf16/fp16/fp32, to 8 in e5m2 (2 mantissa bits).
PROBE_RADIX = {"auto": 64, "fp8": 8}

# An integer type of each element size: compaction moves raw elements, whatever they encode, and
# a strided read copies a run of contiguous elements as one wider element (up to 8 bytes).
RAW_BY_ITEMSIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def split_cache(kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The key and value halves of one layer's CPU cache, as the backend views them."""
    blocks, heads, block_size, _ = kv_cache.shape
    return kv_cache.view(blocks, heads, 2 * block_size, -1).chunk(2, dim=2)


def digits(size: int, radix: int) -> int:
    """Digits of base `radix` that tell apart the integers below `size`."""
    n = 1
    while radix**n < size:
        n += 1
    return n


@dataclass(frozen=True)
class BitView:
    """A tile order that only permutes the bits of the logical index t * D + d (sizes powers of
    two): the tile, as runs of `wide` elements (`ratio` of its own each), viewed as `tile_dims`
    and permuted by `logical_dims` (offset by the dims before the tile's) is the tile in logical
    order."""

    wide: torch.dtype
    ratio: int
    tile_dims: tuple[int, ...]
    logical_dims: tuple[int, ...]


def bit_view(order: torch.Tensor, itemsize: int, head_dim: int) -> BitView | None:
    """The strided view that reads a tile in logical order, when `order` (the tile position of
    each logical element) moves bits only; None for any other order."""
    n = order.numel()
    bits = n.bit_length() - 1
    if n < 2 or 1 << bits != n:
        return None
    where = []  # the tile bit each logical bit lands on
    for i in range(bits):
        p = int(order[1 << i])
        if p <= 0 or p & (p - 1):
            return None
        where.append(p.bit_length() - 1)
    logical = torch.arange(n)
    if not torch.equal(order, sum(((logical >> i) & 1) << w for i, w in enumerate(where))):
        return None
    # Runs of logical bits that land on consecutive tile bits, lowest first: (tile bit, bits).
    runs: list[list[int]] = []
    for i, w in enumerate(where):
        if runs and where[i - 1] + 1 == w:
            runs[-1][1] += 1
        else:
            runs.append([w, 1])
    # The lowest run, where it is the tile's lowest bits too, is copied as wider elements.
    wide_bits = 0
    if runs[0][0] == 0:
        wide_bits = min(runs[0][1], (8 // itemsize).bit_length() - 1, head_dim.bit_length() - 1)
        runs[0] = [wide_bits, runs[0][1] - wide_bits]
        if runs[0][1] == 0:
            runs.pop(0)
    by_tile = sorted(range(len(runs)), key=lambda r: -runs[r][0])  # the tile's dims, outermost first
    tile_dims = tuple(1 << runs[r][1] for r in by_tile)
    logical_dims = tuple(3 + by_tile.index(r) for r in reversed(range(len(runs))))
    return BitView(RAW_BY_ITEMSIZE[itemsize << wide_bits], 1 << wide_bits, tile_dims, logical_dims)


class TileLayout:
    """Where token t's channel d of one (block, head) tile lies, for keys and for values, in a
    cache of the model's `dtype` or of one of the `FP8_FORMATS` (`kv_cache_dtype`)."""

    def __init__(
        self, block_size: int, head_dim: int, dtype: torch.dtype, isa: str, kv_cache_dtype: str = "auto"
    ) -> None:
        if kv_cache_dtype != "auto" and kv_cache_dtype not in FP8_FORMATS:
            raise ValueError(
                f"reasonkv reads kv_cache_dtype 'auto' or {sorted(FP8_FORMATS)}, not {kv_cache_dtype!r}"
            )
        self.block_size, self.head_dim, self.isa = block_size, head_dim, isa
        self.dtype, self.kv_cache_dtype = dtype, kv_cache_dtype
        self.stored = FP8_FORMATS.get(kv_cache_dtype)  # None: the model's dtype
        radix = PROBE_RADIX["auto" if self.stored is None else "fp8"]
        n = block_size * head_dim
        token = torch.arange(block_size)[:, None].expand(block_size, head_dim).reshape(-1)
        channel = torch.arange(head_dim)[None, :].expand(block_size, head_dim).reshape(-1)
        found = []
        for half in (0, 1):  # keys, values
            source = torch.zeros(n, dtype=torch.long)
            for index, weight, size in ((token, head_dim, block_size), (channel, 1, head_dim)):
                for digit in range(digits(size, radix)):
                    value = (index // radix**digit) % radix
                    landed = self._probe(value.view(block_size, head_dim).to(dtype), half)
                    source += landed.round().long() * radix**digit * weight
            if not torch.equal(source.sort().values, torch.arange(n)):
                raise RuntimeError(
                    f"vLLM's CPU cache layout (isa {isa!r}, {kv_cache_dtype}) could not be read: "
                    "not a permutation"
                )
            found.append(source.argsort())  # tile position of logical element t * D + d
        self.key_order, self.value_order = found
        # [2, block size, head dim]: where token t's channels lie in a (block, head) tile's keys
        # (0) and values (1), counted from the tile's first key element: a move's offsets.
        self.token_offsets = torch.stack(
            [found[0].view(block_size, head_dim), found[1].view(block_size, head_dim) + n]
        )
        # A tile order that permutes the bits of (token, channel) reads as a strided view (one
        # copy of runs as wide as it keeps) instead of a gather over every element.
        itemsize = dtype.itemsize if self.stored is None else 1  # fp8 is stored as bytes
        self.key_view, self.value_view = (bit_view(order, itemsize, head_dim) for order in found)

    def _probe(self, tile: torch.Tensor, half: int) -> torch.Tensor:
        """Write `tile` [block size, head dim] as one block of keys (half 0) or values (1) of
        one head and return the tile's storage, flat, as floats."""
        storage = tile.dtype if self.stored is None else torch.uint8
        cache = torch.zeros(1, 1, self.block_size, 2 * self.head_dim, dtype=storage)
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
            kv_cache_dtype=self.kv_cache_dtype,
        )
        return self._as_numbers(keys if half == 0 else values).reshape(-1).float()

    def _as_numbers(self, stored: torch.Tensor) -> torch.Tensor:
        """Stored elements as the numbers they encode (fp8 bytes viewed as their format)."""
        return stored if self.stored is None else stored.contiguous().view(self.stored)

    def read(
        self,
        kv_cache: torch.Tensor,
        table: torch.Tensor,
        length: int,
        values: bool = True,
        scales: tuple[float, float] = (1.0, 1.0),
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The first `length` slots of each row (a request) whose block ids are the rows of
        `table` [R, blocks] (any block past a row's own: its slots are read and not used): keys
        and values [R, KV heads, length, head dim] in the model's dtype (an fp8 cache's times
        the layer's `scales`, as its kernel reads them), copies in slot order (values None
        unless asked). One read for every row."""
        keys = self._read_half(
            split_cache(kv_cache)[0], table, length, self.key_order, self.key_view, scales[0]
        )
        return keys, (self.read_values(kv_cache, table, length, scales[1]) if values else None)

    def read_values(
        self, kv_cache: torch.Tensor, table: torch.Tensor, length: int, scale: float = 1.0
    ) -> torch.Tensor:
        """The values alone, as `read` gives them (for a step that has read the keys already)."""
        value_half = split_cache(kv_cache)[1]
        return self._read_half(value_half, table, length, self.value_order, self.value_view, scale)

    def _read_half(
        self,
        half: torch.Tensor,
        table: torch.Tensor,
        length: int,
        order: torch.Tensor,
        view: BitView | None,
        scale: float,
    ) -> torch.Tensor:
        n = (length + self.block_size - 1) // self.block_size
        table = table[:, :n].to(half.device, torch.long)
        rows, heads, bs, d = table.shape[0], half.shape[1], self.block_size, self.head_dim
        # Wider elements need every stride and the offset in whole wide elements (vLLM's are).
        strides = (half.storage_offset(), *half.stride()[:-1])
        if view is not None and all(x % view.ratio == 0 for x in strides):
            tiles = half.view(view.wide).view(-1, heads, *view.tile_dims).index_select(0, table.reshape(-1))
            tiles = tiles.view(rows, n, heads, *view.tile_dims).permute(0, 2, 1, *view.logical_dims)
            # Into fresh storage of canonical strides: the dtype view below needs a unit last stride.
            out = torch.empty((rows, heads, n, *tiles.shape[3:]), dtype=view.wide, device=half.device)
            flat = out.copy_(tiles).view(rows, heads, n * bs, d // view.ratio).view(half.dtype)
        else:
            tiles = half[table.reshape(-1)]  # [R * n, H, bs, D] as stored (a copy)
            tiles = tiles.reshape(rows * n, heads, -1)[..., order].view(rows * n, heads, bs, d)
            # [R, H, n * bs, D] in slot order
            flat = tiles.reshape(rows, n, heads, bs, d).transpose(1, 2).reshape(rows, heads, n * bs, d)
        flat = flat[:, :, :length]
        if self.stored is not None:  # decoded and scaled in fp32, then the model's dtype
            flat = (flat.view(self.stored).float() * scale).to(self.dtype)
        return flat

    def compact(
        self,
        kv_cache: torch.Tensor,
        table: torch.Tensor,
        slots: torch.Tensor,
        kept: list[int],
        read: tuple[torch.Tensor, torch.Tensor],
    ) -> None:
        """Compaction of every row (a request) at once: row r's kept `slots[r]` [H, K]
        (ascending) into its slots 0 .. kept[r] - 1, keys and values; `table` [R, blocks] holds
        each row's block ids and `read` the rows' keys and values as `read` gave them.

        A cache of the model's dtype holds exactly what was read: the kept tokens are taken
        from `read` and written back with vLLM's own write op (a token slot that every head
        keeps in place is not written). An fp8 cache's bytes are moved instead (`move`): no
        second rounding. Measured: docs/performance.md."""
        if self.stored is not None:
            self.move(kv_cache, table, slots, kept)
            return
        rows, heads, k = slots.shape
        keys, values = read
        length, device = keys.shape[2], keys.device
        slots = slots.to(device)
        j = torch.arange(k, device=device)
        # Flat row indices into [R * H * T, D]: one index_select, far faster than an expanded gather.
        flat = (
            slots.clamp(max=length - 1)
            + torch.arange(rows * heads, device=device).view(rows, heads, 1) * length
        )
        flat = flat.flatten()
        kept_k, kept_v = (
            x.reshape(-1, self.head_dim)
            .index_select(0, flat)
            .view(rows, heads, k, -1)
            .transpose(1, 2)
            .reshape(rows * k, heads, -1)
            for x in (keys, values)
        )
        table = table.to(device, torch.long)
        mapping = (
            table.gather(1, (j // self.block_size).expand(rows, k)) * self.block_size + j % self.block_size
        )
        written = (j < torch.tensor(kept, device=device)[:, None]) & (slots != j).any(1)  # [R, K]
        mapping = mapping.masked_fill(~written, -1).flatten()  # -1: the write op skips the token
        key_half, value_half = split_cache(kv_cache)
        ops.cpu_attn_reshape_and_cache(
            kept_k, kept_v, key_half, value_half, mapping, self.isa,
            k_scale=1.0, v_scale=1.0, kv_cache_dtype=self.kv_cache_dtype,
        )  # fmt: skip

    def move(self, kv_cache: torch.Tensor, table: torch.Tensor, slots: torch.Tensor, kept: list[int]) -> None:
        """Compaction of every row (a request) at once: row r's kept `slots[r]` [H, K]
        (ascending) into its slots 0 .. kept[r] - 1, keys and values, as stored (raw elements:
        exact for every cache dtype); `table` [R, blocks] holds each row's block ids. A slot
        that keeps its token (slots[r, h, k] == k) is not written, nor is anything past kept[r].

        One gather and one scatter over the layer's cache as a flat run of raw elements, each
        element's offset taken from per-token tables: half the time of indexing the
        [blocks, heads, tile] view over three broadcast axes, and one pair of ops for all the
        requests of a step (docs/performance.md)."""
        rows, heads, k = slots.shape
        bs, d = self.block_size, self.head_dim
        if kv_cache.shape[2:] != (bs, 2 * d) or kv_cache.stride()[2:] != (2 * d, 1):
            # The offsets assume this layout's tiles, each one run of elements.
            raise ValueError(
                f"reasonkv moves K/V in (block, head) tiles of {bs} x {2 * d} contiguous elements, "
                f"not of shape {tuple(kv_cache.shape[2:])} with strides {kv_cache.stride()[2:]}"
            )
        device = kv_cache.device
        raw = kv_cache.view(RAW_BY_ITEMSIZE[kv_cache.element_size()])
        flat = raw.as_strided((raw.untyped_storage().nbytes() // raw.element_size(),), (1,), 0)
        starts = raw.storage_offset() + table.to(device, torch.long) * raw.stride(0)  # [R, blocks]
        slots = slots.to(device)
        j = torch.arange(k, device=device).expand(rows, heads, k)
        kept = torch.tensor(kept, device=device)
        moves = ((j < kept[:, None, None]) & (slots != j)).flatten().nonzero().squeeze(1)  # of R * H * K
        row, head, dst = moves // (heads * k), (moves // k) % heads * raw.stride(1), moves % k
        src = slots.flatten()[moves]
        offsets = self.token_offsets.to(device)  # [2, bs, D]
        src = (starts[row, src // bs] + head)[None, :, None] + offsets[:, src % bs]  # [2, moves, D]
        dst = (starts[row, dst // bs] + head)[None, :, None] + offsets[:, dst % bs]
        flat[dst.reshape(-1)] = flat[src.reshape(-1)]  # read in full, then written
