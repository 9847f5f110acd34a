"""A pure-torch KIVI-style quantizer (Liu et al. 2024, arXiv:2402.02750) and the KV storage format.

Asymmetric min/max quantization in groups: each group of `group_size` elements along one
axis gets a scale and a zero point (its minimum), and each element a `bits`-bit code in
[0, 2^bits - 1], so the dequantized `code * scale + zero` is within `scale / 2` of the
element. Codes are packed along the last axis into uint8 (one int8, two int4 or four int2
per byte). The scale is rounded up and the zero down to the storage dtype, so that the bound
still holds after they are stored at low precision.

KV caches group keys per channel (groups run along the token axis: outlier channels get
their own scale) and values per token (groups run along the channel axis).
"""

from __future__ import annotations

import functools
import sys
from dataclasses import dataclass
from typing import Literal

import torch

from reasonkv.core.policy.knob import MAX_TOKENS, knob, tokens

LOW_TIER_KNOBS = ("low_budget", "low_bits", "low_group_size")
"""The storage knobs of the low tier (see `KVFormat`)."""

STORAGE_KNOBS = {
    "kv_bits": "16: K/V as the model computes them; 8, 4 or 2: what is kept is stored quantized (KIVI-style)",
    "group_size": "tokens per key group, and channels per value group unless value_group_size is set",
    "residual": "the newest tokens kept in full precision (unset: a quarter of the budget, at most 32)",
    "fp_sinks": "the first real tokens of each head kept in full precision beside their codes",
    "pre_rope": "keys quantized before RoPE, rotated to their positions on every read",
    "hadamard": "keys and values quantized in the Hadamard basis (head dim a power of two)",
    "value_group_size": "channels per value group (unset: group_size); it must divide the head dim",
    "low_budget": "tokens per KV head of what eviction drops kept in a low tier (0: none)",
    "low_bits": "the low tier's bits",
    "low_group_size": "channels per low-tier group (unset: the values' group)",
}
"""What each of `KVFormat`'s knobs does, in a line (`reasonkv methods` lists them once)."""

BITS = (8, 4, 2)
"""The code widths the quantizer packs (16 means: not quantized, see `KVFormat`)."""

RESIDUAL = 32
"""The most tokens the default residual keeps in full precision (see `default_residual`)."""

GROUP_SIZE = 32
"""The default group: keys per channel over 32 tokens, values per token over 32 channels, as in
KIVI; on the default model (head dim 64) it had less KL than group 16 at equal memory
(docs/results.md, "Quantize, evict, or both"). A head dim below 32 needs a smaller group (the
tests' models set group_size=16)."""


def default_residual(budget: int | None) -> int:
    """`residual` when it is not set: a quarter of the budget, at most 32 (`RESIDUAL`); 32 for
    a cache without a budget (full, quant-int*).

    A head quantizes a group only once it holds residual + group_size tokens, and holds that
    many in full precision from then on: 32 (+ a group) is the whole of a budget-32 cache, while
    a quarter of it leaves the rest to the codes. From a budget of 128 up it is 32 as it
    always was, so every published unit (none sets kv_bits below 16 at a budget under 256
    without its residual) means what it meant."""
    return RESIDUAL if budget is None else min(RESIDUAL, budget // 4)


def check_bits(bits: int) -> None:
    if bits not in BITS:
        raise ValueError(f"bits must be one of {', '.join(map(str, BITS))}, got {bits!r}")


def _check_group(size: int, group_size: int, what: str) -> None:
    if group_size < 1 or size % group_size:
        raise ValueError(f"group_size {group_size} must divide the {what} ({size})")


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 codes [..., n] (each < 2^bits) -> [..., n * bits / 8] bytes, the first code in the low bits."""
    check_bits(bits)
    per = 8 // bits
    if per == 1:
        return codes.to(torch.uint8)
    n = codes.shape[-1]
    if n % per:
        raise ValueError(f"the last axis ({n}) must be a multiple of {per} to pack {bits}-bit codes")
    grouped = codes.to(torch.uint8).unflatten(-1, (n // per, per))
    out = grouped[..., 0].clone()
    for i in range(1, per):
        out |= grouped[..., i] << (bits * i)
    return out


_SPREAD = {
    4: (torch.int16, ((4, 0x0F0F),)),
    2: (torch.int32, ((12, 0x000F000F), (6, 0x03030303))),
}
"""How `unpack` spreads the codes of a byte over the bytes of a wider integer (see there)."""


def unpack_wide_dtype(bits: int) -> torch.dtype:
    """The integer dtype `unpack_wide_` takes for `bits`-bit codes: one element per packed byte."""
    return _SPREAD[bits][0]


def unpack_wide_(wide: torch.Tensor, bits: int) -> torch.Tensor:
    """`unpack` of bytes already widened to `unpack_wide_dtype(bits)` (contiguous), in place:
    each code moves to its own byte, and the uint8 view of the result is the codes, in order."""
    for shift, mask in _SPREAD[bits][1]:
        wide.bitwise_or_(wide << shift).bitwise_and_(mask)
    return wide.view(torch.uint8)


def unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """The inverse of `pack`: [..., m] bytes -> uint8 codes [..., m * 8 / bits].

    Each byte is widened to 2 (int4) or 4 (int2) bytes and its codes moved into a byte each
    with a few whole-tensor shifts and masks; on a little-endian machine the bytes of the
    result are then the codes in order (the first, low-bit code first). That is several
    times faster than interleaving one tensor per code position (a strided uint8 copy)."""
    check_bits(bits)
    per = 8 // bits
    if per == 1:
        return packed
    if sys.byteorder != "little":  # pragma: no cover - no big-endian torch platform in use
        mask = 2**bits - 1
        return torch.stack([(packed >> (bits * i)) & mask for i in range(per)], -1).flatten(-2)
    wide = torch.empty(packed.shape, dtype=unpack_wide_dtype(bits), device=packed.device)
    wide.copy_(packed)
    return unpack_wide_(wide, bits)


@dataclass
class QuantizedTensor:
    """Packed codes and, per group, a scale and a zero point. `dim` is the axis the groups run
    along; `scale` and `zero` have that axis divided by `group_size`, every other axis as is."""

    codes: torch.Tensor  # uint8, the last axis packed
    scale: torch.Tensor
    zero: torch.Tensor
    bits: int
    group_size: int
    dim: int  # non-negative

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        return dequantize(self, dtype)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.codes, self.scale, self.zero))


def _round_to(x: torch.Tensor, dtype: torch.dtype, up: bool) -> torch.Tensor:
    """x (float32) in `dtype`, rounded towards +inf (up) or -inf, so the stored value bounds x."""
    if dtype == torch.float32:
        return x
    stored = x.to(dtype)
    wrong = stored.float() < x if up else stored.float() > x
    step = torch.full_like(stored, float("inf") if up else float("-inf"))
    return torch.where(wrong, torch.nextafter(stored, step), stored)


def quantize(
    x: torch.Tensor,
    bits: int,
    group_size: int,
    dim: int,
    store_dtype: torch.dtype | None = None,
    valid: torch.Tensor | None = None,
) -> QuantizedTensor:
    """Quantize `x` in groups of `group_size` along `dim`; scales and zeros in `store_dtype`
    (default: x's dtype). The last axis is packed, so it must hold a whole number of bytes.
    `valid` (bool, broadcastable to x) leaves elements out of their group's range: they are
    stored too, clamped into it (padding and evicted slots, never read)."""
    check_bits(bits)
    dim = dim % x.dim()
    _check_group(x.shape[dim], group_size, f"axis {dim} of a {tuple(x.shape)} tensor")
    store_dtype = x.dtype if store_dtype is None else store_dtype
    levels = 2**bits - 1
    g = x.float().unflatten(dim, (x.shape[dim] // group_size, group_size))
    if valid is None:
        lo, hi = g.amin(dim + 1, keepdim=True), g.amax(dim + 1, keepdim=True)
    else:
        ok = valid.expand_as(x).unflatten(dim, g.shape[dim : dim + 2])
        lo = g.masked_fill(~ok, float("inf")).amin(dim + 1, keepdim=True)
        hi = g.masked_fill(~ok, float("-inf")).amax(dim + 1, keepdim=True)
        empty = ~ok.any(dim + 1, keepdim=True)
        lo, hi = lo.masked_fill(empty, 0.0), hi.masked_fill(empty, 0.0)
    zero = _round_to(lo, store_dtype, up=False)
    span = hi - zero.float()
    tiny = torch.finfo(store_dtype).tiny
    scale = _round_to((span / levels).clamp(min=tiny), store_dtype, up=True)
    codes = ((g - zero.float()) / scale.float()).round_().clamp_(0, levels).to(torch.uint8)
    return QuantizedTensor(
        pack(codes.flatten(dim, dim + 1), bits),
        scale.squeeze(dim + 1),
        zero.squeeze(dim + 1),
        bits,
        group_size,
        dim,
    )


def dequantize(q: QuantizedTensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The tensor `q` stands for, in `dtype` (default: the scales' dtype)."""
    dtype = q.scale.dtype if dtype is None else dtype
    codes = unpack(q.codes, q.bits)
    out = torch.empty(codes.shape, dtype=dtype, device=codes.device)
    out.copy_(codes)
    _scale_codes_(out, q.scale.to(dtype), q.zero.to(dtype), q.group_size, q.dim)
    return out


def _scale_codes_(
    x: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group_size: int, dim: int
) -> None:
    """x (codes as floats, in scale's dtype) <- zero + x * scale, in place, per group along `dim`.

    Groups along another axis than the last (keys): one addcmul, with scale and zero broadcast
    over an outer axis. Groups along the last axis (values, the low tier): `scale_channel_groups_`.
    """
    x = x.unflatten(dim, (x.shape[dim] // group_size, group_size))
    scale, zero = scale.unsqueeze(dim + 1), zero.unsqueeze(dim + 1)
    if dim == x.dim() - 2:
        scale_channel_groups_(x, scale, zero)
    else:
        torch.addcmul(zero, x, scale, out=x)


def scale_channel_groups_(x: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> None:
    """x [..., groups, g] <- zero + x * scale in place, scale and zero [..., groups, 1].

    The broadcast of scale and zero falls in the innermost loop. The CPU kernels stay
    vectorised there for one broadcast float32 operand, not two, and for no bf16/fp16 one. So:
    float32 multiplies, then adds (the product rounded first; nothing copied); other dtypes
    expand scale and zero first (a broadcast copy is fast) and take one addcmul. Every reader
    of these codes goes through here, so they all share one arithmetic per dtype.
    """
    if x.dtype == torch.float32:
        x.mul_(scale).add_(zero)
    else:
        torch.addcmul(zero.expand_as(x).contiguous(), x, scale.expand_as(x).contiguous(), out=x)


@functools.cache
def hadamard_matrix(n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The n x n Hadamard matrix divided by sqrt(n) (n a power of two): orthonormal and
    symmetric, so it is its own inverse. Made once per size, dtype and device (reads use it
    every step; callers must not write to it)."""
    if n < 1 or n & (n - 1):
        raise ValueError(f"a Hadamard matrix needs a power of two, got {n}")
    h = torch.ones(1, 1)
    while h.shape[0] < n:  # Sylvester: [[H, H], [H, -H]]
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)])
    return (h / n**0.5).to(device=device, dtype=dtype)


@dataclass
class KVFormat:
    """How a cache stores the keys and values it keeps: its knobs, on every method.

    kv_bits 16 stores them as the model computes them (no quantization). 8, 4 or 2 stores
    keys per channel over groups of `group_size` tokens (32, `GROUP_SIZE`) and values per token
    over groups of `value_group_size` channels (None: `group_size`; it must divide the head
    dim; a whole head's channels in one group halves the values' scale bytes), packed, with a
    scale and a zero point per group; the newest `residual` tokens (at least) stay in full
    precision and move to the quantized part a group at a time. The residual is 32, not KIVI's
    128: eviction budgets here are 64-512 tokens, and 128 would keep a budget-128 cache
    unquantized; a method with a budget under 128 that leaves it unset gets a quarter of its
    budget instead (`default_residual`, applied by `make_cache`).

    fp_sinks > 0 keeps the first `fp_sinks` real tokens (the attention sinks) in full precision
    beside their codes, and leaves them out of their key group's range: a sink's keys are
    outliers that would widen the scale of every token in its group, and most heads attend
    to it heavily (IntactKV, Liu et al. 2024, arXiv:2403.01241, keeps such pivot tokens
    lossless). 0 (the default) quantizes them like any token.

    pre_rope quantizes keys as the model projected them, before RoPE (KVQuant, Hooper et al.
    2024, arXiv:2401.18079): RoPE turns each channel pair by a different angle at every
    position, so after it a channel's values swing over its pair's whole magnitude within a
    group of tokens, while before it each channel keeps its own range. Reads rotate the
    dequantized keys back to their positions (the model's `inv_freq`); the residual stays as
    the model gave it.

    hadamard quantizes keys and values in a rotated basis: each token's channels times the
    normalised Hadamard matrix, which spreads a few outlier channels over all of them so one
    scale fits the group better (QuaRot, Ashkboos et al. 2024, arXiv:2404.00456); reads turn
    them back. The head dim must then be a power of two.

    low_budget > 0 adds a low tier (core/low_tier.py): the tokens eviction drops go there,
    `low_budget` per KV head, each token's keys and values at `low_bits` over groups of
    `low_group_size` channels (None: the values' group), and leave the cache only when the tier
    is full and they are the lowest-scoring of it. 0 (the default) is no low tier.
    """

    kv_bits: Literal[16, 8, 4, 2] = 16
    group_size: int = knob(GROUP_SIZE, ge=1, le=1024)
    residual: int = tokens(RESIDUAL, minimum=0)
    fp_sinks: int = knob(0, ge=0, le=64)
    pre_rope: bool = False
    hadamard: bool = False
    value_group_size: int | None = knob(None, ge=1, le=1024)
    low_budget: int = tokens(0, minimum=0)
    low_bits: Literal[8, 4, 2] = 4
    low_group_size: int | None = knob(None, ge=1, le=1024)

    def __post_init__(self) -> None:
        if self.kv_bits != 16:
            check_bits(self.kv_bits)
        if self.group_size & (self.group_size - 1):
            raise ValueError(
                f"group_size must be a power of two (it is the values' group too unless value_group_size "
                f"is set), got {self.group_size}"
            )
        for name in ("fp_sinks", "pre_rope", "hadamard"):  # they change how quantized K/V are stored
            if getattr(self, name) and not self.quantized:
                raise ValueError(
                    f"{name}={getattr(self, name)} changes how a quantized cache stores K/V: "
                    "it needs kv_bits 8, 4 or 2"
                )
        if self.residual > MAX_TOKENS:
            raise ValueError(f"residual must be at most 10^9 tokens, got {self.residual}")
        check_bits(self.low_bits)
        if self.low_budget < 0:
            raise ValueError(f"low_budget must be a number of tokens >= 0, got {self.low_budget}")
        if self.value_group < 1 or self.value_group & (self.value_group - 1):
            raise ValueError(
                f"value_group_size must be a power of two (it divides the head dim), got {self.value_group}"
            )
        if self.low_group & (self.low_group - 1) or self.low_group < 1:
            raise ValueError(
                f"low_group_size must be a power of two (it divides the head dim), got {self.low_group}"
            )

    @property
    def quantized(self) -> bool:
        return self.kv_bits != 16

    @property
    def below_model_precision(self) -> bool:
        """Keeps some K/V at fewer bits than the model computes them: kv_bits below 16, or a
        low tier for what eviction drops."""
        return self.quantized or self.low_budget > 0

    @property
    def value_group(self) -> int:
        """Channels per value group (value_group_size, or group_size when it is None)."""
        return self.group_size if self.value_group_size is None else self.value_group_size

    @property
    def low_group(self) -> int:
        """Channels per group of the low tier (low_group_size, or the values' group when it is None)."""
        return self.value_group if self.low_group_size is None else self.low_group_size

    def check_head_dim(self, head_dim: int) -> None:
        """Refuse a head dim the value groups (and the packing) cannot split."""
        if self.quantized and head_dim % self.value_group:
            name = "group_size" if self.value_group_size is None else "value_group_size"
            raise ValueError(
                f"{name} {self.value_group} must divide the model's head dim ({head_dim}): values "
                f"are quantized per token in groups of {name} channels; set {name} to a power of "
                f"two up to {head_dim & -head_dim}"
            )
        if self.quantized and self.hadamard and head_dim & (head_dim - 1):
            raise ValueError(
                f"hadamard rotates a head's channels by a Hadamard matrix, which needs a head dim that is "
                f"a power of two; the model's is {head_dim}"
            )
        if self.low_budget and head_dim % self.low_group:
            unset = "" if self.low_group_size is not None else " (unset: the values' group)"
            raise ValueError(
                f"low_group_size {self.low_group}{unset} must divide the model's head dim ({head_dim}): the "
                "low tier quantizes keys and values per token in groups of low_group_size channels; set "
                f"low_group_size to a power of two up to {head_dim & -head_dim}"
            )
