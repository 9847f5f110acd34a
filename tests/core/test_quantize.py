"""The KIVI-style quantizer: the error bound, exact packing, and clear errors."""

from __future__ import annotations

import pytest
import torch

from reasonkv.core.quantize import KVFormat, dequantize, pack, quantize, unpack


def _scale_per_element(q, shape) -> torch.Tensor:
    return q.scale.float().repeat_interleave(q.group_size, dim=q.dim)[tuple(slice(n) for n in shape)]


@pytest.mark.parametrize("bits", [8, 4, 2])
@pytest.mark.parametrize("dim", [2, 3])  # keys: per channel over tokens; values: per token over channels
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_dequantized_values_are_within_half_a_scale(bits: int, dim: int, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(bits + dim)
    x = (torch.randn(2, 3, 64, 16, generator=gen) * 3 + torch.linspace(-5, 5, 16)).to(dtype)
    q = quantize(x, bits, 8, dim)
    assert q.scale.dtype == dtype and q.zero.dtype == dtype
    err = (x.float() - dequantize(q, torch.float32)).abs()
    bound = _scale_per_element(q, x.shape) / 2
    assert bool((err <= bound * (1 + 1e-5) + 1e-6).all())
    assert dequantize(q).dtype == dtype


def test_a_constant_group_comes_back_exactly() -> None:
    x = torch.full((1, 1, 8, 8), 2.5)
    assert torch.equal(dequantize(quantize(x, 4, 8, 2)), x)


@pytest.mark.parametrize("bits", [8, 4, 2])
def test_packing_round_trips_and_counts_bytes_exactly(bits: int) -> None:
    gen = torch.Generator().manual_seed(bits)
    codes = torch.randint(0, 2**bits, (3, 5, 32), generator=gen, dtype=torch.uint8)
    packed = pack(codes, bits)
    assert packed.dtype == torch.uint8 and packed.shape == (3, 5, 32 * bits // 8)
    assert torch.equal(unpack(packed, bits), codes)
    x = torch.randn(2, 2, 64, 16)
    for dim in (2, 3):
        q = quantize(x, bits, 16, dim)
        assert q.codes.numel() == x.numel() * bits // 8
        groups = x.numel() // 16
        assert q.scale.numel() == q.zero.numel() == groups
        assert q.nbytes() == x.numel() * bits // 8 + 2 * groups * 4


def test_four_int2_codes_share_a_byte_low_bits_first() -> None:
    codes = torch.tensor([[1, 2, 3, 0]], dtype=torch.uint8)
    assert pack(codes, 2).tolist() == [[1 | 2 << 2 | 3 << 4]]
    assert pack(torch.tensor([[15, 1]], dtype=torch.uint8), 4).tolist() == [[15 | 1 << 4]]


@pytest.mark.parametrize("bits", [1, 3, 16, 0])
def test_bits_other_than_8_4_2_are_refused(bits: int) -> None:
    with pytest.raises(ValueError, match="bits must be one of 8, 4, 2"):
        quantize(torch.randn(1, 1, 8, 8), bits, 8, 2)
    with pytest.raises(ValueError, match="bits must be one of"):
        pack(torch.zeros(1, 8, dtype=torch.uint8), bits)


def test_a_group_size_that_does_not_divide_the_axis_is_refused() -> None:
    with pytest.raises(ValueError, match="group_size 6 must divide"):
        quantize(torch.randn(1, 1, 16, 8), 4, 6, 2)
    with pytest.raises(ValueError, match="group_size 16 must divide"):
        quantize(torch.randn(1, 1, 16, 8), 4, 16, 3)


def test_the_kv_format_checks_itself() -> None:
    assert not KVFormat().quantized and KVFormat(kv_bits=4).quantized
    with pytest.raises(ValueError, match="bits"):
        KVFormat(kv_bits=3)
    with pytest.raises(ValueError, match="power of two"):
        KVFormat(kv_bits=4, group_size=12)
    with pytest.raises(ValueError, match="divide the model's head dim"):
        KVFormat(kv_bits=4, group_size=32).check_head_dim(16)
    KVFormat(kv_bits=16, group_size=32).check_head_dim(16)  # not quantized: nothing to split


def test_elements_left_out_do_not_widen_their_group() -> None:
    x = torch.randn(1, 2, 16, 8)
    x[:, :, 3] = 1000.0  # a padding slot
    valid = torch.ones(1, 2, 16, 1, dtype=torch.bool)
    valid[:, :, 3] = False
    q = quantize(x, 4, 8, 2, valid=valid)
    wide = quantize(x, 4, 8, 2)
    assert float(q.scale[:, :, 0].max()) < float(wide.scale[:, :, 0].min())
    err = (dequantize(q) - x).abs()
    err[:, :, 3] = 0
    assert bool((err <= _scale_per_element(q, x.shape) / 2 + 1e-6).all())
    none = quantize(x, 4, 8, 2, valid=torch.zeros(1, 1, 16, 1, dtype=torch.bool))
    assert torch.isfinite(dequantize(none)).all()
