"""A method is resolved once, at the edge where it is named: following the name from the CLI,
from `make_cache`, from a `CacheFactory`, from a sweep grid and from vLLM's config, the registry
and the knob checks are entered through `resolve_method` only, and only once. Counted with a
profiler hook on the code of every function that checks or builds a method, so an import under
another name counts too."""

from __future__ import annotations

import inspect
import json
import pickle
import sys
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch

import reasonkv
from cli_helpers import CharTokenizer, runner, tiny_llama
from reasonkv.cli import main as cli
from reasonkv.core.models import ModelShape
from reasonkv.harness import sweep
from reasonkv.methods import knobs, registry, resolved
from reasonkv.methods.api import build_policy
from reasonkv.serving.request_limits import check_fits
from reasonkv.serving.vllm.settings import read_settings

_MODULES = (knobs, registry, resolved)


def _functions(module) -> dict:
    """The module's own top-level functions, by code object."""
    return {
        f.__code__: name
        for name, f in vars(module).items()
        if inspect.isfunction(f) and f.__module__ == module.__name__
    }


RESOLVING = {code: name for module in _MODULES for code, name in _functions(module).items()}
INSIDE = {module.__file__ for module in _MODULES}


@contextmanager
def entries() -> Iterator[Counter]:
    """Calls of a resolving function from code outside the three resolving modules, by name."""
    seen: Counter = Counter()

    def hook(frame, event, _arg):
        if event == "call" and frame.f_code in RESOLVING:
            caller = frame.f_back
            if caller is None or caller.f_code.co_filename not in INSIDE:
                seen[RESOLVING[frame.f_code]] += 1

    previous = sys.getprofile()
    sys.setprofile(hook)
    try:
        yield seen
    finally:
        sys.setprofile(previous)


def test_the_counter_sees_a_resolution_and_its_absence() -> None:
    with entries() as seen:
        reasonkv.resolve_method("snapkv", 64, {"window": 8})
    assert seen == Counter(resolve_method=1)
    with entries() as seen:
        knobs.check_knobs(registry.get_method("snapkv"), {})
    assert seen == Counter(get_method=1, check_knobs=1)


def test_make_cache_by_name_resolves_once_and_a_resolved_value_not_again() -> None:
    model = tiny_llama("sdpa")
    with entries() as seen:
        reasonkv.make_cache(model, "beaconkv-lean", 64, recent=8)
    assert seen == Counter(resolve_method=1)
    value = reasonkv.resolve_method("rkv", 32)
    with entries() as seen:
        for _ in range(3):
            reasonkv.make_cache(model, value)
    assert seen == Counter()


def test_a_cache_factory_resolves_once_for_every_cache_it_makes() -> None:
    with entries() as seen:
        caches = reasonkv.CacheFactory(tiny_llama("sdpa"), "h2o", 32, recent_ratio=0.25)
        made = [caches() for _ in range(3)]
    assert seen == Counter(resolve_method=1)
    assert len({id(c) for c in made}) == 3 and all(c.policy.scorer.recent_ratio == 0.25 for c in made)


def test_a_cache_factory_takes_a_resolved_value_as_it_is() -> None:
    value = reasonkv.resolve_method("snapkv", 32, {"window": 4})
    with entries() as seen:
        caches = reasonkv.CacheFactory(tiny_llama("sdpa"), value)
        cache = caches()
    assert seen == Counter() and cache.policy.scorer.window == 4
    assert (caches.method, caches.budget, caches.knobs) == ("snapkv", 32, {"window": 4})
    with pytest.raises(TypeError, match="resolved method and knobs"):
        reasonkv.CacheFactory(tiny_llama("sdpa"), value, window=8)


def test_the_generate_command_resolves_once(fake_loader) -> None:
    args = ["generate", "--method", "snapkv", "--budget", "16", "-n", "4", "--set", "window=4", "hi there"]
    with entries() as seen:
        result = runner.invoke(cli.app, args)
    assert result.exit_code == 0, result.output
    assert seen == Counter(resolve_method=1)


def test_vllm_settings_resolve_once_and_the_engine_checks_reuse_them() -> None:
    shape = ModelShape("tiny", "llama", n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16)
    config = {"reasonkv": {"method": "beaconkv", "budget": 64, "upkeep_every": 16}}
    with entries() as seen:
        settings = read_settings(config)
        _, policy = build_policy(settings, shape)
        check_fits(settings, policy, shape, max_model_len=1024)
        build_policy(settings, shape)  # a worker builds its own from the same value
    assert seen == Counter(resolve_method=1)
    assert policy.scorer.upkeep_every == 16 and dict(settings.knobs) == {"upkeep_every": 16}


def test_a_resolved_value_says_what_ran_and_compares_by_its_setting() -> None:
    preset = reasonkv.resolve_method("beaconkv-int4", 64)
    assert (preset.name, preset.method, preset.budget) == ("beaconkv-int4", "beaconkv", 64)
    assert preset.knobs["kv_bits"] == 4 and preset.policy.kv_format.kv_bits == 4
    assert preset == reasonkv.resolve_method("beaconkv-int4", 64)
    assert preset != reasonkv.resolve_method("beaconkv-int4", 96)
    with pytest.raises(TypeError):
        preset.knobs["kv_bits"] = 8  # type: ignore[index]
    again = pickle.loads(pickle.dumps(preset))  # another process resolves it again
    assert again == preset and again.policy is not preset.policy and again.policy.kv_format.kv_bits == 4
    full = reasonkv.resolve_method("full", 512)
    assert full.budget is None and not full.compresses


def test_make_cache_refuses_knobs_beside_a_resolved_value() -> None:
    with pytest.raises(TypeError, match="put them in resolve_method"):
        reasonkv.make_cache(tiny_llama("sdpa"), reasonkv.resolve_method("snapkv", 32), window=4)


def test_resolving_refuses_in_one_line_before_any_model() -> None:
    with pytest.raises(ValueError, match="unknown method 'nope'"):
        reasonkv.resolve_method("nope", 64)
    with pytest.raises(ValueError, match="a method is named by a string"):
        reasonkv.resolve_method(None, 64)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="below the protected window"):
        reasonkv.resolve_method("snapkv", 4)
    with pytest.raises(ValueError, match="beacon_min < beacon_max"):
        reasonkv.resolve_method("beaconkv", 64, {"beacon_min": 32, "beacon_max": 16})


def test_the_runs_of_replay_bench_and_analyze_resolve_once_each() -> None:
    """`build_runs` (replay, bench, analyze): the knobs are shared out once (once more for an
    entry with knobs of its own), each (method, budget) is resolved once, `full` once whatever
    the budgets, and the runs' caches resolve nothing again. A record's knobs spell out the
    group size of a quantized run, and its resolved value says the same."""
    from reasonkv.cli.common import build_runs

    with entries() as seen:
        runs = build_runs(["snapkv", "h2o:kv_bits=4", "full"], [16, 32], {"window": 4})
        for run in runs[:2] + runs[-1:]:  # the tiny model's head dim is below h2o's group size
            reasonkv.make_cache(tiny_llama("sdpa"), run.resolved)
    assert seen == Counter(share_knobs=2, resolve_method=5)
    assert [r.label for r in runs] == [
        "snapkv@16",
        "snapkv@32",
        "h2o:kv_bits=4@16",
        "h2o:kv_bits=4@32",
        "full",
    ]
    h2o = runs[2]
    assert h2o.knobs == dict(h2o.resolved.knobs) == {"kv_bits": 4, "group_size": 32}
    assert runs[0].knobs == {"window": 4} and runs[0].resolved == reasonkv.resolve_method(
        "snapkv", 16, {"window": 4}
    )


def tiny_sweep_loader(name: str, attn_implementation: str = "sdpa", device: str = "cpu", dtype=torch.float32):
    """A sweep's model loader here: a tiny random Llama and a char tokenizer."""
    return tiny_llama(attn_implementation).to(device=device, dtype=dtype), CharTokenizer()


@pytest.mark.parametrize("kind", ["replay", "eval"])
def test_a_sweep_resolves_each_run_once_when_its_grid_loads(tmp_path, kind: str) -> None:
    """A grid shares its knobs out once and resolves each (method, budget) once, `full` once;
    its units run (in this process) on those values. A budget below a method's protected window
    is resolved once too, and fails its units alone."""
    rows = [
        {"id": i, "problem": f"What is {i}+{i}?", "trace": "add them up, " * 6, "answer": str(2 * i)}
        for i in (1, 2)
    ]
    (tmp_path / "items.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    source = {"traces": "items.jsonl"} if kind == "replay" else {"dataset": "items.jsonl"}
    limits = {"max_tokens": 60} if kind == "replay" else {"max_new_tokens": 6}
    data = {
        "kind": kind,
        "models": ["tiny"],
        "methods": ["full", "snapkv", "h2o"],
        "budgets": [4, 16, 24],
        "settings": {"loader": "test_resolved_once:tiny_sweep_loader", **limits},
        "knobs": {"window": 4, "h2o": {"recent_ratio": 0.25}},
        "datasets": [source],
    }
    with entries() as seen:
        stats = sweep.run_sweep(sweep.parse_grid(data, tmp_path), tmp_path / "out.jsonl", threads=1)
    assert seen == Counter(share_knobs=1, resolve_method=1 + 3 + 3)
    records = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    failed = {(r["config"]["method"], r["config"]["budget"]) for r in records if r["status"] == "error"}
    assert failed == {("snapkv", 4)} and stats.failed == 2 and stats.ok == 2 * 6
