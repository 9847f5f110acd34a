"""Whether quantized storage pays at a budget, judged before anything runs: a setting below 16
bits that never quantizes a token, or whose decoding peak is above the same cache's at 16 bits
(both metered on a run of the real layer and storage, `core/storage_peak`), is refused with
what to change."""

from __future__ import annotations

import dataclasses

import torch

from reasonkv.core.slot_count import per_layer
from reasonkv.core.step import LayerPolicy
from reasonkv.core.storage_peak import measure_layer, peak
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
    policy: LayerPolicy,
    budgets: torch.Tensor,
    head_dim: int,
    *,
    residual_given: bool,
) -> str | None:
    """Why `method` stored as `policy.kv_format` does not pay at `budget` (one sentence that
    says what to change), or None: it pays, or it cannot be judged from the budget. `budgets`
    [layers, KV heads] are the cache's; `residual_given`: the residual was set, not defaulted.

    The caller leaves out the settings where the tokens a head holds are not the budget's to
    say (a schedule that never compresses or counts from the prompt's end, a kept prompt).
    Under a head allocator the shortest head, which decides what is quantized, holds no more
    than the mean, so "never quantizes" is as sure; the peak is measured with equal heads and
    must save `HEAD_SPLIT_MARGIN`."""
    fmt = policy.kv_format
    if not fmt.quantized:
        return None
    layers = per_layer(budgets, lambda row: measure_layer(policy, row, head_dim))
    if any(layer is None for layer in layers):
        return None
    r, g = fmt.residual, fmt.group_size
    residual = f"residual={r}" + ("" if residual_given else f", the default at budget {budget}")
    plans = [policy.schedule.plan([int(b) for b in row.tolist()]) for row in budgets]
    if not any(layer.quantizes for layer in layers):
        # The most slots a head holds after a step (tokens and holes): below the trigger.
        most = max(plan.trigger_max - 1 + plan.hole_slots for plan in plans)
        return (
            f"kv_bits={fmt.kv_bits} quantizes nothing at budget {budget}: a head of {method!r} holds "
            f"at most {most} tokens here, and a group of group_size={g} leaves the full-precision "
            f"residual ({residual}) only at {r + g}; {CHANGE}"
        )
    if not all(len(set(plan.triggers)) == 1 and len(set(plan.targets)) == 1 for plan in plans):
        return None
    plain = dataclasses.replace(policy, kv_format=None)
    layers_16 = per_layer(budgets, lambda row: measure_layer(plain, row, head_dim))
    if not all(layer is not None and layer.steady for layer in layers_16):  # storage grows by chunks
        return None
    at_16, quantized = peak(layers_16), peak(layers)
    head_split = policy.head_allocator is not None
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
