"""`TileLayout` against vLLM's own write op: what it reads is what the op wrote, slot by slot.

The adapter's reads (scoring, H2O's per-step attention) and moves (compaction) go through this
layout, so it is checked directly for both dtypes, the fp8 caches (read dequantised as the kernel
reads them, moved byte for byte), both block sizes the tests and the docs use, and both kernels
this CPU can run (`vec` for head dims divisible by 32, `vec16` otherwise), including the strided
fast paths the common orders take.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="the vLLM adapter's tests run in .venv-vllm: make test-vllm")

import torch  # noqa: E402
from vllm import _custom_ops as ops  # noqa: E402

from reasonkv.serving.vllm.paged_kv import FP8_FORMATS, TileLayout, split_cache  # noqa: E402

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


@pytest.mark.parametrize(("dtype", "block_size", "head_dim", "isa", "kv_dtype"), CASES, ids=str)
def test_read_returns_what_the_engine_wrote_and_move_is_exact(dtype, block_size, head_dim, isa, kv_dtype):
    if kv_dtype != "auto" and not FP8_HERE:
        pytest.skip("vLLM's CPU backend stores fp8 only on x86 with AVX-512 or AMX")
    if isa == "amx" and not AMX_HERE:
        pytest.skip("this CPU has no AMX tiles")
    gen = torch.Generator().manual_seed(0)
    heads, n_blocks, length = 3, 7, 3 * block_size - 5
    stored = dtype if kv_dtype == "auto" else torch.uint8
    # As vLLM holds it: a view into one buffer shared by every layer, past the layers before.
    shape = (n_blocks, heads, block_size, 2 * head_dim)
    size = shape[0] * shape[1] * shape[2] * shape[3]
    buffer = torch.zeros(3 * size, dtype=stored)
    cache = buffer[size : 2 * size].view(shape)
    assert cache.storage_offset() == size
    blocks = torch.tensor([5, 1, 3], dtype=torch.int32)  # out of order, as a pool hands them out
    scales = (1.0, 1.0) if kv_dtype == "auto" else SCALES
    keys = torch.randn(length, heads, head_dim, generator=gen)
    values = torch.randn(length, heads, head_dim, generator=gen)
    if kv_dtype != "auto":  # values an fp8 cache holds exactly (its kernel's rounding is its own)
        fmt = FP8_FORMATS[kv_dtype]
        keys, values = (x.to(fmt).float() * scale for x, scale in zip((keys, values), scales, strict=True))
    keys, values = keys.to(dtype), values.to(dtype)
    j = torch.arange(length)
    slots = blocks[j // block_size].long() * block_size + j % block_size
    key_half, value_half = split_cache(cache)
    ops.cpu_attn_reshape_and_cache(
        keys, values, key_half, value_half, slots, isa,
        k_scale=scales[0], v_scale=scales[1], kv_cache_dtype=kv_dtype,
    )  # fmt: skip
    want_k, want_v = keys.transpose(0, 1), values.transpose(0, 1)

    layout = TileLayout(block_size, head_dim, dtype, isa, kv_dtype)
    read_k, read_v = layout.read(cache, blocks, length, scales=scales)
    assert read_k.dtype == dtype and torch.equal(read_k[0], want_k) and torch.equal(read_v[0], want_v)
    only_k, none = layout.read(cache, blocks, length, values=False, scales=scales)
    assert none is None and torch.equal(only_k, read_k)
    assert torch.equal(layout.read_values(cache, blocks, length, scales[1]), read_v)

    # Compaction: each head keeps its own slots, moved to the first ones, bytes unchanged.
    half = (length + 1) // 2
    kept = torch.stack([
        torch.arange(0, length, 2),  # every other slot
        torch.randperm(length, generator=gen)[:half].sort().values,  # any slots
        torch.arange(length - half, length),  # the last ones: a move onto overlapping slots
    ])  # fmt: skip
    before = cache.clone()
    layout.move(cache, blocks, kept)
    back_k, back_v = layout.read(cache, blocks, kept.shape[1], scales=scales)
    for h in range(heads):
        assert torch.equal(back_k[0, h], want_k[h, kept[h]]) and torch.equal(back_v[0, h], want_v[h, kept[h]])
    untouched = torch.ones(n_blocks, dtype=torch.bool)
    untouched[blocks.long()] = False
    assert torch.equal(cache[untouched], before[untouched])  # other requests' blocks
    assert not buffer[:size].any() and not buffer[2 * size :].any()  # the other layers: never written

    # A move after the slots a step keeps in place (a protected prompt): those are not written.
    first, moved = block_size - 3, cache.clone()  # the moved slots cross a block boundary
    n_kept, n_later = kept.shape[1], (kept.shape[1] - first) // 2
    later = torch.stack([  # each head's own slots >= first, ascending
        first + torch.randperm(n_kept - first, generator=gen)[:n_later].sort().values for _ in range(heads)
    ])  # fmt: skip
    layout.move(cache, blocks, later, first)
    again_k, again_v = layout.read(cache, blocks, first + later.shape[1], scales=scales)
    kept_k, kept_v = layout.read(moved, blocks, kept.shape[1], scales=scales)
    assert torch.equal(again_k[..., :first, :], kept_k[..., :first, :])
    assert torch.equal(again_v[..., :first, :], kept_v[..., :first, :])
    for h in range(heads):
        assert torch.equal(again_k[0, h, first:], kept_k[0, h, later[h]])
        assert torch.equal(again_v[0, h, first:], kept_v[0, h, later[h]])
    assert torch.equal(cache[untouched], before[untouched])
    assert not buffer[:size].any() and not buffer[2 * size :].any()


def test_the_fast_paths_are_the_orders_this_cpu_uses():
    """`vec` keeps keys [head dim, block] and values [block, head dim] in a tile: both read as views.
    (Should vLLM change a kernel's order, the gather path still reads it; this says which ran.)"""
    layout = TileLayout(32, 64, torch.float32, "vec")
    assert (layout.key_view, layout.value_view) == ("channels", "tokens")


def test_a_cache_whose_tiles_are_not_one_run_is_refused():
    """Compaction computes each element's offset from the tile layout: a cache laid out any other
    way (here each tile's elements transposed, or blocks of another size) is an error, never a
    write to the wrong elements."""
    layout = TileLayout(32, 64, torch.float32, "vec")
    slots = torch.arange(4).expand(2, 4)
    transposed = torch.zeros(3, 2, 128, 32).transpose(2, 3)
    with pytest.raises(ValueError, match="contiguous elements"):
        layout.move(transposed, torch.tensor([0], dtype=torch.int32), slots)
    other_blocks = torch.zeros(3, 2, 16, 128)
    with pytest.raises(ValueError, match="tiles of 32 x 128"):
        layout.move(other_blocks, torch.tensor([0], dtype=torch.int32), slots)
