"""Any method with any knobs and any budget, on a tiny random model: either make_cache refuses
with a clear ValueError (KnobError is one), or decoding runs and the cache keeps its bound.
Never a hang, never another exception. Values are drawn both inside and outside each knob's
range (and of the wrong type), so the check and the policies are tested together."""

from __future__ import annotations

import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import reasonkv
from conftest import greedy_loop, random_prompt, tiny_model
from method_helpers import time_limit
from reasonkv.methods.knobs import KnobError, knob_bounds, literal_choices
from reasonkv.methods.profiles import config_hash, save_profile
from reasonkv.methods.registry import METHODS

INT_OUTSIDE = [-3, -1, 0, 10**12, 2.5, "x", None]
FLOAT_OUTSIDE = [-0.5, 0.0, 1.0, 1.5, 4.0, 1e9, math.nan, math.inf, -math.inf, "x"]


def end(closed, open_) -> tuple[float, bool] | None:
    """One end of a range: (value, open?), or None when unbounded."""
    return (closed, False) if closed is not None else (open_, True) if open_ is not None else None


def inside(spec, name: str, default) -> st.SearchStrategy:
    """Values inside the knob's choices or range (small ones: a tiny model, short prompts)."""
    choices = literal_choices(spec, name)
    if choices is not None:
        return st.sampled_from(choices)
    if isinstance(default, bool):
        return st.booleans()
    bounds = knob_bounds(spec, name)
    lo, lo_open = max((end(b.ge, b.gt) for b in bounds if end(b.ge, b.gt)), default=(-8, False))
    hi, hi_open = min((end(b.le, b.lt) for b in bounds if end(b.le, b.lt)), default=(8, False))
    if isinstance(default, float):
        hi, hi_open = (8.0, False) if hi > 8 else (hi, hi_open)
        return st.floats(lo, hi, exclude_min=lo_open, exclude_max=hi_open)
    top = 12 if name in ("n_sink", "n_recent") else 40  # wider protection is mostly refused
    return st.integers(int(lo) + lo_open, min(int(hi) - hi_open, top))


def outside(spec, name: str, default) -> st.SearchStrategy:
    """Values outside the knob's range or of the wrong type (some may be inside: no harm)."""
    if literal_choices(spec, name) is not None:
        return st.sampled_from(["bogus", 1, None])
    if isinstance(default, bool):
        return st.sampled_from([1, "yes"])
    return st.sampled_from(FLOAT_OUTSIDE if isinstance(default, float) else INT_OUTSIDE)


@st.composite
def cases(draw):
    """Knobs inside their ranges (these should mostly run), in a third of the examples one knob
    outside (it should be refused), and in a sixth a bad budget."""
    method = draw(st.sampled_from(sorted(METHODS)), label="method")
    spec = METHODS[method]
    names = [n for n in spec.knobs() if n != "profile"]
    knobs = {}
    for name in names:
        if draw(st.integers(0, 2), label=f"set {name}") == 0:
            knobs[name] = draw(inside(spec, name, spec.knobs()[name]), label=name)
    if "interval" in names and "interval" not in knobs:  # compress within a short run
        knobs["interval"] = draw(st.integers(1, 16), label="interval")
    if draw(st.integers(0, 2), label="one bad knob") == 0:
        name = draw(st.sampled_from(names), label="bad knob")
        knobs[name] = draw(outside(spec, name, spec.knobs()[name]), label=f"bad {name}")
    bad_budget = draw(st.integers(0, 5), label="bad budget") == 0
    budgets = st.sampled_from([-1, 0, 1, True, 10**30]) if bad_budget else st.integers(4, 32)
    budget = draw(budgets, label="budget")
    prompt = draw(st.integers(1, 40), label="prompt length")
    steps = draw(st.integers(1, 16), label="steps")
    return method, knobs, budget, prompt, steps


@pytest.fixture(scope="module")
def profile(tmp_path_factory) -> str:
    model = tiny_model("llama")
    path = tmp_path_factory.mktemp("profile") / "tiny.json"
    save_profile({"model": "tiny", "config_hash": config_hash(model.config), "demand": [0.8, 0.3]}, path)
    return str(path)


def bound_checker(prompt_len: int):
    def check_bound(cache, fed: int) -> None:
        """Live tokens per head never above the method's bound (with a head allocator: per
        layer; live_token_bound counts a protected prompt itself)."""
        live = cache.memory()["live_tokens"]
        # A kept prompt stays whole even past the budget (every protected token is kept), and so
        # does the whole prompt until the first compression of a schedule that counts from the
        # prompt's end (phase=decode): the bound allows the prompt beside the budget either way.
        keeps_prompt = cache.policy.protect_prompt or cache.policy.schedule.from_prompt_end
        extra = prompt_len if keeps_prompt else 0
        bound = cache.live_token_bound()
        if bound is not None:
            assert int(live.max()) <= bound, f"a head holds {int(live.max())} tokens, bound {bound}"
        elif cache.policy.head_allocator is not None:
            heads = live.shape[-1]
            for layer, held in zip(cache.layers, live.sum(-1).tolist(), strict=True):
                total = layer.plan.trigger_total + heads * extra
                assert held < total, f"a layer holds {held} tokens, trigger {total}"

    return check_bound


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=cases())
def test_any_knobs_and_budget_give_a_clear_error_or_a_bounded_run(profile, case) -> None:
    method, knobs, budget, prompt_len, steps = case
    if "profile" in METHODS[method].knobs():
        knobs["profile"] = profile
    model = tiny_model("llama")
    with time_limit(20):
        try:
            cache = reasonkv.make_cache(model, method, budget, **knobs)
        except ValueError as err:
            assert str(err) and len(str(err).splitlines()) == 1
            if not isinstance(err, KnobError):  # the few errors that are not knob checks
                assert "profile" in str(err) or "periodic schedule" in str(err), err
            return
        prompt = random_prompt(prompt_len, seed=prompt_len)
        greedy_loop(model, prompt, cache, steps, after_step=bound_checker(prompt_len))
