"""A policy part built directly, not through `check_knobs`, is held to the same declarations:
each knob's range (`knob`, `tokens`, `unit`) and choices (`typing.Literal`) are checked from the
field that declares them (`core.policy.knob.Declared`), with no second copy in the class."""

from __future__ import annotations

import dataclasses
import typing

import pytest

from reasonkv.core.policy.knob import BOUNDS_KEY
from reasonkv.methods.registry import METHODS, get_method


def outside(cls: type, field: dataclasses.Field) -> object | None:
    """A value just outside what the field declares, or None where it declares nothing."""
    hint = typing.get_type_hints(cls).get(field.name)
    if typing.get_origin(hint) is typing.Literal:
        return "bogus"
    bounds = field.metadata.get(BOUNDS_KEY)
    if bounds is None:
        return None
    if bounds.ge is not None:
        return bounds.ge - 1
    if bounds.gt is not None:
        return bounds.gt
    if bounds.le is not None:
        return bounds.le + 1
    return bounds.lt


def parts(name: str) -> list[type]:
    spec = get_method(name)
    found = (spec.scorer, spec.schedule, spec.allocator, spec.head_allocator)
    return [c for c in found if isinstance(c, type) and dataclasses.is_dataclass(c)]


def test_every_declared_knob_of_every_part_is_checked_when_built_directly() -> None:
    classes = {cls for name in METHODS for cls in parts(name)}
    checked = []
    for cls in sorted(classes, key=lambda c: c.__name__):
        cls()  # the defaults are inside
        for field in dataclasses.fields(cls):
            bad = outside(cls, field) if field.init else None
            if bad is None:
                continue
            with pytest.raises(ValueError, match=f"^{field.name} must be"):
                cls(**{field.name: bad})
            checked.append(f"{cls.__name__}.{field.name}")
    # Scorers, schedules and allocators alike.
    assert {"BeaconKVScorer.recent", "H2OScorer.recent_ratio", "EveryStep.evict_every"} <= set(checked)
    assert any(c.startswith("PyramidAllocator.") for c in checked)
    assert any(c.startswith("AdaKVHeadAllocator.") for c in checked)
