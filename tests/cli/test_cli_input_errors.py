"""Bad input files and arguments end as one line that names the file and line (or the option
and what it takes), exit code 2 and no traceback, in every command that reads them."""

from __future__ import annotations

import json

import pytest

from cli_helpers import WIDE, errors_of, runner, tiny_llama
from reasonkv.cli import analyze as analyze_cli
from reasonkv.cli import main as cli
from reasonkv.cli import replay as replay_cli
from reasonkv.methods.profiles import config_hash

GOOD = {"id": "t0", "problem": "What is 2+2?", "trace": "Let me think step by step. " * 4}
BAD_ROWS = {
    "null": ("null", "traces.jsonl:2: each trace row must be a JSON object ({...}), got null"),
    "number": ("3", "traces.jsonl:2: each trace row must be a JSON object ({...}), got a number"),
    "string": ('"x"', "traces.jsonl:2: each trace row must be a JSON object ({...}), got a string"),
    "list": ("[1, 2]", "traces.jsonl:2: each trace row must be a JSON object ({...}), got a list"),
    "cut": (json.dumps(GOOD)[:-2], "traces.jsonl:2: not JSON (Unterminated string starting at column"),
    "problem-null": (
        json.dumps({**GOOD, "problem": None}),
        "traces.jsonl:2: `problem` must be a string, got null",
    ),
    "surrogate": (json.dumps({**GOOD, "trace": "a\udcffb"}), "traces.jsonl:2: `trace` is not UTF-8 text"),
}


@pytest.fixture
def no_model(monkeypatch, no_loading):
    """Also replay's and analyze's loader: every error here comes before a model loads."""

    def load(*args, **kwargs):
        raise AssertionError("the model was loaded although the input was invalid")

    monkeypatch.setattr(replay_cli, "load_model", load)
    monkeypatch.setattr(analyze_cli, "load_model", load)


def one_line_error(result, message: str) -> str:
    err = errors_of(result)
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output and len(err.strip().splitlines()) == 1, err
    assert message in err, err
    return err


def command_args(command: str, traces, tmp_path) -> list[str]:
    if command == "sweep":
        grid = tmp_path / "grid.toml"
        grid.write_text(
            'kind = "replay"\nmodels = ["tiny"]\nmethods = ["snapkv"]\nbudgets = [16]\n'
            f'[[datasets]]\ntraces = "{traces}"\nvariant = "all"\n'
        )
        return ["sweep", str(grid), "--out", str(tmp_path / "out.jsonl")]
    out = ["--out", str(tmp_path / "out")]
    return [command, "--traces", str(traces), *out, "--variant", "all"]


@pytest.mark.parametrize("command", ["replay", "profile", "analyze", "sweep"])
@pytest.mark.parametrize("bad", list(BAD_ROWS))
def test_a_bad_trace_row_names_the_file_and_line(tmp_path, no_model, command, bad) -> None:
    line, message = BAD_ROWS[bad]
    traces = tmp_path / "traces.jsonl"
    traces.write_text(json.dumps(GOOD) + "\n" + line + "\n")
    result = runner.invoke(cli.app, command_args(command, traces, tmp_path), env=WIDE)
    assert str(traces) in one_line_error(result, message)


@pytest.mark.parametrize("command", ["replay", "sweep"])
def test_a_trace_file_that_is_binary_or_a_folder_is_named(tmp_path, no_model, command) -> None:
    traces = tmp_path / "traces.jsonl"
    traces.write_bytes(json.dumps(GOOD).encode() + b"\n\x89PNG\xff\n")
    result = runner.invoke(cli.app, command_args(command, traces, tmp_path), env=WIDE)
    one_line_error(result, "traces.jsonl:2: not UTF-8 text (byte 0x89")
    result = runner.invoke(cli.app, command_args(command, tmp_path, tmp_path), env=WIDE)
    one_line_error(result, "cannot read it")


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("null", "problems.jsonl:2: each problem row must be a JSON object ({...}), got null"),
        ('{"id": 1}', "problems.jsonl:2: each row needs a `problem` field"),
        ('{"problem": 7}', "problems.jsonl:2: `problem` must be a string, got a number"),
    ],
)
def test_profile_generate_names_the_bad_problem_line(tmp_path, no_model, line, message) -> None:
    problems = tmp_path / "problems.jsonl"
    problems.write_text('{"problem": "What is 1+1?"}\n' + line + "\n")
    args = ["profile", "--generate", "--traces", str(problems), "--out", str(tmp_path / "p.json")]
    one_line_error(runner.invoke(cli.app, args, env=WIDE), message)


# ------------------------------------------------------------------ profile files
PROFILE_CASES = [
    ("3", "a profile must be a JSON object ({...}), got a number"),
    ('{"config_hash": "HASH", "demand": null}', "`demand` must be a non-empty list of numbers"),
    (
        '{"config_hash": "HASH", "demand": [NaN, 1.0]}',
        "`demand` of layer 0 must be a finite number >= 0, got nan",
    ),
    (
        '{"config_hash": "HASH", "demand": [1.0, -2.0]}',
        "`demand` of layer 1 must be a finite number >= 0, got -2.0",
    ),
    ('{"config_hash": "HASH", "demand": [0, 0]}', "`demand` is zero on every layer"),
    (
        '{"config_hash": "HASH", "demand": [1, 2, 3]}',
        "`demand` has 3 values, one per layer, but the model has 2",
    ),
    ('{"config_hash": "HASH", "demand": [0.5, 0.', "wave.json:1: not JSON (Expecting"),
]


@pytest.mark.parametrize(("text", "message"), PROFILE_CASES)
def test_generate_names_the_bad_profile_file(tmp_path, fake_loader, text, message) -> None:
    profile = tmp_path / "wave.json"
    profile.write_text(text.replace("HASH", config_hash(tiny_llama().config)))
    args = ["generate", "-m", "reasonalloc-layer-rkv", "-b", "16", "--profile", str(profile), "hi"]
    err = one_line_error(runner.invoke(cli.app, args, env=WIDE), message)
    assert str(profile) in err


@pytest.mark.parametrize(("text", "message"), PROFILE_CASES[:5] + PROFILE_CASES[6:])
def test_a_bad_profile_is_refused_before_the_model_loads(tmp_path, no_model, text, message) -> None:
    """Only the layer count needs the model; the rest of a profile is read with the knobs."""
    profile = tmp_path / "wave.json"
    profile.write_text(text.replace("HASH", "x"))
    args = ["generate", "-m", "reasonalloc-layer-rkv", "-b", "16", "--profile", str(profile), "hi"]
    assert str(profile) in one_line_error(runner.invoke(cli.app, args, env=WIDE), message)
    traces = tmp_path / "traces.jsonl"
    traces.write_text(json.dumps(GOOD) + "\n")
    args = ["replay", "--traces", str(traces), "--variant", "all", "-m", "reasonalloc-rkv"]
    args += ["--set", f"profile={profile}"]
    assert str(profile) in one_line_error(runner.invoke(cli.app, args, env=WIDE), message)


@pytest.mark.parametrize(("text", "message"), PROFILE_CASES[:5])
def test_plot_wave_names_the_bad_profile_file(tmp_path, text, message) -> None:
    profile = tmp_path / "wave.json"
    profile.write_text(text)
    args = ["plot", "wave", str(profile), "--out", str(tmp_path / "w.png")]
    assert str(profile) in one_line_error(runner.invoke(cli.app, args, env=WIDE), message)
    profile.write_bytes(b"\x89PNG\r\n\x1a\n\x00")
    one_line_error(runner.invoke(cli.app, args, env=WIDE), "wave.json: not UTF-8 text")


# ------------------------------------------------------------------ arguments
def test_a_budget_too_large_for_the_cache_names_the_option_and_the_range(tmp_path, no_model) -> None:
    huge = str(10**30)  # a budget this large would overflow the budget tensors
    one_line_error(
        runner.invoke(cli.app, ["generate", "-b", huge, "hi"], env=WIDE),
        "budget must be a positive number of tokens per KV head (at most 10^9)",
    )
    traces = tmp_path / "traces.jsonl"
    traces.write_text(json.dumps(GOOD) + "\n")
    args = ["replay", "--traces", str(traces), "--variant", "all", "--budgets", f"64,{huge}"]
    one_line_error(
        runner.invoke(cli.app, args, env=WIDE),
        f"--budgets takes at most 1000000000 tokens per KV head, got {huge}",
    )
    args = ["analyze", "--traces", str(traces), "--out", str(tmp_path / "a"), "--budget", huge]
    one_line_error(runner.invoke(cli.app, args, env=WIDE), "budget must be a positive number")


def test_generate_refuses_an_empty_prompt_and_a_prompt_that_is_not_utf8(no_loading) -> None:
    for args in (["generate", "--raw", ""], ["generate", ""]):  # no tokens to start from
        one_line_error(runner.invoke(cli.app, args, env=WIDE), "the prompt is empty")
    # An undecodable byte on the command line reaches Python as a lone surrogate.
    result = runner.invoke(cli.app, ["generate", "ab\udcff"], env=WIDE)
    one_line_error(result, "the prompt is not UTF-8 text (byte 0xff at character 3)")


# ------------------------------------------------------------------ model paths
@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("./no-such-dir", "no model at ./no-such-dir: the path does not exist"),
        ("SUB/missing", "SUB/missing: the path does not exist"),
        ("SUB/missing.gguf", "no GGUF file at"),
        ("SUB", "has no config.json"),
        ("SUB/empty.gguf", "empty.gguf is empty"),
        ("SUB/random.gguf", "random.gguf is not a GGUF file (it does not start with the GGUF magic bytes)"),
        ("SUB/notes.txt", "notes.txt is neither a GGUF file nor a model folder"),
    ],
)
def test_a_local_model_path_that_holds_no_model_is_named(tmp_path, monkeypatch, name, message) -> None:
    monkeypatch.chdir(tmp_path)
    sub = tmp_path / "models"
    sub.mkdir()
    (sub / "empty.gguf").write_bytes(b"")
    (sub / "random.gguf").write_bytes(b"\x00" * 64)
    (sub / "notes.txt").write_text("hello")
    name = name.replace("SUB", "models")
    result = runner.invoke(cli.app, ["generate", "--model", name, "hi"], env=WIDE)
    err = one_line_error(result, message.replace("SUB", "models"))
    assert "hub" not in err and "sentencepiece" not in err


@pytest.mark.model
@pytest.mark.parametrize("size", [100, 3_000_000])
def test_a_truncated_gguf_file_is_named_as_truncated_or_corrupt(tmp_path, size) -> None:
    from reasonkv.core.models import bundled_gguf_path

    with bundled_gguf_path("smollm2-135m").open("rb") as f:
        head = f.read(size)
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(head)
    result = runner.invoke(cli.app, ["generate", "--model", str(cut), "hi"], env=WIDE)
    one_line_error(result, f"GGUF file {cut} is truncated or corrupt (")


def test_plot_reads_a_bare_profile_and_names_a_bad_run_file(tmp_path) -> None:
    profile, png = tmp_path / "wave.json", tmp_path / "w.png"
    profile.write_text('{"config_hash": "x", "demand": [0.2, 0.9, 0.5]}')  # no per-trace curves
    result = runner.invoke(cli.app, ["plot", "wave", str(profile), "--out", str(png)], env=WIDE)
    assert result.exit_code == 0, result.output
    run = tmp_path / "run.json"
    for text, message in (
        ("null", "a run record must be a JSON object"),
        ('{"events": [', "run.json:1: not JSON"),
    ):
        run.write_text(text)
        args = ["plot", "budgets", str(run), "--out", str(png)]
        one_line_error(runner.invoke(cli.app, args, env=WIDE), message)
