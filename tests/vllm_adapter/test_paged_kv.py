"""`TileLayout` against vLLM's own write op: what it reads is what the op wrote, slot by slot.

The adapter's reads (scoring, H2O's per-step attention) and moves (compaction) go through this
layout, so it is checked directly for both dtypes, the fp8 caches (read dequantised as the kernel
reads them, moved byte for byte), both block sizes the tests and the docs use, and both kernels
this CPU can run (`vec` for head dims divisible by 32, `vec16` otherwise), including the strided
views the bit-permuted orders take.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="the vLLM adapter's tests run in .venv-vllm: make test-vllm")

import torch  # noqa: E402
from vllm import _custom_ops as ops  # noqa: E402

from reasonkv.serving.vllm.paged_kv import FP8_FORMATS, TileLayout, bit_view, split_cache  # noqa: E402

CASES = [
    (torch.bfloat16, 128, 64, "vec", "auto"),
    (torch.float32, 32, 64, "vec", "auto"),
    (torch.bfloat16, 32, 80, "vec16", "auto"),
    (torch.float32, 16, 48, "vec16", "auto"),
    (torch.float32, 32, 64, "vec", "fp8"),
    (torch.bfloat16, 32, 64, "vec", "fp8_e4m3"),
    (torch.float32, 64, 64, "vec", "fp8_e5m2"),
    (torch.bfloat16, 128, 64, "amx", "auto"),  # what the default model runs with on an AMX CPU
    (torch.bfloat16, 32, 64, "amx", "fp8"),
]
SCALES = (0.5, 2.0)  # the layer's k_scale, v_scale: an fp8 read multiplies by them


FP8_HERE = torch.cpu._is_avx512_supported() or torch.cpu._is_amx_tile_supported()
AMX_HERE = torch.cpu._is_amx_tile_supported()


def kept_slots(length: int, gen: torch.Generator) -> torch.Tensor:
    """[3, K]: each head keeps its own half of `length` slots, ascending."""
    half = (length + 1) // 2
    return torch.stack([
        torch.arange(0, length, 2)[:half],  # every other slot
        torch.randperm(length, generator=gen)[:half].sort().values,  # any slots
        torch.arange(length - half, length),  # the last ones: a move onto overlapping slots
    ])  # fmt: skip


@pytest.mark.parametrize(("dtype", "block_size", "head_dim", "isa", "kv_dtype"), CASES, ids=str)
def test_read_returns_what_the_engine_wrote_and_move_is_exact(dtype, block_size, head_dim, isa, kv_dtype):
    """Two requests of other lengths and blocks, read in one call and compacted in one call."""
    if kv_dtype != "auto" and not FP8_HERE:
        pytest.skip("vLLM's CPU backend stores fp8 only on x86 with AVX-512 or AMX")
    if isa == "amx" and not AMX_HERE:
        pytest.skip("this CPU has no AMX tiles")
    gen = torch.Generator().manual_seed(0)
    heads, n_blocks = 3, 7
    lengths = [3 * block_size - 5, 2 * block_size - 7]
    stored = dtype if kv_dtype == "auto" else torch.uint8
    # As vLLM holds it: a view into one buffer shared by every layer, past the layers before.
    shape = (n_blocks, heads, block_size, 2 * head_dim)
    size = shape[0] * shape[1] * shape[2] * shape[3]
    buffer = torch.zeros(3 * size, dtype=stored)
    cache = buffer[size : 2 * size].view(shape)
    assert cache.storage_offset() == size
    # Out of order, as a pool hands them out; the shorter row padded with its own last block.
    table = torch.tensor([[5, 1, 3], [0, 6, 6]], dtype=torch.int32)
    scales = (1.0, 1.0) if kv_dtype == "auto" else SCALES
    key_half, value_half = split_cache(cache)
    want = []
    for row, length in enumerate(lengths):
        keys = torch.randn(length, heads, head_dim, generator=gen)
        values = torch.randn(length, heads, head_dim, generator=gen)
        if kv_dtype != "auto":  # values an fp8 cache holds exactly (its kernel's rounding is its own)
            fmt = FP8_FORMATS[kv_dtype]
            keys, values = (x.to(fmt).float() * sc for x, sc in zip((keys, values), scales, strict=True))
        keys, values = keys.to(dtype), values.to(dtype)
        j = torch.arange(length)
        slots = table[row, j // block_size].long() * block_size + j % block_size
        ops.cpu_attn_reshape_and_cache(
            keys, values, key_half, value_half, slots, isa,
            k_scale=scales[0], v_scale=scales[1], kv_cache_dtype=kv_dtype,
        )  # fmt: skip
        want.append((keys.transpose(0, 1), values.transpose(0, 1)))

    layout = TileLayout(block_size, head_dim, dtype, isa, kv_dtype)
    read_k, read_v = layout.read(cache, table, max(lengths), scales=scales)
    assert read_k.dtype == dtype and read_k.shape == (2, heads, max(lengths), head_dim)
    for row, length in enumerate(lengths):
        assert torch.equal(read_k[row, :, :length], want[row][0])
        assert torch.equal(read_v[row, :, :length], want[row][1])
    only_k, none = layout.read(cache, table, max(lengths), values=False, scales=scales)
    assert none is None and torch.equal(only_k, read_k)
    assert torch.equal(layout.read_values(cache, table, max(lengths), scales[1]), read_v)

    # Compaction: each head of each row keeps its own slots, moved to its first ones, bytes unchanged.
    kept = [kept_slots(length, gen) for length in lengths]
    counts = [k.shape[1] for k in kept]
    slots = torch.stack(
        [torch.nn.functional.pad(k, (0, max(counts) - k.shape[1]), value=10**6) for k in kept]
    )
    before = cache.clone()
    by_bytes = cache.clone()
    layout.move(by_bytes, table, slots, counts)  # what an fp8 cache takes
    layout.compact(cache, table, slots, counts, (read_k, read_v))  # written back where it can be
    assert torch.equal(by_bytes, cache)
    back_k, back_v = layout.read(cache, table, max(counts), scales=scales)
    for row in range(2):
        for h in range(heads):
            picked = kept[row][h]
            assert torch.equal(back_k[row, h, : counts[row]], want[row][0][h, picked])
            assert torch.equal(back_v[row, h, : counts[row]], want[row][1][h, picked])
    untouched = torch.ones(n_blocks, dtype=torch.bool)
    untouched[table.long().flatten()] = False
    assert untouched.any() and torch.equal(cache[untouched], before[untouched])  # other requests' blocks
    assert not buffer[:size].any() and not buffer[2 * size :].any()  # the other layers: never written

    # Slots that keep their token (slot k == k: a protected prompt) stay: the first `first` of
    # row 0 stay, the others move, across a block boundary.
    first, moved = block_size - 3, cache.clone()
    n_later = (counts[0] - first) // 2
    moving = [
        first + torch.randperm(counts[0] - first, generator=gen)[:n_later].sort().values for _ in range(heads)
    ]
    later = torch.stack([torch.cat([torch.arange(first), m]) for m in moving])
    read = layout.read(cache, table[:1], counts[0], scales=scales)
    layout.compact(cache, table[:1], later[None], [first + n_later], read)
    again_k, again_v = layout.read(cache, table[:1], first + n_later, scales=scales)
    kept_k, kept_v = layout.read(moved, table[:1], counts[0], scales=scales)
    assert torch.equal(again_k[..., :first, :], kept_k[..., :first, :])
    for h in range(heads):
        assert torch.equal(again_k[0, h, first:], kept_k[0, h, later[h, first:]])
        assert torch.equal(again_v[0, h, first:], kept_v[0, h, later[h, first:]])
    assert torch.equal(cache[untouched], before[untouched])
    assert not buffer[:size].any() and not buffer[2 * size :].any()


def test_the_fast_paths_are_the_orders_this_cpu_uses():
    """`vec` keeps keys [head dim, block] and values [block, head dim] in a tile, AMX pairs of
    channels (keys) or of tokens (values) in 16-token groups: each only moves the bits of the
    logical index, so each reads as a strided view (runs of 8 bytes, 4, 2 or 1 element). A head dim
    that is not a power of two takes the gather. (Should vLLM change a kernel's order, the gather
    path still reads it; this says which ran.)"""
    vec = TileLayout(32, 64, torch.float32, "vec")
    assert (vec.key_view.wide, vec.key_view.tile_dims, vec.value_view.wide) == (
        torch.int32,
        (64, 32),
        torch.int64,
    )
    assert TileLayout(32, 80, torch.bfloat16, "vec16").key_view is None
    if AMX_HERE:
        amx = TileLayout(128, 64, torch.bfloat16, "amx")
        assert (amx.key_view.wide, amx.key_view.tile_dims) == (torch.int32, (8, 32, 16))
        assert (amx.value_view.wide, amx.value_view.tile_dims) == (torch.int16, (4, 64, 16, 2))


@pytest.mark.parametrize(("pad", "offset"), [(0, 0), (6, 0), (0, 1), (6, 3)])
def test_a_read_through_a_view_equals_the_gather_whatever_the_cache_strides(pad, offset):
    """A cache whose blocks are padded or that starts at an odd element (strides not whole wide
    elements) reads through the gather; either way every read equals the gather's."""
    layout = TileLayout(32, 64, torch.float32, "vec")  # values: token-major, read as int64 pairs
    heads, blocks, tile = 2, 6, 2 * 32 * 64
    buffer = torch.randn(offset + blocks * heads * (tile + pad))
    cache = buffer[offset:].view(blocks, heads, tile + pad)[:, :, :tile].unflatten(2, (64, 64))
    table = torch.tensor([[0, 2, 4], [1, 3, 5]])
    for half, order, view in (
        (0, layout.key_order, layout.key_view),
        (1, layout.value_order, layout.value_view),
    ):
        part = split_cache(cache)[half]
        for length in (1, 33, 95):
            got = layout._read_half(part, table, length, order, view, 1.0)
            assert torch.equal(got, layout._read_half(part, table, length, order, None, 1.0))


@pytest.mark.parametrize("itemsize", [1, 2, 4])
def test_a_bit_view_reads_any_bit_permuted_tile_as_the_gather_does(itemsize):
    """Random permutations of the index bits of tiles of 4..128 tokens x 4..128 channels: the view
    gives each logical element where the gather does; an order that is not a bit permutation
    has no view."""
    gen = torch.Generator().manual_seed(itemsize)
    dtype = {1: torch.uint8, 2: torch.bfloat16, 4: torch.float32}[itemsize]
    for _ in range(40):
        block, dim = (2 ** int(torch.randint(2, 8, (1,), generator=gen)) for _ in range(2))
        bits = (block * dim).bit_length() - 1
        moved = torch.randperm(bits, generator=gen).tolist()
        logical = torch.arange(block * dim)
        order = sum(((logical >> i) & 1) << moved[i] for i in range(bits))
        view = bit_view(order, itemsize, dim)
        tile = torch.randint(0, 100, (block * dim,)).to(dtype)
        tiles = tile.view(1, 1, block, dim).view(view.wide).view(1, 1, 1, *view.tile_dims)
        read = tiles.permute(0, 2, 1, *view.logical_dims).reshape(block, -1).contiguous().view(dtype)
        assert torch.equal(read, tile[order].view(block, dim)), (block, dim, moved)
    swapped = torch.arange(64)
    swapped[[1, 2]] = swapped[[2, 1]]  # a transposition of two elements moves no bit
    assert bit_view(swapped, itemsize, 8) is None


def test_a_cache_whose_tiles_are_not_one_run_is_refused():
    """Compaction computes each element's offset from the tile layout: a cache laid out any other
    way (here each tile's elements transposed, or blocks of another size) is an error, never a
    write to the wrong elements."""
    layout = TileLayout(32, 64, torch.float32, "vec")
    slots = torch.arange(4).expand(1, 2, 4)
    transposed = torch.zeros(3, 2, 128, 32).transpose(2, 3)
    with pytest.raises(ValueError, match="contiguous elements"):
        layout.move(transposed, torch.tensor([[0]], dtype=torch.int32), slots, [4])
    other_blocks = torch.zeros(3, 2, 16, 128)
    with pytest.raises(ValueError, match="tiles of 32 x 128"):
        layout.move(other_blocks, torch.tensor([[0]], dtype=torch.int32), slots, [4])
