"""The knobs a record of a run keeps, from which a sweep unit's key is made.

A record keeps the knobs as given, so that a default never enters a key. Two defaults are
spelt out all the same, because what they name is part of what the unit measured and a
default may change: a two-tier unit's tier width (`low_bits`), and the group size of a unit
stored below 16 bits (`group_size`; the published units in examples/bytes/ spell it). A key
then names one setting whatever the defaults are.
"""

from __future__ import annotations

import dataclasses
from types import MappingProxyType

from reasonkv.methods.resolved import ResolvedMethod


def recorded(resolved: ResolvedMethod) -> ResolvedMethod:
    """`resolved` with its knobs as a record keeps them, its parts as built: what is spelt out
    is the defaults they were built with."""
    knobs = dict(resolved.knobs)
    defaults = resolved.spec.knobs()
    if knobs.get("low_budget") and "low_bits" not in knobs:
        knobs["low_bits"] = defaults["low_bits"]
    if "group_size" not in knobs and resolved.stores_quantized:
        knobs["group_size"] = defaults["group_size"]
    return dataclasses.replace(resolved, knobs=MappingProxyType(knobs))
