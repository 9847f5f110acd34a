"""The knobs a record of a run keeps, from which a sweep unit's key is made.

A record keeps the knobs as given, so that a default never enters a key. Two defaults are
spelt out all the same, because what they name is part of what the unit measured and a
default may change: a two-tier unit's tier width (`low_bits`), and the group size of a unit
stored below 16 bits (`group_size`; the published units in examples/bytes/ spell it). A key
then names one setting whatever the defaults are.
"""

from __future__ import annotations

from reasonkv.methods.knobs import stores_quantized
from reasonkv.methods.registry import get_method


def record_knobs(method: str, knobs: dict[str, object]) -> dict[str, object]:
    """`knobs` (checked) as a record of `method` keeps them: with `low_bits` and `group_size`
    spelt out where they say what ran."""
    defaults = get_method(method).knobs()
    out = dict(knobs)
    if out.get("low_budget") and "low_bits" not in out:
        out["low_bits"] = defaults["low_bits"]
    if "group_size" not in out and stores_quantized(method, out):
        out["group_size"] = defaults["group_size"]
    return out
