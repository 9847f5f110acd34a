"""The `reasonkv` command line and the demo, on a tiny random Llama (no real model load)."""

from __future__ import annotations

import importlib.metadata
import io
import os

import pytest
import torch
from rich.console import Console

import reasonkv
from cli_helpers import WIDE, CharTokenizer, errors_of, runner, tiny_llama
from reasonkv.cli import common
from reasonkv.cli import generate as generate_cli
from reasonkv.cli import main as cli
from reasonkv.core.policy import StreamingScorer
from reasonkv.core.policy.schedules import MaxMinThreshold
from reasonkv.harness import demo
from reasonkv.methods.knobs import KnobError, check_knobs
from reasonkv.methods.registry import METHODS, MethodSpec
from reasonkv.util import runtime


# ---------------------------------------------------------------- version
def _installed(name: str) -> bool:
    try:
        importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


@pytest.mark.skipif(
    not _installed("reasonkv"),
    reason="reasonkv is not installed (run from the source tree, PYTHONPATH=src): no version to compare",
)
def test_version_is_the_installed_packages():
    from importlib import metadata

    result = runner.invoke(cli.app, ["--version"])
    assert result.exit_code == 0, result.output
    assert result.output.strip() == f"reasonkv {metadata.version('reasonkv')}"
    assert reasonkv.__version__ == metadata.version("reasonkv")


def test_help_wraps_sentences_where_the_terminal_ends_not_where_the_source_did():
    assert cli.flowed_help("First line\n    goes on.\n\n    Second paragraph\n    here.") == (
        "First line goes on.\n\nSecond paragraph here."
    )
    result = runner.invoke(cli.app, ["--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0
    # analyze's docstring breaks after "look far"; at 200 columns the sentence is one line.
    assert any("which queries look far back, what they read" in line for line in result.output.splitlines())


# ---------------------------------------------------------------- methods
def test_methods_lists_every_registered_method():
    result = runner.invoke(cli.app, ["methods"], env=WIDE)
    assert result.exit_code == 0, result.output
    for name in METHODS:
        assert name in result.output
    assert "buffer(every 128)" in result.output  # snapkv's schedule with its default interval


def test_methods_picks_up_a_method_registered_later(monkeypatch):
    spec = MethodSpec(
        "beacon-test-only", "a method added after the CLI was written", "-", StreamingScorer, MaxMinThreshold
    )
    monkeypatch.setitem(METHODS, spec.name, spec)
    result = runner.invoke(cli.app, ["methods"], env=WIDE)
    assert result.exit_code == 0
    assert "beacon-test-only" in result.output
    assert "fraction=0.125" in result.output


# ------------------------------------------------------------- knob parsing
@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("16", 16),
        ("-3", -3),
        ("0.25", 0.25),
        ("1e-3", 1e-3),
        ("true", True),
        ("False", False),
        ("none", None),
        ("avg", "avg"),
        ("max_logit", "max_logit"),
    ],
)
def test_set_values_are_auto_typed(text, value):
    parsed = common.parse_value(text)
    assert parsed == value and type(parsed) is type(value)


def test_set_items_become_a_dict_later_items_win():
    assert common.parse_sets(["window=16", "pooling=avg", "window=4", "note=a=b"]) == {
        "window": 4,
        "pooling": "avg",
        "note": "a=b",
    }
    assert common.parse_sets(None) == {}


@pytest.mark.parametrize("item", ["window", "=3", ""])
def test_set_without_key_value_is_refused(item):
    with pytest.raises(common.CliError, match="key=value"):
        common.parse_sets([item])


def test_number_lists_keep_first_occurrences_and_name_the_option():
    assert common.split_list(" a, b,,c ", "--x") == ["a", "b", "c"]
    assert common.positive_ints("64, 128,64,8", "--budgets", "tokens") == [64, 128, 8]
    for text, message in [
        (" , ", "--budgets takes a comma-separated list, got ' , '"),
        ("64,1.5", "--budgets takes positive integers (tokens), got '1.5'"),
        ("64,-3", "--budgets takes positive integers (tokens), got -3"),
    ]:
        with pytest.raises(common.CliError) as err:
            common.positive_ints(text, "--budgets", "tokens")
        assert str(err.value) == message


def test_knobs_are_checked_against_the_defaults_types():
    snapkv = METHODS["snapkv"]
    assert check_knobs(snapkv, {"window": 4, "pooling": "avg", "protect_prompt": True}) == {
        "window": 4,
        "pooling": "avg",
        "protect_prompt": True,
    }
    with pytest.raises(KnobError, match="'window' of 'snapkv' expects an integer"):
        check_knobs(snapkv, {"window": 2.5})
    with pytest.raises(KnobError, match="expects true or false"):
        check_knobs(snapkv, {"protect_prompt": 1})
    with pytest.raises(KnobError, match="expects one of max, avg, none"):
        check_knobs(snapkv, {"pooling": "median"})
    with pytest.raises(KnobError, match=r"unknown parameter\(s\) nope"):
        check_knobs(snapkv, {"nope": 1})
    ratio = check_knobs(METHODS["h2o"], {"recent_ratio": 1})["recent_ratio"]
    assert ratio == 1.0 and isinstance(ratio, float)
    threshold = MethodSpec("t", "", "", StreamingScorer, MaxMinThreshold)
    with pytest.raises(KnobError, match=r"parameter 'fraction' of 't' must be in \(0, 1\), got 1.0"):
        check_knobs(threshold, {"fraction": 1})


# ----------------------------------------------------------------- errors
@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--method", "nope"], "unknown method 'nope'"),
        (["--set", "nope=1"], "unknown parameter(s) nope"),
        (["--set", "window"], "--set takes key=value"),
        (["--set", "kernel=wide"], "'kernel' of 'snapkv' expects an integer"),
        (["--budget", "0"], "budget must be a positive number"),
        (["--attn", "flash"], "--attn must be sdpa or eager"),
    ],
)
def test_bad_arguments_exit_2_with_one_clean_line(no_loading, args, message):
    result = runner.invoke(cli.app, ["generate", *args, "What is 17*23?"], env=WIDE)
    assert result.exit_code == 2
    err = errors_of(result)
    assert message in err
    assert "Traceback" not in result.output and len(err.strip().splitlines()) == 1


def test_missing_model_exits_2_and_says_what_it_looked_for():
    result = runner.invoke(cli.app, ["generate", "--model", "no-such-model", "hi"], env=WIDE)
    assert result.exit_code == 2
    assert "'no-such-model' is neither a bundled name" in errors_of(result)


def test_budget_below_protected_window_is_a_clean_error(fake_loader):
    # Only make_cache (after loading) knows the protected window: snapkv protects 8 recent tokens.
    result = runner.invoke(cli.app, ["generate", "--budget", "4", "hi"], env=WIDE)
    assert result.exit_code == 2
    assert "below the protected window" in errors_of(result)


# --------------------------------------------------------------- generate
def test_generate_passes_method_budget_and_knobs_to_the_cache(fake_loader, monkeypatch):
    made = []

    def spy_make_cache(model, resolved):
        cache = reasonkv.make_cache(model, resolved)
        made.append((resolved.name, resolved.budget, dict(resolved.knobs), cache))
        return cache

    monkeypatch.setattr(generate_cli, "make_cache", spy_make_cache)
    prompt = "a prompt of some forty characters, or so"
    args = [
        "generate",
        "--method",
        "snapkv",
        "--budget",
        "16",
        "--max-new-tokens",
        "30",
        "--set",
        "window=4",
        "--set",
        "interval=8",
        "--attn",
        "eager",
        prompt,
    ]
    result = runner.invoke(cli.app, args, env=WIDE)
    assert result.exit_code == 0, result.output
    assert fake_loader[0]["attn_implementation"] == "eager"
    method, budget, knobs, cache = made[0]
    assert (method, budget, knobs) == ("snapkv", 16, {"window": 4, "interval": 8})
    assert cache.policy.scorer.window == 4 and cache.policy.schedule.interval == 8
    # 40 prompt + 29 fed tokens = 69 seen: compressions at 24, 32, ... so heads stay under 16 + 8.
    mem = cache.memory()
    assert mem["seen_tokens"] == len(prompt) + 30 - 1
    assert int(mem["live_tokens"].max()) < 16 + 8
    assert len(cache.events) > 0

    # The printed text is exactly what the library produces with the same settings.
    model = tiny_llama("eager")
    same = reasonkv.make_cache(model, "snapkv", 16, window=4, interval=8)
    texts, _ = reasonkv.generate(
        model, CharTokenizer(), prompt, cache=same, max_new_tokens=30, do_sample=False
    )
    lines = result.stdout.splitlines()
    assert lines[0] == texts[0]
    assert "30 new tokens" in result.stdout
    assert f"seen {mem['seen_tokens']}" in result.stdout


def test_generate_with_the_full_cache_never_compresses(fake_loader):
    result = runner.invoke(cli.app, ["generate", "--method", "full", "-n", "12", "hello there"], env=WIDE)
    assert result.exit_code == 0, result.output
    assert "budget=-" in result.stdout and "compressions/layer 0" in result.stdout


def test_sampling_is_reproducible_with_a_seed(fake_loader):
    args = [
        "generate",
        "--method",
        "streaming",
        "--budget",
        "12",
        "-n",
        "20",
        "--sample",
        "--temperature",
        "1.5",
        "--seed",
        "7",
        "hello sampling",
    ]
    first = runner.invoke(cli.app, args, env=WIDE)
    second = runner.invoke(cli.app, args, env=WIDE)
    assert first.exit_code == 0 and second.exit_code == 0, first.output
    assert first.stdout.splitlines()[0] == second.stdout.splitlines()[0]


# ------------------------------------------------------------------- demo
def test_first_divergence():
    assert demo.first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert demo.first_divergence([1, 2, 3], [1, 5, 3]) == 1
    assert demo.first_divergence([1, 2, 3], [1, 2]) == 2
    assert demo.first_divergence([], [4]) == 0


def test_demo_on_a_tiny_model_shrinks_the_cache(fake_loader):
    out = io.StringIO()
    runs = demo.run_demo(model="tiny", budget=16, max_new_tokens=40, console=Console(file=out, width=120))
    assert [r.method for r in runs] == ["full", "snapkv", "streaming"]
    full, snapkv, streaming = runs
    assert all(r.n_tokens == 40 for r in runs)
    assert full.memory["compressions"] == 0
    # streaming compresses after every step back to the budget: exactly 16 live tokens per head.
    assert streaming.memory["live_mean"] == 16.0
    assert snapkv.memory["compressions"] > 0 and snapkv.memory["live_mean"] <= 16 + 128
    assert streaming.memory["kv_bytes"] < full.memory["kv_bytes"]
    text = out.getvalue()
    for name in ("full", "snapkv", "streaming", "reference", "evictions"):
        assert name in text


def test_demo_with_a_budget_above_the_sequence_is_identical_to_full(fake_loader):
    out = io.StringIO()
    runs = demo.run_demo(
        model="tiny",
        budget=4096,
        max_new_tokens=12,
        methods=("snapkv",),
        console=Console(file=out, width=120),
    )
    assert runs[1].tokens == runs[0].tokens
    assert "identical" in out.getvalue()


def test_demo_refuses_an_unknown_method_before_loading(no_loading):
    with pytest.raises(ValueError, match="unknown method"):
        demo.run_demo(methods=("nope",))


def test_thread_count_defaults_to_at_most_four_and_obeys_the_environment(monkeypatch):
    before = torch.get_num_threads()
    try:
        monkeypatch.delenv("REASONKV_THREADS", raising=False)
        assert runtime.set_threads() == min(4, os.cpu_count() or 1) == torch.get_num_threads()
        monkeypatch.setenv("REASONKV_THREADS", "1")
        assert runtime.set_threads() == 1 == torch.get_num_threads()
    finally:
        torch.set_num_threads(before)


def test_demo_command_runs_and_reports_errors_cleanly(fake_loader):
    result = runner.invoke(cli.app, ["demo", "--model", "tiny", "--budget", "16", "-n", "20"], env=WIDE)
    assert result.exit_code == 0, result.output
    assert fake_loader[0]["name"] == "tiny"
    assert "streaming" in result.stdout and "diverges" in result.stdout
    bad = runner.invoke(cli.app, ["demo", "--budget", "0"], env=WIDE)
    assert bad.exit_code == 2 and "budget must be a positive number" in errors_of(bad)
    assert len(fake_loader) == 1  # the bad budget never reached the loader
