"""The basis a quantized cache stores in (KVFormat.pre_rope, KVFormat.hadamard): reads equal a
loop reference built from the quantizer and RoPE, positions follow padding and compaction,
each change of basis lowers the error it is for, and bad uses are clear errors."""

from __future__ import annotations

import pytest
import torch

from conftest import HEAD_DIM, build_tiny_model, left_pad, random_prompt, tiny_model
from reasonkv.core.hf_compat import cache_arg
from reasonkv.core.kv_basis import QuantizationBasis
from reasonkv.core.memory_meter import MemoryMeter
from reasonkv.core.policy.rope import apply_rope, unapply_rope
from reasonkv.core.quantize import KVFormat, dequantize, hadamard_matrix, quantize
from reasonkv.core.quantized_storage import QuantizedKVStorage
from reasonkv.methods.api import make_cache
from reasonkv.methods.knobs import KnobError, check_knobs
from reasonkv.methods.registry import get_method

INV_FREQ = 1.0 / (10000 ** (torch.arange(0, HEAD_DIM, 2).float() / HEAD_DIM))
CPU = torch.device("cpu")


def _storage(k, v, positions, pad: int = 0, **fmt) -> QuantizedKVStorage:
    """One layer holding k, v [1, H, n, D] (the first `pad` tokens padding) at RoPE `positions`
    [1, n], settled at 4 bits, group 8, no residual."""
    fmt = KVFormat(kv_bits=4, group_size=8, residual=0, **fmt)
    basis = QuantizationBasis(fmt, INV_FREQ)
    s = QuantizedKVStorage(1, k.shape[1], CPU, fmt, meter=MemoryMeter(), basis=basis)
    n = k.shape[2]
    s.ensure_capacity(n, n + 8, k, v)
    s.append(k, v, 0)
    index = torch.arange(n)[None]
    if pad:
        s.mark_padding(index >= pad, 0)
    s.record_positions(index.masked_fill(index < pad, -1), positions)
    s.settle()
    return s


def _kv(n: int = 32, heads: int = 2, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(1, heads, n, HEAD_DIM, generator=gen)
    return k, torch.randn(1, heads, n, HEAD_DIM, generator=gen)


def test_reads_equal_the_quantizer_in_the_rotated_basis_turned_back() -> None:
    k, v = _kv()
    positions = torch.arange(32)[None] + 5  # not the sequence indices: the recorded ones count
    s = _storage(k, v, positions, pre_rope=True, hadamard=True)
    assert s.q_used == 32
    h = hadamard_matrix(HEAD_DIM, torch.float32, CPU)
    pos = positions[:, None].expand(1, 2, -1)
    key_codes = quantize(unapply_rope(k, pos, INV_FREQ) @ h, 4, 8, 2)
    want_k = apply_rope(dequantize(key_codes) @ h, pos, INV_FREQ)
    want_v = dequantize(quantize(v @ h, 4, 8, 3)) @ h
    assert torch.allclose(s.read_keys(), want_k, atol=1e-5)
    assert torch.allclose(s.read_values(), want_v, atol=1e-5)
    # The read is close to what was written, and the meter balances once the view is dropped.
    assert float((s.read_keys() - k).abs().max()) < 0.5
    s._drop_view()
    assert s.meter.current == s.kv_bytes()


def test_positions_follow_padding_and_compaction() -> None:
    k, v = _kv(40)
    seq = torch.arange(40)
    positions = torch.where(seq < 3, 1, seq - 3)[None]  # 3 left pads (at 1, as generate puts them)
    s = _storage(k, v, positions, pad=3, pre_rope=True)
    padding_then_real = torch.cat([torch.zeros(3, dtype=torch.long), torch.arange(37)])
    assert torch.equal(s._positions(0, 40)[0, 1], padding_then_real)
    kept = torch.tensor([[[3, 4, 9, 17, 20, 25, 33, 39]]]).expand(1, 2, -1)
    before = s.read_keys().gather(2, kept[..., None].expand(-1, -1, -1, HEAD_DIM))
    s.compact(kept, torch.full((1, 2), 8), 8)
    assert torch.equal(s._positions(0, 8)[0, 0], torch.tensor([0, 1, 6, 14, 17, 22, 30, 36]))
    s.select_rows(torch.tensor([0, 0]))  # a beam search's rows: each keeps its offset
    assert torch.equal(s._positions(0, 8)[1, 1], torch.tensor([0, 1, 6, 14, 17, 22, 30, 36]))
    # Re-quantized in their new groups from the positions they moved with: still close.
    assert float((s.read_keys() - before).abs().max()) < 0.5


def test_pre_rope_keeps_a_steady_channel_steady() -> None:
    """Keys whose channels hold steady values before RoPE (one outlier pair): after RoPE the
    pairs swing with position, so per-channel groups over tokens lose several times more."""
    gen = torch.Generator().manual_seed(1)
    steady = torch.randn(1, 2, 1, HEAD_DIM, generator=gen)
    pre = steady + 0.05 * torch.randn(1, 2, 32, HEAD_DIM, generator=gen)
    pre[..., 0] *= 20
    pre[..., HEAD_DIM // 2] *= 20
    positions = torch.arange(32)[None]
    k = apply_rope(pre, positions[:, None], INV_FREQ)
    v = torch.zeros_like(k)
    err_post = (_storage(k, v, positions).read_keys() - k).abs().mean()
    err_pre = (_storage(k, v, positions, pre_rope=True).read_keys() - k).abs().mean()
    assert err_pre * 4 < err_post


def test_hadamard_spreads_an_outlier_channel() -> None:
    k, v = _kv()
    v[..., 3] *= 40  # one channel sets every value group's scale
    err_plain = (_storage(k, v, torch.arange(32)[None]).read_values() - v).pow(2).mean()
    err_rotated = (_storage(k, v, torch.arange(32)[None], hadamard=True).read_values() - v).pow(2).mean()
    assert err_rotated * 2 < err_plain


def test_pre_rope_holds_no_bytes_more_and_refuses_positions_that_leave_the_sequence() -> None:
    k, v = _kv()
    plain = _storage(k, v, torch.arange(32)[None])
    pre = _storage(k, v, torch.arange(32)[None], pre_rope=True)
    assert pre.kv_bytes() == plain.kv_bytes()  # a row's offset, not a position per slot
    more_k, more_v = _kv(8, seed=1)
    pre.ensure_capacity(40, 48, more_k, more_v)
    pre.append(more_k, more_v, 32)
    pre.record_positions(torch.arange(32, 40)[None], torch.arange(32, 40)[None] + 100)
    with pytest.raises(ValueError, match="positions do not follow"):
        pre.settle()


@torch.no_grad()
def _greedy_logits(model, ids, mask, cache, steps: int = 24) -> torch.Tensor:
    out = model(input_ids=ids, attention_mask=mask, **cache_arg(cache), use_cache=True)
    logits = [out.logits[:, -1]]
    tokens = random_prompt(steps, 9, ids.shape[0])
    for i in range(steps):
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], 1)
        out = model(input_ids=tokens[:, i : i + 1], attention_mask=mask, **cache_arg(cache), use_cache=True)
        logits.append(out.logits[:, -1])
    return torch.stack(logits, 1)


@pytest.mark.usefixtures("toy_storage")  # a quantized cache the tiny model cannot pay for
@pytest.mark.parametrize(
    "arch,method,knobs",
    [
        ("llama", "snapkv", {"interval": 8}),  # compactions
        ("qwen3", "snapkv", {"interval": 8}),
        ("llama", "h2o", {}),  # holes every step
        ("llama", "adakv-snapkv", {"interval": 8}),  # ragged heads
    ],
)
def test_a_left_padded_batch_at_8_bits_stays_close_to_full_precision(arch, method, knobs) -> None:
    """Both changes of basis on, every slot layout: the reads turn back what was stored."""
    model = tiny_model(arch)
    ids, mask = left_pad([random_prompt(30, 5)[0], random_prompt(19, 6)[0]])
    knobs = {**knobs, "group_size": 8, "residual": 0}
    full = _greedy_logits(model, ids, mask, make_cache(model, method, budget=24, **knobs))
    both = make_cache(model, method, budget=24, kv_bits=8, pre_rope=True, hadamard=True, **knobs)
    quant = _greedy_logits(model, ids, mask, both)
    assert both.layers[0].storage.q_used > 0
    assert float((quant - full).abs().max()) < 0.02 * float(full.abs().max())


@pytest.mark.parametrize("knobs", [{"pre_rope": True}, {"hadamard": True}])
def test_a_change_of_basis_without_quantization_is_refused(knobs) -> None:
    with pytest.raises(KnobError, match="needs kv_bits"):
        check_knobs(get_method("snapkv"), knobs)


def test_hadamard_needs_a_power_of_two_head_dim() -> None:
    with pytest.raises(ValueError, match="power of two"):
        KVFormat(kv_bits=4, group_size=8, hadamard=True).check_head_dim(24)
    KVFormat(kv_bits=4, group_size=8).check_head_dim(24)  # without it, 24 splits into groups of 8


def test_pre_rope_needs_the_models_rope() -> None:
    model = build_tiny_model("llama")
    model.model.rotary_emb.inv_freq = None
    with pytest.raises(KnobError, match="pre_rope needs its RoPE"):
        make_cache(model, "quant-int4", pre_rope=True, group_size=16)  # head dim 16
