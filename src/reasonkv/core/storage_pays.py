"""Whether quantized storage pays at a budget, judged before anything runs: a setting below 16
bits that never quantizes a token, or whose decoding peak is above the same cache's at 16 bits
(both from `quantized_peak`: the layers' slots as they run, and what `QuantizedKVStorage`
makes of them), is refused with what to change."""

from __future__ import annotations

from reasonkv.core import quantized_peak
from reasonkv.core.policy.contract import BudgetPlan
from reasonkv.core.quantize import KVFormat
from reasonkv.util.formatting import format_bytes

HEAD_SPLIT_MARGIN = 0.2
"""How far below the 16-bit peak quantized storage must stay, with every head at its budget,
under a head allocator (AdaKV, ReasonAlloc). Its heads' lengths are split as the cache runs,
and a layer quantizes only what its shortest head holds: the longer heads' tokens past it stay
in the full-precision residual, which the estimate with equal heads does not see
(docs/architecture.md, "Storage that cannot pay is refused", says what the tests' model showed)."""

CHANGE = "lower group_size or residual, raise the budget, or use kv_bits=16"


def storage_refusal(
    method: str,
    budget: int,
    fmt: KVFormat,
    plans: list[BudgetPlan],
    layers: list[quantized_peak.LayerSlots | None],
    shape: tuple[int, int],
    *,
    head_split: bool,
    residual_given: bool,
) -> str | None:
    """Why `method` stored as `fmt` does not pay at `budget` (one sentence that says what to
    change), or None: it pays, or it cannot be judged from the budget. `plans` are the layers'
    budget plans, `layers` their slots (`LayerSlots.counted`), `shape` (KV heads, head dim);
    `head_split`: a head allocator splits each layer's budget as the cache runs;
    `residual_given`: the residual was set, not defaulted.

    The caller leaves out the settings where the tokens a head holds are not the budget's to
    say (a schedule that never compresses or counts from the prompt's end, a kept prompt).
    Under a head split the shortest head, which decides what is quantized, holds no more than
    the mean, so "never quantizes" is as sure; the peak is estimated with equal heads and must
    save `HEAD_SPLIT_MARGIN`."""
    if not fmt.quantized:
        return None
    if any(layer is None for layer in layers):
        return None
    r, g = fmt.residual, fmt.group_size
    residual = f"residual={r}" + ("" if residual_given else f", the default at budget {budget}")
    if not any(quantized_peak.quantizes(layer, fmt) for layer in layers):
        most = max(layer.most_slots for layer in layers)
        return (
            f"kv_bits={fmt.kv_bits} quantizes nothing at budget {budget}: a head of {method!r} holds "
            f"at most {most} tokens here, and a group of group_size={g} leaves the full-precision "
            f"residual ({residual}) only at {r + g}; {CHANGE}"
        )
    uniform = all(len(set(plan.triggers)) == 1 and len(set(plan.targets)) == 1 for plan in plans)
    if not uniform or not quantized_peak.steady(layers):
        return None
    slot = quantized_peak.SlotBytes(*shape, fmt)
    at_16 = quantized_peak.peak_16bit(layers, slot)
    quantized = quantized_peak.peak_quantized(layers, slot)
    if quantized <= at_16 * (1 - HEAD_SPLIT_MARGIN if head_split else 1):
        return None
    given = [f"{k}={getattr(fmt, k)}" for k in ("value_group_size", "fp_sinks") if getattr(fmt, k)]
    default = "" if residual_given else f" (the default at budget {budget})"
    setting = f"{method!r} with group_size={g}, {', '.join([f'residual={r}', *given])}{default}"
    peaks = (
        f"{format_bytes(quantized)} of K/V a sequence while decoding, against {format_bytes(at_16)} at "
        f"16 bits ({quantized / at_16:.3f}x; {len(plans)} layers, {r + g} tokens a head in full precision, "
        "a layer read dequantized each step)"
    )
    if head_split:
        return (
            f"kv_bits={fmt.kv_bits} saves too little under a head allocator at budget {budget} on this "
            f"model: with every head at its budget, {setting} peaks at {peaks}, and the uneven split "
            f"keeps the longer heads' tokens in full precision; it must save {HEAD_SPLIT_MARGIN:.0%}: "
            f"{CHANGE}"
        )
    return (
        f"kv_bits={fmt.kv_bits} holds more than kv_bits=16 at budget {budget} on this model: {setting} "
        f"peaks at {peaks}; {CHANGE}"
    )
