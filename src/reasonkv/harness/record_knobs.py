"""The knobs a record of a run keeps, from which a sweep unit's key is made.

A record keeps the knobs as given, so that a default never enters a key. Two defaults are
spelt out all the same, because what they name is part of what the unit measured and a
default may change: a two-tier unit's tier width (`low_bits`), and the group size of a unit
stored below 16 bits (`group_size`; the published units in examples/bytes/ spell it). A key
then names one setting whatever the defaults are.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from types import MappingProxyType

from reasonkv.methods.knobs import stores_quantized
from reasonkv.methods.registry import get_method
from reasonkv.methods.resolved import ResolvedMethod


def record_knobs(method: str, knobs: dict[str, object]) -> dict[str, object]:
    """`knobs` (checked) as a record of `method` keeps them: with `low_bits` and `group_size`
    spelt out where they say what ran."""
    return _spelt(knobs, get_method(method).knobs(), stores_quantized(method, knobs))


def recorded(resolved: ResolvedMethod) -> ResolvedMethod:
    """`resolved` with its knobs as a record keeps them (`record_knobs`), its parts as built:
    what is spelt out is the defaults they were built with."""
    fmt = resolved.policy.kv_format
    quantized = fmt is not None and fmt.below_model_precision
    knobs = _spelt(resolved.knobs, resolved.spec.knobs(), quantized)
    return dataclasses.replace(resolved, knobs=MappingProxyType(knobs))


def _spelt(knobs: Mapping[str, object], defaults: dict[str, object], quantized: bool) -> dict[str, object]:
    out = dict(knobs)
    if out.get("low_budget") and "low_bits" not in out:
        out["low_bits"] = defaults["low_bits"]
    if "group_size" not in out and quantized:
        out["group_size"] = defaults["group_size"]
    return out
