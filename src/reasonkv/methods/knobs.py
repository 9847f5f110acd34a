"""A method's knobs: which exist, which values they take, and which part of the method owns
each. The one place that checks them, for the API, the CLI and sweeps alike."""

from __future__ import annotations

import dataclasses
import numbers
import typing

from reasonkv.core.policy.contract import Allocator
from reasonkv.core.policy.knob import MAX_TOKENS, Bounds, declared_bounds
from reasonkv.core.quantize import default_residual
from reasonkv.core.step import LayerPolicy
from reasonkv.methods.presets import PRESETS
from reasonkv.methods.profiles import load_profile
from reasonkv.methods.registry import PROTECTION_BOUNDS, PROTECTION_KNOBS, MethodSpec, get_method


class KnobError(ValueError):
    """An unknown knob, a value of the wrong type, outside its choices or range, knobs that do
    not fit together, or a bad budget."""


class BudgetError(KnobError):
    """A budget the setting cannot run at, its knobs being fine: none where the method
    compresses, one out of range, or one whose post-compression size is below the protected
    window. A sweep records it as that unit's failure and runs the setting's other budgets."""


def check_known(names, valid, owner: str) -> None:
    """Raise KnobError naming every name not in `valid` (`owner`: "method 'x'" or "methods a, b")."""
    unknown = sorted(set(names) - set(valid))
    if unknown:
        raise KnobError(
            f"unknown parameter(s) {', '.join(unknown)} for {owner}; valid: {', '.join(sorted(valid))}"
        )


def _knob_classes(spec: MethodSpec) -> list[type]:
    parts = (spec.scorer, spec.schedule, spec.allocator, spec.head_allocator, spec.storage)
    return [c for c in parts if isinstance(c, type) and dataclasses.is_dataclass(c)]


def _declaring(spec: MethodSpec, name: str) -> list[type]:
    return [c for c in _knob_classes(spec) if name in {f.name for f in dataclasses.fields(c) if f.init}]


def _hint(cls: type, name: str):
    try:
        return typing.get_type_hints(cls).get(name)
    except Exception:  # an unresolvable annotation only costs us the check
        return None


def literal_choices(spec: MethodSpec, name: str) -> tuple | None:
    """The allowed values of a knob annotated with typing.Literal, or None."""
    for cls in _declaring(spec, name):
        hint = _hint(cls, name)
        if typing.get_origin(hint) is typing.Literal:
            return typing.get_args(hint)
    return None


def knob_bounds(spec: MethodSpec, name: str) -> list[Bounds]:
    """Every range declared for the knob (a knob two parts share must suit both)."""
    found = [declared_bounds(cls, name) for cls in _declaring(spec, name)]
    found.append(PROTECTION_BOUNDS.get(name))
    return [b for b in found if b is not None]


def knob_rule(spec: MethodSpec, name: str) -> str | None:
    """What the knob accepts, in words ('in (0, 1)', 'one of max, avg', 'true or false'), or
    None when nothing is declared for it."""
    choices = literal_choices(spec, name)
    if choices is not None:
        return "one of " + ", ".join(map(str, choices))
    if isinstance(spec.knobs().get(name), bool):
        return "true or false"
    bounds = knob_bounds(spec, name)
    return " and ".join(dict.fromkeys(b.describe() for b in bounds)) or None


def _expected_type(spec: MethodSpec, name: str, default: object) -> type | None:
    """The type a knob's value must have: its default's, or for a None default (an optional
    knob) the annotation's other type."""
    if default is not None:
        return type(default)
    for cls in _declaring(spec, name):
        args = [a for a in typing.get_args(_hint(cls, name)) if a is not type(None)]
        if len(args) == 1 and args[0] in (bool, int, float, str):
            return args[0]
    return None


def _check_type(spec: MethodSpec, name: str, value: object, default: object) -> object:
    kind = _expected_type(spec, name, default)
    if value is None and default is None:
        return value
    if kind is bool:
        ok, expected = isinstance(value, bool), "true or false"
    elif kind is int:
        ok, expected = isinstance(value, int) and not isinstance(value, bool), "an integer"
    elif kind is float:
        ok, expected = isinstance(value, (int, float)) and not isinstance(value, bool), "a number"
        value = float(value) if ok else value
    elif kind is str:
        ok, expected = isinstance(value, str), "a string"
    else:  # an object default: nothing to compare against
        ok, expected = True, ""
    if not ok:
        raise KnobError(f"parameter {name!r} of {spec.name!r} expects {expected}, got {value!r}")
    return value


def check_values(spec: MethodSpec, knobs: dict[str, object]) -> dict[str, object]:
    """Each knob's name, type, choices and range against the method, one at a time.

    Types follow the default (for a None default, the annotation): an int knob takes an int, a
    float knob an int or float, a bool knob true/false; Literal-annotated knobs take one of
    their choices; a knob declared with `reasonkv.core.policy.knob.knob` must be in its range.

    For a preset the result is its knobs with the given ones over them: what a record of it
    keeps, so the record says what ran without the preset's definition beside it.
    """
    defaults = spec.knobs()
    check_known(knobs, defaults, f"method {spec.name!r}")
    out: dict[str, object] = {}
    if spec.preset_of is not None:
        out.update(PRESETS[spec.name].knobs)
    for name, value in knobs.items():
        value = _check_type(spec, name, value, defaults[name])
        choices = literal_choices(spec, name)
        if choices is not None and value not in choices:
            allowed = ", ".join(map(str, choices))
            raise KnobError(f"parameter {name!r} of {spec.name!r} expects one of {allowed}, got {value!r}")
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            for bounds in knob_bounds(spec, name):
                if not bounds.admits(value):
                    raise KnobError(
                        f"parameter {name!r} of {spec.name!r} must be {bounds.describe()}, got {value!r}"
                    )
        out[name] = value
    return out


def check_knobs(spec: MethodSpec, knobs: dict[str, object]) -> dict[str, object]:
    """`check_values`, then the rules between knobs (the parts' own checks when built) and the
    profile a profile-driven method names: the knobs of a method checked without a budget. With
    a budget, `resolved.resolve_method` does all of it once."""
    out = check_values(spec, knobs)
    build_parts(spec, out)
    check_profile(spec, out)
    return out


def check_profile(spec: MethodSpec, knobs: dict[str, object]) -> None:
    """Read the profile a profile-driven method names now: a bad one should not wait for the model."""
    if isinstance(knobs.get("profile"), str):
        try:
            load_profile(knobs["profile"])
        except (ValueError, FileNotFoundError) as err:
            raise KnobError(f"parameter 'profile' of {spec.name!r}: {err}") from None


def build_parts(spec: MethodSpec, overrides: dict) -> tuple[Allocator, LayerPolicy]:
    """The method's layer allocator and the policy every layer applies (scorer, schedule, head
    allocator, protection, storage format; no RoPE: the model gives it), with these knobs over
    the defaults. A part that refuses its knobs together (its own ValueError) is a KnobError
    naming the method."""
    routed = route_knobs(spec, overrides)
    try:
        schedule = spec.schedule
        policy = LayerPolicy(
            scorer=spec.scorer(**routed["scorer"]),
            schedule=schedule(**routed["schedule"]) if isinstance(schedule, type) else schedule,
            head_allocator=spec.head_allocator(**routed["head_allocator"]) if spec.head_allocator else None,
            kv_format=spec.storage(**routed["storage"]),
            **routed["protection"],
        )
        return spec.allocator(**routed["allocator"]), policy
    except KnobError:
        raise
    except (ValueError, TypeError) as err:
        raise KnobError(f"parameters of {spec.name!r} do not fit together: {err}") from None


def check_budget(spec: MethodSpec, budget: object) -> int | None:
    """The budget as an int, a whole number of tokens per KV head in [1, MAX_TOKENS]; None for a
    method that never compresses (it ignores any budget). Whether compressing at it keeps the
    protected window is `check_policy_budget`."""
    if not spec.compresses:
        return None
    if isinstance(budget, bool) or not isinstance(budget, numbers.Integral) or not 1 <= budget <= MAX_TOKENS:
        raise BudgetError(
            f"budget must be a positive number of tokens per KV head (at most 10^9), got {budget!r}"
        )
    return int(budget)


def check_policy_budget(spec: MethodSpec, budget: int, policy: LayerPolicy) -> None:
    """Every allocator keeps the mean budget, so some layer gets at most `budget`: if the
    schedule's target for it is below n_sink + n_recent, no allocation can work, and the model
    need not be loaded to say so."""
    try:
        kept = policy.schedule.target(budget)
    except ValueError as err:  # a schedule that cannot work with this budget says why
        raise BudgetError(f"budget {budget} does not work for {spec.name!r}: {err}") from None
    check_protected_window(spec, budget, kept, policy.protected)


def at_budget(spec: MethodSpec, budget: int | None, knobs: dict[str, object]) -> dict[str, object]:
    """The checked `knobs` as a cache at `budget` uses them: with the residual the budget gives
    (`default_residual`) where the method compresses and neither the knobs nor the method set
    one. Records keep the knobs as given, so the default never enters a unit's key."""
    if not spec.compresses or "residual" in knobs or "residual" in spec.defaults:
        return knobs
    return {**knobs, "residual": default_residual(budget)}


def min_budget(schedule, protected: int) -> int:
    """The smallest per-head budget whose post-compression size still holds the protected
    window (allocators that move budget between layers must not go below it). A bounded
    search (targets do not shrink as budgets grow: doubling, then halving the gap), so a
    schedule that never keeps enough is an error, not a hang."""
    low = high = max(protected, 1)
    while schedule.target(high) < protected:
        if high >= MAX_TOKENS:
            raise KnobError(
                f"no budget up to 10^9 tokens keeps the protected window of {protected} tokens "
                f"after compressing with {schedule.describe()}"
            )
        low, high = high + 1, min(2 * high, MAX_TOKENS)
    while low < high:  # target(high) >= protected; the answer is in [low, high]
        mid = (low + high) // 2
        low, high = (low, mid) if schedule.target(mid) >= protected else (mid + 1, high)
    return high


def check_protected_window(spec: MethodSpec, budget: int, kept: int, protected: int) -> None:
    """Refuse a budget whose post-compression size `kept` is below the protected window."""
    if kept < protected:
        raise BudgetError(
            f"budget {budget} is below the protected window: method {spec.name!r} keeps at least "
            f"n_sink + n_recent = {protected} tokens per head (after compressing it keeps {kept})"
        )


def share_knobs(
    methods: list[str], shared: dict[str, object], per_method: dict[str, dict] | None = None
) -> dict[str, dict[str, object]]:
    """Each method's knobs, not yet checked: a shared knob goes to every method that has it (one
    that no method has is a typo, and an error), `per_method[name]` to that method only, over
    the shared ones. A method that never compresses gets only its storage knobs (kv_bits...):
    the others would change nothing. Their values are checked where each setting resolves."""
    specs = {name: get_method(name) for name in dict.fromkeys(methods)}
    known = set().union(*(spec.knobs() for spec in specs.values()))
    check_known(shared, known, f"methods {', '.join(specs)}")
    out = {}
    for name, spec in specs.items():
        mine = {k: v for k, v in shared.items() if k in spec.knobs()}
        mine.update((per_method or {}).get(name, {}))
        if not spec.compresses:
            mine = {k: v for k, v in mine.items() if k in storage_knobs(spec)}
        out[name] = mine
    return out


def storage_knobs(spec: MethodSpec) -> dict[str, object]:
    """The knobs of how the method's cache stores K/V (kv_bits, group_size, residual), with
    the method's defaults."""
    names = {f.name for f in dataclasses.fields(spec.storage) if f.init}
    return {k: v for k, v in spec.knobs().items() if k in names}


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
        "storage": fields_of(spec.storage),
        "protection": {k: knobs[k] for k in PROTECTION_KNOBS},
    }


def stores_quantized(method: str, knobs: dict) -> bool:
    """Whether `method` with `knobs` keeps any K/V below the model's precision (its storage
    format's `below_model_precision`). Unknown methods raise ValueError."""
    spec = get_method(method)
    storage = storage_knobs(spec)
    storage.update((k, v) for k, v in knobs.items() if k in storage)
    return spec.storage(**storage).below_model_precision
