"""What a benchmark measures: the runs (the reference first), and the step windows."""

from __future__ import annotations

from collections.abc import Iterable

from reasonkv.harness.replay_run import ReplayRun
from reasonkv.methods.registry import METHODS, get_method

BASELINE = "streaming"
"""The method each run's decode time is compared with at the same budget
(`overhead_vs_<BASELINE>`): streaming keeps a window without scoring, so the extra time of
another method over it is the cost of its scoring and selection."""

BenchRun = ReplayRun
"""One setting to measure: method, budget (None for the reference), knobs (the replay's run type)."""


def is_reference(method: str) -> bool:
    """Does this method keep every token (its spec does not compress)? Ratios are to it."""
    return get_method(method).compresses is False


def is_plain_reference(result: dict) -> bool:
    """Is this run (a result dict with its label) the reference as registered, not a variant
    given knobs of its own (`full:kv_bits=4`)? Every ratio divides by it."""
    return result["label"] == reference_method()


def reference_method() -> str:
    """The registered method that keeps every token: it writes the tokens every run is fed."""
    return next(name for name in METHODS if is_reference(name))


def plan_runs(methods: Iterable[str], budgets: Iterable[int], knobs: dict | None = None) -> list[BenchRun]:
    """The reference first (every ratio is to it), then every compressing method × budget. A knob
    goes to each method that has it."""
    knobs = knobs or {}
    names = list(dict.fromkeys([reference_method(), *methods]))
    runs = []
    for name in names:
        spec = get_method(name)
        own = {k: v for k, v in knobs.items() if k in spec.knobs()}
        if spec.compresses:
            runs += [BenchRun(name, int(b), own) for b in dict.fromkeys(budgets)]
        else:
            runs.append(BenchRun(name, None, own))
    return runs


def windows_of(n: int, window: int) -> list[tuple[int, int]]:
    """Decode-step windows [start, end) covering n steps; the last one may be shorter."""
    if window <= 0:
        raise ValueError(f"window must be positive, got {window}")
    return [(a, min(a + window, n)) for a in range(0, n, window)]
