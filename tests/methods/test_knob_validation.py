"""Every knob is checked for its type, choices and range, the same way for make_cache and the
CLI, before any model loads: a bad value is one KnobError (a ValueError) that names the knob
and what it accepts, never a hang or another exception."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import reasonkv
from conftest import tiny_model
from method_helpers import time_limit
from reasonkv.core.policy.allocators.reasonalloc import layer_budgets
from reasonkv.core.policy.base import pool_tokens
from reasonkv.core.policy.knob import Bounds, knob
from reasonkv.core.policy.schedules import MaxMinThreshold, Schedule
from reasonkv.methods.knobs import BudgetError, KnobError, check_budget, check_knobs, knob_rule, min_budget
from reasonkv.methods.registry import METHODS


# ------------------------------------------------------------- the found bugs
@pytest.mark.parametrize("method", ["beaconkv", "reasonalloc-beaconkv", "recent-query", "random"])
@pytest.mark.parametrize("fraction", [1.0, 1, 1.5, 0.0, -0.25, math.nan, math.inf])
def test_a_threshold_fraction_outside_0_1_is_refused_not_a_hang(method: str, fraction) -> None:
    with time_limit(10), pytest.raises(KnobError, match=r"parameter 'fraction' of .* must be in \(0, 1\)"):
        reasonkv.make_cache(tiny_model("llama"), method, 32, fraction=fraction)


def test_the_message_names_the_knob_the_method_the_range_and_the_value() -> None:
    with pytest.raises(KnobError) as err:
        reasonkv.make_cache(tiny_model("llama"), "beaconkv", 32, fraction=1.0)
    assert str(err.value) == "parameter 'fraction' of 'beaconkv' must be in (0, 1), got 1.0"
    assert isinstance(err.value, ValueError)


class KeepsNothing(Schedule):
    """A schedule whose target never reaches any protected window (none of ours can be built
    so: `fraction` is declared in (0, 1), and a part built by hand is held to that too)."""

    def target(self, budget: int) -> int:
        return 0

    def describe(self) -> str:
        return "keeps-nothing"


def test_min_budget_is_a_bounded_search() -> None:
    """A schedule whose target never reaches the protected window: an error, quickly, not an
    endless loop."""
    with time_limit(5), pytest.raises(ValueError, match="no budget up to 10\\^9"):
        min_budget(KeepsNothing(), 20)
    with pytest.raises(ValueError, match=r"^fraction must be in \(0, 1\), got 1.0"):
        MaxMinThreshold(fraction=1.0)


@pytest.mark.parametrize("fraction", [0.01, 0.125, 0.5, 0.9, 0.999])
@pytest.mark.parametrize("protected", [0, 1, 7, 20, 333])
def test_min_budget_is_the_smallest_budget_that_keeps_the_window(fraction: float, protected: int) -> None:
    schedule = MaxMinThreshold(fraction=fraction)
    found = min_budget(schedule, protected)
    assert schedule.target(found) >= protected
    assert found == max(protected, 1) or schedule.target(found - 1) < protected


# ------------------------------------------------------------ ranges, one by one
BAD_KNOBS = [
    ("reasonalloc-rkv", {"tau": 0}, "'tau' of 'reasonalloc-rkv' must be > 0, got 0.0"),
    ("reasonalloc-rkv", {"tau": -1.0}, "must be > 0"),
    ("snapkv", {"interval": 0}, "'interval' of 'snapkv' must be in [1, 10^9], got 0"),
    ("rkv", {"interval": -8}, "'interval' of 'rkv' must be in [1, 10^9]"),
    ("rpc", {"interval": 0}, "'interval' of 'rpc' must be in [1, 10^9]"),
    ("rpc", {"interval": "often"}, "'interval' of 'rpc' expects an integer"),
    ("rpc", {"ratio": 0.5}, "'ratio' of 'rpc' must be in [1, 10^6]"),
    ("snapkv", {"window": -1}, "'window' of 'snapkv' must be in [1, 10^9]"),
    ("pyramidkv", {"window": 0}, "'window' of 'pyramidkv' must be in [1, 10^9]"),  # the scorer's rule
    ("snapkv", {"n_recent": -1}, "'n_recent' of 'snapkv' must be in [0, 10^9]"),
    ("beaconkv", {"n_sink": -4}, "'n_sink' of 'beaconkv' must be in [0, 10^9]"),
    ("adakv-snapkv", {"n_sink": -1}, "'n_sink' of 'adakv-snapkv' must be in [0, 10^9]"),
    ("snapkv", {"kernel": 0}, "'kernel' of 'snapkv' must be in [1, 1024], got 0"),
    ("rkv", {"kernel": 10**6}, "'kernel' of 'rkv' must be in [1, 1024]"),
    ("reasonalloc-rkv", {"ema": 1.5}, "'ema' of 'reasonalloc-rkv' must be in [0, 1]"),
    ("reasonalloc-rkv", {"step_ema": 1.0}, "'step_ema' of 'reasonalloc-rkv' must be in [0, 1)"),
    ("reasonalloc-rkv", {"floor_ratio": -0.1}, "'floor_ratio' of 'reasonalloc-rkv' must be in [0, 1]"),
    ("reasonalloc-rkv", {"entropy_every": 0}, "'entropy_every' of 'reasonalloc-rkv' must be in [1, 10^9]"),
    ("rkv", {"mix_lambda": 1.1}, "'mix_lambda' of 'rkv' must be in [0, 1]"),
    ("rkv", {"sim_threshold": 2.0}, "'sim_threshold' of 'rkv' must be in [-1, 1]"),
    ("h2o", {"recent_ratio": -0.5}, "'recent_ratio' of 'h2o' must be in [0, 1]"),
    ("h2o", {"compact_every": 0}, "'compact_every' of 'h2o' must be in [1, 10^9]"),
    ("adakv-rkv", {"floor_alpha": 2}, "'floor_alpha' of 'adakv-rkv' must be in [0, 1]"),
    ("pyramidkv", {"beta": 0.5}, "'beta' of 'pyramidkv' must be >= 1"),
    ("beaconkv", {"beacon_max": 1}, "'beacon_max' of 'beaconkv' must be in [2, 10^9]"),
    ("beaconkv", {"beacon_min": 0}, "'beacon_min' of 'beaconkv' must be in [1, 10^9]"),
    ("beaconkv", {"recent": 0}, "'recent' of 'beaconkv' must be in [1, 10^9]"),
    ("beaconkv", {"upkeep_every": 0}, "'upkeep_every' of 'beaconkv' must be in [1, 10^9]"),
    ("beaconkv", {"beacon_min": 40}, "parameters of 'beaconkv' do not fit together: need 1 <= beacon_min"),
    ("beaconkv", {"beacon_min": 8, "beacon_max": 8}, "do not fit together"),
    ("recent-query", {"window": 0}, "'window' of 'recent-query' must be in [1, 10^9]"),
    ("random", {"seed": -1}, "'seed' of 'random' must be >= 0"),
    ("tova", {"window": 0}, "'window' of 'tova' must be in [1, 10^9]"),
    ("streaming", {"window": -1}, "'window' of 'streaming' must be in [0, 10^9]"),
    ("snapkv", {"window": 10**12}, "'window' of 'snapkv' must be in [1, 10^9]"),
    ("snapkv", {"window": "abc"}, "'window' of 'snapkv' expects an integer, got 'abc'"),
    ("snapkv", {"pooling": "median"}, "'pooling' of 'snapkv' expects one of max, avg, none"),
    ("reasonalloc-rkv", {"profile": 3}, "'profile' of 'reasonalloc-rkv' expects a string"),
]


@pytest.mark.parametrize(("method", "knobs", "message"), BAD_KNOBS)
def test_a_knob_outside_its_range_is_a_knob_error_before_any_model(method, knobs, message) -> None:
    with pytest.raises(KnobError) as err:
        check_knobs(METHODS[method], knobs)
    assert message in str(err.value)
    assert len(str(err.value).splitlines()) == 1


@pytest.mark.parametrize(("method", "knobs", "message"), BAD_KNOBS[:6])
def test_make_cache_runs_the_same_check(method, knobs, message) -> None:
    with pytest.raises(KnobError, match=message.replace("[", r"\[").replace("^", r"\^")):
        reasonkv.make_cache(tiny_model("llama"), method, 64, **knobs)


def test_a_wrong_type_through_the_api_is_a_knob_error_not_a_type_error() -> None:
    with pytest.raises(KnobError, match="parameter 'window' of 'snapkv' expects an integer, got 'abc'"):
        reasonkv.make_cache(tiny_model("llama"), "snapkv", 128, window="abc")


@pytest.mark.parametrize("tau", [1e-3, 1e-6, 1e-300])
def test_a_small_tau_keeps_the_exact_total(tau: float) -> None:
    """demand^(1/tau) overflowed to inf below tau ~ 1e-3 and the budgets lost their total."""
    demand = torch.tensor([0.5, 1.0, 3.0, 2.0], dtype=torch.float64)
    budgets = layer_budgets(demand, 2, 64, tau, lo=12)
    assert int(budgets.sum()) == 4 * 2 * 64 and int(budgets.min()) >= 12
    assert int(budgets[2, 0]) == int(budgets.max())  # the peak layer takes everything above the floor


@pytest.mark.parametrize("kernel", [1, 2, 4, 5])
def test_any_kernel_from_1_pools_to_the_same_length(kernel: int) -> None:
    """Even kernels work too (they lean one token to the past); 1 is no pooling."""
    scores = torch.rand(1, 2, 9)
    for how in ("max", "avg"):
        assert pool_tokens(scores, kernel, how).shape == scores.shape
    assert torch.equal(pool_tokens(scores, 1, "max"), scores)


# ------------------------------------------------------------------ budgets
@pytest.mark.parametrize("budget", [True, 0, -1, 2.5, "64", None, 10**30, 2**63, 10**9 + 1])
def test_a_budget_that_is_not_a_sane_positive_int_is_refused(budget) -> None:
    with pytest.raises(KnobError, match="budget must be a positive number of tokens per KV head"):
        check_budget(METHODS["snapkv"], budget)
    with pytest.raises(KnobError, match="budget must be a positive number"):
        reasonkv.make_cache(tiny_model("llama"), "snapkv", budget)


def test_a_numpy_integer_budget_is_taken() -> None:
    assert check_budget(METHODS["snapkv"], np.int64(64)) == 64
    assert reasonkv.make_cache(tiny_model("llama"), "snapkv", np.int64(64)).live_token_bound() == 64 + 127


@pytest.mark.parametrize(
    ("method", "budget", "knobs"),
    [
        ("snapkv", 9, {"n_sink": 4, "n_recent": 6}),
        ("pyramidkv", 7, {}),  # n_recent 8: some layer gets at most the mean budget
        ("reasonalloc-rkv", 7, {}),
        ("beaconkv", 20, {}),  # threshold: 20 - 2 = 18 kept, n_sink + n_recent = 20
        ("adakv-snapkv", 4, {}),
    ],
)
def test_a_budget_below_the_protected_window_is_caught_without_the_model(method, budget, knobs) -> None:
    with pytest.raises(KnobError, match="below the protected window"):
        reasonkv.resolve_method(method, budget, knobs)
    with pytest.raises(KnobError, match="below the protected window"):
        reasonkv.make_cache(tiny_model("llama"), method, budget, **knobs)


def test_a_periodic_interval_that_keeps_nothing_is_a_knob_error_whatever_the_budget() -> None:
    """interval // ratio = 0 is the knobs' fault, not the budget's: a sweep grid refuses it
    when it loads rather than failing the method's units at every budget."""
    with pytest.raises(KnobError, match="do not fit together: interval 3 keeps interval // ratio = 0") as err:
        reasonkv.resolve_method("rpc", 64, {"interval": 3})
    assert not isinstance(err.value, BudgetError)
    assert check_knobs(METHODS["rpc"], {"interval": 4}) == {"interval": 4}


# ------------------------------------------------------- every knob is declared
@pytest.mark.parametrize("method", list(METHODS))
def test_every_knob_has_a_declared_range_or_choices(method: str) -> None:
    """A knob added without `knob(...)` (or a Literal annotation, or a bool default) fails here."""
    spec = METHODS[method]
    undeclared = [name for name in spec.knobs() if knob_rule(spec, name) is None]
    assert not undeclared, f"{method}: declare these knobs with reasonkv.core.policy.knob.knob: {undeclared}"


@pytest.mark.parametrize("method", list(METHODS))
def test_every_method_default_is_inside_its_range(method: str) -> None:
    spec = METHODS[method]
    assert check_knobs(spec, spec.knobs()).keys() == spec.knobs().keys()


def test_bounds_describe_themselves_and_refuse_nan() -> None:
    assert Bounds(gt=0.0, lt=1.0).describe() == "in (0, 1)"
    assert Bounds(ge=1, le=10**9).describe() == "in [1, 10^9]"
    assert Bounds(gt=0.0).describe() == "> 0"
    assert Bounds(le=5).describe() == "<= 5"
    assert Bounds().describe() == "any value"
    assert not Bounds(ge=0.0).admits(math.nan) and Bounds().admits(3)
    assert knob(3, ge=1).metadata["reasonkv_bounds"] == Bounds(ge=1)
