"""A method's knobs: which exist, which values they take, and which part of the method owns
each. The one place that checks them, for the API, the CLI and sweeps alike."""

from __future__ import annotations

import dataclasses
import typing

from reasonkv.methods.registry import PROTECTION_KNOBS, MethodSpec, get_method


class KnobError(ValueError):
    """An unknown knob, or a value of the wrong type or outside its choices."""


def check_known(names, valid, owner: str) -> None:
    """Raise KnobError naming every name not in `valid` (`owner`: "method 'x'" or "methods a, b")."""
    unknown = sorted(set(names) - set(valid))
    if unknown:
        raise KnobError(
            f"unknown parameter(s) {', '.join(unknown)} for {owner}; valid: {', '.join(sorted(valid))}"
        )


def _knob_classes(spec: MethodSpec) -> list[type]:
    parts = (spec.scorer, spec.schedule, spec.allocator, spec.head_allocator)
    return [c for c in parts if isinstance(c, type)]


def literal_choices(spec: MethodSpec, name: str) -> tuple | None:
    """The allowed values of a knob annotated with typing.Literal, or None."""
    for cls in _knob_classes(spec):
        if not dataclasses.is_dataclass(cls) or name not in {f.name for f in dataclasses.fields(cls)}:
            continue
        try:
            hint = typing.get_type_hints(cls).get(name)
        except Exception:  # an unresolvable annotation only costs us the check
            return None
        if typing.get_origin(hint) is typing.Literal:
            return typing.get_args(hint)
    return None


def check_knobs(spec: MethodSpec, knobs: dict[str, object]) -> dict[str, object]:
    """Validate names and types against the method's defaults before the (slow) model load.

    Types follow the default: an int knob takes an int, a float knob an int or float, a bool
    knob true/false; Literal-annotated knobs take one of their choices.
    """
    defaults = spec.knobs()
    check_known(knobs, defaults, f"method {spec.name!r}")
    out: dict[str, object] = {}
    for name, value in knobs.items():
        default = defaults[name]
        if isinstance(default, bool):
            ok, expected = isinstance(value, bool), "true or false"
        elif isinstance(default, int):
            ok, expected = isinstance(value, int) and not isinstance(value, bool), "an integer"
        elif isinstance(default, float):
            ok, expected = isinstance(value, (int, float)) and not isinstance(value, bool), "a number"
            value = float(value) if ok else value
        elif isinstance(default, str):
            ok, expected = isinstance(value, str), "a string"
        else:  # None or an object default: nothing to compare against
            ok, expected = True, ""
        if not ok:
            raise KnobError(f"parameter {name!r} of {spec.name!r} expects {expected}, got {value!r}")
        choices = literal_choices(spec, name)
        if choices is not None and value not in choices:
            allowed = ", ".join(map(str, choices))
            raise KnobError(f"parameter {name!r} of {spec.name!r} expects one of {allowed}, got {value!r}")
        out[name] = value
    return out


def knobs_for_methods(
    methods: list[str], shared: dict[str, object], per_method: dict[str, dict] | None = None
) -> dict[str, dict[str, object]]:
    """Each method's checked knobs: a shared knob goes to every method that has it (one that no
    method has is a typo, and an error), `per_method[name]` to that method only, over the shared
    ones. A method that never compresses gets none: they would change nothing."""
    specs = {name: get_method(name) for name in dict.fromkeys(methods)}
    known = set().union(*(spec.knobs() for spec in specs.values()))
    check_known(shared, known, f"methods {', '.join(specs)}")
    out = {}
    for name, spec in specs.items():
        mine = {k: v for k, v in shared.items() if k in spec.knobs()}
        mine.update((per_method or {}).get(name, {}))
        out[name] = check_knobs(spec, mine) if spec.compresses else {}
    return out


def route_knobs(spec: MethodSpec, overrides: dict) -> dict[str, dict]:
    """Every knob (defaults, then overrides) routed to the part that owns it: scorer, schedule,
    allocator, head_allocator, protection (a knob two parts share goes to both)."""
    knobs = spec.knobs()
    check_known(overrides, knobs, f"method {spec.name!r}")
    knobs.update(overrides)

    def fields_of(cls) -> dict:
        if not isinstance(cls, type):
            return {}
        names = {f.name for f in dataclasses.fields(cls) if f.init and f.name != "name"}
        return {k: v for k, v in knobs.items() if k in names}

    return {
        "scorer": fields_of(spec.scorer),
        "schedule": fields_of(spec.schedule),
        "allocator": fields_of(spec.allocator),
        "head_allocator": fields_of(spec.head_allocator),
        "protection": {k: knobs[k] for k in PROTECTION_KNOBS},
    }
