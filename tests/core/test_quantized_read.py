"""The quantized read path (`QuantizedKVStorage._dequantize`, `unpack`): bit for bit what the
plain per-code formula gives, at every width and dtype, and metered as one layer's view."""

from __future__ import annotations

import itertools

import pytest
import torch

from reasonkv.core.memory_meter import MemoryMeter
from reasonkv.core.quantize import KVFormat, QuantizedTensor, unpack
from reasonkv.core.quantized_storage import QuantizedKVStorage


def reference_unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    per = 8 // bits
    codes = [(packed >> (bits * i)) & (2**bits - 1) for i in range(per)]
    return torch.stack(codes, -1).flatten(-2) if per > 1 else packed


def reference_dequantize(q: QuantizedTensor, slots: int, dtype: torch.dtype) -> torch.Tensor:
    """The first `slots` slots of `q` by the textbook formula: zero + code * scale per group
    (in float32 the product is rounded before the add for groups along channels)."""
    per = slots // q.group_size if q.dim == 2 else slots
    codes = reference_unpack(q.codes[:, :, :slots], q.bits).to(dtype)
    codes = codes.unflatten(q.dim, (codes.shape[q.dim] // q.group_size, q.group_size))
    scale = q.scale[:, :, :per].unsqueeze(q.dim + 1).to(dtype)
    zero = q.zero[:, :, :per].unsqueeze(q.dim + 1).to(dtype)
    two_steps = q.dim == codes.dim() - 2 and dtype == torch.float32
    scaled = codes * scale + zero if two_steps else torch.addcmul(zero, codes, scale)
    return scaled.flatten(q.dim, q.dim + 1)


@pytest.mark.parametrize("bits", [8, 4, 2])
def test_unpack_gives_every_byte_its_codes_low_bits_first(bits: int) -> None:
    every = torch.arange(256, dtype=torch.uint8)
    assert torch.equal(unpack(every, bits), reference_unpack(every, bits))
    strided = every.view(16, 16).t()  # not contiguous
    assert torch.equal(unpack(strided, bits), reference_unpack(strided, bits))


@pytest.mark.parametrize(
    "bits,dtype", list(itertools.product([8, 4, 2], [torch.float32, torch.bfloat16, torch.float16]))
)
def test_the_read_is_the_formula_bit_for_bit_and_metered_as_one_view(bits: int, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(bits)
    for batch, heads, dim, tokens, residual in ((1, 3, 64, 150, 32), (3, 2, 32, 77, 0)):
        meter = MemoryMeter()
        fmt = KVFormat(kv_bits=bits, group_size=16, residual=residual)
        s = QuantizedKVStorage(batch, heads, torch.device("cpu"), fmt, meter=meter)
        k = (torch.randn(batch, heads, tokens, dim, generator=gen) * 6 * torch.rand(dim, generator=gen)).to(
            dtype
        )
        v = torch.randn(batch, heads, tokens, dim, generator=gen).to(dtype)
        s.ensure_capacity(tokens, tokens + 40, k, v)
        s.append(k[:, :, :-2], v[:, :, :-2], 0)
        s.settle()
        s.append(k[:, :, -2:], v[:, :, -2:], tokens - 2)  # a decode step's write after a settle
        held = meter.current
        keys, values = s.read_keys(), s.read_values()
        n, rest = s.q_used, s.used - s.q_used
        assert n > 0
        for got, q, res in ((keys, s.kq, s.k_res), (values, s.vq, s.v_res)):
            want = torch.cat([reference_dequantize(q, n, dtype), res[:, :, :rest]], 2)
            assert got.dtype == dtype and got.is_contiguous() and torch.equal(got, want)
        view = 2 * keys.numel() * keys.element_size()
        assert meter.current == held + view
        s._drop_view()
        assert meter.current == held
