"""A knob's allowed range, declared where the knob is declared.

A policy's knobs are its dataclass fields. Declaring one with `knob(default, ge=..., gt=...,
le=..., lt=...)` attaches its `Bounds` to the field, so the one check of every knob
(`reasonkv.methods.knobs.check_knobs`) and `reasonkv methods` read the range from the field
itself: a new knob gets its range where it is written. `knob(default)` with no bounds
declares a knob that takes any value of its type (a file path). Choices are the field's
`typing.Literal` annotation, and a bool's are true and false, so neither needs a range.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import typing
from dataclasses import dataclass

MAX_TOKENS = 10**9
"""The upper bound of every token count (budgets, windows, intervals): far above any real
cache, and small enough that sums and products of a few of them stay exact in int64."""

BOUNDS_KEY = "reasonkv_bounds"


def _number(value: float) -> str:
    if isinstance(value, int) and value >= 10**6 and math.log10(value).is_integer():
        return f"10^{int(math.log10(value))}"
    return f"{value:g}" if isinstance(value, float) else str(value)


@dataclass(frozen=True)
class Bounds:
    """ge/gt: the lower bound, inclusive or not; le/lt: the upper bound. None = unbounded.
    NaN is never inside (every comparison with it is false)."""

    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None

    def admits(self, value: float) -> bool:
        checks = (
            self.ge is None or value >= self.ge,
            self.gt is None or value > self.gt,
            self.le is None or value <= self.le,
            self.lt is None or value < self.lt,
        )
        return all(checks) and value == value

    def describe(self) -> str:
        """'in (0, 1)', 'in [1, 10^9]', '> 0', or 'any value'."""
        lo = (self.ge, "[") if self.ge is not None else (self.gt, "(") if self.gt is not None else None
        hi = (self.le, "]") if self.le is not None else (self.lt, ")") if self.lt is not None else None
        if lo and hi:
            return f"in {lo[1]}{_number(lo[0])}, {_number(hi[0])}{hi[1]}"
        if lo:
            return f"{'>=' if lo[1] == '[' else '>'} {_number(lo[0])}"
        if hi:
            return f"{'<=' if hi[1] == ']' else '<'} {_number(hi[0])}"
        return "any value"


def knob(default, *, ge=None, gt=None, le=None, lt=None, **field_kwargs):
    """A dataclass field whose allowed values are [ge or (gt, le] or lt) (see `Bounds`)."""
    metadata = {**field_kwargs.pop("metadata", {}), BOUNDS_KEY: Bounds(ge, gt, le, lt)}
    return dataclasses.field(default=default, metadata=metadata, **field_kwargs)


def tokens(default: int | None, minimum: int = 1, **field_kwargs):
    """A token count knob: an integer in [minimum, MAX_TOKENS]."""
    return knob(default, ge=minimum, le=MAX_TOKENS, **field_kwargs)


def unit(default: float, *, open_low: bool = False, open_high: bool = False):
    """A knob in [0, 1], either end open."""
    return knob(
        default,
        ge=None if open_low else 0.0,
        gt=0.0 if open_low else None,
        le=None if open_high else 1.0,
        lt=1.0 if open_high else None,
    )


def declared_bounds(cls: type, name: str) -> Bounds | None:
    """The Bounds of `cls`'s field `name` when it is declared with `knob`, else None."""
    if not dataclasses.is_dataclass(cls):
        return None
    for f in dataclasses.fields(cls):
        if f.name == name:
            return f.metadata.get(BOUNDS_KEY)
    return None


def check_declared(obj: object) -> None:
    """Raise ValueError for a field of the dataclass `obj` outside what its declaration allows
    (a `knob` range, or a `typing.Literal`'s choices): a policy built directly, not through
    `check_knobs`, is held to the same declaration. Rules between knobs are the class's own."""
    hints = _literal_hints(type(obj))
    for f in dataclasses.fields(obj):
        if not f.init:
            continue
        value = getattr(obj, f.name)
        bounds = f.metadata.get(BOUNDS_KEY)
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if bounds is not None and number and not bounds.admits(value):
            raise ValueError(f"{f.name} must be {bounds.describe()}, got {value!r}")
        choices = hints.get(f.name)
        if choices is not None and value not in choices:
            raise ValueError(f"{f.name} must be one of {', '.join(map(repr, choices))}, got {value!r}")


@functools.cache
def _literal_hints(cls: type) -> dict[str, tuple]:
    """The choices of each field of `cls` annotated with a `typing.Literal`, resolved once."""
    try:
        hints = typing.get_type_hints(cls)
    except NameError:  # an annotation only a type checker resolves (as check_knobs, skip them)
        return {}
    return {k: typing.get_args(h) for k, h in hints.items() if typing.get_origin(h) is typing.Literal}


class Declared:
    """A policy part whose dataclass fields are its knobs: a dataclass subclass's generated
    `__init__` calls this `__post_init__`, so every part built, through `check_knobs` or
    directly, is held to its declarations. A subclass with rules between knobs extends it."""

    def __post_init__(self) -> None:
        check_declared(self)
