"""`TileLayout` against vLLM's own write op: what it reads is what the op wrote, slot by slot.

The adapter's reads (scoring, H2O's per-step attention) and writes (compaction) go through this
layout, so it is checked directly for both dtypes, both block sizes the tests and the docs use,
and both kernels this CPU can run (`vec` for head dims divisible by 32, `vec16` otherwise),
including the strided fast paths the common orders take.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="the vLLM adapter's tests run in .venv-vllm: make test-vllm")

import torch  # noqa: E402
from vllm import _custom_ops as ops  # noqa: E402

from reasonkv.serving.vllm.paged_kv import TileLayout, split_cache  # noqa: E402

CASES = [
    (torch.bfloat16, 128, 64, "vec"),
    (torch.float32, 32, 64, "vec"),
    (torch.bfloat16, 32, 80, "vec16"),
    (torch.float32, 16, 48, "vec16"),
]


@pytest.mark.parametrize(("dtype", "block_size", "head_dim", "isa"), CASES, ids=str)
def test_read_returns_what_the_engine_wrote_and_write_round_trips(dtype, block_size, head_dim, isa):
    gen = torch.Generator().manual_seed(0)
    heads, n_blocks, length = 3, 7, 3 * block_size - 5
    cache = torch.zeros(n_blocks, heads, block_size, 2 * head_dim, dtype=dtype)
    blocks = torch.tensor([5, 1, 3], dtype=torch.int32)  # out of order, as a pool hands them out
    keys = torch.randn(length, heads, head_dim, generator=gen).to(dtype)
    values = torch.randn(length, heads, head_dim, generator=gen).to(dtype)
    j = torch.arange(length)
    slots = blocks[j // block_size].long() * block_size + j % block_size
    key_half, value_half = split_cache(cache)
    ops.cpu_attn_reshape_and_cache(keys, values, key_half, value_half, slots, isa, kv_cache_dtype="auto")

    layout = TileLayout(block_size, head_dim, dtype, isa)
    read_k, read_v = layout.read(cache, blocks, length)
    assert torch.equal(read_k[0], keys.transpose(0, 1)) and torch.equal(read_v[0], values.transpose(0, 1))
    only_k, none = layout.read(cache, blocks, length, values=False)
    assert none is None and torch.equal(only_k, read_k)
    assert torch.equal(layout.read_values(cache, blocks, length), read_v)

    # Compaction: keep every other slot of each head, written back to the first slots.
    kept = torch.arange(0, length, 2)

    class Layer:
        _k_scale_float = _v_scale_float = 1.0

    layout.write(cache, blocks, read_k[0][:, kept], read_v[0][:, kept], Layer())
    back_k, back_v = layout.read(cache, blocks, kept.numel())
    assert torch.equal(back_k[0], keys[kept].transpose(0, 1)) and torch.equal(
        back_v[0], values[kept].transpose(0, 1)
    )


def test_the_fast_paths_are_the_orders_this_cpu_uses():
    """`vec` keeps keys [head dim, block] and values [block, head dim] in a tile: both read as views.
    (Should vLLM change a kernel's order, the gather path still reads it; this says which ran.)"""
    layout = TileLayout(32, 64, torch.float32, "vec")
    assert (layout.key_view, layout.value_view) == ("channels", "tokens")
