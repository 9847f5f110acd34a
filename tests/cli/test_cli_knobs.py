"""Bad knobs and budgets on the command line: exit 2 with one line and no traceback, before the
model loads (the same check as make_cache's), and never a hang."""

from __future__ import annotations

import pytest

from cli_helpers import WIDE, errors_of, runner
from method_helpers import time_limit
from reasonkv.cli import common
from reasonkv.cli import main as cli
from reasonkv.methods.knobs import KnobError


def one_clean_line(result) -> str:
    assert result.exit_code == 2, result.output
    err = errors_of(result)
    assert "Traceback" not in result.output and len(err.strip().splitlines()) == 1, err
    return err


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--method", "beaconkv", "--budget", "32", "--set", "fraction=1.0"],
            "parameter 'fraction' of 'beaconkv' must be in (0, 1), got 1.0",
        ),
        (["--method", "reasonalloc-beaconkv", "--set", "fraction=1"], "must be in (0, 1), got 1.0"),
        (["--method", "reasonalloc-rkv", "--set", "tau=0"], "'tau' of 'reasonalloc-rkv' must be > 0"),
        (["--set", "interval=0"], "parameter 'interval' of 'snapkv' must be in [1, 10^9], got 0"),
        (["--set", "kernel=0"], "parameter 'kernel' of 'snapkv' must be in [1, 1024], got 0"),
        (["--set", "n_recent=-1"], "parameter 'n_recent' of 'snapkv' must be in [0, 10^9], got -1"),
        (["--method", "h2o", "--set", "recent_ratio=1.5"], "'recent_ratio' of 'h2o' must be in [0, 1]"),
        (["--method", "beaconkv", "--set", "beacon_min=40"], "do not fit together"),
        (["--method", "rpc", "--set", "interval=abc"], "'interval' of 'rpc' expects an integer, got 'abc'"),
        (["--budget", "4"], "budget 4 is below the protected window"),
        (["--method", "beaconkv", "--budget", "20"], "budget 20 is below the protected window"),
        (["--budget", "1" + "0" * 30], "budget must be a positive number of tokens per KV head"),
        (["--budget", "-3"], "budget must be a positive number of tokens per KV head"),
    ],
)
def test_bad_knobs_and_budgets_exit_2_before_loading(no_loading, args, message) -> None:
    with time_limit(30):
        result = runner.invoke(cli.app, ["generate", *args, "hi"], env=WIDE)
    assert message in one_clean_line(result)


def test_a_budget_that_is_not_an_integer_is_a_usage_error() -> None:
    result = runner.invoke(cli.app, ["generate", "--budget", "1e30", "hi"], env=WIDE)
    assert result.exit_code == 2 and "Traceback" not in result.output


def test_runs_for_replay_and_bench_refuse_a_budget_below_the_window_before_loading() -> None:
    with pytest.raises(KnobError, match="budget 4 is below the protected window: method 'snapkv'"):
        common.build_runs(["full", "snapkv"], [64, 4], {})
    with pytest.raises(KnobError, match="budget must be a positive number"):
        common.build_runs(["snapkv"], [10**30], {})
    runs = common.build_runs(["full", "streaming"], [5], {})  # streaming protects 4 + 1
    assert [(r.method, r.budget) for r in runs] == [("full", None), ("streaming", 5)]


def test_a_method_entry_with_its_own_knobs_runs_beside_the_plain_method() -> None:
    runs = common.build_runs(["snapkv", "snapkv:kv_bits=4:group_size=32", "quant-int2"], [64], {"window": 16})
    assert [r.label for r in runs] == ["snapkv@64", "snapkv:kv_bits=4:group_size=32@64", "quant-int2"]
    plain, quantized, quant = runs
    assert plain.knobs == {"window": 16}  # --set goes to both settings of snapkv
    assert quantized.knobs == {"window": 16, "kv_bits": 4, "group_size": 32}
    # quant-int2 has no window (--set skips it); a unit stored below 16 bits records its group
    assert quant.knobs == {"group_size": 32}
    with pytest.raises(KnobError, match="kv_bits"):
        common.build_runs(["snapkv:kv_bits=3"], [64], {})
    with pytest.raises(KnobError, match="no_such_knob"):
        common.build_runs(["snapkv:no_such_knob=1"], [64], {})
    with pytest.raises(common.CliError, match="method:key=value"):
        common.build_runs(["snapkv:kv_bits"], [64], {})
    assert len(common.build_runs(["snapkv:kv_bits=4", "snapkv:kv_bits=4"], [64], {})) == 1
    # A method that never compresses takes storage knobs only: anything else is refused, not dropped.
    with pytest.raises(common.CliError, match="does not use kv_bit"):
        common.build_runs(["full:kv_bit=4"], [64], {})
    with pytest.raises(common.CliError, match="does not use window"):
        common.build_runs(["full:window=8"], [64], {})
    assert common.build_runs(["full:kv_bits=4"], [64], {})[0].knobs == {"kv_bits": 4, "group_size": 32}


def test_replay_with_a_bad_knob_exits_2_in_one_line(tmp_path) -> None:
    traces = tmp_path / "t.jsonl"
    traces.write_text("")
    result = runner.invoke(
        cli.app, ["replay", "--traces", str(traces), "--methods", "beaconkv", "--set", "fraction=2"], env=WIDE
    )
    assert "parameter 'fraction' of 'beaconkv' must be in (0, 1), got 2.0" in one_clean_line(result)


def test_methods_lists_each_knob_with_its_range() -> None:
    result = runner.invoke(cli.app, ["methods"], env={"COLUMNS": "400"})
    assert result.exit_code == 0, result.output
    for text in ("fraction=0.125 (0,1)", "kernel=7 [1,1024]", "tau=1.0 (>0)", "pooling=max {max|avg|none}"):
        assert text in result.output


STORAGE_ARGS = ["--set", "kv_bits=4", "--set", "group_size=16"]
NOTHING = "kv_bits=4 quantizes nothing at budget 8: a head of 'streaming' holds at most 8 tokens here"


def test_generate_refuses_storage_that_quantizes_nothing_in_one_line_before_generating(
    fake_loader, monkeypatch
) -> None:
    from reasonkv.cli import generate as generate_cli

    def generate(*args, **kwargs):
        raise AssertionError("generated although the cache was refused")

    monkeypatch.setattr(generate_cli, "generate_text", generate)
    args = ["generate", "-m", "streaming", "-b", "8", *STORAGE_ARGS, "hi"]
    err = one_clean_line(runner.invoke(cli.app, args, env=WIDE))
    assert NOTHING in err and "residual=2, the default at budget 8) only at 18" in err
    assert len(fake_loader) == 1  # the budget's check needs the model's shape: after it loads


def test_replay_refuses_storage_that_quantizes_nothing_in_one_line_before_replaying(
    tmp_path, monkeypatch
) -> None:
    from cli_helpers import CharTokenizer, tiny_llama
    from reasonkv.cli import replay as replay_cli

    monkeypatch.setattr(replay_cli, "load_model", lambda name, **kwargs: (tiny_llama(), CharTokenizer()))
    monkeypatch.setattr(
        replay_cli, "load_tokenizer_and_config", lambda name: (CharTokenizer(), tiny_llama().config)
    )
    monkeypatch.setattr(replay_cli, "replay_batch", None)  # a replay would fail on this, not in one line
    traces = tmp_path / "t.jsonl"
    traces.write_text('{"id": "t0", "problem": "2+2?", "trace": "' + "four. " * 8 + '"}\n')
    args = ["replay", "--traces", str(traces), "--variant", "all", "--methods", "streaming", "--budgets", "8"]
    result = runner.invoke(cli.app, [*args, *STORAGE_ARGS, "--out", str(tmp_path / "r.json")], env=WIDE)
    assert NOTHING in one_clean_line(result)
    assert not (tmp_path / "r.json").exists()


def test_runs_without_budgets_are_the_methods_that_never_compress() -> None:
    """No budgets (an API caller's list; the CLI refuses an empty one): a compressing method has
    no run, one that never compresses runs once, as it does beside budgets."""
    assert common.build_runs(["snapkv"], [], {}) == []
    assert [r.label for r in common.build_runs(["snapkv", "full", "quant-int4"], [], {})] == [
        "full",
        "quant-int4",
    ]
